"""Exact per-row top-k in Triton (OPS_CONTRACT op 2, `topk_per_row`).

Values are compared through the order-preserving uint32 image of float32 (`_order_key`:
flip the sign bit of non-negatives, invert negatives), so ties and signed zeros follow one
total order. Keys of -inf (and anything below) are never picked.

One program per row, in three phases, reading the row about twice:

1. *Floor.* Split the row's columns into GROUPS interleaved groups (column j is in group
   j % GROUPS) and keep each group's max key. Any k of those maxima are k distinct columns,
   so the k-th largest group max is a lower bound (`floor`) of the row's k-th largest key.
   With GROUPS >= 4k it is a tight one: on continuous data only ~1.15k columns lie above it.
   The bound is found by a bitwise search over the maxima that starts below their common
   prefix and stops after FLOOR_BITS bits (a lower bound is all it needs).
2. *Collect.* Second pass: columns with key > floor go to a per-row candidate buffer (up to
   CAP = 2 * K_PAD). Chunks are tiled as rows of 4 columns (one vector load per thread); a
   row with matches takes its slots with one relaxed atomic and numbers them in registers.
3. *Select.*
   - at most k candidates: the floor *is* the k-th largest key; write every candidate and
     fill with columns equal to the floor (collected by one more pass, only in this case),
     then -1 padding when the row has fewer than k finite values;
   - up to CAP candidates: find the exact k-th largest key among them (bitwise search over
     the buffer, from below the candidates' common prefix) and write the keys above it plus
     enough equal ones;
   - more than CAP (adversarial rows, e.g. the top keys crowded into few groups): the same
     search over the whole row, 32 counting passes. Slow, never wrong.
Exactly min(k, #finite values) columns are written, then -1 padding.

Cost is proportional to the row's length, not its width. The buffers are scratch memory
allocated per call (rows x (CAP + K_PAD + 2) int32, in row batches of at most
SCRATCH_BYTES). Known weakness: one program per row, so a handful of very long rows
(e.g. 8 rows x 1M) use only a few multiprocessors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphidx.ops.kernels import next_power_of_2

KEY_NEG_INF = tl.constexpr(0x007FFFFF)
"""_order_key(-inf): every key <= this is never picked (a constexpr global for the kernels)."""

FLOOR_BITS = tl.constexpr(12)
"""Bits the floor search resolves below the keys' common prefix: a lower bound is enough."""

SCRATCH_BYTES = 64 << 20
MIN_GROUPS = 1024
MAX_GROUPS = 16384


@dataclass(frozen=True)
class TopkConfig:
    """Buffer and tile sizes of one top-k launch (powers of two, chosen from k)."""

    groups: int
    capacity: int
    num_warps: int


def default_config(k: int) -> TopkConfig:
    """GROUPS = 4 * K_PAD (>= 1024, <= 16384), CAP = 2 * K_PAD."""
    k_pad = next_power_of_2(k)
    groups = min(max(4 * k_pad, MIN_GROUPS), MAX_GROUPS)
    return TopkConfig(groups=groups, capacity=2 * k_pad, num_warps=8 if groups >= 4096 else 4)


