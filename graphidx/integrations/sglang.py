"""SGLang adapter: CUDA-graph metadata hooks over an `IndexerGraphRunner`, and KV slot ids.

Names and signatures follow SGLang as of v0.5 (`python/sglang/srt/layers/attention/
base_attn_backend.py`, `AttentionBackend`):
`init_forward_metadata_capture_cuda_graph(bs, num_tokens, req_pool_indices, seq_lens,
encoder_lens, forward_mode, spec_info)`, `init_forward_metadata_replay_cuda_graph(bs,
req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode, spec_info,
seq_lens_cpu)` and `get_cuda_graph_seq_len_fill_value()` (1); the model runner's
`req_to_token_pool.req_to_token` (`[pool rows, context]` int32: the KV slot of every token
position, `page * page_size + offset`) and `page_size`; `forward_mode.is_target_verify()`;
the verify input's `draft_token_num`. SGLang is not imported; attributes are read by name.

How a backend uses it: build `SGLangIndexerHooks.from_model_runner(runner, model_runner)`
once; in each of the backend's graph hooks call the same-named method with the same arguments
(at replay also `num_real_reqs`, the graph runner's unpadded batch size) and keep the returned
`StepBatch` (also `hooks.batch`); in the indexer layer write q / q_scale / weights into
`runner.input_views(batch.num_tokens)` and call `runner.step(batch, views)`; hand
`hooks.kv_slots(topk)` to the sparse attention, which takes KV slot ids, not positions.

The hooks write the step into the runner's persistent step buffers (`runner.buffers`
"seq_lens" and "block_table", and "query_start_loc" when the runner has one), so the runner
copies nothing for them. Device work only, never a device-to-host read: lengths are copied
(plus the draft rows in target-verify mode, where SGLang's `seq_lens` exclude them), the
block table is gathered from `req_to_token` at page starts, and padding requests (index >=
`num_real_reqs`) get SGLang's padding form explicitly — decode: 1 row, `seq_len` 1 (the fill
value), page 0; target verify: `next_n` rows, `seq_len` 0, page 0 — so they plan as padding
(docs/contract.md section 3.2a) whatever stale pool rows SGLang left there.
"""

from __future__ import annotations

from typing import Any

import torch

from graphidx.batch import StepBatch
from graphidx.config import cdiv
from graphidx.ops.validate import check_kind
from graphidx.runner import IndexerGraphRunner

SEQ_LEN_FILL_VALUE = 1
"""SGLang's `get_cuda_graph_seq_len_fill_value()`: the sequence length of padding requests."""

_MISSING = object()


def _attr(obj: Any, owner: str, name: str) -> Any:
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        raise ValueError(f"{owner}.{name} is missing")
    return value


def _int(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where} must be an int >= {minimum}, got {value!r}")
    return value


