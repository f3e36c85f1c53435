"""`graphidx replay-check`: the replay-correctness harness over several model shapes.

Cases rotate over small runners that between them cover R in {1, 2, 4}, dense and two-level
(candidate) stacks, next_n 2 and 3, and adaptive verification, each in the precisions asked
for (both by default: `exact`, and `fp8` where the runners' backend has fp8 kernels: on a
GPU); each runner captures its
decode ladder first, then `check_replay` runs every case eager-unpadded, eager-padded and
through the normal replay path. Prints `N cases, M mismatches` last.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from capture import CaptureSizes
from graphidx.config import IndexerConfig
from graphidx.distributed import ContextParallel, ContextParallelGroup
from graphidx.ops.backend import default_backend, resolve_precision
from graphidx.runner import IndexerGraphRunner, IndexerStack
from graphidx.testing import (
    ReplayReport,
    StepCase,
    StepGenerator,
    check_replay,
    rank_cache_pages,
    run_gloo_ranks,
    selection_order,
    shard_case,
)


@dataclass(frozen=True)
class HarnessShape:
    name: str
    config: IndexerConfig
    stack: IndexerStack
    max_context: int
    max_capture: int
    """Largest captured token count: below the largest step on purpose for the adaptive
    shape, whose steps above it take their own eager path."""


PRECISION_CHOICES = ("exact", "fp8", "both")


def harness_precisions(choice: str, device: torch.device) -> tuple[str, ...]:
    """The precisions `--precision` asks for on `device`: `both` is exact and fp8 where the
    runners' backend (the device's default) runs fp8 kernels, else exact alone (the
    reference computes fp8 exactly: fp8 runners would repeat the exact ones); an explicit
    `fp8` the device cannot run raises ValueError."""
    if choice not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {PRECISION_CHOICES}, got {choice!r}")
    if choice == "exact":
        return ("exact",)
    backend = default_backend(device)
    try:
        resolve_precision("fp8", backend, device)
    except ValueError:
        if choice == "fp8":
            raise
        return ("exact",)
    if choice == "fp8":
        return ("fp8",)
    return ("exact", "fp8") if backend == "triton" else ("exact",)


def harness_shapes(
    device: torch.device, precisions: tuple[str, ...] = ("exact",)
) -> list[HarnessShape]:
    """Small shapes on a CPU; on a GPU the same structure at the full head counts; each in
    every precision of `precisions` (" fp8" added to the name)."""
    small = device.type != "cuda"
    heads, dim = (8, 64) if small else (64, 128)
    cand_heads = 8 if small else 32
    # The harness proves replay semantics, not speed: GPU shapes keep the real head counts
    # and head_dim but moderate contexts, so a thousand cases fit a few minutes.
    common: dict[str, Any] = dict(
        max_model_len=4096 if small else 16384, max_num_seqs=16 if small else 64
    )
    tokens = 256 if small else 1024
    base = [
        (
            "v41-like R1",
            IndexerConfig.cpu_demo(
                num_heads=cand_heads,
                head_dim=dim,
                max_num_batched_tokens=tokens,
                **common,
            ),
            IndexerStack(candidate_source=True, consumers=2),
            2048 if small else 8192,
        ),
        (
            "v32-like R2 next_n 3",
            IndexerConfig(
                num_heads=heads,
                head_dim=dim,
                compress_ratio=2,
                block_size=64,
                num_speculative_tokens=2,
                topk_tokens=64 if small else 2048,
                max_logits_bytes=2**20 if small else 2**28,
                max_num_batched_tokens=tokens,
                **common,
            ),
            IndexerStack(dense=2),
            2048 if small else 8192,
        ),
        (
            "v41-like R4 adaptive",
            IndexerConfig.cpu_demo(
                num_heads=cand_heads,
                head_dim=dim,
                compress_ratio=4,
                block_size=128,
                adaptive_verification=True,
                max_num_batched_tokens=tokens,
                **common,
            ),
            IndexerStack(candidate_source=True, consumers=1),
            4096 if small else 16384,
        ),
    ]
    return [
        HarnessShape(
            name + ("" if precision == "exact" else f" {precision}"),
            config.replace(precision=precision),
            stack,
            max_context,
            _largest_capture(config),
        )
        for name, config, stack, max_context in base
        for precision in precisions
    ]


def _largest_capture(config: IndexerConfig) -> int:
    """Every uniform step of the shape's batches, up to 64 tokens; under adaptive
    verification half of that, so some steps are above the ladder."""
    tokens = min(64, config.max_num_seqs * config.next_n)
    return tokens // 2 if config.adaptive_verification else tokens


def _progress(done: int, total: int, mismatches: int, start: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    rate = done / max(time.perf_counter() - start, 1e-9)
    sys.stderr.write(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} cases, "
        f"{mismatches} mismatches, {rate:.1f} cases/s"
    )
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def run_replay_check(
    *,
    backend: str,
    cases: int,
    seed: int,
    device: torch.device,
    progress: bool = True,
    print_fn=print,
    precision: str = "both",
    dcp: int = 1,
) -> int:
    """Run `cases` random steps over the harness shapes in `precision` (`harness_precisions`);
    print and return the mismatches. `dcp` W > 1: `run_replay_check_dcp` (W CPU processes,
    gloo, the tape backend, exact precision)."""
    if cases < 1:
        raise ValueError(f"cases must be >= 1, got {cases}")
    if not isinstance(dcp, int) or isinstance(dcp, bool) or dcp < 1:
        raise ValueError(f"dcp must be an int >= 1, got {dcp!r}")
    if dcp > 1:
        if backend != "tape" or device.type != "cpu":
            raise ValueError(
                f"dcp = {dcp} runs CPU processes over gloo: it needs --backend tape on the cpu "
                f"device, got {backend!r} on {device}"
            )
        return run_replay_check_dcp(dcp, cases=cases, seed=seed, print_fn=print_fn)
    if backend == "device" and device.type != "cuda":
        raise ValueError("--backend device needs a CUDA/ROCm GPU (use --backend tape on a CPU)")
    shapes = harness_shapes(device, harness_precisions(precision, device))
    setups = []
    for i, shape in enumerate(shapes):
        gen = StepGenerator(
            shape.config,
            shape.stack,
            num_pages=512,
            device=device,
            seed=seed * 1000 + i,
            max_context=shape.max_context,
        )
        runner = IndexerGraphRunner(
            shape.config,
            shape.stack,
            gen.kv_caches(),
            device,
            graph_backend=backend,
            capture_sizes=CaptureSizes(
                max_size=shape.max_capture, uniform_query_len=shape.config.next_n
            ),
        )
        runner.capture()
        setups.append((shape, gen, runner))
    total = ReplayReport()
    start = time.perf_counter()
    for done in range(cases):
        shape, gen, runner = setups[done % len(setups)]
        report = check_replay(runner, [gen.case(_kind(gen, done))])
        total.cases += report.cases
        total.replayed += report.replayed
        total.by_kind.update({f"{k}": v for k, v in report.by_kind.items()})
        for m in report.mismatches:
            total.mismatches.append(m)
            print_fn(
                f"mismatch in case {done} ({shape.name}, {m.kind}): layer {m.layer} "
                f"row {m.row}: {m.what}"
            )
        if progress:
            _progress(done + 1, cases, len(total.mismatches), start)
    print_fn(total.summary())
    print_fn(f"{total.cases} cases, {len(total.mismatches)} mismatches")
    return len(total.mismatches)


def _kind(gen: StepGenerator, index: int) -> str:
    """Half the cases uniform decode (the replayed path), the rest spread over other kinds."""
    kinds = ("decode", "decode", "ragged", "padded", "mixed", "prefill", "adaptive")
    return kinds[(index // 3) % len(kinds)]


# --- context parallel: W CPU ranks over gloo --------------------------------------------------

DCP_KINDS = ("decode", "decode", "ragged", "padded", "mixed", "prefill", "pad-vllm-zero")
DCP_MAX_CAPTURE = 32


def dcp_shapes(world_size: int) -> list[HarnessShape]:
    """The CPU harness shapes a context-parallel check runs (adaptive verification left out:
    its cases are not sharded), each rank's config of `world_size`, capture ladders up to
    `DCP_MAX_CAPTURE` tokens."""
    shapes = [s for s in harness_shapes(torch.device("cpu")) if not s.config.adaptive_verification]
    return [
        HarnessShape(
            s.name,
            s.config.replace(dcp_world_size=world_size),
            s.stack,
            s.max_context,
            min(s.max_capture, DCP_MAX_CAPTURE),
        )
        for s in shapes
    ]


def _dcp_steps(
    shapes: list[HarnessShape], cases: int, seed: int
) -> tuple[list[list[torch.Tensor]], list[tuple[int, StepCase]]]:
    """Every shape's single-rank caches and the `cases` steps as (shape index, case), drawn
    in one order so that every process draws the same ones."""
    gens = [
        StepGenerator(
            s.config.replace(dcp_world_size=1),
            s.stack,
            num_pages=128,
            seed=seed * 1000 + i,
            max_context=s.max_context,
        )
        for i, s in enumerate(shapes)
    ]
    caches = [g.kv_caches() for g in gens]
    steps = []
    for done in range(cases):
        i = done % len(shapes)
        steps.append((i, gens[i].case(DCP_KINDS[done % len(DCP_KINDS)])))
    return caches, steps


def _dcp_runner(
    shape: HarnessShape, config: IndexerConfig, caches: list[torch.Tensor], dcp: object
) -> IndexerGraphRunner:
    sizes = CaptureSizes(max_size=shape.max_capture, uniform_query_len=config.next_n)
    return IndexerGraphRunner(
        config, shape.stack, caches, "cpu", graph_backend="tape", capture_sizes=sizes,
        dcp=dcp,  # type: ignore[arg-type]
    )  # fmt: skip


def single_rank_answers(world_size: int, cases: int, seed: int) -> list[torch.Tensor]:
    """The W = 1 runner's eager unpadded top-k of every step, in the selection order."""
    shapes = dcp_shapes(world_size)
    caches, steps = _dcp_steps(shapes, cases, seed)
    runners = [
        _dcp_runner(s, s.config.replace(dcp_world_size=1), caches[i], None)
        for i, s in enumerate(shapes)
    ]
    answers = []
    with selection_order():
        for i, case in steps:
            run = runners[i].step(case.reference, case.inputs, pad=False)
            answers.append(run.topk[:, : case.num_real_tokens].clone())
    return answers


