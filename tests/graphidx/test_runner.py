"""IndexerGraphRunner on the tape backend: padding, replay vs eager, and a planted bug."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from capture import CaptureSizes, StepShape
from graphidx.batch import StepBatch
from graphidx.builder import CandidateIndexerMetadataBuilder, CapturedDecode
from graphidx.cli.replay_check import run_replay_check
from graphidx.config import IndexerConfig
from graphidx.runner import IndexerGraphRunner, IndexerStack
from graphidx.testing import StepGenerator, check_replay, random_tape_runner

CONFIG = IndexerConfig.cpu_demo(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=2048)
STACK = IndexerStack(candidate_source=True, consumers=2)


def _setup(
    seed: int = 0, *, config: IndexerConfig = CONFIG, max_size: int = 16, **runner_kw: object
) -> tuple[IndexerGraphRunner, StepGenerator]:
    sizes = CaptureSizes(max_size=max_size, uniform_query_len=config.next_n)
    return random_tape_runner(config, STACK, seed=seed, capture_sizes=sizes, **runner_kw)


def test_uniform_decode_is_padded_and_replayed() -> None:
    runner, gen = _setup()
    case = gen.case("decode")
    while case.batch.num_reqs * CONFIG.next_n > 16 or case.batch.num_reqs == 4:
        case = gen.case("decode")
    result = runner.step(case.batch, case.inputs)
    assert result.replayed
    assert result.shape is not None and result.shape.uniform_query_len == CONFIG.next_n
    assert result.shape.num_tokens >= case.num_real_tokens
    assert result.padded_tokens == result.shape.num_tokens - case.num_real_tokens
    assert runner.counters.replayed == 1
    # Real rows see only their own context; padding rows stay empty.
    topk = result.topk
    assert topk.shape == (STACK.num_layers, case.num_real_tokens, CONFIG.topk_tokens)
    pad = runner.topk_buffer[:, case.num_real_tokens : result.shape.num_tokens]
    assert bool((pad == -1).all())


def test_other_steps_run_eagerly_with_a_reason() -> None:
    runner, gen = _setup(seed=1)
    case = gen.case("prefill")
    result = runner.step(case.batch, case.inputs)
    assert not result.replayed and result.eager_reason == "not a uniform decode step"
    assert runner.graphs.stats().eager_fallbacks.get("not a uniform decode step") == 1


def test_eager_steps_check_their_inputs_but_cache_no_views() -> None:
    """Prefill and mixed steps run eagerly on the caller's inputs: they are checked (the same
    ValueError), but no persistent view of their size is made or kept, so a long run of
    varied prefill sizes does not grow the runner's caches."""
    runner, gen = _setup(seed=4)
    cached = (dict(runner._views), dict(runner._bytes))
    for kind in ("prefill", "mixed", "prefill", "mixed"):
        case = gen.case(kind)
        assert not runner.step(case.batch, case.inputs).replayed
    assert (runner._views, runner._bytes) == cached
    case = gen.case("prefill")
    bad = [dataclasses.replace(i, weights=i.weights.double()) for i in case.inputs]
    with pytest.raises(ValueError, match=r"layer_inputs\[0\]\.weights must be torch.float32"):
        runner.step(case.batch, bad)


def test_replay_equals_eager_on_random_steps() -> None:
    runner, gen = _setup(seed=2)
    report = check_replay(runner, gen.cases(40))
    assert report.ok, report.mismatches[:5]
    assert report.replayed > 0


