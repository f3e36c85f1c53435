"""Context parallel, dense layers end to end on the CPU (docs/contract.md section 10).

One random step at a time (`graphidx.testing.StepGenerator`: uniform, ragged, padded, runtime
padding forms, mixed and pure prefill; next_n 1 and 2; R 1 and 4), the single-rank K cache is
sharded into W rank caches holding the same bytes (`shard_kv_cache`), every rank plans its
share with its own builder and runs `dense_indexer` with a `ContextParallelGroup` over gloo,
and every rank's top-k must equal the W = 1 top-k on every row, exactly: the W = 1 layer runs
with its top-k in the selection order (larger score first, ties to the smaller position:
`local_topk` of one rank), since ReLU scores tie often (at 0) and the single-rank kernels
may break ties any way.
Eager widths, FULL-graph widths, the captured uniform-decode metadata (`uniform_decode`) and
that step captured on the tape backend (the exchange recorded as one op) and replayed on new
values are all covered. Bad configurations raise ValueError before any kernel runs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DcpSetup, across_gloo_ranks

from capture import GraphCache, StepShape
from graphidx.batch import StepBatch
from graphidx.builder import CandidateIndexerMetadataBuilder, IndexerMetadataBuilder
from graphidx.config import IndexerConfig
from graphidx.distributed import (
    ContextParallel,
    ContextParallelGroup,
    local_lengths,
)
from graphidx.indexer import candidate_consumer, dense_indexer
from graphidx.runner import IndexerStack, LayerInput
from graphidx.testing import (
    StepCase,
    rank_batch,
    request_contexts,
    run_gloo_ranks,
    selection_order,
    shard_kv_cache,
)
from graphidx.workspace import IndexerWorkspace

BACKEND = "reference"
KINDS = (
    "decode",
    "ragged",
    "padded",
    "mixed",
    "prefill",
    "pad-vllm-zero",
    "pad-vllm-arange",
    "pad-sglang-fill1",
)
DENSE = IndexerStack(dense=1)
SETUPS = (
    DcpSetup("spec2-s1", DENSE, 2, 1, 0, 1, seed=11, max_context=1500),
    DcpSetup("r4-s16", DENSE, 1, 4, 0, 16, seed=12, max_context=6000),
    DcpSetup("spec2-s64", DENSE, 2, 1, 0, 64, seed=13, max_context=2000),
)


# --- running one layer ------------------------------------------------------------------------


def run_dense(
    config: IndexerConfig,
    batch: StepBatch,
    kv_cache: torch.Tensor,
    layer: LayerInput,
    *,
    full_graph: bool,
    dcp: ContextParallelGroup | None = None,
) -> torch.Tensor:
    """One dense layer's top-k for `batch` through a fresh builder (eager or FULL widths)."""
    builder = IndexerMetadataBuilder(
        config, "cpu", num_pages=kv_cache.shape[0], full_graph_decode=full_graph
    )
    metadata = builder.build(batch)
    return _layer(config, metadata, kv_cache, layer, dcp)


