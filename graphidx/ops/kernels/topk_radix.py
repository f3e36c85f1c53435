"""Exact top-k spread over many programs per row: a radix select.

One program per row (the grouped path of `topk`) leaves most SMs idle on a very wide row; here
every row is cut into slices of STEP columns, one program per slice (grid: slices x rows),
and the row's k-th largest key is found 11 bits at a time by counting, so no program ever
searches. `topk.default_config` takes it for one row of at least RADIX_MIN_WIDTH columns at
k above SPLIT_MAX_K, the only shapes where the H200 measured it faster (docs/perf-notes.md:
the histograms are instruction-bound, so at 2-64 rows of 64K columns it is slower):

1. `_radix_high_kernel`: each program counts its slice's live keys by their top 11 bits
   (BINS bins, `tl.histogram`) and adds the nonzero counts to the row's histogram (relaxed
   atomics). The row's last program to arrive (an acq_rel counter) finds the bin holding the
   k-th largest key (HIGH_BIN) and the count of keys in higher bins (ABOVE_HIGH, < k). A row
   with at most k live keys takes them all (HIGH_BIN = NO_BIN).
2. `_radix_low_kernel`: the same over the keys of HIGH_BIN by their next 11 bits; the last
   program sets PREFIX, the k-th largest key's top 22 bits, and ABOVE, the count of keys
   whose top 22 bits exceed it (< k).
3. `_radix_collect_kernel`: every key whose top 22 bits exceed PREFIX is a pick, stored at
   a slot from one atomic per program plus a prefix sum; the columns of keys whose top 22
   bits equal it are staged. The last program to arrive picks the k - ABOVE best staged
   keys by (key descending, column ascending): one rank step for at most RANK_KEYS of them
   (`_emit_ranked`), else two exact counting searches over at most CAP (the k-th largest
   key, then the smallest columns among the keys tied with it), and for more than CAP (rows
   with thousands of keys sharing 22 bits) the whole-row selection in column order.

The picks are the first k by (key descending, column ascending), so equal inputs give equal
picks; their order in `out` follows the programs' arrival (the contract's "any order"). A row
of n live keys costs three short passes over its n columns (the last two from L2) and a few
hundred atomics; the programs past a row's length return at once. The row state and both
histograms (STATE_INTS int32 per row) start zeroed (one fill per call); the staged columns
and the rank step's stage are scratch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphidx.ops.kernels import topk_select as sel
from graphidx.ops.kernels.launch import launch
from graphidx.ops.kernels.ptx import wait_for_prior_kernels

BINS = tl.constexpr(2048)
"""Bins per radix digit (11 bits): two digits resolve a key's top 22 bits."""
HIGH_SHIFT = tl.constexpr(21)
LOW_SHIFT = tl.constexpr(10)
NO_BIN = tl.constexpr(sel.KEY_NEG_INF.value >> 21)
"""A high bin no live key has (live keys exceed KEY_NEG_INF): the row takes every live key."""
TAKE_ALL = tl.constexpr(sel.KEY_NEG_INF.value >> 10)
"""The PREFIX below every live key's top 22 bits: all of them are picks, none staged."""
MAX_STEP = 8192
"""Widest slice: the collect numbers picks and staged keys in 16-bit halves of one sum."""

# Row state (int32 slots); the two histograms follow.
HIGH_ARRIVALS = tl.constexpr(0)
LOW_ARRIVALS = tl.constexpr(1)
COLLECT_ARRIVALS = tl.constexpr(2)
HIGH_BIN = tl.constexpr(3)
ABOVE_HIGH = tl.constexpr(4)
PREFIX = tl.constexpr(5)
ABOVE = tl.constexpr(6)
PICKED = tl.constexpr(7)
STAGED = tl.constexpr(8)
HIGH_COUNTS = tl.constexpr(16)
LOW_COUNTS = tl.constexpr(16 + BINS.value)
STATE_INTS = tl.constexpr(16 + 2 * BINS.value)
STAGE_INTS = tl.constexpr(2 * sel.RANK_KEYS.value)
"""The rank step's stage (uint64 per key) at the start of a row's scratch; staged columns
follow."""