def test_planted_shape_bug_is_caught() -> None:
    """A builder whose captured decode width comes from the capture-time lengths (a host
    value, not the shape) replays that narrow width on longer contexts: the harness must
    see it."""

    class LengthDependentBuilder(CandidateIndexerMetadataBuilder):
        def uniform_decode(self, num_reqs, seq_lens, block_table, num_live_reqs, **options):  # type: ignore[no-untyped-def]
            captured = super().uniform_decode(
                num_reqs, seq_lens, block_table, num_live_reqs, **options
            )
            width = max(1, int(seq_lens.max()) // self.config.compress_ratio)
            decode = dataclasses.replace(captured.metadata.decode, width=width)
            metadata = dataclasses.replace(captured.metadata, decode=decode)
            return CapturedDecode(metadata, captured.derive)

    runner, gen = random_tape_runner(CONFIG, STACK, seed=3, capture=False)
    runner.builder = LengthDependentBuilder(
        CONFIG, "cpu", num_pages=runner.num_pages, full_graph_decode=True
    )
    runner.capture()
    report = check_replay(runner, gen.cases(20, kinds=("decode",)))
    assert report.replayed > 0
    assert not report.ok
    # The padded eager step runs the same captured-shape metadata, so it differs too.
    kinds = {m.what for m in report.mismatches}
    assert "replay != unpadded eager" in kinds
    assert kinds <= {"replay != unpadded eager", "padded eager != unpadded eager"}


def test_layer_inputs_are_checked() -> None:
    runner, gen = _setup(seed=4)
    case = gen.case("decode")
    with pytest.raises(ValueError, match="layer_inputs has 1 entries for 3 indexer layers"):
        runner.step(case.batch, case.inputs[:1])
    bad = case.inputs[0].__class__(
        case.inputs[0].q, case.inputs[0].q_scale, case.inputs[0].weights.double()
    )
    with pytest.raises(ValueError, match=r"layer_inputs\[0\].weights must be torch.float32"):
        runner.step(case.batch, (bad, *case.inputs[1:]))
    as_tuples = [(i.q, i.q_scale, i.weights) for i in case.inputs]
    with pytest.raises(ValueError, match=r"layer_inputs\[0\] must be a LayerInput"):
        runner.step(case.batch, as_tuples)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"batch must be a StepBatch"):
        runner.step({}, case.inputs)  # type: ignore[arg-type]


def test_capture_sizes_must_match_next_n() -> None:
    gen = StepGenerator(CONFIG, STACK, num_pages=8)
    with pytest.raises(ValueError, match="uniform_query_len"):
        IndexerGraphRunner(
            CONFIG,
            STACK,
            gen.kv_caches(),
            "cpu",
            graph_backend="tape",
            capture_sizes=CaptureSizes(max_size=16, uniform_query_len=1),
        )


def test_stack_validation() -> None:
    with pytest.raises(ValueError, match="consumers need a candidate_source"):
        IndexerStack(consumers=2)
    with pytest.raises(ValueError, match="at least one layer"):
        IndexerStack()
    assert IndexerStack(dense=1, candidate_source=True, consumers=2).kinds == (
        "dense",
        "source",
        "consumer",
        "consumer",
    )


def test_constructor_refuses_what_would_fail_later() -> None:
    """Errors at construction, naming the option: not at capture or at the first step."""
    gen = StepGenerator(CONFIG, STACK, num_pages=8)
    caches = gen.kv_caches()

    def build(kv_caches: object = caches, **options: object) -> IndexerGraphRunner:
        return IndexerGraphRunner(CONFIG, STACK, kv_caches, "cpu", graph_backend="tape", **options)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="backend must be one of"):
        build(ops_backend="cuda-magic")
    with pytest.raises(ValueError, match=r"kv_caches\[1\] has shape .* a page needs"):
        build([caches[0], caches[1][:, :16], caches[2]])
    with pytest.raises(ValueError, match=r"kv_caches\[0\] must be a 2-D uint8 tensor"):
        build([caches[0].numpy(), caches[1], caches[2]])
    with pytest.raises(ValueError, match="kv_caches has 2 caches for 3 indexer layers"):
        build(caches[:2])
    with pytest.raises(ValueError, match="stack must be an IndexerStack"):
        IndexerGraphRunner(CONFIG, "stack", caches, "cpu", graph_backend="tape")  # type: ignore[arg-type]


def test_a_step_above_the_largest_capture_size_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner, gen = _setup(seed=12, max_size=4)
    case = gen.case("decode")
    while case.num_real_tokens <= 4:
        case = gen.case("decode")
    with caplog.at_level("WARNING", logger="graphidx.runner"):
        for _ in range(3):
            result = runner.step(case.batch, case.inputs)
            assert not result.replayed
            assert result.eager_reason == "above the largest capture size"
    warnings = [r for r in caplog.records if "exceed the largest capture size" in r.message]
    assert len(warnings) == 1


