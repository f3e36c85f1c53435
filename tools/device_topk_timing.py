"""H200 script: how stable are the Triton top-k timings on one fixed input?

    python tools/device_topk_timing.py [--repeat 5]

The top-k rows of `graphidx bench` moved by up to 2x between runs on the same seeded input
(BENCHMARKS.md). This times each config `--repeat` times in one process on one input
(triton.testing.do_bench, L2 cleared before each launch) and checks that every run picks the
same columns, so run-to-run noise and data-independent slow paths can be told apart.
"""

from __future__ import annotations

import argparse
import sys

import torch

from graphidx.bench import time_us
from graphidx.ops.kernels import topk as triton_topk

ROWS, WIDTH = 128, 65536


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--once", action="store_true", help="one launch per config, no timing (for ncu)"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    logits = torch.randn(ROWS, WIDTH, device=device)
    lengths = torch.full((ROWS,), WIDTH, dtype=torch.int32, device=device)
    same = True
    for k in (512, 2048):
        configs = {"default": triton_topk.default_config(k, ROWS, WIDTH)}
        for split in (1, 2, 4):
            configs[f"P={split}"] = triton_topk.split_config(k, split)
        for name, config in configs.items():
            out = torch.full((ROWS, k), -1, dtype=torch.int32, device=device)
            picks = []
            times = []
            for _ in range(args.repeat):
                out.fill_(-1)
                triton_topk.topk_per_row(logits, lengths, k, out, config=config)
                picks.append(torch.sort(out, dim=1).values.cpu())
                if args.once:
                    break
                times.append(time_us(
                    lambda out=out, config=config, k=k: triton_topk.topk_per_row(
                        logits, lengths, k, out, config=config
                    )
                ))  # fmt: skip
            stable = all(torch.equal(p, picks[0]) for p in picks)
            same &= stable
            print(
                f"k {k:>4} {name:>8} (P={config.programs_per_row}): "
                + " ".join(f"{t:6.1f}" for t in times)
                + f" us; picks identical across runs: {stable}",
                flush=True,
            )
        if args.once:
            continue
        torch_times = [
            time_us(lambda k=k: torch.topk(logits, k, dim=1)) for _ in range(args.repeat)
        ]
        print(f"k {k:>4} torch.topk: " + " ".join(f"{t:6.1f}" for t in torch_times) + " us")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
