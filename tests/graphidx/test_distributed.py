"""graphidx.distributed (docs/contract.md section 10): sharding arithmetic, the deterministic
merge against a brute-force single-rank top-k, and the exchange across gloo processes."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import across_gloo_ranks, needs_gloo
from hypothesis import given, settings
from hypothesis import strategies as st

from graphidx.config import IndexerConfig
from graphidx.distributed import (
    ContextParallel,
    ContextParallelGroup,
    exchange_topk,
    global_positions,
    local_lengths,
    local_positions,
    local_topk,
    local_topk_at,
    merge_topk,
    sharded_topk,
    sharded_topk_at,
    unpin_foreign_newest_block,
)
from graphidx.testing import run_gloo_ranks

NEG_INF = float("-inf")


# --- brute force ------------------------------------------------------------------------


def brute_owner(ctx: ContextParallel, p: int) -> bool:
    return p >= 0 and (p // ctx.interleave) % ctx.world_size == ctx.rank


def brute_local_index(ctx: ContextParallel, p: int) -> int:
    """The rank's positions counted in order: the local index is the count of owned ones below."""
    return sum(brute_owner(ctx, q) for q in range(p))


def brute_topk(scores: torch.Tensor, lengths: list[int], k: int) -> list[list[tuple[float, int]]]:
    """Single-rank top-k of `scores[r, :lengths[r]]`: larger score first, ties to the smaller
    position, -inf never picked; a list of (score, position) per row, unpadded."""
    rows = []
    for r, n in enumerate(lengths):
        cands = [(float(v), p) for p, v in enumerate(scores[r, :n].tolist()) if v != NEG_INF]
        cands.sort(key=lambda sp: (-sp[0], sp[1]))
        rows.append(cands[:k])
    return rows


def padded(picks: list[list[tuple[float, int]]], k: int) -> tuple[list, list]:
    pos = [[p for _, p in row] + [-1] * (k - len(row)) for row in picks]
    val = [[s for s, _ in row] + [NEG_INF] * (k - len(row)) for row in picks]
    return pos, val


def quantized_scores(gen: torch.Generator, rows: int, width: int) -> torch.Tensor:
    """Scores from a handful of values (many ties), with -inf and both zeros."""
    levels = torch.tensor([NEG_INF, -1.0, -0.0, 0.0, 0.5, 1.0, 2.0])
    return levels[torch.randint(0, len(levels), (rows, width), generator=gen)]