def test_replay_check_1000_cases(capsys: pytest.CaptureFixture[str]) -> None:
    """The harness over every shape of `graphidx replay-check` (R 1/2/4, dense and
    candidate stacks, adaptive verification): 1000 random cases, no mismatch."""
    mismatches = run_replay_check(
        backend="tape", cases=1000, seed=7, device=torch.device("cpu"), progress=False
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "1000 cases, 0 mismatches"
    assert mismatches == 0


def test_step_shape_key() -> None:
    runner, _ = _setup(seed=5)
    assert StepShape(16, 8, CONFIG.next_n) in runner.graphs


def test_a_replay_that_does_nothing_is_caught() -> None:
    """check_replay poisons the shared top-k buffer before every run: a graph whose replay
    writes nothing cannot pass on the eager run's answer."""
    runner, gen = _setup(seed=6)

    class DoNothing:
        num_bytes = None
        num_ops = None

        def replay(self) -> None:
            return None

    for cached in runner.graphs._graphs.values():
        cached.graph = DoNothing()  # type: ignore[assignment]
    report = check_replay(runner, gen.cases(6, kinds=("decode",)))
    assert report.replayed > 0
    assert not report.ok


def test_step_refuses_a_batch_validated_for_another_cache_or_config() -> None:
    runner, gen = _setup(seed=8)
    case = gen.case("decode")
    b = case.batch

    def unchecked(config: IndexerConfig, num_pages: int | None = None) -> StepBatch:
        """The case's step tensors under `config` and `num_pages`, not validated."""
        return StepBatch(
            b.query_start_loc_cpu,
            b.seq_lens_upper_bound,
            b.query_start_loc,
            b.seq_lens,
            b.block_table,
            config=config,
            num_tokens=b.num_tokens,
            num_pages=num_pages,
            validate=False,
        )

    with pytest.raises(ValueError, match=r"batch\.num_pages = None"):
        runner.step(unchecked(CONFIG), case.inputs)
    with pytest.raises(ValueError, match="num_pages"):
        runner.step(unchecked(CONFIG, runner.num_pages + 1), case.inputs)
    foreign = unchecked(CONFIG.replace(block_size=128), runner.num_pages)
    with pytest.raises(ValueError, match=r"batch\.config differs"):
        runner.step(foreign, case.inputs)


def _replayable_decode(gen: StepGenerator) -> object:
    case = gen.case("decode")
    while case.batch.num_reqs * CONFIG.next_n > 16:
        case = gen.case("decode")
    return case


def _ops_outside_replay(runner: IndexerGraphRunner, step: Callable[[], object]) -> Counter[str]:
    """The non-view torch ops `step()` dispatches, not counting the graph replay itself."""
    ops: Counter[str] = Counter()
    counting = True
    replay = runner.graphs.replay

    def uncounted_replay(shape: StepShape) -> None:
        nonlocal counting
        counting = False
        try:
            replay(shape)
        finally:
            counting = True

    class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if counting and not func.is_view:
                ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    runner.graphs.replay = uncounted_replay  # type: ignore[method-assign]
    try:
        with CountOps():
            step()
    finally:
        runner.graphs.replay = replay  # type: ignore[method-assign]
    return ops


def test_a_replayed_step_dispatches_only_its_copies() -> None:
    """Host work of a replayed step: the raw-input copies and the live count when it changed,
    nothing else (no planning ops, no zero-fills, no index vectors, no per-row block table)."""
    runner, gen = _setup(seed=9)
    case = _replayable_decode(gen)
    want = torch.sort(runner.step(case.batch, case.inputs).topk.long(), -1).values.clone()
    n = case.num_real_tokens
    views = runner.input_views(n)
    for view, given in zip(views, case.inputs, strict=True):
        for name in ("q", "q_scale", "weights"):
            getattr(view, name).copy_(getattr(given, name)[:n])

    # The contiguous copies (seq_lens; with the inputs, every q / q_scale / weights) go in one
    # foreach; the case's block table is narrower than the runner's, so it is a copy of its own.
    assert case.batch.block_table.shape[1] < runner.buffers["block_table"].shape[1]
    one_foreach_and_the_table = Counter({"_foreach_copy_": 1, "copy_": 1})
    in_place = _ops_outside_replay(runner, lambda: runner.step(case.batch, views))
    assert in_place == one_foreach_and_the_table  # same live count: no fill
    copied = _ops_outside_replay(runner, lambda: runner.step(case.batch, case.inputs))
    assert copied == one_foreach_and_the_table
    full_width = dataclasses.replace(
        case.batch,
        block_table=runner.buffers["block_table"][: case.batch.num_reqs].clone(),
        validate=False,
    )
    whole = _ops_outside_replay(runner, lambda: runner.step(full_width, case.inputs))
    assert whole == Counter({"_foreach_copy_": 1})
    assert runner.counters.replayed == 4
    got = torch.sort(runner.step(case.batch, views).topk.long(), -1).values
    assert torch.equal(got, want)
    other = _replayable_decode(gen)
    while other.batch.num_real_reqs == case.batch.num_real_reqs:
        other = _replayable_decode(gen)
    changed = _ops_outside_replay(runner, lambda: runner.step(other.batch, other.inputs))
    assert changed == one_foreach_and_the_table + Counter({"fill_": 1})  # + live count
    with pytest.raises(ValueError, match="num_tokens = -1"):
        runner.input_views(-1)


def test_inputs_of_any_layout_are_copied_exactly() -> None:
    """A replayed step copies layer inputs whatever their layout: taller than the step,
    strided (through one `copy_` each, next to the foreach), or partly the runner's own
    views already (those fields are not copied); every form gives the contiguous answer."""
    runner, gen = _setup(seed=12)
    case = _replayable_decode(gen)
    n = case.num_real_tokens
    # The unpadded eager step reads the inputs themselves: no copy path is trusted.
    want = torch.sort(runner.step(case.batch, case.inputs, pad=False).topk.long(), -1)
    want = want.values.clone()

    def taller(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:n], torch.full_like(t[:3], 7)])

    def strided(t: torch.Tensor) -> torch.Tensor:
        wide = torch.zeros((t.shape[0], *t.shape[1:-1], 2 * t.shape[-1]), dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]

    views = runner.input_views(n)
    mixed = []
    for i, inp in enumerate(case.inputs):
        views[i].weights.copy_(inp.weights[:n])
        mixed.append(dataclasses.replace(inp, q=strided(inp.q), weights=views[i].weights))
    forms = {
        "taller": [dataclasses.replace(i, q=taller(i.q), q_scale=taller(i.q_scale),
                                       weights=taller(i.weights)) for i in case.inputs],
        "strided": [dataclasses.replace(i, q_scale=strided(i.q_scale)) for i in case.inputs],
        "mixed": mixed,
    }  # fmt: skip
    for name, inputs in forms.items():
        for view in runner.input_views(n):
            view.q.fill_(0xFF)
            view.q_scale.fill_(0)
        if name != "mixed":
            for view in runner.input_views(n):
                view.weights.fill_(float("nan"))
        result = runner.step(case.batch, inputs)
        assert result.replayed, name
        assert torch.equal(torch.sort(result.topk.long(), -1).values, want), name


