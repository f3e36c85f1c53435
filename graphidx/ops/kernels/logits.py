"""Dense paged MXFP4 MQA logits in Triton (docs/contract.md section 5.1, `paged_mqa_logits`).

One program scores a *row group* (rows of one seq that share every K tile) against a range of
that seq's keys, walking it in tiles of BLOCK_N keys:

    K tile  [BLOCK_N, D]           decoded in registers from the paged cache (mxfp4_tl)
    Q^T     [D, BLOCK_R * HP]      the group's rows x heads, decoded once per program
    S = K @ Q^T                    tensor cores, float32 accumulation
    logits[t, r] = sum_h w[r, h] * relu(S[t, r * HP + h])

Keys are the MMA's M dimension, so the instruction shape stays legal for 32 or 64 heads and
any number of rows. Block scores come from the same tile (BLOCK_N is a multiple of C, and
every key range starts on a tile boundary, so no candidate block straddles two programs).
Columns past a row's end are never written here; `clean` runs `_clean_kernel` over exactly
those columns afterwards.

Row groups and grids (all decided by shapes, never by device values):
- native decode (`next_n`) / flattened: a seq's next_n rows (one row when flattened) form
  one group, or cdiv(next_n, BLOCK_R) groups of BLOCK_R rows when next_n exceeds BLOCK_R
  (N = BLOCK_R * heads_pad <= 128 columns by default). Static grid (groups, cdiv(W,
  SPLIT)): program (g, i) scores keys [i * SPLIT, +SPLIT) and exits at once past the
  group's span. With a `schedule`
  (graphidx.ops.schedule) a persistent grid of `multiprocessor_count * programs_per_sm`
  programs walks the schedule's (seq, key_start, key_end) items instead (every row block
  of the seq), so one long request is split across the GPU.
- prefill (`query_start_loc`): groups are row blocks of <= BLOCK_R rows that never cross a
  seq boundary, found on the device: programs [0, cdiv(rows, BLOCK_R)) take the aligned block
  starting at row g * BLOCK_R, clipped to the seq holding that row (binary search of
  query_start_loc); program cdiv(rows, BLOCK_R) + s takes seq s's head rows
  [qsl[s], min(qsl[s + 1], round_up(qsl[s], BLOCK_R))) when qsl[s] is not aligned. Every
  row lands in exactly one group; extra programs exit. Grid axis 1 splits the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

from graphidx.config import cdiv
from graphidx.mxfp4 import CacheLayout, cache_layout
from graphidx.ops.kernels import (
    OPERANDS_BF16X2,
    OPERANDS_FP32,
    multiprocessor_count,
    next_power_of_2,
    operand_mode,
    require_bf16_tensor_cores,
)
from graphidx.ops.kernels.fp8_tl import (
    fp8_key_factor,
    fp8_key_reference,
    fp8_key_span,
    fp8_keys,
    fp8_keys_held,
    fp8_queries,
)
from graphidx.ops.kernels.launch import launch
from graphidx.ops.kernels.mxfp4_tl import (
    BF16X2_OPERANDS,
    KeyTiling,
    cache_words,
    decode_key_tile,
    dequantize_tile,
    key_tile_words,
    key_tile_words_mma,
    key_tiling,
    load_query_codes,
    max_propagate_nan,
    mma_operand,
    mma_tile_rows,
    prefetch_tile_l2,
    relu_propagate_nan,
    seq_of_row,
    tile_scores,
)
from graphidx.ops.kernels.ptx import store_b32, wait_for_prior_kernels
from graphidx.ops.kernels.schedule import (
    COMPLETE,
    GROUP_COUNT,
    GROUP_ROWS,
    ITEM_COUNT,
    ITEM_GROUP,
    ITEM_KEY_END,
    ITEM_KEY_START,
)
from graphidx.ops.schedule_format import SCHEDULE_HEADER_INTS, SCHEDULE_ITEM_INTS, SPLIT_ALIGNMENT

GROUP_FIXED = 0  # next_n rows (or one row) per seq
GROUP_QUERY_START_LOC = 1  # rows of a seq given by query_start_loc


DECODE_SPLIT_KEYS = 2048
"""Keys per program of the static decode grid (and of the untrusted-schedule walk)."""

PREFILL_SPLIT_KEYS = 4096
"""Keys per prefill program; a multiple of every BLOCK_N, amortizes the Q decode."""

CLEAN_BLOCK = 1024
ITEM_ALIGNMENT = tl.constexpr(SPLIT_ALIGNMENT)
"""graphidx.ops.schedule.SPLIT_ALIGNMENT for the kernels: every item starts on a multiple."""

_PER_STEP_ARGS = ["ctx_ptr", "row_ends_ptr", "qsl_ptr", "rows", "num_seqs", "width"]
"""Arguments that change from step to step (metadata views start anywhere in their buffers,
row and seq counts and widths take any value) and only feed scalar loads and bounds: not
specializing them keeps one compiled variant per tile config instead of one per combination
of their `== 1` / `% 16` / pointer-alignment properties (see tools/count_specializations.py).
"""
MIN_MMA_COLUMNS = 16  # tl.dot needs N >= 16


class LaunchOptions(Protocol):
    """The Triton launch options a logits or gather config carries."""

    @property
    def num_warps(self) -> int: ...

    @property
    def num_stages(self) -> int: ...

    @property
    def max_registers(self) -> int | None: ...


def check_launch_options(config: LaunchOptions, mode: int) -> None:
    """ValueError naming the first launch option of `config` the kernels cannot run under
    operand mode `mode` (`operand_mode()`): num_warps 4 or 8, num_stages >= 1, max_registers
    None or in [24, 255] (OPERANDS_BF16X2 only: NVIDIA)."""
    if config.num_warps not in (4, 8):
        raise ValueError(f"config.num_warps must be 4 or 8, got {config.num_warps}")
    if config.num_stages < 1:
        raise ValueError(f"config.num_stages must be >= 1, got {config.num_stages}")
    if config.max_registers is not None:
        if not 24 <= config.max_registers <= 255:
            raise ValueError(
                f"config.max_registers must be in [24, 255] or None, got {config.max_registers}"
            )
        if mode != OPERANDS_BF16X2:
            raise ValueError(
                f"config.max_registers is an NVIDIA GPU option (Triton's maxnreg), got "
                f"{config.max_registers} on a {'ROCm GPU' if torch.version.hip else 'CPU'}"
            )


def launch_options(config: LaunchOptions) -> dict[str, int]:
    """`config`'s options as `launch` keywords (`maxnreg` only when capped)."""
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.max_registers is not None:
        options["maxnreg"] = config.max_registers
    return options


