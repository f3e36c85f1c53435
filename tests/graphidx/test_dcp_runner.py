"""Context parallel through the runner on the tape backend, dense and two-level stacks
(docs/contract.md section 10).

Each of W gloo ranks builds a tape `IndexerGraphRunner` over its rank-local caches (the
single-rank caches sharded, `graphidx.testing.shard_case`), captures the uniform-decode
ladder and runs random steps (uniform, ragged, padded, runtime padding forms, mixed, pure
prefill; speculative next_n = 2) three ways: eager unpadded, eager padded, and the normal
path that replays the captured graph (the exchange recorded on the tape). Every rank's top-k
of every layer must equal the W = 1 runner's on every real row, exactly, the W = 1 layers
picking in the selection order (`graphidx.testing.selection_order`). The two-level stack
(candidate source, then consumers) covers the source's block-score merge, the pool resolved
to each rank's part and the consumers' merge, through both the gather and the dense + mask
paths.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DcpSetup, across_gloo_ranks, needs_gloo

from capture import CaptureSizes
from graphidx.builder import CandidateIndexerMetadataBuilder
from graphidx.config import IndexerConfig
from graphidx.distributed import ContextParallel, ContextParallelGroup
from graphidx.runner import IndexerGraphRunner, IndexerStack
from graphidx.testing import (
    rank_cache_pages,
    run_gloo_ranks,
    selection_order,
    shard_case,
)

KINDS = ("decode", "decode", "ragged", "padded", "mixed", "prefill", "pad-vllm-zero")
MODES = ("unpadded", "padded", "normal", "masked")


SETUPS = (
    DcpSetup("v41", IndexerStack(dense=1, candidate_source=True, consumers=2), 2, 1, 8, 8, seed=22),
    DcpSetup("v41-r4", IndexerStack(candidate_source=True, consumers=1), 1, 4, 8, 16, seed=23),
)


def masked_decode(runner: IndexerGraphRunner) -> None:
    """Make the runner's eager steps plan decode as an eager builder does and never gather
    it, so that the consumers' decode rows take the dense + mask path."""
    builder = runner.builder
    assert isinstance(builder, CandidateIndexerMetadataBuilder)
    builder.full_graph_decode = False
    builder.decode_gather_width = 2**31


def runner_for(
    config: IndexerConfig, stack: IndexerStack, caches: list[torch.Tensor], **options: object
) -> IndexerGraphRunner:
    sizes = CaptureSizes(max_size=8 * config.next_n, uniform_query_len=config.next_n)
    return IndexerGraphRunner(
        config, stack, caches, "cpu", graph_backend="tape", capture_sizes=sizes,
        ops_backend="reference", **options,  # type: ignore[arg-type]
    )  # fmt: skip


def _setup_results(setup: DcpSetup, world_size: int, rank: int) -> dict[str, torch.Tensor]:
    config = setup.config(world_size, rank)
    dcp = ContextParallelGroup(ContextParallel.from_config(config))
    caches, cases = setup.cases(KINDS)
    width = caches[0].shape[1]
    rank_caches = [torch.zeros(rank_cache_pages(config), width, dtype=torch.uint8) for _ in caches]
    runner = runner_for(config, setup.stack, rank_caches, dcp=dcp)
    runner.capture()
    results: dict[str, torch.Tensor] = {}
    replayed = 0
    for i, case in enumerate(cases):
        mine = shard_case(case, config, caches, rank_caches)
        n = mine.num_real_tokens
        runs = (
            runner.step(mine.reference, mine.inputs, pad=False),
            runner.step(mine.batch, mine.inputs, force_eager=True),
            runner.step(mine.batch, mine.inputs),
        )
        replayed += int(runs[2].replayed)
        for mode, run in zip(MODES[:3], runs, strict=True):
            results[f"{setup.name}/{i}/{mode}"] = run.topk[:, :n].clone()
    assert replayed >= 2, f"{setup.name}: only {replayed} steps replayed"
    masked_decode(runner)
    for i, case in enumerate(cases):
        mine = shard_case(case, config, caches, rank_caches)
        run = runner.step(mine.reference, mine.inputs, pad=False)
        results[f"{setup.name}/{i}/masked"] = run.topk[:, : mine.num_real_tokens].clone()
    return results


