"""What a Hopper user would assemble instead of graphidx, timed the same way (`--peers`).

The V3.2 decode layer from the peers: DeepGEMM's `get_paged_mqa_logits_metadata` +
`fp8_paged_mqa_logits` over an FP8 paged cache (e4m3 keys, one fp32 scale per key, 132 B per
key at D = 128) and FlashInfer's `top_k_ragged_transform` (top-2048), captured in one CUDA
graph; its step copies the context lengths in from pinned host memory and replays. Used only
as libraries (`../shared/peers/README.md` has how to build them on the GPU machine); nothing
here runs when they are not importable.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from graphidx.bench.step import STEP_BATCHES, median_ms
from graphidx.config import cdiv

HEAD_DIM = 128
PEER_BLOCK = 64
"""DeepGEMM's paged-cache block on Hopper (64 keys)."""
PEER_TOPK = 2048


def peers_available() -> list[str]:
    """The peer libraries importable here (`deep_gemm`, `flashinfer`)."""
    return [name for name in ("deep_gemm", "flashinfer") if importlib.util.find_spec(name)]


def _fp8_cache(blocks: int, device: torch.device) -> torch.Tensor:
    """uint8 `[blocks, 64, 1, D + 4]`: per block 64 * D e4m3 key bytes, then 64 fp32 scales."""
    keys = torch.randn(blocks, PEER_BLOCK, HEAD_DIM, device=device)
    scale = keys.abs().amax(dim=2, keepdim=True).clamp(min=1e-4) / 448.0
    codes = (keys / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    cache = torch.empty(blocks, PEER_BLOCK * (HEAD_DIM + 4), dtype=torch.uint8, device=device)
    cache[:, : PEER_BLOCK * HEAD_DIM] = codes.reshape(blocks, -1)
    cache[:, PEER_BLOCK * HEAD_DIM :] = scale.reshape(blocks, -1).contiguous().view(torch.uint8)
    return cache.view(blocks, PEER_BLOCK, 1, HEAD_DIM + 4)


def peer_v32_step(
    context: int, batches: tuple[int, ...] = STEP_BATCHES, num_heads: int = 64, next_n: int = 2
) -> dict[tuple[int, int], tuple[float, float]]:
    """(context, batch) -> (step ms, graph ms) of the peer V3.2 decode layer."""
    import deep_gemm
    import flashinfer.topk as flashinfer_topk

    # In a graph FlashInfer otherwise picks CUB's top-k for long rows.
    os.environ.setdefault("FLASHINFER_TOPK_ALGO", "default")
    sms = deep_gemm.get_num_sms()
    rows: dict[tuple[int, int], tuple[float, float]] = {}
    for batch in batches:
        rows[(context, batch)] = _peer_batch(
            deep_gemm, flashinfer_topk, sms, context, batch, num_heads, next_n
        )
        print(
            f"  peer v32 {context} x {batch}: step {rows[(context, batch)][0]:.3f} ms, "
            f"graph {rows[(context, batch)][1]:.3f} ms",
            flush=True,
        )
        torch.cuda.empty_cache()
    return rows


def _peer_batch(
    deep_gemm: Any,
    flashinfer_topk: Any,
    sms: int,
    context: int,
    batch: int,
    num_heads: int,
    next_n: int,
) -> tuple[float, float]:
    """(step ms, graph ms) of the peer layer at one batch."""
    device = torch.device("cuda")
    pages = cdiv(context, PEER_BLOCK)
    table = torch.randperm(batch * pages, device=device).to(torch.int32).view(batch, pages)
    cache = _fp8_cache(batch * pages, device)
    q = torch.randn(batch, next_n, num_heads, HEAD_DIM, device=device).to(torch.float8_e4m3fn)
    weights = torch.rand(batch * next_n, num_heads, device=device)
    ends = [[context - next_n + 1 + j for j in range(next_n)] for _ in range(batch)]
    host_lens = torch.tensor(ends, dtype=torch.int32).pin_memory()
    lens = host_lens.to(device)
    flat_lens = lens.view(-1).clone()
    offsets = torch.zeros(batch * next_n, dtype=torch.int32, device=device)

    def layer() -> torch.Tensor:
        schedule = deep_gemm.get_paged_mqa_logits_metadata(lens, PEER_BLOCK, sms)
        logits = deep_gemm.fp8_paged_mqa_logits(
            q, cache, weights, lens, table, schedule, pages * PEER_BLOCK, False
        )
        flat_lens.copy_(lens.view(-1))
        return flashinfer_topk.top_k_ragged_transform(logits, offsets, flat_lens, PEER_TOPK)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        picks = layer()
    graph.replay()
    torch.cuda.synchronize()
    if not (int(picks[0].min()) >= 0 and int(picks[0].max()) < context):
        raise RuntimeError(f"peer top-k out of range at batch {batch}")

    def step() -> None:
        lens.copy_(host_lens, non_blocking=True)
        graph.replay()

    return median_ms(step, False), median_ms(graph.replay, True)
