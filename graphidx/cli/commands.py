"""The `graphidx` command's parser and entry point: demo, replay-check, capture, bench.

Each subcommand's module is imported only when it runs. A bad argument or input (a
ValueError) is printed as one line, `graphidx <command>: error: ...`, with exit status 2
(`-v` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib import metadata

from graphidx.cli.options import resolve_device

SUBCOMMANDS = ("demo", "replay-check", "capture", "bench")


def package_version() -> str:
    """The installed distribution's version; `graphidx.__version__` when not installed."""
    try:
        return metadata.version("graphidx")
    except metadata.PackageNotFoundError:
        import graphidx

        return str(getattr(graphidx, "__version__", "unknown"))


def cmd_demo(args: argparse.Namespace) -> int:
    from graphidx.cli.demo import demo_device, run_demo

    device = demo_device(args.device, args.dcp)
    workers = args.warmup_workers
    if workers is not None and workers < 1:
        raise ValueError(f"--warmup-workers must be >= 1, got {workers}")
    ok = run_demo(
        device, seed=args.seed, dcp=args.dcp, num_requests=args.requests, warmup_workers=workers
    )
    return 0 if ok else 1


def cmd_replay_check(args: argparse.Namespace) -> int:
    from graphidx.cli.replay_check import run_replay_check

    mismatches = run_replay_check(
        backend=args.backend,
        cases=args.cases,
        seed=args.seed,
        device=resolve_device(args.device),
        progress=not args.quiet,
        precision=args.precision,
        dcp=args.dcp,
    )
    return 0 if mismatches == 0 else 1


def cmd_capture(args: argparse.Namespace) -> int:
    from graphidx.cli.capture import run_capture_sweep

    return run_capture_sweep(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from graphidx.cli.bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphidx",
        description="Lightning-indexer planning, kernels and FULL-graph replay.",
    )
    parser.add_argument("--version", action="version", version=f"graphidx {package_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="serving simulation: replayed vs eager steps")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--requests",
        type=int,
        default=None,
        metavar="N",
        help="requests to serve (default: 24 on a CPU, 96 on a GPU)",
    )
    demo.add_argument(
        "--dcp",
        type=int,
        default=1,
        metavar="W",
        help="context parallel over W CPU ranks (gloo processes, tape backend): every rank's "
        "top-k of every step against the single-rank answer",
    )
    demo.add_argument(
        "--warmup-workers",
        type=int,
        default=None,
        metavar="N",
        help="processes compiling the warm-up's kernels on a GPU (default: min(8, CPUs); "
        "1: all in this process)",
    )
    demo.set_defaults(func=cmd_demo)

    check = sub.add_parser("replay-check", help="prove replay == eager on random padded steps")
    check.add_argument("--backend", choices=("tape", "device"), default="tape")
    check.add_argument("--cases", type=int, default=100)
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--device", default=None)
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    check.add_argument(
        "--precision",
        choices=("exact", "fp8", "both"),
        default="both",
        help="logits precision of the runners (both: fp8 runners too where fp8 kernels run, "
        "i.e. on a GPU)",
    )
    check.add_argument(
        "--dcp",
        type=int,
        default=1,
        metavar="W",
        help="context parallel over W CPU ranks (gloo processes, tape backend): every rank's "
        "top-k against the single-rank answer",
    )
    check.set_defaults(func=cmd_replay_check)

    cap = sub.add_parser("capture", help="capture sweep: time and memory per size")
    cap.add_argument("--device", default=None)
    cap.add_argument("--preset", choices=("cpu-demo", "v32", "v41-flash"), default=None)
    cap.add_argument("--max-batch", type=int, default=None, help="largest expected batch")
    cap.add_argument("--json", dest="json_path", default=None, help="write a JSON report here")
    cap.set_defaults(func=cmd_capture)

    bench = sub.add_parser("bench", help="kernels against the roofline (GPU)")
    bench.add_argument("--quick", action="store_true", help="1/4 of the keys and rows")
    bench.add_argument("--out", default="graphidx-bench", help="folder for JSON + PNG")
    bench.add_argument(
        "--replot",
        metavar="KERNELS_JSON",
        help="only redraw roofline.png (under --out) from a saved run; runs nothing",
    )
    bench.add_argument(
        "--step",
        action="store_true",
        help="the decode step per layer kind instead of the kernels: launches, graph, step",
    )
    bench.add_argument(
        "--peers",
        action="store_true",
        help="DeepGEMM's and FlashInfer's kernels beside the cases that have a peer, and the "
        "ratios; with --step, their V3.2 layer beside the step (both must be importable)",
    )
    bench.add_argument(
        "--model-len",
        type=int,
        metavar="N",
        help="with --step: logits rows N columns wide (every preset's max_model_len, the "
        "peer's too), as a deployment sizes them for its model's longest context (V3.2: "
        "163840); default: each context + 64",
    )
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except ValueError as error:
        if args.verbose:
            raise
        print(f"graphidx {args.command}: error: {error}", file=sys.stderr)
        return 2
