"""`graphidx bench --step`: one decode step per layer kind on device graphs — launches per
layer, the bare graph and the replayed step, at batch 1 / 4 / 16 / 64 x 8K / 64K tokens.
The logits rows are as wide as the config's `max_model_len`: by default the context + 64;
`model_len` sets it, as a deployment does for its model's longest context (V3.2: 163840),
where the decode rows hold far fewer live columns than their buffer.

Presets: `v32`, one DeepSeek-V3.2 indexer layer (64 heads, next_n 2, top-2048); `v41`, the
DeepSeek-V4.1-Flash stack (candidate source + 3 consumers, 32 heads, next_n 2). For each
batch the runner replays a uniform decode step whose inputs are all written in place
(`input_views`, the persistent `seq_lens` and `block_table`): "step" is the wall time of
`runner.step(...)` with its host work, synchronized; "graph" the bare replay between two
events (the captured graph's own replay, without the runner's address guard: timed as the
peer's graph is). Launches come from the profiler's record of one replay (every kernel, memset and
copy the graph runs); per layer kind by difference of stacks that add one layer of that
kind, so the step-level launches (the derived metadata) are counted once, as "step".
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphidx.batch import StepBatch
from graphidx.config import IndexerConfig, cdiv
from graphidx.runner import IndexerGraphRunner, IndexerStack, LayerInput
from graphidx.testing import random_kv_cache, random_layer_input

STEP_BATCHES = (1, 4, 16, 64)
STEP_CONTEXTS = (8192, 65536)
REPEAT = 30


@dataclass(frozen=True)
class StepRow:
    """One preset's decode step at one context and batch."""

    preset: str
    context: int
    batch: int
    step_ms: float
    graph_ms: float
    launches: int
    """Device activities of one replay (kernels, memsets, copies)."""
    launches_per_kind: dict[str, int]
    """Per layer kind (`dense`, `source`, `consumer`) and `step` (the step-level ones)."""
    activities: tuple[tuple[str, float, float], ...] = ()
    """(short name, start us after the first activity's start, device us) of each activity
    of one replay, in start order."""


def min_model_len(context: int) -> int:
    """The presets' `max_model_len` for requests of up to `context` tokens, and the least a
    caller may give."""
    return max(context, 4096) + 64


def preset(
    name: str, context: int, max_reqs: int, model_len: int | None = None
) -> tuple[IndexerConfig, IndexerStack]:
    """(config, stack) of `v32` or `v41` for requests of up to `context` tokens, with
    `max_model_len` = `model_len` (None: `min_model_len(context)`; ValueError below it)."""
    least = min_model_len(context)
    if model_len is None:
        model_len = least
    elif model_len < least:
        raise ValueError(f"model_len={model_len} must be at least {least} for context {context}")
    if name == "v41":
        config = IndexerConfig.deepseek_v41_flash(max_num_seqs=max_reqs, max_model_len=model_len)
        return config, IndexerStack(candidate_source=True, consumers=3)
    if name == "v32":
        config = IndexerConfig.deepseek_v32(
            max_num_seqs=max_reqs, max_model_len=model_len, num_speculative_tokens=1
        )
        return config, IndexerStack(dense=1)
    raise ValueError(f"unknown step preset {name!r}; known: v32, v41")


def median_ms(fn: Callable[[], object], event: bool, repeat: int = REPEAT) -> float:
    """Median of `repeat` calls of `fn`: between two CUDA events (`event`), else wall time
    synchronized before and after."""
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeat):
        if event:
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            torch.cuda.synchronize()
            began = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def replay_activities(replay: Callable[[], object]) -> list[tuple[str, float, float]]:
    """(name, start us after the first one's start, device us) of every kernel, memset and
    copy one call of `replay` runs, in start order, from the profiler's record."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    first = events[0].time_range.start if events else 0
    return [(e.name, e.time_range.start - first, e.time_range.elapsed_us()) for e in events]


def _replay_launches(replay: Callable[[], object]) -> int:
    return len(replay_activities(replay))


def short_name(kernel: str) -> str:
    """A kernel's name without its template or argument list (profiler names can be long)."""
    return kernel.split("(")[0].split("<")[0].strip()[:40]


