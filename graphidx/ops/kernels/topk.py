"""Exact per-row top-k in Triton (OPS_CONTRACT op 2, `topk_per_row`).

Values are compared through the order-preserving uint32 image of float32 (`_order_key`:
flip the sign bit of non-negatives, invert negatives), so ties and signed zeros follow one
total order. Keys of -inf (and anything below) are never picked.

One program per row, in three phases, reading the row about twice:

1. *Floor.* Split the row's columns into GROUPS interleaved groups (column j is in group
   j % GROUPS) and keep each group's max key. Any k of those maxima are k distinct columns,
   so the k-th largest group max is a lower bound (`floor`) of the row's k-th largest key.
   With GROUPS >= 4k it is a tight one: on continuous data only ~1.15k columns lie above it.
   (The k-th largest of the GROUPS maxima is found by a 32-step bitwise search over keys.)
2. *Collect.* Second pass: columns with key > floor go to a per-row candidate buffer (up to
   CAP = 2 * K_PAD), columns with key == floor to a tie buffer (up to K_PAD), by prefix
   sums.
3. *Select.*
   - at most k candidates: the floor *is* the k-th largest key; write every candidate and
     fill with ties (then -1 padding when the row has fewer than k finite values);
   - up to CAP candidates: find the exact k-th largest key among them (bitwise search over
     the buffer) and write the keys above it plus enough equal ones;
   - more than CAP (adversarial rows, e.g. the top keys crowded into few groups): the same
     search over the whole row, 32 counting passes. Slow, never wrong.
Exactly min(k, #finite values) columns are written, then -1 padding.

Cost is proportional to the row's length, not its width. The buffers are scratch memory
allocated per call (rows x (CAP + K_PAD) int32, in row batches of at most SCRATCH_BYTES).
Known weakness: one program per row, so a handful of very long rows (e.g. 8 rows x 1M) use
only a few multiprocessors.
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
def _load_keys(src, col, n):
    """Keys of columns `col` of a row of length n; 0 (never picked) outside or at -inf."""
    inside = col < n
    key = _order_key(tl.load(src + col, mask=inside, other=float("-inf")))
    return tl.where(inside & (key > KEY_NEG_INF), key, 0)


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


@triton.jit
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
    candidates = scratch_ptr + row * (CAP + K_PAD)
    ties = candidates + CAP
    lane = tl.arange(0, GROUPS)

    # Phase 1: the floor, from the max key of each interleaved group. Two chunks per
    # iteration keep twice the bytes in flight.
    group_max = tl.zeros([GROUPS], tl.uint32)
    for start in range(0, n, 2 * GROUPS):
        first = _load_keys(src, start + lane, n)
        second = _load_keys(src, start + GROUPS + lane, n)
        group_max = tl.maximum(group_max, tl.maximum(first, second))
    valid_groups = tl.sum((group_max > 0).to(tl.int32), axis=0)
    floor = KEY_NEG_INF + tl.zeros([], tl.uint32)
    if valid_groups >= k:
        floor = tl.maximum(_kth_largest_key(group_max, k, FLOOR_BITS), KEY_NEG_INF)

    # Phase 2: collect keys above the floor and (up to K_PAD) equal to it.
    above_total = tl.zeros([], tl.int32)
    tied_total = tl.zeros([], tl.int32)
    for start in range(0, n, GROUPS):
        col = start + lane
        key = _load_keys(src, col, n)
        above = key > floor
        tied = (key == floor) & (key > KEY_NEG_INF)
        # Both running counts in one scan: above in the low 16 bits, tied in the high ones.
        packed = above.to(tl.int32) + tied.to(tl.int32) * 65536
        running = tl.cumsum(packed, axis=0)
        slot_above = above_total + (running & 0xFFFF) - 1
        slot_tied = tied_total + (running >> 16) - 1
        tl.store(candidates + slot_above, col, mask=above & (slot_above < CAP))
        tl.store(ties + slot_tied, col, mask=tied & (slot_tied < K_PAD))
        block_total = tl.sum(packed, axis=0)
        above_total += block_total & 0xFFFF
        tied_total += block_total >> 16
    # The buffers were written by other threads of this program.
    tl.debug_barrier()

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
                key = _load_keys(src, start + lane, n)
                count += tl.sum((key >= trial).to(tl.int32), axis=0)
            threshold = tl.where(count >= k, trial, threshold)
        above_count = tl.zeros([], tl.int32)
        for start in range(0, n, GROUPS):
            key = _load_keys(src, start + lane, n)
            above_count += tl.sum((key > threshold).to(tl.int32), axis=0)
        above_run = tl.zeros([], tl.int32)
        tied_run = tl.zeros([], tl.int32)
        for start in range(0, n, GROUPS):
            col = start + lane
            key = _load_keys(src, col, n)
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
    row_ints = cfg.capacity + k_pad
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
