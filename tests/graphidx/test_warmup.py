"""The start-up warm-up (graphidx.warmup): after `warmup()` and `capture()` no step launches a
kernel variant that was not launched before (kernel launches recorded under the Triton
interpreter, not executed: `graphidx.specializations.recording_interpreter`); the warm-up
leaves the runner's answers, inputs, caches and counters as they were; the pool's key
assignment; eager steps read one block-table layout whatever the caller's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import small_dense_config

import graphidx.cli.demo as demo
from capture import CaptureSizes
from graphidx.batch import StepBatch
from graphidx.builder import CandidateIndexerMetadataBuilder
from graphidx.config import IndexerConfig
from graphidx.ops.backend import triton_interpreted
from graphidx.runner import IndexerGraphRunner, IndexerStack
from graphidx.specializations import (
    Key,
    KeyLog,
    intercepted_launches,
    launch_key,
    recorder,
    recording_interpreter,
)
from graphidx.testing import KINDS, StepGenerator, random_layer_input, random_tape_runner
from graphidx.warmup import (
    WarmupScratch,
    WarmupStep,
    add_capture_keys,
    assign_keys,
    candidate_steps,
    compile_in_pool,
    plan_warmup,
    pool_workers,
    warmup,
)

pytest.importorskip("triton")
needs_interpreter = pytest.mark.skipif(
    not triton_interpreted(), reason="records launches through the Triton interpreter"
)

DENSE = small_dense_config(compress_ratio=4, block_size=128)
"""A dense stack's config: compressed (R = 4), no speculative rows, no candidate pool."""
TWO_LEVEL = IndexerConfig.cpu_demo(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048)
WIDE = IndexerConfig.cpu_demo(
    max_num_seqs=16, max_num_batched_tokens=256, max_model_len=65536, max_logits_bytes=32 << 20
)
"""Rows wide enough for the streaming top-k (one program per row, and rows split over
programs), whose variants follow the width's residue mod 4 and the row count."""


def _demo_simulation(num_requests: int) -> demo.ServingSimulation:
    """The CPU demo's simulation on Triton kernels, the decode schedule built as on a GPU."""
    settings = demo.DemoSettings.for_device(torch.device("cpu"), num_requests=num_requests)
    sim = demo.ServingSimulation(settings)
    cfg = settings.config
    runner = IndexerGraphRunner(
        cfg, settings.stack, sim.caches, "cpu", graph_backend="tape", ops_backend="triton"
    )
    runner.builder = CandidateIndexerMetadataBuilder(
        cfg, "cpu", num_pages=sim.num_pages, full_graph_decode=True, decode_schedule=True
    )
    sim.runner = runner
    return sim


def _recorded(run: object) -> KeyLog:
    """The keys of every kernel call `run()` makes (recorded, not executed)."""
    log = KeyLog()
    with recording_interpreter(log):
        run()  # type: ignore[operator]
    return log


def _unexpected(steps: KeyLog, *before: KeyLog) -> list[Key]:
    known = {key for log in before for key in log}
    return [key for key in steps if key not in known]


@needs_interpreter
def test_after_warmup_and_capture_the_demo_launches_no_new_kernel_variant() -> None:
    """The demo's order (warm-up, capture, serve): every key its steps launch was launched
    by the warm-up or the capture, and some only by the warm-up (the check has teeth: the
    capture alone leaves the prefill steps their own variants to compile)."""
    sim = _demo_simulation(num_requests=8)
    reports = []
    warm = _recorded(lambda: reports.append(warmup(sim.runner, workers=4)))
    captured = _recorded(sim.runner.capture)

    def serve() -> None:
        for index in range(400):
            if not sim.waiting and not sim.running:
                return
            sim.step(index)

    served = _recorded(serve)
    assert reports[0].steps > 0 and reports[0].workers == 1  # the CPU compiles in-process
    assert reports[0].variants == len(warm)
    assert _unexpected(served, warm, captured) == []
    assert _unexpected(served, captured), "the capture alone covered the demo: a vacuous test"


def _random_steps(gen: StepGenerator, config: IndexerConfig, count: int) -> list[StepBatch]:
    """Single-request prefill steps of random rows and widths (the widest chunks a request
    of that context makes)."""
    rng = np.random.default_rng(7)
    batches = []
    for _ in range(count):
        seq = int(rng.integers(config.next_n + 1, config.max_model_len + 1))
        rows = int(rng.integers(config.next_n + 1, min(seq, config.max_num_batched_tokens) + 1))
        batches.append(
            StepBatch.from_lists(config, [rows], [seq], num_pages=gen.num_pages, device="cpu")
        )
    return batches


