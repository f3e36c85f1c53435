"""How far each precision of the dense logits lands from float64, per kind of data, and how
much of the exact mode's top-k the fp8 mode keeps (docs/contract.md section 5, "Precision").

For every data kind, `measure_precision` builds MXFP4 keys and queries on the GPU, runs the
Triton dense logits in both precisions and scores each against float64 math over the same
decoded values:
- error: max over rows of max |logit - float64| / max |float64 logit of the row| (rows whose
  largest float64 logit is 0 are skipped);
- recall: the share of the fp8 top-k whose exact logit reaches the exact k-th largest (ties
  count as kept, so repeated keys do not lower it).

Kinds: `gaussian` (quantized N(0, 1)), `hadamard` (N(0, 1) with four outlier channels x20,
rotated by a Hadamard matrix: how real indexer keys look), `uniform codes` (every code,
scales 2**-7 .. 2**5), and the adversarial ones: `wide spread` (key block scales anywhere in
2**-57 .. 2**57, queries in 2**-27 .. 2**27), `extreme scales` (keys near 2**125, the largest
scale whose values float32 holds, queries near 2**-125, and the reverse), `subnormal` (keys
whose decoded values are float32 subnormals), `ties` (every key repeated 16 times) and
`cancellation` (each head's dot products are two large halves that cancel, leaving a small
remainder).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphidx.config import cdiv
from graphidx.mxfp4 import cache_layout, dequantize_mxfp4, quantize_mxfp4
from graphidx.mxfp4.layout import device_entry_offsets

DATA_KINDS = (
    "gaussian",
    "hadamard",
    "uniform codes",
    "wide spread",
    "extreme scales",
    "subnormal",
    "ties",
    "cancellation",
)
HEAD_DIM = 128
PAGE_ENTRIES = 64


@dataclass(frozen=True)
class PrecisionResult:
    """One data kind's figures (`measure_precision`)."""

    kind: str
    exact_error: float
    fp8_error: float
    recall: float
    rows: int
    keys: int
    heads: int