def shard_topk(
    ctx: ContextParallel, scores: torch.Tensor, lengths: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ctx.rank's local top-k of global `scores` `[rows, N]`: its columns only."""
    n_local = ctx.local_count(scores.shape[1])
    cols = global_positions(ctx, torch.arange(n_local))
    local_logits = scores[:, cols].contiguous()
    out = torch.empty(scores.shape[0], k, dtype=torch.int32)
    vals = torch.empty(scores.shape[0], k)
    local_topk(ctx, local_logits, local_lengths(ctx, lengths), k, out, vals)
    return vals, out


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(world_size=0), "world_size"),
        (dict(world_size=True), "world_size"),
        (dict(world_size=2, rank=2), "rank"),
        (dict(world_size=2, rank=-1), "rank"),
        (dict(world_size=2, rank=1.0), "rank"),
        (dict(interleave=0), "interleave"),
        (dict(interleave=2.5), "interleave"),
    ],
)
def test_context_parallel_validation(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ContextParallel(**kwargs)


def test_check_config() -> None:
    demo = IndexerConfig.cpu_demo()  # C = 8, page_entries 64, n_per_tile 32
    assert ContextParallel(4, 3, 16).check(demo).page_entries == 64
    ContextParallel(2, 0, 8).check(demo)
    with pytest.raises(ValueError, match="interleave = 12 must be a multiple of candidate_block"):
        ContextParallel(2, 0, 12).check(demo)
    # Dense: any interleave.
    ContextParallel(3, 1, 5).check(IndexerConfig(num_heads=8, head_dim=64))
    # A page the rank-local cache cannot tile.
    with pytest.raises(ValueError, match="page_entries = 16"):
        ContextParallel(2, 0, 4).check(IndexerConfig(num_heads=8, head_dim=64, block_size=16))
    # A candidate block wider than one tile.
    wide = IndexerConfig.cpu_demo(block_size=128, candidate_block_size=64)
    with pytest.raises(ValueError, match="n_per_tile"):
        ContextParallel(2, 0, 64).check(wide)
    with pytest.raises(ValueError, match="config"):
        ContextParallel().check("v32")  # type: ignore[arg-type]


def test_op_validation() -> None:
    ctx = ContextParallel(2, 0, 4)
    with pytest.raises(ValueError, match="positions"):
        local_positions(ctx, torch.zeros(3))
    with pytest.raises(ValueError, match="ctx"):
        local_lengths(2, torch.zeros(3, dtype=torch.int32))  # type: ignore[arg-type]
    scores = torch.zeros(2, 3, 4)
    pos = torch.zeros(2, 3, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="positions"):
        merge_topk(scores, pos.long(), 4, torch.empty(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        merge_topk(scores, pos, 5, torch.empty(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_scores"):
        merge_topk(scores, pos, 4, torch.empty(3, 4, dtype=torch.int32), torch.empty(3, 4).double())
    with pytest.raises(ValueError, match="lengths"):
        local_topk(
            ctx,
            torch.zeros(3, 8),
            torch.zeros(2, dtype=torch.int32),
            4,
            torch.empty(3, 4, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="local_positions"):
        exchange_topk(torch.zeros(3, 4), torch.zeros(3, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="world_size 2"):
        exchange_topk(torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.int32), ctx=ctx)


# --- sharding arithmetic ----------------------------------------------------------------------

contexts = st.integers(1, 5).flatmap(
    lambda w: st.builds(ContextParallel, st.just(w), st.integers(0, w - 1), st.integers(1, 9))
)


@settings(max_examples=150, deadline=None)
@given(
    ctx=contexts,
    values=st.lists(st.integers(-5, 400), min_size=1, max_size=40),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_positions_against_brute_force(
    ctx: ContextParallel, values: list[int], dtype: torch.dtype
) -> None:
    p = torch.tensor(values, dtype=dtype)
    local = local_positions(ctx, p)
    assert local.dtype == dtype
    want = [brute_local_index(ctx, v) if brute_owner(ctx, v) else -1 for v in values]
    assert local.tolist() == want
    # Round trip on the owned ones; global_positions of -1 is -1.
    back = global_positions(ctx, local)
    assert back.tolist() == [v if w >= 0 else -1 for v, w in zip(values, want, strict=True)]
    # Every local index maps to an owned position and back; the map is increasing.
    idx = torch.arange(-1, 60, dtype=dtype)
    glob = global_positions(ctx, idx)
    assert glob[0] == -1 and all(brute_owner(ctx, g) for g in glob[1:].tolist())
    assert bool((glob[2:] > glob[1:-1]).all())
    assert local_positions(ctx, glob).tolist() == idx.tolist()

    lengths = local_lengths(ctx, p)
    assert lengths.dtype == dtype
    want_len = [sum(brute_owner(ctx, q) for q in range(v)) for v in values]
    assert lengths.tolist() == want_len
    assert [ctx.local_count(v) for v in values] == want_len


def test_local_lengths_covers_all_ranks() -> None:
    """The ranks' local lengths partition every L, large values included (no overflow)."""
    big = torch.tensor([0, 1, 7, 2**20 + 3, 2**31 - 1], dtype=torch.int32)
    for w, s in [(1, 1), (2, 8), (4, 64), (3, 5), (8, 1024)]:
        total = sum(local_lengths(ContextParallel(w, r, s), big).long() for r in range(w))
        assert total.tolist() == big.tolist()


# --- merge ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("interleave", [1, 3, 8])
def test_merge_equals_single_rank_topk(
    gen: torch.Generator, world_size: int, interleave: int
) -> None:
    rows, width, k = 24, 97, 16
    for _ in range(3):
        scores = quantized_scores(gen, rows, width)
        lengths = torch.randint(0, width + 1, (rows,), generator=gen, dtype=torch.int32)
        lengths[:4] = torch.tensor([0, 1, k - 3, width], dtype=torch.int32)
        want_pos, want_val = padded(brute_topk(scores, lengths.tolist(), k), k)

        parts = [
            shard_topk(ContextParallel(world_size, r, interleave), scores, lengths, k)
            for r in range(world_size)
        ]
        gathered_scores = torch.stack([v for v, _ in parts])
        gathered_pos = torch.stack([p for _, p in parts])
        out = torch.full((rows, k), 123, dtype=torch.int32)
        vals = torch.full((rows, k), 5.0)
        merge_topk(gathered_scores, gathered_pos, k, out, vals)
        # The exact tie rule (order included) and hence equal sets.
        assert out.tolist() == want_pos
        assert vals.tolist() == want_val
        for got, want in zip(out.tolist(), want_pos, strict=True):
            assert set(got) == set(want)
        # The single-rank top-k (W = 1 through the same code) is the same answer.
        single_vals, single_pos = shard_topk(ContextParallel(), scores, lengths, k)
        assert single_pos.tolist() == want_pos and single_vals.tolist() == want_val


def test_local_topk_at_equals_local_topk_on_the_rank_map(gen: torch.Generator) -> None:
    """Columns given their global positions pick as `local_topk` does with the rank's map;
    a -1 column is never picked."""
    ctx = ContextParallel(3, 1, 4)
    rows, width, k = 12, 40, 9
    scores = quantized_scores(gen, rows, width)
    lengths = torch.randint(0, width + 1, (rows,), generator=gen, dtype=torch.int32)
    want = torch.empty(rows, k, dtype=torch.int32)
    local_topk(ctx, scores, lengths, k, want)
    cols = global_positions(ctx, torch.arange(width, dtype=torch.int32)).expand(rows, width)
    got = torch.empty(rows, k, dtype=torch.int32)
    local_topk_at(scores, cols.contiguous(), lengths, k, got)
    assert torch.equal(got, want)
    hidden = cols.clone()
    hidden[:, 0] = -1
    local_topk_at(scores, hidden, lengths, k, got)
    assert not bool((got == cols[0, 0]).any())


def test_unpin_keeps_only_the_global_newest_block() -> None:
    """The pinned block of a row's newest local key keeps +inf only on the rank holding the
    row's newest global key; elsewhere it gets its max over the visible columns."""
    c, s = 4, 8
    logits = torch.arange(24, dtype=torch.float32).repeat(3, 1)
    # Rows: global end 20 (newest 19, held by rank 0 of 2 with S = 8: positions 16..23),
    # global end 9 (newest 8, rank 1 holds 8..15), global end 0.
    global_ends = torch.tensor([20, 9, 0], dtype=torch.int32)
    for rank, keeps in ((0, [True, False]), (1, [False, True])):
        ctx = ContextParallel(2, rank, s)
        local_ends = local_lengths(ctx, global_ends)
        blocks = torch.zeros(3, 6)
        newest = ((local_ends.long() - 1).clamp(min=0) // c).tolist()
        for r in range(2):
            blocks[r, newest[r]] = float("inf")
        unpin_foreign_newest_block(ctx, logits, blocks, local_ends, global_ends, c)
        for r in range(2):
            n = int(local_ends[r])
            real = float(logits[r, newest[r] * c : n].max())
            assert float(blocks[r, newest[r]]) == (float("inf") if keeps[r] else real)
        assert not bool(blocks[2].any())


def test_merge_candidate_order_and_padding(gen: torch.Generator) -> None:
    """Candidates in any order per rank, kl != k, and k larger than all candidates."""
    w, rows, kl = 3, 5, 4
    perm = torch.randperm(60, generator=gen)[: w * rows * kl].to(torch.int32)
    pos = perm.view(w, rows, kl).clone()
    pos[0, 0, :2] = -1
    scores = quantized_scores(gen, w * rows, kl).view(w, rows, kl)
    flat_s = scores.permute(1, 0, 2).reshape(rows, w * kl)
    flat_p = pos.permute(1, 0, 2).reshape(rows, w * kl)
    for k in (1, 5, w * kl, w * kl + 3):
        out = torch.empty(rows, k, dtype=torch.int32)
        vals = torch.empty(rows, k)
        merge_topk(scores, pos, k, out, vals)
        shuffled = torch.empty_like(out)
        order = torch.randperm(kl, generator=gen)
        merge_topk(scores[:, :, order], pos[:, :, order].contiguous(), k, shuffled)
        assert shuffled.tolist() == out.tolist()
        for r in range(rows):
            cands = [
                (s, p)
                for s, p in zip(flat_s[r].tolist(), flat_p[r].tolist(), strict=True)
                if p >= 0 and s != NEG_INF
            ]
            cands.sort(key=lambda sp: (-sp[0], sp[1]))
            want_pos, want_val = padded([cands[:k]], k)
            assert out[r].tolist() == want_pos[0] and vals[r].tolist() == want_val[0]


def test_merge_empty_rows() -> None:
    out = torch.empty(0, 4, dtype=torch.int32)
    merge_topk(torch.empty(2, 0, 4), torch.empty(2, 0, 4, dtype=torch.int32), 4, out)
    local_topk(
        ContextParallel(),
        torch.empty(3, 0),
        torch.zeros(3, dtype=torch.int32),
        2,
        out2 := torch.empty(3, 2, dtype=torch.int32),
    )
    assert out2.tolist() == [[-1, -1]] * 3


def test_exchange_single_rank_returns_views() -> None:
    s = torch.randn(3, 4)
    p = torch.arange(12, dtype=torch.int32).view(3, 4)
    gs, gp = exchange_topk(s, p, ctx=ContextParallel())
    assert gs.shape == (1, 3, 4) and gp.shape == (1, 3, 4)
    assert gs.data_ptr() == s.data_ptr() and gp.data_ptr() == p.data_ptr()


# --- across processes (gloo) --------------------------------------------------------------------


def _dense_problem(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank rebuilds the same global problem: integer-valued q, k and weights, so the
    logits (relu(q k^T) weighted over heads) are exact whichever subset a rank scores, with
    many ties; ragged row ends including 0 and fewer than k."""
    g = torch.Generator().manual_seed(seed)
    rows, heads, dim, n = 12, 4, 8, 150
    q = torch.randint(-1, 2, (rows, heads, dim), generator=g).float()
    keys = torch.randint(-1, 2, (n, dim), generator=g).float()
    w = torch.randint(0, 3, (rows, heads), generator=g).float()
    lengths = torch.randint(0, n + 1, (rows,), generator=g, dtype=torch.int32)
    lengths[:3] = torch.tensor([0, 5, n], dtype=torch.int32)
    return q, keys, w, lengths


def _logits(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.relu(torch.einsum("rhd,nd->rhn", q, keys)) * w.unsqueeze(2)).sum(1)


def _rank_answer(
    ctx: ContextParallel, seed: int, k: int, group: torch.distributed.ProcessGroup | None
) -> torch.Tensor:
    q, keys, w, lengths = _dense_problem(seed)
    cols = global_positions(ctx, torch.arange(ctx.local_count(keys.shape[0])))
    local_logits = _logits(q, keys[cols], w)  # this rank's positions only
    pos = torch.empty(q.shape[0], k, dtype=torch.int32)
    vals = torch.empty(q.shape[0], k)
    local_topk(ctx, local_logits, local_lengths(ctx, lengths), k, pos, vals)
    all_vals, all_pos = exchange_topk(vals, pos, group, ctx=ctx)
    out = torch.empty_like(pos)
    merge_topk(all_vals, all_pos, k, out)
    return out


def _single_rank_answer(seed: int, k: int) -> torch.Tensor:
    q, keys, w, lengths = _dense_problem(seed)
    out = torch.empty(q.shape[0], k, dtype=torch.int32)
    local_topk(ContextParallel(), _logits(q, keys, w), lengths, k, out)
    return out


def _ranked(rank: int, world_size: int, shared: None) -> dict[str, torch.Tensor]:
    """One gloo rank: exchange and merge against the single-rank answer, across the world and
    (at four ranks) within two groups of two."""
    import torch.distributed as dist

    results = {}
    for seed, interleave, k in [(1, 8, 16), (2, 3, 16), (3, 1, 7), (4, 64, 32)]:
        ctx = ContextParallel(world_size, rank, interleave)
        got = _rank_answer(ctx, seed, k, None)
        want = _single_rank_answer(seed, k)
        assert torch.equal(got, want), (rank, seed, interleave)
        results[f"world/{seed}"] = got
    if world_size == 4:
        # Two groups of two, through the group argument.
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        ctx = ContextParallel(2, rank % 2, 8)
        got = _rank_answer(ctx, 5, 16, groups[rank // 2])
        assert torch.equal(got, _single_rank_answer(5, 16)), rank
        results["pairs/5"] = got
    return results


@across_gloo_ranks
def test_exchange_and_merge_across_gloo_ranks(world_size: int) -> None:
    answers = run_gloo_ranks(_ranked, world_size, None, timeout_s=120)
    for name, first in answers[0].items():
        seed = int(name.split("/")[1])
        k = first.shape[1]
        assert torch.equal(first, _single_rank_answer(seed, k)), name
        for other in answers[1:]:
            assert torch.equal(other[name], first), name


def test_context_parallel_from_the_config() -> None:
    """The config's dcp fields give each rank's `ContextParallel` (interleave defaulting to
    C), and its view of candidate blocks; the builders plan a two-level rank's share."""
    from graphidx.builder import IndexerMetadataBuilder
    from graphidx.config import IndexerConfig
    from graphidx.distributed import ContextParallel

    config = IndexerConfig.cpu_demo(dcp_world_size=4, dcp_rank=3)
    cp = ContextParallel.from_config(config)
    assert (cp.world_size, cp.rank, cp.interleave) == (4, 3, max(1, config.candidate_block_size))
    assert ContextParallel.from_config(config.replace(dcp_interleave=64)).interleave == 64
    single = ContextParallel.from_config(IndexerConfig.cpu_demo())
    assert (single.world_size, single.rank) == (1, 0)
    blocks = ContextParallel(4, 3, 16).blocks(8)
    assert (blocks.world_size, blocks.rank, blocks.interleave) == (4, 3, 2)
    with pytest.raises(ValueError, match="multiple of candidate_block_size"):
        ContextParallel(4, 3, 12).blocks(8)
    assert IndexerMetadataBuilder(config, "cpu").context_parallel == cp


def test_sharded_topk_checks_its_output_before_the_exchange(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bad `out` raises before any rank enters the all-gather (a rank that raised after
    it would leave the others waiting in the next collective)."""
    import graphidx.distributed as dist

    def no_exchange(*args: object, **kwargs: object) -> None:
        raise AssertionError("the exchange ran before the output check")

    monkeypatch.setattr(dist, "exchange_topk", no_exchange)
    group = ContextParallelGroup(ContextParallel())
    logits = torch.zeros(3, 16)
    lengths = torch.full((3,), 16, dtype=torch.int32)
    wrong = torch.empty(3, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="out"):
        sharded_topk(group, logits, lengths, 4, wrong)
    with pytest.raises(ValueError, match="out"):
        sharded_topk_at(group, logits, torch.zeros(3, 16, dtype=torch.int32), lengths, 4, wrong)


def _abort_later(rank: int, world_size: int, shared: object, when: str) -> int:
    """Rank 1 aborts: `when` = "teardown", from a thread that outlives the rank's work (so
    after every answer is saved, as gloo's own teardown aborts do); "work", at once."""
    import os
    import threading

    if rank == 1 and when == "work":
        os.abort()
    if rank == 1 and when == "teardown":
        threading.Thread(target=lambda: (time.sleep(1.0), os.abort())).start()
    return rank * 10


@needs_gloo
def test_a_rank_dying_in_teardown_keeps_the_saved_answers() -> None:
    with pytest.warns(UserWarning, match="a gloo rank died after every answer was saved"):
        answers = run_gloo_ranks(_abort_later, 2, None, ("teardown",), timeout_s=120)
    assert answers == [0, 10]
    with pytest.raises(torch.multiprocessing.ProcessExitedException, match="SIGABRT"):
        run_gloo_ranks(_abort_later, 2, None, ("work",), timeout_s=120)
