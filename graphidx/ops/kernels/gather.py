"""Compact gather logits over a candidate pool, and the remap of their top-k, in Triton
(docs/contract.md sections 5.4 and 5.5).

`gather_mqa_logits`: program (r, i) scores compact columns [i * SPLIT, (i + 1) * SPLIT) of
row r in tiles of BLOCK_N columns. Column j scores key position
p = positions[r, j // C] + j % C, so a tile's keys come in runs of C consecutive entries of
one page (C divides the page); each key is located and decoded exactly as in the dense kernel
(mxfp4_tl), and `K [BLOCK_N, D] @ Q^T [D, HP]` (the row's own heads, decoded once per
program) goes through the tensor cores. Columns that are not real keys (padding slot, p
outside [0, context)) are -inf and read nothing; columns >= live are untouched unless
`clean`. Candidate sets differ per row, so rows share no K tile.

`remap_compact_topk`: an elementwise kernel, safe in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphidx.config import cdiv
from graphidx.ops.kernels import (
    OPERANDS_FP32,
    fp8_tl,
    multiprocessor_count,
    next_power_of_2,
    operand_mode,
    require_bf16_tensor_cores,
)
from graphidx.ops.kernels.launch import launch
from graphidx.ops.kernels.logits import (
    MIN_MMA_COLUMNS,
    PagedQueryShape,
    check_launch_options,
    launch_options,
    operand_strides,
    padded_heads,
)
from graphidx.ops.kernels.mxfp4_tl import (
    BF16X2_OPERANDS,
    LINE_ENTRIES,
    cache_words,
    decode_key_tile,
    dequantize_tile,
    key_tile_words,
    load_query_codes,
    mma_operand,
    prefetch_key_tile,
    relu_propagate_nan,
    seq_of_row,
    tile_scores,
)
from graphidx.ops.kernels.ptx import store_b32, wait_for_prior_kernels

GATHER_SPLIT_COLUMNS = 2048
"""Compact columns per program by default: amortizes the Q decode and fills the GPU at 128
rows."""
MAX_SPLIT_COLUMNS = 1 << 20
MAX_BLOCK_N = GATHER_SPLIT_COLUMNS
"""Largest tile (columns): bounds candidate_block_size through `default_config`."""


class Occupancy(NamedTuple):
    """The default config's occupancy trade at one head count (`default_config`)."""

    max_registers: int
    prefetch: bool
    uncapped_programs_per_sm: int
    """Programs an SM holds without the cap (by the sm_90 SASS's register count)."""


GATHER_OCCUPANCY = {32: Occupancy(64, False, 3), 64: Occupancy(128, True, 2)}
"""By padded heads (16 counts as 32), at 128-key tiles (the size measured), on NVIDIA: the cap
and prefetch used when the grid is wider than the uncapped config holds at once (159 / 194
registers uncapped). Wider heads and tiles run uncapped with the prefetch."""
MIN_SPLIT_TILES = 4
"""Fewest tiles per program `default_config` splits a small batch's rows into (each program
decodes its row's queries once)."""

REMAP_BLOCK = 1024


@dataclass(frozen=True)
class GatherConfig:
    """Tile shape and launch parameters of one gather launch (chosen from shapes)."""

    block_n: int
    num_warps: int
    num_stages: int
    prefetch: bool = True
    """Run the chain of dependent reads ahead of the scoring (see the kernel): the next
    tile's codes are prefetched into L1, later tiles' pages and positions are loading,
    instead of each tile's whole chain of reads when it is scored."""
    max_registers: int | None = None
    """Cap on registers per thread (Triton's maxnreg, NVIDIA only; None: the compiler's
    choice): trades spills for resident programs."""
    split: int = GATHER_SPLIT_COLUMNS
    """Compact columns per program (a multiple of block_n): the grid is rows x
    ceil(width / split)."""


