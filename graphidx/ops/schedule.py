"""The decode work schedule (docs/contract.md section 5.7): work descriptors built on the device.

`build_decode_schedule` fills a fixed-size buffer (`allocate_schedule`; layout in
`graphidx.ops.schedule_format`) from `row_lens` without a host sync; its unused slots are
never read, so a graph captured at one batch replays correctly at any other.

`derive_uniform_decode` is the captured uniform-decode step's metadata in one device op: from
the persistent request lengths and a device count of live requests it writes the compressed
contexts, the decode row ends, the candidate block ends and the schedule, so a replayed graph
recomputes every value it derives instead of trusting the host.
"""

from __future__ import annotations

import torch

from graphidx.ops.backend import resolve_backend
from graphidx.ops.registry import define_op
from graphidx.ops.schedule_format import (
    KEY_END_OPEN,
    SCHEDULE_HEADER_INTS,
    SCHEDULE_ITEM_INTS,
    SCHEDULE_SPLIT_KEYS,
    SPLIT_ALIGNMENT,
    schedule_capacity,
    schedule_ints,
)
from graphidx.ops.validate import check_int, check_int32, check_rows


def _check_split(split_keys: int, target_items: int) -> None:
    """split_keys a multiple of SPLIT_ALIGNMENT (at least one), target_items an int >= 0."""
    check_int("split_keys", split_keys, minimum=SPLIT_ALIGNMENT)
    if split_keys % SPLIT_ALIGNMENT:
        raise ValueError(f"split_keys must be a multiple of {SPLIT_ALIGNMENT}, got {split_keys}")
    check_int("target_items", target_items, minimum=0)


def _check_capacity(schedule: torch.Tensor, groups: int) -> None:
    """ValueError unless `schedule` holds at least one item per row group."""
    capacity = schedule_capacity(schedule)
    if capacity < groups:
        raise ValueError(
            f"schedule holds {capacity} items, fewer than the {groups} row groups; "
            "size it with allocate_schedule(max_seqs, max_width, device)"
        )


TARGET_ITEMS_PER_SM = 4
"""Items per multiprocessor a GPU build aims at: one per persistent program of the scheduled
logits grid (`LogitsConfig.programs_per_sm`)."""


def default_target_items(device: torch.device) -> int:
    """The target item count of a decode schedule built for `device`: TARGET_ITEMS_PER_SM per
    multiprocessor on a GPU, 0 (the fixed split) elsewhere. A host constant of the device."""
    if device.type != "cuda":
        return 0
    from graphidx.ops.kernels import multiprocessor_count

    return TARGET_ITEMS_PER_SM * multiprocessor_count(device)


def allocate_schedule(
    max_seqs: int,
    max_width: int,
    device: torch.device | str,
    *,
    split_keys: int = SCHEDULE_SPLIT_KEYS,
    target_items: int = 0,
) -> torch.Tensor:
    """A zeroed schedule buffer for up to `max_seqs` row groups of up to `max_width` keys.

    max_seqs counts the groups a decode launch can have: requests for a native (next_n)
    launch, rows for a flattened one. Capacity is max_seqs * cdiv(max_width, split_keys)
    items, enough for every group at full width, or target_items + max_seqs when larger
    (pass the split_keys and target_items the builds will use).
    Returns int32 `[4 + 3 * capacity]`; until it is built it reads as untrusted (the static
    grid runs).
    """
    check_int("max_seqs", max_seqs, minimum=1)
    check_int("max_width", max_width, minimum=1)
    _check_split(split_keys, target_items)
    return torch.zeros(
        schedule_ints(max_seqs, max_width, split_keys, target_items),
        dtype=torch.int32,
        device=device,
    )


