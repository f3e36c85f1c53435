"""How the bench times a kernel: CUDA-graph replays with an emptied L2, and device spans.

`time_case` is what every case reports: the median time of one replay of the case's launches
captured in a CUDA graph, each replay started with an L2 that holds none of the case's data and
no dirty lines (`time_us`), plus two notes: the replay's device span without its launch
(`kernel_us`, from the profiler) and the eager `triton.testing.do_bench` time with its dirty L2
flush (`eager_dirty_us`). Everything here needs a CUDA/ROCm GPU except `launch_spans`.
"""

from __future__ import annotations

import functools
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch

L2_STATES = ("clean", "dirty")

KERNEL_REPS = 20
"""Runs whose device spans `kernel_span_us` takes the median of."""


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _flush_buffers(device: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 256 MB buffer (five times the H200's L2) read before each timed run, and its sum."""
    flush = torch.ones(64 << 20, dtype=torch.float32, device=device)
    return flush, torch.empty((), dtype=torch.float32, device=device)


def time_us(
    fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: int = 100, l2: str = "clean"
) -> float:
    """Median time of `fn` in microseconds, L2 emptied of `fn`'s data before every run.

    l2="clean": a 256 MB buffer is read before each run, so the L2 holds only clean lines
    and the timed kernels move their own bytes and no others. l2="dirty":
    `triton.testing.do_bench`, whose flush zeroes that buffer, leaving the L2 full of dirty
    lines that the timed kernels' misses must first write back (about one extra write of up
    to 50 MB: on a 33.5 MB read, as much again).
    """
    if l2 not in L2_STATES:
        raise ValueError(f"l2 must be one of {L2_STATES}, got {l2!r}")
    import triton.testing

    if l2 == "dirty":
        return 1e3 * float(
            triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        )
    flush, sink = _flush_buffers(torch.cuda.current_device())

    def run_once(start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        torch.sum(flush, dim=0, out=sink)
        start.record()
        fn()
        end.record()

    probe = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    run_once(*probe)  # compile / warm up, then estimate
    torch.cuda.synchronize()
    run_once(*probe)
    torch.cuda.synchronize()
    estimate_ms = max(probe[0].elapsed_time(probe[1]), 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        run_once(*probe)
    events = [
        [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        for _ in range(max(1, int(rep_ms / estimate_ms)))
    ]
    for start, end in events:
        run_once(start, end)
    torch.cuda.synchronize()
    times = torch.tensor([start.elapsed_time(end) for start, end in events])
    return 1e3 * float(torch.median(times))


def time_us_graph(
    fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: int = 100, l2: str = "clean"
) -> float:
    """Median time of one replay of `fn` captured in a CUDA graph, in microseconds (L2 as
    in `time_us`).

    The way graphidx runs its ops, and free of host time: timed eagerly, an op of several
    launches (allocations, a memset, two kernels) is measured from its first launch's start
    to its last's end, so whenever the host takes longer to issue them than the GPU to run
    them, the host's time is in the figure. `fn` runs once eagerly first (compiling).
    """
    return time_us(captured(fn).replay, warmup_ms=warmup_ms, rep_ms=rep_ms, l2=l2)


def captured(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`fn` run once eagerly (compiling), then captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def time_case(fn: Callable[[], object]) -> tuple[float, dict[str, Any]]:
    """(time, notes) of one benchmark case: the time is one CUDA-graph replay with a clean
    L2 (`time_us` of the captured graph's replay), how graphidx runs its ops; the notes keep
    the same replay's device span (`kernel_us`, from `kernel_span_us`: the time without the
    replay's fixed launch cost) and the eager time with do_bench's dirty L2 flush
    (`eager_dirty_us`)."""
    graph = captured(fn)
    return time_us(graph.replay), {
        "kernel_us": kernel_span_us(graph.replay),
        "eager_dirty_us": round(time_us(fn, l2="dirty"), 1),
    }


def kernel_span_us(run: Callable[[], object], reps: int = KERNEL_REPS) -> float | str:
    """Median device span of one `run`, in microseconds: from the start of its first device
    activity (kernel, memset, copy) to the end of its last, as the profiler records them
    (CUPTI / roctracer, graph replays included), each run after the L2 flush of `time_us`.
    Leaves out what a replay's events also time: the launch before the first kernel starts.
    A string saying why when the profiler records none of `run`'s activities, or fails, or
    its records do not add up (the case's replay time stands either way)."""
    flush, sink = _flush_buffers(torch.cuda.current_device())

    def flush_l2() -> None:
        torch.sum(flush, dim=0, out=sink)

    def runs() -> None:
        for _ in range(reps):
            flush_l2()
            run()

    try:
        per_flush, per_run = len(_device_activities(flush_l2)), len(_device_activities(run))
        if per_flush == 0 or per_run == 0:
            return "n/a: the profiler recorded no device activity"
        spans = launch_spans(_device_activities(runs), per_flush, per_run, reps)
    except (RuntimeError, ValueError) as err:
        return f"n/a: {err}"[:200]
    return round(statistics.median(spans), 1)


def launch_spans(
    activities: list[tuple[float, float]], before: int, per_run: int, reps: int
) -> list[float]:
    """The span (last end - first start) of each run's activities, from `(start, end)` pairs
    sorted by start that repeat `reps` times as `before` others (the L2 flush) then `per_run`
    of the run's own. ValueError unless there are exactly that many."""
    group = before + per_run
    if before < 0 or per_run < 1 or reps < 1 or len(activities) != reps * group:
        raise ValueError(
            f"expected {reps} x ({before} + {per_run}) device activities, got {len(activities)}"
        )
    spans = []
    for rep in range(reps):
        own = activities[rep * group + before : (rep + 1) * group]
        spans.append(max(end for _, end in own) - min(start for start, _ in own))
    return spans


def _device_activities(run: Callable[[], object]) -> list[tuple[float, float]]:
    """(start, end) in us of every device activity `run` causes, sorted by start."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        # One profiling cycle, no schedule: torch's note about events cleared between
        # cycles does not apply (its `acc_events` switch is missing from older torch).
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        found = [
            (float(event.time_range.start), float(event.time_range.end))
            for event in prof.events()
            if event.device_type == DeviceType.CUDA
        ]
    return sorted(found)
