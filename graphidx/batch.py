"""StepBatch: one scheduler step, the library's input (docs/contract.md section 3.1).

A step carries two host tensors the planner reads freely (`query_start_loc_cpu`,
`seq_lens_upper_bound`) and three device tensors it must never read back (`query_start_loc`,
`seq_lens`, `block_table`). Construction validates everything, device values included, and
raises `ValueError` naming the field, the request and the value; hot paths that already
validated pass `validate=False` and pay for no device read.

Padding requests (docs/contract.md section 3.2a). A batch told `num_real_reqs` treats the
requests after the first `num_real_reqs` as padding and accepts each in one of the shapes
serving runtimes write:

  - "zero":   0 query rows, `seq_len` 0 (vLLM's usual FULL-graph padding; block row 0),
  - "arange": `next_n` query rows, `seq_len` 0 (vLLM's `query_start_loc = arange(., next_n)`
              form, so `seq_len < query_len`, which a real request may never have),
  - "fill1":  1 query row, `seq_len` 1, its one used page (when `1 // R` sees an entry) the
              reserved page 0 (SGLang's seq-len fill value).

The block row of a zero-length padding request is never read and not checked (runtimes may
leave a stale row there). Padding requests must produce row ends of 0 and read no page; the
planner does that when it is given `num_real_reqs` (`build_decode_rows`). The arange and fill1
forms have query rows, so they must be planned as decode rows: they may not follow a real
prefill request (a step with prefills may carry zero-row padding only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass

import numpy as np
import torch

from graphidx.config import IndexerConfig, cdiv

_DEVICE_FIELDS = ("query_start_loc", "seq_lens", "block_table")
_HOST_FIELDS = ("query_start_loc_cpu", "seq_lens_upper_bound")

PADDING_FORMS = ("zero", "arange", "fill1")
"""The padding-request shapes `StepBatch` accepts after its real requests (module docstring)."""


@dataclass(frozen=True, eq=False, repr=False)
class StepBatch:
    """One step: requests ordered decodes first, their rows concatenated.

    Host (CPU) tensors, int32:
      `query_start_loc_cpu` `[num_reqs + 1]`: row offsets, starting at 0, non-decreasing.
      `seq_lens_upper_bound` `[num_reqs]`: per request, >= the device `seq_lens` (the planner
      sizes launches from it; it may be stale-high, never low).
    Device tensors, int32, all on one device (CPU allowed):
      `query_start_loc` `[num_reqs + 1]` (equal to the host copy), `seq_lens` `[num_reqs]`
      (uncompressed tokens, the step's rows included), `block_table` `[num_reqs, max_blocks]`
      (page ids; a request of `seq_len` L uses its first `cdiv(L // R, page_entries)` columns).
    `num_tokens` (default `query_start_loc_cpu[-1]`) may exceed the real rows: the extra rows
    are graph padding. `num_pages` is the KV cache's page count (None skips the page-id check).
    `num_real_reqs` (default: every request) is how many leading requests are real; the rest
    are runtime padding requests, each one of `PADDING_FORMS` (module docstring). Real
    requests are validated exactly as in a batch without padding.
    """

    query_start_loc_cpu: torch.Tensor
    seq_lens_upper_bound: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    _: KW_ONLY
    config: IndexerConfig
    num_tokens: int = None  # type: ignore[assignment]  # None until __post_init__ fills it
    num_pages: int | None = None
    num_real_reqs: int = None  # type: ignore[assignment]  # None until __post_init__ fills it
    validate: InitVar[bool] = True

    def __post_init__(self, validate: bool) -> None:
        if validate:
            _validate_structure(self)
        if self.num_tokens is None:
            object.__setattr__(self, "num_tokens", int(self.query_start_loc_cpu[-1]))
        if self.num_real_reqs is None:
            object.__setattr__(self, "num_real_reqs", self.num_reqs)
        if validate:
            _validate_values(self)

    @property
    def num_reqs(self) -> int:
        return int(self.query_start_loc_cpu.shape[0]) - 1

    @property
    def num_padding_reqs(self) -> int:
        """Requests after the real ones (runtime padding, docs/contract.md section 3.2a)."""
        return self.num_reqs - self.num_real_reqs

    @property
    def num_real_tokens(self) -> int:
        """Query rows of the real requests: `query_start_loc_cpu[num_real_reqs]`."""
        return int(self.query_start_loc_cpu[self.num_real_reqs])

    def without_padding(self) -> StepBatch:
        """The real requests alone (views, not copies): the first `num_real_reqs` requests,
        `num_tokens` their rows. Not validated again (this batch was, or was trusted)."""
        n = self.num_real_reqs
        if n == self.num_reqs and self.num_tokens == self.num_real_tokens:
            return self
        return StepBatch(
            self.query_start_loc_cpu[: n + 1],
            self.seq_lens_upper_bound[:n],
            self.query_start_loc[: n + 1],
            self.seq_lens[:n],
            self.block_table[:n],
            config=self.config,
            num_tokens=self.num_real_tokens,
            num_pages=self.num_pages,
            validate=False,
        )

    @property
    def device(self) -> torch.device:
        """The device of the device tensors."""
        return self.seq_lens.device

    @functools.cached_property
    def query_lens_cpu(self) -> torch.Tensor:
        """Host int32 `[num_reqs]`: each request's query rows."""
        qsl = self.query_start_loc_cpu
        return qsl[1:] - qsl[:-1]

    def __repr__(self) -> str:
        return (
            f"StepBatch(num_reqs={self.num_reqs}, num_real_reqs={self.num_real_reqs}, "
            f"num_tokens={self.num_tokens}, "
            f"query_lens={self.query_lens_cpu.tolist()}, "
            f"seq_lens_upper_bound={self.seq_lens_upper_bound.tolist()}, "
            f"block_table={tuple(self.block_table.shape)}, device={self.device})"
        )

    @classmethod
    def from_lists(
        cls,
        config: IndexerConfig,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_table: torch.Tensor | None = None,
        *,
        num_tokens: int | None = None,
        num_pages: int | None = None,
        device: torch.device | str = "cpu",
        seq_lens_upper_bound: Sequence[int] | None = None,
        num_real_reqs: int | None = None,
    ) -> StepBatch:
        """A validated batch from per-request lists (tests, generators, the demo).

        Without `block_table`, request i gets the next `cdiv(seq_lens[i] // R, page_entries)`
        page ids in order (distinct pages, consecutive), rows padded with page 0 to the widest
        request (at least one column); a padding request (index >= `num_real_reqs`) gets a row
        of page 0. `seq_lens_upper_bound` defaults to `seq_lens`.
        """
        query_lens = [int(q) for q in query_lens]
        seq_lens = [int(s) for s in seq_lens]
        if len(query_lens) != len(seq_lens):
            raise ValueError(
                f"query_lens has {len(query_lens)} requests but seq_lens has {len(seq_lens)}"
            )
        upper = seq_lens if seq_lens_upper_bound is None else [int(u) for u in seq_lens_upper_bound]
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        if block_table is None:
            real = len(seq_lens) if num_real_reqs is None else num_real_reqs
            pages = [
                cdiv(max(s, 0) // config.compress_ratio, config.page_entries) if i < real else 0
                for i, s in enumerate(seq_lens)
            ]
            table = np.zeros((len(seq_lens), max([1, *pages])), dtype=np.int32)
            next_page = 0
            for i, n in enumerate(pages):
                table[i, :n] = np.arange(next_page, next_page + n)
                next_page += n
            block_table = torch.from_numpy(table)
        qsl_cpu = torch.from_numpy(qsl).to(torch.int32)
        return cls(
            qsl_cpu,
            torch.tensor(upper, dtype=torch.int32),
            qsl_cpu.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table.to(device),
            config=config,
            num_tokens=int(qsl[-1]) if num_tokens is None else num_tokens,
            num_pages=num_pages,
            num_real_reqs=len(query_lens) if num_real_reqs is None else num_real_reqs,
        )


def _fail(message: str) -> None:
    raise ValueError(message)


def _validate_structure(batch: StepBatch) -> None:
    """Types, dtypes, devices and shapes: everything checkable without reading values."""
    if not isinstance(batch.config, IndexerConfig):
        _fail(f"config must be an IndexerConfig, got {type(batch.config).__name__}")
    for name in _HOST_FIELDS + _DEVICE_FIELDS:
        value = getattr(batch, name)
        if not isinstance(value, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype != torch.int32:
            _fail(f"{name} must be int32, got {value.dtype}")
    for name in _HOST_FIELDS:
        device = getattr(batch, name).device
        if device.type != "cpu":
            _fail(f"{name} is a host tensor and must be on the CPU, got device {device}")
    device = batch.query_start_loc.device
    for name in _DEVICE_FIELDS[1:]:
        other = getattr(batch, name).device
        if other != device:
            _fail(
                f"{name} is on {other} but query_start_loc is on {device}: "
                "all device tensors must share one device"
            )
    qsl_cpu = batch.query_start_loc_cpu
    if qsl_cpu.dim() != 1 or qsl_cpu.shape[0] < 1:
        _fail(f"query_start_loc_cpu must have shape [num_reqs + 1], got {tuple(qsl_cpu.shape)}")
    num_reqs = qsl_cpu.shape[0] - 1
    expected = {
        "seq_lens_upper_bound": (num_reqs,),
        "query_start_loc": (num_reqs + 1,),
        "seq_lens": (num_reqs,),
    }
    for name, shape in expected.items():
        actual = tuple(getattr(batch, name).shape)
        if actual != shape:
            _fail(f"{name} must have shape {list(shape)} (num_reqs = {num_reqs}), got {actual}")
    table_shape = tuple(batch.block_table.shape)
    if len(table_shape) != 2 or table_shape[0] != num_reqs:
        _fail(f"block_table must have shape [num_reqs = {num_reqs}, max_blocks], got {table_shape}")
    if num_reqs > batch.config.max_num_seqs:
        _fail(f"num_reqs = {num_reqs} exceeds config.max_num_seqs = {batch.config.max_num_seqs}")
    num_tokens = batch.num_tokens
    if num_tokens is not None and (not isinstance(num_tokens, int) or isinstance(num_tokens, bool)):
        _fail(f"num_tokens must be an int or None, got {num_tokens!r}")
    num_pages = batch.num_pages
    if num_pages is not None and (
        not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages <= 0
    ):
        _fail(f"num_pages must be a positive int or None, got {num_pages!r}")
    num_real = batch.num_real_reqs
    if num_real is not None and (
        not isinstance(num_real, int) or isinstance(num_real, bool) or not 0 <= num_real <= num_reqs
    ):
        _fail(
            f"num_real_reqs must be an int in [0, num_reqs = {num_reqs}] or None, got {num_real!r}"
        )


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _fail_first(bad: np.ndarray, message: Callable[[int], str]) -> None:
    """Raise ValueError(message(r)) for the first index r where `bad` holds; none, no raise."""
    if bad.any():
        _fail(message(_first(bad)))


def _validate_values(batch: StepBatch) -> None:
    """Every value rule of docs/contract.md section 3.1; reads the device tensors (the slow
    path)."""
    config = batch.config
    qsl = batch.query_start_loc_cpu.numpy().astype(np.int64)
    if qsl[0] != 0:
        _fail(f"query_start_loc_cpu[0] must be 0, got {qsl[0]}")
    query_lens = np.diff(qsl)
    _fail_first(
        query_lens < 0,
        lambda r: (
            f"query_start_loc_cpu must be non-decreasing: request {r} has "
            f"query_start_loc_cpu[{r}] = {qsl[r]} > query_start_loc_cpu[{r + 1}] = {qsl[r + 1]}"
        ),
    )
    num_tokens = batch.num_tokens
    if num_tokens < qsl[-1]:
        _fail(f"num_tokens = {num_tokens} is below query_start_loc_cpu[-1] = {qsl[-1]}")
    if num_tokens > config.max_num_batched_tokens:
        _fail(
            f"num_tokens = {num_tokens} exceeds config.max_num_batched_tokens = "
            f"{config.max_num_batched_tokens}"
        )
    qsl_device = batch.query_start_loc.cpu().numpy().astype(np.int64)
    _fail_first(
        qsl_device != qsl,
        lambda r: (
            f"query_start_loc[{r}] = {qsl_device[r]} differs from "
            f"query_start_loc_cpu[{r}] = {qsl[r]}"
        ),
    )
    seq_lens = batch.seq_lens.cpu().numpy().astype(np.int64)
    num_real = batch.num_real_reqs
    real_seq, real_query = seq_lens[:num_real], query_lens[:num_real]
    too_long = f"exceeds config.max_model_len = {config.max_model_len}"
    _fail_first(real_seq < 0, lambda r: f"seq_lens[{r}] = {seq_lens[r]} is negative (request {r})")
    _fail_first(
        real_seq < real_query,
        lambda r: (
            f"seq_lens[{r}] = {seq_lens[r]} is shorter than request {r}'s query length "
            f"{query_lens[r]}"
        ),
    )
    _fail_first(
        real_seq > config.max_model_len,
        lambda r: f"seq_lens[{r}] = {seq_lens[r]} {too_long} (request {r})",
    )
    upper = batch.seq_lens_upper_bound.numpy().astype(np.int64)
    _fail_first(
        upper < seq_lens,
        lambda r: (
            f"seq_lens_upper_bound[{r}] = {upper[r]} is below seq_lens[{r}] = "
            f"{seq_lens[r]} (request {r})"
        ),
    )
    _fail_first(
        upper > config.max_model_len,
        lambda r: f"seq_lens_upper_bound[{r}] = {upper[r]} {too_long} (request {r})",
    )
    pages_used = -(-(seq_lens // config.compress_ratio) // config.page_entries)
    max_blocks = batch.block_table.shape[1]
    _fail_first(
        pages_used > max_blocks,
        lambda r: (
            f"block_table has {max_blocks} columns but request {r} (seq_lens[{r}] = "
            f"{seq_lens[r]}) uses {pages_used[r]} pages"
        ),
    )
    if batch.num_pages is not None and seq_lens.shape[0] > 0:
        table = batch.block_table.cpu().numpy()
        used = np.arange(max_blocks)[None, :] < pages_used[:, None]
        bad = used & ((table < 0) | (table >= batch.num_pages))
        if bad.any():
            r, c = (int(i[0]) for i in np.nonzero(bad))
            _fail(
                f"block_table[{r}, {c}] = {table[r, c]} is outside [0, num_pages = "
                f"{batch.num_pages}) (request {r} uses {pages_used[r]} pages)"
            )
    if num_real < batch.num_reqs:
        _validate_padding(batch, query_lens, seq_lens)


def padding_form(query_len: int, seq_len: int, next_n: int) -> str | None:
    """The `PADDING_FORMS` name of a padding request of these lengths, or None if none fits.

    The page of a "fill1" request is not looked at here (`StepBatch` checks it is page 0).
    """
    if seq_len == 0 and query_len == 0:
        return "zero"
    if seq_len == 0 and query_len == next_n:
        return "arange"
    if seq_len == 1 and query_len == 1:
        return "fill1"
    return None


def _validate_padding(batch: StepBatch, query_lens: np.ndarray, seq_lens: np.ndarray) -> None:
    """Each request after the real ones is one of `PADDING_FORMS` (docs/contract.md section
    3.2a)."""
    config = batch.config
    next_n = config.next_n
    num_real = batch.num_real_reqs
    real_prefill = query_lens[:num_real] > next_n
    first_prefill = _first(real_prefill) if real_prefill.any() else None
    table = None
    for r in range(num_real, batch.num_reqs):
        q, s = int(query_lens[r]), int(seq_lens[r])
        form = padding_form(q, s, next_n)
        if form is None:
            _fail(
                f"seq_lens[{r}] = {s} with query length {q}: padding request {r} "
                f"(num_real_reqs = {num_real}) is none of the padding forms: 0 rows and "
                f"seq_len 0, next_n = {next_n} rows and seq_len 0, or 1 row and seq_len 1"
            )
        if form != "zero" and first_prefill is not None:
            _fail(
                f"query_start_loc_cpu: padding request {r} has {q} query rows but follows "
                f"prefill request {first_prefill}; a step with prefills may carry only "
                "zero-row padding requests"
            )
        if form == "fill1" and 1 // config.compress_ratio > 0:
            if table is None:
                table = batch.block_table.cpu().numpy()
            if table[r, 0] != 0:
                _fail(
                    f"block_table[{r}, 0] = {table[r, 0]}: padding request {r} (1 row, "
                    "seq_len 1) must sit on the reserved page 0"
                )
