"""`graphidx bench`: the kernel benchmarks on the GPU, or `--replot` of a saved run.

    graphidx bench [--quick] [--out DIR]        every case; kernels.json + roofline.png in DIR
    graphidx bench --replot KERNELS_JSON [--out DIR]   redraw DIR/roofline.png, no GPU needed

Exit status 1 when a case's check failed; 2 for bad arguments (no GPU, a missing or foreign
kernels.json, no matplotlib for --replot, an --out that is a file), before anything runs.
"""

from __future__ import annotations

import argparse

import torch

from graphidx.cli.options import check_output_folder


def run_bench(args: argparse.Namespace) -> int:
    """The command: `args.replot` (a kernels.json path or None), `args.out`, `args.quick`."""
    out = check_output_folder("--out", args.out)
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
    from graphidx.bench.suite import run

    results = run(out, quick=bool(args.quick))
    return 1 if any(r.check.startswith("FAIL") for r in results) else 0