def check_config(config: GatherConfig) -> None:
    """ValueError naming the first field of `config` the gather kernel cannot run."""
    block_n = config.block_n
    if block_n & (block_n - 1) or not MIN_MMA_COLUMNS <= block_n <= MAX_BLOCK_N:
        raise ValueError(
            f"config.block_n must be a power of two in [{MIN_MMA_COLUMNS}, {MAX_BLOCK_N}], "
            f"got {block_n}"
        )
    if config.split % block_n or not block_n <= config.split <= MAX_SPLIT_COLUMNS:
        raise ValueError(
            f"config.split must be a positive multiple of block_n = {block_n} (whole tiles "
            f"per program) up to {MAX_SPLIT_COLUMNS}, got {config.split}"
        )
    check_launch_options(config, operand_mode())


def default_config(
    candidate_block_size: int, num_heads: int, rows: int, width: int, multiprocessors: int
) -> GatherConfig:
    """The config of a launch over `rows` x `width` compact columns on a GPU of
    `multiprocessors` SMs.

    A grid the SMs hold uncapped at GATHER_SPLIT_COLUMNS is split finer (halving the split
    down to MIN_SPLIT_TILES tiles per program, while halving adds programs) until it outgrows
    them, so a small batch also gets the occupancy config: 16 rows x 16384, C 8, H32 32.6 ->
    21.7 us, H64 36.1 -> 22.5 (split 512; 128 rows unchanged).

    128 keys per tile on a GPU (sm_90 SASS of the tile loop: 659 instructions per warp and
    128 keys, against 2 x 383 at 64); the loads are gathers, so no shared-memory pipelining
    (num_stages 1): latency is hidden by resident programs and by running the reads ahead
    (`prefetch`: 114.1 -> 108.5 us at H32, 128 x 16384, C 8 with the L1 prefetch of the next
    tile's codes).

    On NVIDIA, when the grid has more programs than the SMs hold uncapped (3 per SM at 32
    heads, 2 at 64), occupancy wins over the rest (128 x 16384, C 8; docs/perf-notes.md):
    - up to 32 padded heads, registers capped at 64 (8 resident programs per SM) and no
      prefetch (its registers cost more programs than its latency saves): tile loop 677
      SASS instructions against 675, 42 local loads / stores in the kernel; H32 108.5 ->
      91.4 us;
    - at 64 heads, capped at 128 with the prefetch (4 programs; no spills, 785 instructions
      against 739): H64 143.3 -> 117.9 us (without the prefetch 128.7, capped at 96 149.2).
    A grid the SMs hold at once gains nothing from more room and loses the prefetch and
    the spills: at 16 rows and the full split (128 programs) the capped configs measured
    52.2 / 43.4 us against 32.5 / 36.6 uncapped (H32 / H64), hence the finer split first.
    Wider heads, and tiles wider than 128 keys (C > 128), run uncapped with the prefetch
    (not measured)."""
    block_n = 16 if operand_mode() == OPERANDS_FP32 else 128
    block_n = max(block_n, next_power_of_2(candidate_block_size))
    cap, prefetch, split = None, True, GATHER_SPLIT_COLUMNS
    if operand_mode() == BF16X2_OPERANDS.value and block_n == 128:
        tuned = GATHER_OCCUPANCY.get(max(padded_heads(num_heads), 32))
        if tuned is not None:
            held = tuned.uncapped_programs_per_sm * multiprocessors
            while (
                split > MIN_SPLIT_TILES * block_n
                and rows * cdiv(width, split) <= held
                and cdiv(width, split // 2) > cdiv(width, split)  # halving adds programs
            ):
                split //= 2
            if rows * cdiv(width, split) > held:
                cap, prefetch = tuned.max_registers, tuned.prefetch
    return GatherConfig(
        block_n=block_n,
        num_warps=4,
        num_stages=1,
        prefetch=prefetch,
        max_registers=cap,
        split=split,
    )


@triton.jit
def _tile_firsts(tile_start, score_stop, pos_row, pool_blocks, C: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """First key position of each column's pool block (-1: padding, or past score_stop)."""
    col = tile_start + tl.arange(0, BLOCK_N)
    block = col // C
    return tl.load(pos_row + block, mask=(col < score_stop) & (block < pool_blocks), other=-1)


@triton.jit
def _slots_of(tile_start, firsts, score_stop, context, block_row, C: tl.constexpr,
              E: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(page, slot in page, scored) of a tile's columns from `_tile_firsts`: a column is
    scored when it is below score_stop, its pool block is live and its position is below the
    context; other columns read page 0 and are never loaded."""
    col = tile_start + tl.arange(0, BLOCK_N)
    position = firsts + col % C
    scored = (col < score_stop) & (firsts >= 0) & (position < context)
    # Unsigned from here: page and slot arithmetic on powers of two become shifts.
    position = tl.where(scored, position, 0).to(tl.uint32)
    page = tl.load(block_row + position // E, mask=scored, other=0)
    return page, (position % E).to(tl.int32), scored


@triton.jit
def _tile_slots(tile_start, score_stop, context, block_row, pos_row, pool_blocks,
                C: tl.constexpr, E: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """`_slots_of` the tile, its positions loaded here."""
    firsts = _tile_firsts(tile_start, score_stop, pos_row, pool_blocks, C, BLOCK_N)
    return _slots_of(tile_start, firsts, score_stop, context, block_row, C, E, BLOCK_N)


@triton.jit
def _tile_keys(page, slot, scored, kv_ptr, page_stride, KEYS: tl.constexpr):  # fmt: skip
    """Raw codes and scales of the scored columns' keys (`key_tile_words`)."""
    page_ptr = kv_ptr + page.to(tl.int64) * page_stride
    return key_tile_words(page_ptr, slot, scored, KEYS, True)


@triton.jit
def _prefetch_tile(page, slot, scored, kv_ptr, page_stride, KEYS: tl.constexpr,
                   LINE_RUN: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """L1 prefetch of a tile's codes from `_slots_of` (`prefetch_key_tile`): one slot per
    LINE_RUN columns (LINE_ENTRIES when C is a multiple of it: such a run is LINE_ENTRIES
    consecutive slots of one page, sharing their lines)."""
    runs: tl.constexpr = page.shape[0] // LINE_RUN
    page = tl.max(tl.reshape(page, [runs, LINE_RUN]), axis=1)
    slot = tl.max(tl.reshape(slot, [runs, LINE_RUN]), axis=1)
    scored = tl.max(tl.reshape(scored.to(tl.int32), [runs, LINE_RUN]), axis=1) != 0
    page_ptr = kv_ptr + page.to(tl.int64) * page_stride
    prefetch_key_tile(page_ptr, slot, scored, KEYS, PTX)


@triton.jit
def _exact_logits(values, scales, queries_t, weights, OPERANDS: tl.constexpr):
    """One tile's logits on the exact path (`decode_key_tile`, the exact query operand)."""
    keys = decode_key_tile(values, scales, OPERANDS)
    scores = relu_propagate_nan(tile_scores(keys, queries_t, OPERANDS))
    return tl.sum(scores * weights[None, :], axis=1)


@triton.jit
def _score_tile(tile_start, values, scales, scored, queries, out_row, score_stop, reference,
                OPERANDS: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """Decode, multiply and store one tile: -inf where not scored, nothing past score_stop.
    queries: (exact Q^T, weights, e4m3 Q^T, factored weights, e4m3 usable) as
    `graphidx.ops.kernels.logits._group_queries` builds them; FP8 takes the e4m3 operands,
    the keys against the exponent `reference` (`fp8_keys`: keys outside its window get wrong
    columns, which the caller rescores)."""
    col = tile_start + tl.arange(0, BLOCK_N)
    if FP8:
        keys8 = fp8_tl.fp8_keys(values, scales, reference, OPERANDS == BF16X2_OPERANDS)
        scores = relu_propagate_nan(tl.dot(keys8, queries[2]))
        logits = tl.sum(scores * queries[3][None, :], axis=1) * fp8_tl.fp8_key_factor(reference)
    else:
        logits = _exact_logits(values, scales, queries[0], queries[1], OPERANDS)
    logits = tl.where(scored, logits, float("-inf"))
    store_b32(out_row + col, logits, col < score_stop, OPERANDS == BF16X2_OPERANDS)


@triton.jit
def _walk_columns(col_start, score_stop, context, block_row, pos_row, pool_blocks, queries,
                  out_row, kv_ptr, page_stride, KEYS: tl.constexpr, C: tl.constexpr,
                  BLOCK_N: tl.constexpr, OPERANDS: tl.constexpr, PREFETCH: tl.constexpr,
                  LINE_RUN: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """Score compact columns [col_start, score_stop) of one row tile by tile (col_start <
    score_stop). FP8: on e4m3 operands, every key against one exponent reference taken from
    the first tile; returns int32 1 when every scored key was held exactly (else its columns
    are wrong: the caller walks again exactly). Without FP8: exact, returns 1."""
    slot_args = (score_stop, context, block_row, pos_row, pool_blocks)
    if FP8:
        page, slot, scored = _tile_slots(col_start, *slot_args, C, KEYS.E, BLOCK_N)
        _, first_scales = _tile_keys(page, slot, scored, kv_ptr, page_stride, KEYS)
        reference = fp8_tl.fp8_key_reference(first_scales, scored[:, None, None, None])
    else:
        reference = 0
    low = tl.full([BLOCK_N, KEYS.SUB, 1, 4], 255, tl.int32)
    high = tl.full([BLOCK_N, KEYS.SUB, 1, 4], 0, tl.int32)
    tile_args = (queries, out_row, score_stop, reference)
    if PREFETCH:
        # The chain of dependent reads runs ahead of the scoring: while tile i is scored,
        # tile i + 1's codes are prefetched into L1 (its page was read a tile earlier),
        # tile i + 2's pages and tile i + 3's positions are loading; each read waits a
        # whole tile for the one it depends on, and tile i's codes come from L1.
        page, slot, scored = _tile_slots(col_start, *slot_args, C, KEYS.E, BLOCK_N)
        page1, slot1, scored1 = _tile_slots(col_start + BLOCK_N, *slot_args, C, KEYS.E, BLOCK_N)
        firsts = _tile_firsts(col_start + 2 * BLOCK_N, score_stop, pos_row, pool_blocks, C,
                              BLOCK_N)  # fmt: skip
        for tile_start in range(col_start, score_stop, BLOCK_N):
            _prefetch_tile(page1, slot1, scored1, kv_ptr, page_stride, KEYS, LINE_RUN,
                           OPERANDS == BF16X2_OPERANDS)  # fmt: skip
            values, scales = _tile_keys(page, slot, scored, kv_ptr, page_stride, KEYS)
            page2, slot2, scored2 = _slots_of(
                tile_start + 2 * BLOCK_N, firsts, score_stop, context, block_row, C, KEYS.E,
                BLOCK_N,
            )  # fmt: skip
            firsts = _tile_firsts(tile_start + 3 * BLOCK_N, score_stop, pos_row,
                                  pool_blocks, C, BLOCK_N)  # fmt: skip
            _score_tile(tile_start, values, scales, scored, *tile_args,
                        OPERANDS, BLOCK_N, FP8)  # fmt: skip
            if FP8:
                low, high = fp8_tl.fp8_key_span(low, high, scales, scored[:, None, None, None])
            page, slot, scored = page1, slot1, scored1
            page1, slot1, scored1 = page2, slot2, scored2
    else:
        for tile_start in range(col_start, score_stop, BLOCK_N):
            page, slot, scored = _tile_slots(tile_start, *slot_args, C, KEYS.E, BLOCK_N)
            values, scales = _tile_keys(page, slot, scored, kv_ptr, page_stride, KEYS)
            _score_tile(tile_start, values, scales, scored, *tile_args,
                        OPERANDS, BLOCK_N, FP8)  # fmt: skip
            if FP8:
                low, high = fp8_tl.fp8_key_span(low, high, scales, scored[:, None, None, None])
    if FP8:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        held = fp8_tl.fp8_keys_held(low, high, reference)
    else:
        held = 1
    return held


@triton.jit(do_not_specialize=["ctx_ptr", "live_ptr", "qsl_ptr", "num_seqs", "rows_per_seq"])
def _gather_logits_kernel(
    q_ptr,
    q_scale_ptr,
    kv_ptr,
    w_ptr,
    ctx_ptr,
    bt_ptr,
    positions_ptr,
    live_ptr,
    out_ptr,
    qsl_ptr,
    q_row_stride,
    q_head_stride,
    qs_row_stride,
    qs_head_stride,
    page_stride,
    w_row_stride,
    bt_row_stride,
    pos_row_stride,
    out_row_stride,
    num_seqs,
    rows_per_seq,
    pool_blocks,
    out_width,
    H: tl.constexpr,
    HP: tl.constexpr,
    KEYS: tl.constexpr,
    GROUPING: tl.constexpr,
    C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    CLEAN: tl.constexpr,
    OPERANDS: tl.constexpr,
    PREFETCH: tl.constexpr,
    LINE_RUN: tl.constexpr,
    FP8: tl.constexpr,
):
    wait_for_prior_kernels()
    row = tl.program_id(0)
    col_start = tl.program_id(1) * SPLIT
    if GROUPING == 1:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        seq = seq_of_row(row, qsl_ptr, num_seqs)
    else:
        seq = row // rows_per_seq
    live = tl.minimum(tl.maximum(tl.load(live_ptr + row), 0), out_width)
    col_stop = tl.minimum(col_start + SPLIT, out_width)
    score_stop = tl.minimum(col_stop, live)
    out_row = out_ptr + row.to(tl.int64) * out_row_stride
    if col_start < score_stop:
        head = tl.arange(0, HP)
        head_ok = head < H
        q_words, q_scales = load_query_codes(q_ptr, q_scale_ptr, row + 0 * head, head, head_ok,
                                         q_row_stride, q_head_stride, qs_row_stride,
                                         qs_head_stride, KEYS)  # fmt: skip
        queries_t = mma_operand(tl.trans(dequantize_tile(q_words, q_scales)), OPERANDS)
        weights = tl.load(w_ptr + row.to(tl.int64) * w_row_stride + head, mask=head_ok, other=0.0)
        if FP8:
            queries8, weights8, fp8_ok = fp8_tl.fp8_queries(q_words, q_scales, weights,
                                                     OPERANDS == BF16X2_OPERANDS)  # fmt: skip
            queries = (queries_t, weights, queries8, weights8, fp8_ok)
        else:
            queries = (queries_t, weights, queries_t, weights, False)
        context = tl.load(ctx_ptr + seq)
        block_row = bt_ptr + seq.to(tl.int64) * bt_row_stride
        pos_row = positions_ptr + row.to(tl.int64) * pos_row_stride
        # (Constexprs are passed one by one: Triton 3.6 drops them from unpacked tuples.)
        walk_args = (col_start, score_stop, context, block_row, pos_row, pool_blocks, queries,
                     out_row, kv_ptr, page_stride)  # fmt: skip
        exact = tl.full([], 1, tl.int32)
        if FP8:  # noqa: SIM102 (a constexpr branch around a runtime one)
            # The row's columns on e4m3 operands; if a key was not held exactly, the exact
            # walk scores them all again.
            if fp8_ok:
                held = _walk_columns(*walk_args, KEYS, C, BLOCK_N, OPERANDS, PREFETCH,
                                     LINE_RUN, True)  # fmt: skip
                exact = 1 - held
        if exact != 0:
            if FP8:
                # The fp8 walk's stores come first, whichever thread made them.
                tl.debug_barrier()
            _walk_columns(*walk_args, KEYS, C, BLOCK_N, OPERANDS, PREFETCH, LINE_RUN, False)
    if CLEAN:
        for tile_start in range(tl.maximum(col_start, live), col_stop, BLOCK_N):
            col = tile_start + tl.arange(0, BLOCK_N)
            tl.store(
                out_row + col,
                tl.full([BLOCK_N], float("-inf"), tl.float32),
                mask=col < col_stop,
            )


@triton.jit
def _remap_kernel(
    compact_ptr,
    positions_ptr,
    out_ptr,
    compact_row_stride,
    pos_row_stride,
    out_row_stride,
    k,
    pool_cols,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
):
    wait_for_prior_kernels()
    row = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = slot < k
    column = tl.load(compact_ptr + row * compact_row_stride + slot, mask=in_row, other=-1)
    valid = (column >= 0) & (column < pool_cols)
    first = tl.load(positions_ptr + row * pos_row_stride + column // C, mask=valid, other=0)
    tl.store(
        out_ptr + row * out_row_stride + slot,
        tl.where(valid, first + column % C, -1),
        mask=in_row,
    )


def gather_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    live_cols: torch.Tensor,
    out: torch.Tensor,
    *,
    candidate_block_size: int,
    query_start_loc: torch.Tensor | None = None,
    next_n: int | None = None,
    clean: bool = False,
    page_entries: int | None = None,
    precision: str = "exact",
    config: GatherConfig | None = None,
) -> None:
    """Triton `gather_mqa_logits` (docs/contract.md section 5.4; arguments validated by the
    wrapper, `precision` resolved by `graphidx.ops.backend.resolve_precision`).

    Same contract as `graphidx.ops.gather_mqa_logits`; `config` overrides the shape-chosen
    tiles (tuning hook, checked by `check_config`). Reads no device value on the host.
    """
    shape = PagedQueryShape.of(q, kv_cache, query_start_loc, next_n, page_entries)
    rows, out_width = shape.rows, out.shape[1]
    require_bf16_tensor_cores(q.device)
    cfg = config or default_config(
        candidate_block_size, shape.num_heads, rows, out_width, multiprocessor_count(q.device)
    )
    check_config(cfg)
    kv_words = cache_words(kv_cache)
    if rows == 0 or out_width == 0:
        return
    qsl = query_start_loc if query_start_loc is not None else context_lens
    grid = (rows, cdiv(out_width, cfg.split))
    launch(_gather_logits_kernel, grid,
        q, q_scale, kv_words, weights, context_lens, block_table, positions, live_cols, out, qsl,
        *operand_strides(q, q_scale, kv_words, weights, block_table), positions.stride(0),
        out.stride(0),
        # rows_per_seq is a runtime value: a prefill gather launch is one seq of any number
        # of rows, and a constexpr would compile the kernel again for every launch size.
        shape.num_seqs, shape.rows_per_seq, positions.shape[1], out_width,
        **shape.tile_constexprs(),
        GROUPING=shape.grouping,
        C=candidate_block_size,
        BLOCK_N=cfg.block_n,
        SPLIT=cfg.split,
        CLEAN=clean,
        OPERANDS=operand_mode(),
        PREFETCH=cfg.prefetch,
        LINE_RUN=LINE_ENTRIES.value if candidate_block_size % LINE_ENTRIES.value == 0 else 1,
        FP8=precision == "fp8",
        **launch_options(cfg),
    )  # fmt: skip


def remap_compact_topk(
    compact_topk: torch.Tensor,
    positions: torch.Tensor,
    candidate_block_size: int,
    out: torch.Tensor,
) -> None:
    """Triton `remap_compact_topk` (docs/contract.md section 5.5); `out` may be `compact_topk`.

    out[r, i] = positions[r, j // C] + j % C for j = compact_topk[r, i] in [0, KB * C),
    else -1.
    """
    rows, k = compact_topk.shape
    if rows == 0 or k == 0:
        return
    grid = (rows, cdiv(k, REMAP_BLOCK))
    launch(
        _remap_kernel,
        grid,
        compact_topk,
        positions,
        out,
        compact_topk.stride(0),
        positions.stride(0),
        out.stride(0),
        k,
        positions.shape[1] * candidate_block_size,
        C=candidate_block_size,
        BLOCK=REMAP_BLOCK,
    )


__all__ = [
    "GatherConfig",
    "check_config",
    "default_config",
    "gather_mqa_logits",
    "remap_compact_topk",
]
