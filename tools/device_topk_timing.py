"""H200 script: how stable are the Triton top-k timings on one fixed input?

    python tools/device_topk_timing.py [--repeat 8] [--k 512] [--once]

The top-k rows of `graphidx bench` move by up to 2x between runs on the same seeded input,
and tools/device_spread.py saw one config flip between ~68 and ~140 us within one process,
within one buffer placement, at a steady SM clock (BENCHMARKS.md). This times every config
`--repeat` rounds, the configs interleaved within each round (so a slow period hits all of
them alike), with triton.testing.do_bench (L2 cleared before each launch), and checks that
every run picks the same columns. Prints each config's times in round order, then its
median and best.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

from graphidx.bench import time_us
from graphidx.ops.kernels import topk as triton_topk

ROWS, WIDTH = 128, 65536


def configs_for(k: int) -> dict[str, triton_topk.TopkConfig]:
    """The default, P = 1 / 2 / 4 at their default warps, their 4- or 8-warp variants and an
    80-register variant."""
    configs = {"default": triton_topk.default_config(k, ROWS, WIDTH)}
    for split in (1, 2, 4):
        base = triton_topk.split_config(k, split)
        configs[f"P={split}"] = base
        for warps in (4, 8):
            variant = dataclasses.replace(base, num_warps=warps, chunk=512 * warps)
            if variant != base:
                configs[f"P={split} warps={warps}"] = variant
        configs[f"P={split} maxnreg=80"] = dataclasses.replace(base, max_registers=80)
    return configs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=8, help="rounds over all configs")
    parser.add_argument("--k", type=int, action="append", help="k values (default 512, 2048)")
    parser.add_argument(
        "--once", action="store_true", help="one launch per config, no timing (for ncu)"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    logits = torch.randn(ROWS, WIDTH, device=device)
    lengths = torch.full((ROWS,), WIDTH, dtype=torch.int32, device=device)
    same = True
    for k in args.k or (512, 2048):
        configs = configs_for(k)
        out = torch.full((ROWS, k), -1, dtype=torch.int32, device=device)
        picks: dict[str, list[torch.Tensor]] = {name: [] for name in configs}
        times: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(1 if args.once else args.repeat):
            for name, config in configs.items():
                out.fill_(-1)
                triton_topk.topk_per_row(logits, lengths, k, out, config=config)
                picks[name].append(torch.sort(out, dim=1).values.cpu())
                if not args.once:
                    times[name].append(time_us(
                        lambda config=config, k=k, out=out: triton_topk.topk_per_row(
                            logits, lengths, k, out, config=config
                        )
                    ))  # fmt: skip
        torch_times = [] if args.once else [
            time_us(lambda k=k: torch.topk(logits, k, dim=1)) for _ in range(3)
        ]  # fmt: skip
        for name, config in configs.items():
            stable = all(torch.equal(p, picks[name][0]) for p in picks[name])
            same &= stable
            row = " ".join(f"{t:6.1f}" for t in times[name])
            summary = (
                f" | median {statistics.median(times[name]):6.1f} best {min(times[name]):6.1f}"
                if times[name]
                else ""
            )
            print(
                f"k {k:>4} {name:>16} (P={config.programs_per_row} w{config.num_warps}): "
                f"{row} us{summary}; picks identical: {stable}",
                flush=True,
            )
        if torch_times:
            print(f"k {k:>4} torch.topk: " + " ".join(f"{t:6.1f}" for t in torch_times) + " us")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
