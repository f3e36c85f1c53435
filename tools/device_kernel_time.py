"""H200 script: kernel-only times of bench cases (CUPTI through torch.profiler), beside the
replay times that BENCHMARKS.md reports.

    python tools/device_kernel_time.py [--case topk512 ...] [--reps 20]

Every time in BENCHMARKS.md is one CUDA-graph replay timed with events (`graphidx.bench`
`time_case`), so it carries the fixed cost of a replay (one tiny kernel measures ~4.8 us).
This evaluates the same cases as tools/device_ab.py (its CASES, in this process, with the
graphidx on PYTHONPATH) and, for the launch each case times, also records its kernels: the
launch runs eagerly `reps` times, each after the 256 MB read that empties the L2 (as in
`time_case`); per launch it takes the span from its first kernel's start to its last
kernel's end and the sum of its kernels' durations. Prints, per timed launch (a case may
time several, e.g. `read` one per config, numbered `#i`): its kernels by name, then a table
of replay us, median kernel span us and median kernel sum us.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

AB_PATH = Path(__file__).with_name("device_ab.py")


def _load_ab() -> Any:
    """tools/device_ab.py as a module (its CASES and PRELUDE)."""
    spec = importlib.util.spec_from_file_location("device_ab", AB_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_spans(
    kernels: list[tuple[str, float, float]], per_launch: int, reps: int
) -> list[tuple[float, float]]:
    """(span, sum of durations) of each launch from its kernels `(name, start, end)` in us,
    sorted by start, `per_launch` kernels per launch; ValueError unless there are exactly
    `per_launch * reps` of them."""
    if per_launch < 1 or len(kernels) != per_launch * reps:
        raise ValueError(
            f"expected {reps} launches of {per_launch} kernels, got {len(kernels)} kernels"
        )
    spans = []
    for rep in range(reps):
        group = kernels[rep * per_launch : (rep + 1) * per_launch]
        span = max(end for _, _, end in group) - min(start for _, start, _ in group)
        spans.append((span, sum(end - start for _, start, end in group)))
    return spans


def _device_kernels(run: Callable[[], None]) -> list[tuple[str, float, float]]:
    """The device kernels `run` launches, `(name, start us, end us)` sorted by start."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    found = [
        (event.name, float(event.time_range.start), float(event.time_range.end))
        for event in prof.events()
        if event.device_type == DeviceType.CUDA
    ]
    return sorted(found, key=lambda kernel: kernel[1])


def profile_launch(fn: Callable[[], object], reps: int) -> dict[str, Any]:
    """Kernel span and sum of `fn` over `reps` eager launches, each after the L2 flush."""
    import torch

    import graphidx.bench as bench

    flush, sink = bench._flush_buffers(torch.cuda.current_device())
    fn()
    torch.cuda.synchronize()
    flushed = _device_kernels(lambda: torch.sum(flush, dim=0, out=sink))
    flush_names = {name for name, _, _ in flushed}
    own = _device_kernels(fn)
    if any(name in flush_names for name, _, _ in own):
        raise ValueError(
            "the launch runs the L2 flush's own kernel: its kernels cannot be told apart"
        )
    per_launch = len(own)

    def launches() -> None:
        for _ in range(reps):
            torch.sum(flush, dim=0, out=sink)
            fn()

    kernels = [k for k in _device_kernels(launches) if k[0] not in flush_names]
    spans = launch_spans(kernels, per_launch, reps)
    names: dict[str, list[float]] = {}
    for name, start, end in kernels:
        names.setdefault(name, []).append(end - start)
    return {
        "span_us": statistics.median(span for span, _ in spans),
        "sum_us": statistics.median(total for _, total in spans),
        "kernels": {name[:60]: round(statistics.median(times), 1) for name, times in names.items()},
    }


def main() -> int:
    ab = _load_ab()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(ab.CASES))
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    scope: dict[str, Any] = {}
    exec(ab.PRELUDE, scope)  # the helpers and `scope` of tools/device_ab.py's cases
    import graphidx.bench as bench

    timed = bench.time_case
    launches: list[tuple[float, dict[str, Any]]] = []

    def time_and_profile(fn: Callable[[], object]) -> tuple[float, dict[str, float]]:
        found = profile_launch(fn, args.reps)
        replay = timed(fn)
        launches.append((replay[0], found))
        return replay

    bench.time_case = time_and_profile  # every case times its launches through this name
    rows = []
    for name in args.case or ["topk512", "topk2048", "read", "gather", "decode64"]:
        launches.clear()
        result = eval(ab.CASES[name], scope["scope"])
        for index, (replay_us, found) in enumerate(launches):
            label = name if len(launches) == 1 else f"{name}#{index}"
            rows.append((label, replay_us, found, result.check))
            print(f"{label}: {found['kernels']}", flush=True)
    print(f"\n{'launch':20} {'replay us':>10} {'kernel span us':>15} {'kernel sum us':>14}  check")
    for label, replay_us, found, check in rows:
        print(
            f"{label:20} {replay_us:10.1f} {found['span_us']:15.1f} {found['sum_us']:14.1f}  "
            f"{check}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
