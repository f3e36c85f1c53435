"""What a Hopper user would assemble instead of graphidx, timed the same way (`--peers`).

Kernels (`graphidx bench --peers`): DeepGEMM's `fp8_paged_mqa_logits` and `fp8_mqa_logits`
and FlashInfer's `top_k` on the graphidx cases' workloads, each peer's output checked (logits
against float64 over its own FP8 inputs, within `FP8_LOGIT_BOUND` of the row's largest;
top-k picks against torch.topk), timed like every case; `format_peer_ratios` prints
graphidx / peer. The step (`graphidx bench --step --peers`):
the V3.2 decode layer from the peers: DeepGEMM's `get_paged_mqa_logits_metadata` +
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

from graphidx.bench.step import STEP_BATCHES, median_ms, replay_activities, short_name
from graphidx.config import cdiv
from graphidx.ops.backend import FP8_LOGIT_BOUND

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
    context: int,
    batches: tuple[int, ...] = STEP_BATCHES,
    num_heads: int = 64,
    next_n: int = 2,
    model_len: int | None = None,
) -> dict[tuple[int, int], tuple[float, float]]:
    """(context, batch) -> (step ms, graph ms) of the peer V3.2 decode layer; its logits rows
    `model_len` wide rounded up to whole pages (None: the context's pages)."""
    import deep_gemm
    import flashinfer.topk as flashinfer_topk

    # In a graph FlashInfer otherwise picks CUB's top-k for long rows.
    os.environ.setdefault("FLASHINFER_TOPK_ALGO", "default")
    sms = deep_gemm.get_num_sms()
    rows: dict[tuple[int, int], tuple[float, float]] = {}
    for batch in batches:
        rows[(context, batch)] = _peer_batch(
            deep_gemm, flashinfer_topk, sms, context, batch, num_heads, next_n, model_len
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
    model_len: int | None,
) -> tuple[float, float]:
    """(step ms, graph ms) of the peer layer at one batch."""
    device = torch.device("cuda")
    pages = cdiv(context, PEER_BLOCK)
    width = max(cdiv(model_len or 0, PEER_BLOCK), pages) * PEER_BLOCK
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
            q, cache, weights, lens, table, schedule, width, False
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

    for kernel, start, us in replay_activities(graph.replay):
        print(f"      at {start:7.1f} us: {us:8.1f} us  {short_name(kernel)}", flush=True)
    return median_ms(step, False), median_ms(graph.replay, True)


# ---------------------------------------------------------------------------------------
# Kernel peers: each graphidx logits / top-k case beside the peer kernel of the same work.
# ---------------------------------------------------------------------------------------

PEER_ENTRY_BYTES = HEAD_DIM + 4
"""An FP8 key of DeepGEMM's caches: D e4m3 bytes and one fp32 scale."""


def _fp8_keys(count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 keys `[count, D]`, fp32 scale per key) of Gaussian keys."""
    keys = torch.randn(count, HEAD_DIM, device=device)
    scale = keys.abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / 448.0
    return (keys / scale).to(torch.float8_e4m3fn), scale.squeeze(1).contiguous()


def _float64_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`sum_h w[r, h] relu(q[r, h] . k)` in float64: q `[R, H, D]`, keys `[T, D]` -> `[R, T]`."""
    scores = torch.einsum("rhd,td->rht", q.double(), keys.double()).relu_()
    return torch.einsum("rh,rht->rt", weights.double(), scores)


def _peer_check(got: torch.Tensor, want: torch.Tensor) -> str:
    """The peer's logits on its visible columns against float64, relative to the row's
    largest |logit| (the figure the fp8 precision is held to)."""
    scale = want.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    err = float(((got.double() - want).abs() / scale).max())
    return "OK" if err <= FP8_LOGIT_BOUND else f"FAIL: error {err:.3g} of the row max"


def deepgemm_decode_case(
    name: str, num_heads: int, next_n: int, seqs: int, context: int, ceilings: Any
) -> Any:
    """DeepGEMM's `fp8_paged_mqa_logits` (its metadata built once, outside the timing) over
    `seqs` requests of `context` keys, next_n rows each, block 64."""
    import deep_gemm

    from graphidx.bench.roofline import timed_result

    device = torch.device("cuda")
    pages = cdiv(context, PEER_BLOCK)
    table = torch.randperm(seqs * pages, device=device).to(torch.int32).view(seqs, pages)
    keys, scales = _fp8_keys(seqs * pages * PEER_BLOCK, device)
    cache = torch.empty(seqs * pages, PEER_BLOCK * PEER_ENTRY_BYTES, dtype=torch.uint8,
                        device=device)  # fmt: skip
    cache[:, : PEER_BLOCK * HEAD_DIM] = keys.view(torch.uint8).view(seqs * pages, -1)
    cache[:, PEER_BLOCK * HEAD_DIM :] = scales.view(seqs * pages, -1).view(torch.uint8)
    cache = cache.view(seqs * pages, PEER_BLOCK, 1, PEER_ENTRY_BYTES)
    q = torch.randn(seqs, next_n, num_heads, HEAD_DIM, device=device).to(torch.float8_e4m3fn)
    weights = torch.rand(seqs * next_n, num_heads, device=device)
    # Per row (request, j): the keys it sees, context - next_n + 1 + j (DeepGEMM's 2-D lengths).
    ends = [[context - next_n + 1 + j for j in range(next_n)] for _ in range(seqs)]
    lens = torch.tensor(ends, dtype=torch.int32, device=device)
    schedule = deep_gemm.get_paged_mqa_logits_metadata(lens, PEER_BLOCK, deep_gemm.get_num_sms())
    width = pages * PEER_BLOCK

    def run() -> torch.Tensor:
        return deep_gemm.fp8_paged_mqa_logits(
            q, cache, weights, lens, table, schedule, width, False
        )

    logits = run()
    torch.cuda.synchronize()
    # Seq 0 against float64 over its keys in page order; row j sees keys < context - next_n + j + 1.
    order = table[0].long()
    blocks = keys.view(seqs * pages, PEER_BLOCK, HEAD_DIM)[order].float()
    blocks = blocks * scales.view(seqs * pages, PEER_BLOCK, 1)[order]
    seq_keys = blocks.reshape(-1, HEAD_DIM)[:context]
    want = _float64_scores(q[0].float(), seq_keys, weights[:next_n])
    visible = context - next_n + 1
    check = _peer_check(logits[:next_n, :visible], want[:, :visible])
    keys_read = seqs * context
    bytes_moved = float(keys_read * PEER_ENTRY_BYTES + seqs * next_n * context * 4)
    flops = 2.0 * seqs * next_n * context * num_heads * HEAD_DIM
    shape = f"H{num_heads} next_n {next_n}, {seqs} seqs, {keys_read} keys, FP8 132 B/key"
    return timed_result(name, shape, run, bytes_moved, flops, ceilings, check, reference=True)


def deepgemm_prefill_case(num_heads: int, rows: int, context: int, ceilings: Any) -> Any:
    """DeepGEMM's `fp8_mqa_logits` over a contiguous K (a paged cache would first be
    gathered), the chunk's rows causal: row r sees keys [0, context - rows + r + 1)."""
    import deep_gemm

    from graphidx.bench.roofline import timed_result

    device = torch.device("cuda")
    keys, scales = _fp8_keys(context, device)
    q = torch.randn(rows, num_heads, HEAD_DIM, device=device).to(torch.float8_e4m3fn)
    weights = torch.rand(rows, num_heads, device=device)
    starts = torch.zeros(rows, dtype=torch.int32, device=device)
    ends = torch.arange(context - rows + 1, context + 1, dtype=torch.int32, device=device)

    def run() -> torch.Tensor:
        return deep_gemm.fp8_mqa_logits(q, (keys, scales), weights, starts, ends, False)

    logits = run()
    torch.cuda.synchronize()
    sample = slice(rows - 8, rows)
    want = _float64_scores(q[sample].float(), keys.float() * scales.unsqueeze(1), weights[sample])
    visible = context - 7  # the sample's first row sees this many keys
    check = _peer_check(logits[sample, :visible], want[:, :visible])
    scored = int((ends - starts).sum())
    bytes_moved = float(context * PEER_ENTRY_BYTES + scored * 4)
    flops = 2.0 * scored * num_heads * HEAD_DIM
    shape = f"H{num_heads}, {rows} rows x {context} keys (causal), FP8, contiguous K"
    return timed_result(
        "DeepGEMM prefill", shape, run, bytes_moved, flops, ceilings, check, reference=True
    )


def flashinfer_topk_case(rows: int, width: int, k: int, ceilings: Any) -> Any:
    """FlashInfer's `top_k` (its default algorithm, as under a graph with
    FLASHINFER_TOPK_ALGO=default) on the top-k case's rows, picks checked."""
    import flashinfer.topk as flashinfer_topk

    from graphidx.bench.checks import check_topk_picks
    from graphidx.bench.roofline import timed_result

    os.environ.setdefault("FLASHINFER_TOPK_ALGO", "default")
    device = torch.device("cuda")
    logits = torch.randn(rows, width, device=device)
    want = torch.topk(logits, k, dim=1).values.sort(dim=1).values

    def run() -> torch.Tensor:
        return flashinfer_topk.top_k(logits, k)[1]

    picks = run()
    torch.cuda.synchronize()
    check = check_topk_picks(logits, picks.to(torch.int32), want)
    bytes_moved = float(rows * width * 4 + rows * k * 4)
    shape = f"{rows} rows x {width} cols, k {k}"
    return timed_result(
        f"FlashInfer top-k {k}", shape, run, bytes_moved, 0.0, ceilings, check, reference=True
    )


PEER_PAIRS = (
    ("dense decode", "H64", "DeepGEMM decode H64"),
    ("dense decode", "H32", "DeepGEMM decode H32"),
    ("prefill chunk", "H64", "DeepGEMM prefill"),
    ("top-k 512", "k 512", "FlashInfer top-k 512"),
    ("top-k 2048", "k 2048", "FlashInfer top-k 2048"),
)
"""(graphidx case name, a word of its shape, peer case name) of the ratio table."""


def peer_kernel_cases(ceilings: Any, device: torch.device) -> list[Any]:
    """The graphidx cases that have a peer (exact and fp8), then the peers' cases."""
    from graphidx.bench.cases import dense_decode_case, prefill_case, topk_cases

    ours = []
    for precision in ("exact", "fp8"):
        ours += [
            dense_decode_case("dense decode", 64, 2, [16384] * 64, 64, ceilings, device,
                              use_schedule=True, precision=precision),
            dense_decode_case("dense decode", 32, 2, [65536] * 64, 128, ceilings, device,
                              use_schedule=True, precision=precision),
            prefill_case(64, 4096, 32768, ceilings, device, precision=precision),
        ]  # fmt: skip
    for k in (512, 2048):
        ours += topk_cases(128, 65536, k, ceilings, device, variants=False)
    peers = [
        _guarded("DeepGEMM decode H64",
                 lambda: deepgemm_decode_case("DeepGEMM decode H64", 64, 2, 64, 16384, ceilings)),
        _guarded("DeepGEMM decode H32",
                 lambda: deepgemm_decode_case("DeepGEMM decode H32", 32, 2, 64, 65536, ceilings)),
        _guarded("DeepGEMM prefill", lambda: deepgemm_prefill_case(64, 4096, 32768, ceilings)),
        _guarded("FlashInfer top-k 512", lambda: flashinfer_topk_case(128, 65536, 512, ceilings)),
        _guarded("FlashInfer top-k 2048",
                 lambda: flashinfer_topk_case(128, 65536, 2048, ceilings)),
    ]  # fmt: skip
    return ours + peers


def _guarded(name: str, build: Any) -> Any:
    """A peer case, or a FAIL row naming the error (a peer's API or build problem must not
    hide the other rows)."""
    from graphidx.bench.roofline import CaseResult

    try:
        return build()
    except Exception as err:  # report and keep going, as the suite does
        return CaseResult(name, "-", 0.0, 0.0, 0.0, 0.0, f"FAIL: {err!r}"[:300], reference=True)
    finally:
        torch.cuda.empty_cache()


def format_peer_ratios(results: list[Any]) -> str:
    """graphidx time / peer time for each pair of PEER_PAIRS found in `results` (replay
    times; the exact and fp8 rows of a logits case each get a line)."""
    lines = [f"{'workload':<28} {'graphidx us':>11} {'peer us':>9} {'graphidx / peer':>15}"]
    for name, word, peer_name in PEER_PAIRS:
        peer = next((r for r in results if r.name == peer_name), None)
        if peer is None or peer.time_us <= 0:
            continue
        for ours in (r for r in results if r.name == name and word in r.shape and not r.variant):
            label = f"{name} {word}" + (" fp8" if ours.shape.endswith("fp8") else "")
            lines.append(
                f"{label:<28} {ours.time_us:11.1f} {peer.time_us:9.1f} "
                f"{ours.time_us / peer.time_us:15.2f}"
            )
    return "\n".join(lines)