@needs_interpreter
@pytest.mark.parametrize(
    ("config", "stack"),
    [
        (TWO_LEVEL, IndexerStack(candidate_source=True, consumers=1)),
        (DENSE, IndexerStack(dense=1)),
        (WIDE, IndexerStack(candidate_source=True, consumers=1)),
    ],
    ids=["two-level", "dense-R4", "wide"],
)
def test_random_steps_after_warmup_launch_no_new_kernel_variant(
    config: IndexerConfig, stack: IndexerStack
) -> None:
    """Random steps of every kind (padded and unpadded) and random prefill widths, after the
    warm-up and the capture: no key that neither launched."""
    sizes = CaptureSizes(max_size=16, uniform_query_len=config.next_n)
    runner, gen = random_tape_runner(
        config, stack, seed=3, num_pages=config.max_blocks_per_seq + 8,
        max_context=config.max_model_len,
        capture_sizes=sizes, capture=False, ops_backend="triton",
    )  # fmt: skip
    warm = _recorded(lambda: warmup(runner))
    captured = _recorded(runner.capture)
    kinds = [kind for kind in KINDS if kind != "adaptive"]
    cases = list(gen.cases(30, kinds))
    prefills = _random_steps(gen, config, 40)

    def serve() -> None:
        for case in cases:
            runner.step(case.batch, case.inputs)
            runner.step(case.batch, case.inputs, pad=False)
        inputs = tuple(
            random_layer_input(config, config.max_num_batched_tokens, "cpu", gen.gen)
            for _ in range(stack.num_layers)
        )
        for batch in prefills:
            runner.step(batch, inputs)

    served = _recorded(serve)
    assert len(warm) > 0
    assert _unexpected(served, warm, captured) == []


@needs_interpreter
def test_each_planned_step_launches_for_real_the_keys_its_dry_run_recorded() -> None:
    """The pool compiles the keys of the plan's dry runs; the serving process then runs the
    same steps for real. Executed (interpreted), every step launches exactly the keys its dry
    run recorded: no launch shape depends on a device value that a dry run leaves unwritten."""
    from triton.runtime.interpreter import InterpretedFunction

    sim = _demo_simulation(num_requests=4)
    runner = sim.runner
    scratch = WarmupScratch.for_runner(runner)
    plan = plan_warmup(runner, scratch)
    assert len(plan.steps) > 3
    launched: list[Key] = []
    original = InterpretedFunction.run

    def run(self: object, *args: object, grid: object, warmup: bool, **kwargs: object) -> object:
        launched.append(launch_key(self, args, kwargs))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run  # type: ignore[method-assign]
    try:
        for step in plan.steps[:6]:
            launched.clear()
            scratch.run(runner, step)
            assert launched and set(launched) == plan.keys[step], step
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]


@needs_interpreter
def test_a_dry_run_launches_no_kernel() -> None:
    """Under `intercepted_launches` every kernel call of a step reaches the handler and none
    reaches Triton: the planner's dry runs launch nothing."""
    runner, gen = random_tape_runner(
        TWO_LEVEL, IndexerStack(candidate_source=True, consumers=1), seed=4, capture=False,
        ops_backend="triton",
    )  # fmt: skip
    case = gen.case("mixed")
    intercepted = KeyLog()

    def dry_step() -> None:
        with intercepted_launches(recorder(intercepted)):
            runner.step(case.batch, case.inputs)

    reached = _recorded(dry_step)
    assert len(reached) == 0 and len(intercepted) > 0


def _sorted(topk: torch.Tensor) -> torch.Tensor:
    return torch.sort(topk.long(), -1).values.clone()


def test_warmup_leaves_answers_inputs_caches_and_counters_unchanged() -> None:
    """A runner warmed up (explicit steps, run for real on the reference kernels) after its
    capture answers every later step as a runner that never warmed up; the warm-up changed
    none of the persistent inputs, the top-k output, the caches or the counters."""
    stack = IndexerStack(candidate_source=True, consumers=1)
    warmed, gen = random_tape_runner(TWO_LEVEL, stack, seed=5, num_pages=64)
    fresh = IndexerGraphRunner(
        TWO_LEVEL, stack, [c.clone() for c in warmed.kv_caches], "cpu", graph_backend="tape",
        capture_sizes=warmed.capture_sizes,
    )  # fmt: skip
    fresh.capture()
    views = warmed.input_views(TWO_LEVEL.max_num_batched_tokens)
    for view in views:
        view.weights.uniform_(0.1, 1.0)
        view.q.random_(0, 256)
    before = {name: warmed.buffers[name].clone() for name in warmed.buffers.names()}
    caches = [c.clone() for c in warmed.kv_caches]
    steps = candidate_steps(TWO_LEVEL, gather_width=warmed.builder.min_gather_width)[::40]
    report = warmup(warmed, steps=steps)
    assert report.steps == len(steps) > 5
    kept = [n for n in before if not n.startswith(("workspace.", "builder."))]
    assert "topk" in kept and "q.0" in kept and "seq_lens" in kept and "num_live_reqs" in kept
    for name in kept:
        assert torch.equal(warmed.buffers[name], before[name]), name
    for cache, copy in zip(warmed.kv_caches, caches, strict=True):
        assert torch.equal(cache, copy)
    assert warmed.counters.steps == 0 and not warmed.graphs.stats().eager_fallbacks
    for case in gen.cases(24):
        want = fresh.step(case.batch, case.inputs)
        got = warmed.step(case.batch, case.inputs)
        assert got.replayed == want.replayed, case.kind
        assert torch.equal(_sorted(got.topk), _sorted(want.topk)), case.kind


