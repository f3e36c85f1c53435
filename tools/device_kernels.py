"""H200 script: check every Triton kernel against the reference at full size and time it.

    python tools/device_kernels.py [--quick] [--sweep | --sweep-only] [--out DIR]

Measures the copy and bf16-matmul ceilings once, then runs the issue-5 cases of
`graphidx.bench` (dense decode H64 / H32, prefill chunk, gather, top-k 512 / 2048 with
torch.topk alongside, skewed vs even decode with the schedule). `--sweep` adds grids of
tile configs (dense decode, prefill, gather) for tuning the defaults. A failing case is
reported as FAIL and the rest still run. Prints the table last; writes kernels.json and
roofline.png under --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graphidx.bench import run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1/4 of the keys and rows")
    parser.add_argument("--sweep", action="store_true", help="also sweep logits tile configs")
    parser.add_argument("--sweep-only", action="store_true", help="the sweep, not the cases")
    parser.add_argument("--out", default="out/device_kernels", help="folder for JSON + PNG")
    args = parser.parse_args()
    results = run(
        Path(args.out),
        quick=args.quick,
        sweep=args.sweep or args.sweep_only,
        cases=not args.sweep_only,
    )
    return 1 if any(r.check.startswith("FAIL") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
