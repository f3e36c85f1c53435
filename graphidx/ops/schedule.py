"""The decode work schedule (SPEC 5; OPS_CONTRACT op 7): work descriptors built on the device.

A decode step's row groups (seqs of `next_n` rows, or single rows) are cut into *items* of
at most SPLIT = `split_keys` keys (default SCHEDULE_SPLIT_KEYS), so that `paged_mqa_logits`
can run a fixed, persistent grid that splits one long request across the GPU as readily as
it runs many short ones. The buffer
has a fixed size (`allocate_schedule`), is filled on the device without a host sync, and its
unused slots are never read, so a graph captured at one batch replays correctly at any other.

Buffer format (int32, 1-D):

    [0] item count   [1] group count   [2] next_n   [3] complete flag (1 = trusted)
    then item i at [4 + 3i : 7 + 3i] = (group, first key, end key)

Group g's span is the max over its rows of max(row_lens, 0); it gets max(1, cdiv(span,
SPLIT)) items in key order, item j covering keys [j * SPLIT, (j + 1) * SPLIT), and its last
item's end key is KEY_END_OPEN ("up to the group's span"): the logits kernel clips every item
to the span it computes from the actual row ends and context lengths. Every group has at
least one item, so a schedule left stale after row_lens changed still covers every key (it
is only less balanced). When the items exceed the capacity, each group keeps one item and
the spare slots are shared pro rata (items then cover whole multiples of SPLIT). A buffer
that cannot hold one item per group is written with complete = 0, and a zero-filled buffer
(from `allocate_schedule`) also reads as untrusted: the logits kernel then walks its static
grid instead. The answer never depends on the schedule.
"""

from __future__ import annotations

import torch

from graphidx.config import cdiv
from graphidx.ops.backend import resolve_backend
from graphidx.ops.validate import check_int, check_tensor

SCHEDULE_HEADER_INTS = 4
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


def _check_split_keys(split_keys: int) -> None:
    check_int("split_keys", split_keys, minimum=SPLIT_ALIGNMENT)
    if split_keys % SPLIT_ALIGNMENT:
        raise ValueError(f"split_keys must be a multiple of {SPLIT_ALIGNMENT}, got {split_keys}")


def allocate_schedule(
    max_seqs: int,
    max_width: int,
    device: torch.device | str,
    *,
    split_keys: int = SCHEDULE_SPLIT_KEYS,
) -> torch.Tensor:
    """A zeroed schedule buffer for up to `max_seqs` row groups of up to `max_width` keys.

    max_seqs counts the groups a decode launch can have: requests for a native (next_n)
    launch, rows for a flattened one. Capacity is max_seqs * cdiv(max_width, split_keys)
    items, enough for every group at full width (pass the split_keys the builds will use).
    Returns int32 `[4 + 3 * capacity]`; until it is built it reads as untrusted (the static
    grid runs).
    """
    check_int("max_seqs", max_seqs, minimum=1)
    check_int("max_width", max_width, minimum=1)
    _check_split_keys(split_keys)
    capacity = max_seqs * cdiv(max_width, split_keys)
    return torch.zeros(
        SCHEDULE_HEADER_INTS + SCHEDULE_ITEM_INTS * capacity, dtype=torch.int32, device=device
    )


