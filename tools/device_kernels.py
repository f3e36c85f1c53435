"""H200 script: check every Triton kernel against the reference at full size and time it.

    python tools/device_kernels.py [--quick] [--sweep | --sweep-only] [--out DIR]

Measures the copy and bf16-matmul ceilings once, then runs the cases of `graphidx.bench`
(dense decode H64 / H32, prefill chunk, gather, top-k 512 / 2048 with torch.topk alongside,
skewed vs even decode with the schedule). `--sweep` adds grids of tile configs (dense decode,
prefill, gather: `sweep_tiles`) for tuning the defaults; `--sweep-only` runs the grids alone.
A failing case is reported as FAIL and the rest still run. Prints the table last; writes
kernels.json and roofline.png under --out.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path
from typing import Any

import torch

from graphidx.bench import (
    CaseResult,
    Ceilings,
    dense_decode_case,
    gather_case,
    prefill_case,
    run,
    variant_point,
)


def _config_label(point: tuple[object, ...]) -> str:
    names = ("n", "r", "w", "s", "reg", "p/SM", "prefetch", "halves", "l2")
    return " ".join(f"{name}{value}" for name, value in zip(names, point, strict=False))


def sweep_tiles(ceilings: Ceilings, device: torch.device) -> list[CaseResult]:
    """Time the logits cases under small grids of tile configs (for tuning the defaults).

    Dense decode (H64 and H32), prefill and gather; every point is checked against the
    reference like the main cases.
    """
    from graphidx.ops.kernels.gather import GatherConfig
    from graphidx.ops.kernels.logits import LogitsConfig

    results = []
    decode_points: dict[int, list[tuple[Any, ...]]] = {
        # heads: LogitsConfig fields (block_n, block_r, num_warps, num_stages, max_registers,
        # programs_per_sm, prefetch, halves, l2_prefetch); the first point of each is the
        # default.
        64: [
            (64, 2, 4, 1, 128, 4, True, True, True),
            (64, 2, 4, 1, 128, 4, True, True, False),
            (64, 2, 4, 1, 128, 4, True, False, True),
        ],
        32: [(64, 2, 4, 1, None, 4, True)],
    }  # fmt: skip
    for heads, contexts, page_entries in ((64, [16384] * 64, 64), (32, [65536] * 64, 128)):
        for point, use_schedule in itertools.product(decode_points[heads], (False, True)):
            how = " (schedule)" if use_schedule else ""
            label = f"sweep decode{how} H{heads} {_config_label(point)}"
            build = functools.partial(
                dense_decode_case, label, heads, 2, contexts, page_entries, ceilings, device,
                use_schedule=use_schedule, config=LogitsConfig(*point),
            )  # fmt: skip
            results.append(variant_point(label, build))
    # The default (the next tile's codes prefetched in registers), the same at a 168-register
    # cap, and without the prefetch (the loop then waits for every load where it is issued).
    prefill_points: tuple[tuple[Any, ...], ...] = (
        (64, 2, 4, 1, None, 4, True), (64, 2, 4, 1, 168, 4, True), (64, 2, 4, 1, None),
    )  # fmt: skip
    for point in prefill_points:
        label = f"sweep prefill {_config_label(point)}"
        build = functools.partial(
            prefill_case, 64, 4096, 32768, ceilings, device, name=label,
            config=LogitsConfig(*point),
        )  # fmt: skip
        results.append(variant_point(label, build))
    skewed = [131072] + [1024] * 63
    even = [sum(skewed) // len(skewed)] * len(skewed)
    for (name, contexts), (programs, halves) in itertools.product(
        (("skewed", skewed), ("even", even)), ((4, True), (4, False), (2, False))
    ):
        point = (64, 2, 4, 1, 128, programs, True, halves, True)
        label = f"sweep decode {name} (schedule) H64 {_config_label(point)}"
        build = functools.partial(
            dense_decode_case, label, 64, 2, contexts, 64, ceilings, device, use_schedule=True,
            config=LogitsConfig(*point),
        )  # fmt: skip
        results.append(variant_point(label, build))
    gather_points = (
        (128, 4, 1, False, 64, 2048), (128, 4, 1, False, 64, 1024), (128, 4, 1, True, 80, 1024),
        (128, 4, 1, True, None, 2048), (128, 4, 1, False, None, 2048),
    )  # fmt: skip
    for point in gather_points:
        block_n, num_warps, num_stages, prefetch, cap, split = point
        label = (
            f"sweep gather n{block_n} w{num_warps} s{num_stages} prefetch{prefetch} "
            f"maxnreg{cap} split{split}"
        )
        build = functools.partial(
            gather_case, 32, 2, 64, 65536, 2048, 8, ceilings, device, name=label,
            config=GatherConfig(*point),
        )  # fmt: skip
        results.append(variant_point(label, build))
    return results


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
        cases=not args.sweep_only,
        extra=sweep_tiles if args.sweep or args.sweep_only else None,
    )
    return 1 if any(r.check.startswith("FAIL") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
