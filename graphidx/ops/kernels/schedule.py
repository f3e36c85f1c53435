"""Triton builder of the decode work schedule (OPS_CONTRACT op 7; format in graphidx.ops.schedule).

One program reads `row_lens` and writes the schedule buffer on the device, so building it is
part of the step's device work and never a host sync. Two passes over the groups in blocks of
BLOCK_G: the first counts items (to know whether the buffer's capacity suffices), the second
writes each group's items with one masked 2-D store per block of BLOCK_J items.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphidx.ops.schedule import KEY_END_OPEN, SCHEDULE_HEADER_INTS, SCHEDULE_ITEM_INTS

BLOCK_G = 128
BLOCK_J = 64


@triton.jit
def _group_items(row_lens_ptr, group, ok, NEXT_N: tl.constexpr, NEXT_N_PAD: tl.constexpr, SPLIT):
    """Items a group needs: cdiv(span, SPLIT), at least 1; span = max of its rows' lens."""
    member = tl.arange(0, NEXT_N_PAD)
    lens = tl.load(
        row_lens_ptr + group[:, None] * NEXT_N + member[None, :],
        mask=ok[:, None] & (member[None, :] < NEXT_N),
        other=0,
    )
    span = tl.maximum(tl.max(lens, axis=1), 0)
    return tl.where(ok, tl.maximum(tl.cdiv(span, SPLIT), 1), 0)


@triton.jit
def _build_schedule_kernel(
    row_lens_ptr,
    schedule_ptr,
    num_groups,
    capacity,
    NEXT_N: tl.constexpr,
    NEXT_N_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
    HEADER: tl.constexpr,
    ITEM: tl.constexpr,
    KEY_END: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    total = tl.zeros([], tl.int64)
    for first in range(0, num_groups, BLOCK_G):
        group = first + tl.arange(0, BLOCK_G)
        items = _group_items(row_lens_ptr, group, group < num_groups, NEXT_N, NEXT_N_PAD, SPLIT)
        total += tl.sum(items.to(tl.int64), axis=0)
    complete = num_groups <= capacity
    over = total > capacity
    # Over capacity, every group keeps one item and shares the spare slots pro rata.
    spare = (capacity - num_groups).to(tl.int64)
    extra = tl.maximum(total - num_groups, 1)

    written = tl.zeros([], tl.int32)
    for first in range(0, num_groups, BLOCK_G):
        group = first + tl.arange(0, BLOCK_G)
        ok = group < num_groups
        items = _group_items(row_lens_ptr, group, ok, NEXT_N, NEXT_N_PAD, SPLIT)
        granted = tl.where(over, 1 + ((items - 1).to(tl.int64) * spare) // extra, items)
        granted = tl.maximum(granted.to(tl.int32), 1)
        splits_per_item = tl.cdiv(items, granted)
        count = tl.where(ok, tl.cdiv(items, tl.maximum(splits_per_item, 1)), 0)
        offset = written + tl.cumsum(count, axis=0) - count
        item_keys = splits_per_item * SPLIT
        for j_first in range(0, tl.max(count, axis=0), BLOCK_J):
            j = j_first + tl.arange(0, BLOCK_J)
            # where(), not `&`: the interpreter mistypes a vector & scalar bool.
            mask = tl.where(complete, j[None, :] < count[:, None], False)
            slot_ptr = schedule_ptr + HEADER + (offset[:, None] + j[None, :]).to(tl.int64) * ITEM
            key_start = j[None, :] * item_keys[:, None]
            key_end = tl.where(
                j[None, :] == count[:, None] - 1, KEY_END, key_start + item_keys[:, None]
            )
            tl.store(slot_ptr, group[:, None] + 0 * j[None, :], mask=mask)
            tl.store(slot_ptr + 1, key_start, mask=mask)
            tl.store(slot_ptr + 2, key_end, mask=mask)
        written += tl.sum(count, axis=0)
    tl.store(schedule_ptr, tl.where(complete, written, 0))
    tl.store(schedule_ptr + 1, num_groups)
    tl.store(schedule_ptr + 2, NEXT_N)
    tl.store(schedule_ptr + 3, complete.to(tl.int32))


def build_decode_schedule(
    row_lens: torch.Tensor, schedule: torch.Tensor, *, next_n: int, split_keys: int
) -> None:
    """Triton `build_decode_schedule` (arguments validated by graphidx.ops.schedule)."""
    rows = row_lens.shape[0]
    capacity = (schedule.shape[0] - SCHEDULE_HEADER_INTS) // SCHEDULE_ITEM_INTS
    _build_schedule_kernel[(1,)](
        row_lens,
        schedule,
        rows // next_n,
        capacity,
        NEXT_N=next_n,
        NEXT_N_PAD=triton.next_power_of_2(next_n),
        SPLIT=split_keys,
        HEADER=SCHEDULE_HEADER_INTS,
        ITEM=SCHEDULE_ITEM_INTS,
        KEY_END=KEY_END_OPEN,
        BLOCK_G=BLOCK_G,
        BLOCK_J=BLOCK_J,
        num_warps=4,
    )


__all__ = ["build_decode_schedule"]
