"""The decode work schedule's buffer format: the one place its layout is defined.

A decode step's row groups (seqs of `next_n` rows, or single rows) are cut into *items* of at
most SPLIT = `split_keys` keys, so that `paged_mqa_logits` can run a fixed, persistent grid
that splits one long request across the GPU as readily as it runs many short ones.

Buffer (int32, 1-D):

    [ITEM_COUNT] item count   [GROUP_COUNT] group count   [GROUP_ROWS] rows per group
    [COMPLETE] complete flag (1 = trusted)
    then item i at [SCHEDULE_HEADER_INTS + SCHEDULE_ITEM_INTS * i + ...] =
    (ITEM_GROUP group, ITEM_KEY_START first key, ITEM_KEY_END end key)

Group g's span is the max over its rows of max(row_lens, 0); it gets max(1, cdiv(span,
SPLIT)) items in key order, item j covering keys [j * SPLIT, (j + 1) * SPLIT), and its last
item's end key is KEY_END_OPEN ("up to the group's span"): the logits kernel clips every item
to the span it computes from the actual row ends and context lengths. Every group has at
least one item, so a schedule left stale after row_lens changed still covers every key (it
is only less balanced). When the items exceed the capacity, each group keeps one item and
the spare slots are shared pro rata (items then cover whole multiples of SPLIT). A build
given a target item count T uses, instead of `split_keys`, SPLIT = the sum of the spans over
T rounded up to a multiple of SPLIT_ALIGNMENT, within [SPLIT_ALIGNMENT, split_keys]: a small
batch's keys are cut finer and spread over about T programs. A buffer
that cannot hold one item per group is written with complete = 0, and a zero-filled buffer
also reads as untrusted: the logits kernel then walks its static grid instead. The answer
never depends on the schedule.
"""

from __future__ import annotations

import torch

from graphidx.config import cdiv

ITEM_COUNT, GROUP_COUNT, GROUP_ROWS, COMPLETE = 0, 1, 2, 3
"""Header slots."""
SCHEDULE_HEADER_INTS = 4

ITEM_GROUP, ITEM_KEY_START, ITEM_KEY_END = 0, 1, 2
"""Slots within one item."""
SCHEDULE_ITEM_INTS = 3

SCHEDULE_SPLIT_KEYS = 2048
"""Default keys per item."""

SPLIT_ALIGNMENT = 256
"""Items start on multiples of this: every logits tile (BLOCK_N) and candidate block divides it."""

KEY_END_OPEN = 2**31 - 1
"""End key of a group's last item: score up to the group's actual span."""


def schedule_capacity(schedule: torch.Tensor) -> int:
    """Items a schedule buffer can hold (from its shape)."""
    return max(0, (schedule.shape[0] - SCHEDULE_HEADER_INTS) // SCHEDULE_ITEM_INTS)


def schedule_ints(
    max_seqs: int, max_width: int, split_keys: int = SCHEDULE_SPLIT_KEYS, target_items: int = 0
) -> int:
    """Length of a buffer holding every one of `max_seqs` groups at `max_width` keys, and,
    for builds that aim at `target_items` items, that many plus one per group."""
    items = max(
        max_seqs * cdiv(max_width, split_keys), target_items + max_seqs if target_items else 0
    )
    return SCHEDULE_HEADER_INTS + SCHEDULE_ITEM_INTS * items


__all__ = [
    "COMPLETE",
    "GROUP_COUNT",
    "GROUP_ROWS",
    "ITEM_COUNT",
    "ITEM_GROUP",
    "ITEM_KEY_END",
    "ITEM_KEY_START",
    "KEY_END_OPEN",
    "SCHEDULE_HEADER_INTS",
    "SCHEDULE_ITEM_INTS",
    "SCHEDULE_SPLIT_KEYS",
    "SPLIT_ALIGNMENT",
    "schedule_capacity",
    "schedule_ints",
]
