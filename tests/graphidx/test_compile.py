"""torch.compile over the indexer layers (issue 6), on the CPU with the reference ops.

`torch.compile(fullgraph=True)` must trace both layer entry points — `dense_indexer` (plain
and as the candidate source) and `candidate_consumer` (resolving the pool, and reusing it) —
without a graph break, with every kernel a custom op in the graph, and the compiled layers
must write exactly what the eager ones write (top-k sets per row, the source's candidate
blocks). Steps mix decode rows (native and flattened) and prefill chunks cut by a small
`max_logits_bytes`, with both consumer paths (gather and dense + mask). Bad input is still
refused under compile, with the argument named. Last, the tape backend records a compiled
callable, and the runner captures and replays its compiled step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from helpers import small_dense_config

from capture import CaptureSizes, GraphCache, StepShape
from capture.backends.tape import Tape
from graphidx.batch import StepBatch
from graphidx.builder import CandidateIndexerMetadataBuilder, IndexerMetadataBuilder
from graphidx.config import IndexerConfig, cdiv
from graphidx.indexer import candidate_consumer, dense_indexer
from graphidx.metadata import IndexerMetadata
from graphidx.ops.backend import resolve_backend, triton_interpreted
from graphidx.runner import IndexerStack, LayerInput
from graphidx.testing import (
    check_replay,
    random_kv_cache,
    random_layer_input,
    random_tape_runner,
)
from graphidx.workspace import IndexerWorkspace

SENTINEL = -777

SCALE: dict[str, int] = dict(
    num_heads=4, head_dim=64, topk_tokens=16, max_logits_bytes=16 * 1024, max_num_seqs=8,
    max_num_batched_tokens=256,
)  # fmt: skip
"""What both configs share: 4 heads of 64, top-16, 16 KiB of logits, 8 requests of 256."""
# Two-level: a pool of 4 blocks of 8 = 32 columns, so decode rows gather from a widest
# context of 96 and prefill chunks from a width of 48; 16 KiB of logits cuts prefill chunks.
CANDIDATE_CONFIG = IndexerConfig.cpu_demo(**SCALE, max_model_len=1024, candidate_topk_blocks=4)
DENSE_CONFIG = small_dense_config(
    **SCALE, compress_ratio=2, block_size=128, max_model_len=2048, num_speculative_tokens=2
)


@dataclass
class Step:
    config: IndexerConfig
    batch: StepBatch
    metadata: IndexerMetadata
    inputs: list[LayerInput]
    caches: list[torch.Tensor]
    workspace: IndexerWorkspace


def _step(config: IndexerConfig, query_lens: list[int], seq_lens: list[int], layers: int) -> Step:
    gen = torch.Generator().manual_seed(6)
    pages = sum(cdiv(s // config.compress_ratio, config.page_entries) for s in seq_lens) + 1
    batch = StepBatch.from_lists(config, query_lens, seq_lens, num_pages=pages)
    builder_type = (
        CandidateIndexerMetadataBuilder if config.has_candidates else IndexerMetadataBuilder
    )
    metadata = builder_type(config, "cpu", num_pages=pages).build(batch)
    inputs = [random_layer_input(config, batch.num_tokens, "cpu", gen) for _ in range(layers)]
    caches = [random_kv_cache(config, pages, "cpu", gen) for _ in range(layers)]
    return Step(config, batch, metadata, inputs, caches, IndexerWorkspace(config, "cpu"))


def _mixed_candidate_step() -> Step:
    # Decodes with next_n = 2 (short and long contexts), then a prefill too narrow to gather
    # and a long one that gathers and is cut into several chunks.
    step = _step(CANDIDATE_CONFIG, [2, 2, 2, 30, 20], [40, 300, 700, 30, 500], layers=3)
    md = step.metadata
    assert md.decode_use_gather and md.plans and md.gather_launches
    assert any(not plan.use_gather for plan in md.plans)
    return step


def _mixed_dense_step() -> Step:
    # next_n = 3: a uniform (native) decode part, then prefills over several chunks.
    return _step(DENSE_CONFIG, [3, 3, 40, 25], [90, 1500, 300, 900], layers=1)


def _poison(workspace: IndexerWorkspace) -> None:
    for tensor in workspace.buffers().values():
        tensor.fill_(float("nan") if tensor.is_floating_point() else SENTINEL)


LayerFn = Callable[..., None]


def _run_candidate_stack(step: Step, source: LayerFn, consumer: LayerFn) -> list[torch.Tensor]:
    """Source, first consumer (resolves the pool), second consumer (reuses it); returns the
    three top-k outputs and the source's candidate blocks."""
    cfg, md, tokens = step.config, step.metadata, step.batch.num_tokens
    _poison(step.workspace)
    outs = [torch.full((tokens, cfg.topk_tokens), SENTINEL, dtype=torch.int32) for _ in range(3)]
    for i in range(3):
        inp = step.inputs[i]
        args = (md, inp.q, inp.q_scale, inp.weights, step.caches[i], outs[i], step.workspace)
        if i == 0:
            source(*args, config=cfg, candidate_source=True)
        else:
            consumer(*args, config=cfg, resolve_pool=i == 1)
    assert step.workspace.candidate_ids is not None
    return [*outs, step.workspace.candidate_ids[:tokens].clone()]


