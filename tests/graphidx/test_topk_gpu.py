"""The Triton top-k at full size on a GPU (marked `gpu`: skipped without one).

The interpreter runs programs one after another, so the cross-program parts of the split
path (relaxed slot atomics from P programs at once, the acq_rel last-arriver hand-off, `.cg`
reads of other programs' writes) only meet real concurrency here. Every program count is
checked at the H200 benchmark shape, with random lengths, ties and -inf, against exact key
math done with torch on the device.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

KEY_NEG_INF = 0x007FFFFF
SENTINEL = -777


def order_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 copy of the kernel's uint32 order key of each float32."""
    bits = values.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, ~bits & 0xFFFFFFFF, bits | (1 << 31))


def check_exact(logits: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Per row: the first min(k, #pickable) entries are distinct columns inside the length
    whose keys are the largest keys as a multiset, then -1; of the columns tied at the
    smallest picked key, the picked ones are those of smallest index (vectorized, on the
    device)."""
    width = logits.shape[1]
    inside = torch.arange(width, device=logits.device)[None, :] < lengths.clamp(0, width)[:, None]
    keys = torch.where(inside, order_keys(logits), -1)
    keys = torch.where(keys > KEY_NEG_INF, keys, -1)
    expect = (keys >= 0).sum(dim=1).clamp(max=k)
    slot = torch.arange(k, device=logits.device)[None, :]
    valid = slot < expect[:, None]
    picks = out.long()
    assert bool((picks[~valid] == -1).all()), "entries past the picks must be -1"
    assert bool(((picks >= 0) & (picks < lengths.clamp(0, width)[:, None].long()))[valid].all())
    ordered = torch.where(valid, picks, -1 - slot).sort(dim=1).values
    assert bool((ordered[:, 1:] != ordered[:, :-1]).all()), "a column was picked twice"
    chosen = torch.where(valid, keys.gather(1, picks.clamp(min=0)), -1)
    best = torch.where(valid, torch.topk(keys, k, dim=1).values, -1)
    assert torch.equal(chosen.sort(dim=1, descending=True).values, best)
    # Ties at the k-th key: exactly the first (in column order) that fit are picked.
    kth = best.gather(1, (expect - 1).clamp(min=0)[:, None])
    tied = (keys == kth) & (expect > 0)[:, None]
    fit = expect[:, None] - (keys > kth).sum(dim=1, keepdim=True)
    want = tied & (tied.cumsum(dim=1) <= fit)
    got = torch.zeros_like(keys).scatter_add_(1, picks.clamp(min=0), valid.long()) > 0
    assert torch.equal(got & tied, want), "tied columns not picked in column order"


def hard_rows(k: int, rows: int, width: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, lengths) of `rows` x `width` normals with the hard rows first: ties at the
    threshold, all equal, -inf columns, fewer finite values than k, the top keys crowded
    into an eighth of `groups` interleaved groups, extra columns tied at the k-th value;
    random lengths after the first 8 full ones, then 0 and k - 1."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(k + width)
    logits = torch.randn(rows, width, device="cuda", generator=gen)
    logits[1] = torch.round(logits[1] * 8.0) / 8.0  # many ties at the threshold
    logits[2] = 0.25  # all equal
    logits[3, ::3] = float("-inf")
    logits[4, 100:] = float("-inf")  # fewer finite values than k
    # The top keys crowded into an eighth of the groups: more candidates than CAP, so the
    # exact whole-row fallback of the grouped paths runs.
    crowded = torch.arange(width, device="cuda") % groups < groups // 8
    logits[5, crowded] += 50.0
    # 60 more columns tied at the k-th value, 20 of them picked: few enough that the
    # select's rank step orders them (`_emit_ranked`), not the tie buffer.
    kth = logits[6].sort(descending=True).values[k - 20]
    below = (logits[6] < kth).nonzero().flatten()
    logits[6, below[torch.randperm(below.numel(), device="cuda", generator=gen)[:60]]] = kth
    lengths = torch.randint(0, width + 1, (rows,), device="cuda", generator=gen)
    lengths[:8] = width
    lengths[8] = 0
    lengths[9] = k - 1
    return logits, lengths.to(torch.int32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("k", [512, 2048])
def test_every_program_count_at_full_size(k: int) -> None:
    from graphidx.ops.kernels.topk import (
        default_config,
        radix_config,
        split_config,
        topk_per_row,
    )

    rows, width = 128, 65536
    logits, lengths = hard_rows(k, rows, width, default_config(k, rows, width).groups)
    # The default (P = 1 with 16 warps at this width), every split and the radix select.
    configs = [default_config(k, rows, width)] + [split_config(k, s) for s in (1, 2, 4, 8, 16)]
    configs += [radix_config(1024, 4), radix_config(4096, 8)]
    for config in configs:
        for _ in range(3):  # races, if any, need repeats to show
            out = torch.full((rows, k), SENTINEL, dtype=torch.int32, device="cuda")
            topk_per_row(logits, lengths, k, out, config=config)
            check_exact(logits, lengths, k, out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("width", [2048, 8256, 16384, 32768])
@pytest.mark.parametrize("k", [512, 2048])
def test_whole_row_kernel_at_full_size(k: int, width: int) -> None:
    """The whole-row kernel on the hard rows, few and many of them, at every width it takes
    by default and at its widest."""
    from graphidx.ops.kernels.topk import topk_per_row, whole_row_config

    for rows in (2, 128):
        logits, lengths = hard_rows(k, max(rows, 10), width, 64)
        logits, lengths = logits[:rows], lengths[:rows]
        for _ in range(3):
            out = torch.full((rows, k), SENTINEL, dtype=torch.int32, device="cuda")
            topk_per_row(logits, lengths, k, out, config=whole_row_config(width))
            check_exact(logits, lengths, k, out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("width", [65600, 163840])
def test_few_rows_split_at_large_k(width: int) -> None:
    """Two rows at k 2048 take the split path by default (a V3.2 decode step of one
    request): every hard row, two at a time, three times, exact."""
    from graphidx.ops.kernels.topk import default_config, topk_per_row

    k = 2048
    assert default_config(k, 2, width).programs_per_row > 1
    logits, lengths = hard_rows(k, 10, width, default_config(k, 2, width).groups)
    for first in range(0, 10, 2):
        rows = slice(first, first + 2)
        for _ in range(3):
            out = torch.full((2, k), SENTINEL, dtype=torch.int32, device="cuda")
            topk_per_row(logits[rows], lengths[rows], k, out)
            check_exact(logits[rows], lengths[rows], k, out)