def test_garbage_in_derived_buffers_and_padding_cannot_change_a_replay() -> None:
    """The graph recomputes every derived value: poisoning the builder's buffers, the
    padding requests' raw inputs and the padding rows' q leaves the answer unchanged."""
    runner, gen = _setup(seed=11)
    case = _replayable_decode(gen)
    sizes = runner.capture_sizes
    while sizes.pad(case.num_real_tokens).num_tokens == case.num_real_tokens:  # needs padding
        case = _replayable_decode(gen)
    first = runner.step(case.batch, case.inputs)
    assert first.replayed and first.padded_tokens > 0
    want = torch.sort(first.topk.long(), -1).values.clone()
    torch.manual_seed(0)
    for tensor in runner.builder.buffers().values():
        tensor.copy_(torch.randint(-(2**20), 2**20, tensor.shape, dtype=tensor.dtype))
    live, rows = case.batch.num_reqs, case.num_real_tokens
    b = runner.buffers
    b["seq_lens"][live:].fill_(CONFIG.max_model_len)
    b["block_table"][live:].fill_(10**6)
    for i in range(STACK.num_layers):
        b[f"q.{i}"][rows:].fill_(0x77)
        b[f"weights.{i}"][rows:].fill_(float("nan"))
    again = runner.step(case.batch, case.inputs)
    assert again.replayed
    assert torch.equal(torch.sort(again.topk.long(), -1).values, want)
    assert bool((runner.topk_buffer[:, rows : again.shape.num_tokens] == -1).all())


ADAPTIVE = IndexerConfig.cpu_demo(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=2048,
    adaptive_verification=True,
    num_speculative_tokens=2,
)


