"""Exact selection helpers shared by the top-k kernels (`topk`, `topk_radix`).

Keys are the order-preserving uint32 image of float32 (`_order_key`): comparing keys compares
the floats, ties and signed zeros in one total order, and every key at or below KEY_NEG_INF
(-inf's) is never picked (loaded as 0). Here: the loads that make keys, the counting search
for a k-th largest key over a register tile (`_kth_largest_key`, three trial thresholds per
CTA-wide sum), the prefix sum that numbers picks (`_run_prefix`), the one-step rank of a small
bracket by (key, column) (`_emit_ranked`), and the whole-row selection by counting passes
that every path falls back to on adversarial rows (`_select_from_row`).
"""

from __future__ import annotations

import triton
import triton.language as tl

KEY_NEG_INF = tl.constexpr(0x007FFFFF)
"""_order_key(-inf): every key <= this is never picked (a constexpr global for the kernels)."""

RANK_KEYS = tl.constexpr(128)
"""Largest bracket (keys left in [lo, hi] around the k-th largest) the select's exact search
hands to one rank step (`_emit_ranked`) instead of more counting rounds: on rows of normals
(128 x 65536, a model of the search) 4.5 -> 2.0 rounds at k 2048, 3.9 -> 1.9 at k 512, at
most 114 keys left. Capped at K_PAD / 2 (the bracket is staged in the tie buffer)."""

RANK_PARTS = tl.constexpr(4)
"""Threads per staged key in `_emit_ranked` (RANK_KEYS * RANK_PARTS = 512: one per thread
at 16 warps)."""

BRACKET_SPREAD = tl.constexpr(8)
"""Interpolated trials sit at the estimate and +- 1/BRACKET_SPREAD of the bracket from it
(chosen over 16 and 32 by rounds counted on rows of normals)."""

_COUNT_BITS = 21

COUNT_BITS = tl.constexpr(_COUNT_BITS)
"""Width of one packed count: a tensor has at most 2**20 elements, so counts fit."""

COUNT_FIELD = tl.constexpr((1 << _COUNT_BITS) - 1)

THIRD_COUNT_AT = tl.constexpr(2 * _COUNT_BITS)

FALLBACK_STEP = tl.constexpr(1024)
"""Columns per step of the whole-row fallback: small, so the rare path does not raise the
register count (and cut the occupancy) of the kernel that holds it."""


@triton.jit
def _order_key(x):
    """uint32 image of float32 that orders like the floats (NaN above +inf): negatives flip
    every bit, the rest only the sign bit (xor with the sign-extended sign, or the sign)."""
    sign = (x.to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True)
    return x.to(tl.uint32, bitcast=True) ^ (sign | 0x80000000)


@triton.jit
def _never_picked_zero(key):
    """Keys at or below -inf's (KEY_NEG_INF) as 0, the others kept."""
    return tl.where(key > KEY_NEG_INF, key, 0)


@triton.jit
def _load_order_keys(src, col, inside, MASKED: tl.constexpr):
    """`_order_key` of columns `col`, -inf's key where not `inside` (MASKED; unmasked, so
    vectorized, when the caller knows every column is inside)."""
    if MASKED:
        return _order_key(tl.load(src + col, mask=inside, other=float("-inf")))
    return _order_key(tl.load(src + col))


@triton.jit
def _load_keys(src, col, inside, MASKED: tl.constexpr):
    """Keys of columns `col`; 0 (never picked) where not `inside` or at -inf."""
    return _never_picked_zero(_load_order_keys(src, col, inside, MASKED))


@triton.jit
def _count_at_least3(keys, t1, t2, t3):
    """(count(keys >= t1), count(keys >= t2), count(keys >= t3)) in one packed int64 sum."""
    packed = (keys >= t1).to(tl.int64)
    packed += (keys >= t2).to(tl.int64) << COUNT_BITS
    packed += (keys >= t3).to(tl.int64) << THIRD_COUNT_AT
    total = tl.sum(packed)
    return (
        (total & COUNT_FIELD).to(tl.int32),
        ((total >> COUNT_BITS) & COUNT_FIELD).to(tl.int32),
        (total >> THIRD_COUNT_AT).to(tl.int32),
    )