def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    h = torch.ones((1, 1), device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def _floats(kind: str, count: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """float32 `[count, HEAD_DIM]` vectors of a float-based kind."""
    x = torch.randn((count, HEAD_DIM), generator=gen, device=device)
    if kind == "hadamard":
        scale = torch.ones(HEAD_DIM, device=device)
        scale[torch.randperm(HEAD_DIM, generator=gen, device=device)[:4]] = 20.0
        x = (x * scale) @ _hadamard(HEAD_DIM, device)
    return x


def _random_codes(
    count: int, low: int, high: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every code uniformly, scale bytes uniform in [low, high]."""
    values = torch.randint(0, 256, (count, HEAD_DIM // 2), generator=gen, device=device)
    scales = torch.randint(low, high + 1, (count, HEAD_DIM // 32), generator=gen, device=device)
    return values.to(torch.uint8), scales.to(torch.uint8)


def _keys_and_queries(
    kind: str, keys: int, queries: int, gen: torch.Generator, device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """MXFP4 (values, scales) of `keys` keys and `queries` query heads of one kind."""
    if kind in ("gaussian", "hadamard"):
        return quantize_mxfp4(_floats(kind, keys, gen, device)), quantize_mxfp4(
            _floats(kind, queries, gen, device)
        )
    if kind == "uniform codes":
        return _random_codes(keys, 120, 132, gen, device), _random_codes(
            queries, 120, 132, gen, device
        )
    if kind == "wide spread":
        # Spreads of up to 114 (keys) and 54 (queries) octaves; products stay in float32.
        return _random_codes(keys, 70, 184, gen, device), _random_codes(
            queries, 100, 154, gen, device
        )
    if kind == "extreme scales":
        # Keys near the largest scale whose values float32 holds (6 * 2**125), queries near
        # the smallest, and the reverse in the second half of the seqs.
        half_keys, half_queries = keys // 2, queries // 2
        big_k, small_k = (
            _random_codes(half_keys, 238, 252, gen, device),
            _random_codes(keys - half_keys, 2, 16, gen, device),
        )
        small_q, big_q = (
            _random_codes(half_queries, 2, 16, gen, device),
            _random_codes(queries - half_queries, 238, 252, gen, device),
        )
        return (
            (torch.cat([big_k[0], small_k[0]]), torch.cat([big_k[1], small_k[1]])),
            (torch.cat([small_q[0], big_q[0]]), torch.cat([small_q[1], big_q[1]])),
        )
    if kind == "subnormal":
        return _random_codes(keys, 0, 6, gen, device), _random_codes(queries, 118, 130, gen, device)
    if kind == "ties":
        distinct = quantize_mxfp4(_floats("gaussian", cdiv(keys, 16), gen, device))
        return (
            distinct[0].repeat_interleave(16, 0)[:keys],
            distinct[1].repeat_interleave(16, 0)[:keys],
        ), quantize_mxfp4(_floats("gaussian", queries, gen, device))
    if kind == "cancellation":
        # Keys [u, u + small], queries [v, -v]: q . k = -v . small, the halves cancel.
        u = torch.randn((keys, HEAD_DIM // 2), generator=gen, device=device)
        small = 0.05 * torch.randn((keys, HEAD_DIM // 2), generator=gen, device=device)
        v = torch.randn((queries, HEAD_DIM // 2), generator=gen, device=device)
        return quantize_mxfp4(torch.cat([u, u + small], 1)), quantize_mxfp4(torch.cat([v, -v], 1))
    raise ValueError(f"unknown data kind {kind!r}; known: {DATA_KINDS}")


def _paged_cache(values: torch.Tensor, scales: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A cache whose slot i (page i // PAGE_ENTRIES) holds key i."""
    layout = cache_layout(num_heads, HEAD_DIM, PAGE_ENTRIES)
    pages = cdiv(values.shape[0], PAGE_ENTRIES)
    padding = pages * PAGE_ENTRIES - values.shape[0]
    values = torch.nn.functional.pad(values, (0, 0, 0, padding))
    scales = torch.nn.functional.pad(scales, (0, 0, 0, padding), value=127)
    value_offsets, scale_offsets = device_entry_offsets(layout, values.device)
    cache = torch.zeros((pages, layout.page_bytes), dtype=torch.uint8, device=values.device)
    cache[:, value_offsets.reshape(-1)] = values.view(pages, -1)
    cache[:, scale_offsets.reshape(-1)] = scales.view(pages, -1)
    return cache


def _float64_logits(
    q_values: torch.Tensor,
    q_scales: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    seqs: int,
) -> torch.Tensor:
    """float64 `[seqs, keys per seq]`: sum_h w * relu(q . k) over the decoded values."""
    heads = weights.shape[1]
    q = dequantize_mxfp4(q_values, q_scales).double().view(seqs, heads, HEAD_DIM)
    per_seq = keys.shape[0] // seqs
    k = keys.view(seqs, per_seq, HEAD_DIM)
    scores = torch.bmm(q, k.transpose(1, 2)).relu_()
    return torch.bmm(weights.double().unsqueeze(1), scores).squeeze(1)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().amax(dim=1)
    err = (got.double() - want).abs().amax(dim=1)
    keep = scale > 0
    if not bool(keep.any()):
        return 0.0
    return float((err[keep] / scale[keep]).max())


def _recall(fp8: torch.Tensor, exact: torch.Tensor, k: int) -> float:
    picks = torch.topk(fp8, k, dim=1).indices
    threshold = torch.topk(exact, k, dim=1).values[:, -1:]
    kept = exact.gather(1, picks) >= threshold
    return float(kept.double().mean())


def measure_kind(
    kind: str,
    device: torch.device,
    *,
    seqs: int = 8,
    keys: int = 16384,
    num_heads: int = 64,
    k: int = 2048,
    seed: int = 0,
) -> PrecisionResult:
    """One data kind at `seqs` rows (one per seq, next_n 1) of `keys` keys each (a positive
    multiple of PAGE_ENTRIES: whole pages)."""
    from graphidx.ops import paged_mqa_logits

    if keys <= 0 or keys % PAGE_ENTRIES:
        raise ValueError(f"keys must be a positive multiple of {PAGE_ENTRIES}, got {keys}")
    gen = torch.Generator(device=device).manual_seed(seed)
    (k_values, k_scales), (q_values, q_scales) = _keys_and_queries(
        kind, seqs * keys, seqs * num_heads, gen, device
    )
    q_values = q_values.view(seqs, num_heads, HEAD_DIM // 2)
    q_scales = q_scales.view(seqs, num_heads, HEAD_DIM // 32)
    weights = torch.rand((seqs, num_heads), generator=gen, device=device) + 0.05
    cache = _paged_cache(k_values, k_scales, num_heads)
    pages_per_seq = keys // PAGE_ENTRIES
    block_table = torch.arange(seqs * pages_per_seq, dtype=torch.int32, device=device)
    block_table = block_table.view(seqs, pages_per_seq)
    context_lens = torch.full((seqs,), keys, dtype=torch.int32, device=device)
    outs = {}
    for precision in ("exact", "fp8"):
        out = torch.full((seqs, keys), float("nan"), device=device)
        paged_mqa_logits(
            q_values, q_scales, cache, weights, context_lens, block_table, context_lens, out,
            page_entries=PAGE_ENTRIES, precision=precision, backend="triton",
        )  # fmt: skip
        outs[precision] = out
    want = _float64_logits(
        q_values.view(-1, HEAD_DIM // 2),
        q_scales.view(-1, HEAD_DIM // 32),
        weights,
        dequantize_mxfp4(k_values, k_scales).double(),
        seqs,
    )
    finite = bool(want.isfinite().all())
    return PrecisionResult(
        kind,
        _relative_error(outs["exact"], want) if finite else float("nan"),
        _relative_error(outs["fp8"], want) if finite else float("nan"),
        _recall(outs["fp8"], outs["exact"], min(k, keys)),
        seqs,
        keys,
        num_heads,
    )


def measure_precision(device: torch.device, **shape: int) -> list[PrecisionResult]:
    """`measure_kind` for every kind of DATA_KINDS (same shape for all)."""
    return [measure_kind(kind, device, **shape) for kind in DATA_KINDS]


def format_precision(results: list[PrecisionResult]) -> str:
    """A table: kind, exact and fp8 error relative to the row's largest logit, fp8 recall."""
    lines = [f"{'data':>15} {'exact err':>10} {'fp8 err':>10} {'fp8 recall':>10}  shape"]
    for r in results:
        lines.append(
            f"{r.kind:>15} {r.exact_error:10.2e} {r.fp8_error:10.2e} {100 * r.recall:9.3f}%  "
            f"H{r.heads}, {r.rows} rows x {r.keys} keys"
        )
    return "\n".join(lines)
