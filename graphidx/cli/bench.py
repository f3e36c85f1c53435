"""`graphidx bench`: the kernel benchmarks on the GPU, or `--replot` of a saved run.

    graphidx bench [--quick] [--out DIR]        every case; kernels.json + roofline.png in DIR
    graphidx bench --replot KERNELS_JSON [--out DIR]   redraw DIR/roofline.png, no GPU needed
    graphidx bench --peers [--out DIR]          the cases that have a peer, beside DeepGEMM's
        and FlashInfer's kernels (importable), and the ratios; kernels.json in DIR
    graphidx bench --step [--peers] [--quick] [--model-len N] [--out DIR]   the decode step
        per layer kind (launches, bare graph, replayed step); --peers adds DeepGEMM +
        FlashInfer's V3.2 layer; --model-len sizes the logits rows (and the peer's) for a
        model's longest context, as a deployment does; step.json in DIR

Exit status 1 when a case's check failed; 2 for bad arguments (no GPU, a missing or foreign
kernels.json, no matplotlib for --replot, an --out that is a file), before anything runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from graphidx.cli.options import check_output_folder


def run_bench(args: argparse.Namespace) -> int:
    """The command: `args.replot` (a kernels.json path or None), `args.out`, `args.quick`,
    `args.step`, `args.peers`, `args.model_len` (None or an int, only with --step)."""
    out = check_output_folder("--out", args.out)
    model_len = getattr(args, "model_len", None)
    if model_len is not None:
        _check_model_len(model_len, bool(args.step), bool(args.quick))
    if args.replot:
        from graphidx.bench.report import plot_roofline, read_outputs

        try:
            results, ceilings, _ = read_outputs(args.replot)
        except ValueError as error:
            raise ValueError(f"--replot: {error}") from None
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--replot needs matplotlib (pip install '.[plot]')") from None
        out.mkdir(parents=True, exist_ok=True)
        png = out / "roofline.png"
        plot_roofline(results, ceilings, png)
        print(f"wrote {png}")
        return 0
    if not torch.cuda.is_available():
        raise ValueError(
            "the kernel benchmarks need a CUDA/ROCm GPU (--replot redraws a saved run without one)"
        )
    if args.peers:
        _require_peers()
    if args.step:
        return _run_step(out, quick=bool(args.quick), peers=bool(args.peers), model_len=model_len)
    if args.peers:
        return _run_kernel_peers(out)
    from graphidx.bench.suite import run

    results = run(out, quick=bool(args.quick))
    return 1 if any(r.check.startswith("FAIL") for r in results) else 0


def _check_model_len(model_len: int, step: bool, quick: bool) -> None:
    """ValueError unless --model-len comes with --step and covers every context it runs."""
    from graphidx.bench.step import min_model_len

    if not step:
        raise ValueError("--model-len applies to --step only")
    longest = max(_step_contexts(quick))
    least = min_model_len(longest)
    if model_len < least:
        raise ValueError(
            f"--model-len {model_len} must be at least {least} (the longest step context, "
            f"{longest}, + 64)"
        )


def _step_contexts(quick: bool) -> tuple[int, ...]:
    """The contexts `bench --step` runs (--quick: the first only)."""
    from graphidx.bench.step import STEP_CONTEXTS

    return STEP_CONTEXTS[:1] if quick else STEP_CONTEXTS


def _run_step(out: Path, *, quick: bool, peers: bool, model_len: int | None = None) -> int:
    """The step table (`graphidx.bench.step`), and the peers' V3.2 layer beside it; logits
    rows `model_len` wide (None: each context's own)."""
    import dataclasses
    import json

    from graphidx.bench.peers import peer_v32_step
    from graphidx.bench.step import STEP_BATCHES, format_step, measure_step

    contexts = _step_contexts(quick)
    batches = STEP_BATCHES[:2] if quick else STEP_BATCHES
    rows = []
    peer_rows: dict[tuple[int, int], tuple[float, float]] = {}
    for context in contexts:
        for name in ("v32", "v41"):
            rows += measure_step(name, context, batches, model_len)
        if peers:
            peer_rows.update(peer_v32_step(context, batches, model_len=model_len))
    print(format_step(rows, peer_rows))
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": torch.cuda.get_device_name(),
        "model_len": model_len,
        "rows": [dataclasses.asdict(r) for r in rows],
        "peers": [
            {"context": c, "batch": b, "step_ms": s, "graph_ms": g}
            for (c, b), (s, g) in sorted(peer_rows.items())
        ],
    }
    (out / "step.json").write_text(json.dumps(payload, indent=1))
    print(f"wrote {out / 'step.json'}")
    return 0


def _require_peers() -> None:
    from graphidx.bench.peers import peers_available

    if len(peers_available()) < 2:
        raise ValueError(
            f"--peers needs deep_gemm and flashinfer importable, found {peers_available()} "
            "(../shared/peers/README.md says how to build them)"
        )


def _run_kernel_peers(out: Path) -> int:
    """The cases that have a peer and the peers' kernels; the table, the ratios, JSON."""
    from graphidx.bench.peers import format_peer_ratios, peer_kernel_cases
    from graphidx.bench.report import format_table, write_outputs
    from graphidx.bench.roofline import measure_ceilings

    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    torch.manual_seed(0)
    results = peer_kernel_cases(ceilings, device)
    print(format_table(results))
    print(format_peer_ratios(results))
    write_outputs(results, ceilings, out, {"peers": True})
    return 1 if any(r.check.startswith("FAIL") for r in results) else 0