@triton.jit
def _count_at_least(keys, threshold, shift):
    """count(keys >= threshold | d << shift) for d = 1, 2, 3, in one packed int64 sum."""
    one = tl.full([], 1, tl.uint32)
    return _count_at_least3(
        keys, threshold | (one << shift), threshold | (2 * one << shift),
        threshold | (3 * one << shift),
    )  # fmt: skip


@triton.jit
def _take_digit(threshold, count, c1, c2, c3, k, shift):
    """Set the 2-bit digit at `shift`: the largest d with count(keys >= trial d) >= k (the
    counts fall with d). `count` tracks count(keys >= threshold) once a trial passed."""
    digit = (c1 >= k).to(tl.uint32) + (c2 >= k).to(tl.uint32) + (c3 >= k).to(tl.uint32)
    threshold = threshold | (digit << shift)
    count = tl.where(c3 >= k, c3, tl.where(c2 >= k, c2, tl.where(c1 >= k, c1, count)))
    return threshold, count


@triton.jit
def _max_min_count(a_max, a_min, a_count, b_max, b_min, b_count):
    return tl.maximum(a_max, b_max), tl.minimum(a_min, b_min), a_count + b_count


@triton.jit
def _key_range(keys):
    """(largest, smallest nonzero, count of nonzero) of uint32 keys in one CTA-wide pass
    (smallest 0xFFFFFFFF when none is nonzero)."""
    flat = tl.reshape(keys, [keys.numel])
    live = flat > 0
    return tl.reduce((flat, tl.where(live, flat, 0xFFFFFFFF), live.to(tl.int32)), 0, _max_min_count)


