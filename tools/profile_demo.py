"""H200 script: profile the first steps of `graphidx demo` and print the costliest ops.

    python tools/profile_demo.py [--steps 4]

Runs the GPU demo's serving simulation for `--steps` steps (after capture) under
torch.profiler and prints, per step, its wall time, then the ops and kernels sorted by
device time and by host time.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from graphidx.demo import DemoSettings, ServingSimulation


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    sim = ServingSimulation(DemoSettings.for_device(torch.device("cuda")))
    sim.runner.capture()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for index in range(args.steps):
            start = time.perf_counter()
            row = sim.step(index)
            torch.cuda.synchronize()
            print(f"step {index}: {time.perf_counter() - start:.3f} s  {row}", flush=True)
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(averages.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