def _dcp_rank(
    rank: int, world_size: int, answers: list[torch.Tensor], cases: int, seed: int
) -> ReplayReport:
    """One rank (inside its gloo group): its runners over its shares of the caches, every
    step checked by `check_replay` against the W = 1 `answers`."""
    shapes = dcp_shapes(world_size)
    caches, steps = _dcp_steps(shapes, cases, seed)
    runners, rank_caches = [], []
    for i, s in enumerate(shapes):
        config = s.config.replace(dcp_rank=rank)
        width = caches[i][0].shape[1]
        mine = [torch.zeros(rank_cache_pages(config), width, dtype=torch.uint8) for _ in caches[i]]
        group = ContextParallelGroup(ContextParallel.from_config(config))
        runner = _dcp_runner(s, config, mine, group)
        runner.capture()
        runners.append(runner)
        rank_caches.append(mine)
    total = ReplayReport()
    for index, ((i, case), answer) in enumerate(zip(steps, answers, strict=True)):
        config = shapes[i].config.replace(dcp_rank=rank)
        shard = shard_case(case, config, caches[i], rank_caches[i])
        report = check_replay(runners[i], [shard], expected=[answer])
        total.cases += 1
        total.replayed += report.replayed
        total.by_kind.update(report.by_kind)
        total.mismatches += [dataclasses.replace(m, case=index) for m in report.mismatches]
    return total


def run_replay_check_dcp(
    world_size: int, *, cases: int, seed: int, print_fn=print, timeout_s: float = 1800
) -> int:
    """`replay-check --dcp W`: W CPU processes over gloo (`run_gloo_ranks`), each a rank with
    its runners (tape backend) over its share of the harness shapes' caches; every rank's
    unpadded-eager, padded-eager and replayed top-k of every step compared with the W = 1
    eager answer (in the selection order, computed here in the parent). Prints each mismatch
    with its rank, then `N cases, M mismatches` (N counted once per step); returns the
    mismatches over all ranks."""
    answers = single_rank_answers(world_size, cases, seed)
    reports = run_gloo_ranks(_dcp_rank, world_size, answers, (cases, seed), timeout_s=timeout_s)
    mismatches = 0
    for rank, report in enumerate(reports):
        for m in report.mismatches:
            print_fn(
                f"mismatch on rank {rank} in case {m.case} ({m.kind}): layer {m.layer} "
                f"row {m.row}: {m.what}"
            )
        mismatches += len(report.mismatches)
    print_fn(f"dcp {world_size}: {reports[0].summary()} on rank 0")
    print_fn(f"{cases} cases, {mismatches} mismatches")
    return mismatches