@triton.jit
def _kth_largest_key(keys, k, tight, loose, largest, smallest, live, seed_lo, seed_hi,
                     LOOSE_BITS: tl.constexpr, BRACKET: tl.constexpr):  # fmt: skip
    """(t, count(keys >= t), hi, count(keys > hi)): a threshold t > 0 with count(keys >= t)
    >= k, keys uint32 (0 = never picked) bracketed by (largest, smallest, live): no key above
    largest, live = count(keys >= smallest) >= k, smallest >= 1 (their `_key_range`, or any
    such bracket); [t, hi] is the search's last bracket (count(keys > hi) < k).

    The search keeps a bracket [lo, hi] around the k-th largest key t*: count(keys >= lo) >=
    k > count(keys > hi). Each CTA-wide count tests three trial thresholds inside it: around
    where the counts at its ends place t* by linear interpolation (+- 1/BRACKET_SPREAD of the
    bracket), or at its quarters in every round after one that shrank the bracket less than
    4x (data the interpolation misjudges, e.g. clusters); every round shrinks it. It stops once
    count(keys >= lo) <= tight, or <= loose with the bracket cut to 2**-LOOSE_BITS of the
    keys' range, or at lo = hi (lo = t*), or (BRACKET > 0) once at most BRACKET keys are
    left in [lo, hi], and returns lo.
    With tight = loose = k, LOOSE_BITS = 32 and BRACKET = 0 the result is exact: t = t*, or a
    t with exactly k keys >= t, so count(keys > t) <= k. With BRACKET > 0 it is exact too
    unless count(keys >= t) > k and at most BRACKET keys lie in [t, hi]: then t* is among
    those (`_emit_ranked` ranks them).
    On rows of normals this takes ~4 rounds where a 2-bit radix search took 6-6.4 (k 512)
    and 10.7 (the select at k 2048); on clustered or tie-heavy keys up to ~18, where the
    radix search took at most 16.
    Seeds (seed_hi > 0): the first round's trials are seed_lo, seed_hi + 1 and their middle
    (cut into the bracket) instead of interpolated ones. Keys near t* on both sides (the
    floor's, from `_maxima_range`) save the rounds the interpolation spends narrowing a wide
    first bracket (rows of normals at k 2048: the floor search in ~1.8 rounds instead of 4,
    counted in a model of this search). Seeds are only trials: any give a valid result.
    """
    lo = smallest
    hi = largest
    count_lo = live  # count(keys >= lo)
    count_hi = live * 0  # count(keys > hi)
    if LOOSE_BITS < 32:  # noqa: SIM108 (a constexpr branch: a 32-bit shift is undefined)
        loose_width = (hi - lo) >> LOOSE_BITS
    else:
        loose_width = tl.zeros([], tl.uint32)
    quarters = live < 0  # false
    seeded = (live >= 0) & (seed_hi > 0)  # a tensor even for constant seeds
    while (
        (lo < hi)
        & (count_lo > tight)
        & ((count_lo > loose) | (hi - lo > loose_width))
        & ((BRACKET == 0) | (count_lo - count_hi > BRACKET))
    ):
        # Trials in (lo, hi]: the middle one from scalar float math (inexact is fine, any
        # trial inside the bracket is a valid one), the others a step to either side, cut
        # at the bracket's ends. lo >= 1, so width + 1 fits in 32 bits.
        width = hi - lo
        span = (width + 1).to(tl.float32)
        # Where t* would sit if the keys in the bracket were spread evenly.
        share = tl.fdiv((count_lo - k).to(tl.float32), (count_lo - count_hi).to(tl.float32))
        t2 = lo + _offset_in(tl.where(quarters, 0.5, share) * span, width)
        step = tl.where(quarters, width // 4, width // BRACKET_SPREAD)
        t1 = t2 - tl.minimum(step, t2 - lo - 1)
        t3 = t2 + tl.minimum(step, hi - t2)
        if seeded:  # the first round only
            t1 = tl.minimum(tl.maximum(seed_lo, lo + 1), hi)
            t3 = tl.minimum(tl.maximum(seed_hi, lo), hi - 1) + 1
            t2 = t1 + (t3 - t1) // 2
        c1, c2, c3 = _count_at_least3(keys, t1, t2, t3)
        # The highest trial still reaching k becomes lo, the next one up bounds hi.
        hi = tl.where(c3 >= k, hi, tl.where(c2 >= k, t3, tl.where(c1 >= k, t2, t1)) - 1)
        count_hi = tl.where(c3 >= k, count_hi, tl.where(c2 >= k, c3, tl.where(c1 >= k, c2, c1)))
        lo = tl.where(c3 >= k, t3, tl.where(c2 >= k, t2, tl.where(c1 >= k, t1, lo)))
        count_lo = tl.where(c3 >= k, c3, tl.where(c2 >= k, c2, tl.where(c1 >= k, c1, count_lo)))
        # (The seeded round's trials need not cut the bracket 4x to be good ones.)
        quarters = quarters | ((hi - lo > width // 4) & ~seeded)
        seeded = live < 0  # false
    return lo, count_lo, hi, count_hi


@triton.jit
def _offset_in(offset, width):
    """A float offset as a uint32 in [1, width] (width >= 1)."""
    whole = tl.minimum(tl.maximum(offset, 1.0), 4294967040.0).to(tl.uint32)
    return tl.minimum(whole, width)


@triton.jit
def _run_prefix(x):
    """(exclusive prefix sum of x in row-major order, total) for a 2-D [runs, RUN] tensor:
    a prefix sum within each run plus one across the run totals. Triton scans a flat tensor
    as one warp-wide scan per element a thread holds (16 per thread at 8192 elements); this
    form keeps the runs in the loads' layout (`_list_groups`, `_collect_groups`,
    `_emit_selection`)."""
    run_total = tl.sum(x, axis=1)
    prefix = (tl.cumsum(run_total, axis=0) - run_total)[:, None] + tl.cumsum(x, axis=1) - x
    return prefix, tl.sum(run_total, axis=0)


@triton.jit
def _emit_ranked(key, col, lo, hi, inside, above, k, stage, dst, M: tl.constexpr):
    """Write the `above` < k columns with key > hi (key and col [runs, RUN] in column order)
    to dst, then the k - above first of the `inside` <= M keys in [lo, hi] by (key
    descending, column ascending) after them: the k-th largest key need not be known, and
    tied keys go in column order whatever order the candidates are in.

    One prefix sum numbers both kinds; the bracket's keys are staged in stage[0 : 2M] (int32,
    8-byte aligned) as uint64 that order the same way, (key << 32) | ~column, and each
    key is ranked against all the others by RANK_PARTS threads."""
    over = (key > hi).to(tl.int32)
    between = (key >= lo) & (key <= hi)
    tl.static_assert(M < 256)  # the bracket's numbers fit the low 8 bits
    rank, _ = _run_prefix(between.to(tl.int32) + (over << 8))
    tl.store(dst + (rank >> 8), col, mask=over != 0)
    staged = stage.to(tl.pointer_type(tl.uint64))
    order = (key.to(tl.uint64) << 32) | (~col).to(tl.uint32, bitcast=True).to(tl.uint64)
    tl.store(staged + (rank & 0xFF), order, mask=between)
    tl.debug_barrier()  # other threads of this CTA read the staged keys
    # Thread (entry, part) compares its entry with every RANK_PARTS-th staged one from `part`
    # on (a flat tensor, so both loads share one layout); the parts' counts are then summed.
    slot = tl.arange(0, M * RANK_PARTS)
    entry = slot // RANK_PARTS
    mine = tl.load(staged + entry, mask=entry < inside, other=0)
    ahead = tl.zeros([M * RANK_PARTS], tl.int32)  # staged entries ahead of mine
    for first in range(0, inside, 8 * RANK_PARTS):
        for j in tl.static_range(8):  # 8 loads in flight per thread and iteration
            other = first + j * RANK_PARTS + slot % RANK_PARTS
            # 0 past `inside`: below every staged value (keys >= lo >= 1).
            theirs = tl.load(staged + other, mask=other < inside, other=0)
            ahead += (theirs > mine).to(tl.int32)
    # The parts' counts summed, then every part stores the same column (no layout changes; the
    # mask from the data: a staged value is never 0).
    place = tl.sum(tl.reshape(ahead, [M, RANK_PARTS]), axis=1)[:, None]
    place = tl.reshape(tl.broadcast_to(place, [M, RANK_PARTS]), [M * RANK_PARTS])
    picked = ~mine.to(tl.uint32).to(tl.int32, bitcast=True)
    tl.store(dst + above + place, picked, mask=(mine != 0) & (place < k - above))


@triton.jit
def _select_from_row(src, n, k, dst, STEP: tl.constexpr):
    """The exact selection by counting passes over the whole row (>= k finite values)."""
    lane = tl.arange(0, STEP)
    threshold = tl.zeros([], tl.uint32)
    count = tl.zeros([], tl.int32)
    shift = tl.full([], 30, tl.int32)
    while (shift >= 0) & (count != k):
        c1 = tl.zeros([], tl.int32)
        c2 = tl.zeros([], tl.int32)
        c3 = tl.zeros([], tl.int32)
        for start in range(0, n, STEP):
            key = _load_keys(src, start + lane, start + lane < n, True)
            d1, d2, d3 = _count_at_least(key, threshold, shift)
            c1 += d1
            c2 += d2
            c3 += d3
        threshold, count = _take_digit(threshold, count, c1, c2, c3, k, shift)
        shift -= 2
    above_count = tl.zeros([], tl.int32)
    for start in range(0, n, STEP):
        key = _load_keys(src, start + lane, start + lane < n, True)
        above_count += tl.sum((key > threshold).to(tl.int32), axis=0)
    above_run = tl.zeros([], tl.int32)
    tied_run = tl.zeros([], tl.int32)
    for start in range(0, n, STEP):
        col = start + lane
        key = _load_keys(src, col, col < n, True)
        above = key > threshold
        tied = key == threshold
        slot_above = above_run + tl.cumsum(above.to(tl.int32), axis=0) - 1
        slot_tied = above_count + tied_run + tl.cumsum(tied.to(tl.int32), axis=0) - 1
        tl.store(dst + slot_above, col, mask=above)
        tl.store(dst + slot_tied, col, mask=tied & (slot_tied < k))
        above_run += tl.sum(above.to(tl.int32), axis=0)
        tied_run += tl.sum(tied.to(tl.int32), axis=0)


@triton.jit
def row_length(lengths_ptr, row, width):
    """Row `row`'s length clamped to [0, width] (the contract's clamp of `lengths`)."""
    return tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), width)
