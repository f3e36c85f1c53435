"""The bench's checks (graphidx.bench.checks) on CPU tensors: each says OK for the right
answer and FAIL for each way a kernel's output can be wrong."""

from __future__ import annotations

import pytest
import torch

from graphidx.bench.checks import check_topk_picks, chunk_maxima, compare_logits


def _logits(gen: torch.Generator) -> torch.Tensor:
    logits = 30 * torch.randn(6, 40, generator=gen)
    logits[:, 33:] = float("nan")  # columns a kernel must leave unwritten
    logits[2, 5] = float("-inf")
    return logits


def test_compare_logits_accepts_fp32_rounding(gen: torch.Generator) -> None:
    want = _logits(gen)
    got = want.clone()
    scale = float(want[want.isfinite()].abs().max())
    got[0, 0] += 0.5e-5 * scale
    assert compare_logits(got, want) == "OK"
    assert (
        compare_logits(torch.full((2, 3), float("nan")), torch.full((2, 3), float("nan"))) == "OK"
    )


def test_compare_logits_refuses_a_wrong_value(gen: torch.Generator) -> None:
    want = _logits(gen)
    got = want.clone()
    got[4, 7] += 1e-3 * float(want[want.isfinite()].abs().max())
    assert compare_logits(got, want).startswith("FAIL: max error")


def test_compare_logits_refuses_written_or_unwritten_columns(gen: torch.Generator) -> None:
    want = _logits(gen)
    written = want.clone()
    written[1, 35] = 0.0
    assert compare_logits(written, want) == "FAIL: 1 written/NaN columns differ"
    missing = want.clone()
    missing[1, 3] = float("nan")
    assert compare_logits(missing, want) == "FAIL: 1 written/NaN columns differ"
    infinite = want.clone()
    infinite[3, 3] = float("inf")
    assert compare_logits(infinite, want) == "FAIL: inf columns differ"


def test_topk_picks(gen: torch.Generator) -> None:
    logits = torch.randn(10, 64, generator=gen)
    k = 8
    want = torch.topk(logits, k, dim=1)
    want_values = want.values.sort(dim=1).values
    picks = want.indices.flip(1).to(torch.int32)  # any order
    assert check_topk_picks(logits, picks, want_values) == "OK"
    wrong = picks.clone()
    wrong[9, 0] = int(torch.topk(logits[9], k + 1).indices[-1])  # the (k+1)-th largest
    assert check_topk_picks(logits, wrong, want_values) == "FAIL: wrong picks"
    repeated = picks.clone()
    repeated[0, 1] = repeated[0, 0]
    assert check_topk_picks(logits, repeated, want_values) == "FAIL: wrong picks"


@pytest.mark.parametrize("numel", [1, 255, 256, 1000])
def test_chunk_maxima(numel: int, gen: torch.Generator) -> None:
    values = torch.randn(numel, generator=gen)
    got = chunk_maxima(values, 128)
    want = torch.stack([values[i : i + 128].max() for i in range(0, numel, 128)])
    assert torch.equal(got, want)
