"""Start-up warm-up: compile every Triton kernel variant a runner's eager steps launch.

Triton compiles a kernel once per new specialization key (`graphidx.specializations`): the
first prefill and mixed steps of a fresh process would each stall for seconds. `warmup(runner)`
runs throwaway steps that launch every variant first. Its parts:

Which steps (`candidate_steps`). A launch's key follows from the shapes of the step's
launches: per prefill chunk its rows and logits width (and from them the block-score width
ceil(width / C) and the consumers' gather launches), per step its decode rows, native or
flattened. The kernels' launch code buckets these sizes by rules that change at powers of
two (top-k's whole-row padding, group width, program split; the gather's split by rows;
...), at a residue mod 4 (top-k's QUADS) or at a gate of the config (a chunk of
`min_gather_width` columns or more gathers). So the candidates are prefill chunks of every
power-of-two row count up to the chunk's limit (the token budget and `max_logits_bytes`)
at every width p, p + 1, p + 2, p + 3 for powers of two p, in units of 1 and of C, around
each gate and below `logits_width`; decode rows of every power of two up to the decode
limit, native and flattened, alone and in mixed steps (which also move the prefill rows to
other offsets). An interval (m / 2, m] always holds a power of two, so a rule whose
threshold halves or doubles (such as rows * programs <= SMs * residents) is met on both
sides by some candidate.

Which of them (`plan_warmup`). Every candidate runs once with every launch intercepted
(nothing is launched: a few host milliseconds each) and its keys are recorded; the cheapest
candidates that together launch every key are the plan.

Where they compile. In-process by default: the plan's steps run for real, eagerly, on
throwaway inputs and outputs. On a GPU with `workers` > 1, a pool of spawned processes
compiles first: each builds its own runner from the config and stack (caches of the same
page layout), runs the plan's steps and the capture sizes with launches intercepted, and
compiles (`kernel.warmup`: compiled, never launched) the keys it owns: every key is owned
by one worker, each kernel's variants dealt round the workers. Triton's on-disk cache
(the same TRITON_CACHE_DIR) then serves the parent's steps and its capture.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from capture import CaptureSizes, StepShape
from graphidx.batch import StepBatch
from graphidx.config import IndexerConfig, cdiv
from graphidx.ops.backend import resolve_backend, triton_interpreted
from graphidx.plan.prefill import rows_per_slice
from graphidx.specializations import Key, KeyLog, intercepted_launches, launch_key

if TYPE_CHECKING:
    from graphidx.runner import IndexerGraphRunner, IndexerStack, LayerInput

Progress = Callable[[str, int, int], None]
"""on_progress(phase, done, total): phases "plan" (candidates dry-run), "compile" (keys
compiled by the pool), "run" (steps run in this process)."""

MAX_WORKERS = 8


def default_workers() -> int:
    """The compile pool's default size: min(MAX_WORKERS, os.cpu_count())."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


