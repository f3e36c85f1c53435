"""The checks a case runs before it is timed: its kernel's output against the reference's.

Each returns "OK" or "FAIL: ..." (the case's `check` column); none raises on a mismatch, so a
wrong kernel is reported and timed like the others.
"""

from __future__ import annotations

import torch

from graphidx.config import cdiv
from graphidx.ops.backend import FP8_LOGIT_BOUND

LOGITS_RTOL = 1e-5
"""Largest logit error, relative to the largest finite reference logit (at least 1)."""


def compare_logits(got: torch.Tensor, want: torch.Tensor, precision: str = "exact") -> str:
    """float32 logits: the NaN (unwritten) and inf patterns equal, finite values within
    LOGITS_RTOL of the reference (`exact`), or within the fp8 bound
    (`graphidx.ops.FP8_LOGIT_BOUND`, `fp8`)."""
    if not torch.equal(got.isnan(), want.isnan()):
        return f"FAIL: {int((got.isnan() != want.isnan()).sum())} written/NaN columns differ"
    if not torch.equal(got.isinf(), want.isinf()):
        return "FAIL: inf columns differ"
    finite = want.isfinite()
    if not bool(finite.any()):
        return "OK"
    scale = float(want[finite].abs().max())
    err = float((got[finite].double() - want[finite].double()).abs().max())
    bound = (FP8_LOGIT_BOUND if precision == "fp8" else LOGITS_RTOL) * max(scale, 1.0)
    return "OK" if err <= bound else f"FAIL: max error {err:.3g} > {bound:.3g}"


def check_topk_picks(logits: torch.Tensor, picks: torch.Tensor, want_values: torch.Tensor) -> str:
    """`picks` (`[rows, k]` column indices) select the rows' k largest values: the picked
    values, sorted, equal `want_values` (torch.topk's, sorted per row), and the first 8 rows'
    picks are distinct."""
    k = picks.shape[1]
    got_values = logits.gather(1, picks.clamp(min=0).long()).sort(dim=1).values
    distinct = all(len(set(row)) == k for row in picks[:8].tolist())
    return "OK" if torch.equal(got_values, want_values) and distinct else "FAIL: wrong picks"


def chunk_maxima(values: torch.Tensor, chunk: int) -> torch.Tensor:
    """The max of each `chunk` consecutive elements of `values` (flattened), the last chunk
    padded with -inf: what the `one read` kernel writes."""
    flat = values.flatten()
    chunks = cdiv(flat.numel(), chunk)
    padded = torch.full((chunks * chunk,), float("-inf"), dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    return padded.view(chunks, chunk).amax(dim=1)
