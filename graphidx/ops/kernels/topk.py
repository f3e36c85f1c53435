"""Exact per-row top-k in Triton (docs/contract.md section 5.2, `topk_per_row`).

Values are compared through the order-preserving uint32 image of float32 (`_order_key`:
flip the sign bit of non-negatives, invert negatives), so ties and signed zeros follow one
total order. Keys of -inf (and anything below) are never picked.

The grouped paths rest on one bound: any k distinct columns' keys bound the row's k-th largest key
from below, so the k-th largest of the rows' group maxima (groups of disjoint columns) is a
*floor*: every top-k column has key >= floor. With about 4k groups, ~1.1-1.3k columns lie
above it on continuous data. A lower bound is all it needs, so the search for it over the
maxima stops once at most k + k / FLOOR_SLACK of them reach it (or FLOOR_LIMIT * k with
FLOOR_BITS bits of their range resolved).

One program per row (P = 1, `_topk_row_kernel`, one launch), rows cut into G-column
*contiguous* groups (G = `group_columns(width, groups)`):
1. *Maxima.* One streaming pass writes each group's max key to scratch (two steps' loads in
   flight while a step is reduced; stores made from the reduction's layout). Each lane also
   keeps its few largest maxima, which seed the floor search's first round (`_maxima_range`).
2. *List.* The floor from the maxima, then the groups whose max is >= floor listed in
   ascending order: they hold every column >= floor (~k groups: 13% of a 65536-column row of
   normals at k 512, 27% at 2048).
3. *Collect.* Only the listed groups are read again (from L2): columns > floor go to the
   candidate buffer (CAP = 2 * K_PAD entries), columns == floor to the tie buffer (K_PAD),
   numbered by one prefix sum per step, so both buffers hold their columns in column order.
   A step's tile gives each thread whole pieces of groups (`_group_tile`), so the prefix sum
   needs no layout conversion (`_tile_prefix`).
4. *Select* (`_select`): at most k candidates: the floor *is* the k-th largest key when the
   row has k finite values; write every candidate, then the first tied columns up to k, then
   -1. Up to CAP: search them (from [floor + 1, the row's largest key], both known from
   step 2) until the k-th largest key is found or at most RANK_KEYS keys are left in the
   bracket around it; write the keys above the bracket, then the bracket's best by key and
   column, ranked in one step (`_emit_ranked`), or the keys above the k-th largest plus the
   first equal ones. More than CAP (adversarial rows, e.g. the top keys crowded into few
   groups): the same search over the whole row, 16 counting passes. Slow, never wrong.

P > 1 programs per row (few, wide rows): the row's columns fall into GROUPS *interleaved*
groups (column j is in group j % GROUPS) and program s of the row owns groups [s * GS, (s + 1)
* GS), GS = GROUPS / P, so a run of adjacent top keys is spread over all P programs.
`_split_floor_kernel` (grid P x rows) writes each program's group maxima to scratch and the
last program of a row to arrive (acq_rel counter) computes the row's floor;
`_split_collect_kernel` streams every column again, appending those > floor / == floor with
relaxed atomics (in arrival order), and the row's last program to arrive selects. Because
that order varies from run to run, whenever only some of the columns tied at the threshold
can be picked and the rank step does not order them (more than RANK_KEYS keys in the last
bracket), this path takes them from the whole-row pass instead (in column order).

Either way exactly min(k, #finite values) distinct columns are written, then -1 padding, and
when only some tied columns can be picked they are the tied columns of smallest index: equal
inputs always give equal picks, whatever the path (a replayed graph must reproduce the eager
answer). (NaN input is undefined by the contract; here a NaN ranks by its bits: +NaN above
+inf, -NaN like -inf.) Every search counts three trial thresholds per CTA-wide sum (one
packed int64): interpolated between the counts at the ends of a bracket around the k-th
largest key (`_kth_largest_key`), or 2-bit digits in the whole-row select; each stops early
once exactly k keys are at or above the threshold.

Cost (H200, 128 x 65536 float32, CUDA-graph replays with a clean L2, BENCHMARKS.md): P = 1
at 16 warps, kernel alone (the replay's device span) 20.8 us at k 512 and 27.8 at k 2048
(replays 24.6 / 31.9), 2.19 and 2.93 times a measured read of the
logits' kernel (9.5 us), 2.7 and 3.6 times the nominal read (7.8 us at 4.3 TB/s). Phases at
k 2048 (graph replays of the kernel cut after each, clean L2): maxima stream 13.5 us, floor
and list +6.0, collect +6.2, the select's gather +0.7, its search down to the rank bracket
(~2 rounds) +2.3, ranking it and writing the picks +2.8.

Whole rows (`_topk_whole_row_kernel`, one launch, one program per row of at most
MAX_WHOLE_ROW_COLUMNS): the row is read once into registers (about WHOLE_ROW_KEYS keys per
thread) and the same exact search runs over all its keys (no floor, no second read); the
picks are written in column order, the last bracket ranked by `_emit_ranked` when it is
small, else the first tied columns.

The cost follows a row's live columns, not its buffer's width (a FULL graph's decode rows
are sized for the longest context): from W_PAD = HALF_ROW_TIER on, the whole-row kernel
holds a row of at most W_PAD / 2 live columns in a half tile; the one-program kernel holds a
row of at most `short_row_columns` live columns whole, and cuts a longer one of at most
width >> t columns into groups of G >> t (`group_tiers`), so a short row has as many groups,
and as tight a floor, as a full one.

Which path runs: `default_config(k, rows, width)` holds rows whole up to WHOLE_ROW_NARROW
columns, and up to WHOLE_ROW_COLUMNS when k >= WHOLE_ROW_MIN_K or there are at most
WHOLE_ROW_MAX_ROWS rows. Otherwise, at k <= SPLIT_MAX_K or for at most SPLIT_FEW_ROWS
rows, it doubles P from 1 while rows * P < 128, each program keeps >= 4096 columns of the
width and P <= 128; so P = 1 for >= 128 rows, rows narrower than 8192 columns, or three
rows and more at k > SPLIT_MAX_K; P > 1 for fewer, wider rows (8 x 65536 at k 512 -> P = 16,
2 x 65600 at k 2048 -> P = 16, one row of 1M columns at k 512 -> P = 128). Scratch is
allocated per call, in row batches of at most SCRATCH_BYTES.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphidx.ops.kernels import OPERANDS_BF16X2, next_power_of_2, operand_mode
from graphidx.ops.kernels.launch import launch
from graphidx.ops.kernels.ptx import store_b32, wait_for_prior_kernels
from graphidx.ops.kernels.topk_radix import MAX_STEP, radix_topk_per_row
from graphidx.ops.kernels.topk_select import (
    FALLBACK_STEP,
    KEY_NEG_INF,
    RANK_KEYS,
    _emit_ranked,
    _key_range,
    _kth_largest_key,
    _load_keys,
    _load_order_keys,
    _never_picked_zero,
    _order_key,
    _run_prefix,
    _select_from_row,
    row_length,
)

FLOOR_SLACK = tl.constexpr(8)
"""The floor search stops once at most k + k / FLOOR_SLACK group maxima reach the floor (on
rows of normals after ~3.5 rounds at k 512, ~4 at 2048)."""
FLOOR_LIMIT = tl.constexpr(2)
"""...or once at most FLOOR_LIMIT * k maxima reach it and the bracket is down to 2**-FLOOR_BITS
of the maxima's range (clustered maxima, e.g. a few values far apart or maxima on both sides
of zero, may not get under the slack soon), or once the bracket is one key (ties at the
floor can leave any count). The columns at or above the floor must fit CAP = 2 * K_PAD, or
the row takes the whole-row select, 18x slower (a floor resolved to 8-10 bits of the maxima's
range does that: docs/perf-notes.md, top-k); at 128 x 65536 normals the floors measured
leave 572 / 2532 candidates at k 512 / 2048, but a floor reached by FLOOR_LIMIT alone could
leave more than CAP (2k maxima plus their groups' other columns above it)."""
FLOOR_BITS = tl.constexpr(12)
"""Bits of the maxima's range the bracket must resolve before FLOOR_LIMIT ends the search
(measured with a 2-bit radix floor search: 12 bits 36.0 / 54.5 us at k 512 / 2048, 16 bits
36.4 / 56.0)."""


# Per-row counters (int32 slots of the counters tensor).
ABOVE = tl.constexpr(0)  # candidates with key > floor
TIED = tl.constexpr(1)  # columns with key == floor
FLOOR_ARRIVALS = tl.constexpr(2)  # programs done with the floor phase (P > 1)
FLOOR_KEY = tl.constexpr(3)  # the row's floor key, bitcast to int32 (P > 1)
COLLECT_ARRIVALS = tl.constexpr(4)  # programs done with the collect phase (P > 1)
COUNTER_SLOTS = tl.constexpr(8)


SCRATCH_BYTES = 64 << 20
MIN_GROUPS = 1024
MAX_GROUPS = 16384
TARGET_PROGRAMS = 128
"""Programs per launch below which default_config splits rows: about one per multiprocessor.
Rows are split only when there are too few to fill the GPU: rows that fill it take the
one-program path, which needs one launch and no cross-program floor, and is the path tuned
and measured on them (BENCHMARKS.md)."""
SPLIT_MAX_K = 1024
"""Largest k that default_config splits rows for, unless there are at most SPLIT_FEW_ROWS
rows (measured at 128 x 65536, k 2048: P = 1 76 us, P = 2 125 us, P = 4 163 us: the last
arriver's floor search over 8192 group maxima and the extra launch cost more than the split
saves)."""
SPLIT_FEW_ROWS = 2
"""Rows up to which default_config splits at any k. On the H200 (kernel spans, graph
replays, clean L2) 2 rows at k 2048: 65600 columns 32.0 -> 24.2 us at P = 16, the P the
default takes (26.8 -> 22.7 at 16384 live columns); 163840 columns 35.6 -> 23.8 at P = 16
(the default takes P = 32, not timed there; at 65600 P = 32 read 24.8); at 4 rows P = 16
gained 7%, at 8 rows and more every split was slower (29.1 against 33.9 and up). Widths
from 163840 up to RADIX_MIN_WIDTH were not timed. A V3.2 decode step of one request is 2
such rows."""
WIDE_ROW_COLUMNS = 65536
"""Row width from which one program per row gets WIDE_ROW_WARPS warps, WIDE_ROW_CHUNK
columns per step and at least WIDE_ROW_GROUPS groups. Measured at 128 x 65536 (CUDA-graph
replays, clean L2, a sweep of groups x steps x warps): 16 warps, 4096-column steps and 4096
groups (16-column groups at k 512) 36.3 us at k 512 and, with k 2048's own 8192 groups, 54.7
us, against 39.6 / 55.3 at 2048 / 8192 groups with 8192-column steps; 8 warps, 1024 or
16384 groups and 16384-column steps were slower.
Narrower rows are unmeasured, so they keep split_config's sizes."""
WIDE_ROW_WARPS = 16
WIDE_ROW_CHUNK = 4096
WIDE_ROW_GROUPS = 4096
MAX_STEP_COLUMNS = 32768
"""Columns one step of the one-program path may hold: its counts are packed in 16 bits."""
WHOLE_ROW_COLUMNS = 16384
"""Widest row `default_config` holds whole in registers (one program per row, one read)."""
WHOLE_ROW_NARROW = 4096
"""Rows up to this width are always held whole (H200, graph replays of 2-512 rows: 0.34-0.59x
the grouped path's time at 2048 columns, 0.49-0.78x at 4096, k 512 and 2048)."""
WHOLE_ROW_MIN_K = 1024
"""From this k on, rows up to WHOLE_ROW_COLUMNS are held whole at any row count (k 2048 at
8256 and 16384 columns, 2-512 rows: 0.81-0.91x the grouped path's time)."""
WHOLE_ROW_MAX_ROWS = 64
"""Below WHOLE_ROW_MIN_K, wider rows are held whole only up to this many rows: at k 512 and
8256-16384 columns the whole-row path is 0.99-1.08x the grouped one at 2-8 rows, 0.81-0.86x
at 32-64, 1.33-1.37x at 128 and 2.3-2.7x at 512 (one program per row searches its whole row;
the grouped path reads only ~k groups again)."""
MAX_WHOLE_ROW_COLUMNS = 32768
"""Widest row the whole-row path can hold (its prefix sums pack counts in 16 bits)."""
WHOLE_ROW_KEYS = 16
"""Keys per thread the whole-row path aims at (more warps for wider rows, up to 16)."""
MIN_TIER_GROUP = 4
"""Narrowest group a tier of the one-program kernel cuts a short row into (the collect's
pieces are runs of 4 columns)."""
HALF_ROW_TIER = tl.constexpr(8192)
"""From this W_PAD on, the whole-row kernel holds a row of at most W_PAD / 2 live columns in
a tile of half the size (same warps, half the keys per thread)."""
MIN_SLICE_COLUMNS = 4096
"""Columns of the width each program keeps at least (a shorter stream is all overhead)."""
MIN_SLICE_GROUPS = 128
"""Groups per program at least: 512-byte contiguous pieces per GROUPS-column block."""
MAX_PROGRAMS_PER_ROW = MAX_GROUPS // MIN_SLICE_GROUPS
RADIX_PATH = -1
RADIX_MIN_WIDTH = 1 << 20
"""A single row at least this wide, at k above SPLIT_MAX_K, takes the radix select
(`topk_radix`, slices of RADIX_CHUNK columns at 8 warps). H200 graph replays, clean L2: one
row of 1048576 columns at k 2048, 94.0 us against 167.6 on one program; everywhere else
measured the radix select was slower (2 x 65600 at k 2048: 32.0-39.3 against 34.1; 8 rows
65.5 against 34.9; 32 rows 204 against 36: its 2048-bin histograms cost more than the
programs it spreads the row over save, docs/perf-notes.md)."""
RADIX_CHUNK = 4096


@dataclass(frozen=True)
class TopkConfig:
    """Sizes of one top-k call (every size a power of two).

    groups: group maxima per row behind the floor (P = 1: at most this many contiguous
    groups of a power-of-two width; P > 1: exactly this many interleaved groups); capacity:
    candidate buffer entries per row (>= next_power_of_2(k)); num_warps: warps per program;
    programs_per_row: P, programs splitting each row (groups // P >= 4); chunk: columns a
    program loads per step (P = 1: also per collect step, at most MAX_STEP_COLUMNS; P > 1:
    raised to groups // P when smaller); max_registers: Triton's `maxnreg` for every launch
    (None: the compiler's choice), a tuning hook for occupancy; whole_row: one program per
    row holds the whole row in registers (`_topk_whole_row_kernel`, widths up to
    MAX_WHOLE_ROW_COLUMNS; groups, capacity, P and chunk unused); short_rows: at P = 1,
    rows whose length fits `short_row_columns` are held whole instead of grouped; radix:
    the radix select of `topk_radix` over slices of `chunk` columns (at most
    topk_radix.MAX_STEP), staging at most `capacity` columns per row (>= RANK_KEYS; groups
    and P unused).
    """

    groups: int
    capacity: int
    num_warps: int
    programs_per_row: int = 1
    chunk: int = 2048
    max_registers: int | None = None
    whole_row: bool = False
    short_rows: bool = True
    radix: bool = False


def default_config(k: int, rows: int, width: int) -> TopkConfig:
    """The config for `rows` rows of `width` columns and this k, from the shapes alone.

    P doubles from 1 while k <= SPLIT_MAX_K (or rows <= SPLIT_FEW_ROWS), rows * P <
    TARGET_PROGRAMS, width >= 2P * MIN_SLICE_COLUMNS and P < MAX_PROGRAMS_PER_ROW; the
    sizes are then `split_config(k, P)`, with WIDE_ROW_WARPS warps, WIDE_ROW_CHUNK columns
    per step and at least WIDE_ROW_GROUPS groups at P = 1 from WIDE_ROW_COLUMNS on. Rows
    are held whole in registers (`whole_row_config`) up to WHOLE_ROW_NARROW columns, and up
    to WHOLE_ROW_COLUMNS when k >= WHOLE_ROW_MIN_K or rows <= WHOLE_ROW_MAX_ROWS; a single
    row of at least RADIX_MIN_WIDTH columns at k > SPLIT_MAX_K takes the radix select.
    """
    if width <= WHOLE_ROW_NARROW or (
        width <= WHOLE_ROW_COLUMNS and (k >= WHOLE_ROW_MIN_K or rows <= WHOLE_ROW_MAX_ROWS)
    ):
        return whole_row_config(width)
    if rows == 1 and width >= RADIX_MIN_WIDTH and k > SPLIT_MAX_K:
        return radix_config(RADIX_CHUNK, 8)
    split = 1
    while (
        (k <= SPLIT_MAX_K or rows <= SPLIT_FEW_ROWS)
        and rows * split < TARGET_PROGRAMS
        and split < MAX_PROGRAMS_PER_ROW
        and width >= 2 * split * MIN_SLICE_COLUMNS
    ):
        split *= 2
    config = split_config(k, split)
    if split == 1 and width >= WIDE_ROW_COLUMNS:
        config = dataclasses.replace(
            config,
            groups=max(config.groups, WIDE_ROW_GROUPS),
            num_warps=WIDE_ROW_WARPS,
            chunk=WIDE_ROW_CHUNK,
        )
    return config


def whole_row_config(width: int) -> TopkConfig:
    """One program per row with the row in registers: about WHOLE_ROW_KEYS keys per thread,
    4 to 16 warps."""
    warps = min(16, max(4, next_power_of_2(max(width, 1)) // (32 * WHOLE_ROW_KEYS)))
    return TopkConfig(groups=MIN_GROUPS, capacity=2, num_warps=warps, whole_row=True)


def radix_config(chunk: int, num_warps: int, capacity: int = 4096) -> TopkConfig:
    """The radix select (`topk_radix`) over slices of `chunk` columns."""
    return TopkConfig(groups=MIN_GROUPS, capacity=capacity, num_warps=num_warps, chunk=chunk,
                      radix=True)  # fmt: skip


def split_config(k: int, programs_per_row: int) -> TopkConfig:
    """The sizes for this k at P = programs_per_row (a power of two <= MAX_PROGRAMS_PER_ROW).

    GROUPS = max(4 * K_PAD, 1024, P * MIN_SLICE_GROUPS) capped at 16384; CAP = 2 * K_PAD;
    8 warps when P > 1 or from 4096 groups on, else 4; chunk = 512 * warps (16 columns per
    thread and step: the collect step holds ~75 registers per thread at that size, ~120 at
    twice it, per ptxas for sm_90).
    """
    k_pad = next_power_of_2(k)
    groups = min(max(4 * k_pad, MIN_GROUPS, programs_per_row * MIN_SLICE_GROUPS), MAX_GROUPS)
    num_warps = 8 if programs_per_row > 1 or groups >= 4096 else 4
    return TopkConfig(
        groups=groups,
        capacity=2 * k_pad,
        num_warps=num_warps,
        programs_per_row=programs_per_row,
        chunk=512 * num_warps,
    )


@triton.jit
def _row_floor(group_max, k, largest, smallest, live, seed_lo, seed_hi):
    """(floor, count(group_max >= floor)): a lower bound of the row's k-th largest key from
    its group maxima, whose `_key_range` is (largest, smallest, live) (KEY_NEG_INF when fewer
    than k groups hold a finite value: then every finite column is a candidate): the search
    stops once at most k + k / FLOOR_SLACK maxima reach it, or FLOOR_LIMIT * k with
    FLOOR_BITS bits of their range resolved. Seeds as in `_kth_largest_key` (0, 0: none)."""
    floor = KEY_NEG_INF + tl.zeros([], tl.uint32)
    reaching = live
    if live >= k:
        floor, reaching, _, _ = _kth_largest_key(
            group_max, k, k + k // FLOOR_SLACK, FLOOR_LIMIT * k, largest, smallest, live,
            seed_lo, seed_hi, FLOOR_BITS, 0,
        )  # fmt: skip
        # Finite keys are above KEY_NEG_INF, so raising the floor to it drops no live key.
        floor = tl.maximum(floor, KEY_NEG_INF)
    return floor, reaching


@triton.jit
def _group_maxima(src, n, piece, GROUPS: tl.constexpr, GS: tl.constexpr, BLOCKS: tl.constexpr):
    """Max key of groups piece .. piece + GS - 1 over a row of length n (0 for a group with
    no finite column): BLOCKS GROUPS-column blocks per step, full steps unmasked."""
    block = tl.arange(0, BLOCKS)[:, None]
    lane = tl.arange(0, GS)[None, :]
    group_max = tl.zeros([GS], tl.uint32)
    main_stop = n // GROUPS // BLOCKS * BLOCKS
    # Raw keys: a group's max is zeroed once, after the loop (the max of zeroed keys).
    for first in range(0, main_stop, BLOCKS):
        col = (first + block) * GROUPS + piece + lane
        key = _load_order_keys(src, col, col, False)
        group_max = tl.maximum(group_max, tl.max(key, axis=0))
    if main_stop * GROUPS < n:
        # At most BLOCKS blocks are left (the last one partial): one masked step.
        col = (main_stop + block) * GROUPS + piece + lane
        key = _load_order_keys(src, col, col < n, True)
        group_max = tl.maximum(group_max, tl.max(key, axis=0))
    return _never_picked_zero(group_max)


@triton.jit
def _scatter_quads(dst, col_base, slot, match, capacity):
    """Store col_base + j at slot[:, j] where match[:, j], for slots below `capacity`. Each
    of the 4 columns is stored as its own 1-D tensor, which keeps the scatter in the tile's
    row layout."""
    lane = tl.arange(0, 4)[None, :]
    for j in tl.static_range(4):
        pick = lane == j
        slot_j = tl.sum(tl.where(pick, slot, 0), axis=1)
        match_j = tl.sum(tl.where(pick, match, 0), axis=1)
        tl.store(dst + slot_j, col_base + j, mask=(match_j != 0) & (slot_j < capacity))


@triton.jit
def _collect_step(
    src,
    first,
    n,
    floor,
    candidates,
    ties,
    counters,
    piece,
    K_PAD: tl.constexpr,
    CAP: tl.constexpr,
    GROUPS: tl.constexpr,
    GS: tl.constexpr,
    BLOCKS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Append this program's columns of blocks [first, first + BLOCKS) with key > floor to
    `candidates` (counted in counters[ABOVE]) and those equal to a finite floor to `ties`
    (counters[TIED]); the counters count every match, the buffers keep the first CAP / K_PAD.

    The step is tiled as quads of 4 adjacent columns, one 16-byte vector per thread. A quad
    with candidates takes its slots with one relaxed atomic (only a few percent hold one)
    and numbers them in registers, far cheaper than a prefix sum over every column. Ties are
    numbered by a prefix sum over the quads and one atomic per step, and only in steps that
    hold any: all-equal rows would otherwise take an atomic per quad.
    """
    quad = tl.arange(0, BLOCKS * GS // 4)
    col_base = (first + quad // (GS // 4)) * GROUPS + piece + (quad % (GS // 4)) * 4
    col = col_base[:, None] + tl.arange(0, 4)[None, :]
    key = _load_keys(src, col, col < n, MASKED)
    above = (key > floor).to(tl.int32)
    above_quad = tl.sum(above, axis=1)
    base = tl.atomic_add(
        counters + ABOVE + tl.zeros_like(above_quad), above_quad, mask=above_quad > 0,
        sem="relaxed",
    )  # fmt: skip
    _scatter_quads(candidates, col_base, base[:, None] + tl.cumsum(above, axis=1) - above,
                   above, CAP)  # fmt: skip
    tied = ((key == floor) & (key > KEY_NEG_INF)).to(tl.int32)
    tied_quad = tl.sum(tied, axis=1)
    tied_step = tl.sum(tied_quad, axis=0)
    if tied_step > 0:
        tied_base = tl.atomic_add(counters + TIED, tied_step, sem="relaxed")
        quad_first = tied_base + tl.cumsum(tied_quad, axis=0) - tied_quad
        _scatter_quads(ties, col_base, quad_first[:, None] + tl.cumsum(tied, axis=1) - tied,
                       tied, K_PAD)  # fmt: skip


@triton.jit
def _tile_prefix(x):
    """(exclusive prefix sum of x in row-major order, total) for a 3-D [pieces, runs, RUN]
    tile whose pieces each lie in one thread (`_group_tile`). Every scan but the one across
    the piece totals runs along an axis a thread holds, in the tile's own layout: a scan of
    a reduced (sliced) layout would first be converted through shared memory (at k 2048,
    128 x 65536: 11 -> 5 CTA barriers and 383 -> 335 sm_90 instructions per collect step)."""
    earlier_runs = tl.sum(tl.cumsum(x, axis=1) - x, axis=2)
    piece_total = tl.sum(tl.sum(x, axis=2), axis=1)
    piece_prefix = tl.cumsum(piece_total, axis=0) - piece_total
    within = piece_prefix[:, None] + earlier_runs
    return within[:, :, None] + tl.cumsum(x, axis=2) - x, tl.sum(piece_total, axis=0)


@triton.jit
def _emit_selection(key, col, threshold, k, dst):
    """Write the columns with key > threshold, then equal ones up to k in total (each kind in
    column order; key and col are [runs, RUN] in row-major column order). Both are numbered
    by one prefix sum, their counts packed in 16-bit halves when there are fewer than 65536
    keys (a power of two, so at most 32768: every rank fits below bit 15 of its half); else
    one prefix sum each."""
    above = (key > threshold).to(tl.int32)
    tied = (key == threshold).to(tl.int32)
    if key.shape[0] * key.shape[1] < 65536:
        rank, total = _run_prefix(above + (tied << 16))
        above_count = total & 0xFFFF
        slot_above = rank & 0xFFFF
        slot_tied = above_count + (rank >> 16)
    else:
        slot_above, above_count = _run_prefix(above)
        slot_tied, _ = _run_prefix(tied)
        slot_tied += above_count
    tl.store(dst + slot_above, col, mask=above != 0)
    tl.store(dst + slot_tied, col, mask=(tied != 0) & (slot_tied < k))


@triton.jit
def _select(
    src,
    n,
    dst,
    candidates,
    ties,
    above_total,
    tied_total,
    floor,
    row_max,
    k,
    K_PAD: tl.constexpr,
    CAP: tl.constexpr,
    ORDERED: tl.constexpr,
):
    """Write the row's k columns (phase 3) from the candidate and tie buffers and their
    counts, once every writer's stores are visible (buffers are read through L2, `.cg`).

    ORDERED: the buffers hold their columns in column order (one program wrote them in
    order), so ties at the threshold are picked from them directly. Otherwise they fill in
    atomic (arrival) order, which varies from run to run: whenever only some of the columns
    tied at the threshold can be picked and the rank step below does not order them, the
    choice is made in column order by the whole-row pass instead. Either way equal inputs
    always give equal picks, the same ones (a replayed graph must reproduce the eager
    answer).

    The candidates are the keys > floor. ORDERED also passes the row's largest key, so the
    exact search starts from the bracket [floor + 1, row_max] (count above_total, 0) without
    a CTA-wide pass for the candidates' range (unless the floor is -inf's key); otherwise
    row_max is unused and the range is computed. The search stops at a bracket of at most
    RANK_KEYS keys, which `_emit_ranked` orders by key and column (on either path: that
    order does not depend on the buffers').
    """
    if above_total <= k:
        if (tied_total > k - above_total) & (ORDERED == 0):
            _select_from_row(src, n, k, dst, FALLBACK_STEP)
        else:
            slot = tl.arange(0, K_PAD)
            tie_slot = slot - above_total
            picked = tl.load(candidates + slot, mask=slot < above_total, other=-1,
                             cache_modifier=".cg")  # fmt: skip
            tie = tl.load(ties + tie_slot, mask=(tie_slot >= 0) & (tie_slot < tied_total),
                          other=-1, cache_modifier=".cg")  # fmt: skip
            tl.store(dst + slot, tl.where(slot < above_total, picked, tie), mask=slot < k)
    elif above_total <= CAP:
        RUN: tl.constexpr = 1 + 3 * (CAP >= 4)
        slot = tl.arange(0, CAP // RUN)[:, None] * RUN + tl.arange(0, RUN)[None, :]
        inside = slot < above_total
        col = tl.load(candidates + slot, mask=inside, other=0, cache_modifier=".cg")
        key = tl.where(inside, _order_key(tl.load(src + col, mask=inside, other=0.0)), 0)
        if ORDERED:
            largest, smallest, live = row_max, floor + 1, above_total
            if floor == KEY_NEG_INF:
                # No floor (fewer than k finite groups, e.g. short rows): the candidates may
                # sit far above floor + 1, where the bracket's interpolation would need ~2x
                # the rounds; their own range is cheaper.
                largest, smallest, live = _key_range(key)
        else:
            largest, smallest, live = _key_range(key)
        # The tie buffer is free here (more than k candidates): it stages the rank step's keys.
        # A bracket to rank holds >= 2 keys (count >= k + 1 at lo, <= k - 1 above hi), so at
        # K_PAD <= 2 (BRACKET <= 1) the step never runs; M = 1 only keeps it compilable.
        BRACKET: tl.constexpr = RANK_KEYS if RANK_KEYS <= K_PAD // 2 else K_PAD // 2
        threshold, reaching, hi, above_hi = _kth_largest_key(
            key, k, k, k, largest, smallest, live, 0, 0, 32, BRACKET
        )
        if (reaching > k) & (reaching - above_hi <= BRACKET):
            _emit_ranked(key, col, threshold, hi, reaching - above_hi, above_hi, k, ties, dst,
                         BRACKET if BRACKET > 0 else 1)  # fmt: skip
        elif (reaching > k) & (ORDERED == 0):
            _select_from_row(src, n, k, dst, FALLBACK_STEP)
        else:
            _emit_selection(key, col, threshold, k, dst)
    else:
        _select_from_row(src, n, k, dst, FALLBACK_STEP)


@triton.jit
def _store_group_maxima(src, n, maxima, G: tl.constexpr, SG: tl.constexpr, RANKS: tl.constexpr,
                        PTX: tl.constexpr):  # fmt: skip
    """maxima[g] = the max key of columns [g * G, (g + 1) * G) of a row of length n (0 when
    none is finite), for every g < cdiv(n, G): SG groups per step, the loop's loads
    unmasked (only the first two and the partial last step are masked), each step's maxima
    stored from where the reduction left them (no barrier in the loop).

    Returns the running (max, smallest nonzero, nonzero count, and the RANKS <= 4 largest in
    descending order) of the maxima each of SG lanes stored ([SG] each; lane l holds groups
    l, l + SG, ...): `_maxima_range` reduces them to the maxima's `_key_range` and the floor
    search's seeds, so it needs no pass over the maxima for them."""
    group = tl.arange(0, SG)
    none = tl.zeros([SG], tl.uint32)
    seen = (none, tl.full([SG], 0xFFFFFFFF, tl.uint32), tl.zeros([SG], tl.int32),
            none, none, none, none)  # fmt: skip
    col = group[:, None] * G + tl.arange(0, G)[None, :]
    STEP: tl.constexpr = SG * G
    main_stop = n // STEP * STEP
    pair_stop = n // (2 * STEP) * (2 * STEP)
    last = main_stop - STEP
    # Software-pipelined two steps deep, unrolled by two so that each buffer is refilled in
    # place: a load is waited for two steps after it is issued, never copied before (a
    # register copy would wait for it). Past the end the loads repeat the last full step (an
    # L2 hit), which keeps them unmasked; floats are carried raw, keys made at use.
    value_a = tl.load(src + col, mask=col < main_stop, other=float("-inf"))
    value_b = tl.load(src + tl.minimum(STEP, last) + col, mask=col < last, other=float("-inf"))
    for first in range(0, pair_stop, 2 * STEP):
        here = _order_key(value_a)
        value_a = tl.load(src + tl.minimum(first + 2 * STEP, last) + col)
        seen = _seen(seen, _store_step_maxima(here, maxima + first // G, group, PTX), RANKS)
        here = _order_key(value_b)
        value_b = tl.load(src + tl.minimum(first + 3 * STEP, last) + col)
        seen = _seen(seen, _store_step_maxima(here, maxima + first // G + SG, group, PTX), RANKS)
    if pair_stop < main_stop:  # one full step left, loaded into value_a
        step_max = _store_step_maxima(_order_key(value_a), maxima + pair_stop // G, group, PTX)
        seen = _seen(seen, step_max, RANKS)
    if main_stop < n:
        key = _load_order_keys(src, main_stop + col, main_stop + col < n, True)
        group_max = _never_picked_zero(tl.max(key, axis=1))  # 0 for the groups past n
        store_b32(maxima + main_stop // G + group, group_max,
                  main_stop + group * G < n, PTX)  # fmt: skip
        seen = _seen(seen, group_max, RANKS)
    return seen


@triton.jit
def _seen(seen, group_max, RANKS: tl.constexpr):
    """`_store_group_maxima`'s running values after one more step's maxima (0: never picked):
    the range as `_key_range`, and each lane's RANKS largest (an insertion into a sorted
    list: a max and a min per rank)."""
    largest, smallest, live, top0, top1, top2, top3 = seen
    nonzero = group_max > 0
    value = group_max
    if RANKS >= 1:
        top0, value = tl.maximum(top0, value), tl.minimum(top0, value)
    if RANKS >= 2:
        top1, value = tl.maximum(top1, value), tl.minimum(top1, value)
    if RANKS >= 3:
        top2, value = tl.maximum(top2, value), tl.minimum(top2, value)
    if RANKS >= 4:
        top3 = tl.maximum(top3, value)
    return (
        tl.maximum(largest, group_max),
        tl.minimum(smallest, tl.where(nonzero, group_max, 0xFFFFFFFF)),
        live + nonzero.to(tl.int32),
        top0,
        top1,
        top2,
        top3,
    )


@triton.jit
def _range_and_seeds(a_max, a_min, a_count, a_lo, a_hi, b_max, b_min, b_count, b_lo, b_hi):
    return (tl.maximum(a_max, b_max), tl.minimum(a_min, b_min), a_count + b_count,
            tl.minimum(a_lo, b_lo), tl.maximum(a_hi, b_hi))  # fmt: skip


@triton.jit
def _maxima_range(seen, k, RANKS: tl.constexpr):
    """(`_key_range` of the maxima `_store_group_maxima` stored, and seeds for the floor
    search), from what it returned. With j = cdiv(k, SG) <= RANKS, the seeds are the least
    and the greatest of the lanes' j-th largest maxima: j maxima of every lane are >= the
    first, so at least j * SG >= k of all are; fewer than j of every lane exceed the second,
    so fewer than (j - 1) * SG + 1 <= k do. They bracket the k-th largest maximum, usually
    far tighter than the range (no seeds, (0, 0), when RANKS is 0)."""
    largest, smallest, live, top0, top1, top2, top3 = seen
    SG: tl.constexpr = largest.shape[0]
    rank = (k + SG - 1) // SG
    jth = tl.where(rank <= 1, top0, tl.where(rank == 2, top1, tl.where(rank == 3, top2, top3)))
    if RANKS == 0:
        jth = tl.zeros_like(jth)
    return tl.reduce((largest, smallest, live, jth, jth), 0, _range_and_seeds)


@triton.jit
def _store_step_maxima(key, dst, group, PTX: tl.constexpr):
    """dst[group] = the max of key[group, :], 0 at or below -inf's key (one full step);
    returns those maxima."""
    group_max = _never_picked_zero(tl.max(key, axis=1))
    store_b32(dst + group, group_max, group >= 0, PTX)
    return group_max


@triton.jit
def _list_groups(maxima, seen, n, k, group_list, G: tl.constexpr, NG_PAD: tl.constexpr,
                 RANKS: tl.constexpr):  # fmt: skip
    """(floor, count, row max): the row's floor from its group maxima (`seen`: what
    `_store_group_maxima` returned), and the groups whose max is at or above it (every
    column > floor or == floor lies in one), listed in ascending order; the row max is its
    largest key (0 when none is finite)."""
    group = tl.arange(0, NG_PAD)
    live = group < (n + G - 1) // G
    group_max = tl.load(maxima + group, mask=live, other=0, cache_modifier=".cg")
    group_max = group_max.to(tl.uint32, bitcast=True)
    # The range comes from registers: its CTA-wide reduction runs while the load above is
    # in flight.
    row_max, smallest, finite, seed_lo, seed_hi = _maxima_range(seen, k, RANKS)
    floor, listed_count = _row_floor(group_max, k, row_max, smallest, finite, seed_lo, seed_hi)
    # Numbered in runs of RUN adjacent groups (`_run_prefix`): 1329 -> 546 sm_90 SASS
    # instructions from the floor search to the collect loop at k 2048, 721 -> 302 at k 512.
    RUN: tl.constexpr = 1 + 3 * (NG_PAD >= 4)
    listed = tl.reshape((group_max >= floor).to(tl.int32), [NG_PAD // RUN, RUN])
    slot, _ = _run_prefix(listed)
    tl.store(group_list + slot, tl.reshape(group, [NG_PAD // RUN, RUN]), mask=listed != 0)
    return floor, listed_count, row_max


@triton.jit
def _listed(group_list, first, listed, TG: tl.constexpr, PARTS: tl.constexpr):
    """Group ids of list entries [first, first + TG), each repeated PARTS times (0 past
    `listed`): one per row of `_group_tile`."""
    entry = first + tl.arange(0, TG * PARTS) // PARTS
    return tl.load(group_list + entry, mask=entry < listed, other=0, cache_modifier=".cg")


@triton.jit
def _group_tile(src, n, group, first, listed, G: tl.constexpr, TG: tl.constexpr,
                PARTS: tl.constexpr, QUADS: tl.constexpr):  # fmt: skip
    """(columns, floats) of list entries [first, first + TG) (`group`: their ids, from
    `_listed`) as one [TG * PARTS, W / R, R] tile in column order (row-major): each group
    cut into PARTS pieces of W = G / PARTS columns, a piece in runs of R = min(W, 4); -inf
    where not read (entries past `listed`, and columns past n unless QUADS reads them,
    below). With the runs an axis of their own, Triton gives each thread whole pieces (a
    [TG, G] tile would spread a group over G / 4 threads), so counts per piece need no
    layout conversion (`_tile_prefix`); the caller picks PARTS so that there are about as
    many pieces as threads. The floats are raw: `_tile_keys` turns them into keys where they
    are used, so a tile loaded a step ahead is not waited for until then.

    QUADS (the row width a multiple of 4, W >= 4): loads are masked per quad of 4 columns
    (a quad that starts before n ends inside the row), which lets them be 16-byte vectors;
    the columns past n in the last quad are read and left to `_tile_keys`. Else masked per
    column."""
    W: tl.constexpr = G // PARTS
    R: tl.constexpr = 4 if W >= 4 else W
    piece = tl.arange(0, TG * PARTS)
    inside = (first + piece // PARTS < listed)[:, None, None]
    run = tl.arange(0, W // R)[None, :, None] * R + tl.arange(0, R)[None, None, :]
    col = (group * G + piece % PARTS * W)[:, None, None] + run
    if QUADS and W >= 4:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        mask = inside & (col // 4 * 4 < n)
    else:
        mask = inside & (col < n)
    value = tl.load(src + col, mask=mask, other=float("-inf"))
    return col, value


@triton.jit
def _tile_keys(col, value, n, QUADS: tl.constexpr):
    """`_order_key`s of a `_group_tile`, not zeroed at -inf (a key at or below KEY_NEG_INF
    where the tile held -inf); QUADS: 0 for the columns past n."""
    key = _order_key(value)
    if QUADS:
        key = tl.where(col < n, key, 0)
    return key


@triton.jit
def _collect_groups(
    src,
    n,
    floor,
    group_list,
    listed,
    candidates,
    ties,
    K_PAD: tl.constexpr,
    CAP: tl.constexpr,
    G: tl.constexpr,
    TG: tl.constexpr,
    PARTS: tl.constexpr,
    PTX: tl.constexpr,
    QUADS: tl.constexpr,
):
    """(above, tied): append the columns with key > floor of the `listed` groups of
    `group_list` to `candidates` and those equal to a finite floor to `ties`, in column order,
    TG groups per step (each in PARTS pieces, `_group_tile`); the counts count every match,
    the buffers keep the first CAP / K_PAD. Both are numbered by one prefix sum over the step
    (`_tile_prefix`), the two counts packed in 16-bit halves (a step holds fewer than 65536
    columns)."""
    above_total = tl.zeros([], tl.int32)
    tied_total = tl.zeros([], tl.int32)
    # The floor is at least KEY_NEG_INF: no key at or below it (the tile's keys are not
    # zeroed) is above the floor, nor, by the second test, tied with it.
    # Software pipeline: step i + 2's group ids load while step i is counted and stored,
    # and are first read a step later; so are step i + 1's floats, issued here too
    # (tools/compile_sm90.py --loads: first read ~360 instructions later).
    group = _listed(group_list, 0, listed, TG, PARTS)
    col, value = _group_tile(src, n, group, 0, listed, G, TG, PARTS, QUADS)
    group = _listed(group_list, TG, listed, TG, PARTS)
    for first in range(0, listed, TG):
        key = _tile_keys(col, value, n, QUADS and G // PARTS >= 4)
        above = key > floor
        tied = (key == floor) & (key > KEY_NEG_INF)
        packed = above.to(tl.int32) + (tied.to(tl.int32) << 16)
        here = col
        col, value = _group_tile(src, n, group, first + TG, listed, G, TG, PARTS, QUADS)
        group = _listed(group_list, first + 2 * TG, listed, TG, PARTS)
        rank, total = _tile_prefix(packed)
        slot = above_total + (rank & 0xFFFF)
        store_b32(candidates + slot, here, above & (slot < CAP), PTX)
        tied_here = (total >> 16) & 0xFFFF  # 32768 ties set the sign bit
        if tied_here > 0:  # ties are rare: most steps skip their stores' address math
            slot = tied_total + (rank >> 16)
            store_b32(ties + slot, here, tied & (slot < K_PAD), PTX)
        above_total += total & 0xFFFF
        tied_total += tied_here
    return above_total, tied_total


@triton.jit(do_not_specialize=["lengths_ptr", "width"])
def _topk_row_kernel(
    logits_ptr,
    lengths_ptr,
    out_ptr,
    scratch_ptr,
    row_stride,
    out_row_stride,
    width,
    k,
    K_PAD: tl.constexpr,
    CAP: tl.constexpr,
    G: tl.constexpr,
    SG: tl.constexpr,
    NG_PAD: tl.constexpr,
    ROW_INTS: tl.constexpr,
    PTX: tl.constexpr,
    QUADS: tl.constexpr,
    PARTS: tl.constexpr,
    SHORT: tl.constexpr,
    TIERS: tl.constexpr,
):
    """P = 1: one program per row; one streaming pass, then only the listed groups (QUADS:
    the width is a multiple of 4, `_group_tile`). The cost follows the row's live columns,
    not the buffer's width (a decode row is sized for the longest context): a row of at
    most SHORT live columns (SHORT > 0) is held whole in registers (`_whole_row_picks`, the
    bracket staged at the start of the row's scratch); a longer one of at most width >> t
    live columns (t <= TIERS) is cut into groups of G >> t columns, so (for rows longer than
    width >> (TIERS + 1)) it has between NG / 2 and NG groups like a full row
    (NG = cdiv(width, G)) and the floor stays as
    tight (with G columns per group a short row's few groups put the floor at their
    smallest maximum, and the select then falls back to whole-row passes)."""
    wait_for_prior_kernels()
    row = tl.program_id(0).to(tl.int64)
    n = row_length(lengths_ptr, row, width)
    src = logits_ptr + row * row_stride
    dst = out_ptr + row * out_row_stride
    candidates = scratch_ptr + row * ROW_INTS
    if SHORT > 0:
        if n <= SHORT:
            _whole_row_picks(src, dst, candidates, n, k, K_PAD, SHORT, RANK_KEYS)
        else:
            _tiered_row_picks(src, dst, candidates, n, width, k, K_PAD, CAP, G, SG, NG_PAD,
                              PTX, QUADS, PARTS, TIERS)  # fmt: skip
    else:
        _tiered_row_picks(src, dst, candidates, n, width, k, K_PAD, CAP, G, SG, NG_PAD, PTX,
                          QUADS, PARTS, TIERS)  # fmt: skip


@triton.jit
def _tiered_row_picks(src, dst, candidates, n, width, k, K_PAD: tl.constexpr,
                      CAP: tl.constexpr, G: tl.constexpr, SG: tl.constexpr,
                      NG_PAD: tl.constexpr, PTX: tl.constexpr, QUADS: tl.constexpr,
                      PARTS: tl.constexpr, TIERS: tl.constexpr):  # fmt: skip
    """The grouped path at tier t, the largest t <= TIERS with n <= width >> t: groups of
    G >> t columns, SG << t of them per step (the same step), PARTS >> t pieces each."""
    for tier in tl.static_range(TIERS + 1):
        if tier == TIERS:
            here = n <= (width >> tier)
        else:
            here = (n <= (width >> tier)) & (n > (width >> (tier + 1)))
        if here:
            _grouped_row_picks(src, dst, candidates, n, k, K_PAD, CAP, G >> tier, SG << tier,
                               NG_PAD, PTX, QUADS, max(1, PARTS >> tier))  # fmt: skip


@triton.jit
def _grouped_row_picks(src, dst, candidates, n, k, K_PAD: tl.constexpr, CAP: tl.constexpr,
                       G: tl.constexpr, SG: tl.constexpr, NG_PAD: tl.constexpr,
                       PTX: tl.constexpr, QUADS: tl.constexpr, PARTS: tl.constexpr):  # fmt: skip
    """`_topk_row_kernel`'s grouped path over one row (its scratch from `candidates` on)."""
    ties = candidates + CAP
    maxima = ties + K_PAD
    group_list = maxima + NG_PAD
    # Lanes keep their SEED_RANKS largest maxima for the floor search's seeds when k needs
    # at most 4 of each (`_maxima_range`).
    RANK: tl.constexpr = (K_PAD + SG - 1) // SG
    SEED_RANKS: tl.constexpr = RANK if RANK <= 4 else 0
    seen = _store_group_maxima(src, n, maxima, G, SG, SEED_RANKS, PTX)
    # Each phase reads what other threads of this program wrote (through L2) in the last.
    tl.debug_barrier()
    floor, listed, row_max = _list_groups(maxima, seen, n, k, group_list, G, NG_PAD, SEED_RANKS)
    tl.debug_barrier()
    above, tied = _collect_groups(src, n, floor, group_list, listed, candidates, ties,
                                  K_PAD, CAP, G, SG, PARTS, PTX, QUADS)  # fmt: skip
    tl.debug_barrier()
    _select(src, n, dst, candidates, ties, above, tied, floor, row_max, k, K_PAD, CAP, True)


@triton.jit(do_not_specialize=["lengths_ptr", "width"])
def _topk_whole_row_kernel(
    logits_ptr,
    lengths_ptr,
    out_ptr,
    stage_ptr,
    row_stride,
    out_row_stride,
    width,
    k,
    K_PAD: tl.constexpr,
    W_PAD: tl.constexpr,
    BRACKET: tl.constexpr,
):
    """One program per row of at most W_PAD columns, held in registers: one read, the exact
    search for the k-th largest key over all of them, then the picks in column order (ties
    by column), or with the last bracket ranked by `_emit_ranked` (staged in the row's
    2 * BRACKET ints of stage). From W_PAD = HALF_ROW_TIER on, a row of at most W_PAD / 2
    live columns is held in a tile of half the size, so the search's cost follows the live
    columns rather than the buffer's width (a decode row sized for the longest context
    holds a shorter one)."""
    wait_for_prior_kernels()
    row = tl.program_id(0).to(tl.int64)
    n = row_length(lengths_ptr, row, width)
    src = logits_ptr + row * row_stride
    dst = out_ptr + row * out_row_stride
    stage = stage_ptr + row * (2 * BRACKET)
    if W_PAD >= HALF_ROW_TIER:
        if n <= W_PAD // 2:
            _whole_row_picks(src, dst, stage, n, k, K_PAD, W_PAD // 2, BRACKET)
        else:
            _whole_row_picks(src, dst, stage, n, k, K_PAD, W_PAD, BRACKET)
    else:
        _whole_row_picks(src, dst, stage, n, k, K_PAD, W_PAD, BRACKET)


@triton.jit
def _whole_row_picks(src, dst, stage, n, k, K_PAD: tl.constexpr, W: tl.constexpr,
                     BRACKET: tl.constexpr):  # fmt: skip
    """The picks of one row of n <= W columns, held in a W-key tile (the whole-row kernel's,
    and the one-program kernel's for rows of at most SHORT columns); `stage` holds the
    last bracket's 2 * BRACKET ints, 8-byte aligned."""
    RUN: tl.constexpr = 4 if W >= 4 else 1
    col = tl.arange(0, W // RUN)[:, None] * RUN + tl.arange(0, RUN)[None, :]
    key = _load_keys(src, col, col < n, True)
    largest, smallest, live = _key_range(key)
    if live <= k:
        picked = (key > 0).to(tl.int32)
        slot, _ = _run_prefix(picked)
        tl.store(dst + slot, col, mask=picked != 0)
        tail = tl.arange(0, K_PAD)
        tl.store(dst + tail, tl.full([K_PAD], -1, tl.int32), mask=(tail >= live) & (tail < k))
    else:
        threshold, reaching, hi, above_hi = _kth_largest_key(
            key, k, k, k, largest, smallest, live, 0, 0, 32, BRACKET
        )
        if (reaching > k) & (reaching - above_hi <= BRACKET):
            _emit_ranked(key, col, threshold, hi, reaching - above_hi, above_hi, k, stage, dst,
                         BRACKET)  # fmt: skip
        else:
            _emit_selection(key, col, threshold, k, dst)


@triton.jit(do_not_specialize=["lengths_ptr", "width"])
def _split_floor_kernel(
    logits_ptr,
    lengths_ptr,
    scratch_ptr,
    counters_ptr,
    row_stride,
    width,
    k,
    GROUPS: tl.constexpr,
    GS: tl.constexpr,
    BLOCKS: tl.constexpr,
    MAXIMA_AT: tl.constexpr,
    ROW_INTS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """P > 1, grid (P, rows): program s writes the maxima of groups [s * GS, (s + 1) * GS);
    the row's last program to arrive turns all GROUPS maxima into the row's floor."""
    wait_for_prior_kernels()
    piece = tl.program_id(0) * GS
    row = tl.program_id(1).to(tl.int64)
    n = row_length(lengths_ptr, row, width)
    maxima = scratch_ptr + row * ROW_INTS + MAXIMA_AT
    counters = counters_ptr + row * COUNTER_SLOTS
    group_max = _group_maxima(logits_ptr + row * row_stride, n, piece, GROUPS, GS, BLOCKS)
    tl.store(maxima + piece + tl.arange(0, GS), group_max.to(tl.int32, bitcast=True))
    # Every thread's stores precede the release of the arrival (the acquire pairs with it).
    tl.debug_barrier()
    if tl.atomic_add(counters + FLOOR_ARRIVALS, 1, sem="acq_rel") == SPLIT - 1:
        every = tl.load(maxima + tl.arange(0, GROUPS), cache_modifier=".cg")
        every = every.to(tl.uint32, bitcast=True)
        largest, smallest, live = _key_range(every)
        floor, _ = _row_floor(every, k, largest, smallest, live, 0, 0)
        tl.store(counters + FLOOR_KEY, floor.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["lengths_ptr", "width"])
def _split_collect_kernel(
    logits_ptr,
    lengths_ptr,
    out_ptr,
    scratch_ptr,
    counters_ptr,
    row_stride,
    out_row_stride,
    width,
    k,
    K_PAD: tl.constexpr,
    CAP: tl.constexpr,
    GROUPS: tl.constexpr,
    GS: tl.constexpr,
    BLOCKS: tl.constexpr,
    ROW_INTS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """P > 1, grid (P, rows): program s collects its groups' columns above the row's floor;
    the row's last program to arrive selects."""
    wait_for_prior_kernels()
    piece = tl.program_id(0) * GS
    row = tl.program_id(1).to(tl.int64)
    n = row_length(lengths_ptr, row, width)
    src = logits_ptr + row * row_stride
    candidates = scratch_ptr + row * ROW_INTS
    ties = candidates + CAP
    counters = counters_ptr + row * COUNTER_SLOTS
    floor = tl.load(counters + FLOOR_KEY).to(tl.uint32, bitcast=True)
    # `_collect_step` over every block of the row, the full steps unmasked.
    main_stop = n // GROUPS // BLOCKS * BLOCKS
    for first in range(0, main_stop, BLOCKS):
        _collect_step(src, first, n, floor, candidates, ties, counters, piece,
                      K_PAD, CAP, GROUPS, GS, BLOCKS, False)  # fmt: skip
    if main_stop * GROUPS < n:
        _collect_step(src, main_stop, n, floor, candidates, ties, counters, piece,
                      K_PAD, CAP, GROUPS, GS, BLOCKS, True)  # fmt: skip
    tl.debug_barrier()
    if tl.atomic_add(counters + COLLECT_ARRIVALS, 1, sem="acq_rel") == SPLIT - 1:
        above = tl.atomic_add(counters + ABOVE, 0, sem="relaxed")
        tied = tl.atomic_add(counters + TIED, 0, sem="relaxed")
        _select(src, n, out_ptr + row * out_row_stride, candidates, ties, above, tied, floor,
                floor, k, K_PAD, CAP, False)  # fmt: skip


def _is_power_of_2(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def check_config(config: TopkConfig, k: int) -> None:
    """ValueError naming the field when `config` cannot serve this k."""
    for name in ("groups", "capacity", "num_warps", "programs_per_row", "chunk"):
        value = getattr(config, name)
        if not isinstance(value, int) or not _is_power_of_2(value):
            raise ValueError(f"config.{name} must be a power of two, got {value!r}")
    registers = config.max_registers
    if registers is not None and (not isinstance(registers, int) or not 24 <= registers <= 255):
        raise ValueError(f"config.max_registers must be None or in [24, 255], got {registers!r}")
    if config.whole_row:
        return
    if config.radix:
        if not 16 <= config.chunk <= MAX_STEP:
            raise ValueError(f"config.chunk must be in [16, {MAX_STEP}] for radix, got "
                             f"{config.chunk}")  # fmt: skip
        if config.capacity < RANK_KEYS.value:
            raise ValueError(f"config.capacity must be >= {RANK_KEYS.value} for radix, got "
                             f"{config.capacity}")  # fmt: skip
        return
    k_pad = next_power_of_2(k)
    if config.capacity < k_pad:
        raise ValueError(f"config.capacity {config.capacity} < next_power_of_2(k) {k_pad}")
    if config.groups // config.programs_per_row < 4:
        raise ValueError(
            f"config.programs_per_row {config.programs_per_row} leaves fewer than 4 of "
            f"config.groups {config.groups} per program"
        )


def group_columns(width: int, groups: int) -> int:
    """Columns per group of the P = 1 kernel: the power of two that cuts `width` columns
    into at most `groups` contiguous groups."""
    return next_power_of_2(max(1, -(-width // groups)))


def collect_parts(group: int, step_groups: int, num_warps: int) -> int:
    """PARTS of `_collect_groups`: how many pieces each group of `group` columns is cut
    into so that a step of `step_groups` groups has about one piece per thread, keeping
    pieces of >= 4 columns (at 128 x 65536: 1 at k 2048, 512 groups of 8 columns per step;
    2 at k 512, 256 groups of 16)."""
    return max(1, min(32 * num_warps // step_groups, group // 4))


def short_row_columns(cfg: TopkConfig, k: int, padded_width: int) -> int:
    """SHORT of the one-program kernel: rows of at most this many live columns are held
    whole (WHOLE_ROW_KEYS per thread at the config's warps); 0 when `cfg.short_rows` is
    off, or that tile would hold no more than k columns or no fewer than `padded_width`
    (the row's groups padded to a power of two: like every constexpr of the kernel, a
    function of the width's specialization class, so that one warm-up width covers it)."""
    short = 32 * cfg.num_warps * WHOLE_ROW_KEYS
    if cfg.short_rows and k < short < padded_width and short <= MAX_WHOLE_ROW_COLUMNS:
        return short
    return 0


def group_tiers(group: int, padded_width: int, short: int) -> int:
    """TIERS of the one-program kernel: how many times a shorter row's groups may halve
    (groups of at least MIN_TIER_GROUP columns), stopping before a tier whose rows all fit
    the SHORT hold (it would never run). From the group width and `padded_width` (the
    row's groups padded to a power of two), as the other constexprs are, so one warm-up
    width covers its class."""
    tiers = 0
    while group >> (tiers + 1) >= MIN_TIER_GROUP and padded_width >> (tiers + 1) > short:
        tiers += 1
    return tiers


def _launch_options(cfg: TopkConfig) -> dict[str, int]:
    options = {"num_warps": cfg.num_warps}
    if cfg.max_registers is not None:
        options["maxnreg"] = cfg.max_registers
    return options


@dataclass(frozen=True)
class _Plan:
    """Everything a `topk_per_row` call launches, from (k, rows, width, config) alone."""

    split: int
    """P, 0 for the whole-row kernel, RADIX_PATH for the radix select."""
    batch: int
    scratch_ints: int
    constexprs: tuple[dict[str, int | bool], ...]  # per launch of one row batch
    options: dict[str, int]


@functools.lru_cache(maxsize=512)
def _plan(k: int, rows: int, width: int, config: TopkConfig | None) -> _Plan:
    """The launches of `topk_per_row` for these sizes (cached: an eager call pays a lookup)."""
    cfg = config or default_config(k, rows, width)
    check_config(cfg, k)
    k_pad = next_power_of_2(k)
    if cfg.radix:
        return _Plan(RADIX_PATH, rows, 0, (dict(STEP=cfg.chunk, CAP=cfg.capacity),),
                     _launch_options(cfg))  # fmt: skip
    if cfg.whole_row:
        if width > MAX_WHOLE_ROW_COLUMNS:
            raise ValueError(
                f"config.whole_row holds rows of at most {MAX_WHOLE_ROW_COLUMNS} columns, "
                f"got {width}"
            )
        row_ints = 2 * RANK_KEYS.value
        constexprs = (dict(K_PAD=k_pad, W_PAD=max(16, next_power_of_2(width)),
                           BRACKET=RANK_KEYS.value),)  # fmt: skip
        return _Plan(0, max(1, SCRATCH_BYTES // (4 * row_ints)), row_ints, constexprs,
                     _launch_options(cfg))  # fmt: skip
    split = cfg.programs_per_row
    if split == 1:
        group = group_columns(width, cfg.groups)
        if max(group, cfg.chunk) > MAX_STEP_COLUMNS:
            raise ValueError(
                f"top-k over rows of {width} columns with config.groups {cfg.groups} and "
                f"config.chunk {cfg.chunk}: a step of the one-program path would hold "
                f"{max(group, cfg.chunk)} columns, more than {MAX_STEP_COLUMNS}"
            )
        groups_pad = next_power_of_2(-(-width // group))
        step_groups = max(1, cfg.chunk // group)
        short = short_row_columns(cfg, k, groups_pad * group)
        tiers = group_tiers(group, groups_pad * group, short)
        row_ints = cfg.capacity + k_pad + 2 * groups_pad
        if short:  # its last bracket is staged as uint64 at the start of the row's scratch
            row_ints = max(row_ints + row_ints % 2, 2 * RANK_KEYS.value)
        launches: tuple[dict[str, int | bool], ...] = (dict(
            K_PAD=k_pad, CAP=cfg.capacity, G=group, SG=step_groups, NG_PAD=groups_pad,
            ROW_INTS=row_ints, PTX=operand_mode() == OPERANDS_BF16X2, QUADS=width % 4 == 0,
            PARTS=collect_parts(group, step_groups, cfg.num_warps), SHORT=short, TIERS=tiers,
        ),)  # fmt: skip
        batch = max(1, SCRATCH_BYTES // (4 * row_ints))
    else:
        slice_groups = cfg.groups // split
        maxima_at = cfg.capacity + k_pad
        row_ints = maxima_at + cfg.groups
        shared = dict(GROUPS=cfg.groups, GS=slice_groups, BLOCKS=max(1, cfg.chunk // slice_groups),
                      ROW_INTS=row_ints, SPLIT=split)  # fmt: skip
        launches = (dict(shared, MAXIMA_AT=maxima_at), dict(shared, K_PAD=k_pad, CAP=cfg.capacity))
        # Rows are the grid's second axis (at most 65535 programs there).
        batch = min(max(1, SCRATCH_BYTES // (4 * row_ints)), 65535)
    return _Plan(split, batch, row_ints, launches, _launch_options(cfg))


def _row_batches(
    rows: int, batch: int, *tensors: torch.Tensor
) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """(row count, the tensors' rows) per batch of at most `batch` rows (no views when one
    batch holds every row)."""
    if rows <= batch:
        yield rows, tensors
        return
    for first in range(0, rows, batch):
        last = min(first + batch, rows)
        yield last - first, tuple(t[first:last] for t in tensors)


def topk_per_row(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    *,
    config: TopkConfig | None = None,
) -> None:
    """Triton `topk_per_row` (docs/contract.md section 5.2; arguments validated by the wrapper).

    out[r] gets the columns of the k largest of logits[r, :clamp(lengths[r], 0, W)] in any
    order, -1 padded; -inf is never picked. `config` overrides `default_config(k, rows, W)`
    (tuning hook, checked by `check_config`). Reads no device value on the host: P and every
    size come from the shapes, so a captured launch replays correctly at any lengths. Whole
    rows: `_topk_whole_row_kernel` per row; P = 1: `_topk_row_kernel` per row; P > 1:
    `_split_floor_kernel` then `_split_collect_kernel` over P programs per row. Rows go in
    batches whose scratch fits SCRATCH_BYTES.
    """
    rows, width = logits.shape
    if rows == 0 or k == 0:
        return
    plan = _plan(k, rows, width, config)
    if plan.split == RADIX_PATH:
        (radix_c,) = plan.constexprs
        radix_topk_per_row(logits, lengths, k, out, step=radix_c["STEP"],
                           capacity=radix_c["CAP"], options=plan.options)  # fmt: skip
        return
    device = logits.device
    scratch = torch.empty((min(rows, plan.batch), plan.scratch_ints), dtype=torch.int32,
                          device=device)  # fmt: skip
    options, split = plan.options, plan.split
    lstride, ostride = logits.stride(0), out.stride(0)
    if split == 0:
        (whole_c,) = plan.constexprs
        for n, (x, lens, dst) in _row_batches(rows, plan.batch, logits, lengths, out):
            launch(_topk_whole_row_kernel, (n,), x, lens, dst, scratch, lstride, ostride, width,
                   k, **whole_c, **options)  # fmt: skip
        return
    if split == 1:
        (row_c,) = plan.constexprs
        for n, (x, lens, dst) in _row_batches(rows, plan.batch, logits, lengths, out):
            launch(_topk_row_kernel, (n,), x, lens, dst, scratch, lstride, ostride, width, k,
                   **row_c, **options)  # fmt: skip
        return
    floor_c, collect_c = plan.constexprs
    counters = torch.zeros((scratch.shape[0], COUNTER_SLOTS.value), dtype=torch.int32,
                           device=device)  # fmt: skip
    for i, (n, (x, lens, dst)) in enumerate(_row_batches(rows, plan.batch, logits, lengths, out)):
        if i > 0:
            counters.zero_()
        launch(_split_floor_kernel, (split, n), x, lens, scratch, counters, lstride, width, k,
               **floor_c, **options)  # fmt: skip
        launch(_split_collect_kernel, (split, n), x, lens, dst, scratch, counters, lstride,
               ostride, width, k, **collect_c, **options)  # fmt: skip


__all__ = [
    "TopkConfig",
    "check_config",
    "default_config",
    "radix_config",
    "split_config",
    "topk_per_row",
]
