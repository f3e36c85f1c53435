"""Triton builder of the decode work schedule (format: graphidx.ops.schedule_format).

One program writes the schedule buffer on the device, so building it is part of the step's
device work and never a host sync. A step of at most BLOCK_G groups computes their spans
once and every pass reuses them; a larger one makes two passes over the groups in blocks of
BLOCK_G: the first counts items (to know whether the buffer's capacity suffices), the second
writes each group's items with one masked 2-D store per block of BLOCK_J items
(`block_sizes`). With ADAPT (a target item count) the first pass sums the groups' keys
instead, the item size is chosen from that sum, and a counting pass at that size runs before
the writing one.

With DERIVE the same program is the captured uniform-decode step's metadata: the group spans
come from the persistent request lengths and the live-request count instead of `row_lens`,
and the first pass also stores the row ends, block ends and compressed contexts it computed
(`graphidx.ops.schedule.derive_uniform_decode`). One launch derives everything a replayed
decode step needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphidx.ops import schedule_format as fmt
from graphidx.ops.kernels.launch import launch
from graphidx.ops.kernels.ptx import wait_for_prior_kernels

# Module globals a jit function reads must be constexprs: the schedule format's slots, for
# this builder and for the logits kernels that read the schedule.
ITEM_COUNT = tl.constexpr(fmt.ITEM_COUNT)
GROUP_COUNT = tl.constexpr(fmt.GROUP_COUNT)
GROUP_ROWS = tl.constexpr(fmt.GROUP_ROWS)
COMPLETE = tl.constexpr(fmt.COMPLETE)
ITEM_GROUP = tl.constexpr(fmt.ITEM_GROUP)
ITEM_KEY_START = tl.constexpr(fmt.ITEM_KEY_START)
ITEM_KEY_END = tl.constexpr(fmt.ITEM_KEY_END)
KEY_END_OPEN = tl.constexpr(fmt.KEY_END_OPEN)
HEADER_INTS = tl.constexpr(fmt.SCHEDULE_HEADER_INTS)
ALIGNMENT = tl.constexpr(fmt.SPLIT_ALIGNMENT)
ITEM_INTS = tl.constexpr(fmt.SCHEDULE_ITEM_INTS)

BLOCK_TILE = 1024
"""Slots of one masked store tile: BLOCK_G groups x BLOCK_J items (`block_sizes`), 8 per
thread at 4 warps. A group's items beyond BLOCK_J take more tiles, so the tile only sets how
much of a tile a step leaves masked: a decode step's groups mostly get a few to a few dozen
items (the adaptive split aims at TARGET_ITEMS_PER_SM per multiprocessor in all)."""


def block_sizes(num_groups: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_J) for `num_groups` groups: 1 x 1024 for one group, 16 x 64 up to 16,
    else 128 x 8 (three variants)."""
    block_g = 1 if num_groups <= 1 else 16 if num_groups <= 16 else 128
    return block_g, BLOCK_TILE // block_g