def build_decode_schedule_reference(
    row_lens: torch.Tensor,
    schedule: torch.Tensor,
    *,
    next_n: int,
    split_keys: int,
    target_items: int = 0,
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
    split = torch.tensor(split_keys, dtype=torch.int64, device=device)
    if target_items > 0:
        per_item = (spans.sum() + target_items - 1) // target_items
        per_item = (per_item + SPLIT_ALIGNMENT - 1) // SPLIT_ALIGNMENT * SPLIT_ALIGNMENT
        split = per_item.clamp(SPLIT_ALIGNMENT, split_keys)
    items = ((spans + split - 1) // split).clamp(min=1)
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
    item_keys = per_item[group] * split
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


_build_decode_schedule = define_op(
    "build_decode_schedule",
    build_decode_schedule_reference,
    "schedule",
    mutates_args=("schedule",),
)


def build_decode_schedule(
    row_lens: torch.Tensor,
    schedule: torch.Tensor,
    *,
    next_n: int = 1,
    split_keys: int = SCHEDULE_SPLIT_KEYS,
    target_items: int = 0,
    backend: str | None = None,
) -> None:
    """Fill `schedule` with the decode work items for `row_lens` (format: module docstring).

    row_lens int32 `[rows]` (each row's end; rows a multiple of next_n); schedule int32 1-D
    from `allocate_schedule`, on the same device, holding at least one item per group
    (rows // next_n). next_n: rows per group, as passed to `paged_mqa_logits` (1 for a
    flattened launch). split_keys: keys per item, a multiple of 256 (SPLIT above), or with
    target_items > 0 the largest item size, the step's keys then cut to about that many
    items (`graphidx.ops.schedule_format`; `default_target_items` is the GPU's).
    Runs on the device; no host sync.
    """
    check_int32("row_lens", row_lens, (None,))
    device = row_lens.device
    check_int32("schedule", schedule, (None,), device)
    check_int("next_n", next_n, minimum=1)
    _check_split(split_keys, target_items)
    rows = row_lens.shape[0]
    if rows % next_n:
        raise ValueError(f"next_n={next_n} does not divide the {rows} rows of row_lens")
    _check_capacity(schedule, rows // next_n)
    resolved = resolve_backend(backend, device)
    _build_decode_schedule(row_lens, schedule, next_n, split_keys, target_items, resolved)


def derive_uniform_decode_reference(
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
    """Torch oracle of `derive_uniform_decode`: tensor ops only, no host sync."""
    reqs = seq_lens.shape[0]
    device = seq_lens.device
    live = torch.arange(reqs, device=device) < num_live_reqs
    lens = torch.where(live, seq_lens, 0).clamp(min=0)
    context_lens.copy_(lens // compress_ratio)
    steps = torch.arange(1 - next_n, 1, device=device)
    ends = (lens.unsqueeze(1) + steps).clamp(min=0) // compress_ratio
    row_lens.view(reqs, next_n).copy_(ends)
    if block_ends is not None:
        size = candidate_block_size
        block_ends.copy_((row_lens + size - 1) // size)
    if schedule is not None:
        build_decode_schedule_reference(
            row_lens, schedule, next_n=group_rows, split_keys=split_keys, target_items=target_items
        )


_derive_uniform_decode = define_op(
    "derive_uniform_decode",
    derive_uniform_decode_reference,
    "schedule",
    mutates_args=("context_lens", "row_lens", "block_ends", "schedule"),
)


def derive_uniform_decode(
    seq_lens: torch.Tensor,
    num_live_reqs: torch.Tensor,
    context_lens: torch.Tensor,
    row_lens: torch.Tensor,
    block_ends: torch.Tensor | None = None,
    schedule: torch.Tensor | None = None,
    *,
    next_n: int,
    compress_ratio: int = 1,
    candidate_block_size: int = 0,
    group_rows: int | None = None,
    split_keys: int = SCHEDULE_SPLIT_KEYS,
    target_items: int = 0,
    backend: str | None = None,
) -> None:
    """A uniform decode step's metadata, derived on the device in one op.

    Inputs: `seq_lens` int32 `[reqs]` (the persistent request lengths; values past the live
    count are ignored, whatever they hold) and `num_live_reqs` int32 `[1]` (requests
    `[num_live, reqs)` are padding). Every request has `next_n` rows. Writes, for request r
    with L = seq_lens[r] if r < num_live else 0: `context_lens[r] = L // R`; row j of it
    (row `r * next_n + j` of `row_lens`, int32 `[reqs * next_n]`) ends at
    `max(L - next_n + j + 1, 0) // R`; `block_ends = ceil(row_lens / C)` when given (needs
    `candidate_block_size` C > 0); and, when `schedule` is given, the decode schedule of
    those row ends with `group_rows` rows per group (`next_n` for a native launch, 1 for a
    flattened one; default next_n; `split_keys` and `target_items` as in
    `build_decode_schedule`). Reads no host value that changes per step, so a graph
    captured with it recomputes all of these at every replay.
    """
    check_int32("seq_lens", seq_lens, (None,))
    device = seq_lens.device
    reqs = seq_lens.shape[0]
    check_int("next_n", next_n, minimum=1)
    check_int("compress_ratio", compress_ratio, minimum=1)
    check_int("candidate_block_size", candidate_block_size, minimum=0)
    group_rows = next_n if group_rows is None else group_rows
    if group_rows not in (1, next_n):
        raise ValueError(f"group_rows must be 1 or next_n = {next_n}, got {group_rows}")
    check_rows("num_live_reqs", num_live_reqs, 1, device)
    check_rows("context_lens", context_lens, reqs, device)
    rows = reqs * next_n
    check_rows("row_lens", row_lens, rows, device)
    if not row_lens.is_contiguous() or not context_lens.is_contiguous():
        raise ValueError("row_lens and context_lens must be contiguous")
    if (block_ends is None) != (candidate_block_size == 0):
        raise ValueError(
            f"block_ends must be given exactly when candidate_block_size > 0 "
            f"(candidate_block_size = {candidate_block_size})"
        )
    if block_ends is not None:
        check_rows("block_ends", block_ends, rows, device)
        if not block_ends.is_contiguous():
            raise ValueError("block_ends must be contiguous")
    if schedule is not None:
        check_int32("schedule", schedule, (None,), device)
        _check_split(split_keys, target_items)
        _check_capacity(schedule, rows // group_rows)
    resolved = resolve_backend(backend, device)
    if resolved == "aiter":
        resolved = "triton" if device.type == "cuda" else "reference"
    _derive_uniform_decode(
        seq_lens,
        num_live_reqs,
        context_lens,
        row_lens,
        block_ends,
        schedule,
        next_n,
        compress_ratio,
        candidate_block_size,
        group_rows,
        split_keys,
        target_items,
        resolved,
    )


__all__ = [
    "KEY_END_OPEN",
    "SCHEDULE_HEADER_INTS",
    "SCHEDULE_ITEM_INTS",
    "SCHEDULE_SPLIT_KEYS",
    "SPLIT_ALIGNMENT",
    "TARGET_ITEMS_PER_SM",
    "allocate_schedule",
    "build_decode_schedule",
    "build_decode_schedule_reference",
    "default_target_items",
    "derive_uniform_decode",
    "derive_uniform_decode_reference",
    "schedule_capacity",
]