def _check_runner_refusals(world_size: int, rank: int) -> None:
    """A W > 1 runner needs its matching group, and refuses what it cannot run."""
    setup = SETUPS[0]
    config = setup.config(world_size, rank)
    caches = [torch.zeros(rank_cache_pages(config), 4096, dtype=torch.uint8)] * 4
    dcp = ContextParallelGroup(ContextParallel.from_config(config))
    with pytest.raises(ValueError, match="compile_layers"):
        runner_for(config, setup.stack, caches, dcp=dcp, compile_layers=True)
    with pytest.raises(ValueError, match="dcp has"):
        runner_for(config.replace(dcp_interleave=16), setup.stack, caches, dcp=dcp)


def _ranked(rank: int, world_size: int, shared: None) -> dict[str, torch.Tensor]:
    """One gloo rank: the refusals, then every setup's answers."""
    _check_runner_refusals(world_size, rank)
    results: dict[str, torch.Tensor] = {}
    for setup in SETUPS:
        results.update(_setup_results(setup, world_size, rank))
    return results


def _single_rank_results() -> dict[str, torch.Tensor]:
    """The W = 1 runner's eager unpadded answers in the selection order, per case."""
    results: dict[str, torch.Tensor] = {}
    with selection_order():
        for setup in SETUPS:
            caches, cases = setup.cases(KINDS)
            runner = runner_for(setup.config(), setup.stack, caches)
            for i, case in enumerate(cases):
                run = runner.step(case.reference, case.inputs, pad=False)
                results[f"{setup.name}/{i}"] = run.topk[:, : case.num_real_tokens].clone()
            masked_decode(runner)
            for i, case in enumerate(cases):
                run = runner.step(case.reference, case.inputs, pad=False)
                assert torch.equal(
                    run.topk[:, : case.num_real_tokens], results[f"{setup.name}/{i}"]
                )
    return results


@across_gloo_ranks
def test_runner_across_gloo_ranks_equals_one_rank(world_size: int) -> None:
    want = _single_rank_results()
    answers = run_gloo_ranks(_ranked, world_size, None, timeout_s=150)
    assert len(answers[0]) == len(MODES) * len(want)
    for key, single in want.items():
        assert bool((single >= 0).any()), key
        for mode in MODES:
            for rank, got in enumerate(answers):
                assert torch.equal(got[f"{key}/{mode}"], single), f"{key}/{mode} on rank {rank}"


def test_runner_refuses_a_missing_group() -> None:
    setup = SETUPS[0]
    config = setup.config(2, 0)
    caches = [torch.zeros(rank_cache_pages(config), 4096, dtype=torch.uint8)] * 4
    missing = r"dcp must be a ContextParallelGroup \(this rank and its process group\), got None"
    with pytest.raises(ValueError, match=missing):
        runner_for(config, setup.stack, caches)
    with pytest.raises(ValueError, match="dcp must be a ContextParallelGroup"):
        runner_for(config, setup.stack, caches, dcp=ContextParallel.from_config(config))


@needs_gloo
def test_replay_check_dcp_finds_no_mismatch() -> None:
    """`replay-check --dcp 2` on a few cases: two gloo ranks, every step equal to W = 1."""
    from graphidx.cli.replay_check import run_replay_check

    lines: list[str] = []
    mismatches = run_replay_check(
        backend="tape", cases=5, seed=3, device=torch.device("cpu"), dcp=2,
        print_fn=lines.append,
    )  # fmt: skip
    assert mismatches == 0, lines
    assert lines[-1] == "5 cases, 0 mismatches"
    with pytest.raises(ValueError, match="dcp must be an int"):
        run_replay_check(backend="tape", cases=1, seed=0, device=torch.device("cpu"), dcp=0)