def _rows(value: Any, where: str, rows: int, device: torch.device | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{where} must be a 1-D tensor, got {got}")
    if value.shape[0] < rows:
        raise ValueError(f"{where} has {value.shape[0]} entries, fewer than bs = {rows}")
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise ValueError(f"{where} must hold integers, got {value.dtype}")
    if device is not None and value.device != device:
        raise ValueError(f"{where} is on {value.device}, the runner on {device}")
    return value[:rows]


def _is_target_verify(forward_mode: Any) -> bool:
    check = getattr(forward_mode, "is_target_verify", None)
    if forward_mode is not None and check is None:
        raise ValueError("forward_mode.is_target_verify is missing")
    return bool(check()) if check is not None else False


class SGLangIndexerHooks:
    """SGLang's attention-backend CUDA-graph hooks for one `IndexerGraphRunner`.

    `req_to_token`: SGLang's `req_to_token_pool.req_to_token` (device int32 `[pool rows,
    context]`); `page_size`: tokens per KV page (SGLang's `page_size`), which must be the
    runner's `config.block_size`. `validate`: validate every step's `StepBatch` (reads the
    device tensors; pass False on a hot path that trusts SGLang's values).
    """

    def __init__(
        self,
        runner: IndexerGraphRunner,
        req_to_token: torch.Tensor,
        *,
        page_size: int | None = None,
        validate: bool = True,
    ) -> None:
        if not isinstance(runner, IndexerGraphRunner):
            raise ValueError(f"runner must be an IndexerGraphRunner, got {type(runner).__name__}")
        config = runner.config
        page_size = config.block_size if page_size is None else page_size
        _int(page_size, "page_size", 1)
        if page_size != config.block_size:
            raise ValueError(
                f"page_size = {page_size} but the runner's config.block_size = "
                f"{config.block_size}: the indexer cache must page like SGLang's KV pool"
            )
        check_kind("req_to_token", req_to_token, rank=2, dtype=torch.int32, device=runner.device)
        for name in ("seq_lens", "block_table"):
            if name not in runner.buffers:
                raise ValueError(f"runner.buffers has no {name!r} step buffer")
        self.runner = runner
        self.config = config
        self.req_to_token = req_to_token
        self.page_size = page_size
        self.validate = validate
        self.batch: StepBatch | None = None
        self._cols = min(config.max_blocks_per_seq, cdiv(int(req_to_token.shape[1]), page_size))
        # The page starts of every pool row: a strided view, gathered per step.
        self._page_starts = req_to_token[:, : self._cols * page_size : page_size]
        self._offsets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._req_pool_indices: torch.Tensor | None = None

    @classmethod
    def from_model_runner(
        cls, runner: IndexerGraphRunner, model_runner: Any, *, validate: bool = True
    ) -> SGLangIndexerHooks:
        """Read `model_runner.req_to_token_pool.req_to_token` and `model_runner.page_size`."""
        pool = _attr(model_runner, "model_runner", "req_to_token_pool")
        req_to_token = _attr(pool, "model_runner.req_to_token_pool", "req_to_token")
        page_size = _int(
            _attr(model_runner, "model_runner", "page_size"), "model_runner.page_size", 1
        )
        return cls(runner, req_to_token, page_size=page_size, validate=validate)

    @staticmethod
    def get_cuda_graph_seq_len_fill_value() -> int:
        return SEQ_LEN_FILL_VALUE

    # The hooks.
    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None = None,
        forward_mode: Any = None,
        spec_info: Any = None,
    ) -> StepBatch:
        """The capture-time step: every request real, SGLang's dummy lengths (fill value)."""
        batch = self._load(
            bs, req_pool_indices, seq_lens, None, encoder_lens, forward_mode, spec_info, bs
        )
        if batch.num_tokens != num_tokens:
            raise ValueError(
                f"num_tokens = {num_tokens} but bs = {bs} requests of "
                f"{batch.num_tokens // max(bs, 1)} rows make {batch.num_tokens}"
            )
        return batch

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int | None = None,
        encoder_lens: torch.Tensor | None = None,
        forward_mode: Any = None,
        spec_info: Any = None,
        seq_lens_cpu: torch.Tensor | None = None,
        *,
        num_real_reqs: int | None = None,
    ) -> StepBatch:
        """The replayed step of padded size `bs`, its first `num_real_reqs` requests real
        (None: all). `seq_lens_cpu` (host) bounds the lengths; without it the bound is
        `max_model_len` (valid, loose). `seq_lens_sum` is not needed."""
        real = bs if num_real_reqs is None else _int(num_real_reqs, "num_real_reqs")
        if real > bs:
            raise ValueError(f"num_real_reqs = {real} exceeds bs = {bs}")
        return self._load(
            bs,
            req_pool_indices,
            seq_lens,
            seq_lens_cpu,
            encoder_lens,
            forward_mode,
            spec_info,
            real,
        )

    def kv_slots(self, topk: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The last step's top-k positions as SGLang KV slot ids (see
        `topk_positions_to_kv_slots`), through `req_to_token`; -1 stays -1."""
        if self.batch is None or self._req_pool_indices is None:
            raise ValueError("kv_slots needs a step: call a metadata hook first")
        return topk_positions_to_kv_slots(
            topk,
            self.batch.query_start_loc,
            req_to_token=self.req_to_token,
            req_pool_indices=self._req_pool_indices,
            out=out,
        )

    # Internals.
    def _query_offsets(self, query_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host and device `arange(max_num_seqs + 1) * query_len`, made once per length."""
        offsets = self._offsets.get(query_len)
        if offsets is None:
            host = torch.arange(self.config.max_num_seqs + 1, dtype=torch.int32) * query_len
            offsets = (host, host.to(self.runner.device))
            self._offsets[query_len] = offsets
        return offsets

    def _load(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor | None,
        encoder_lens: torch.Tensor | None,
        forward_mode: Any,
        spec_info: Any,
        num_real: int,
    ) -> StepBatch:
        config, runner = self.config, self.runner
        _int(bs, "bs", 1)
        if bs > config.max_num_seqs:
            raise ValueError(f"bs = {bs} exceeds config.max_num_seqs = {config.max_num_seqs}")
        if encoder_lens is not None:
            raise ValueError("encoder_lens must be None: the indexer has no encoder")
        device = runner.device
        pool_rows = _rows(req_pool_indices, "req_pool_indices", bs, device)
        lens = _rows(seq_lens, "seq_lens", bs, device)
        verify = _is_target_verify(forward_mode)
        if verify:
            drafts = getattr(spec_info, "draft_token_num", config.next_n)
            query_len = _int(drafts, "spec_info.draft_token_num", 1)
        else:
            query_len = 1
        # Padding requests: decode keeps SGLang's fill value; verify has next_n rows, seq 0.
        pad_seq = 0 if verify else SEQ_LEN_FILL_VALUE

        b = runner.buffers
        seq_buf, table = b["seq_lens"][:bs], b["block_table"][:bs]
        seq_buf.copy_(lens, non_blocking=True)
        if verify:
            seq_buf.add_(query_len)
        cols = self._cols
        pages = self._page_starts.index_select(0, pool_rows.long())
        table[:, :cols].copy_(pages.div_(self.page_size, rounding_mode="floor"))
        if num_real < bs:
            seq_buf[num_real:].fill_(pad_seq)
            table[num_real:].zero_()

        host_qsl, device_qsl = self._query_offsets(query_len)
        qsl = device_qsl[: bs + 1]
        if "query_start_loc" in b:
            b["query_start_loc"][: bs + 1].copy_(qsl, non_blocking=True)
            qsl = b["query_start_loc"][: bs + 1]
        if seq_lens_cpu is None:
            upper = torch.full((bs,), config.max_model_len, dtype=torch.int32)
        else:
            host = _rows(seq_lens_cpu, "seq_lens_cpu", bs)
            if host.device.type != "cpu":
                raise ValueError(f"seq_lens_cpu must be a host tensor, got device {host.device}")
            upper = host.to(torch.int32) + (query_len if verify else 0)
        upper[num_real:] = pad_seq
        self._req_pool_indices = pool_rows
        batch = StepBatch(
            host_qsl[: bs + 1].clone(),
            upper,
            qsl,
            seq_buf,
            table,
            config=config,
            num_pages=runner.num_pages,
            num_real_reqs=num_real,
            validate=self.validate,
        )
        self.batch = batch
        return batch


