"""Kernel benchmarks against the roofline (`graphidx bench`, tools/device_kernels.py).

Each case builds random inputs at full size on the GPU, checks the Triton kernel against the
torch reference (on a sample of rows where the reference would be slow), times it (`time_case`:
the median of CUDA-graph replays, each started with an L2 holding none of the case's data and
no dirty lines; the notes add the replay's device span without its launch, `kernel_us`, and
the eager do_bench figure of earlier sessions) and compares it with its floor:

    floor = max(bytes / copy bandwidth, flops / bf16 matmul throughput)

where `bytes` counts every input read once plus the output written once (an MXFP4 key is
68 bytes at D = 128, logits are float32, only the visible columns count) and `flops` counts
2 * heads * head_dim per scored (row, key) pair. The ceilings are measured once (a large
device copy, a large bf16 matmul) or taken from ARCHITECTURE.md (4.3 TB/s, 790 TFLOP/s).

A case that raises is reported as FAIL with its error; the others still run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from graphidx.config import cdiv
from graphidx.mxfp4 import cache_layout

NOMINAL_COPY_BYTES_PER_S = 4.3e12
NOMINAL_MATMUL_FLOPS_PER_S = 790e12


@dataclass(frozen=True)
class Ceilings:
    """The device's copy bandwidth and bf16 matmul throughput (nominal, and measured beside
    them), and the time of one tiny kernel under the cases' timing."""

    copy_bytes_per_s: float = NOMINAL_COPY_BYTES_PER_S
    matmul_flops_per_s: float = NOMINAL_MATMUL_FLOPS_PER_S
    measured_copy_bytes_per_s: float | None = None
    measured_matmul_flops_per_s: float | None = None
    measured_tiny_kernel_us: float | None = None
    """One tiny kernel timed like every case (`time_us_graph`): the fixed cost each case's
    time carries (launch, events) and no floor counts (4.6 us on the H200, session 8)."""


@dataclass
class CaseResult:
    """One timed kernel launch and its roofline floor."""

    name: str
    shape: str
    time_us: float
    bytes_moved: float
    flops: float
    floor_us: float
    check: str
    notes: dict[str, Any] = field(default_factory=dict)
    variant: bool = False
    """A sweep point or an alternative config of a case (in the table and the JSON, not in the
    plot)."""
    reference: bool = False
    """A yardstick, not a graphidx op (torch.topk, the bare `one read`): gray in the plot, as
    is any row without a check (files written before this field)."""

    @property
    def tbps(self) -> float:
        return self.bytes_moved / (self.time_us * 1e-6) / 1e12 if self.time_us > 0 else 0.0

    @property
    def tflops(self) -> float:
        return self.flops / (self.time_us * 1e-6) / 1e12 if self.time_us > 0 else 0.0

    @property
    def pct_of_floor(self) -> float:
        """100 = at the floor; 50 = twice the floor."""
        return 100.0 * self.floor_us / self.time_us if self.time_us > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def floor_us(bytes_moved: float, flops: float, ceilings: Ceilings) -> float:
    """max(bytes / bandwidth, flops / matmul throughput), in microseconds."""
    return 1e6 * max(bytes_moved / ceilings.copy_bytes_per_s, flops / ceilings.matmul_flops_per_s)


L2_STATES = ("clean", "dirty")


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
    to 50 MB: on a 33.5 MB read, as much again); earlier figures in BENCHMARKS.md before
    session 4 are all "dirty".
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
    return time_us(_captured(fn).replay, warmup_ms=warmup_ms, rep_ms=rep_ms, l2=l2)