@triton.jit
def _order_key(x):
    """uint32 image of float32 that orders like the floats (NaN above +inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit
def _kth_largest_key(keys, k, MAX_BITS: tl.constexpr):
    """Largest t with count(keys >= t) >= k, keys uint32 (0 = never picked), assuming at
    least k nonzero keys.

    Only the bits below the highest bit where the smallest and largest nonzero keys differ
    vary, so the bitwise search starts there (one CTA-wide count per bit: the rounds are
    what this costs). With MAX_BITS < 32 it stops after MAX_BITS bits and returns a lower
    bound of the exact answer that still satisfies count(keys >= t) >= k.
    """
    largest = tl.max(keys, axis=0)
    smallest = tl.min(tl.where(keys > 0, keys, 0xFFFFFFFF), axis=0)
    differ = largest ^ smallest
    # floor(log2(differ)), or one more when the float conversion rounds up: either way a
    # bit at or above the highest differing one.
    top = (differ.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    top = tl.minimum(tl.where(differ == 0, 0, top), 31)
    below = (tl.full([], 2, tl.uint32) << top) - 1
    threshold = largest & ~below
    for step in range(tl.minimum(top + 1, MAX_BITS)):
        trial = threshold | (tl.full([], 1, tl.uint32) << (top - step))
        count = tl.sum((keys >= trial).to(tl.int32), axis=0)
        threshold = tl.where(count >= k, trial, threshold)
    return threshold


@triton.jit
def _load_keys(src, col, n, MASKED: tl.constexpr):
    """Keys of columns `col` of a row of length n; 0 (never picked) outside or at -inf.
    Unmasked (vectorized) when the caller knows every column is inside."""
    if MASKED:
        inside = col < n
        key = _order_key(tl.load(src + col, mask=inside, other=float("-inf")))
        return tl.where(inside & (key > KEY_NEG_INF), key, 0)
    key = _order_key(tl.load(src + col))
    return tl.where(key > KEY_NEG_INF, key, 0)


@triton.jit
def _collect(src, start, n, threshold, out, counter, capacity, GROUPS, TIES, MASKED):
    """Append the columns of [start, start + GROUPS) whose key is above `threshold` (or,
    with TIES, equal to it and finite) to `out`, up to `capacity` entries; `counter`
    counts them all.

    The chunk is tiled as rows of 4 adjacent columns, one 16-byte vector per thread: a row
    takes its slots with one relaxed atomic (only a few percent of the rows hold a match)
    and numbers its matches in registers, which costs far less than a prefix sum over
    every column. Each of the 4 columns is then stored as its own 1-D tensor, which keeps
    the scatter in the row layout.
    """
    row = tl.arange(0, GROUPS // 4)
    lane = tl.arange(0, 4)
    col = start + (4 * row)[:, None] + lane[None, :]
    key = _load_keys(src, col, n, MASKED)
    if TIES:
        match = ((key == threshold) & (key > KEY_NEG_INF)).to(tl.int32)
    else:
        match = (key > threshold).to(tl.int32)
    count = tl.sum(match, axis=1)
    base = tl.atomic_add(counter + tl.zeros_like(count), count, mask=count > 0, sem="relaxed")
    slot = base[:, None] + tl.cumsum(match, axis=1) - match
    for j in tl.static_range(4):
        pick = lane[None, :] == j
        slot_j = tl.sum(tl.where(pick, slot, 0), axis=1)
        match_j = tl.sum(tl.where(pick, match, 0), axis=1)
        tl.store(out + slot_j, start + 4 * row + j, mask=(match_j != 0) & (slot_j < capacity))


@triton.jit
def _emit_selection(key, col, threshold, k, dst):
    """Write the columns with key > threshold, then equal ones up to k in total."""
    above = key > threshold
    tied = key == threshold
    above_count = tl.sum(above.to(tl.int32), axis=0)
    slot_above = tl.cumsum(above.to(tl.int32), axis=0) - 1
    slot_tied = above_count + tl.cumsum(tied.to(tl.int32), axis=0) - 1
    tl.store(dst + slot_above, col, mask=above)
    tl.store(dst + slot_tied, col, mask=tied & (slot_tied < k))


@triton.jit(do_not_specialize=["lengths_ptr", "width"])
def _topk_kernel(
    logits_ptr,
    lengths_ptr,
    out_ptr,
    scratch_ptr,
    row_stride,
    out_row_stride,
    width,
    k,
    K_PAD: tl.constexpr,
    GROUPS: tl.constexpr,
    CAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), width)
    src = logits_ptr + row * row_stride
    dst = out_ptr + row * out_row_stride
    candidates = scratch_ptr + row * (CAP + K_PAD + 2)
    ties = candidates + CAP
    counters = ties + K_PAD
    lane = tl.arange(0, GROUPS)

    # Phase 1: the floor, from the max key of each interleaved group. Two chunks per
    # iteration keep twice the bytes in flight; full chunks load unmasked (vectorized).
    group_max = tl.zeros([GROUPS], tl.uint32)
    full_stop = n // (2 * GROUPS) * (2 * GROUPS)
    for start in range(0, full_stop, 2 * GROUPS):
        first = _load_keys(src, start + lane, n, False)
        second = _load_keys(src, start + GROUPS + lane, n, False)
        group_max = tl.maximum(group_max, tl.maximum(first, second))
    for start in range(full_stop, n, GROUPS):
        group_max = tl.maximum(group_max, _load_keys(src, start + lane, n, True))
    valid_groups = tl.sum((group_max > 0).to(tl.int32), axis=0)
    floor = KEY_NEG_INF + tl.zeros([], tl.uint32)
    if valid_groups >= k:
        floor = tl.maximum(_kth_largest_key(group_max, k, FLOOR_BITS), KEY_NEG_INF)

    # Phase 2: collect the keys above the floor.
    tl.store(counters + tl.arange(0, 2), tl.zeros([2], tl.int32))
    tl.debug_barrier()
    full_stop = n // GROUPS * GROUPS
    for start in range(0, full_stop, GROUPS):
        _collect(src, start, n, floor, candidates, counters, CAP, GROUPS, False, False)
    if full_stop < n:
        _collect(src, full_stop, n, floor, candidates, counters, CAP, GROUPS, False, True)
    # The buffer was written by other threads of this program; the count is read through
    # the atomics' own path (L2).
    tl.debug_barrier()
    above_total = tl.atomic_add(counters, 0, sem="relaxed")
    tied_total = tl.zeros([], tl.int32)
    if above_total < k:
        # Only now are keys equal to the floor needed (the floor is then the k-th largest).
        for start in range(0, full_stop, GROUPS):
            _collect(src, start, n, floor, ties, counters + 1, K_PAD, GROUPS, True, False)
        if full_stop < n:
            _collect(src, full_stop, n, floor, ties, counters + 1, K_PAD, GROUPS, True, True)
        tl.debug_barrier()
        tied_total = tl.atomic_add(counters + 1, 0, sem="relaxed")

    # Phase 3: select.
    if above_total <= k:
        slot = tl.arange(0, K_PAD)
        tie_slot = slot - above_total
        tie_count = tl.minimum(k - above_total, tied_total)
        picked = tl.load(candidates + slot, mask=slot < above_total, other=-1)
        tie = tl.load(ties + tie_slot, mask=(tie_slot >= 0) & (tie_slot < tie_count), other=-1)
        tl.store(dst + slot, tl.where(slot < above_total, picked, tie), mask=slot < k)
    elif above_total <= CAP:
        slot = tl.arange(0, CAP)
        inside = slot < above_total
        col = tl.load(candidates + slot, mask=inside, other=0)
        key = tl.where(inside, _order_key(tl.load(src + col, mask=inside, other=0.0)), 0)
        _emit_selection(key, col, _kth_largest_key(key, k, 32), k, dst)
    else:
        # Fallback: exact threshold by counting passes over the whole row.
        threshold = tl.zeros([], tl.uint32)
        for step in tl.static_range(32):
            trial = threshold | (1 << (31 - step))
            count = tl.zeros([], tl.int32)
            for start in range(0, n, GROUPS):
                key = _load_keys(src, start + lane, n, True)
                count += tl.sum((key >= trial).to(tl.int32), axis=0)
            threshold = tl.where(count >= k, trial, threshold)
        above_count = tl.zeros([], tl.int32)
        for start in range(0, n, GROUPS):
            key = _load_keys(src, start + lane, n, True)
            above_count += tl.sum((key > threshold).to(tl.int32), axis=0)
        above_run = tl.zeros([], tl.int32)
        tied_run = tl.zeros([], tl.int32)
        for start in range(0, n, GROUPS):
            col = start + lane
            key = _load_keys(src, col, n, True)
            above = key > threshold
            tied = key == threshold
            slot_above = above_run + tl.cumsum(above.to(tl.int32), axis=0) - 1
            slot_tied = above_count + tied_run + tl.cumsum(tied.to(tl.int32), axis=0) - 1
            tl.store(dst + slot_above, col, mask=above)
            tl.store(dst + slot_tied, col, mask=tied & (slot_tied < k))
            above_run += tl.sum(above.to(tl.int32), axis=0)
            tied_run += tl.sum(tied.to(tl.int32), axis=0)


def topk_per_row(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    *,
    config: TopkConfig | None = None,
) -> None:
    """Triton `topk_per_row` (OPS_CONTRACT op 2; arguments validated by the wrapper).

    out[r] gets the columns of the k largest of logits[r, :clamp(lengths[r], 0, W)] in any
    order, -1 padded; -inf is never picked. `config` overrides the sizes derived from k
    (tuning hook; its fields must be powers of two with groups >= capacity >= 2 * K_PAD is
    not required, only capacity >= K_PAD). Reads no device value on the host.
    """
    rows, width = logits.shape
    if rows == 0 or k == 0:
        return
    cfg = config or default_config(k)
    k_pad = next_power_of_2(k)
    if cfg.capacity < k_pad:
        raise ValueError(f"config.capacity {cfg.capacity} < next_power_of_2(k) {k_pad}")
    row_ints = cfg.capacity + k_pad + 2
    batch = max(1, SCRATCH_BYTES // (4 * row_ints))
    scratch = torch.empty((min(rows, batch), row_ints), dtype=torch.int32, device=logits.device)
    for first in range(0, rows, batch):
        last = min(first + batch, rows)
        _topk_kernel[(last - first,)](
            logits[first:last],
            lengths[first:last],
            out[first:last],
            scratch,
            logits.stride(0),
            out.stride(0),
            width,
            k,
            K_PAD=k_pad,
            GROUPS=cfg.groups,
            CAP=cfg.capacity,
            num_warps=cfg.num_warps,
        )


__all__ = ["TopkConfig", "default_config", "topk_per_row"]