def test_adaptive_draft_reallocation_replays_exactly() -> None:
    """Host offsets a uniform placeholder, device offsets the reallocated drafts: the
    replayed graph follows the device rows and equals the eager step over the real rows."""
    runner, gen = _setup(seed=5, config=ADAPTIVE, max_size=24)
    report = check_replay(runner, gen.cases(12, kinds=("adaptive",)))
    assert report.ok, report.mismatches[:5]
    assert report.replayed == 12


def test_adaptive_rows_from_the_host_placeholder_are_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A captured step that trusted the host's uniform offsets would own the rows wrongly:
    the harness must see it."""
    import graphidx.builder as builder_module

    derive = builder_module.derive_request_rows

    def from_placeholder(seq_lens, live, offsets, next_n, *args, **kwargs):  # type: ignore[no-untyped-def]
        uniform = torch.arange(0, (seq_lens.shape[0] + 1) * next_n, next_n, dtype=torch.int32)
        return derive(seq_lens, live, uniform, next_n, *args, **kwargs)

    monkeypatch.setattr(builder_module, "derive_request_rows", from_placeholder)
    runner, gen = _setup(seed=6, config=ADAPTIVE, max_size=24)
    report = check_replay(runner, gen.cases(6, kinds=("adaptive",)))
    assert not report.ok


def test_adaptive_step_above_the_largest_capture_size_follows_the_device_rows() -> None:
    """An adaptive step too large for any graph runs eagerly, and still by the device
    offsets: the host planner would take the uniform placeholder for the real rows."""
    runner, gen = _setup(seed=8, config=ADAPTIVE, max_size=6)
    cases = [c for c in gen.cases(40, kinds=("adaptive",)) if c.batch.num_tokens > 6]
    reallocated = [
        c
        for c in cases[:8]
        if not torch.equal(c.reference.query_start_loc_cpu, c.batch.query_start_loc_cpu)
    ]
    assert len(cases) >= 5 and reallocated, "the cases must reallocate drafts above the ladder"
    report = check_replay(runner, cases[:8])
    assert report.ok, report.mismatches[:5]
    assert report.replayed == 0
    reasons = runner.graphs.stats().eager_fallbacks
    assert reasons.get("above the largest capture size") == min(len(cases), 8)


def test_harness_runs_both_precisions_where_the_device_can() -> None:
    """`replay-check` builds exact and fp8 runners where fp8 kernels run (on a CPU the
    reference would repeat the exact ones: exact alone), the adaptive shape captures below
    its largest steps, and a bad choice is refused."""
    from graphidx.cli.replay_check import harness_precisions, harness_shapes

    cpu = torch.device("cpu")
    assert harness_precisions("both", cpu) == ("exact",)
    assert harness_precisions("exact", cpu) == ("exact",)
    assert harness_precisions("fp8", cpu) == ("fp8",)
    shapes = harness_shapes(cpu, ("exact", "fp8"))
    assert len(shapes) == 6
    assert {s.config.precision for s in shapes} == {"exact", "fp8"}
    assert all(s.name.endswith(" fp8") == (s.config.precision == "fp8") for s in shapes)
    adaptive = [s for s in shapes if s.config.adaptive_verification]
    assert adaptive and all(
        s.max_capture < s.config.max_num_seqs * s.config.next_n for s in adaptive
    )
    with pytest.raises(ValueError, match="precision must be one of"):
        harness_precisions("bf16", cpu)


def test_uniform_offsets_check_matches_the_diff_rule() -> None:
    """The host's uniform-step test (a byte comparison with a cached ramp) agrees with
    'every request has next_n rows', whatever the offsets' dtype and length."""
    import numpy as np

    runner, _ = _setup()
    n = CONFIG.next_n
    for dtype in (np.int32, np.int64):
        uniform = np.arange(0, 6 * n, n, dtype=dtype)
        assert runner._uniform_offsets(uniform, 5)
        ragged = uniform.copy()
        ragged[3] += 1
        assert not runner._uniform_offsets(ragged, 5)
        assert runner._uniform_offsets(ragged, 2)  # only the first `live` requests count
        long = np.arange(0, 80 * n, n, dtype=dtype)  # more requests than the cached ramp
        assert runner._uniform_offsets(long, 79)