def _captured(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
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
    (`eager_dirty_us`), the method of the figures before session 4."""
    graph = _captured(fn)
    return time_us(graph.replay), {
        "kernel_us": kernel_span_us(graph.replay),
        "eager_dirty_us": round(time_us(fn, l2="dirty"), 1),
    }


KERNEL_REPS = 20
"""Runs whose device spans `kernel_span_us` takes the median of."""


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


def measure_ceilings(device: torch.device) -> Ceilings:
    """The nominal ceilings with measured ones beside them: a 1 GiB device copy (read +
    write), an 8192^3 bf16 matmul, and one tiny kernel (one float incremented) timed as the
    cases are."""
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = time_us(lambda: dst.copy_(src)) * 1e-6
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_s = time_us(lambda: a @ b) * 1e-6
    one = torch.zeros(1, device=device)
    return Ceilings(
        measured_copy_bytes_per_s=2 * size / copy_s,
        measured_matmul_flops_per_s=2 * n**3 / mm_s,
        measured_tiny_kernel_us=time_us_graph(lambda: one.add_(1)),
    )


# ---------------------------------------------------------------------------------------
# Random inputs on the device.
# ---------------------------------------------------------------------------------------

SCALE_LOW, SCALE_HIGH = 120, 134  # e8m0 bytes: 2**-7 .. 2**6, a sane activation range


def random_kv_cache(
    num_pages: int, num_heads: int, head_dim: int, page_entries: int, device: torch.device
) -> torch.Tensor:
    """A cache of random MXFP4 keys: random value bytes, scales in [120, 134)."""
    layout = cache_layout(num_heads, head_dim, page_entries)
    kv = torch.randint(0, 256, (num_pages, layout.page_bytes), dtype=torch.uint8, device=device)
    kv[:, layout.scale_base :] = torch.randint(
        SCALE_LOW, SCALE_HIGH, (num_pages, layout.page_bytes - layout.scale_base),
        dtype=torch.uint8, device=device,
    )  # fmt: skip
    return kv


def random_queries(
    rows: int, num_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 256, (rows, num_heads, head_dim // 2), dtype=torch.uint8, device=device)
    q_scale = torch.randint(
        SCALE_LOW, SCALE_HIGH, (rows, num_heads, head_dim // 32), dtype=torch.uint8, device=device
    )
    weights = torch.randn(rows, num_heads, device=device)
    return q, q_scale, weights


def random_block_table(
    contexts: list[int], page_entries: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """Every seq's pages, shuffled over the cache (pages are never adjacent in order)."""
    pages = [cdiv(c, page_entries) for c in contexts]
    total = sum(pages)
    order = torch.randperm(total, device=device).to(torch.int32)
    table = torch.zeros((len(contexts), max(pages, default=1)), dtype=torch.int32, device=device)
    start = 0
    for s, count in enumerate(pages):
        table[s, :count] = order[start : start + count]
        start += count
    return table, total


def compare(got: torch.Tensor, want: torch.Tensor) -> str:
    """'OK' or 'FAIL: ...' for float32 logits (NaN pattern equal, values to fp32 order)."""
    if not torch.equal(got.isnan(), want.isnan()):
        return f"FAIL: {int((got.isnan() != want.isnan()).sum())} written/NaN columns differ"
    if not torch.equal(got.isinf(), want.isinf()):
        return "FAIL: inf columns differ"
    finite = want.isfinite()
    if not bool(finite.any()):
        return "OK"
    scale = float(want[finite].abs().max())
    err = float((got[finite].double() - want[finite].double()).abs().max())
    bound = 1e-5 * max(scale, 1.0)
    return "OK" if err <= bound else f"FAIL: max error {err:.3g} > {bound:.3g}"


# ---------------------------------------------------------------------------------------
# Cases.
# ---------------------------------------------------------------------------------------

HEAD_DIM = 128
CHECK_SEQS = 4


def _logits_bytes_flops(
    row_lens: list[int], seq_keys: int, rows: int, num_heads: int
) -> tuple[float, float]:
    entry_bytes = HEAD_DIM // 2 + HEAD_DIM // 32
    written = sum(row_lens)
    bytes_moved = (
        seq_keys * entry_bytes  # K read once
        + rows * num_heads * (HEAD_DIM // 2 + HEAD_DIM // 32 + 4)  # q, q_scale, weights
        + written * 4  # logits
    )
    flops = 2.0 * written * num_heads * HEAD_DIM
    return float(bytes_moved), flops


def dense_decode_case(
    name: str,
    num_heads: int,
    next_n: int,
    contexts: list[int],
    page_entries: int,
    ceilings: Ceilings,
    device: torch.device,
    *,
    use_schedule: bool = False,
    config: object | None = None,
) -> CaseResult:
    from graphidx.ops import paged_mqa_logits
    from graphidx.ops.kernels import logits as triton_logits
    from graphidx.ops.schedule import allocate_schedule, build_decode_schedule

    seqs = len(contexts)
    rows = seqs * next_n
    width = max(contexts)
    table, pages = random_block_table(contexts, page_entries, device)
    kv = random_kv_cache(pages, num_heads, HEAD_DIM, page_entries, device)
    q, q_scale, weights = random_queries(rows, num_heads, HEAD_DIM, device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    ends = [c - (next_n - 1 - j) for c in contexts for j in range(next_n)]
    row_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    out = torch.full((rows, width), float("nan"), device=device)
    schedule = None
    notes: dict[str, Any] = {}
    if use_schedule:
        schedule = allocate_schedule(seqs, width, device)
        build_decode_schedule(row_ends, schedule, next_n=next_n, backend="triton")
        notes["schedule_items"] = int(schedule[0])
        notes["schedule_build_us"] = round(
            time_us(
                lambda: build_decode_schedule(row_ends, schedule, next_n=next_n, backend="triton")
            ),
            2,
        )

    def run() -> None:
        triton_logits.paged_mqa_logits(
            q, q_scale, kv, weights, context_lens, table, row_ends, out,
            next_n=next_n, schedule=schedule, page_entries=page_entries,
            config=config,  # type: ignore[arg-type]
        )  # fmt: skip

    run()
    _sync(device)
    sample = slice(0, min(CHECK_SEQS, seqs) * next_n)
    want = torch.full((sample.stop, width), float("nan"), device=device)
    paged_mqa_logits(
        q[sample], q_scale[sample], kv, weights[sample], context_lens[: sample.stop // next_n],
        table[: sample.stop // next_n], row_ends[sample], want,
        next_n=next_n, page_entries=page_entries, backend="reference",
    )  # fmt: skip
    check = compare(out[sample], want)
    elapsed, timing = time_case(run)
    notes.update(timing)
    row_lens = [max(0, min(end, contexts[r // next_n])) for r, end in enumerate(ends)]
    bytes_moved, flops = _logits_bytes_flops(row_lens, sum(contexts), rows, num_heads)
    shape = f"H{num_heads} next_n {next_n}, {seqs} seqs, {sum(contexts)} keys"
    return CaseResult(
        name, shape, elapsed, bytes_moved, flops, floor_us(bytes_moved, flops, ceilings), check,
        notes,
    )  # fmt: skip


def prefill_case(
    num_heads: int,
    rows: int,
    context: int,
    ceilings: Ceilings,
    device: torch.device,
    *,
    name: str = "prefill chunk",
    config: object | None = None,
) -> CaseResult:
    from graphidx.ops import paged_mqa_logits
    from graphidx.ops.kernels import logits as triton_logits

    page_entries = 64
    table, pages = random_block_table([context], page_entries, device)
    kv = random_kv_cache(pages, num_heads, HEAD_DIM, page_entries, device)
    q, q_scale, weights = random_queries(rows, num_heads, HEAD_DIM, device)
    context_lens = torch.tensor([context], dtype=torch.int32, device=device)
    # The chunk's rows are the last `rows` tokens of the request (causal ends).
    ends = [context - rows + r + 1 for r in range(rows)]
    row_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, rows], dtype=torch.int32, device=device)
    out = torch.empty((rows, context), device=device)

    def run() -> None:
        triton_logits.paged_mqa_logits(
            q, q_scale, kv, weights, context_lens, table, row_ends, out,
            query_start_loc=qsl, page_entries=page_entries,
            config=config,  # type: ignore[arg-type]
        )  # fmt: skip

    out.fill_(float("nan"))
    run()
    _sync(device)
    checks = []
    for first in (0, rows - 8):
        part = slice(first, first + 8)
        want = torch.full((8, context), float("nan"), device=device)
        paged_mqa_logits(
            q[part], q_scale[part], kv, weights[part], context_lens, table, row_ends[part], want,
            query_start_loc=torch.tensor([0, 8], dtype=torch.int32, device=device),
            page_entries=page_entries, backend="reference",
        )  # fmt: skip
        checks.append(compare(out[part], want))
    check = next((c for c in checks if c != "OK"), "OK")
    elapsed, timing = time_case(run)
    bytes_moved, flops = _logits_bytes_flops(ends, context, rows, num_heads)
    shape = f"H{num_heads}, {rows} rows x {context} keys (causal)"
    return CaseResult(
        name, shape, elapsed, bytes_moved, flops, floor_us(bytes_moved, flops, ceilings), check,
        timing,
    )  # fmt: skip


def gather_case(
    num_heads: int,
    next_n: int,
    seqs: int,
    context: int,
    pool_blocks: int,
    block_size: int,
    ceilings: Ceilings,
    device: torch.device,
    *,
    name: str = "gather",
    config: object | None = None,
) -> CaseResult:
    from graphidx.ops import gather_mqa_logits, resolve_candidate_pool
    from graphidx.ops.kernels import gather as triton_gather

    page_entries = 128
    rows = seqs * next_n
    contexts = [context] * seqs
    table, pages = random_block_table(contexts, page_entries, device)
    kv = random_kv_cache(pages, num_heads, HEAD_DIM, page_entries, device)
    q, q_scale, weights = random_queries(rows, num_heads, HEAD_DIM, device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    row_ends = torch.tensor(
        [context - (next_n - 1 - j) for _ in range(seqs) for j in range(next_n)],
        dtype=torch.int32, device=device,
    )  # fmt: skip
    blocks = cdiv(context, block_size)
    block_ids = torch.argsort(torch.rand(rows, blocks, device=device), dim=1)[:, :pool_blocks]
    positions = torch.empty((rows, pool_blocks), dtype=torch.int32, device=device)
    live = torch.empty(rows, dtype=torch.int32, device=device)
    resolve_candidate_pool(
        block_ids.to(torch.int32), row_ends, block_size, positions, live, backend="triton"
    )
    width = pool_blocks * block_size
    out = torch.full((rows, width), float("nan"), device=device)

    def launch(backend: str, seq_count: int, target: torch.Tensor) -> None:
        part = slice(0, seq_count * next_n)
        gather_mqa_logits(
            q[part], q_scale[part], kv, weights[part], context_lens[:seq_count],
            table[:seq_count], positions[part], live[part], target,
            candidate_block_size=block_size, next_n=next_n, page_entries=page_entries,
            backend=backend,
        )  # fmt: skip

    def run() -> None:
        triton_gather.gather_mqa_logits(
            q, q_scale, kv, weights, context_lens, table, positions, live, out,
            candidate_block_size=block_size, next_n=next_n, page_entries=page_entries,
            config=config,  # type: ignore[arg-type]
        )  # fmt: skip

    run()
    _sync(device)
    want = torch.full((CHECK_SEQS * next_n, width), float("nan"), device=device)
    launch("reference", CHECK_SEQS, want)
    check = compare(out[: CHECK_SEQS * next_n], want)
    elapsed, timing = time_case(run)
    entry_bytes = HEAD_DIM // 2 + HEAD_DIM // 32
    scored = rows * width
    bytes_moved = float(
        scored * entry_bytes  # every gathered key read once per row
        + rows * pool_blocks * 4  # positions
        + rows * num_heads * (entry_bytes + 4)
        + scored * 4
    )
    flops = 2.0 * scored * num_heads * HEAD_DIM
    shape = f"H{num_heads}, {rows} rows x {width} cols (C={block_size}), context {context}"
    return CaseResult(
        name, shape, elapsed, bytes_moved, flops, floor_us(bytes_moved, flops, ceilings), check,
        timing,
    )  # fmt: skip


TOPK_SPLITS = (1, 2, 4, 8, 16)
"""Programs per row the top-k case also times besides the default config's."""
TOPK_MAX_REGISTERS = 80
"""The register cap the top-k case also times (3 programs of 8 warps per multiprocessor)."""


READ_CONFIGS = ((4096, 4, 8), (4096, 8, 8), (8192, 4, 16), (2048, 16, 4))
"""(elements per step, steps per program, warps) tried by `logits_read_case`."""


def logits_read_case(rows: int, width: int, ceilings: Ceilings, device: torch.device) -> CaseResult:
    """`one read`: the fastest of READ_CONFIGS of a Triton pass that reads `rows x width`
    float32 once (a max per program, a few KB written), timed like every case: the measured
    "one read of the logits" beside the nominal one (bytes / copy bandwidth), with the same
    fixed cost per replay in it as the top-k's own time; its `kernel_us` is the shortest
    device span of the configs. Each config's partial maxima are checked against torch's."""
    from graphidx.ops.kernels.read import read_max_kernel

    logits = torch.randn(rows, width, device=device)
    n = logits.numel()
    times: dict[str, float] = {}
    kernels: dict[str, float | str] = {}
    check = "OK"
    for block, steps, warps in READ_CONFIGS:
        partial = torch.full((cdiv(n, block * steps),), float("nan"), device=device)

        def run(
            partial: torch.Tensor = partial,
            block: int = block,
            steps: int = steps,
            warps: int = warps,
        ) -> None:
            read_max_kernel[(partial.numel(),)](logits, partial, n, BLOCK=block, STEPS=steps,
                                                 num_warps=warps)  # fmt: skip

        run()
        _sync(device)
        padded = torch.full((partial.numel() * block * steps,), float("-inf"), device=device)
        padded[:n] = logits.flatten()
        if not torch.equal(partial, padded.view(partial.numel(), -1).amax(dim=1)):
            check = f"FAIL: wrong maxima at {block} x {steps}"
        label = f"{block}x{steps} w{warps}"
        elapsed, timing = time_case(run)
        times[label], kernels[label] = round(elapsed, 1), timing["kernel_us"]
    bytes_moved = float(n * 4)
    spans = [span for span in kernels.values() if isinstance(span, float)]
    return CaseResult(
        "one read", f"{rows} rows x {width} cols float32", min(times.values()), bytes_moved,
        0.0, floor_us(bytes_moved, 0.0, ceilings), check,
        {"kernel_us": min(spans) if spans else next(iter(kernels.values())),
         "configs_us": times, "configs_kernel_us": kernels},
        reference=True,
    )  # fmt: skip


def topk_cases(
    rows: int,
    width: int,
    k: int,
    ceilings: Ceilings,
    device: torch.device,
    measured_read: CaseResult | None = None,
) -> list[CaseResult]:
    """Rows: `top-k {k}` (the default config, through the op); `top-k {k} P={p}` for each
    other P in TOPK_SPLITS (`split_config(k, P)`); `top-k {k} P={default P} warps={w}` (the
    default config with 8 warps, or 4 when it has 8, the same columns per thread) and
    `... maxnreg=80` (with the register cap TOPK_MAX_REGISTERS); `torch.topk {k}`. Each
    top-k row notes its time in reads of the logits: replay time over the nominal read
    (`x_one_read`, bytes / copy bandwidth) and, given `measured_read` (`logits_read_case`),
    over the measured read's (`x_measured_read`); device spans (`kernel_us`) over the nominal
    read (`x_kernel_one_read`) and over the measured read's span (`x_kernel_read`)."""
    from graphidx.ops import topk_per_row
    from graphidx.ops.kernels import topk as triton_topk

    logits = torch.randn(rows, width, device=device)
    lengths = torch.full((rows,), width, dtype=torch.int32, device=device)
    want_values = torch.topk(logits, k, dim=1).values.sort(dim=1).values
    bytes_moved = float(rows * width * 4 + rows * k * 4)
    read_us = 1e6 * rows * width * 4 / ceilings.copy_bytes_per_s
    shape = f"{rows} rows x {width} cols, k {k}"
    torch_us, torch_timing = time_case(lambda: torch.topk(logits, k, dim=1))
    default = triton_topk.default_config(k, rows, width)

    def case(name: str, run: Callable[[torch.Tensor], None], config: Any) -> CaseResult:
        out = torch.full((rows, k), -7, dtype=torch.int32, device=device)
        run(out)
        _sync(device)
        got_values = logits.gather(1, out.clamp(min=0).long()).sort(dim=1).values
        distinct = all(len(set(r)) == k for r in out[:8].tolist())
        check = "OK" if torch.equal(got_values, want_values) and distinct else "FAIL: wrong picks"
        elapsed, timing = time_case(lambda: run(out))
        return CaseResult(
            name, shape, elapsed, bytes_moved, 0.0, floor_us(bytes_moved, 0.0, ceilings), check,
            {**timing, "vs_torch_topk": round(torch_us / elapsed, 2),
             **read_multiples(elapsed, timing["kernel_us"], read_us, measured_read),
             "config": f"P={config.programs_per_row} groups={config.groups} "
                       f"cap={config.capacity} warps={config.num_warps} chunk={config.chunk} "
                       f"maxnreg={config.max_registers}"},
        )  # fmt: skip

    results = [
        case(f"top-k {k}", lambda out: topk_per_row(logits, lengths, k, out, backend="triton"),
             default),
    ]  # fmt: skip
    for split in TOPK_SPLITS:
        if split == default.programs_per_row:
            continue
        config = triton_topk.split_config(k, split)
        label = f"top-k {k} P={split}"

        def run(out: torch.Tensor, config: Any = config) -> None:
            triton_topk.topk_per_row(logits, lengths, k, out, config=config)

        results.append(_sweep_point(label, functools.partial(case, label, run, config)))
    warps = 8 if default.num_warps != 8 else 4  # another warp count, at the default P
    variants = {
        f"warps={warps}": replace(
            default, num_warps=warps, chunk=default.chunk * warps // default.num_warps
        ),
        f"maxnreg={TOPK_MAX_REGISTERS}": replace(default, max_registers=TOPK_MAX_REGISTERS),
    }
    for suffix, config in variants.items():
        label = f"top-k {k} P={default.programs_per_row} {suffix}"

        def run_variant(out: torch.Tensor, config: Any = config) -> None:
            triton_topk.topk_per_row(logits, lengths, k, out, config=config)

        results.append(_sweep_point(label, functools.partial(case, label, run_variant, config)))
    results.append(
        CaseResult(
            f"torch.topk {k}", shape, torch_us, bytes_moved, 0.0,
            floor_us(bytes_moved, 0.0, ceilings), "-", torch_timing, reference=True,
        )
    )  # fmt: skip
    return results


def read_multiples(
    replay: float, kernel: float | str, nominal_read: float, measured_read: CaseResult | None
) -> dict[str, float]:
    """A top-k's `replay` time and device span `kernel` (us) in reads of its logits, for
    `topk_cases`' notes; the kernel ones only where both spans are numbers."""
    found = {"x_one_read": round(replay / nominal_read, 2)}
    if isinstance(kernel, float):
        found["x_kernel_one_read"] = round(kernel / nominal_read, 2)
    if measured_read is not None:
        found["x_measured_read"] = round(replay / measured_read.time_us, 2)
        read_kernel = measured_read.notes.get("kernel_us")
        if isinstance(kernel, float) and isinstance(read_kernel, float):
            found["x_kernel_read"] = round(kernel / read_kernel, 2)
    return found


def skewed_decode_cases(
    ceilings: Ceilings, device: torch.device, *, scale: int = 1
) -> list[CaseResult]:
    """One 128K-key request + 63 of 1K vs the same keys spread evenly (64 heads, next_n 2)."""
    long_keys, short_keys, seqs = 131072 // scale, 1024 // scale, 64
    skewed = [long_keys] + [short_keys] * (seqs - 1)
    even = [sum(skewed) // seqs] * seqs
    results = [
        dense_decode_case("decode skewed (schedule)", 64, 2, skewed, 64, ceilings, device,
                          use_schedule=True),
        dense_decode_case("decode even (schedule)", 64, 2, even, 64, ceilings, device,
                          use_schedule=True),
        dense_decode_case("decode skewed (static)", 64, 2, skewed, 64, ceilings, device),
    ]  # fmt: skip
    results[0].notes["vs_even"] = round(results[0].time_us / results[1].time_us, 2)
    return results


def _sweep_point(label: str, build: Callable[[], CaseResult]) -> CaseResult:
    """`build()` marked as a variant; a config that cannot compile or run is a FAIL row."""
    try:
        result = build()
    except Exception as err:  # a config that cannot compile or run is a data point
        result = CaseResult(label, "-", 0.0, 0.0, 0.0, 0.0, f"FAIL: {err!r}"[:200])
    result.variant = True
    return result


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
            results.append(_sweep_point(label, build))
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
        results.append(_sweep_point(label, build))
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
        results.append(_sweep_point(label, build))
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
        results.append(_sweep_point(label, build))
    return results


def run_benchmarks(
    device: torch.device, *, quick: bool = False, ceilings: Ceilings | None = None
) -> list[CaseResult]:
    """Every issue-5 case (quick: 1/4 of the keys and rows); a failing case becomes FAIL."""
    ceilings = ceilings or Ceilings()
    div = 4 if quick else 1
    cases: list[tuple[str, Callable[[], list[CaseResult]]]] = [
        ("dense decode H64", lambda: [dense_decode_case(
            "dense decode", 64, 2, [16384 // div] * 64, 64, ceilings, device)]),
        ("dense decode H32", lambda: [dense_decode_case(
            "dense decode", 32, 2, [65536 // div] * 64, 128, ceilings, device)]),
        ("prefill", lambda: [prefill_case(64, 4096 // div, 32768 // div, ceilings, device)]),
        ("gather", lambda: [gather_case(32, 2, 64, 65536 // div, 2048, 8, ceilings, device)]),
        ("one read", lambda: [logits_read_case(128, 65536, ceilings, device)]),
        ("top-k 512", lambda: topk_cases(128, 65536, 512, ceilings, device, one_read())),
        ("top-k 2048", lambda: topk_cases(128, 65536, 2048, ceilings, device, one_read())),
        ("skewed decode", lambda: skewed_decode_cases(ceilings, device, scale=div)),
    ]  # fmt: skip
    results: list[CaseResult] = []

    def one_read() -> CaseResult | None:
        """The measured `one read` case, if it ran and passed."""
        found = [r for r in results if r.name == "one read" and r.check == "OK"]
        return found[0] if found else None

    for label, build in cases:
        started = time.time()
        try:
            results.extend(build())
        except Exception as err:  # report and keep going: one broken case must not hide others
            trace = traceback.format_exc(limit=3).strip().splitlines()[-1]
            results.append(CaseResult(label, "-", 0.0, 0.0, 0.0, 0.0, f"FAIL: {err!r}"[:300],
                                      {"trace": trace}))  # fmt: skip
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"  {label}: {time.time() - started:.1f} s", flush=True)
    return results


# ---------------------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------------------


def format_table(results: list[CaseResult]) -> str:
    """One line per case: replay time, device span (`kernel us`, from the notes; `-` where
    not measured), floor, achieved rates and % of floor (from the replay time), check, and
    the other notes."""
    header = (
        f"{'case':<26} {'shape':<52} {'time us':>10} {'kernel us':>10} {'floor us':>9} "
        f"{'TB/s':>6} {'TFLOP/s':>8} {'% floor':>8}  check"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        kernel = r.notes.get("kernel_us")
        span = f"{kernel:>10.1f}" if isinstance(kernel, float) else f"{'-':>10}"
        rest = {key: value for key, value in r.notes.items() if key != "kernel_us"}
        if kernel is not None and not isinstance(kernel, float):
            rest["kernel_us"] = kernel  # why there is no span
        lines.append(
            f"{r.name:<26} {r.shape:<52} {r.time_us:>10.1f} {span} {r.floor_us:>9.1f} "
            f"{r.tbps:>6.2f} {r.tflops:>8.1f} {r.pct_of_floor:>7.0f}%  {r.check}"
            + (f"  {rest}" if rest else "")
        )
    return "\n".join(lines)


def _plot_label(result: CaseResult) -> str:
    """The case name, with the head count when the shape starts with one (`H64 ...`)."""
    head = result.shape.split()[0].rstrip(",") if result.shape.split() else ""
    return f"{result.name} {head}" if head[:1] == "H" and head[1:].isdigit() else result.name


def plot_roofline(results: list[CaseResult], ceilings: Ceilings, path: Path) -> bool:
    """Write a two-panel PNG of the main cases (variants left out): left, achieved TFLOP/s
    against arithmetic intensity under the roofline (cases with FLOPs); right, each case's
    replay time as a multiple of its floor (top-k's floor is one read of the logits), its
    device span (`kernel_us`) a tick on the bar, with the 1.5x and 3x marks of the issue-5
    targets. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bandwidth = ceilings.copy_bytes_per_s
    peak = ceilings.matmul_flops_per_s
    shown = [r for r in results if not r.variant and r.time_us > 0 and r.floor_us > 0]
    fig, (roof, ratio) = plt.subplots(1, 2, figsize=(16, 6.5), width_ratios=(1, 1.1))
    intensities = [10 ** (x / 10) for x in range(-10, 41)]
    roof.plot(intensities, [min(peak, bandwidth * i) / 1e12 for i in intensities], "k-")
    markers = "osD^v<>ph*"
    for index, r in enumerate(x for x in shown if x.flops > 0 and x.bytes_moved > 0):
        label = f"{_plot_label(r)}: {r.pct_of_floor:.0f}% of floor"
        marker = markers[index % len(markers)]
        roof.plot(r.flops / r.bytes_moved, r.tflops, marker, markersize=8, label=label)
    roof.set_xscale("log")
    roof.set_yscale("log")
    roof.set_xlabel("arithmetic intensity (FLOP / byte)")
    roof.set_ylabel("TFLOP/s")
    roof.set_title(f"roofline: {bandwidth / 1e12:.1f} TB/s, {peak / 1e12:.0f} TFLOP/s")
    roof.grid(True, which="both", alpha=0.3)
    roof.legend(fontsize=8, loc="lower right")
    if not shown:  # every case failed, or only sweep points were run
        ratio.text(0.5, 0.5, "no case with a time and a floor", ha="center", va="center")
        ratio.set_axis_off()
        return _save(fig, path)
    labels = [_plot_label(r) for r in shown]
    multiples = [r.time_us / r.floor_us for r in shown]
    colors = ["0.6" if r.reference or r.check == "-" else "tab:blue" for r in shown]
    rows = range(len(shown))
    ratio.barh(rows, multiples, color=colors)
    for row, r, multiple in zip(rows, shown, multiples, strict=True):
        kernel = r.notes.get("kernel_us")
        text = f" {r.time_us:.1f} us ({multiple:.2f}x)"
        if isinstance(kernel, float) and kernel > 0:  # the device span: a black tick
            ratio.plot([kernel / r.floor_us] * 2, [row - 0.4, row + 0.4], "k-", linewidth=2)
            text += f", kernel {kernel:.1f} us ({kernel / r.floor_us:.2f}x)"
        if math.log(multiple) > 0.45 * math.log(1.6 * max(multiples)):  # most of the log
            # axis: the label inside the bar, at its root
            ratio.text(1.02, row, text, va="center", fontsize=8, color="white")
        else:
            ratio.text(multiple, row, text, va="center", fontsize=8)
    for mark in (1.5, 3.0):
        ratio.axvline(mark, color="tab:red", linestyle="--", linewidth=1)
    ratio.set_yticks(list(rows), labels, fontsize=8)
    ratio.invert_yaxis()
    ratio.set_xscale("log")
    ticks = [t for t in (1, 1.5, 2, 3, 5, 10, 20, 50, 100) if t <= 1.3 * max(multiples)]
    ratio.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ratio.minorticks_off()
    ratio.set_xlim(1, 1.6 * max(multiples))
    ratio.set_xlabel(
        "replay time / floor (black tick: the device span; 1x: at the floor; red: 1.5x and 3x;"
        " gray: not graphidx)"
    )
    ratio.set_title("time against each case's floor")
    ratio.grid(True, axis="x", which="both", alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> bool:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def read_outputs(json_path: Path) -> tuple[list[CaseResult], Ceilings, dict[str, Any]]:
    """(results, ceilings, meta) of a `kernels.json` that `write_outputs` wrote."""
    payload = json.loads(Path(json_path).read_text())
    fields = {f for f in CaseResult.__dataclass_fields__}
    results = [
        CaseResult(**{k: v for k, v in row.items() if k in fields}) for row in payload["results"]
    ]
    # Fields a later version added are left out, so an older checkout reads newer files.
    known = {f for f in Ceilings.__dataclass_fields__}
    ceilings = Ceilings(**{k: v for k, v in payload["ceilings"].items() if k in known})
    return results, ceilings, payload["meta"]


def replot(json_path: Path, png_path: Path) -> bool:
    """Draw `plot_roofline` again from a `kernels.json` (no GPU needed)."""
    results, ceilings, _ = read_outputs(json_path)
    return plot_roofline(results, ceilings, png_path)


def write_outputs(
    results: list[CaseResult], ceilings: Ceilings, out_dir: Path, meta: dict[str, Any]
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "kernels.json"
    payload = {
        "meta": meta,
        "ceilings": asdict(ceilings),
        "results": [
            {**asdict(r), "tbps": r.tbps, "tflops": r.tflops, "pct_of_floor": r.pct_of_floor}
            for r in results
        ],
    }
    json_path.write_text(json.dumps(payload, indent=2, default=str))
    written = [json_path]
    png = out_dir / "roofline.png"
    if plot_roofline(results, ceilings, png):
        written.append(png)
    return written


def run(
    out_dir: Path,
    *,
    quick: bool = False,
    measure: bool = True,
    sweep: bool = False,
    cases: bool = True,
) -> list[CaseResult]:
    """Measure the ceilings, run every case (unless `cases` is false) and the tile sweep (when
    `sweep`), print the table, write JSON + PNG."""
    if not torch.cuda.is_available():
        raise SystemExit("graphidx bench needs a CUDA/ROCm GPU")
    device = torch.device("cuda")
    ceilings = Ceilings()
    if measure:
        ceilings = measure_ceilings(device)
        print(
            f"ceilings: copy {(ceilings.measured_copy_bytes_per_s or 0) / 1e12:.2f} TB/s, "
            f"bf16 matmul {(ceilings.measured_matmul_flops_per_s or 0) / 1e12:.0f} TFLOP/s "
            f"(floors use the nominal {NOMINAL_COPY_BYTES_PER_S / 1e12} TB/s, "
            f"{NOMINAL_MATMUL_FLOPS_PER_S / 1e12:.0f} TFLOP/s); one tiny kernel timed like "
            f"the cases: {ceilings.measured_tiny_kernel_us or 0:.2f} us (in every time, in "
            "no floor)",
            flush=True,
        )
    torch.manual_seed(0)  # the same random inputs every run: timings compare across commits
    results = run_benchmarks(device, quick=quick, ceilings=ceilings) if cases else []
    if sweep:
        results.extend(sweep_tiles(ceilings, device))
    print(format_table(results))
    meta = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "quick": quick,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    for path in write_outputs(results, ceilings, out_dir, meta):
        print(f"wrote {path}")
    return results


def main(args: argparse.Namespace) -> int:
    """Entry point of `graphidx bench` (args.quick, args.sweep, args.out; args.replot: only
    redraw `roofline.png` under args.out from that kernels.json); 1 when a check failed."""
    replot_from = getattr(args, "replot", None)
    if replot_from:
        if not Path(replot_from).is_file():
            raise SystemExit(f"graphidx bench --replot: no such file: {replot_from}")
        png = Path(args.out) / "roofline.png"
        png.parent.mkdir(parents=True, exist_ok=True)
        if not replot(Path(replot_from), png):
            raise SystemExit("graphidx bench --replot needs matplotlib (pip install '.[plot]')")
        print(f"wrote {png}")
        return 0
    results = run(
        Path(args.out),
        quick=bool(getattr(args, "quick", False)),
        sweep=bool(getattr(args, "sweep", False)),
    )
    return 1 if any(r.check.startswith("FAIL") for r in results) else 0


__all__ = [
    "CaseResult",
    "Ceilings",
    "floor_us",
    "format_table",
    "main",
    "measure_ceilings",
    "plot_roofline",
    "read_outputs",
    "replot",
    "run",
    "run_benchmarks",
    "sweep_tiles",
    "time_us",
    "time_us_graph",
    "write_outputs",
]
