"""The `aiter` backend (gfx950 only): adapters from graphidx's op contract to aiter kernels.

Reached only when a caller asks for `backend="aiter"` explicitly and
`graphidx.ops.backend.resolve_backend` has confirmed a gfx950 GPU with aiter importable; it is
never a default and never a fallback.

What it serves:
- `topk_per_row`: aiter's `top_k_per_row_prefill` (rows [0, length)), whose kernel is built
  for k = 2048 (DeepSeek-V3.2's top-k); other k raise NotImplementedError. Its picks are
  post-filtered so exactly -inf entries and columns past a row's length become -1, as the
  contract requires. Not run on a gfx950 in this repository's CI (none is available): treat
  it as unverified until the GPU tests pass there.
- Everything else raises NotImplementedError: aiter has no kernel that reads graphidx's
  MXFP4 preshuffled paged cache with this op contract (its paged MQA logits kernels take FP8
  keys), and no candidate-pool ops. Use `backend="triton"` on gfx950 for those.
"""

from __future__ import annotations

import importlib

import torch

AITER_TOPK = 2048


def _unsupported(op: str) -> NotImplementedError:
    return NotImplementedError(
        f"backend='aiter' does not implement {op}: aiter has no kernel for graphidx's MXFP4 "
        "paged cache and candidate pools under this contract; use backend='triton' on gfx950"
    )


def paged_mqa_logits(*args: object, **kwargs: object) -> None:
    """Not provided by aiter (see module docstring)."""
    raise _unsupported("paged_mqa_logits")


def gather_mqa_logits(*args: object, **kwargs: object) -> None:
    """Not provided by aiter (see module docstring)."""
    raise _unsupported("gather_mqa_logits")


def remap_compact_topk(*args: object, **kwargs: object) -> None:
    """Not provided by aiter (see module docstring)."""
    raise _unsupported("remap_compact_topk")


def resolve_candidate_pool(*args: object, **kwargs: object) -> None:
    """Not provided by aiter (see module docstring)."""
    raise _unsupported("resolve_candidate_pool")


def apply_candidate_mask(*args: object, **kwargs: object) -> None:
    """Not provided by aiter (see module docstring)."""
    raise _unsupported("apply_candidate_mask")


def build_decode_schedule(*args: object, **kwargs: object) -> None:
    """Not provided by aiter: its logits kernel reads no decode schedule."""
    raise NotImplementedError(
        "aiter has no decode schedule (its logits kernel does not read one); "
        "build it with backend='triton' or 'reference'"
    )


def topk_per_row(logits: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """`topk_per_row` through aiter's `top_k_per_row_prefill` (k must be 2048)."""
    if k != AITER_TOPK:
        raise NotImplementedError(
            f"backend='aiter' top-k is built for k={AITER_TOPK}, got k={k}; "
            "use backend='triton' for other k"
        )
    aiter = importlib.import_module("aiter")
    rows, width = logits.shape
    row_ends = lengths.clamp(0, width)
    row_starts = torch.zeros_like(row_ends)
    aiter.top_k_per_row_prefill(
        logits, row_starts, row_ends, out, None, rows, logits.stride(0), logits.stride(1)
    )
    # The contract drops -inf picks and anything past the row's length.
    picked = out.to(torch.int64)
    inside = (picked >= 0) & (picked < row_ends.unsqueeze(1))
    values = logits.gather(1, torch.where(inside, picked, 0))
    out.copy_(torch.where(inside & (values != float("-inf")), out, -1))
