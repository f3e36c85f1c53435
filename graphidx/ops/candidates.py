"""The candidate pool of a two-level indexer (docs/contract.md sections 5.3 and 5.6).

`resolve_candidate_pool` turns the source layer's candidate block ids into sorted first
positions and a live column count per row; `apply_candidate_mask` masks a dense logits row
to those blocks (the dense fallback of a consumer). Each public wrapper validates, resolves
the backend and calls its custom op (reference below, `graphidx.ops.kernels.candidates`, or
`graphidx.ops.aiter`).
"""

from __future__ import annotations

import torch

from graphidx.ops.backend import resolve_backend
from graphidx.ops.registry import define_op
from graphidx.ops.validate import check_int, check_int32, check_rows, check_tensor

NEG_INF = float("-inf")
_INT32_MAX = 2**31 - 1


def resolve_candidate_pool_reference(
    block_ids: torch.Tensor,
    row_ends: torch.Tensor,
    candidate_block_size: int,
    positions: torch.Tensor,
    live_cols: torch.Tensor,
) -> None:
    """Torch oracle of `resolve_candidate_pool`."""
    rows, pool_blocks = block_ids.shape
    if rows == 0:
        return
    size = candidate_block_size
    ends = row_ends.to(torch.int64).clamp(min=0)
    block_ends = (ends + size - 1) // size
    ids = block_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < block_ends.unsqueeze(1))
    # Invalid ids sort after every valid one, so the first n slots hold the valid ids.
    ordered, _ = torch.sort(torch.where(valid, ids, _INT32_MAX), dim=1)
    count = valid.sum(dim=1)
    slot = torch.arange(pool_blocks, device=block_ids.device).unsqueeze(0)
    positions.copy_(torch.where(slot < count.unsqueeze(1), ordered * size, -1).to(torch.int32))
    if pool_blocks == 0:
        live_cols.zero_()
        return
    last_id = ordered.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    tail = torch.clamp(ends - last_id * size, max=size)
    live = torch.where(count > 0, (count - 1) * size + tail, 0)
    live_cols.copy_(live.to(torch.int32))


def apply_candidate_mask_reference(
    logits: torch.Tensor, positions: torch.Tensor, candidate_block_size: int
) -> None:
    """Torch oracle of `apply_candidate_mask`."""
    rows, width = logits.shape
    if rows == 0 or width == 0:
        return
    size = candidate_block_size
    starts = positions.to(torch.int64)
    columns = starts.unsqueeze(2) + torch.arange(size, device=logits.device)
    inside = (starts >= 0).unsqueeze(2) & (columns < width)
    # Columns outside the row land in a spare column `width`, dropped afterwards.
    columns = torch.where(inside, columns, width).reshape(rows, -1)
    keep = torch.zeros(rows, width + 1, dtype=torch.bool, device=logits.device)
    keep.scatter_(1, columns, True)
    logits.masked_fill_(~keep[:, :width], NEG_INF)


_resolve_candidate_pool = define_op(
    "resolve_candidate_pool",
    resolve_candidate_pool_reference,
    "candidates",
    mutates_args=("positions", "live_cols"),
)
_apply_candidate_mask = define_op(
    "apply_candidate_mask", apply_candidate_mask_reference, "candidates", mutates_args=("logits",)
)


def resolve_candidate_pool(
    block_ids: torch.Tensor,
    row_ends: torch.Tensor,
    candidate_block_size: int,
    positions: torch.Tensor,
    live_cols: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Sorted first positions and live compact columns of each row's candidate blocks.

    block_ids int32 `[rows, KB]` (-1 padded, unique non-negative ids, any order); row_ends
    int32 `[rows]`; C = candidate_block_size >= 1. Writes positions int32 `[rows, KB]`: the
    valid ids (0 <= id < ceil(end / C)) ascending, as `id * C`, then -1; live_cols int32
    `[rows]`: `(n - 1) * C + min(C, end - last_id * C)` for n valid ids, 0 when n == 0.
    """
    check_int32("block_ids", block_ids, (None, None))
    rows, pool_blocks = block_ids.shape
    device = block_ids.device
    check_rows("row_ends", row_ends, rows, device)
    check_int("candidate_block_size", candidate_block_size, minimum=1)
    check_int32("positions", positions, (rows, pool_blocks), device)
    check_rows("live_cols", live_cols, rows, device)
    resolved = resolve_backend(backend, device)
    _resolve_candidate_pool(
        block_ids, row_ends, candidate_block_size, positions, live_cols, resolved
    )


def apply_candidate_mask(
    logits: torch.Tensor,
    positions: torch.Tensor,
    candidate_block_size: int,
    *,
    backend: str | None = None,
) -> None:
    """In place: -inf on every column of `logits` outside the row's candidate blocks.

    logits float32 `[rows, W]`; positions int32 `[rows, KB]` (first positions, -1 padded, as
    written by `resolve_candidate_pool`). Column t survives when some positions[r, i] >= 0
    has positions[r, i] <= t < positions[r, i] + C.
    """
    check_tensor("logits", logits, dtype=torch.float32, rank=2)
    rows = logits.shape[0]
    device = logits.device
    check_int32("positions", positions, (rows, None), device)
    check_int("candidate_block_size", candidate_block_size, minimum=1)
    resolved = resolve_backend(backend, device)
    _apply_candidate_mask(logits, positions, candidate_block_size, resolved)
