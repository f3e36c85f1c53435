"""The `graphidx` command: demo, replay-check, capture, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch


def _device(name: str | None) -> torch.device:
    if name:
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit(f"--device {name}: no CUDA/ROCm GPU is available")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cmd_demo(args: argparse.Namespace) -> int:
    from graphidx.demo import run_demo

    ok = run_demo(_device(args.device), seed=args.seed)
    return 0 if ok else 1


def cmd_replay_check(args: argparse.Namespace) -> int:
    from graphidx.replay_check import run_replay_check

    mismatches = run_replay_check(
        backend=args.backend,
        cases=args.cases,
        seed=args.seed,
        device=_device(args.device),
        progress=not args.quiet,
    )
    return 0 if mismatches == 0 else 1


def cmd_capture(args: argparse.Namespace) -> int:
    from graphidx.capture_sweep import run_capture_sweep

    return run_capture_sweep(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from graphidx.bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphidx",
        description="Lightning-indexer planning, kernels and FULL-graph replay.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="serving simulation: replayed vs eager steps")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)

    check = sub.add_parser("replay-check", help="prove replay == eager on random padded steps")
    check.add_argument("--backend", choices=("tape", "device"), default="tape")
    check.add_argument("--cases", type=int, default=100)
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--device", default=None)
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    check.set_defaults(func=cmd_replay_check)

    cap = sub.add_parser("capture", help="capture sweep: time and memory per size")
    cap.add_argument("--device", default=None)
    cap.add_argument("--preset", choices=("cpu-demo", "v32", "v41-flash"), default=None)
    cap.add_argument("--max-batch", type=int, default=None, help="largest expected batch")
    cap.add_argument("--json", dest="json_path", default=None, help="write a JSON report here")
    cap.set_defaults(func=cmd_capture)

    bench = sub.add_parser("bench", help="kernels against the roofline (GPU)")
    bench.add_argument("--quick", action="store_true", help="1/4 of the keys and rows")
    bench.add_argument("--sweep", action="store_true", help="also time tile-config grids")
    bench.add_argument("--out", default="graphidx-bench", help="folder for JSON + PNG")
    bench.add_argument(
        "--replot",
        metavar="KERNELS_JSON",
        help="only redraw roofline.png (under --out) from a saved run; runs nothing",
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
        # Bad arguments or input: one clear line, not a traceback (-v shows the traceback).
        if args.verbose:
            raise
        print(f"graphidx {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