def build_decode_schedule_reference(
    row_lens: torch.Tensor, schedule: torch.Tensor, *, next_n: int, split_keys: int
) -> None:
    """Torch oracle of `build_decode_schedule`: tensor ops only, no host sync.

    Writes the header and the used item slots; unused slots keep their bytes.
    """
    rows = row_lens.shape[0]
    groups = rows // next_n
    capacity = schedule_capacity(schedule)
    device = schedule.device
    complete = groups <= capacity
    if groups == 0:
        header = torch.tensor([0, 0, next_n, int(complete)], dtype=torch.int32, device=device)
        schedule[:SCHEDULE_HEADER_INTS].copy_(header)
        return
    spans = row_lens.to(torch.int64).view(groups, next_n).amax(dim=1).clamp(min=0)
    items = ((spans + split_keys - 1) // split_keys).clamp(min=1)
    total = items.sum()
    spare = capacity - groups
    extra = (total - groups).clamp(min=1)
    granted = torch.where(total > capacity, 1 + (items - 1) * spare // extra, items).clamp(min=1)
    per_item = (items + granted - 1) // granted
    count = (items + per_item - 1) // per_item
    ends = torch.cumsum(count, dim=0)
    written = ends[-1]

    slot = torch.arange(capacity, device=device)
    group = torch.searchsorted(ends, slot, right=True).clamp(max=groups - 1)
    index = slot - (ends - count)[group]
    item_keys = per_item[group] * split_keys
    key_start = index * item_keys
    key_end = torch.where(index == count[group] - 1, KEY_END_OPEN, key_start + item_keys)
    used = (slot < written) & complete
    body = schedule[SCHEDULE_HEADER_INTS : SCHEDULE_HEADER_INTS + SCHEDULE_ITEM_INTS * capacity]
    body = body.view(capacity, SCHEDULE_ITEM_INTS)
    fresh = torch.stack((group, key_start, key_end), dim=1).to(torch.int32)
    body.copy_(torch.where(used.unsqueeze(1), fresh, body))
    header = torch.stack(
        (
            written * int(complete),
            torch.tensor(groups, device=device),
            torch.tensor(next_n, device=device),
            torch.tensor(int(complete), device=device),
        )
    ).to(torch.int32)
    schedule[:SCHEDULE_HEADER_INTS].copy_(header)


@torch.library.custom_op("graphidx::build_decode_schedule", mutates_args=("schedule",))
def _build_decode_schedule_op(
    row_lens: torch.Tensor, schedule: torch.Tensor, next_n: int, split_keys: int, backend: str
) -> None:
    if backend == "reference":
        build_decode_schedule_reference(row_lens, schedule, next_n=next_n, split_keys=split_keys)
    elif backend == "triton":
        from graphidx.ops.kernels import schedule as triton_schedule

        triton_schedule.build_decode_schedule(
            row_lens, schedule, next_n=next_n, split_keys=split_keys
        )
    elif backend == "aiter":
        raise NotImplementedError(
            "aiter has no decode schedule (its logits kernel does not read one); "
            "build it with backend='triton' or 'reference'"
        )
    else:
        raise ValueError(f"unknown backend {backend!r}")


@_build_decode_schedule_op.register_fake
def _build_decode_schedule_fake(
    row_lens: torch.Tensor, schedule: torch.Tensor, next_n: int, split_keys: int, backend: str
) -> None:
    return None


def build_decode_schedule(
    row_lens: torch.Tensor,
    schedule: torch.Tensor,
    *,
    next_n: int = 1,
    split_keys: int = SCHEDULE_SPLIT_KEYS,
    backend: str | None = None,
) -> None:
    """Fill `schedule` with the decode work items for `row_lens` (format: module docstring).

    row_lens int32 `[rows]` (each row's end; rows a multiple of next_n); schedule int32 1-D
    from `allocate_schedule`, on the same device, holding at least one item per group
    (rows // next_n). next_n: rows per group, as passed to `paged_mqa_logits` (1 for a
    flattened launch). split_keys: keys per item, a multiple of 256 (SPLIT above).
    Runs on the device; no host sync.
    """
    check_tensor("row_lens", row_lens, dtype=torch.int32, rank=1)
    device = row_lens.device
    check_tensor("schedule", schedule, dtype=torch.int32, rank=1, device=device)
    check_int("next_n", next_n, minimum=1)
    _check_split_keys(split_keys)
    rows = row_lens.shape[0]
    if rows % next_n:
        raise ValueError(f"next_n={next_n} does not divide the {rows} rows of row_lens")
    capacity = schedule_capacity(schedule)
    if capacity < rows // next_n:
        raise ValueError(
            f"schedule holds {capacity} items, fewer than the {rows // next_n} row groups; "
            "size it with allocate_schedule(max_seqs, max_width, device)"
        )
    resolved = resolve_backend(backend, device)
    torch.ops.graphidx.build_decode_schedule(row_lens, schedule, next_n, split_keys, resolved)


__all__ = [
    "KEY_END_OPEN",
    "SCHEDULE_HEADER_INTS",
    "SCHEDULE_ITEM_INTS",
    "SCHEDULE_SPLIT_KEYS",
    "SPLIT_ALIGNMENT",
    "allocate_schedule",
    "build_decode_schedule",
    "build_decode_schedule_reference",
    "schedule_capacity",
]