def run_uniform(
    config: IndexerConfig,
    batch: StepBatch,
    kv_cache: torch.Tensor,
    layer: LayerInput,
    dcp: ContextParallelGroup | None = None,
) -> dict[str, torch.Tensor]:
    """A uniform decode step through `uniform_decode` (the captured shape's metadata, derived
    on the device), its last request declared padding by the live count, two ways: `captured`
    derives and runs the layer at once; `tape` captures the derive and the layer on the tape
    over other values (half the contexts, every request live, rolled queries), then writes
    the step's values into the persistent inputs and replays the tape."""
    n, next_n = batch.num_reqs, config.next_n
    builder = IndexerMetadataBuilder(config, "cpu", num_pages=kv_cache.shape[0])
    real = torch.tensor([max(1, n - 1)], dtype=torch.int32)
    direct = builder.uniform_decode(n, batch.seq_lens, batch.block_table, real, backend=BACKEND)
    direct.derive()
    results = {"captured": _layer(config, direct.metadata, kv_cache, layer, dcp)}

    seq_lens = (batch.seq_lens // 2).clamp(min=next_n)
    live = torch.tensor([n], dtype=torch.int32)
    q, q_scale, weights = (t.roll(1, 0).clone() for t in (layer.q, layer.q_scale, layer.weights))
    builder = IndexerMetadataBuilder(config, "cpu", num_pages=kv_cache.shape[0])
    captured = builder.uniform_decode(n, seq_lens, batch.block_table, live, backend=BACKEND)
    workspace = IndexerWorkspace(config, "cpu")
    out = torch.full((n * next_n, config.topk_tokens), -7, dtype=torch.int32)

    def step() -> None:
        captured.derive()
        dense_indexer(
            captured.metadata, q, q_scale, weights, kv_cache, out, workspace,
            config=config, backend=BACKEND, dcp=dcp,
        )  # fmt: skip

    graphs = GraphCache("tape")
    shape = StepShape(n * next_n, n, next_n)
    graphs.capture(shape, step)
    seq_lens.copy_(batch.seq_lens)
    live.fill_(max(1, n - 1))
    q.copy_(layer.q)
    q_scale.copy_(layer.q_scale)
    weights.copy_(layer.weights)
    out.fill_(-7)
    graphs.replay(shape)
    results["tape"] = out
    return results


def _layer(
    config: IndexerConfig,
    metadata: object,
    kv_cache: torch.Tensor,
    layer: LayerInput,
    dcp: ContextParallelGroup | None,
) -> torch.Tensor:
    workspace = IndexerWorkspace(config, "cpu")
    out = torch.full((metadata.num_tokens, config.topk_tokens), -7, dtype=torch.int32)  # type: ignore[attr-defined]
    dense_indexer(
        metadata,  # type: ignore[arg-type]
        layer.q,
        layer.q_scale,
        layer.weights,
        kv_cache,
        out,
        workspace,
        config=config,
        backend=BACKEND,
        dcp=dcp,
    )
    return out


def is_uniform(case: StepCase) -> bool:
    batch = case.batch
    next_n = batch.config.next_n
    return bool((batch.query_lens_cpu == next_n).all()) and batch.num_tokens == (
        batch.num_reqs * next_n
    )


def step_cases(setup: DcpSetup) -> tuple[torch.Tensor, list[StepCase]]:
    """The setup's single-rank cache and its steps (identical in every process)."""
    (cache,), cases = setup.cases(KINDS)
    return cache, cases


# --- the ranks --------------------------------------------------------------------------------


def _rank_results(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    results: dict[str, torch.Tensor] = {}
    for setup in SETUPS:
        config = setup.config(world_size, rank)
        dcp = ContextParallelGroup(ContextParallel.from_config(config))
        cache, cases = step_cases(setup)
        for i, case in enumerate(cases):
            table_cache = shard_kv_cache(
                config, dcp.ctx, cache, case.batch.block_table, request_contexts(case.batch)
            )
            rank_cache, table = table_cache
            batch = rank_batch(case.batch, config, table, rank_cache.shape[0])
            (layer,) = case.inputs
            for full_graph in (False, True):
                key = f"{setup.name}/{i}/{'full' if full_graph else 'eager'}"
                results[key] = run_dense(
                    config, batch, rank_cache, layer, full_graph=full_graph, dcp=dcp
                )
            if is_uniform(case):
                for way, out in run_uniform(config, batch, rank_cache, layer, dcp).items():
                    results[f"{setup.name}/{i}/{way}"] = out
    return results


def _check_group_refusals(rank: int, world_size: int) -> None:
    """A group that disagrees with the process group or with the config is refused."""
    with pytest.raises(ValueError, match="this process is rank"):
        ContextParallelGroup(ContextParallel(world_size, (rank + 1) % world_size))
    with pytest.raises(ValueError, match="group has"):
        ContextParallelGroup(ContextParallel(world_size + 1, rank))
    config = SETUPS[0].config(world_size, rank)
    other = ContextParallelGroup(ContextParallel(world_size, rank, 2))
    with pytest.raises(ValueError, match="dcp has"):
        other.check(config)


def _ranked(rank: int, world_size: int, shared: None) -> dict[str, torch.Tensor]:
    """One gloo rank: the refusals, then its answers."""
    _check_group_refusals(rank, world_size)
    return _rank_results(rank, world_size)


def _single_rank_results() -> dict[str, torch.Tensor]:
    """The W = 1 answers in the selection order, keyed as `_rank_results`."""
    with selection_order():
        return _single_rank_answers()


def _single_rank_answers() -> dict[str, torch.Tensor]:
    results: dict[str, torch.Tensor] = {}
    for setup in SETUPS:
        config = setup.config()
        cache, cases = step_cases(setup)
        for i, case in enumerate(cases):
            (layer,) = case.inputs
            for full_graph in (False, True):
                key = f"{setup.name}/{i}/{'full' if full_graph else 'eager'}"
                results[key] = run_dense(config, case.batch, cache, layer, full_graph=full_graph)
            if is_uniform(case):
                key = f"{setup.name}/{i}"
                uniform = run_uniform(config, case.batch, cache, layer)
                assert torch.equal(uniform["tape"], uniform["captured"]), key
                results.update({f"{key}/{way}": out for way, out in uniform.items()})
    return results


@across_gloo_ranks
def test_dense_layer_across_gloo_ranks_equals_one_rank(world_size: int) -> None:
    want = _single_rank_results()
    answers = run_gloo_ranks(_ranked, world_size, None, timeout_s=120)
    assert set(answers[0]) == set(want)
    assert any(key.endswith("/tape") for key in want)
    for key, single in want.items():
        first = answers[0][key]
        for other in answers[1:]:
            assert torch.equal(other[key], first), key  # identical on every rank
        assert torch.equal(first, single), key


# --- in one process ---------------------------------------------------------------------------


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_builder_plans_the_rank_local_lengths(setup: DcpSetup) -> None:
    """Each rank's builder holds `local_lengths` of the single-rank context lengths, decode
    row ends and prefill row ends, and rank-local logits widths; the ranks' shares sum to
    the single-rank values."""
    cache, cases = step_cases(setup)
    for case in cases:
        single = IndexerMetadataBuilder(setup.config(), "cpu").build(case.batch)
        totals = torch.zeros_like(single.context_lens)
        for rank in range(3):
            config = setup.config(3, rank)
            ctx = ContextParallel.from_config(config)
            _, table = shard_kv_cache(
                config, ctx, cache, case.batch.block_table, request_contexts(case.batch)
            )
            got = IndexerMetadataBuilder(config, "cpu").build(
                rank_batch(case.batch, config, table, 1000)
            )
            assert torch.equal(got.context_lens, local_lengths(ctx, single.context_lens))
            totals += got.context_lens
            if single.decode is not None:
                assert got.decode is not None
                assert torch.equal(got.decode.row_lens, local_lengths(ctx, single.decode.row_lens))
                assert got.decode.width == max(1, ctx.local_count(single.decode.width or 0))
            assert len(got.plans) == len(single.plans)
            for mine, one in zip(got.plans, single.plans, strict=True):
                assert torch.equal(mine.row_ends, local_lengths(ctx, one.row_ends))
                assert mine.width == ctx.local_count(one.width)
        assert torch.equal(totals, single.context_lens)


def test_bad_configurations_raise(gen: torch.Generator) -> None:
    setup = SETUPS[0]
    with pytest.raises(ValueError, match="dcp_rank"):
        setup.config(2, 2)
    # An interleave that splits a candidate block.
    with pytest.raises(ValueError, match="multiple of candidate_block_size"):
        IndexerConfig.cpu_demo(dcp_world_size=2, dcp_interleave=12)
    # Two-level stacks plan their rank's share, global row ends kept.
    two_level = IndexerConfig.cpu_demo(dcp_world_size=2, dcp_rank=1)
    assert "global_row_ends" in CandidateIndexerMetadataBuilder(two_level, "cpu").buffers()
    # A rank-local page the cache layout cannot tile.
    with pytest.raises(ValueError, match="rank-local cache cannot be tiled"):
        IndexerMetadataBuilder(
            IndexerConfig(num_heads=8, head_dim=64, block_size=16, dcp_world_size=2), "cpu"
        )
    # A group needs an initialized process group.
    with pytest.raises(ValueError, match="initialized"):
        ContextParallelGroup(ContextParallel(2, 0))

    cache, cases = step_cases(setup)
    case = cases[0]
    (layer,) = case.inputs
    config = setup.config(2, 0)
    ctx = ContextParallel.from_config(config)
    rank_cache, table = shard_kv_cache(
        config, ctx, cache, case.batch.block_table, request_contexts(case.batch)
    )
    batch = rank_batch(case.batch, config, table, rank_cache.shape[0])
    builder = IndexerMetadataBuilder(config, "cpu", num_pages=rank_cache.shape[0])
    metadata = builder.build(batch)
    workspace = IndexerWorkspace(config, "cpu")
    out = torch.empty(metadata.num_tokens, config.topk_tokens, dtype=torch.int32)

    def run(**kwargs: object) -> None:
        dense_indexer(
            metadata, layer.q, layer.q_scale, layer.weights, rank_cache, out, workspace,
            config=config, backend=BACKEND, **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip

    with pytest.raises(ValueError, match="dcp must be a ContextParallelGroup"):
        run()
    with pytest.raises(ValueError, match="dcp must be a ContextParallelGroup"):
        run(dcp=ctx)
    with pytest.raises(ValueError, match="dcp has"):
        run(dcp=ContextParallelGroup(ContextParallel()))
    # One rank: a group of another world size is refused, a single-rank one changes nothing.
    single = setup.config()
    single_builder = IndexerMetadataBuilder(single, "cpu")
    single_metadata = single_builder.build(case.batch)
    want = run_dense(single, case.batch, cache, layer, full_graph=False)
    got = _layer(single, single_metadata, cache, layer, ContextParallelGroup(ContextParallel()))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="dcp must be a ContextParallelGroup or None"):
        _layer(single, single_metadata, cache, layer, object())  # type: ignore[arg-type]

    # Candidate sources and consumers need the group under W > 1 too.
    blocks = config.replace(
        candidate_block_size=8, candidate_topk_blocks=4, sparse_logits=True, dcp_interleave=8
    )
    blocks_builder = IndexerMetadataBuilder(blocks, "cpu", num_pages=rank_cache.shape[0])
    blocks_metadata = blocks_builder.build(
        rank_batch(case.batch, blocks, table, rank_cache.shape[0])
    )
    blocks_workspace = IndexerWorkspace(blocks, "cpu")
    with pytest.raises(ValueError, match="dcp must be a ContextParallelGroup"):
        dense_indexer(
            blocks_metadata, layer.q, layer.q_scale, layer.weights, rank_cache, out,
            blocks_workspace, config=blocks, candidate_source=True, backend=BACKEND,
        )  # fmt: skip
    with pytest.raises(ValueError, match="dcp must be a ContextParallelGroup"):
        candidate_consumer(
            blocks_metadata, layer.q, layer.q_scale, layer.weights, rank_cache, out,
            blocks_workspace, config=blocks, resolve_pool=True, backend=BACKEND,
        )  # fmt: skip