# --- the steps -------------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmupStep:
    """One throwaway step: per request its query rows and sequence length (decodes first),
    every page id 0; `label` says what it is for."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    label: str = ""

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def cost(self, config: IndexerConfig) -> int:
        """Logits elements the step computes (decode rows span `logits_width`): the order
        in which the planner tries candidates, cheapest first."""
        total, prefill = 0, False
        for q, s in zip(self.query_lens, self.seq_lens, strict=True):
            prefill = prefill or q > config.next_n
            total += q * (s // config.compress_ratio if prefill else config.logits_width)
        return total

    def batch(self, config: IndexerConfig, table: torch.Tensor, num_pages: int) -> StepBatch:
        """The step as a batch over `table` (zeros, `[>= num_reqs, max_blocks]`, on the
        runner's device), unvalidated: every value here is in range by construction."""
        qsl = np.zeros(len(self.query_lens) + 1, dtype=np.int32)
        np.cumsum(self.query_lens, out=qsl[1:])
        qsl_cpu = torch.from_numpy(qsl)
        seq_lens = torch.tensor(self.seq_lens, dtype=torch.int32)
        return StepBatch(
            qsl_cpu,
            seq_lens,
            qsl_cpu.to(table.device),
            seq_lens.to(table.device),
            table[: len(self.query_lens)],
            config=config,
            num_tokens=int(qsl[-1]),
            num_pages=num_pages,
            validate=False,
        )


def _ladder(limit: int) -> list[int]:
    """Powers of two up to `limit`, and `limit` (nothing below 1)."""
    values, p = set(), 1
    while p <= limit:
        values.add(p)
        p *= 2
    return sorted(values | {limit}) if limit >= 1 else []


def chunk_widths(config: IndexerConfig, gates: Sequence[int] = ()) -> list[int]:
    """Prefill chunk widths (compressed entries) to warm: p, p + 1, p + 2, p + 3 for every
    power of two p, in units of 1 and of C (so that the block-score width ceil(w / C) takes
    those values too); g - 1 ... g + 3 for every gate g; the four widths up to
    `logits_width`; within [1, logits_width]."""
    widest = config.logits_width
    widths = set(range(widest - 3, widest + 1))
    for unit in {1, max(1, config.candidate_block_size)}:
        for p in _ladder(widest // unit):
            widths.update(unit * (p + extra) for extra in range(4))
    for gate in gates:
        widths.update(range(gate - 1, gate + 4))
    return sorted(w for w in widths if 1 <= w <= widest)


def _seq_len(config: IndexerConfig, width: int) -> int:
    """The longest sequence whose compressed context is `width` entries."""
    r = config.compress_ratio
    return min(width * r + r - 1, config.max_model_len)


def _chunk_requests(config: IndexerConfig, rows: int, width: int) -> list[tuple[int, int]] | None:
    """(query rows, sequence length) of prefill requests that form one chunk of `rows` rows
    and `width` columns (more than next_n rows: one request, or several when the rows exceed
    the sequence), or cut `rows` <= next_n rows off the end of a longer request; None when
    the config allows no such chunk."""
    n, seq = config.next_n, _seq_len(config, width)
    if seq <= n:
        return None  # the first prefill request needs more than next_n rows
    if n < rows <= seq:
        return [(rows, seq)]
    if rows > seq:
        count = cdiv(rows, seq)
        if count > config.max_num_seqs:
            return None
        return [(seq, seq)] * (count - 1) + [(rows - seq * (count - 1), seq)]
    query = rows_per_slice(config.max_logits_bytes, width) + rows  # one full chunk, then ours
    if query > min(config.max_num_batched_tokens, seq):
        return None
    return [(query, seq)]


def _decode_requests(config: IndexerConfig, rows: int, native: bool) -> list[int] | None:
    """Query rows of decode requests totalling `rows`: next_n each (native), or a shorter
    request first (flattened); None when that shape is impossible here."""
    n = config.next_n
    if native:
        lens = [n] * (rows // n) if rows % n == 0 else None
    elif n == 1:
        lens = None  # every next_n = 1 decode is the native shape
    else:
        first = min(n - 1, rows)
        rest = rows - first
        lens = [first] + [n] * (rest // n) + ([rest % n] if rest % n else [])
    if lens is None or len(lens) > config.max_num_seqs:
        return None
    return lens


def candidate_steps(config: IndexerConfig, *, gather_width: int | None = None) -> list[WarmupStep]:
    """Every candidate of the warm-up (module docstring): prefill chunks of the power-of-two
    row counts at each of `chunk_widths(config, gates)` (the gate: `gather_width`, the
    width from which a consumer's prefill chunk gathers, None without one), decode rows of
    the power-of-two counts native and flattened, and mixed steps of those decodes and a
    small and a gathering prefill request."""
    gates = [gather_width] if gather_width else []
    steps = [
        *_prefill_candidates(config, gates),
        *_decode_candidates(config),
        *_mixed_candidates(config, gates),
    ]
    return list(dict.fromkeys(steps))


def _prefill_candidates(config: IndexerConfig, gates: list[int]) -> list[WarmupStep]:
    steps = []
    budget = config.max_num_batched_tokens
    for width in chunk_widths(config, gates):
        for rows in _ladder(min(budget, rows_per_slice(config.max_logits_bytes, width))):
            requests = _chunk_requests(config, rows, width)
            if requests is not None:
                q, s = zip(*requests, strict=True)
                steps.append(WarmupStep(q, s, f"prefill {rows} x {width}"))
    return steps


def _decode_rows_limit(config: IndexerConfig) -> int:
    return min(config.max_num_batched_tokens, config.max_num_seqs * config.next_n)


def _decode_candidates(config: IndexerConfig) -> list[WarmupStep]:
    steps = []
    for rows in _ladder(_decode_rows_limit(config)):
        for native in (True, False):
            lens = _decode_requests(config, rows, native)
            if lens is not None:
                kind = "native" if native else "flattened"
                seqs = (config.block_size,) * len(lens)
                steps.append(WarmupStep(tuple(lens), seqs, f"decode {rows} ({kind})"))
    return steps


def _mixed_candidates(config: IndexerConfig, gates: list[int]) -> list[WarmupStep]:
    n = config.next_n
    prefills = [(n + 1, max(n + 1, config.block_size))]
    prefills += [(n + 1, _seq_len(config, g)) for g in gates if g <= config.logits_width]
    limit = min(_decode_rows_limit(config), config.max_num_batched_tokens - n - 1)
    steps = []
    for rows in _ladder(limit):
        for native in (True, False):
            lens = _decode_requests(config, rows, native)
            if lens is None or len(lens) >= config.max_num_seqs:
                continue
            for q, s in prefills:
                seqs = (config.block_size,) * len(lens) + (s,)
                kind = "native" if native else "flattened"
                width = s // config.compress_ratio
                label = f"mixed: decode {rows} ({kind}) + prefill {q} x {width}"
                steps.append(WarmupStep((*lens, q), seqs, label))
    return steps


# --- planning: the keys each candidate launches -----------------------------------------------


@dataclass
class WarmupScratch:
    """Throwaway per-layer inputs (zeros, `max_num_batched_tokens` rows, one tensor shared
    by every layer), a top-k output and a block table (zeros) shaped like the runner's
    persistent ones, so the warm-up's launches specialize as a step's do."""

    inputs: tuple[LayerInput, ...]
    out: torch.Tensor
    table: torch.Tensor

    @classmethod
    def for_runner(cls, runner: IndexerGraphRunner) -> WarmupScratch:
        from graphidx.runner import LayerInput

        cfg, device = runner.config, runner.device
        rows, heads, dim = cfg.max_num_batched_tokens, cfg.num_heads, cfg.head_dim
        one = LayerInput(
            torch.zeros(rows, heads, dim // 2, dtype=torch.uint8, device=device),
            torch.zeros(rows, heads, dim // 32, dtype=torch.uint8, device=device),
            torch.zeros(rows, heads, dtype=torch.float32, device=device),
        )
        table = runner.buffers["block_table"]
        return cls(
            (one,) * runner.stack.num_layers,
            torch.empty_like(runner.topk_buffer),
            torch.zeros(table.shape, dtype=table.dtype, device=device),
        )

    def run(self, runner: IndexerGraphRunner, step: WarmupStep) -> None:
        """`step` through the runner's eager path, on this scratch."""
        batch = step.batch(runner.config, self.table, runner.num_pages)
        runner._run_warmup_step(batch, self.inputs, self.out)


Item = WarmupStep | StepShape
"""What a worker runs: an eager step, or a captured size run eagerly."""


@dataclass
class WarmupPlan:
    """The steps to run (in order) and, per item (those steps, then the capture shapes when
    a pool compiles), the keys its launches have; `candidates`: steps tried."""

    steps: list[WarmupStep]
    keys: dict[Item, frozenset[Key]] = field(default_factory=dict)
    candidates: int = 0

    def variants(self) -> int:
        """Distinct keys the plan's steps launch."""
        return len(frozenset().union(*(self.keys.get(step, ()) for step in self.steps)))


KeysOf = Callable[[Callable[[], None]], frozenset[Key]]
"""keys_of(run): run `run()` and return the keys of its launches."""


@contextmanager
def _dry_run() -> Iterator[KeysOf]:
    """Inside the block every launch is intercepted (nothing is launched); yields
    `keys_of`."""
    current = [KeyLog()]

    def record(kernel: Any, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        current[0].record(launch_key(kernel, args, kwargs))

    def keys_of(run: Callable[[], None]) -> frozenset[Key]:
        current[0] = KeyLog()
        run()
        return frozenset(current[0])

    with intercepted_launches(record):
        yield keys_of


def plan_warmup(
    runner: IndexerGraphRunner,
    scratch: WarmupScratch,
    *,
    candidates: Sequence[WarmupStep] | None = None,
    keep_all: bool = False,
    on_progress: Progress | None = None,
) -> WarmupPlan:
    """Run every candidate (default: `candidate_steps` of the runner's config) with its
    launches intercepted, cheapest first; keep each that launches a key no earlier one
    launched (`keep_all`: every one, in the given order)."""
    if candidates is None:
        gather = getattr(runner.builder, "min_gather_width", None)
        candidates = candidate_steps(runner.config, gather_width=gather)
    ordered = list(candidates)
    if not keep_all:
        ordered.sort(key=lambda step: step.cost(runner.config))
    plan = WarmupPlan([], candidates=len(ordered))
    seen: set[Key] = set()
    with _dry_run() as keys_of:
        for i, step in enumerate(ordered, start=1):
            keys = keys_of(functools.partial(scratch.run, runner, step))
            if keep_all or not keys <= seen:
                plan.steps.append(step)
                plan.keys[step] = keys
                seen |= keys
            if on_progress is not None:
                on_progress("plan", i, len(ordered))
    return plan


def add_capture_keys(
    runner: IndexerGraphRunner, plan: WarmupPlan, shapes: Sequence[StepShape]
) -> None:
    """The keys of each captured size's step (run eagerly, intercepted) added to `plan`:
    what a pool compiles for the capture. Loads capture's dummy batch into the persistent
    step inputs, as `capture()` does."""
    with _dry_run() as keys_of:
        for shape in shapes:
            plan.keys[shape] = keys_of(functools.partial(runner._run_uniform_eagerly, shape))


# --- the compile pool ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _CacheSpec:
    """A KV cache's layout: row length and stride (bytes), address mod 16."""

    cols: int
    stride: int
    misalign: int

    @classmethod
    def of(cls, cache: torch.Tensor) -> _CacheSpec:
        return cls(int(cache.shape[1]), int(cache.stride(0)), cache.data_ptr() % 16)

    def allocate(self, device: torch.device) -> torch.Tensor:
        """One page of this layout (the warm-up reads page 0 only)."""
        flat = torch.zeros(self.stride + self.misalign, dtype=torch.uint8, device=device)
        return flat[self.misalign :].as_strided((1, self.cols), (self.stride, 1))


@dataclass(frozen=True)
class PoolJob:
    """What every worker gets: the runner to build, and per worker its items and keys."""

    config: IndexerConfig
    stack: IndexerStack
    caches: tuple[_CacheSpec, ...]
    device: torch.device
    ops_backend: str | None
    capture_sizes: CaptureSizes
    items: tuple[tuple[Item, ...], ...]
    owned: tuple[frozenset[Key], ...]

    def runner(self) -> IndexerGraphRunner:
        from graphidx.runner import IndexerGraphRunner

        caches = [spec.allocate(self.device) for spec in self.caches]
        return IndexerGraphRunner(
            self.config,
            self.stack,
            caches,
            self.device,
            graph_backend="tape",  # it captures nothing; the tape runs on any device
            ops_backend=self.ops_backend,
            capture_sizes=self.capture_sizes,
        )


def assign_keys(
    keys: dict[Item, frozenset[Key]], workers: int
) -> list[tuple[list[Item], set[Key]]]:
    """Deal the keys round `workers` workers (sorted by kernel, so each kernel's variants
    spread over the pool), each with the items that first launch its keys; workers left
    without a key are dropped."""
    witness: dict[Key, Item] = {}
    for item, item_keys in keys.items():
        for key in sorted(item_keys, key=repr):
            witness.setdefault(key, item)
    shares: list[tuple[dict[Item, None], set[Key]]] = [({}, set()) for _ in range(workers)]
    for i, key in enumerate(sorted(witness, key=lambda k: (k[0], repr(k)))):
        items, owned = shares[i % workers]
        owned.add(key)
        items[witness[key]] = None
    return [(list(items), owned) for items, owned in shares if owned]


def _load(compiled: Any) -> None:
    """Load a compiled kernel in this worker, so that Triton also builds its launcher now.

    Triton 3.6 compiles a C launcher per kernel signature (a C compiler run of about a second,
    kept in the on-disk cache) only when a kernel is first loaded, which `warmup` does not
    do; left to the first launch, those builds would run one after another in the serving
    process."""
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()


def _pool_worker(index: int, job: PoolJob, queue: Any) -> None:
    """Worker `index`: build the runner, run its items with launches intercepted, compile
    (never launch) the keys it owns; one queue message per key compiled."""
    if job.device.type == "cuda":
        torch.cuda.set_device(job.device)
    from graphidx.ops.kernels.launch import settle_hashes, with_dependent_launch

    settle_hashes()  # the serving process hashes the kernels in this same order
    runner = job.runner()
    scratch = WarmupScratch.for_runner(runner)
    owned, done = job.owned[index], set()

    def compile_owned(
        kernel: Any, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        key = launch_key(kernel, args, kwargs)
        if key in owned and key not in done:
            # The options `launch` adds, so the serving process finds this very variant.
            _load(kernel.warmup(*args, grid=grid, **with_dependent_launch(args, kwargs)))
            done.add(key)
            queue.put(1)

    with intercepted_launches(compile_owned):
        for item in job.items[index]:
            if isinstance(item, WarmupStep):
                scratch.run(runner, item)
            else:
                runner._run_uniform_eagerly(item)


def compile_in_pool(
    runner: IndexerGraphRunner,
    plan: WarmupPlan,
    workers: int,
    on_progress: Progress | None = None,
) -> int:
    """Compile every key of `plan` in `workers` spawned processes (Triton's on-disk cache
    keeps the results); returns the number of keys the workers compiled."""
    import torch.multiprocessing as mp

    shares = assign_keys(plan.keys, workers)
    if not shares:
        return 0
    job = PoolJob(
        runner.config,
        runner.stack,
        tuple(_CacheSpec.of(cache) for cache in runner.kv_caches),
        runner.device,
        runner.ops_backend,
        runner.capture_sizes,
        tuple(tuple(items) for items, _ in shares),
        tuple(frozenset(owned) for _, owned in shares),
    )
    total = sum(len(owned) for _, owned in shares)
    queue = mp.get_context("spawn").SimpleQueue()
    context = mp.spawn(_pool_worker, args=(job, queue), nprocs=len(shares), join=False)
    done = 0
    while True:
        finished = context.join(timeout=0.2)
        while not queue.empty():
            done += queue.get()
            if on_progress is not None:
                on_progress("compile", done, total)
        if finished:
            return done


# --- the whole warm-up ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did: steps run in this process, the candidates they were planned from
    and the kernel variants they launch (0 when the steps were given or not planned),
    processes that compiled (1: this one alone) and the keys they compiled, the time of each
    phase; `skipped` says why nothing ran."""

    steps: int = 0
    candidates: int = 0
    variants: int = 0
    workers: int = 1
    pool_compiled: int = 0
    plan_seconds: float = 0.0
    compile_seconds: float = 0.0
    run_seconds: float = 0.0
    skipped: str | None = None

    @property
    def seconds(self) -> float:
        return self.plan_seconds + self.compile_seconds + self.run_seconds

    def summary(self) -> str:
        if self.skipped is not None:
            return f"warm-up skipped: {self.skipped}"
        planned = f" (from {self.candidates} candidates)" if self.candidates else ""
        variants = f", {self.variants} kernel variants" if self.variants else ""
        pool = (
            f"; compiled {self.pool_compiled} in a pool of {self.workers} workers "
            f"in {self.compile_seconds:.2f} s"
            if self.workers > 1
            else ""
        )
        return (
            f"warmed up {self.steps} steps{planned}{variants} in {self.seconds:.2f} s "
            f"(plan {self.plan_seconds:.2f} s, run {self.run_seconds:.2f} s{pool})"
        )


def runs_triton(runner: IndexerGraphRunner) -> bool:
    """Whether the runner's kernels are Triton's (compiled, or interpreted on a CPU)."""
    return resolve_backend(runner.ops_backend, runner.device) == "triton"


def pool_workers(runner: IndexerGraphRunner, workers: int | None) -> int:
    """The processes that compile: `workers` (None: `default_workers()`) on a GPU whose
    kernels Triton compiles, else 1 (this process)."""
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise ValueError(f"workers must be None or an int >= 1, got {workers!r}")
    if runner.device.type != "cuda" or triton_interpreted() or not runs_triton(runner):
        return 1
    return default_workers() if workers is None else workers


def warmup(
    runner: IndexerGraphRunner,
    *,
    workers: int | None = None,
    steps: Sequence[WarmupStep] | None = None,
    on_progress: Progress | None = None,
) -> WarmupReport:
    """Compile, at start-up, every kernel variant `runner`'s eager steps will launch, so
    that no prefill or mixed step compiles (the module docstring says how the steps are
    found).

    Call it once before `runner.capture()` (capture compiles the uniform decode sizes itself);
    it runs no step of the caller's. It runs throwaway steps eagerly: planned ones (a
    dry run of every candidate, launches intercepted, keeps the cheapest steps that
    launch every kernel variant), or `steps` as given. They read the KV caches (page 0
    only) and write only throwaway inputs, outputs and block table, the workspace and
    the builder's metadata buffers (which every step rewrites); the persistent step
    inputs, the top-k output, the counters and the graph cache are left as they are,
    except that with a pool the capture sizes are dry-run too, which loads capture's
    dummy batch into the persistent lengths, block table and live count, as
    `capture()` does. Nothing is planned when the kernels compile nothing (ops backend
    other than Triton): then, unless `steps` are given, it returns at once.

    `workers`: on a GPU, the processes that compile (None: `default_workers()`, min(8, CPU
    count)); more than 1 spawns a pool that compiles the plan's kernels and the capture
    sizes' into Triton's on-disk cache, which this process then finds (spawned: a script
    calling this needs Python's `if __name__ == "__main__":` guard); elsewhere, and with 1,
    everything compiles in this process. `on_progress(phase, done, total)` reports each
    phase ("plan", "compile", "run"). Returns a `WarmupReport`. ValueError under context
    parallel (the ranks would have to agree on the plan) and for a bad `workers`. Not
    thread-safe: the dry run swaps the kernels' launcher while it runs.
    """
    if runner.dcp is not None:
        raise ValueError(
            "warm-up under context parallel is not supported: every rank would have to run "
            "the same planned steps"
        )
    pool = pool_workers(runner, workers)
    if steps is None and not runs_triton(runner):
        backend = resolve_backend(runner.ops_backend, runner.device)
        return WarmupReport(skipped=f"the {backend!r} kernels compile nothing")
    scratch = WarmupScratch.for_runner(runner)
    start = time.perf_counter()
    plan = (
        plan_warmup(runner, scratch, on_progress=on_progress)
        if steps is None
        else WarmupPlan(list(steps))
    )
    compiled = 0
    if pool > 1:
        if steps is not None:
            plan = plan_warmup(runner, scratch, candidates=steps, keep_all=True)
        shapes = [s for s in runner.capture_sizes.shapes() if s not in runner.graphs]
        add_capture_keys(runner, plan, shapes)
    planned = time.perf_counter()
    if pool > 1:
        compiled = compile_in_pool(runner, plan, pool, on_progress)
    pooled = time.perf_counter()
    for i, step in enumerate(plan.steps, start=1):
        scratch.run(runner, step)
        if on_progress is not None:
            on_progress("run", i, len(plan.steps))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    end = time.perf_counter()
    return WarmupReport(
        steps=len(plan.steps),
        candidates=plan.candidates,
        variants=plan.variants(),
        workers=pool,
        pool_compiled=compiled,
        plan_seconds=planned - start,
        compile_seconds=pooled - planned,
        run_seconds=end - pooled,
    )
