"""The decode work schedule (graphidx.ops.schedule): format, reference vs Triton, bad input.

End-to-end use (same logits with and without a schedule, rebuilt in place, stale, unbuilt)
is in test_ops_triton.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from graphidx.config import cdiv
from graphidx.ops.backend import triton_interpreted
from graphidx.ops.schedule import (
    KEY_END_OPEN,
    SCHEDULE_HEADER_INTS,
    SCHEDULE_ITEM_INTS,
    allocate_schedule,
    build_decode_schedule,
    schedule_capacity,
)

if not triton_interpreted():
    # CPU tensors through the Triton backend need the interpreter; see test_ops_triton.py.
    pytest.skip("interpreter tests: TRITON_INTERPRET is not set", allow_module_level=True)

SPLIT = 256
POISON = -555


def items_of(schedule: torch.Tensor) -> list[tuple[int, int, int]]:
    count = int(schedule[0])
    body = schedule[SCHEDULE_HEADER_INTS : SCHEDULE_HEADER_INTS + SCHEDULE_ITEM_INTS * count]
    return [tuple(int(v) for v in item) for item in body.view(-1, SCHEDULE_ITEM_INTS)]  # type: ignore[misc]


def expected_items(row_lens: list[int], next_n: int) -> list[tuple[int, int, int]]:
    """Within capacity: max(1, cdiv(span, SPLIT)) items per group, the last one open-ended."""
    items = []
    for g in range(len(row_lens) // next_n):
        span = max(0, max(row_lens[g * next_n : (g + 1) * next_n]))
        count = max(1, cdiv(span, SPLIT))
        for j in range(count):
            end = KEY_END_OPEN if j == count - 1 else (j + 1) * SPLIT
            items.append((g, j * SPLIT, end))
    return items


def build(backend: str, row_lens: torch.Tensor, schedule: torch.Tensor, next_n: int) -> None:
    build_decode_schedule(row_lens, schedule, next_n=next_n, split_keys=SPLIT, backend=backend)


@pytest.mark.parametrize("groups", [7, 300])  # one block of groups; several (> 128)
@pytest.mark.parametrize("next_n", [1, 2, 3])
def test_schedule_within_capacity(gen: torch.Generator, next_n: int, groups: int) -> None:
    width = 1500
    row_lens = torch.randint(-5, width + 1, (groups * next_n,), generator=gen).to(torch.int32)
    row_lens[:next_n] = 0  # a padding group
    for backend in ("reference", "triton"):
        schedule = allocate_schedule(groups, width, "cpu", split_keys=SPLIT)
        schedule[SCHEDULE_HEADER_INTS:] = POISON
        build(backend, row_lens, schedule, next_n)
        assert schedule[1:SCHEDULE_HEADER_INTS].tolist() == [groups, next_n, 1]
        assert items_of(schedule) == expected_items(row_lens.tolist(), next_n)
        # Unused slots are never written.
        used = SCHEDULE_HEADER_INTS + SCHEDULE_ITEM_INTS * int(schedule[0])
        assert bool((schedule[used:] == POISON).all())


def test_schedule_over_capacity_keeps_every_key(gen: torch.Generator) -> None:
    # Rows far wider than the buffer was sized for: items grow to whole multiples of SPLIT.
    row_lens = torch.tensor([9000, 300, 0, 5000, 2600], dtype=torch.int32)
    results = []
    for backend in ("reference", "triton"):
        schedule = allocate_schedule(5, 600, "cpu", split_keys=SPLIT)  # capacity 15
        build(backend, row_lens, schedule, 1)
        results.append(schedule)
        items = items_of(schedule)
        assert 5 <= len(items) <= schedule_capacity(schedule)
        for g, span in enumerate(row_lens.tolist()):
            mine = [(start, end) for group, start, end in items if group == g]
            assert mine[0][0] == 0 and mine[-1][1] == KEY_END_OPEN
            for (_, end), (start, _) in itertools.pairwise(mine):
                assert end == start and start % SPLIT == 0  # contiguous, tile aligned
            assert all(start < max(span, 1) for start, _ in mine)
    assert torch.equal(results[0], results[1])


def test_schedule_rebuilt_in_place(gen: torch.Generator) -> None:
    schedule = allocate_schedule(4, 2000, "cpu", split_keys=SPLIT)
    address = schedule.data_ptr()
    row_lens = torch.tensor([1999, 10, 700, 0], dtype=torch.int32)
    build("triton", row_lens, schedule, 1)
    first = items_of(schedule)
    row_lens.copy_(torch.tensor([5, 900, 0, 1300], dtype=torch.int32))
    build("triton", row_lens, schedule, 1)
    assert schedule.data_ptr() == address
    assert items_of(schedule) != first
    assert items_of(schedule) == expected_items(row_lens.tolist(), 1)


def test_allocate_schedule_capacity() -> None:
    schedule = allocate_schedule(3, 1000, "cpu", split_keys=SPLIT)
    assert schedule.dtype == torch.int32 and schedule.dim() == 1
    assert schedule_capacity(schedule) == 3 * cdiv(1000, SPLIT)
    assert int(schedule[3]) == 0  # unbuilt: untrusted


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"next_n": 2}, "does not divide"),
        ({"split_keys": 300}, "split_keys"),
        ({"next_n": 0}, "next_n"),
    ],
)
def test_build_decode_schedule_bad_input(kwargs: dict[str, int], message: str) -> None:
    row_lens = torch.zeros(3, dtype=torch.int32)
    schedule = allocate_schedule(3, 1000, "cpu", split_keys=SPLIT)
    with pytest.raises(ValueError, match=message):
        build_decode_schedule(row_lens, schedule, **{"split_keys": SPLIT, **kwargs})


def test_build_decode_schedule_too_small_buffer() -> None:
    schedule = torch.zeros(SCHEDULE_HEADER_INTS + SCHEDULE_ITEM_INTS * 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="fewer than the 3 row groups"):
        build_decode_schedule(torch.zeros(3, dtype=torch.int32), schedule)
    with pytest.raises(ValueError, match="row_lens"):
        build_decode_schedule(torch.zeros(3, dtype=torch.int64), schedule)
    with pytest.raises(ValueError, match="max_seqs"):
        allocate_schedule(0, 10, "cpu")


@pytest.mark.parametrize(
    ("groups", "width", "target", "split_keys"),
    [(1, 8192, 528, 2048), (3, 5000, 16, 1024), (64, 8192, 528, 2048), (5, 300, 8, 2048),
     (1, 300000, 2000, 256), (17, 40000, 2000, 256),  # more items than a tile holds
     (300, 2000, 528, 2048)],  # several blocks of groups
)
def test_target_items_cut_a_small_step_finer(
    gen: torch.Generator, groups: int, width: int, target: int, split_keys: int
) -> None:
    """With a target item count the item size is the step's keys over the target, rounded up
    to 256 and within [256, split_keys]; reference and Triton write the same items, which
    cover every group's span."""
    next_n = 2
    row_lens = torch.randint(0, width + 1, (groups * next_n,), generator=gen).to(torch.int32)
    row_lens[1] = width
    spans = [max(0, max(row_lens[g * next_n : (g + 1) * next_n].tolist())) for g in range(groups)]
    split = min(max(cdiv(cdiv(sum(spans), target), 256) * 256, 256), split_keys)
    want = []
    for g, span in enumerate(spans):
        count = max(1, cdiv(span, split))
        want += [(g, j * split, KEY_END_OPEN if j == count - 1 else (j + 1) * split)
                 for j in range(count)]  # fmt: skip
    for backend in ("reference", "triton"):
        schedule = allocate_schedule(groups, width, "cpu", split_keys=split_keys,
                                     target_items=target).fill_(POISON)  # fmt: skip
        build_decode_schedule(row_lens, schedule, next_n=next_n, split_keys=split_keys,
                              target_items=target, backend=backend)  # fmt: skip
        assert int(schedule[3]) == 1, backend
        assert items_of(schedule) == want, backend
        assert len(want) <= target + groups


def test_target_items_refused_when_negative() -> None:
    schedule = allocate_schedule(2, 512, "cpu")
    with pytest.raises(ValueError, match="target_items"):
        build_decode_schedule(torch.zeros(2, dtype=torch.int32), schedule, target_items=-1)
    with pytest.raises(ValueError, match="target_items"):
        allocate_schedule(2, 512, "cpu", target_items=-3)