def topk_positions_to_kv_slots(
    topk: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    page_entries: int | None = None,
    req_to_token: torch.Tensor | None = None,
    req_pool_indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Map top-k positions (`[rows, k]`, -1 padded) to KV slot ids; -1 stays -1.

    Row t belongs to the request r with `query_start_loc[r] <= t < query_start_loc[r + 1]`
    (device `[num_reqs + 1]`); rows past the last offset give -1. Either through a block
    table: position p of request r lives in slot `block_table[r, p // page_entries] *
    page_entries + p % page_entries` (`page_entries` = SGLang's `page_size` at R = 1, where
    positions are token positions and the slot is the token's KV index); or through SGLang's
    `req_to_token[req_pool_indices[r], p]`. Device ops only, no host read; the result is int32
    `[rows, k]`, written into `out` when given (e.g. a persistent buffer a graph reads).
    """
    if not isinstance(topk, torch.Tensor) or topk.dim() != 2:
        raise ValueError(f"topk must be a 2-D tensor [rows, k], got {getattr(topk, 'shape', topk)}")
    if not isinstance(query_start_loc, torch.Tensor) or query_start_loc.dim() != 1:
        raise ValueError("query_start_loc must be a 1-D tensor [num_reqs + 1]")
    via_table = block_table is not None
    if via_table == (req_to_token is not None):
        raise ValueError("pass exactly one of block_table (with page_entries) or req_to_token")
    rows = int(topk.shape[0])
    num_reqs = int(query_start_loc.shape[0]) - 1
    device = topk.device
    if num_reqs < 1 or rows == 0:
        result = torch.full(topk.shape, -1, dtype=torch.int32, device=device)
        return result if out is None else out.copy_(result)
    row_ids = torch.arange(rows, device=device, dtype=query_start_loc.dtype)
    request = torch.searchsorted(query_start_loc[1:].contiguous(), row_ids, right=True)
    live = row_ids < query_start_loc[-1]
    request = request.clamp_(max=num_reqs - 1)
    valid = (topk >= 0) & live[:, None]
    position = topk.long().clamp(min=0)
    if via_table:
        assert block_table is not None
        if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
            raise ValueError(
                f"block_table must be [>= num_reqs = {num_reqs}, max_blocks], got "
                f"{tuple(block_table.shape)}"
            )
        entries = _int(page_entries, "page_entries", 1)
        column = (position // entries).clamp_(max=int(block_table.shape[1]) - 1)
        page = block_table[request.long()[:, None], column].long()
        slots = page * entries + position % entries
    else:
        assert req_to_token is not None
        if req_pool_indices is None:
            raise ValueError("req_to_token needs req_pool_indices")
        if req_to_token.dim() != 2:
            raise ValueError(f"req_to_token must be 2-D, got {tuple(req_to_token.shape)}")
        if req_pool_indices.dim() != 1 or req_pool_indices.shape[0] < num_reqs:
            raise ValueError(
                f"req_pool_indices must have >= num_reqs = {num_reqs} entries, got "
                f"{tuple(req_pool_indices.shape)}"
            )
        pool_row = req_pool_indices.long()[request.long()]
        position = position.clamp_(max=int(req_to_token.shape[1]) - 1)
        slots = req_to_token[pool_row[:, None], position].long()
    result = torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)
    if out is None:
        return result
    return out.copy_(result)