def test_an_eager_step_reads_any_caller_table_layout_alike() -> None:
    """Eager steps copy the caller's block table into the persistent one: a contiguous
    table, the same ids in a strided, misaligned view with garbage past them, and a step
    after a wider one (stale columns) all give the same top-k."""
    stack = IndexerStack(candidate_source=True, consumers=1)
    runner, gen = random_tape_runner(TWO_LEVEL, stack, seed=6, num_pages=64)
    case = gen.case("mixed")
    b = case.batch
    want = _sorted(runner.step(b, case.inputs).topk)
    reqs, cols = b.block_table.shape
    flat = torch.full((reqs * (cols + 3) + 1,), 10**6, dtype=torch.int32)
    strided = flat[1:].as_strided((reqs, cols), (cols + 3, 1))
    strided.copy_(b.block_table)
    odd = StepBatch(
        b.query_start_loc_cpu, b.seq_lens_upper_bound, b.query_start_loc, b.seq_lens, strided,
        config=TWO_LEVEL, num_pages=b.num_pages, validate=False,
    )  # fmt: skip
    wider = gen.case("prefill")
    runner.step(wider.batch, wider.inputs)  # leaves stale columns past a narrower table
    assert torch.equal(_sorted(runner.step(odd, case.inputs).topk), want)


def test_workers_are_checked_and_the_cpu_compiles_in_process() -> None:
    runner, _ = random_tape_runner(
        TWO_LEVEL, IndexerStack(candidate_source=True, consumers=1), seed=0, capture=False
    )
    assert pool_workers(runner, 8) == 1 and pool_workers(runner, None) == 1
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="workers must be"):
            warmup(runner, workers=bad)  # type: ignore[arg-type]
    report = warmup(runner)  # the reference kernels: nothing to compile, nothing run
    assert report.skipped is not None and report.steps == 0
    assert "skipped" in report.summary()


def test_the_pool_owns_every_key_once_with_a_step_that_launches_it() -> None:
    steps = [WarmupStep((3,), (64 * i,), f"s{i}") for i in range(1, 6)]
    keys = {
        step: frozenset((f"k{j % 3}", ((str(j), i),)) for j in range(i + 2))
        for i, step in enumerate(steps)
    }
    every = set().union(*keys.values())
    for workers in (1, 2, 3, 64):
        shares = assign_keys(keys, workers)  # type: ignore[arg-type]
        assert len(shares) == min(workers, len(every))
        owned = [key for _, share in shares for key in share]
        assert sorted(owned, key=repr) == sorted(every, key=repr)  # each key exactly once
        for items, share in shares:
            launched = set().union(*(keys[item] for item in items))  # type: ignore[index]
            assert share <= launched
        sizes = [len(share) for _, share in shares]
        assert max(sizes) - min(sizes) <= 1


@needs_interpreter
def test_the_pool_workers_rebuild_the_runner_and_meet_every_key() -> None:
    """Two spawned workers, each its own runner from the pickled job (caches of one page, the
    same layout): every key of the plan and of the capture sizes is met, hence compiled
    (`kernel.warmup`; a no-op under the interpreter), by the worker that owns it."""
    runner, _ = random_tape_runner(
        TWO_LEVEL, IndexerStack(candidate_source=True, consumers=1), seed=8, capture=False,
        capture_sizes=CaptureSizes(max_size=8, uniform_query_len=TWO_LEVEL.next_n),
        ops_backend="triton",
    )  # fmt: skip
    plan = plan_warmup(runner, WarmupScratch.for_runner(runner))
    add_capture_keys(runner, plan, runner.capture_sizes.shapes())
    every = set().union(*plan.keys.values())
    progress: list[tuple[str, int, int]] = []
    compiled = compile_in_pool(runner, plan, 2, lambda *p: progress.append(p))
    assert compiled == len(every) > len(set().union(*(plan.keys[s] for s in plan.steps)))
    assert progress[-1] == ("compile", len(every), len(every))


def test_candidates_stay_inside_the_config() -> None:
    """Every candidate is a step the config allows: rows within the token budget, requests
    within max_num_seqs, contexts within max_model_len, decodes before prefills."""
    for config in (TWO_LEVEL, DENSE, IndexerConfig.deepseek_v41_flash(max_num_seqs=64)):
        steps = candidate_steps(config, gather_width=24576)
        assert len(steps) == len(set(steps)) > 50
        for step in steps:
            assert 0 < step.num_tokens <= config.max_num_batched_tokens, step
            assert len(step.query_lens) <= config.max_num_seqs, step
            for q, s in zip(step.query_lens, step.seq_lens, strict=True):
                assert 0 < q <= s <= config.max_model_len, step
