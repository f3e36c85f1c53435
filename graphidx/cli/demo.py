"""A small serving simulation: requests arrive, prefill in chunks, decode speculatively, leave.

Every step writes the new tokens' keys into the paged MXFP4 caches, runs every indexer layer
through `IndexerGraphRunner` (replaying a captured graph for uniform decode steps, padded to
the next capture size), and checks the replayed top-k against an eager run of the same step.
On a CPU it runs the `cpu_demo` shape through the tape backend; on a GPU the full
DeepSeek-V4.1-Flash indexer shape through device graphs.

`run_demo(..., dcp=W)` with W > 1 runs it under context parallel on the CPU: W gloo
processes, each a rank running the same simulation over its share of the caches
(docs/contract.md section 10), every step's top-k compared with the single-rank answer.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np
import torch

from graphidx.batch import StepBatch
from graphidx.cli.capture import ProgressBar
from graphidx.cli.options import resolve_device
from graphidx.config import IndexerConfig, cdiv
from graphidx.distributed import ContextParallel, ContextParallelGroup
from graphidx.mxfp4 import cache_layout, compressed_slot_mapping, write_k_cache
from graphidx.runner import IndexerGraphRunner, IndexerStack, LayerInput
from graphidx.testing import (
    StepCase,
    random_kv_cache,
    random_layer_input,
    rank_cache_pages,
    run_gloo_ranks,
    selection_order,
    shard_case,
)
from graphidx.warmup import warmup


@dataclass
class Request:
    prompt_len: int
    output_len: int
    seq_len: int = 0  # tokens whose keys are in the cache
    generated: int = 0
    pages: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.seq_len < self.prompt_len

    @property
    def done(self) -> bool:
        return self.generated >= self.output_len


@dataclass(frozen=True)
class DemoSettings:
    config: IndexerConfig
    stack: IndexerStack
    device: torch.device
    graph_backend: str
    num_requests: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]
    max_running: int
    seed: int = 0

    @classmethod
    def for_device(
        cls, device: torch.device, *, seed: int = 0, num_requests: int | None = None
    ) -> DemoSettings:
        """The CPU shape on a CPU (tape), the full V4.1-Flash shape on a GPU (device).
        `num_requests`: requests to serve (None: 24 on a CPU, 96 on a GPU; ValueError
        below 1)."""
        if num_requests is not None and num_requests < 1:
            raise ValueError(f"--requests must be >= 1, got {num_requests}")
        if device.type == "cuda":
            config = IndexerConfig.deepseek_v41_flash(max_num_seqs=64, max_model_len=131072)
            consumers, backend, default_requests, max_running = 3, "device", 96, 64
            prompt_lens, output_lens = (2048, 65536), (16, 48)
        else:
            config = IndexerConfig.cpu_demo()
            consumers, backend, default_requests, max_running = 2, "tape", 24, 12
            prompt_lens, output_lens = (32, 1024), (8, 24)
        return cls(
            config,
            IndexerStack(candidate_source=True, consumers=consumers),
            device,
            backend,
            num_requests=num_requests if num_requests is not None else default_requests,
            prompt_lens=prompt_lens,
            output_lens=output_lens,
            max_running=max_running,
            seed=seed,
        )

    def random_requests(self, rng: np.random.Generator) -> list[Request]:
        """`num_requests` requests: prompt lengths log-uniform in `prompt_lens`, output
        lengths uniform in `output_lens` (both ends included)."""
        low, high = self.prompt_lens
        return [
            Request(
                int(np.exp(rng.uniform(np.log(low), np.log(high)))),
                int(rng.integers(self.output_lens[0], self.output_lens[1] + 1)),
            )
            for _ in range(self.num_requests)
        ]


@dataclass(frozen=True)
class StepRow:
    step: int
    kind: str
    num_reqs: int
    num_tokens: int
    padded_to: int | None
    mode: str
    millis: float
    eager_millis: float | None
    matches_eager: bool | None
    eager_reason: str | None


@dataclass(frozen=True)
class PlannedStep:
    """One scheduled step, its new keys already in the single-rank caches."""

    index: int
    plan: list[tuple[Request, int]]
    batch: StepBatch
    inputs: tuple[LayerInput, ...]

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens

    @property
    def kind(self) -> str:
        kinds = {"prefill" if r.prefilling else "decode" for r, _ in self.plan}
        return "mixed" if len(kinds) == 2 else kinds.pop()


class ServingSimulation:
    """Drives the runner like a serving loop would, with a page allocator and a scheduler.

    `caches` are the single-rank caches every step writes its keys into; the runner reads
    them (`_make_runner`), or a rank's share of them (`RankSimulation`)."""

    def __init__(self, settings: DemoSettings) -> None:
        self.s = settings
        cfg = settings.config
        self.rng = np.random.default_rng(settings.seed)
        self.gen = torch.Generator().manual_seed(settings.seed)
        self.device_gen = torch.Generator(device=settings.device).manual_seed(settings.seed)
        pages_per_req = cdiv(
            cdiv(settings.prompt_lens[1] + settings.output_lens[1] * cfg.next_n, cfg.block_size)
            * cfg.block_size
            // cfg.compress_ratio,
            cfg.page_entries,
        )
        self.num_pages = settings.max_running * pages_per_req + 1
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        self.layout = cache_layout(cfg.num_heads, cfg.head_dim, cfg.page_entries)
        self.caches = [
            random_kv_cache(cfg, self.num_pages, settings.device, self.gen)
            for _ in range(settings.stack.num_layers)
        ]
        self.runner = self._make_runner()
        self.waiting = settings.random_requests(self.rng)
        self.running: list[Request] = []

    def _make_runner(self) -> IndexerGraphRunner:
        """The single-rank runner over `caches`."""
        s = self.s
        return IndexerGraphRunner(
            s.config, s.stack, self.caches, s.device, graph_backend=s.graph_backend
        )

    # -- scheduling
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.s.max_running:
            self.running.append(self.waiting.pop(0))

    def _schedule(self) -> list[tuple[Request, int]]:
        """Decodes first (next_n rows each), then prefill chunks within the token budget."""
        cfg = self.s.config
        budget = cfg.max_num_batched_tokens
        decodes = [r for r in self.running if not r.prefilling]
        prefills = [r for r in self.running if r.prefilling]
        plan: list[tuple[Request, int]] = []
        for r in decodes:
            if budget >= cfg.next_n:
                plan.append((r, cfg.next_n))
                budget -= cfg.next_n
        for r in prefills:
            if budget <= cfg.next_n:
                break
            left = r.prompt_len - r.seq_len
            take = min(left, budget)
            if take < left and left - take <= cfg.next_n:
                take = left - cfg.next_n - 1  # never leave a remainder a decode would claim
            if take <= cfg.next_n:  # a prefill chunk must be longer than a decode
                continue
            plan.append((r, take))
            budget -= take
        return plan

    def _grow(self, r: Request, new_len: int) -> None:
        cfg = self.s.config
        need = cdiv(new_len // cfg.compress_ratio, cfg.page_entries)
        while len(r.pages) < need:
            r.pages.append(self.free_pages.pop())

    def _write_keys(self, plan: list[tuple[Request, int]], table: torch.Tensor) -> None:
        """Write the keys of this step's new tokens into every layer's cache."""
        cfg, dev = self.s.config, self.s.device
        positions: list[int] = []
        reqs: list[int] = []
        for i, (r, q) in enumerate(plan):
            positions.extend(range(r.seq_len, r.seq_len + q))
            reqs.extend([i] * q)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        req = torch.tensor(reqs, dtype=torch.int64, device=dev)
        slots = compressed_slot_mapping(pos, req, table, cfg.compress_ratio, cfg.page_entries)
        for cache in self.caches:
            keys = torch.randn(len(positions), cfg.head_dim, generator=self.device_gen, device=dev)
            write_k_cache(keys, slots, cache, self.layout)

    def step(self, index: int) -> StepRow | None:
        """Schedule, run and advance step `index`; None when nothing could be scheduled."""
        planned = self._plan(index)
        if planned is None:
            return None
        row = self._execute(planned)
        self._advance(planned.plan)
        return row

    def _plan(self, index: int) -> PlannedStep | None:
        """Admit, schedule, grow pages, write the new keys; the step's batch and inputs."""
        self._admit()
        plan = self._schedule()
        if not plan:
            return None
        cfg, dev = self.s.config, self.s.device
        for r, q in plan:
            self._grow(r, r.seq_len + q)
        width = max(len(r.pages) for r, _ in plan)
        table = torch.zeros(len(plan), width, dtype=torch.int32)
        for i, (r, _) in enumerate(plan):
            table[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        table = table.to(dev)
        self._write_keys(plan, table)
        query_lens = [q for _, q in plan]
        seq_lens = [r.seq_len + q for r, q in plan]
        batch = StepBatch.from_lists(
            cfg, query_lens, seq_lens, table, num_pages=self.num_pages, device=dev
        )
        tokens = sum(query_lens)
        inputs = tuple(
            random_layer_input(cfg, tokens, dev, self.gen) for _ in range(self.s.stack.num_layers)
        )
        return PlannedStep(index, plan, batch, inputs)

    def _runner_batch(self, planned: PlannedStep) -> StepBatch:
        """The step as the runner sees it: the single-rank batch."""
        return planned.batch

    def _check(self, index: int, topk: torch.Tensor) -> None:
        """Called with every top-k a step produces (its real rows), before the next run
        overwrites it; nothing to check on one rank."""

    def _execute(self, planned: PlannedStep) -> StepRow:
        """Run the step (replayed when its padded shape was captured) and, when replayed,
        the same step eagerly and unpadded: the answer the replay must reproduce."""
        batch, inputs = self._runner_batch(planned), planned.inputs
        result = self.runner.step(batch, inputs, synchronize=True)
        self._check(planned.index, result.topk)
        matches: bool | None = None
        eager_ms: float | None = None
        if result.replayed:
            replayed = _sorted_topk(result.topk)
            eager = self.runner.step(batch, inputs, pad=False, synchronize=True)
            self._check(planned.index, eager.topk)
            eager_ms = eager.seconds * 1e3
            matches = bool((_sorted_topk(eager.topk) == replayed).all())
        return StepRow(
            planned.index,
            planned.kind,
            len(planned.plan),
            planned.num_tokens,
            result.shape.num_tokens if result.shape is not None else None,
            "replay" if result.replayed else "eager",
            result.seconds * 1e3,
            eager_ms,
            matches,
            result.eager_reason,
        )

    def _advance(self, plan: list[tuple[Request, int]]) -> None:
        """Accept speculative tokens (1..next_n), finish requests, free their pages."""
        cfg = self.s.config
        for r, q in plan:
            if r.prefilling:
                r.seq_len += q
            else:
                accepted = int(self.rng.integers(1, cfg.next_n + 1))
                r.seq_len += accepted
                r.generated += accepted
            if r.done:
                self.running.remove(r)
                self.free_pages.extend(r.pages)
                r.pages.clear()

    def run(self, on_row: Callable[[StepRow], None], max_steps: int = 10_000) -> list[StepRow]:
        rows = []
        for index in range(max_steps):
            if not self.waiting and not self.running:
                break
            row = self.step(index)
            if row is not None:
                rows.append(row)
                on_row(row)
        return rows


def _sorted_topk(topk: torch.Tensor) -> torch.Tensor:
    """A top-k `[layers, rows, k]` as sets: each row sorted, int64, on the host."""
    return torch.sort(topk.to(torch.int64), dim=-1).values.cpu()


def format_row(row: StepRow) -> str:
    padded = "-" if row.padded_to is None else str(row.padded_to)
    check = {None: "", True: "yes", False: "NO"}[row.matches_eager]
    eager = "" if row.eager_millis is None else f"{row.eager_millis:.2f}"
    return (
        f"{row.step:>5} {row.kind:>8} {row.num_reqs:>5} {row.num_tokens:>7} {padded:>7} "
        f"{row.mode:>7} {row.millis:>9.2f} {eager:>9} {check:>8}"
    )


HEADER = (
    f"{'step':>5} {'kind':>8} {'reqs':>5} {'tokens':>7} {'padded':>7} {'mode':>7} "
    f"{'ms':>9} {'eager ms':>9} {'==eager':>8}"
)


def demo_device(name: str | None, dcp: int) -> torch.device:
    """`--device` and `--dcp` checked together, before any work: W = `dcp` an int >= 1,
    and W > 1 only on the CPU (gloo processes; no `--device` then means the CPU). The
    device resolved as `resolve_device` does; ValueError otherwise."""
    if not isinstance(dcp, int) or isinstance(dcp, bool) or dcp < 1:
        raise ValueError(f"--dcp must be an int >= 1, got {dcp!r}")
    if dcp > 1 and name and name.split(":")[0] != "cpu":
        raise ValueError(
            f"--dcp {dcp} runs CPU processes over gloo: it needs --device cpu, got {name}"
        )
    return resolve_device(name or ("cpu" if dcp > 1 else None))


def run_demo(
    device: torch.device,
    *,
    seed: int = 0,
    print_fn: Callable[[str], None] = print,
    dcp: int = 1,
    num_requests: int | None = None,
    warmup_workers: int | None = None,
) -> bool:
    """Run the simulation, print the per-step table and a summary; True when every replayed
    step matched its eager run. Before the steps: the runner's warm-up (`warmup_workers`:
    its compile pool on a GPU, None for the default; progress bars on stderr), then the
    capture, each timed. `dcp` W > 1: `run_demo_dcp` (CPU only, no warm-up);
    `num_requests`: `DemoSettings.for_device`."""
    settings = DemoSettings.for_device(device, seed=seed, num_requests=num_requests)
    if dcp > 1:
        return run_demo_dcp(settings, dcp, print_fn=print_fn)
    print_fn(_title(settings))
    sim = ServingSimulation(settings)
    report = warmup(sim.runner, workers=warmup_workers, on_progress=PhaseBars(sys.stderr))
    print_fn(report.summary())
    start = time.perf_counter()
    sim.runner.capture(
        on_progress=lambda i, n, shape: (
            print_fn(f"  captured {i}/{n}: {shape.label}") if i == n else None
        )
    )
    capture_s = time.perf_counter() - start
    print_fn(f"captured {len(sim.runner.graphs)} graphs in {capture_s:.2f} s")
    print_fn(HEADER)
    rows = sim.run(lambda row: print_fn(format_row(row)))
    return print_summary(settings, rows, print_fn)


class PhaseBars:
    """A warm-up's `on_progress`: one `ProgressBar` per phase on `stream`, redrawn about
    50 times per phase."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.phase: str | None = None
        self.bar: ProgressBar | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase != self.phase or self.bar is None:
            self.phase, self.bar = phase, ProgressBar(self.stream)
        if done >= total or done % max(1, total // 50) == 0:
            self.bar.update(done, total, f"warm-up {phase}")


def _title(settings: DemoSettings) -> str:
    cfg = settings.config
    return (
        f"graphidx demo on {settings.device} ({settings.graph_backend} graphs): "
        f"{cfg.num_heads} heads x {cfg.head_dim}, R={cfg.compress_ratio}, "
        f"next_n={cfg.next_n}, top-{cfg.topk_tokens}, "
        f"candidate pool {cfg.candidate_topk_blocks} x {cfg.candidate_block_size}, "
        f"layers: 1 source + {settings.stack.consumers} consumers"
    )


def print_summary(
    settings: DemoSettings, rows: list[StepRow], print_fn: Callable[[str], None]
) -> bool:
    """The summary under the table: steps, replayed and eager, their mean times, padding,
    eager reasons, and replay == eager; True when every replayed step matched."""
    replayed = [r for r in rows if r.mode == "replay"]
    eager = [r for r in rows if r.mode == "eager"]
    bad = [r for r in replayed if r.matches_eager is False]
    padding = sum((r.padded_to or r.num_tokens) - r.num_tokens for r in rows)
    reasons = Counter(r.eager_reason for r in eager)

    def mean_ms(values: list[float]) -> str:
        return f"{np.mean(values):.2f} ms" if values else "-"

    print_fn("")
    print_fn(
        f"summary: {len(rows)} steps; {len(replayed)} replayed, mean "
        f"{mean_ms([r.millis for r in replayed])} (the same steps eagerly: "
        f"{mean_ms([r.eager_millis for r in replayed if r.eager_millis is not None])}); "
        f"{len(eager)} eager, mean {mean_ms([r.millis for r in eager])}; "
        f"{padding} padding rows"
    )
    if settings.graph_backend == "tape":
        print_fn("  (tape backend: these timings are not meaningful; only replay == eager is)")
    for reason, count in sorted(reasons.items(), key=lambda kv: str(kv[0])):
        print_fn(f"  eager: {count} x {reason}")
    print_fn(
        f"replay == eager: {len(replayed) - len(bad)}/{len(replayed)} replayed steps"
        + ("" if not bad else f"  MISMATCH in steps {[r.step for r in bad]}")
    )
    return not bad


# --- context parallel: W CPU ranks over gloo --------------------------------------------------


class ReferenceSimulation(ServingSimulation):
    """The single-rank answers: the same simulation (same draws), every step run eagerly
    and unpadded with the layers picking in the selection order (`selection_order`, the
    order a context-parallel merge follows); nothing captured. `answers[step]` is the
    step's top-k as sets (`_sorted_topk`)."""

    def __init__(self, settings: DemoSettings) -> None:
        super().__init__(settings)
        self.answers: dict[int, torch.Tensor] = {}

    def _execute(self, planned: PlannedStep) -> StepRow:
        with selection_order():
            run = self.runner.step(planned.batch, planned.inputs, pad=False)
        self.answers[planned.index] = _sorted_topk(run.topk)
        return StepRow(
            planned.index, planned.kind, len(planned.plan), planned.num_tokens, None,
            "eager", run.seconds * 1e3, None, None, run.eager_reason,
        )  # fmt: skip


class RankSimulation(ServingSimulation):
    """Rank `rank` of `world_size` (inside its gloo group): the same simulation, its runner
    over rank-local caches that every step refills with the rank's share of the single-rank
    caches (`shard_case`), every top-k it produces compared with `answers`."""

    def __init__(
        self,
        settings: DemoSettings,
        rank: int,
        world_size: int,
        answers: dict[int, torch.Tensor],
    ) -> None:
        self.rank_config = settings.config.replace(dcp_world_size=world_size, dcp_rank=rank)
        self.answers = answers
        self.compared: set[int] = set()
        self.mismatched: set[int] = set()
        super().__init__(settings)

    def _make_runner(self) -> IndexerGraphRunner:
        cfg, s = self.rank_config, self.s
        pages, width = rank_cache_pages(cfg), self.caches[0].shape[1]
        self.rank_caches = [
            torch.zeros(pages, width, dtype=torch.uint8, device=s.device) for _ in self.caches
        ]
        group = ContextParallelGroup(ContextParallel.from_config(cfg))
        return IndexerGraphRunner(
            cfg, s.stack, self.rank_caches, s.device, graph_backend=s.graph_backend, dcp=group
        )

    def _runner_batch(self, planned: PlannedStep) -> StepBatch:
        case = StepCase("demo", planned.batch, planned.inputs)
        return shard_case(case, self.rank_config, self.caches, self.rank_caches).batch

    def _check(self, index: int, topk: torch.Tensor) -> None:
        self.compared.add(index)
        answer = self.answers.get(index)
        got = _sorted_topk(topk)
        if answer is None or answer.shape != got.shape or not bool((answer == got).all()):
            self.mismatched.add(index)


@dataclass(frozen=True)
class RankReport:
    """What one rank saw: its table, capture, and the steps compared with W = 1."""

    rank: int
    rows: list[StepRow]
    num_graphs: int
    capture_s: float
    compared: list[int]
    mismatched: list[int]


@contextmanager
def _one_thread() -> Iterator[None]:
    """One torch thread inside, as every rank runs (small reference ops run faster so)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _demo_rank(
    rank: int, world_size: int, answers: dict[int, torch.Tensor], settings: DemoSettings
) -> RankReport:
    """One rank's demo (run by `run_gloo_ranks`): capture, then every step."""
    sim = RankSimulation(settings, rank, world_size, answers)
    start = time.perf_counter()
    sim.runner.capture()
    capture_s = time.perf_counter() - start
    rows = sim.run(lambda row: None)
    return RankReport(
        rank, rows, len(sim.runner.graphs), capture_s, sorted(sim.compared), sorted(sim.mismatched)
    )


def run_demo_dcp(
    settings: DemoSettings, world_size: int, *, print_fn: Callable[[str], None] = print
) -> bool:
    """The demo under context parallel: the single-rank answers computed here in the parent
    (`ReferenceSimulation`), then `world_size` gloo CPU processes (`run_gloo_ranks`), each a
    rank running the same simulation (`RankSimulation`: same seed, requests and steps) and
    comparing every top-k it produces (the normal run and, when replayed, the eager one)
    with the answer (as sets per row: the order of picks is not compared). Once the ranks
    are done, prints rank 0's table and the usual summary, then per rank the steps compared
    and mismatched; True when every rank's replayed steps matched their eager runs and
    every step matched the single-rank answer."""
    if settings.device.type != "cpu":
        raise ValueError(f"dcp = {world_size} runs on the cpu, got {settings.device}")
    print_fn(_title(settings) + f"; context parallel over {world_size} gloo ranks")
    start = time.perf_counter()
    reference = ReferenceSimulation(settings)
    with _one_thread():
        reference.run(lambda row: None)
    print_fn(
        f"single-rank answers: {len(reference.answers)} steps in "
        f"{time.perf_counter() - start:.2f} s (eager, unpadded, selection order)"
    )
    reports = run_gloo_ranks(_demo_rank, world_size, reference.answers, (settings,))
    first = reports[0]
    print_fn(f"rank 0: captured {first.num_graphs} graphs in {first.capture_s:.2f} s")
    print_fn(HEADER)
    for row in first.rows:
        print_fn(format_row(row))
    print_summary(settings, first.rows, print_fn)
    return report_ranks(reports, sorted(reference.answers), print_fn)


def report_ranks(
    reports: list[RankReport],
    steps: list[int],
    print_fn: Callable[[str], None],
) -> bool:
    """One line per rank: steps compared with the single-rank answer (`steps`, the steps
    the single-rank run took), mismatches, and whether its replayed steps matched eager.
    True when every rank compared exactly `steps`, with no mismatch and replay == eager."""
    ok = True
    for report in reports:
        replay = all(row.matches_eager is not False for row in report.rows)
        missing = sorted(set(steps) - set(report.compared))
        extra = sorted(set(report.compared) - set(steps))
        bad = sorted(set(report.mismatched) | set(extra))
        line = (
            f"rank {report.rank}: {len(report.compared)} steps compared with the single-rank "
            f"answer, {len(bad)} mismatches; replay == eager: {'yes' if replay else 'NO'}"
        )
        if bad:
            line += f"  MISMATCH in steps {bad}"
        if missing:
            line += f"  MISSING steps {missing}"
        print_fn(line)
        ok = ok and replay and not bad and not missing
    return ok