def padded_heads(num_heads: int) -> int:
    """The MMA's N per row: heads padded to a power of two, at least MIN_MMA_COLUMNS."""
    return max(next_power_of_2(num_heads), MIN_MMA_COLUMNS)


@dataclass(frozen=True)
class PagedQueryShape:
    """What a logits launcher (dense or gather) knows of its paged MXFP4 query from shapes
    alone: `rows` query rows of `num_heads` heads of `head_dim`, the cache `layout`, the row
    grouping (GROUP_FIXED: `rows_per_seq` consecutive rows per seq; GROUP_QUERY_START_LOC:
    seqs given by query_start_loc, rows_per_seq 1), `num_seqs`, and the key-tile constexprs
    `keys` (`key_tiling`)."""

    rows: int
    num_heads: int
    head_dim: int
    layout: CacheLayout
    grouping: int
    rows_per_seq: int
    num_seqs: int
    keys: KeyTiling

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        query_start_loc: torch.Tensor | None,
        next_n: int | None,
        page_entries: int | None,
        *,
        scheduled: bool = False,
    ) -> PagedQueryShape:
        """The shape of q uint8 `[rows, H, D/2]` over kv_cache (pages of `page_entries`,
        None: page_stride // entry_bytes) under the row grouping. ValueError for both
        groupings at once, for a decode schedule (`scheduled`) with query_start_loc, and for
        a head_dim the kernels do not tile."""
        rows, num_heads, value_bytes = q.shape
        head_dim = 2 * value_bytes
        if page_entries is None:
            page_entries = kv_cache.shape[1] // (head_dim // 2 + head_dim // 32)
        layout = cache_layout(num_heads, head_dim, page_entries)
        if query_start_loc is not None and next_n is not None:
            raise ValueError("query_start_loc and next_n are exclusive row groupings; got both")
        if query_start_loc is not None:
            if scheduled:
                raise ValueError("schedule is a decode schedule; it cannot drive a prefill launch")
            grouping, rows_per_seq = GROUP_QUERY_START_LOC, 1
            num_seqs = query_start_loc.shape[0] - 1
        else:
            grouping, rows_per_seq = GROUP_FIXED, 1 if next_n is None else next_n
            num_seqs = rows // rows_per_seq
        keys = key_tiling(layout)
        return cls(rows, num_heads, head_dim, layout, grouping, rows_per_seq, num_seqs, keys)

    def tile_constexprs(self) -> dict[str, object]:
        """The constexprs every logits kernel takes for its query and cache tiles."""
        return {"H": self.num_heads, "HP": padded_heads(self.num_heads), "KEYS": self.keys}


def operand_strides(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    kv_words: torch.Tensor,
    weights: torch.Tensor,
    block_table: torch.Tensor,
) -> tuple[int, ...]:
    """The leading strides of every logits kernel, in their order: q's row and head, q_scale's
    row and head, the page (in words of `cache_words`), weights' row and block_table's row."""
    return (
        q.stride(0),
        q.stride(1),
        q_scale.stride(0),
        q_scale.stride(1),
        kv_words.stride(0),
        weights.stride(0),
        block_table.stride(0),
    )


@dataclass(frozen=True)
class LogitsConfig:
    """Tile shape and launch parameters of one dense-logits launch (chosen from shapes;
    `check_config` says which values are accepted).

    num_stages 1 turns Triton's shared-memory pipelining of the key loads off. The kernel
    loads keys straight in the tensor-core operand layout when `uses_mma_rows` holds.
    """

    block_n: int
    block_r: int
    num_warps: int
    num_stages: int
    max_registers: int | None = None
    """Cap on registers per thread (Triton's maxnreg, NVIDIA only; None: the compiler's
    choice): trades spills for resident programs."""
    programs_per_sm: int = 4
    """Persistent programs per multiprocessor of the scheduled decode grid (4: as many as
    fit at 4 warps and <= 128 registers)."""
    prefetch: bool = False
    """Load the next tile's codes into registers while the current tile is processed (meant
    for num_stages 1, where Triton does not pipeline the loads itself). Needs tiles within
    one page (page_entries % block_n == 0): a partial last tile then reads its page's
    remaining slots, which are allocated, and never writes them out."""
    halves: bool = False
    """Two MMAs per tile, over the first and the second block_r / 2 rows, each followed by
    its own epilogue: half the accumulator registers live at a time (needs block_r >= 2)."""
    l2_prefetch: bool = False
    """With `prefetch`: also ask for the tile after the next one to be brought into L2 (one
    `prefetch.global.L2` per line, NVIDIA only; a hint that never changes a result). Needs
    block_n a multiple of 32, so a tile's codes and scales are each one run of its page."""


def uses_mma_rows(config: LogitsConfig, page_entries: int) -> bool:
    """Whether key tiles load in the 4-warp tensor-core operand layout
    (`key_tile_words_mma`): one warpgroup, 64-key multiples lying in one page, not ROCm
    (64-lane wavefronts break the lane mapping; the interpreter keeps it, for the tests)."""
    return (
        config.num_warps == 4
        and config.block_n % 64 == 0
        and page_entries % config.block_n == 0
        and torch.version.hip is None
    )


def check_config(config: LogitsConfig, page_entries: int) -> None:
    """ValueError naming the first field of `config` the kernels cannot run."""
    if config.block_n & (config.block_n - 1) or not 16 <= config.block_n <= SPLIT_ALIGNMENT:
        # Key ranges start on multiples of SPLIT_ALIGNMENT: a tile never straddles two.
        raise ValueError(
            f"config.block_n must be a power of two in [16, {SPLIT_ALIGNMENT}], "
            f"got {config.block_n}"
        )
    if config.block_r < 1 or config.block_r & (config.block_r - 1):
        raise ValueError(f"config.block_r must be a power of two, got {config.block_r}")
    check_launch_options(config, operand_mode())
    if config.programs_per_sm < 1:
        raise ValueError(f"config.programs_per_sm must be >= 1, got {config.programs_per_sm}")
    if config.halves and config.block_r < 2:
        raise ValueError(f"config.halves needs block_r >= 2, got {config.block_r}")
    if config.l2_prefetch and not (config.prefetch and config.block_n % 32 == 0):
        raise ValueError(
            "config.l2_prefetch needs prefetch and block_n a multiple of 32, got "
            f"prefetch={config.prefetch}, block_n={config.block_n}"
        )
    if config.prefetch and page_entries % config.block_n:
        raise ValueError(
            f"config.prefetch needs block_n ({config.block_n}) to divide page_entries "
            f"({page_entries})"
        )