@triton.jit
def _group_spans(
    lens_ptr,
    derived,
    group,
    ok,
    STORE: tl.constexpr,
    DERIVE: tl.constexpr,
    ROWS: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    NEXT_N: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
):
    """Each group's span (max over its ROWS rows of max(row end, 0)).

    Without DERIVE the row ends are loaded from `lens_ptr` (row_lens). With DERIVE
    `lens_ptr` holds the request lengths and `derived` the pointers (num_live, row_lens,
    context_lens, block_ends): row j of request r < num_live ends at
    max(L_r - NEXT_N + j + 1, 0) // R, rows of later requests at 0; STORE writes them.
    """
    member = tl.arange(0, ROWS_PAD)
    row = group[:, None] * ROWS + member[None, :]
    in_group = ok[:, None] & (member[None, :] < ROWS)
    if DERIVE:
        num_live_ptr, row_lens_ptr, context_ptr, block_ends_ptr = derived
        request = row // NEXT_N
        step = row % NEXT_N
        live = in_group & (request < tl.load(num_live_ptr))
        seq = tl.maximum(tl.load(lens_ptr + request, mask=live, other=0), 0)
        ends = tl.maximum(seq - NEXT_N + step + 1, 0) // R
        if STORE:
            tl.store(row_lens_ptr + row, ends, mask=in_group)
            if C > 0:
                tl.store(block_ends_ptr + row, (ends + C - 1) // C, mask=in_group)
            tl.store(context_ptr + request, seq // R, mask=in_group & (step == NEXT_N - 1))
    else:
        ends = tl.load(lens_ptr + row, mask=in_group, other=0)
    return tl.maximum(tl.max(ends, axis=1), 0)


@triton.jit
def _sum_over_groups(lens_ptr, derived, num_groups, split, STORE: tl.constexpr,
                     KEYS: tl.constexpr, DERIVE: tl.constexpr, ROWS: tl.constexpr,
                     ROWS_PAD: tl.constexpr, NEXT_N: tl.constexpr, R: tl.constexpr,
                     C: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """int64 sum over the groups of their spans (KEYS) or of their item counts at `split`
    keys per item (max(1, cdiv(span, split))); STORE as in `_group_spans`."""
    total = tl.zeros([], tl.int64)
    for first in range(0, num_groups, BLOCK_G):
        group = first + tl.arange(0, BLOCK_G)
        ok = group < num_groups
        span = _group_spans(
            lens_ptr, derived, group, ok, STORE, DERIVE, ROWS, ROWS_PAD, NEXT_N, R, C
        )
        value = span if KEYS else tl.maximum(tl.cdiv(span, split), 1)
        total += tl.sum(tl.where(ok, value, 0).to(tl.int64), axis=0)
    return total


@triton.jit
def _adaptive_split(keys, target_items, SPLIT: tl.constexpr):
    """Keys per item that spread `keys` over about target_items items: a multiple of
    ALIGNMENT within [ALIGNMENT, SPLIT]."""
    per_item = tl.cdiv(tl.cdiv(keys, target_items), ALIGNMENT) * ALIGNMENT
    return tl.minimum(tl.maximum(per_item, ALIGNMENT), SPLIT).to(tl.int32)


@triton.jit
def _write_items(schedule_ptr, group, ok, span, split, written, complete, over, spare, extra,
                 BLOCK_J: tl.constexpr):  # fmt: skip
    """Write the items of one block of groups (their spans `span`) after the `written` items
    before them; returns the items written so far. Over capacity (`over`), every group keeps
    one item and shares the `spare` slots pro rata to its `extra` items."""
    items = tl.where(ok, tl.maximum(tl.cdiv(span, split), 1), 0)
    granted = tl.where(over, 1 + ((items - 1).to(tl.int64) * spare) // extra, items)
    granted = tl.maximum(granted.to(tl.int32), 1)
    splits_per_item = tl.cdiv(items, granted)
    count = tl.where(ok, tl.cdiv(items, tl.maximum(splits_per_item, 1)), 0)
    offset = written + tl.cumsum(count, axis=0) - count
    item_keys = splits_per_item * split
    for j_first in range(0, tl.max(count, axis=0), BLOCK_J):
        j = j_first + tl.arange(0, BLOCK_J)
        # where(), not `&`: the interpreter mistypes a vector & scalar bool.
        mask = tl.where(complete, j[None, :] < count[:, None], False)
        item = (offset[:, None] + j[None, :]).to(tl.int64) * ITEM_INTS
        slot_ptr = schedule_ptr + HEADER_INTS + item
        key_start = j[None, :] * item_keys[:, None]
        key_end = tl.where(
            j[None, :] == count[:, None] - 1, KEY_END_OPEN, key_start + item_keys[:, None]
        )
        tl.store(slot_ptr + ITEM_GROUP, group[:, None] + 0 * j[None, :], mask=mask)
        tl.store(slot_ptr + ITEM_KEY_START, key_start, mask=mask)
        tl.store(slot_ptr + ITEM_KEY_END, key_end, mask=mask)
    return written + tl.sum(count, axis=0)


@triton.jit
def _build_schedule_kernel(
    lens_ptr,
    schedule_ptr,
    derived,
    num_groups,
    capacity,
    target_items,
    DERIVE: tl.constexpr,
    WRITE_SCHEDULE: tl.constexpr,
    ADAPT: tl.constexpr,
    ROWS: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    NEXT_N: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_J: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    wait_for_prior_kernels()
    # ONE_BLOCK (num_groups <= BLOCK_G): the spans are computed once, with the derived values
    # stored, and every pass reuses them. Else pass 1 (which also stores the derived values)
    # counts the items at SPLIT keys, or with ADAPT sums the keys of all groups for the item
    # size that spreads them over about target_items and then counts the items at that size;
    # the writing pass computes the spans again.
    split = tl.zeros([], tl.int32) + SPLIT
    group_args = (lens_ptr, derived, num_groups)
    if ONE_BLOCK:
        group = tl.arange(0, BLOCK_G)
        ok = group < num_groups
        span = _group_spans(
            lens_ptr, derived, group, ok, DERIVE, DERIVE, ROWS, ROWS_PAD, NEXT_N, R, C
        )
        span = tl.where(ok, span, 0)
        if ADAPT:
            split = _adaptive_split(tl.sum(span.to(tl.int64), axis=0), target_items, SPLIT)
        items = tl.where(ok, tl.maximum(tl.cdiv(span, split), 1), 0)
        total = tl.sum(items.to(tl.int64), axis=0)
    elif ADAPT:
        keys = _sum_over_groups(*group_args, split, DERIVE, True, DERIVE, ROWS, ROWS_PAD,
                                NEXT_N, R, C, BLOCK_G)  # fmt: skip
        split = _adaptive_split(keys, target_items, SPLIT)
        total = _sum_over_groups(*group_args, split, False, False, DERIVE, ROWS, ROWS_PAD,
                                 NEXT_N, R, C, BLOCK_G)  # fmt: skip
    else:
        total = _sum_over_groups(*group_args, split, DERIVE, False, DERIVE, ROWS, ROWS_PAD,
                                 NEXT_N, R, C, BLOCK_G)  # fmt: skip
    if WRITE_SCHEDULE:
        complete = num_groups <= capacity
        over = total > capacity
        spare = (capacity - num_groups).to(tl.int64)
        extra = tl.maximum(total - num_groups, 1)
        written = tl.zeros([], tl.int32)
        if ONE_BLOCK:
            written = _write_items(schedule_ptr, group, ok, span, split, written, complete,
                                   over, spare, extra, BLOCK_J)  # fmt: skip
        else:
            for first in range(0, num_groups, BLOCK_G):
                group = first + tl.arange(0, BLOCK_G)
                ok = group < num_groups
                span = _group_spans(
                    lens_ptr, derived, group, ok, False, DERIVE, ROWS, ROWS_PAD, NEXT_N, R, C
                )
                written = _write_items(schedule_ptr, group, ok, span, split, written,
                                       complete, over, spare, extra, BLOCK_J)  # fmt: skip
        tl.store(schedule_ptr + ITEM_COUNT, tl.where(complete, written, 0))
        tl.store(schedule_ptr + GROUP_COUNT, num_groups)
        tl.store(schedule_ptr + GROUP_ROWS, ROWS)
        tl.store(schedule_ptr + COMPLETE, complete.to(tl.int32))


def _launch(
    lens: torch.Tensor,
    schedule: torch.Tensor | None,
    derived: tuple[object, ...],
    num_groups: int,
    *,
    derive: bool,
    group_rows: int,
    split_keys: int,
    target_items: int,
    next_n: int = 1,
    compress_ratio: int = 1,
    candidate_block_size: int = 0,
) -> None:
    capacity = 0 if schedule is None else fmt.schedule_capacity(schedule)
    block_g, block_j = block_sizes(num_groups)
    launch(
        _build_schedule_kernel,
        (1,),
        lens,
        lens if schedule is None else schedule,
        derived,
        num_groups,
        capacity,
        max(target_items, 1),
        DERIVE=derive,
        WRITE_SCHEDULE=schedule is not None,
        ADAPT=target_items > 0 and schedule is not None,
        ROWS=group_rows,
        ROWS_PAD=triton.next_power_of_2(group_rows),
        NEXT_N=next_n,
        R=compress_ratio,
        C=candidate_block_size,
        SPLIT=split_keys,
        BLOCK_G=block_g,
        BLOCK_J=block_j,
        ONE_BLOCK=num_groups <= block_g,
        num_warps=4,
    )


def build_decode_schedule(
    row_lens: torch.Tensor,
    schedule: torch.Tensor,
    *,
    next_n: int,
    split_keys: int,
    target_items: int = 0,
) -> None:
    """Triton `build_decode_schedule` (arguments validated by graphidx.ops.schedule)."""
    _launch(
        row_lens,
        schedule,
        (row_lens, row_lens, row_lens, row_lens),  # unused without DERIVE
        row_lens.shape[0] // next_n,
        derive=False,
        group_rows=next_n,
        split_keys=split_keys,
        target_items=target_items,
    )


def derive_uniform_decode(
    seq_lens: torch.Tensor,
    num_live_reqs: torch.Tensor,
    context_lens: torch.Tensor,
    row_lens: torch.Tensor,
    block_ends: torch.Tensor | None,
    schedule: torch.Tensor | None,
    *,
    next_n: int,
    compress_ratio: int,
    candidate_block_size: int,
    group_rows: int,
    split_keys: int,
    target_items: int = 0,
) -> None:
    """Triton `derive_uniform_decode` (arguments validated by graphidx.ops.schedule)."""
    derived = (
        num_live_reqs,
        row_lens,
        context_lens,
        row_lens if block_ends is None else block_ends,
    )
    _launch(
        seq_lens,
        schedule,
        derived,
        row_lens.shape[0] // group_rows,
        derive=True,
        group_rows=group_rows,
        split_keys=split_keys,
        target_items=target_items,
        next_n=next_n,
        compress_ratio=compress_ratio,
        candidate_block_size=candidate_block_size if block_ends is not None else 0,
    )


__all__ = ["build_decode_schedule", "derive_uniform_decode"]