@triton.jit
def _slice_keys(src, n, first, STEP: tl.constexpr, QUADS: tl.constexpr):
    """(columns, keys) of columns [first, first + STEP) of a row of length n as a
    [STEP / 4, 4] tile, key 0 (never picked) past n or at -inf. QUADS (the row width a
    multiple of 4): loads masked per quad, so they can be 16-byte vectors."""
    col = first + tl.arange(0, STEP // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    if QUADS:
        value = tl.load(src + col, mask=col // 4 * 4 < n, other=float("-inf"))
    else:
        value = tl.load(src + col, mask=col < n, other=float("-inf"))
    key = sel._order_key(value)
    return col, tl.where((col < n) & (key > sel.KEY_NEG_INF), key, 0)


@triton.jit
def _add_counts(counts_ptr, digit, mask, STEP: tl.constexpr):
    """Add this slice's histogram of `digit` (int32 in [0, BINS), where `mask`) to the row's."""
    counts = tl.histogram(tl.reshape(digit, [STEP]), BINS, mask=tl.reshape(mask, [STEP]))
    tl.atomic_add(counts_ptr + tl.arange(0, BINS), counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _last_to_arrive(arrivals):
    """Whether this program is the last of its row (grid axis 0) to pass here; the caller's
    earlier stores and atomics are then visible to it, and its to the others' later reads."""
    tl.debug_barrier()  # every thread's stores precede the release of the arrival
    return tl.atomic_add(arrivals, 1, sem="acq_rel") == tl.num_programs(0) - 1


@triton.jit
def _row_counts(counts_ptr):
    """The row's histogram, read through L2 (other programs' atomics wrote it)."""
    return tl.load(counts_ptr + tl.arange(0, BINS), cache_modifier=".cg")


@triton.jit
def _bin_of_kth(counts, need):
    """(b, count in bins above b) for a row's histogram: b is the bin holding the need-th
    largest counted key (1 <= need <= the total)."""
    at_or_above = tl.sum(counts) - (tl.cumsum(counts, 0) - counts)  # keys in bins >= b
    bins = tl.arange(0, BINS)
    b = tl.max(tl.where(at_or_above >= need, bins, -1))
    return b, tl.sum(tl.where(bins > b, counts, 0))


@triton.jit(do_not_specialize=["lengths_ptr", "width"])
def _radix_high_kernel(logits_ptr, lengths_ptr, state_ptr, row_stride, width, k,
                       STEP: tl.constexpr, QUADS: tl.constexpr):  # fmt: skip
    """Pass 1, grid (slices, rows): the row's histogram of top digits, then HIGH_BIN and
    ABOVE_HIGH."""
    wait_for_prior_kernels()
    first = tl.program_id(0) * STEP
    row = tl.program_id(1).to(tl.int64)
    n = sel.row_length(lengths_ptr, row, width)
    state = state_ptr + row * STATE_INTS
    if first < n:
        _, key = _slice_keys(logits_ptr + row * row_stride, n, first, STEP, QUADS)
        _add_counts(state + HIGH_COUNTS, (key >> HIGH_SHIFT).to(tl.int32), key > 0, STEP)
    if _last_to_arrive(state + HIGH_ARRIVALS):
        counts = _row_counts(state + HIGH_COUNTS)
        live = tl.sum(counts)
        high_bin = tl.full([], NO_BIN, tl.int32)
        above = live
        if live > k:
            high_bin, above = _bin_of_kth(counts, k)
        tl.store(state + HIGH_BIN, high_bin)
        tl.store(state + ABOVE_HIGH, above)


@triton.jit(do_not_specialize=["lengths_ptr", "width"])
def _radix_low_kernel(logits_ptr, lengths_ptr, state_ptr, row_stride, width, k,
                      STEP: tl.constexpr, QUADS: tl.constexpr):  # fmt: skip
    """Pass 2, grid (slices, rows): the histogram of HIGH_BIN's keys by their next digit,
    then PREFIX and ABOVE."""
    wait_for_prior_kernels()
    first = tl.program_id(0) * STEP
    row = tl.program_id(1).to(tl.int64)
    n = sel.row_length(lengths_ptr, row, width)
    state = state_ptr + row * STATE_INTS
    high_bin = tl.load(state + HIGH_BIN)
    if (first < n) & (high_bin != NO_BIN):
        _, key = _slice_keys(logits_ptr + row * row_stride, n, first, STEP, QUADS)
        # Keys of 0 sit in bin 0, never HIGH_BIN (live keys' bins are above NO_BIN).
        match = (key >> HIGH_SHIFT).to(tl.int32) == high_bin
        low = ((key >> LOW_SHIFT) & (BINS - 1)).to(tl.int32)
        _add_counts(state + LOW_COUNTS, low, match, STEP)
    if _last_to_arrive(state + LOW_ARRIVALS):
        above = tl.load(state + ABOVE_HIGH)
        prefix = tl.full([], TAKE_ALL, tl.int32)
        if high_bin != NO_BIN:
            low_bin, above_low = _bin_of_kth(_row_counts(state + LOW_COUNTS), k - above)
            prefix = (high_bin << 11) | low_bin
            above += above_low
        tl.store(state + PREFIX, prefix)
        tl.store(state + ABOVE, above)


@triton.jit(do_not_specialize=["lengths_ptr", "width"])
def _radix_collect_kernel(logits_ptr, lengths_ptr, out_ptr, state_ptr, scratch_ptr, row_stride,
                          out_row_stride, width, k, STEP: tl.constexpr, QUADS: tl.constexpr,
                          CAP: tl.constexpr):  # fmt: skip
    """Pass 3, grid (slices, rows): store the picks above PREFIX, stage the columns at it,
    and let the row's last program pick among the staged ones and pad with -1."""
    wait_for_prior_kernels()
    first = tl.program_id(0) * STEP
    row = tl.program_id(1).to(tl.int64)
    n = sel.row_length(lengths_ptr, row, width)
    state = state_ptr + row * STATE_INTS
    src = logits_ptr + row * row_stride
    dst = out_ptr + row * out_row_stride
    stage = scratch_ptr + row * (STAGE_INTS + CAP)
    staged_cols = stage + STAGE_INTS
    prefix = tl.load(state + PREFIX)
    if first < n:
        col, key = _slice_keys(src, n, first, STEP, QUADS)
        top = (key >> LOW_SHIFT).to(tl.int32)
        pick = (key > 0) & (top > prefix)
        staged = (key > 0) & (top == prefix)
        rank, total = sel._run_prefix(pick.to(tl.int32) + (staged.to(tl.int32) << 16))
        base = tl.atomic_add(state + PICKED, total & 0xFFFF, sem="relaxed")
        tl.store(dst + base + (rank & 0xFFFF), col, mask=pick)
        slot = tl.atomic_add(state + STAGED, total >> 16, sem="relaxed") + (rank >> 16)
        tl.store(staged_cols + slot, col, mask=staged & (slot < CAP))
    if _last_to_arrive(state + COLLECT_ARRIVALS):
        above = tl.load(state + ABOVE)
        if prefix == TAKE_ALL:
            for start in range(above, k, 1024):  # fewer than k live keys: -1 after them
                tail = start + tl.arange(0, 1024)
                tl.store(dst + tail, tl.full([1024], -1, tl.int32), mask=tail < k)
        else:
            staged_count = tl.atomic_add(state + STAGED, 0, sem="relaxed")
            _pick_staged(src, n, k, dst, stage, staged_cols, staged_count, above, CAP)


@triton.jit
def _pick_staged(src, n, k, dst, stage, staged_cols, staged, above, CAP: tl.constexpr):
    """Write the k - above best of the `staged` columns (k - above <= staged) by (key
    descending, column ascending) to dst[above:k]; more than CAP: the whole row again."""
    if staged <= sel.RANK_KEYS:
        col, key = _staged_keys(src, staged_cols, staged, sel.RANK_KEYS)
        lowest = tl.full([], 1, tl.uint32)
        highest = tl.full([], 0xFFFFFFFF, tl.uint32)
        sel._emit_ranked(key, col, lowest, highest, staged, above, k, stage, dst, sel.RANK_KEYS)
    elif staged <= CAP:
        col, key = _staged_keys(src, staged_cols, staged, CAP)
        need = k - above
        largest, smallest, live = sel._key_range(key)
        t, reaching, _, _ = sel._kth_largest_key(key, need, need, need, largest, smallest, live,
                                                 0, 0, 32, 0)  # fmt: skip
        over = key > t
        rank, over_count = sel._run_prefix(over.to(tl.int32))
        tl.store(dst + above + rank, col, mask=over)
        # Keys tied with t, the smallest columns first: ~column orders them (columns < 2**31).
        tied = tl.where(key == t, (~col).to(tl.uint32, bitcast=True), 0)
        take = tied > 0
        if reaching > need:
            m = need - over_count
            largest, smallest, live = sel._key_range(tied)
            first_col, _, _, _ = sel._kth_largest_key(tied, m, m, m, largest, smallest, live,
                                                      0, 0, 32, 0)  # fmt: skip
            take = tied >= first_col
        rank, _ = sel._run_prefix(take.to(tl.int32))
        tl.store(dst + above + over_count + rank, col, mask=take)
    else:
        sel._select_from_row(src, n, k, dst, sel.FALLBACK_STEP)


@triton.jit
def _staged_keys(src, staged_cols, staged, M: tl.constexpr):
    """(columns, keys) of the first `staged` <= M staged columns as a [M / 4, 4] tile, key 0
    past them (the columns' own keys are live, so above 0)."""
    slot = tl.arange(0, M // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    inside = slot < staged
    col = tl.load(staged_cols + slot, mask=inside, other=0, cache_modifier=".cg")
    key = tl.where(inside, sel._order_key(tl.load(src + col, mask=inside, other=0.0)), 0)
    return col, key


def radix_topk_per_row(logits: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor,
                       *, step: int, capacity: int, options: dict[str, int]) -> None:  # fmt: skip
    """`topk_per_row` over slices of `step` columns (a power of two, 16..MAX_STEP), staging at
    most `capacity` columns per row (a power of two >= RANK_KEYS), three launches per batch of
    at most 65535 rows (the grid's second axis). Sizes from shapes only: capturable."""
    rows, width = logits.shape
    slices = triton.cdiv(width, step)
    batch = 65535
    device = logits.device
    used = min(rows, batch)
    state = torch.zeros((used, STATE_INTS.value), dtype=torch.int32, device=device)
    scratch = torch.empty((used, STAGE_INTS.value + capacity), dtype=torch.int32, device=device)
    lstride, ostride = logits.stride(0), out.stride(0)
    quads = width % 4 == 0
    for first in range(0, rows, batch):
        last = min(first + batch, rows)
        if first > 0:
            state.zero_()
        x, lens, dst = logits[first:last], lengths[first:last], out[first:last]
        grid = (slices, last - first)
        launch(_radix_high_kernel, grid, x, lens, state, lstride, width, k, STEP=step,
               QUADS=quads, **options)  # fmt: skip
        launch(_radix_low_kernel, grid, x, lens, state, lstride, width, k, STEP=step,
               QUADS=quads, **options)  # fmt: skip
        launch(_radix_collect_kernel, grid, x, lens, dst, state, scratch, lstride, ostride,
               width, k, STEP=step, QUADS=quads, CAP=capacity, **options)  # fmt: skip
