"""The metadata builders (docs/contract.md section 3.5): a `StepBatch` in, `IndexerMetadata` out.

A builder is the `plan()` half of a plan/run split: it runs on the host before the step's
kernels, checks the configuration once, allocates every per-step buffer once at its maximum
size, and on each `build()` fills those buffers with device ops and returns views of them.
`build()` reads host values only (offsets, upper bounds) and never copies a device value back,
so it can run while the previous step's kernels are still in flight, and a captured graph that
reads the buffers sees each step's values.

Two ways to use one:
- A runtime that owns its graph calls `build()` outside the graph (host planning, like
  FlashInfer's `plan()`) and captures the layers on the metadata it returns. Such a graph reads
  the batch's device tensors (`seq_lens`, `block_table`) and the builder's `buffers()` —
  exactly the ones named there, all allocated once — and `build()` writes only those buffers
  (plus, for prefill, host staging that no graph reads). It must keep each captured shape's
  block-table width and call `build()` before every replay.
- `uniform_decode()` gives a captured uniform decode shape metadata whose values the graph
  derives itself (one device op from persistent `seq_lens` and a live-request count), so a
  replay needs no `build()` at all: what `IndexerGraphRunner` does.

Buffer sizes: rows `config.max_num_batched_tokens`, requests `config.max_num_seqs`, block-table
columns `config.max_blocks_per_seq`. Views of the row block table are contiguous
`[rows, max_blocks]` blocks at the buffer's start, `max_blocks` being the batch's block-table
width.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from capture import StaticBuffers
from graphidx.batch import StepBatch
from graphidx.config import IndexerConfig, is_power_of_two
from graphidx.distributed import ContextParallel, local_lengths
from graphidx.metadata import (
    DecodeMetadata,
    GatherLaunch,
    IndexerMetadata,
    NativeDecode,
    PrefillChunk,
    PrefillPlan,
    RequestRows,
)
from graphidx.ops.schedule import (
    build_decode_schedule,
    default_target_items,
    derive_uniform_decode,
)
from graphidx.ops.schedule_format import schedule_ints
from graphidx.plan import (
    build_decode_rows,
    build_prefill_chunks,
    derive_request_rows,
    native_decode,
    plan_gather_launches,
    plan_prefill_chunks,
    split_decodes_prefills,
    split_prefill_chunks,
)

if TYPE_CHECKING:
    from graphidx.mxfp4.layout import CacheLayout

DECODE_GATHER_FACTOR = 3.0  # decode rows gather from this many pool widths of context
PREFILL_GATHER_FACTOR = 1.5  # a prefill chunk gathers from this many pool widths of context


class _HostStaging:
    """A host buffer shipped to the device with non-blocking copies.

    On a GPU the buffer is pinned and the copy asynchronous, so before the host rewrites it the
    previous copy must have landed: `writable()` waits on the event recorded after that copy
    (normally long complete; this is a wait on a copy, never a device-to-host transfer).
    """

    def __init__(self, size: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.tensor = torch.empty(size, dtype=torch.int32, pin_memory=pin)
        self._event: torch.cuda.Event | None = None
        self._cuda = pin

    def writable(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.tensor

    def shipped(self) -> None:
        if self._cuda:
            self._event = torch.cuda.Event()
            self._event.record()


@dataclass(frozen=True)
class CapturedDecode:
    """A uniform decode shape's metadata and the device op that fills it.

    `metadata` is fixed for the shape (views of persistent buffers; no value in it depends
    on a step); `derive()` runs `derive_uniform_decode` from the persistent raw inputs. A
    graph that captures `derive()` before the layers recomputes every derived value at each
    replay.
    """

    metadata: IndexerMetadata
    derive: Callable[[], None]


def canonical_device(device: torch.device | str) -> torch.device:
    """`device` with an explicit index ("cuda" becomes "cuda:<current>"), so that it
    compares equal to the device of the tensors allocated on it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class IndexerMetadataBuilder:
    """The dense paged indexer's builder.

    `config`: the model's `IndexerConfig`; `device`: where the persistent buffers live (the
    batches' device tensors must be there too); `num_pages`: the KV cache's page count, when
    known (a batch validated against another cache size is refused); `full_graph_decode`:
    the decode metadata will be replayed from a FULL graph, so every decode decision must
    depend on the step's shape alone (decode logits span the whole `logits_width`);
    `decode_schedule`: build the device decode work schedule every step (None: on a GPU,
    where the Triton kernels use it; the reference kernels ignore it). `buffers`: the
    `StaticBuffers` that owns the persistent buffers (names prefixed "builder."), so that one
    owner holds everything a graph reads; None: the builder's own.
    Raises `ValueError` at construction for a configuration the cache layout cannot serve.

    Context parallel (`config.dcp_world_size` W > 1, docs/contract.md section 10): the builder
    plans rank `config.dcp_rank`'s share. The batch carries the global `seq_lens` and upper
    bounds (every rank gets the same ones) and this rank's block table and page count: its
    cache holds its positions at their local indices (`graphidx.distributed`). The context
    lengths, decode row ends, prefill row ends (and `cu_seqlen_ke`, so `ke - ks` stays the row
    end over the concatenated local contexts) and block ends become rank-local on the device
    (`local_lengths` of the global ones), logits widths become `local_count` of the global
    ones, and the chunking, splits and every other host decision (the consumers' gather
    gates included) stay the global ones, so every rank launches the same rows (the layers'
    exchange needs it). The metadata's `global_row_ends` keeps each row's global end (the
    candidate source needs it to tell which rank holds a row's newest key).
    """

    def __init__(
        self,
        config: IndexerConfig,
        device: torch.device | str,
        *,
        num_pages: int | None = None,
        full_graph_decode: bool = False,
        decode_schedule: bool | None = None,
        buffers: StaticBuffers | None = None,
    ) -> None:
        if not isinstance(config, IndexerConfig):
            raise ValueError(f"config must be an IndexerConfig, got {type(config).__name__}")
        if num_pages is not None and (
            not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages <= 0
        ):
            raise ValueError(f"num_pages must be a positive int or None, got {num_pages!r}")
        self.config = config
        self.full_graph_decode = bool(full_graph_decode)
        self.device = canonical_device(device)
        self.decode_schedule = (
            self.device.type == "cuda" if decode_schedule is None else bool(decode_schedule)
        )
        # Item count the schedule aims at (about one per persistent logits program).
        self._target_items = default_target_items(self.device) if self.decode_schedule else 0
        self.num_pages = num_pages
        self.context_parallel: ContextParallel | None = None
        self.layout = self._check_config()
        self._set_gather_gates()
        if buffers is not None and buffers.device != self.device:
            raise ValueError(f"buffers live on {buffers.device}, the builder on {self.device}")
        self.static = buffers if buffers is not None else StaticBuffers(self.device)
        self._allocate()

    # Construction.
    def _check_config(self) -> CacheLayout:
        """Refuse configurations the cache layout cannot tile; returns the layout."""
        # Imported here: the layout belongs to the cache format, which planning never needs
        # at import time.
        from graphidx.mxfp4.layout import cache_layout

        config = self.config
        if config.dcp_world_size > 1:
            self.context_parallel = ContextParallel.from_config(config)
        try:
            return cache_layout(config.num_heads, config.head_dim, config.page_entries)
        except ValueError as error:
            raise ValueError(
                f"block_size = {config.block_size} (page_entries = {config.page_entries} at "
                f"compress_ratio = {config.compress_ratio}) cannot be tiled by the MXFP4 "
                f"cache layout for num_heads = {config.num_heads}, head_dim = "
                f"{config.head_dim}: {error}"
            ) from error

    def _set_gather_gates(self) -> None:
        """Set the gates from which the plan gathers (None: never, the dense indexer having no
        candidate pool): `min_gather_width`, a prefill chunk's width; `decode_gather_width`,
        the step's widest decode context (upper bound // R); and `rows_per_launch`, the
        prefill rows of one gather launch."""
        self.min_gather_width: int | None = None
        self.decode_gather_width: int | None = None
        self.rows_per_launch = 0

    def _allocate(self) -> None:
        config = self.config
        rows = config.max_num_batched_tokens
        reqs = config.max_num_seqs
        cols = config.max_blocks_per_seq

        self._buffers: dict[str, torch.Tensor] = {}

        def buffer(
            name: str, size: int | tuple[int, ...], dtype: torch.dtype = torch.int32, fill: int = 0
        ) -> None:
            shape = (size,) if isinstance(size, int) else size
            self._buffers[name] = self.static.add(f"builder.{name}", shape, dtype, fill=fill)

        buffer("row_lens", rows)
        buffer("row_block_table", (rows, cols))
        buffer("context_lens", reqs)
        buffer("cu_seqlen_ks", rows)
        buffer("cu_seqlen_ke", rows)
        buffer("prefill_row_ends", rows)
        # Each kept chunk holds num_reqs + 1 offsets. A group of g >= 2 requests is one chunk
        # (g + 1 <= 1.5 g offsets); only a single-request group is cut, into chunks of >= 1
        # row (2 offsets each: up to 2 per row when the logits budget allows one row per
        # launch). So 1.5 reqs + 2 rows at most.
        buffer("chunk_query_start_loc", 2 * (reqs + rows))
        buffer("context_cumsum", reqs + 1, torch.int64)
        buffer("decode_row_index", 2 * rows)
        buffer("prefill_row_index", 3 * rows)
        buffer("prefill_cumsum_pairs", 2 * rows, torch.int64)
        buffer("gather_row_ends", rows)
        if config.has_candidates:
            buffer("block_ends", rows)
            buffer("prefill_block_ends", rows)
        if config.dcp_world_size > 1:
            buffer("global_row_ends", rows)  # each step row's end before it is made local
        if config.adaptive_verification and config.next_n > 1:
            buffer("request_offsets", reqs + 1)  # a captured step's rows by device offsets
        if self.decode_schedule:
            # One group per decode row at most (a flattened launch), each up to logits_width;
            # zero-filled, it reads as untrusted until built.
            groups = min(rows, reqs * config.next_n)
            buffer(
                "schedule",
                schedule_ints(groups, config.logits_width, target_items=self._target_items),
            )
        self._decode_staging = _HostStaging(2 * rows, self.device)
        self._prefill_staging = _HostStaging(3 * rows, self.device)
        self._row_table_flat = self._buffers["row_block_table"].view(-1)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every persistent device buffer by name; addresses never change across builds."""
        return dict(self._buffers)

    def _decode_width(self, batch: StepBatch, num_decodes: int) -> int | None:
        """Decode logits columns: None (all of `logits_width`) under a FULL graph, else the
        step's widest decode context from the host upper bounds (a value-dependent choice
        that only an eager step may make); under context parallel, this rank's share."""
        if self.full_graph_decode:
            return self._full_decode_width()
        upper = batch.seq_lens_upper_bound.numpy()[:num_decodes]
        widest = int(upper.max()) // self.config.compress_ratio if num_decodes else 0
        cp = self.context_parallel
        return max(1, widest if cp is None else cp.local_count(widest))

    def _full_decode_width(self) -> int | None:
        """A FULL graph's decode columns: None (`logits_width`), or under context parallel
        this rank's share of it."""
        cp = self.context_parallel
        return None if cp is None else max(1, cp.local_count(self.config.logits_width))

    # Context parallel: the rank's share of global lengths, in place on the device.
    def _to_local(self, lengths: torch.Tensor) -> None:
        """Replace global lengths by this rank's (`local_lengths`); a no-op on one rank."""
        if self.context_parallel is not None:
            lengths.copy_(local_lengths(self.context_parallel, lengths))

    def _global_row_ends(self, rows: int) -> torch.Tensor | None:
        """The global row ends of step rows [0, rows) (None on one rank): kept for the
        candidate source, whose newest-key block lives on one rank."""
        ends = self._buffers.get("global_row_ends")
        return None if ends is None else ends[:rows]

    def _local_decode_rows(self, row_lens: torch.Tensor, block_ends: torch.Tensor | None) -> None:
        """Decode row ends made rank-local (the global ones kept in `global_row_ends`), and
        the block ends recomputed from them."""
        if self.context_parallel is None:
            return
        self._buffers["global_row_ends"][: row_lens.shape[0]].copy_(row_lens)
        self._to_local(row_lens)
        if block_ends is not None:
            size = self.config.candidate_block_size
            torch.add(row_lens, size - 1, out=block_ends)
            block_ends.div_(size, rounding_mode="floor")

    def _local_prefill_ends(self, start: int, end: int) -> None:
        """Prefill rows [start, end): `cu_seqlen_ke = ks + local(ke - ks)`, so that the row
        ends `ke - ks` planned from them are rank-local (ks is already the cumsum of the
        rank-local contexts)."""
        if self.context_parallel is None or end <= start:
            return
        ks = self._buffers["cu_seqlen_ks"][start:end]
        ke = self._buffers["cu_seqlen_ke"][start:end]
        ke.sub_(ks)
        self._buffers["global_row_ends"][start:end].copy_(ke)
        self._to_local(ke)
        ke.add_(ks)

    def _local_plans(self, plans: list[PrefillPlan]) -> list[PrefillPlan]:
        """Prefill plans whose logits width is this rank's share of the global width."""
        cp = self.context_parallel
        if cp is None:
            return plans
        return [dataclasses.replace(p, width=cp.local_count(p.width)) for p in plans]

    # The step's decode schedule and gather plan.
    def _build_schedule(self, decode: DecodeMetadata) -> torch.Tensor | None:
        """The decode work schedule, built on the device into its persistent buffer (the
        builder's one kernel launch: planning itself stays on the host); None when off."""
        schedule = self._buffers.get("schedule")
        if schedule is None:
            return None
        next_n = decode.native.next_n if decode.native is not None else 1
        build_decode_schedule(
            decode.row_lens, schedule, next_n=next_n, target_items=self._target_items
        )
        return schedule

    def _gather_plan(
        self,
        batch: StepBatch,
        num_decodes: int,
        chunks: list[PrefillChunk],
        plans: list[PrefillPlan],
    ) -> tuple[bool, tuple[GatherLaunch, ...]]:
        """`(decode_use_gather, gather_launches)` under the gates of `_set_gather_gates`:
        nothing gathers without a decode gate; decode rows gather under a FULL graph or when
        the step's widest decode context reaches `decode_gather_width`; the prefill plans
        that gather are cut into launches of `rows_per_launch` rows."""
        if self.decode_gather_width is None:
            return False, ()
        decode_use_gather = self.full_graph_decode
        if not decode_use_gather and num_decodes:
            widest = int(batch.seq_lens_upper_bound.numpy()[:num_decodes].max())
            decode_use_gather = widest // self.config.compress_ratio >= self.decode_gather_width
        launches: tuple[GatherLaunch, ...] = ()
        if plans:
            launches = tuple(
                plan_gather_launches(
                    chunks,
                    plans,
                    self.rows_per_launch,
                    row_ends_out=self._buffers["gather_row_ends"],
                )
            )
        return decode_use_gather, launches

    # The captured uniform decode step.
    def uniform_decode(
        self,
        num_reqs: int,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        num_live_reqs: torch.Tensor,
        *,
        query_start_loc: torch.Tensor | None = None,
        backend: str | None = None,
    ) -> CapturedDecode:
        """The metadata of a uniform decode step of `num_reqs` requests of `next_n` rows.

        `seq_lens` int32 `[num_reqs]`, `block_table` int32 `[num_reqs, max_blocks]` and
        `num_live_reqs` int32 `[1]` are persistent device tensors (a graph reads them in
        place); requests `[num_live_reqs, num_reqs)` are padding whatever their lengths
        hold. Nothing is computed here: `derive()` fills the row ends, block ends,
        compressed contexts and schedule on the device (one op). The decode kernels read the
        request block table directly (row r belongs to request r // next_n): native
        `next_n` grouping (one K walk per request), one row per request when next_n is 1.
        Under adaptive verification with next_n > 1 the rows' owners come from the device
        instead: `query_start_loc` (int32 `[num_reqs + 1]`, persistent) holds the live
        requests' real row offsets, `derive()` computes the row ends from them
        (`graphidx.plan.derive_request_rows`, device ops), and the layers group the rows by
        those offsets (`RequestRows`: still one K walk per request; no schedule). Decode
        logits span the whole `logits_width`, and candidate consumers always gather, as a
        FULL graph needs. `backend`: the ops backend of `derive()` (None: the device's
        default).
        """
        config = self.config
        next_n = config.next_n
        rows = num_reqs * next_n
        if not 0 < num_reqs <= config.max_num_seqs or rows > config.max_num_batched_tokens:
            raise ValueError(
                f"num_reqs = {num_reqs} ({rows} rows) must be in [1, max_num_seqs = "
                f"{config.max_num_seqs}] with rows <= max_num_batched_tokens = "
                f"{config.max_num_batched_tokens}"
            )
        for name, tensor, shape in (
            ("seq_lens", seq_lens, (num_reqs,)),
            ("num_live_reqs", num_live_reqs, (1,)),
        ):
            if tensor.dtype != torch.int32 or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{name} must be int32 {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
                )
        if (
            block_table.dtype != torch.int32
            or block_table.dim() != 2
            or block_table.shape[0] != num_reqs
            or block_table.shape[1] > config.max_blocks_per_seq
        ):
            raise ValueError(
                f"block_table must be int32 [{num_reqs}, <= {config.max_blocks_per_seq}], got "
                f"{block_table.dtype} {tuple(block_table.shape)}"
            )
        for name, tensor in (("seq_lens", seq_lens), ("block_table", block_table)):
            if tensor.device != self.device:
                raise ValueError(f"{name} is on {tensor.device}, the builder on {self.device}")
        b = self._buffers
        context_lens = b["context_lens"][:num_reqs]
        row_lens = b["row_lens"][:rows]
        block_ends = b["block_ends"][:rows] if config.has_candidates else None
        if "request_offsets" in b:
            if query_start_loc is None:
                raise ValueError(
                    "adaptive_verification: uniform_decode needs the device query_start_loc"
                )
            return self._request_rows_decode(
                num_reqs, seq_lens, block_table, num_live_reqs, query_start_loc
            )
        schedule = b.get("schedule")
        native = NativeDecode(next_n, context_lens, block_table) if next_n > 1 else None
        local = self.context_parallel is not None

        def derive() -> None:
            # Under context parallel the row ends become rank-local before the block ends and
            # the schedule are derived from them (a few more device ops, still no host value).
            derive_uniform_decode(
                seq_lens,
                num_live_reqs,
                context_lens,
                row_lens,
                None if local else block_ends,
                None if local else schedule,
                next_n=next_n,
                compress_ratio=config.compress_ratio,
                candidate_block_size=config.candidate_block_size
                if block_ends is not None and not local
                else 0,
                group_rows=next_n,
                target_items=self._target_items,
                backend=backend,
            )
            if local:
                self._to_local(context_lens)
                self._local_decode_rows(row_lens, block_ends)
                if schedule is not None:
                    build_decode_schedule(
                        row_lens,
                        schedule,
                        next_n=next_n,
                        target_items=self._target_items,
                        backend=backend,
                    )

        width = self._full_decode_width()
        decode = DecodeMetadata(row_lens, block_table, block_ends, native, schedule, width=width)
        return self._captured(num_reqs, context_lens, decode, derive)

    def _captured(
        self,
        num_reqs: int,
        context_lens: torch.Tensor,
        decode: DecodeMetadata,
        derive: Callable[[], None],
    ) -> CapturedDecode:
        """A pure uniform-decode step's metadata around its decode rows."""
        rows = num_reqs * self.config.next_n
        metadata = IndexerMetadata(
            num_reqs=num_reqs,
            num_tokens=rows,
            num_decodes=num_reqs,
            num_decode_tokens=rows,
            num_prefills=0,
            num_prefill_tokens=0,
            context_lens=context_lens,
            decode=decode,
            decode_use_gather=self.decode_gather_width is not None,
            global_row_ends=self._global_row_ends(rows),
        )
        return CapturedDecode(metadata, derive)

    def _request_rows_decode(
        self,
        num_reqs: int,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        num_live_reqs: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> CapturedDecode:
        """`uniform_decode` under adaptive verification: rows owned by device offsets."""
        config = self.config
        if query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (num_reqs + 1,):
            raise ValueError(
                f"query_start_loc must be int32 ({num_reqs + 1},), got "
                f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}"
            )
        b = self._buffers
        rows = num_reqs * config.next_n
        context_lens = b["context_lens"][:num_reqs]
        row_lens = b["row_lens"][:rows]
        block_ends = b["block_ends"][:rows] if config.has_candidates else None
        offsets = b["request_offsets"][: num_reqs + 1]

        def derive() -> None:
            derive_request_rows(
                seq_lens,
                num_live_reqs,
                query_start_loc,
                config.next_n,
                config.compress_ratio,
                config.candidate_block_size,
                context_lens_out=context_lens,
                row_lens_out=row_lens,
                block_ends_out=block_ends,
                query_start_loc_out=offsets,
            )
            self._to_local(context_lens)
            self._local_decode_rows(row_lens, block_ends)

        decode = DecodeMetadata(
            row_lens,
            block_table,
            block_ends,
            width=self._full_decode_width(),
            request_rows=RequestRows(offsets, context_lens, block_table),
        )
        return self._captured(num_reqs, context_lens, decode, derive)

    # The step.
    def check_batch(self, batch: StepBatch) -> None:
        """O(1) checks that keep every write inside the buffers, even with validate=False."""
        config = self.config
        if batch.config is not config and batch.config != config:
            raise ValueError("batch.config differs from the builder's config")
        if batch.num_reqs > config.max_num_seqs:
            raise ValueError(
                f"batch.num_reqs = {batch.num_reqs} exceeds config.max_num_seqs = "
                f"{config.max_num_seqs}"
            )
        if batch.num_tokens > config.max_num_batched_tokens:
            raise ValueError(
                f"batch.num_tokens = {batch.num_tokens} exceeds config.max_num_batched_tokens "
                f"= {config.max_num_batched_tokens}"
            )
        if batch.block_table.shape[1] > config.max_blocks_per_seq:
            raise ValueError(
                f"batch.block_table has {batch.block_table.shape[1]} columns, more than "
                f"config.max_blocks_per_seq = {config.max_blocks_per_seq}"
            )
        if batch.device != self.device:
            raise ValueError(f"batch is on {batch.device} but the builder is on {self.device}")
        if (
            self.num_pages is not None
            and batch.num_pages is not None
            and batch.num_pages != self.num_pages
        ):
            raise ValueError(
                f"batch.num_pages = {batch.num_pages} but the builder's cache has "
                f"{self.num_pages} pages"
            )

    def build(self, batch: StepBatch) -> IndexerMetadata:
        """Fill the persistent buffers for `batch` and return the step's metadata
        (docs/contract.md section 3.5).

        Returns the split counts; decode rows (a pure-decode step's rows run to
        `batch.num_tokens`, so graph padding rows are decode rows; with prefills present the
        decode rows are the decode requests' real rows) with `native` (next_n forced to 1
        under adaptive verification) and `schedule`; prefill chunks and plans; and
        `context_lens = seq_lens // R`. All tensors are views of the persistent buffers, valid
        until the next `build()`. No device-to-host copy; host work proportional to requests
        and rows, never to context length.
        """
        self.check_batch(batch)
        config = self.config
        buffers = self._buffers
        num_reqs = batch.num_reqs
        qsl_cpu = batch.query_start_loc_cpu
        qsl = qsl_cpu.numpy()
        query_lens = np.diff(qsl)
        num_decodes, num_decode_tokens, num_prefills, num_prefill_tokens = split_decodes_prefills(
            query_lens, config.next_n
        )

        context_lens = buffers["context_lens"][:num_reqs]
        if config.compress_ratio > 1:
            torch.div(
                batch.seq_lens, config.compress_ratio, rounding_mode="floor", out=context_lens
            )
        else:
            context_lens.copy_(batch.seq_lens)
        if batch.num_real_reqs < num_reqs:  # runtime padding requests see nothing
            context_lens[batch.num_real_reqs :].zero_()
        self._to_local(context_lens)

        decode_rows = num_decode_tokens if num_prefills else batch.num_tokens
        decode = None
        if decode_rows:
            rows = build_decode_rows(
                qsl_cpu,
                batch.seq_lens,
                batch.block_table,
                num_decodes,
                decode_rows,
                config.compress_ratio,
                config.candidate_block_size,
                num_real_reqs=batch.num_real_reqs,
                row_lens_out=buffers["row_lens"],
                row_block_table_out=self._row_table_flat,
                block_ends_out=buffers.get("block_ends"),
                index_staging=self._decode_staging.writable(),
                index_scratch=buffers["decode_row_index"],
            )
            self._decode_staging.shipped()
            self._local_decode_rows(rows.row_lens, rows.block_ends)
            next_n = 1 if config.adaptive_verification else config.next_n
            decode = DecodeMetadata(
                row_lens=rows.row_lens,
                block_table=rows.block_table,
                block_ends=rows.block_ends,
                native=native_decode(
                    rows.row_lens, rows.block_table, query_lens[:num_decodes], next_n, context_lens
                ),
                width=self._decode_width(batch, num_decodes),
            )
            schedule = self._build_schedule(decode)
            if schedule is not None:
                decode = DecodeMetadata(
                    row_lens=decode.row_lens,
                    block_table=decode.block_table,
                    block_ends=decode.block_ends,
                    native=decode.native,
                    schedule=schedule,
                    width=decode.width,
                )

        chunks: list[PrefillChunk] = []
        plans: list[PrefillPlan] = []
        if num_prefills:
            upper = batch.seq_lens_upper_bound.numpy()
            splits = split_prefill_chunks(
                upper[num_decodes:] // config.compress_ratio,
                query_lens[num_decodes:],
                config.max_logits_bytes,
                request_offset=num_decodes,
            )
            chunks = build_prefill_chunks(
                splits,
                int(qsl[num_decodes]),
                qsl_cpu,
                batch.seq_lens_upper_bound,
                batch.seq_lens,
                batch.block_table,
                context_lens,
                config.compress_ratio,
                cu_seqlen_ks_out=buffers["cu_seqlen_ks"],
                cu_seqlen_ke_out=buffers["cu_seqlen_ke"],
                context_cumsum_out=buffers["context_cumsum"],
                index_staging=self._prefill_staging.writable(),
                index_scratch=buffers["prefill_row_index"],
                cumsum_scratch=buffers["prefill_cumsum_pairs"],
            )
            self._prefill_staging.shipped()
            first_row = int(qsl[num_decodes])
            self._local_prefill_ends(first_row, first_row + num_prefill_tokens)
            plans = plan_prefill_chunks(
                chunks,
                qsl,
                upper,
                context_lens,
                config.compress_ratio,
                config.candidate_block_size,
                self.min_gather_width,
                batch.query_start_loc,
                query_start_loc_out=buffers["chunk_query_start_loc"],
                row_ends_out=buffers["prefill_row_ends"],
                block_ends_out=buffers.get("prefill_block_ends"),
            )
            plans = self._local_plans(plans)

        decode_use_gather, gather_launches = self._gather_plan(batch, num_decodes, chunks, plans)
        return IndexerMetadata(
            num_reqs=num_reqs,
            num_tokens=batch.num_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=decode_rows,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            context_lens=context_lens,
            decode=decode,
            chunks=tuple(chunks),
            plans=tuple(plans),
            decode_use_gather=decode_use_gather,
            gather_launches=gather_launches,
            global_row_ends=self._global_row_ends(batch.num_tokens),
        )


