"""Top-k per row of a logits buffer (docs/contract.md section 5.2).

`topk_per_row` validates, resolves the backend and calls the custom op
`graphidx::topk_per_row`: reference below, `graphidx.ops.kernels.topk` (Triton), or
`graphidx.ops.aiter`.
"""

from __future__ import annotations

import torch

from graphidx.ops.backend import resolve_backend
from graphidx.ops.registry import define_op
from graphidx.ops.validate import check_int, check_rows, check_tensor

NEG_INF = float("-inf")


def topk_per_row_reference(
    logits: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor
) -> None:
    """Torch oracle of `topk_per_row`: torch.topk on each row masked to its length."""
    rows, width = logits.shape
    if rows == 0:
        return
    lens = lengths.to(torch.int64).clamp(0, width)
    visible = torch.arange(width, device=logits.device).unsqueeze(0) < lens.unsqueeze(1)
    masked = torch.where(visible, logits, NEG_INF)
    picked = min(k, width)
    if picked > 0:
        values, indices = torch.topk(masked, picked, dim=1)
        # A -inf pick is a column past the length, or a masked-out one: never a real pick.
        out[:, :picked] = torch.where(values == NEG_INF, -1, indices).to(torch.int32)
    out[:, picked:] = -1


_topk_per_row = define_op("topk_per_row", topk_per_row_reference, "topk", mutates_args=("out",))


def topk_per_row(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Indices of the k largest of `logits[r, :lengths[r]]` per row, in any order.

    logits float32 `[rows, W]` (last dim contiguous, any row stride); lengths int32 `[rows]`
    (clamped to [0, W]); out int32 `[rows, k]` with k == out.shape[1]. Rows with fewer than
    k candidates are padded with -1; entries exactly -inf are never picked (they become -1).
    NaN logits are undefined.
    """
    check_tensor("logits", logits, dtype=torch.float32, rank=2)
    rows = logits.shape[0]
    device = logits.device
    check_rows("lengths", lengths, rows, device)
    check_int("k", k, minimum=1)
    check_tensor("out", out, dtype=torch.int32, rank=2, device=device, shape=(rows, None))
    if out.shape[1] != k:
        raise ValueError(f"k={k} must equal out.shape[1], got out of shape {tuple(out.shape)}")
    resolved = resolve_backend(backend, device)
    _topk_per_row(logits, lengths, k, out, resolved)
