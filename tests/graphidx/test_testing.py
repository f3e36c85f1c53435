"""The replay harness's padding cases (docs/contract.md section 3.2a): the runtimes' padding
conventions are generated as declared padding requests, and replay agrees with the unpadded
eager answer on the real rows."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import small_dense_config

from graphidx.batch import padding_form
from graphidx.config import IndexerConfig
from graphidx.runner import IndexerStack
from graphidx.testing import (
    KINDS,
    PADDED_KINDS,
    RUNTIME_PADDING,
    StepGenerator,
    check_replay,
    random_tape_runner,
)

CONFIG = IndexerConfig.cpu_demo(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=2048)
STACK = IndexerStack(candidate_source=True, consumers=2)
# R = 2, next_n = 3, a dense stack: the arange form has more rows than the fill1 form.
DENSE = small_dense_config(
    compress_ratio=2, num_speculative_tokens=2, topk_tokens=32, max_model_len=2048,
    max_num_seqs=8, max_num_batched_tokens=128,
)  # fmt: skip


def test_kinds_cover_every_runtime_convention() -> None:
    assert set(RUNTIME_PADDING.values()) == {"zero", "arange", "fill1"}
    assert set(PADDED_KINDS) <= set(KINDS)


@pytest.mark.parametrize("kind", sorted(RUNTIME_PADDING))
def test_runtime_padded_cases_declare_their_padding(kind: str) -> None:
    gen = StepGenerator(DENSE, IndexerStack(dense=1), num_pages=96, seed=3, max_context=1500)
    for _ in range(20):
        case = gen.case(kind)
        batch = case.batch
        assert case.kind == kind
        assert 0 < batch.num_real_reqs < batch.num_reqs
        n = batch.num_real_reqs
        query, seq = batch.query_lens_cpu[n:].tolist(), batch.seq_lens[n:].tolist()
        pads = {padding_form(q, s, DENSE.next_n) for q, s in zip(query, seq, strict=True)}
        assert pads == {RUNTIME_PADDING[kind]}
        ref = case.reference
        assert ref.num_reqs == ref.num_real_reqs == batch.num_real_reqs
        assert ref.num_tokens == case.num_real_tokens == batch.num_real_tokens
        assert batch.num_tokens >= int(batch.query_start_loc_cpu[-1])
        assert all(inp.q.shape[0] == batch.num_tokens for inp in case.inputs)


def test_padded_draws_every_padded_form() -> None:
    gen = StepGenerator(CONFIG, STACK, num_pages=96, seed=1, max_context=1500)
    seen = Counter(gen.case("padded").kind for _ in range(60))
    assert set(seen) == set(PADDED_KINDS)


@pytest.mark.parametrize(
    ("config", "stack"),
    [(CONFIG, STACK), (DENSE, IndexerStack(dense=2))],
    ids=["candidate R1 next_n 2", "dense R2 next_n 3"],
)
def test_runtime_padding_replays_match_the_unpadded_answer(
    config: IndexerConfig, stack: IndexerStack
) -> None:
    runner, gen = random_tape_runner(config, stack, seed=5)
    report = check_replay(runner, gen.cases(36, kinds=tuple(RUNTIME_PADDING)))
    assert report.ok, report.mismatches[:5]
    assert set(report.by_kind) == set(RUNTIME_PADDING)
    assert report.replayed > 0


def test_a_wrong_real_row_under_padding_is_caught() -> None:
    """A runner that scores a padded step's real rows wrongly (here: drops the last real
    request's picks whenever the step carries padding requests) fails the check."""
    runner, gen = random_tape_runner(CONFIG, STACK, seed=6)
    step = runner.step

    def broken(batch, layer_inputs, **kw):  # type: ignore[no-untyped-def]
        result = step(batch, layer_inputs, **kw)
        if batch.num_padding_reqs and kw.get("pad", True):
            result.topk[:, batch.num_real_tokens - 1].fill_(-1)
        return result

    runner.step = broken  # type: ignore[method-assign]
    report = check_replay(runner, gen.cases(6, kinds=tuple(RUNTIME_PADDING)))
    assert not report.ok
    assert {m.what for m in report.mismatches} == {
        "padded eager != unpadded eager",
        "replay != unpadded eager",
    }