class CandidateIndexerMetadataBuilder(IndexerMetadataBuilder):
    """The two-level indexer's builder (DeepSeek-V4.1): the dense plan plus the gather gates.

    With `config.sparse_logits` it validates the candidate configuration and sets
    `num_candidate_cols`, `rows_per_launch` (the consumers' prefill rows per launch,
    `max(1, min(max_logits_bytes, 2**31 - 1) // (4 * num_candidate_cols))`) and the gates:
    decode rows gather when the step's widest decode context (upper bound // R) is at least
    3.0x `num_candidate_cols`, or always with `full_graph_decode` (a FULL graph cannot follow a
    per-step gate); a prefill chunk gathers when its width is at least 1.5x, i.e.
    `min_gather_width = ceil(1.5 * num_candidate_cols)` (widths are integers, so the ceiling
    is the same gate). Without sparse_logits nothing gathers.
    """

    def _set_gather_gates(self) -> None:
        super()._set_gather_gates()
        config = self.config
        self.num_candidate_cols = config.num_candidate_cols if config.sparse_logits else 0
        if config.sparse_logits:
            cols = self.num_candidate_cols
            self.rows_per_launch = config.consumer_rows_per_launch
            self.min_gather_width = math.ceil(PREFILL_GATHER_FACTOR * cols)
            self.decode_gather_width = math.ceil(DECODE_GATHER_FACTOR * cols)

    def _check_config(self) -> CacheLayout:
        layout = super()._check_config()
        config = self.config
        if not config.sparse_logits:
            return layout
        c = config.candidate_block_size
        if c <= 0 or config.candidate_topk_blocks <= 0:
            raise ValueError(
                "sparse_logits=True needs candidate blocks: candidate_block_size = "
                f"{c}, candidate_topk_blocks = {config.candidate_topk_blocks}"
            )
        if not is_power_of_two(config.candidate_topk_blocks):
            raise ValueError(
                f"candidate_topk_blocks must be a power of two, got {config.candidate_topk_blocks}"
            )
        if config.page_entries % c:
            raise ValueError(
                f"candidate_block_size = {c} must divide page_entries = {config.page_entries} "
                f"(block_size {config.block_size} // compress_ratio {config.compress_ratio})"
            )
        if c > layout.n_per_tile or layout.n_per_tile % c:
            raise ValueError(
                f"candidate_block_size = {c} must divide the cache layout's n_per_tile = "
                f"{layout.n_per_tile} (one candidate block within one tile)"
            )
        return layout