class _Setup:
    """A runner of one stack captured at every batch size, with in-place step inputs."""

    def __init__(
        self, config: IndexerConfig, stack: IndexerStack, context: int, batches: tuple[int, ...]
    ) -> None:
        from capture import CaptureSizes

        self.device = torch.device("cuda")
        self.config, self.context = config, context
        self.pages_per_req = cdiv(context // config.compress_ratio, config.page_entries)
        self.num_pages = max(batches) * self.pages_per_req
        gen = torch.Generator().manual_seed(0)
        caches = [
            random_kv_cache(config, self.num_pages, self.device, gen)
            for _ in range(stack.num_layers)
        ]
        next_n = config.next_n
        self.runner = IndexerGraphRunner(
            config, stack, caches, self.device, graph_backend="device",
            capture_sizes=CaptureSizes([b * next_n for b in batches],
                                       max_size=max(batches) * next_n, uniform_query_len=next_n),
        )  # fmt: skip
        self.runner.capture()
        self.gen = gen

    def step_inputs(self, batch: int) -> tuple[StepBatch, tuple[LayerInput, ...]]:
        """A uniform decode batch and layer inputs, all in the runner's own buffers."""
        config, runner = self.config, self.runner
        table = torch.arange(batch * self.pages_per_req, dtype=torch.int32)
        step = StepBatch.from_lists(
            config, [config.next_n] * batch, [self.context] * batch,
            table.view(batch, -1).to(self.device), num_pages=self.num_pages, device=self.device,
        )  # fmt: skip
        tokens = batch * config.next_n
        views = runner.input_views(tokens)
        for view in views:
            given = random_layer_input(config, tokens, self.device, self.gen)
            for name in ("q", "q_scale", "weights"):
                getattr(view, name).copy_(getattr(given, name))
        seq_view = runner.buffers["seq_lens"][:batch]
        table_view = runner.buffers["block_table"][:batch, : self.pages_per_req]
        seq_view.copy_(step.seq_lens)
        table_view.copy_(step.block_table)
        in_place = dataclasses.replace(
            step, seq_lens=seq_view, block_table=table_view, validate=False
        )
        return in_place, views

    def launches(self, batch: int) -> int:
        step, views = self.step_inputs(batch)
        first = self.runner.step(step, views, synchronize=True)
        if not first.replayed or first.shape is None:
            raise RuntimeError(f"batch {batch} did not replay: {first}")
        shape = first.shape
        return _replay_launches(lambda: self.runner.graphs.replay(shape))


def measure_step(
    name: str,
    context: int,
    batches: tuple[int, ...] = STEP_BATCHES,
    model_len: int | None = None,
) -> list[StepRow]:
    """`name`'s decode step at `context` for each batch, logits rows `model_len` wide (see
    the module docstring)."""
    config, stack = preset(name, context, max(batches), model_len)
    main = _Setup(config, stack, context, batches)
    # Stacks one layer apart give each kind's launches; the rest is the step's own.
    if name == "v32":
        probes = {"dense": (IndexerStack(dense=1), IndexerStack(dense=2))}
    else:
        probes = {
            "consumer": (
                IndexerStack(candidate_source=True),
                IndexerStack(candidate_source=True, consumers=1),
            )
        }
    probe_setups = {
        kind: (_Setup(config, a, context, batches), _Setup(config, b, context, batches))
        for kind, (a, b) in probes.items()
    }
    rows = []
    for batch in batches:
        step, views = main.step_inputs(batch)
        first = main.runner.step(step, views, synchronize=True)
        if not first.replayed or first.shape is None:
            raise RuntimeError(f"{name} batch {batch} did not replay: {first}")
        shape = first.shape
        step_ms = median_ms(lambda: main.runner.step(step, views, synchronize=True), False)  # noqa: B023
        bare = main.runner.graphs.graph(shape).replay
        graph_ms = median_ms(bare, True)
        activities = tuple((short_name(n), start, us) for n, start, us in replay_activities(bare))
        launches = len(activities)
        per_kind: dict[str, int] = {}
        for kind, (small, large) in probe_setups.items():
            one, two = small.launches(batch), large.launches(batch)
            per_kind[kind] = two - one
            if kind == "dense":
                per_kind["step"] = one - per_kind[kind]
            else:
                per_kind["source + step"] = one
        rows.append(
            StepRow(name, context, batch, step_ms, graph_ms, launches, per_kind, activities)
        )
        print(
            f"  {name} {context} x {batch}: step {step_ms:.3f} ms, graph {graph_ms:.3f} ms, "
            f"{launches} launches {per_kind}",
            flush=True,
        )
        for kernel, start, us in activities:
            print(f"      at {start:7.1f} us: {us:8.1f} us  {kernel}", flush=True)
    return rows


def format_step(rows: list[StepRow], peers: dict[tuple[int, int], tuple[float, float]]) -> str:
    """The step table; `peers` maps (context, batch) to the V3.2 peer's (step, graph) ms."""
    lines = [
        f"{'preset':>6} {'context':>7} {'batch':>5} {'step ms':>8} {'graph ms':>8} "
        f"{'launches':>8}  per kind{'':20} {'peer step':>9} {'peer graph':>10}"
    ]
    for r in rows:
        peer = peers.get((r.context, r.batch)) if r.preset == "v32" else None
        kinds = ", ".join(f"{k} {v}" for k, v in r.launches_per_kind.items())
        peer_text = f"{peer[0]:9.3f} {peer[1]:10.3f}" if peer else f"{'-':>9} {'-':>10}"
        lines.append(
            f"{r.preset:>6} {r.context:>7} {r.batch:>5} {r.step_ms:8.3f} {r.graph_ms:8.3f} "
            f"{r.launches:>8}  {kinds:<28} {peer_text}"
        )
    return "\n".join(lines)