def _run_dense(step: Step, layer: LayerFn) -> list[torch.Tensor]:
    cfg, tokens = step.config, step.batch.num_tokens
    _poison(step.workspace)
    out = torch.full((tokens, cfg.topk_tokens), SENTINEL, dtype=torch.int32)
    inp = step.inputs[0]
    layer(step.metadata, inp.q, inp.q_scale, inp.weights, step.caches[0], out, step.workspace)
    return [out]


def _assert_same_rows(eager: list[torch.Tensor], compiled: list[torch.Tensor]) -> None:
    for index, (want, got) in enumerate(zip(eager, compiled, strict=True)):
        assert not bool((want == SENTINEL).any()), f"output {index}: eager left rows unwritten"
        assert bool((want >= 0).any()), f"output {index}: eager picked nothing"
        want_sorted = torch.sort(want, dim=-1).values
        got_sorted = torch.sort(got, dim=-1).values
        differs = (want_sorted != got_sorted).any(dim=-1).nonzero().flatten().tolist()
        assert not differs, f"output {index}: compiled != eager on rows {differs[:10]}"


class GraphLog:
    """A torch.compile backend that keeps every traced graph, then hands it to `inner`."""

    def __init__(self, inner: str) -> None:
        self.inner = torch._dynamo.lookup_backend(inner)
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        self.graphs.append(gm)
        return self.inner(gm, example_inputs)

    def custom_ops(self) -> set[str]:
        """Names of the graphidx custom ops called in the traced graphs."""
        names = set()
        for gm in self.graphs:
            for node in gm.graph.nodes:
                target = str(node.target)
                if node.op == "call_function" and "graphidx." in target:
                    names.add(target.split("graphidx.")[1].split(".")[0])
        return names


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    # Compiled code is cached per code object (dense_indexer's, shared by every test):
    # start each test from an empty cache so recompile limits and guards never leak.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile(fn: LayerFn, backend: str | Callable[..., object], **bound: object) -> LayerFn:
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    return lambda *args, **kwargs: compiled(*args, **bound, **kwargs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_candidate_layers_compile_fullgraph_equal_to_eager(backend: str) -> None:
    step = _mixed_candidate_step()
    eager = _run_candidate_stack(step, dense_indexer, candidate_consumer)
    log = GraphLog(backend)
    compiled_source = _compile(dense_indexer, log)
    compiled_consumer = _compile(candidate_consumer, log)
    compiled = _run_candidate_stack(step, compiled_source, compiled_consumer)
    _assert_same_rows(eager, compiled)
    # One graph per entry point and pool mode (fullgraph: no break could split one).
    assert len(log.graphs) == 3
    assert log.custom_ops() == {
        "paged_mqa_logits",
        "topk_per_row",
        "resolve_candidate_pool",
        "gather_mqa_logits",
        "remap_compact_topk",
        "apply_candidate_mask",
    }
    # A second step of the same structure reuses the compiled graphs.
    compiled = _run_candidate_stack(step, compiled_source, compiled_consumer)
    _assert_same_rows(eager, compiled)
    assert len(log.graphs) == 3


def test_dense_indexer_compiles_fullgraph_equal_to_eager() -> None:
    step = _mixed_dense_step()
    md = step.metadata
    assert md.decode is not None and md.decode.native is not None and len(md.plans) > 2
    eager = _run_dense(step, lambda *args: dense_indexer(*args, config=step.config))
    log = GraphLog("aot_eager")
    compiled = _run_dense(step, _compile(dense_indexer, log, config=step.config))
    _assert_same_rows(eager, compiled)
    assert len(log.graphs) == 1
    assert log.custom_ops() == {"paged_mqa_logits", "topk_per_row"}


@pytest.mark.parametrize("name", [None, "reference", "triton"])
def test_backend_resolution_traces_cleanly(name: str | None) -> None:
    # The layers resolve their ops' backend inside the traced region: no graph break, and
    # no cached call that dynamo would trace through with a warning.
    if name == "triton" and not triton_interpreted():
        pytest.skip("triton on CPU tensors needs TRITON_INTERPRET=1")
    x = torch.arange(3.0)

    def add_name_length(x: torch.Tensor) -> torch.Tensor:
        return x + len(resolve_backend(name, x.device))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.compile(add_name_length, fullgraph=True, backend="eager")(x)
    assert torch.equal(got, x + len(resolve_backend(name, x.device)))


def test_bad_input_is_still_refused_under_compile() -> None:
    step = _mixed_dense_step()
    inp = step.inputs[0]
    out = torch.empty(step.batch.num_tokens, DENSE_CONFIG.topk_tokens, dtype=torch.int32)
    compiled = torch.compile(dense_indexer, fullgraph=True, backend="aot_eager")
    # Validation runs while tracing, before any kernel; under fullgraph torch reports the
    # ValueError through its own exception type, with the message kept.
    with pytest.raises(Exception, match=r"q has 2 heads of 64, config says 4 of 64"):
        compiled(
            step.metadata,
            inp.q[:, :2],
            inp.q_scale[:, :2],
            inp.weights[:, :2],
            step.caches[0],
            out,
            step.workspace,
            config=DENSE_CONFIG,
        )
    wrong = IndexerWorkspace(DENSE_CONFIG.replace(topk_tokens=8), "cpu")
    with pytest.raises(Exception, match="workspace was sized for a different config"):
        compiled(
            step.metadata,
            inp.q,
            inp.q_scale,
            inp.weights,
            step.caches[0],
            out,
            wrong,
            config=DENSE_CONFIG,
        )


def test_tape_records_compiled_layers_and_replays_new_inputs() -> None:
    # A decode-only step: the tape replays it with fresh q / weights written in place.
    step = _step(CANDIDATE_CONFIG, [2, 2, 2], [50, 400, 900], layers=3)
    cfg, tokens = step.config, step.batch.num_tokens
    outs = [torch.full((tokens, cfg.topk_tokens), SENTINEL, dtype=torch.int32) for _ in range(3)]
    source = _compile(dense_indexer, "eager")
    consumer = _compile(candidate_consumer, "eager")

    def layers(source: LayerFn, consumer: LayerFn) -> None:
        for i, inp in enumerate(step.inputs):
            args = (step.metadata, inp.q, inp.q_scale, inp.weights, step.caches[i], outs[i])
            if i == 0:
                source(*args, step.workspace, config=cfg, candidate_source=True)
            else:
                consumer(*args, step.workspace, config=cfg, resolve_pool=i == 1)

    graphs = GraphCache("tape")
    shape = StepShape(tokens, step.batch.num_reqs, cfg.next_n)
    graphs.capture(shape, lambda: layers(source, consumer))
    tape = graphs.graph(shape)
    assert isinstance(tape, Tape)
    assert "graphidx.gather_mqa_logits.default" in tape.op_names()

    gen = torch.Generator().manual_seed(66)
    for inp in step.inputs:
        fresh = random_layer_input(cfg, tokens, "cpu", gen)
        for name in ("q", "q_scale", "weights"):
            getattr(inp, name).copy_(getattr(fresh, name))
    for out in outs:
        out.fill_(SENTINEL)
    _poison(step.workspace)
    graphs.replay(shape)
    replayed = [out.clone() for out in outs]
    layers(dense_indexer, candidate_consumer)
    _assert_same_rows([out.clone() for out in outs], replayed)


def test_runner_captures_and_replays_a_compiled_step() -> None:
    torch._dynamo.utils.counters.clear()
    config = CANDIDATE_CONFIG
    stack = IndexerStack(candidate_source=True, consumers=1)
    sizes = CaptureSizes([4, 8, 16], max_size=16, uniform_query_len=config.next_n)
    runner, gen = random_tape_runner(
        config,
        stack,
        seed=6,
        num_pages=48,
        max_context=1000,
        capture_sizes=sizes,
        compile_layers=True,
    )
    assert len(runner.graphs) == 3
    # The layers really went through dynamo (one graph or more: shapes may recompile).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    report = check_replay(runner, [gen.case("decode") for _ in range(3)])
    assert report.ok, report.mismatches[:5]
    assert report.replayed >= 1