def default_config(
    grouping: int,
    heads_pad: int,
    rows_per_group: int,
    candidate_block_size: int,
    page_entries: int,
    precision: str = "exact",
) -> LogitsConfig:
    """Shape-only config, from the H200 sweeps in BENCHMARKS.md: one warpgroup (4 warps) over
    64 keys and N = block_r * heads_pad <= 128 columns, no shared-memory pipelining
    (num_stages 1), keys loaded in the operand layout (`uses_mma_rows`), the next tile's
    codes prefetched in registers when page_entries % block_n == 0 (prefill 3972 -> 3752-3800
    us at H64, 4096 x 32K); on NVIDIA, decode at N = 128
    caps 64-key tiles at 128 registers (4 resident programs per SM), with >= 2 rows per
    group splits each tile's MMA in two halves of the rows (`LogitsConfig.halves`: few
    spills left) and prefetches the tile after next into L2 (`LogitsConfig.l2_prefetch`:
    H64 64 x 16K 81.7 -> 72.0 us kernel time; at N = 64 its
    instructions cost more than the DRAM wait it hides: H32 184.8 -> 187.9 us, so off);
    prefill keeps the compiler's choice (with the prefetch, a 168-register cap measured
    the same: 3777 vs 3780 us).

    Decode under the fp8 precision (BENCHMARKS.md, "fp8 precision"): at N = 128 one MMA over
    all rows capped at 168 registers, which hold 3 resident programs per SM while the
    persistent grid keeps 4 per SM as measured (H64 64 x 16K: 61.8 us against 69.8
    uncapped with halves, 88.5 capped at 128 with halves, 80.7 without the L2 prefetch); at
    N = 64 capped at 128 registers (H32 64 x 64K: 176.1 against 251.5 at the compiler's 164
    registers, 221.6 capped at 136); both with the L2 prefetch.

    Never depends on lengths, so a graph captured at one step replays at any other.
    """
    # All of a seq's decode rows share each K tile, up to N = 128 columns; prefill row blocks
    # fill N = 128 (N = 256 with 8 warps measured 1.7x slower: one program per SM, no overlap).
    block_r = max(1, 128 // heads_pad)
    if grouping != GROUP_QUERY_START_LOC:
        block_r = min(next_power_of_2(rows_per_group), block_r)
    columns = block_r * heads_pad
    # 64 keys: the wgmma M. The interpreter gets small tiles: they keep the tests fast.
    block_n = 16 if operand_mode() == OPERANDS_FP32 else 64
    block_n = max(block_n, candidate_block_size)
    one_page = page_entries % block_n == 0
    prefill = grouping == GROUP_QUERY_START_LOC
    # Decode at N = 128: 4 resident programs per SM at 128 registers; running each tile's MMA
    # and epilogue over one half of the rows at a time keeps the spills few (none in the
    # scheduled kernel).
    decode_mma = not prefill and operand_mode() == OPERANDS_BF16X2 and block_n == 64
    cap: int | None
    if precision == "fp8" and decode_mma and columns in (64, 128):
        cap, halves, l2_prefetch = (168 if columns == 128 else 128), False, one_page
    else:
        capped = decode_mma and columns >= 128
        cap, halves, l2_prefetch = (128 if capped else None), capped and block_r >= 2, capped
        l2_prefetch = l2_prefetch and one_page
    return LogitsConfig(
        block_n=block_n,
        block_r=block_r,
        num_warps=4 if columns <= 128 else 8,
        num_stages=1,
        max_registers=cap,
        programs_per_sm=4,
        prefetch=one_page,
        halves=halves,
        l2_prefetch=l2_prefetch,
    )


@triton.jit
def _score_group(
    group,
    key_start,
    key_stop,
    ptrs,
    strides,
    sizes,
    H: tl.constexpr,
    HP: tl.constexpr,
    KEYS: tl.constexpr,
    GROUPING: tl.constexpr,
    ROWS_PER_SEQ: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BLOCK_SCORES: tl.constexpr,
    C: tl.constexpr,
    OPERANDS: tl.constexpr,
    MMA_ROWS: tl.constexpr,
    PREFETCH: tl.constexpr,
    HALVES: tl.constexpr,
    FP8: tl.constexpr,
):
    """Score keys [key_start, key_stop) of row group `group` (see the module docstring).

    ptrs, strides and sizes: the kernel's pointer, stride and size arguments, as tuples in
    the order of `_logits_static_kernel`'s signature."""
    q_ptr, q_scale_ptr, kv_ptr, w_ptr, ctx_ptr, bt_ptr, row_ends_ptr, out_ptr, bs_ptr, qsl_ptr = (
        ptrs
    )
    q_row_stride, q_head_stride, qs_row_stride, qs_head_stride, page_stride = strides[:5]
    w_row_stride, bt_row_stride, out_row_stride, bs_row_stride = strides[5:]
    rows, num_seqs, width = sizes
    if GROUPING == 1:
        aligned_blocks = tl.cdiv(rows, BLOCK_R)
        if group < aligned_blocks:
            row_lo = group * BLOCK_R
            seq = seq_of_row(row_lo, qsl_ptr, num_seqs)
            row_hi = tl.minimum(row_lo + BLOCK_R, tl.load(qsl_ptr + seq + 1))
        else:
            seq = group - aligned_blocks
            row_lo = tl.load(qsl_ptr + seq)
            head_end = tl.minimum(tl.load(qsl_ptr + seq + 1), tl.cdiv(row_lo, BLOCK_R) * BLOCK_R)
            # An aligned first row belongs to an aligned block: nothing left for this program.
            row_hi = tl.where(row_lo % BLOCK_R == 0, row_lo, head_end)
    else:
        # A seq's rows in blocks of BLOCK_R (one block unless next_n * heads exceeds the MMA).
        ROW_BLOCKS: tl.constexpr = (ROWS_PER_SEQ + BLOCK_R - 1) // BLOCK_R
        seq = group // ROW_BLOCKS
        row_lo = seq * ROWS_PER_SEQ + (group % ROW_BLOCKS) * BLOCK_R
        row_hi = tl.minimum(row_lo + BLOCK_R, (seq + 1) * ROWS_PER_SEQ)

    row = row_lo + tl.arange(0, BLOCK_R)
    row_ok = row < row_hi
    context = tl.load(ctx_ptr + seq)
    ends = tl.load(row_ends_ptr + row, mask=row_ok, other=0)
    row_len = tl.maximum(tl.minimum(tl.minimum(ends, context), width), 0)
    row_len = tl.where(row_ok, row_len, 0)
    span = tl.max(row_len, axis=0)
    key_stop = tl.minimum(key_stop, span)
    if key_start < key_stop:
        query_args = (q_ptr, q_scale_ptr, w_ptr, row_lo, row_hi, q_row_stride, q_head_stride,
                      qs_row_stride, qs_head_stride, w_row_stride)  # fmt: skip
        if HALVES:
            # Each half of the rows decoded as its own operand: splitting one decoded tile
            # made Triton convert its layout through shared memory 16 times (sm_90: 29 more
            # barriers before the first tile, ~2 us of a one-wave H64 decode).
            ROWS: tl.constexpr = BLOCK_R // 2
            queries_a = _group_queries(*query_args, 0, H, HP, KEYS, ROWS, OPERANDS, FP8)
            queries_b = _group_queries(*query_args, ROWS, H, HP, KEYS, ROWS, OPERANDS, FP8)
        else:
            queries_a = _group_queries(*query_args, 0, H, HP, KEYS, BLOCK_R, OPERANDS, FP8)
            queries_b = queries_a
        block_row = bt_ptr + seq.to(tl.int64) * bt_row_stride
        walk_args = (key_start, key_stop, row, row_len, queries_a, queries_b, out_ptr, bs_ptr,
                     out_row_stride, bs_row_stride, kv_ptr, block_row, page_stride)  # fmt: skip
        exact = tl.full([], 1, tl.int32)
        if FP8:  # noqa: SIM102 (a constexpr branch around a runtime one)
            # The whole range on e4m3 operands; if any of its keys was not held exactly, the
            # exact walk below scores the range again, overwriting every column written.
            if queries_a[4] & queries_b[4]:
                held = _walk_tiles(
                    *walk_args, HP, KEYS, BLOCK_R, BLOCK_N, HAS_BLOCK_SCORES, C, OPERANDS,
                    MMA_ROWS, PREFETCH, HALVES, True,
                )  # fmt: skip
                exact = 1 - held
        if exact != 0:
            if FP8:
                # The fp8 walk's stores come first, whichever thread made them.
                tl.debug_barrier()
            _walk_tiles(
                *walk_args, HP, KEYS, BLOCK_R, BLOCK_N, HAS_BLOCK_SCORES, C, OPERANDS,
                MMA_ROWS, PREFETCH, HALVES, False,
            )  # fmt: skip


@triton.jit
def _group_queries(q_ptr, q_scale_ptr, w_ptr, row_lo, row_hi, q_row_stride, q_head_stride,
                   qs_row_stride, qs_head_stride, w_row_stride, FIRST: tl.constexpr,
                   H: tl.constexpr, HP: tl.constexpr, KEYS: tl.constexpr,
                   ROWS: tl.constexpr, OPERANDS: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """The query operands of rows [row_lo + FIRST, + ROWS) of the group, 0 for heads >= H and
    rows >= row_hi: (Q^T as the exact MMA's B operand `[D, ROWS * HP]`, weights
    `[ROWS * HP]`, then under FP8 Q^T as an e4m3 operand in the fp8 order, the weights times
    each head's factor (`fp8_operand`), and whether the e4m3 operand holds every head
    exactly (`fp8_queries`); without FP8 the last three repeat the exact operand and
    weights, and False)."""
    slot = tl.arange(0, ROWS * HP)
    q_row = row_lo + FIRST + slot // HP
    q_head = slot % HP
    q_ok = (q_row < row_hi) & (q_head < H)
    words, scales = load_query_codes(q_ptr, q_scale_ptr, q_row, q_head, q_ok, q_row_stride,
                                     q_head_stride, qs_row_stride, qs_head_stride,
                                     KEYS)  # fmt: skip
    weights = tl.load(w_ptr + q_row.to(tl.int64) * w_row_stride + q_head, mask=q_ok, other=0.0)
    exact = mma_operand(tl.trans(dequantize_tile(words, scales)), OPERANDS)
    if FP8:
        queries8, weights8, fp8_ok = fp8_queries(
            words, scales, weights, OPERANDS == BF16X2_OPERANDS
        )
        operands = (exact, weights, queries8, weights8, fp8_ok)
    else:
        operands = (exact, weights, exact, weights, False)
    return operands


@triton.jit
def _walk_tiles(
    key_start,
    key_stop,
    row,
    row_len,
    queries_a,
    queries_b,
    out_ptr,
    bs_ptr,
    out_row_stride,
    bs_row_stride,
    kv_ptr,
    block_row,
    page_stride,
    HP: tl.constexpr,
    KEYS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BLOCK_SCORES: tl.constexpr,
    C: tl.constexpr,
    OPERANDS: tl.constexpr,
    MMA_ROWS: tl.constexpr,
    PREFETCH: tl.constexpr,
    HALVES: tl.constexpr,
    FP8: tl.constexpr,
):
    """Score one row group's keys [key_start, key_stop) (key_start < key_stop, a multiple of
    BLOCK_N) tile by tile: full tiles unmasked, then the partial tail (masked loads; with
    PREFETCH it is the loop's last iteration, reading the rest of its page). HALVES: each
    tile takes two MMAs over the first and the second half of the group's rows
    (`LogitsConfig.halves`), with the query operands `queries_a` and `queries_b`
    (`_group_queries` of each half); without it `queries_a` holds all the rows and
    `queries_b` is not used.
    PREFETCH: 0 none, 1 the next tile in registers (`LogitsConfig.prefetch`), 2 that and
    the tile after it into L2 (`LogitsConfig.l2_prefetch`).
    FP8: on e4m3 operands (`_score_rows`); returns int32 1 when every key scored was held
    exactly (`fp8_keys_held`), else 0 (its columns are then wrong). Without FP8: exact,
    returns 1."""
    tl.assume(key_start >= 0)
    tl.assume(key_start % BLOCK_N == 0)
    full_stop = key_start + (key_stop - key_start) // BLOCK_N * BLOCK_N
    if HALVES:
        row_a, row_b = _halves(row)
        len_a, len_b = _halves(row_len)
        tile_args = ((row_a, len_a, queries_a), (row_b, len_b, queries_b),
                     out_ptr, bs_ptr, out_row_stride, bs_row_stride)  # fmt: skip
    else:
        tile_args = ((row, row_len, queries_a), (row, row_len, queries_a),
                     out_ptr, bs_ptr, out_row_stride, bs_row_stride)  # fmt: skip
    PTX: tl.constexpr = OPERANDS == BF16X2_OPERANDS
    if FP8:
        # The e4m3 keys of the whole walk share one exponent reference (`fp8_keys`), taken
        # from the first tile; the walk tracks the exponents it meets to say whether every
        # key it scored was held exactly.
        _, first_scales = _fetch_tile(
            key_start, key_stop, kv_ptr, block_row, page_stride, None,
            KEYS, BLOCK_N, MMA_ROWS, True, PTX,
        )  # fmt: skip
        reference = fp8_key_reference(first_scales, _live_keys(key_start, key_stop, BLOCK_N))
    else:
        reference = 0
    low = tl.full([BLOCK_N, KEYS.SUB, 1, 4], 255, tl.int32)
    high = tl.full([BLOCK_N, KEYS.SUB, 1, 4], 0, tl.int32)
    if PREFETCH:
        # One tile ahead in registers: the next tile's loads are in flight while this one
        # decodes and multiplies, and its block-table entry was loaded a tile before that
        # (PREFETCH 2: the tile after it is on its way into L2 as well).
        # Fetches are unmasked (cheaper) and never start past the last tile holding a live
        # key: a partial tile reads the rest of its page (never written out), the fetch after
        # the last tile repeats it.
        last_start = key_start + (key_stop - 1 - key_start) // BLOCK_N * BLOCK_N
        fetch_args = (key_stop, kv_ptr, block_row, page_stride)
        page = tl.load(block_row + key_start // KEYS.E)
        values, scales = _fetch_tile(
            key_start, *fetch_args, page,
            KEYS, BLOCK_N, MMA_ROWS, False, PTX,
        )  # fmt: skip
        next_page = tl.load(block_row + tl.minimum(key_start + BLOCK_N, last_start) // KEYS.E)
        if PREFETCH == 2:
            later_page = tl.load(
                block_row + tl.minimum(key_start + 2 * BLOCK_N, last_start) // KEYS.E
            )
        # The partial tail tile (if any) is the last iteration: its stores are masked.
        for tile_start in range(key_start, key_stop, BLOCK_N):
            tl.assume(tile_start >= 0)
            next_values, next_scales = _fetch_tile(
                tl.minimum(tile_start + BLOCK_N, last_start), *fetch_args, next_page,
                KEYS, BLOCK_N, MMA_ROWS, False, PTX,
            )  # fmt: skip
            if PREFETCH == 2:
                # The tile after next into L2, its page read an iteration ago.
                later_start = tl.minimum(tile_start + 2 * BLOCK_N, last_start)
                later_ptr = kv_ptr + later_page.to(tl.int64) * page_stride
                prefetch_tile_l2(later_ptr, later_start % KEYS.E, KEYS, BLOCK_N, PTX)
                next_page = later_page
                later_page = tl.load(
                    block_row + tl.minimum(tile_start + 3 * BLOCK_N, last_start) // KEYS.E
                )
            else:
                next_page = tl.load(
                    block_row + tl.minimum(tile_start + 2 * BLOCK_N, last_start) // KEYS.E
                )
            _score_rows(tile_start, reference, values, scales, *tile_args,
                        HP, BLOCK_R, BLOCK_N, HAS_BLOCK_SCORES, C, OPERANDS, HALVES,
                        FP8)  # fmt: skip
            if FP8:
                live = _live_keys(tile_start, key_stop, BLOCK_N)
                low, high = fp8_key_span(low, high, scales, live)
            values, scales = next_values, next_scales
    else:
        fetch_args = (kv_ptr, block_row, page_stride, None)
        for tile_start in range(key_start, full_stop, BLOCK_N):
            values, scales = _fetch_tile(
                tile_start, key_stop, *fetch_args,
                KEYS, BLOCK_N, MMA_ROWS, False, PTX,
            )  # fmt: skip
            _score_rows(tile_start, reference, values, scales, *tile_args,
                        HP, BLOCK_R, BLOCK_N, HAS_BLOCK_SCORES, C, OPERANDS, HALVES,
                        FP8)  # fmt: skip
            if FP8:
                live = _live_keys(tile_start, key_stop, BLOCK_N)
                low, high = fp8_key_span(low, high, scales, live)
        if full_stop < key_stop:
            values, scales = _fetch_tile(
                full_stop, key_stop, *fetch_args,
                KEYS, BLOCK_N, MMA_ROWS, True, PTX,
            )  # fmt: skip
            _score_rows(full_stop, reference, values, scales, *tile_args,
                        HP, BLOCK_R, BLOCK_N, HAS_BLOCK_SCORES, C, OPERANDS, HALVES,
                        FP8)  # fmt: skip
            if FP8:
                live = _live_keys(full_stop, key_stop, BLOCK_N)
                low, high = fp8_key_span(low, high, scales, live)
    if FP8:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        held = fp8_keys_held(low, high, reference)
    else:
        held = 1
    return held


@triton.jit
def _live_keys(tile_start, key_stop, BLOCK_N: tl.constexpr):
    """int1 `[BLOCK_N, 1, 1, 1]`: which keys of the tile are below key_stop."""
    key = tile_start + tl.arange(0, BLOCK_N)
    return (key < key_stop)[:, None, None, None]


@triton.jit
def _fetch_tile(
    tile_start,
    key_stop,
    kv_ptr,
    block_row,
    page_stride,
    page,
    KEYS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MMA_ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    PTX: tl.constexpr,
):
    """Raw codes of keys [tile_start, tile_start + BLOCK_N) of one seq (see `key_tile_words`;
    kv_ptr is the int32 cache of `cache_words`, page_stride in words).

    tile_start is a multiple of BLOCK_N. MASKED reads only keys below key_stop (a tile wholly
    past it reads nothing, not even its block-table entry); unmasked reads the whole tile.
    page: the tile's block-table entry when the caller loaded it ahead (E % BLOCK_N == 0,
    unmasked), else None. MMA_ROWS (4 warps, BLOCK_N a multiple of 64 dividing E) loads in
    the tensor-core operand's thread layout (`key_tile_words_mma`; PTX: NVIDIA).
    """
    key = tile_start + tl.arange(0, BLOCK_N)
    live = key < key_stop
    if KEYS.E % BLOCK_N == 0:
        # The tile lies in one page: one block-table read, one 64-bit page address.
        if page is None:
            if MASKED:
                page = tl.load(
                    block_row + tile_start // KEYS.E, mask=tile_start < key_stop, other=0
                )
            else:
                page = tl.load(block_row + tile_start // KEYS.E)
        page_ptr = kv_ptr + page.to(tl.int64) * page_stride
        if MMA_ROWS:
            rows = mma_tile_rows(BLOCK_N)
            values, scales = key_tile_words_mma(
                page_ptr, tile_start % KEYS.E, rows, rows < key_stop - tile_start,
                KEYS, BLOCK_N, MASKED, PTX,
            )  # fmt: skip
        else:
            entry = tile_start % KEYS.E + tl.arange(0, BLOCK_N)
            values, scales = key_tile_words(page_ptr, entry, live, KEYS, MASKED)
    else:
        page = tl.load(block_row + key // KEYS.E, mask=live, other=0)
        page_ptr = kv_ptr + page.to(tl.int64) * page_stride
        values, scales = key_tile_words(page_ptr, key % KEYS.E, live, KEYS, MASKED)
    return values, scales


@triton.jit
def _halves(x):
    """[N] -> its first and second halves."""
    size: tl.constexpr = x.shape[0]
    return tl.split(tl.permute(tl.reshape(x, [2, size // 2]), (1, 0)))


@triton.jit
def _score_rows(
    tile_start,
    reference,
    values,
    scales,
    rows_a,
    rows_b,
    out_ptr,
    bs_ptr,
    out_row_stride,
    bs_row_stride,
    HP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BLOCK_SCORES: tl.constexpr,
    C: tl.constexpr,
    OPERANDS: tl.constexpr,
    HALVES: tl.constexpr,
    FP8: tl.constexpr,
):
    """Decode one fetched key tile (`_fetch_tile`) and `_score_tile` it over the group's
    rows: `rows_a` = (rows, lengths, query operands of `_group_queries`), or under HALVES
    each half in turn (`rows_a` then `rows_b`, BLOCK_R / 2 rows each).

    FP8: the tile's keys as e4m3 against the exponent `reference` (`fp8_keys`) times the
    e4m3 queries; keys it does not hold get wrong columns (the caller checks the span of
    their exponents). Without FP8 the exact path (reference unused)."""
    tile_args = (out_ptr, bs_ptr, out_row_stride, bs_row_stride)
    ROWS: tl.constexpr = BLOCK_R // 2 if HALVES else BLOCK_R
    if FP8:
        keys8 = fp8_keys(values, scales, reference, OPERANDS == BF16X2_OPERANDS)
        key_factor = fp8_key_factor(reference)
        _score_tile(tile_start, keys8, key_factor, rows_a[0], rows_a[1], rows_a[2][2],
                    rows_a[2][3], *tile_args, HP, ROWS, BLOCK_N, HAS_BLOCK_SCORES, C,
                    OPERANDS)  # fmt: skip
        if HALVES:
            _score_tile(tile_start, keys8, key_factor, rows_b[0], rows_b[1], rows_b[2][2],
                        rows_b[2][3], *tile_args, HP, ROWS, BLOCK_N, HAS_BLOCK_SCORES, C,
                        OPERANDS)  # fmt: skip
    else:
        _score_exact(tile_start, values, scales, rows_a, rows_b, *tile_args,
                     HP, ROWS, BLOCK_N, HAS_BLOCK_SCORES, C, OPERANDS, HALVES)  # fmt: skip


@triton.jit
def _score_exact(tile_start, values, scales, rows_a, rows_b, out_ptr, bs_ptr, out_row_stride,
                 bs_row_stride, HP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_BLOCK_SCORES: tl.constexpr, C: tl.constexpr, OPERANDS: tl.constexpr,
                 HALVES: tl.constexpr):  # fmt: skip
    """`_score_rows`' exact path: the tile decoded by `decode_key_tile`, the exact query
    operands of `rows_a` (and of `rows_b` under HALVES)."""
    tile_args = (out_ptr, bs_ptr, out_row_stride, bs_row_stride)
    keys = decode_key_tile(values, scales, OPERANDS)
    _score_tile(tile_start, keys, None, rows_a[0], rows_a[1], rows_a[2][0], rows_a[2][1],
                *tile_args, HP, ROWS, BLOCK_N, HAS_BLOCK_SCORES, C, OPERANDS)  # fmt: skip
    if HALVES:
        _score_tile(tile_start, keys, None, rows_b[0], rows_b[1], rows_b[2][0], rows_b[2][1],
                    *tile_args, HP, ROWS, BLOCK_N, HAS_BLOCK_SCORES, C, OPERANDS)  # fmt: skip


@triton.jit
def _score_tile(
    tile_start,
    keys,
    key_factor,
    row,
    row_len,
    queries_t,
    weights,
    out_ptr,
    bs_ptr,
    out_row_stride,
    bs_row_stride,
    HP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BLOCK_SCORES: tl.constexpr,
    C: tl.constexpr,
    OPERANDS: tl.constexpr,
):
    """Keys [tile_start, tile_start + BLOCK_N) of one row group: logits and block scores.
    tile_start is a multiple of BLOCK_N; columns at or past a row's length are not written.
    keys: decoded (`decode_key_tile`) with key_factor None, or e4m3 (`fp8_keys`) with the
    walk's scalar float32 factor, queries_t and weights then the e4m3 ones of
    `_group_queries`."""
    key = tile_start + tl.arange(0, BLOCK_N)
    if key_factor is None:
        scores = tile_scores(keys, queries_t, OPERANDS)
    else:
        scores = tl.dot(keys, queries_t)
    scores = relu_propagate_nan(scores) * weights[None, :]
    logits = tl.sum(tl.reshape(scores, [BLOCK_N, BLOCK_R, HP]), axis=2)
    if key_factor is not None:
        logits = logits * key_factor
    visible = key[:, None] < row_len[None, :]
    out_rows = out_ptr + row.to(tl.int64)[None, :] * out_row_stride
    store_b32(out_rows + key[:, None], logits, visible, OPERANDS == BF16X2_OPERANDS)
    if HAS_BLOCK_SCORES:
        BLOCKS: tl.constexpr = BLOCK_N // C
        masked = tl.where(visible, logits, float("-inf"))
        block_max = tl.reduce(tl.reshape(masked, [BLOCKS, C, BLOCK_R]), 1, max_propagate_nan)
        block = tile_start // C + tl.arange(0, BLOCKS)
        newest = (row_len - 1) // C
        block_max = tl.where(block[:, None] == newest[None, :], float("inf"), block_max)
        tl.store(
            bs_ptr + row.to(tl.int64)[None, :] * bs_row_stride + block[:, None],
            block_max,
            mask=block[:, None] < tl.cdiv(row_len, C)[None, :],
        )


@triton.jit(do_not_specialize=_PER_STEP_ARGS)
def _logits_static_kernel(
    q_ptr,
    q_scale_ptr,
    kv_ptr,
    w_ptr,
    ctx_ptr,
    bt_ptr,
    row_ends_ptr,
    out_ptr,
    bs_ptr,
    qsl_ptr,
    q_row_stride,
    q_head_stride,
    qs_row_stride,
    qs_head_stride,
    page_stride,
    w_row_stride,
    bt_row_stride,
    out_row_stride,
    bs_row_stride,
    rows,
    num_seqs,
    width,
    H: tl.constexpr,
    HP: tl.constexpr,
    KEYS: tl.constexpr,
    GROUPING: tl.constexpr,
    ROWS_PER_SEQ: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BLOCK_SCORES: tl.constexpr,
    C: tl.constexpr,
    OPERANDS: tl.constexpr,
    MMA_ROWS: tl.constexpr,
    PREFETCH: tl.constexpr,
    HALVES: tl.constexpr,
    FP8: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Grid (groups, key splits): program (g, i) scores keys [i * SPLIT, (i + 1) * SPLIT)."""
    wait_for_prior_kernels()
    key_start = tl.program_id(1) * SPLIT
    ptrs = (q_ptr, q_scale_ptr, kv_ptr, w_ptr, ctx_ptr, bt_ptr, row_ends_ptr, out_ptr, bs_ptr,
            qsl_ptr)  # fmt: skip
    strides = (q_row_stride, q_head_stride, qs_row_stride, qs_head_stride, page_stride,
               w_row_stride, bt_row_stride, out_row_stride, bs_row_stride)  # fmt: skip
    _score_group(
        tl.program_id(0), key_start, key_start + SPLIT, ptrs, strides, (rows, num_seqs, width),
        H, HP, KEYS, GROUPING, ROWS_PER_SEQ, BLOCK_R, BLOCK_N,
        HAS_BLOCK_SCORES, C, OPERANDS, MMA_ROWS, PREFETCH, HALVES, FP8,
    )  # fmt: skip


@triton.jit(do_not_specialize=[a for a in _PER_STEP_ARGS if a != "qsl_ptr"])
def _logits_scheduled_kernel(
    q_ptr,
    q_scale_ptr,
    kv_ptr,
    w_ptr,
    ctx_ptr,
    bt_ptr,
    row_ends_ptr,
    out_ptr,
    bs_ptr,
    schedule_ptr,
    q_row_stride,
    q_head_stride,
    qs_row_stride,
    qs_head_stride,
    page_stride,
    w_row_stride,
    bt_row_stride,
    out_row_stride,
    bs_row_stride,
    rows,
    num_seqs,
    width,
    static_splits,
    H: tl.constexpr,
    HP: tl.constexpr,
    KEYS: tl.constexpr,
    ROWS_PER_SEQ: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BLOCK_SCORES: tl.constexpr,
    C: tl.constexpr,
    OPERANDS: tl.constexpr,
    MMA_ROWS: tl.constexpr,
    PREFETCH: tl.constexpr,
    HALVES: tl.constexpr,
    FP8: tl.constexpr,
    SPLIT: tl.constexpr,
    HEADER: tl.constexpr,
    ITEM: tl.constexpr,
):
    """Persistent programs walking the schedule's items, strided by the program count.

    The item count is read on the device, so the same launch serves every step. A schedule
    built for another grouping (its header's group count or next_n differ) or marked
    incomplete is not trusted: the programs then walk the static (group, split) grid
    instead, slower for skewed steps but exact.
    """
    wait_for_prior_kernels()
    count = tl.load(schedule_ptr + ITEM_COUNT)
    header_groups = tl.load(schedule_ptr + GROUP_COUNT)
    header_next_n = tl.load(schedule_ptr + GROUP_ROWS)
    complete = tl.load(schedule_ptr + COMPLETE)
    trusted = (complete == 1) & (header_groups == num_seqs) & (header_next_n == ROWS_PER_SEQ)
    num_items = tl.where(trusted, count, num_seqs * static_splits)
    ROW_BLOCKS: tl.constexpr = (ROWS_PER_SEQ + BLOCK_R - 1) // BLOCK_R
    # No query_start_loc in decode: ctx_ptr stands in for it (never read).
    ptrs = (q_ptr, q_scale_ptr, kv_ptr, w_ptr, ctx_ptr, bt_ptr, row_ends_ptr, out_ptr, bs_ptr,
            ctx_ptr)  # fmt: skip
    strides = (q_row_stride, q_head_stride, qs_row_stride, qs_head_stride, page_stride,
               w_row_stride, bt_row_stride, out_row_stride, bs_row_stride)  # fmt: skip
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        item_ptr = schedule_ptr + HEADER + item * ITEM
        seq = tl.where(
            trusted, tl.load(item_ptr + ITEM_GROUP, mask=trusted, other=0), item // static_splits
        )
        fallback_start = (item % static_splits) * SPLIT
        key_start = tl.where(
            trusted, tl.load(item_ptr + ITEM_KEY_START, mask=trusted, other=0), fallback_start
        )
        # Items start on a multiple of SPLIT_ALIGNMENT >= 0 (`build_decode_schedule`); kept so
        # whatever the buffer holds, which also lets the compiler use unsigned tile math.
        key_start = tl.maximum(key_start, 0) // ITEM_ALIGNMENT * ITEM_ALIGNMENT
        key_stop = tl.where(
            trusted, tl.load(item_ptr + ITEM_KEY_END, mask=trusted, other=0), fallback_start + SPLIT
        )
        for row_block in tl.static_range(ROW_BLOCKS):
            _score_group(
                seq * ROW_BLOCKS + row_block, key_start, key_stop, ptrs, strides,
                (rows, num_seqs, width), H, HP, KEYS, 0, ROWS_PER_SEQ,
                BLOCK_R, BLOCK_N, HAS_BLOCK_SCORES, C, OPERANDS, MMA_ROWS, PREFETCH, HALVES, FP8,
            )  # fmt: skip


@triton.jit
def _clean_kernel(
    out_ptr,
    bs_ptr,
    ctx_ptr,
    row_ends_ptr,
    qsl_ptr,
    out_row_stride,
    bs_row_stride,
    num_seqs,
    width,
    block_cols,
    GROUPING: tl.constexpr,
    ROWS_PER_SEQ: tl.constexpr,
    HAS_BLOCK_SCORES: tl.constexpr,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """-inf over columns [n, W) of row r and, with block scores, blocks [ceil(n / C), NB)."""
    wait_for_prior_kernels()
    row = tl.program_id(0)
    if GROUPING == 1:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        seq = seq_of_row(row, qsl_ptr, num_seqs)
    else:
        seq = row // ROWS_PER_SEQ
    row_len = tl.minimum(tl.minimum(tl.load(row_ends_ptr + row), tl.load(ctx_ptr + seq)), width)
    row_len = tl.maximum(row_len, 0)
    column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(
        out_ptr + row.to(tl.int64) * out_row_stride + column,
        tl.full([BLOCK], float("-inf"), tl.float32),
        mask=(column >= row_len) & (column < width),
    )
    if HAS_BLOCK_SCORES:
        tl.store(
            bs_ptr + row.to(tl.int64) * bs_row_stride + column,
            tl.full([BLOCK], float("-inf"), tl.float32),
            mask=(column >= tl.cdiv(row_len, C)) & (column < block_cols),
        )


def _check_block_size(candidate_block_size: int, block_n: int) -> None:
    size = candidate_block_size
    if size <= 0 or size & (size - 1) or size > 256:
        raise ValueError(
            "the triton backend computes block scores for a power-of-two "
            f"candidate_block_size <= 256, got {size}"
        )
    if block_n % size:
        raise ValueError(f"config.block_n {block_n} must be a multiple of C = {size}")


def paged_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    row_ends: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = None,
    next_n: int | None = None,
    schedule: torch.Tensor | None = None,
    block_scores: torch.Tensor | None = None,
    candidate_block_size: int = 0,
    clean: bool = False,
    page_entries: int | None = None,
    precision: str = "exact",
    config: LogitsConfig | None = None,
) -> None:
    """Triton `paged_mqa_logits` (docs/contract.md section 5.1; arguments validated by the
    wrapper, `precision` resolved by `graphidx.ops.backend.resolve_precision`).

    Same contract as `graphidx.ops.paged_mqa_logits`. `schedule` (from
    graphidx.ops.schedule.build_decode_schedule, built with the same next_n) switches decode
    to the persistent launch; it is refused with query_start_loc. Block scores need a
    power-of-two C <= 256. `config` overrides the shape-chosen tiles (tuning hook).
    Reads no device value on the host.
    """
    shape = PagedQueryShape.of(
        q, kv_cache, query_start_loc, next_n, page_entries, scheduled=schedule is not None
    )
    rows, num_seqs = shape.rows, shape.num_seqs
    grouping, rows_per_seq = shape.grouping, shape.rows_per_seq
    entries = shape.layout.page_entries
    width = out.shape[1]
    size = candidate_block_size if block_scores is not None else 1
    heads_pad = padded_heads(shape.num_heads)
    cfg = config or default_config(grouping, heads_pad, rows_per_seq, size, entries, precision)
    check_config(cfg, entries)
    require_bf16_tensor_cores(q.device)
    if block_scores is not None:
        _check_block_size(candidate_block_size, cfg.block_n)
    kv_words = cache_words(kv_cache)
    if rows == 0:
        return

    bs = block_scores if block_scores is not None else out
    qsl = query_start_loc if query_start_loc is not None else context_lens
    common = dict(
        **shape.tile_constexprs(),
        BLOCK_R=cfg.block_r,
        BLOCK_N=cfg.block_n,
        HAS_BLOCK_SCORES=block_scores is not None,
        C=size,
        OPERANDS=operand_mode(),
        MMA_ROWS=uses_mma_rows(cfg, entries),
        PREFETCH=(2 if cfg.l2_prefetch else 1) if cfg.prefetch else 0,
        HALVES=cfg.halves,
        FP8=precision == "fp8",
        **launch_options(cfg),
    )
    strides = (
        *operand_strides(q, q_scale, kv_words, weights, block_table),
        out.stride(0),
        bs.stride(0),
    )
    if width > 0 and num_seqs > 0:
        if schedule is not None:
            split = DECODE_SPLIT_KEYS
            grid: tuple[int, ...] = (multiprocessor_count(q.device) * cfg.programs_per_sm,)
            launch(_logits_scheduled_kernel, grid,
                q, q_scale, kv_words, weights, context_lens, block_table, row_ends, out, bs,
                schedule, *strides, rows, num_seqs, width, cdiv(width, split),
                ROWS_PER_SEQ=rows_per_seq, SPLIT=split, HEADER=SCHEDULE_HEADER_INTS,
                ITEM=SCHEDULE_ITEM_INTS, **common,
            )  # fmt: skip
        else:
            if grouping == GROUP_QUERY_START_LOC:
                split = PREFILL_SPLIT_KEYS
                groups = cdiv(rows, cfg.block_r) + num_seqs
            else:
                split = DECODE_SPLIT_KEYS
                groups = num_seqs * cdiv(rows_per_seq, cfg.block_r)
            grid = (groups, cdiv(width, split))
            launch(_logits_static_kernel, grid,
                q, q_scale, kv_words, weights, context_lens, block_table, row_ends, out, bs,
                qsl, *strides, rows, num_seqs, width,
                GROUPING=grouping, ROWS_PER_SEQ=rows_per_seq, SPLIT=split, **common,
            )  # fmt: skip
    if clean:
        block_cols = bs.shape[1] if block_scores is not None else 0
        grid = (rows, cdiv(max(width, block_cols, 1), CLEAN_BLOCK))
        launch(_clean_kernel, grid,
            out, bs, context_lens, row_ends, qsl, out.stride(0), bs.stride(0), num_seqs, width,
            block_cols, GROUPING=grouping, ROWS_PER_SEQ=rows_per_seq,
            HAS_BLOCK_SCORES=block_scores is not None, C=size, BLOCK=CLEAN_BLOCK,
        )  # fmt: skip


__all__ = [
    "LogitsConfig",
    "check_config",
    "default_config",
    "paged_mqa_logits",
    "uses_mma_rows",
]
