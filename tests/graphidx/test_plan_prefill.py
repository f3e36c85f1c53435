"""Prefill planning: the logits-budget split, chunk construction, and chunk plans (SPEC 3.3)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphidx.metadata import PrefillChunk, PrefillPlan
from graphidx.plan import (
    build_prefill_chunks,
    plan_prefill_chunks,
    rows_per_slice,
    split_decodes_prefills,
    split_prefill_chunks,
)

POISON = -777


def _pairs(out: list[tuple[slice, slice]]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    return [((r.start, r.stop), (q.start, q.stop)) for r, q in out]


# split_prefill_chunks -----------------------------------------------------------------


def test_split_cuts_one_request_in_three() -> None:
    # 10 rows of width 100 fit 4000 bytes.
    out = split_prefill_chunks([100], [30], 4000)
    assert _pairs(out) == [((0, 1), (0, 10)), ((0, 1), (10, 20)), ((0, 1), (20, 30))]


def test_split_request_too_wide_for_the_budget() -> None:
    # One row of width 2000 needs 8000 bytes > 4000: single-row slices, the only way left.
    out = split_prefill_chunks([2000], [3], 4000)
    assert _pairs(out) == [((0, 1), (0, 1)), ((0, 1), (1, 2)), ((0, 1), (2, 3))]


def test_split_groups_by_widest_context_not_the_sum() -> None:
    # Budget = 30 rows at width 20: requests 0..2 group (30 rows, widest 20), request 3's width
    # 100 breaks the group and is cut into 6-row slices (2400 // 400).
    out = split_prefill_chunks([10, 20, 5, 100], [10, 10, 10, 10], 2400, request_offset=5)
    assert _pairs(out) == [((5, 8), (0, 30)), ((8, 9), (30, 36)), ((8, 9), (36, 40))]


def test_split_zero_length_groups_yield_nothing() -> None:
    # Request 1 is too wide to join request 0; requests 1 and 2 form a group with no rows.
    out = split_prefill_chunks([50, 5000, 5000], [4, 0, 0], 4000)
    assert _pairs(out) == [((0, 1), (0, 4))]
    assert split_prefill_chunks([7, 9], [0, 0], 100) == []
    assert split_prefill_chunks([], [], 100) == []


def test_split_trailing_padding_requests_join_the_group() -> None:
    out = split_prefill_chunks([50, 0, 0], [4, 0, 0], 4000, request_offset=3)
    assert _pairs(out) == [((3, 6), (0, 4))]


def test_split_zero_width_group() -> None:
    # Width 0 counts as 1 for the slice size: 8 // 4 = 2 rows per slice.
    out = split_prefill_chunks([0, 0], [5, 5], 8)
    assert _pairs(out) == [((0, 2), (lo, lo + 2)) for lo in range(0, 10, 2)]


def test_rows_per_slice() -> None:
    assert rows_per_slice(4000, 100) == 10
    assert rows_per_slice(4000, 2000) == 1
    assert rows_per_slice(8, 0) == 2


def test_split_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="max_logits_bytes must be a positive integer, got 0"):
        split_prefill_chunks([1], [1], 0)
    with pytest.raises(ValueError, match="request_offset must be a non-negative integer"):
        split_prefill_chunks([1], [1], 10, request_offset=-1)
    with pytest.raises(ValueError, match="context_lens has 2 requests but query_lens has 1"):
        split_prefill_chunks([1, 2], [1], 10)
    with pytest.raises(ValueError, match=r"query_lens\[1\] = -3 is negative"):
        split_prefill_chunks([1, 2], [1, -3], 10)
    with pytest.raises(ValueError, match=r"context_lens\[0\] = -1 is negative"):
        split_prefill_chunks([-1], [1], 10)


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 60)), max_size=15),
    st.integers(1, 200_000),
    st.integers(0, 5),
)
def test_split_properties(requests: list[tuple[int, int]], budget: int, offset: int) -> None:
    contexts = [c for c, _ in requests]
    query_lens = [q for _, q in requests]
    out = split_prefill_chunks(contexts, query_lens, budget, request_offset=offset)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(int)
    # Row slices tile every prefill row exactly once, in order.
    covered = [row for _, rows in out for row in range(rows.start, rows.stop)]
    assert covered == list(range(int(qsl[-1])))
    previous_requests = None
    for reqs, rows in out:
        assert rows.stop > rows.start
        local = range(reqs.start - offset, reqs.stop - offset)
        assert 0 <= local.start < local.stop <= len(requests)
        # The slice's rows belong to the slice's requests.
        assert qsl[local.start] <= rows.start and rows.stop <= qsl[local.stop]
        width = max(contexts[r] for r in local)
        # The logits budget holds except for single rows (the smallest possible launch).
        assert rows.stop - rows.start == 1 or (rows.stop - rows.start) * width * 4 <= budget
        # Request groups never overlap and go forward.
        if previous_requests is not None and previous_requests != reqs:
            assert reqs.start >= previous_requests.stop
        previous_requests = reqs


# build_prefill_chunks / plan_prefill_chunks -------------------------------------------


@dataclass
class Step:
    query_lens: list[int]
    seq_lens: list[int]
    upper: list[int]
    ratio: int
    table: torch.Tensor

    @property
    def qsl(self) -> torch.Tensor:
        return torch.tensor([0, *np.cumsum(self.query_lens).tolist()], dtype=torch.int32)

    @property
    def context(self) -> torch.Tensor:
        return torch.tensor(self.seq_lens, dtype=torch.int32) // self.ratio


class Buffers:
    def __init__(self, rows: int = 512, reqs: int = 64) -> None:
        self.ks = torch.empty(rows, dtype=torch.int32)
        self.ke = torch.empty(rows, dtype=torch.int32)
        self.cumsum = torch.empty(reqs + 1, dtype=torch.int64)
        self.staging = torch.empty(3 * rows, dtype=torch.int32)
        self.scratch = torch.empty(3 * rows, dtype=torch.int32)
        self.pairs = torch.empty(2 * rows, dtype=torch.int64)
        self.local_qsl = torch.empty(2 * (reqs + rows), dtype=torch.int32)  # as the builder
        self.row_ends = torch.empty(rows, dtype=torch.int32)
        self.block_ends = torch.empty(rows, dtype=torch.int32)
        for t in vars(self).values():
            t.fill_(POISON)


def _chunks(
    step: Step, budget: int, buffers: Buffers, next_n: int = 2
) -> tuple[list[PrefillChunk], int]:
    nd, _, _, _ = split_decodes_prefills(step.query_lens, next_n)
    upper_context = [u // step.ratio for u in step.upper]
    splits = split_prefill_chunks(
        upper_context[nd:], step.query_lens[nd:], budget, request_offset=nd
    )
    chunks = build_prefill_chunks(
        splits,
        int(step.qsl[nd]),
        step.qsl,
        torch.tensor(step.upper, dtype=torch.int32),
        torch.tensor(step.seq_lens, dtype=torch.int32),
        step.table,
        step.context,
        step.ratio,
        cu_seqlen_ks_out=buffers.ks,
        cu_seqlen_ke_out=buffers.ke,
        context_cumsum_out=buffers.cumsum,
        index_staging=buffers.staging,
        index_scratch=buffers.scratch,
        cumsum_scratch=buffers.pairs,
    )
    return chunks, nd


def _brute_force_ks_ke(step: Step, chunk: PrefillChunk) -> tuple[list[int], list[int]]:
    qsl = step.qsl.tolist()
    ks, ke = [], []
    for t in range(chunk.token_start, chunk.token_end):
        r = next(i for i in range(len(step.query_lens)) if qsl[i] <= t < qsl[i + 1])
        assert chunk.request_start <= r < chunk.request_start + chunk.num_reqs
        start = sum(s // step.ratio for s in step.seq_lens[chunk.request_start : r])
        position = step.seq_lens[r] - (qsl[r + 1] - t)
        ks.append(start)
        ke.append(start + (position + 1) // step.ratio)
    return ks, ke


def _step(query_lens: list[int], seq_lens: list[int], ratio: int, gen, upper=None) -> Step:  # type: ignore[no-untyped-def]
    table = torch.randint(0, 10**4, (len(query_lens), 7), generator=gen, dtype=torch.int32)
    return Step(query_lens, seq_lens, upper or list(seq_lens), ratio, table)


def test_build_chunks_ks_ke(gen: torch.Generator) -> None:
    # Decodes [2, 1], then prefills: 30 rows at width 200 (cut in three: 10 rows fit), a
    # 12-row and a 7-row request sharing a chunk with a padding request.
    step = _step([2, 1, 30, 12, 7, 0], [50, 9, 400, 130, 107, 3], 2, gen)
    buffers = Buffers()
    chunks, _ = _chunks(step, 10 * 200 * 4, buffers)
    assert [(c.token_start, c.token_end, c.request_start, c.num_reqs) for c in chunks] == [
        (3, 13, 2, 1),
        (13, 23, 2, 1),
        (23, 33, 2, 1),
        (33, 52, 3, 3),
    ]
    for chunk in chunks:
        ks, ke = _brute_force_ks_ke(step, chunk)
        assert chunk.cu_seqlen_ks.tolist() == ks
        assert chunk.cu_seqlen_ke.tolist() == ke
        assert chunk.cu_seqlen_ks.data_ptr() == buffers.ks[chunk.token_start :].data_ptr()
        rs = slice(chunk.request_start, chunk.request_start + chunk.num_reqs)
        assert torch.equal(chunk.block_table, step.table[rs])
        assert chunk.block_table.data_ptr() == step.table[rs].data_ptr()  # a view
    assert (buffers.ks[:3] == POISON).all() and (buffers.ks[52:] == POISON).all()


def test_build_chunks_drops_chunks_without_keys(gen: torch.Generator) -> None:
    # R = 4, 20 bytes. Request 1 (8 rows at positions 0..7, ends 0,0,0,1,1,1,1,2) is cut
    # into 2-row slices: the first sees nothing and is dropped. Request 2 (3 tokens) never has
    # an entry: dropped. Request 3 sees nothing on the device but may at its upper bound: kept.
    step = _step([1, 8, 3, 3], [5, 8, 3, 3], 4, gen, upper=[5, 8, 3, 4])
    buffers = Buffers()
    chunks, nd = _chunks(step, 20, buffers, next_n=1)
    assert nd == 1
    assert [(c.token_start, c.token_end) for c in chunks] == [(3, 5), (5, 7), (7, 9), (12, 15)]
    for chunk in chunks:
        ks, ke = _brute_force_ks_ke(step, chunk)
        assert (chunk.cu_seqlen_ks.tolist(), chunk.cu_seqlen_ke.tolist()) == (ks, ke)
    assert chunks[-1].cu_seqlen_ke.tolist() == [0, 0, 0]


def test_build_chunks_errors(gen: torch.Generator) -> None:
    step = _step([5, 5], [10, 10], 1, gen)
    buffers = Buffers(rows=4)

    def run(splits: list[tuple[slice, slice]], row_offset: int = 0) -> list[PrefillChunk]:
        return build_prefill_chunks(
            splits,
            row_offset,
            step.qsl,
            torch.tensor(step.upper, dtype=torch.int32),
            torch.tensor(step.seq_lens, dtype=torch.int32),
            step.table,
            step.context,
            1,
            cu_seqlen_ks_out=buffers.ks,
            cu_seqlen_ke_out=buffers.ke,
            context_cumsum_out=buffers.cumsum,
            index_staging=buffers.staging,
            index_scratch=buffers.scratch,
            cumsum_scratch=buffers.pairs,
        )

    with pytest.raises(ValueError, match="splits must tile the prefill rows"):
        run([(slice(0, 1), slice(1, 5))])
    with pytest.raises(ValueError, match="splits must tile the prefill rows"):
        run([(slice(0, 1), slice(0, 2)), (slice(0, 1), slice(3, 5))])
    with pytest.raises(ValueError, match="past the step's 10 real rows"):
        run([(slice(1, 2), slice(0, 5))], row_offset=6)
    with pytest.raises(ValueError, match="prefill buffers too small for 5 rows"):
        run([(slice(0, 1), slice(0, 5))])
    assert run([]) == []


def _plans(
    step: Step, chunks: list[PrefillChunk], buffers: Buffers | None, c: int, min_width: int | None
) -> list[PrefillPlan]:
    out = {}
    if buffers is not None:
        out = dict(
            query_start_loc_out=buffers.local_qsl,
            row_ends_out=buffers.row_ends,
            block_ends_out=buffers.block_ends if c else None,
        )
    return plan_prefill_chunks(
        chunks,
        step.qsl,
        torch.tensor(step.upper, dtype=torch.int32),
        step.context,
        step.ratio,
        c,
        min_width,
        step.qsl.clone(),
        **out,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("persistent", [True, False])
def test_plan_prefill_chunks(gen: torch.Generator, persistent: bool) -> None:
    # Prefill requests 2 (30 rows, cut in three), 3..5 in one chunk (5 has no rows).
    step = _step([2, 1, 30, 12, 7, 0], [50, 9, 400, 130, 107, 3], 2, gen, [50, 9, 400, 140, 107, 3])
    buffers = Buffers()
    chunks, _ = _chunks(step, 10 * 200 * 4, buffers)
    plans = _plans(step, chunks, buffers if persistent else None, 8, 100)
    assert [p.first_request for p in plans] == [2, 2, 2, 3]
    assert [p.requests for p in plans] == [
        ((0, 10, 0),),
        ((0, 10, 0),),
        ((0, 10, 0),),
        ((0, 12, 0), (12, 19, 1)),
    ]
    assert [p.query_start_loc.tolist() for p in plans] == [[0, 10]] * 3 + [[0, 12, 19, 19]]
    assert [p.width for p in plans] == [200, 200, 200, 70]  # upper bound 140 // 2
    assert [p.use_gather for p in plans] == [True, True, True, False]
    for chunk, plan in zip(chunks, plans, strict=True):
        row_ends = (chunk.cu_seqlen_ke - chunk.cu_seqlen_ks).tolist()
        assert plan.row_ends.tolist() == row_ends
        assert plan.block_ends is not None
        assert plan.block_ends.tolist() == [-(-e // 8) for e in row_ends]
        rs = slice(chunk.request_start, chunk.request_start + chunk.num_reqs)
        assert plan.context_lens.tolist() == step.context[rs].tolist()
    if persistent:
        assert plans[3].row_ends.data_ptr() == buffers.row_ends[33:].data_ptr()
        assert plans[1].query_start_loc.data_ptr() == buffers.local_qsl[2:].data_ptr()
        assert (buffers.row_ends[:3] == POISON).all() and (buffers.row_ends[52:] == POISON).all()
        assert (buffers.local_qsl[10:] == POISON).all()


def test_plan_without_candidates_or_gather(gen: torch.Generator) -> None:
    step = _step([40], [90], 1, gen)
    chunks, _ = _chunks(step, 10**6, Buffers())
    (plan,) = _plans(step, chunks, None, 0, None)
    assert plan.block_ends is None and not plan.use_gather and plan.width == 90
    (plan,) = _plans(step, chunks, None, 0, 90)
    assert plan.use_gather  # width >= min_gather_width
    (plan,) = _plans(step, chunks, None, 0, 91)
    assert not plan.use_gather


def test_plan_clamps_offsets_of_requests_outside_the_chunk(gen: torch.Generator) -> None:
    # A chunk covering only the second request's rows still lists all three requests.
    step = _step([4, 5, 3], [10, 10, 10], 1, gen)
    chunk = PrefillChunk(
        token_start=5,
        token_end=8,
        num_reqs=3,
        block_table=step.table,
        cu_seqlen_ks=torch.zeros(3, dtype=torch.int32),
        cu_seqlen_ke=torch.ones(3, dtype=torch.int32),
    )
    (plan,) = _plans(step, [chunk], None, 0, None)
    assert plan.first_request == 1
    assert plan.requests == ((0, 3, 1),)
    assert plan.query_start_loc.tolist() == [0, 0, 3, 3]


def test_plan_errors(gen: torch.Generator) -> None:
    step = _step([4, 5], [10, 10], 1, gen)

    def chunk(start: int, end: int, req_start: int, num_reqs: int) -> PrefillChunk:
        rows = torch.zeros(end - start, dtype=torch.int32)
        return PrefillChunk(
            token_start=start,
            token_end=end,
            num_reqs=num_reqs,
            block_table=step.table[req_start : req_start + num_reqs],
            cu_seqlen_ks=rows,
            cu_seqlen_ke=rows,
            request_start=req_start,
        )

    with pytest.raises(ValueError, match="fall outside the step's 9 rows / 2 requests"):
        _plans(step, [chunk(4, 10, 1, 1)], None, 0, None)
    with pytest.raises(ValueError, match="fall outside"):
        _plans(step, [chunk(0, 4, 1, 2)], None, 0, None)
    with pytest.raises(ValueError, match=r"do not start inside its requests \[1, 2\)"):
        _plans(step, [chunk(2, 6, 1, 1)], None, 0, None)
    small = Buffers(rows=8, reqs=0)
    with pytest.raises(ValueError, match="query_start_loc_out has 16 entries, 18 needed"):
        _plans(step, [chunk(0, 4, 0, 1)] * 9, small, 0, None)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=4),
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 900), st.integers(0, 50)), max_size=8),
    st.sampled_from([1, 2, 4]),
    st.integers(16, 40_000),
    st.integers(0, 2**31 - 1),
)
def test_chunk_and_plan_properties(
    decodes: list[int],
    prefills: list[tuple[int, int, int]],
    ratio: int,
    budget: int,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    decodes = [min(q, 3) for q in decodes]
    prefill_lens = [4 + q for q, _, _ in prefills]  # next_n = 3, so these are prefills
    query_lens = decodes + prefill_lens
    seq_lens = [q + 5 for q in decodes] + [
        q + h for q, (_, h, _) in zip(prefill_lens, prefills, strict=True)
    ]
    upper = seq_lens[: len(decodes)] + [
        s + slack for s, (_, _, slack) in zip(seq_lens[len(decodes) :], prefills, strict=True)
    ]
    step = _step(query_lens, seq_lens, ratio, g, upper)
    buffers = Buffers()
    chunks, nd = _chunks(step, budget, buffers, next_n=3)
    plans = _plans(step, chunks, buffers, 8, 50)
    qsl = step.qsl.tolist()

    # Chunks are ordered, disjoint prefill rows; every dropped row is truly keyless.
    kept = set()
    for chunk in chunks:
        kept.update(range(chunk.token_start, chunk.token_end))
    for t in range(qsl[nd], qsl[-1]):
        if t not in kept:
            r = next(i for i in range(len(query_lens)) if qsl[i] <= t < qsl[i + 1])
            assert (seq_lens[r] - (qsl[r + 1] - t) + 1) // ratio == 0
    starts = [c.token_start for c in chunks]
    assert starts == sorted(starts)

    for chunk, plan in zip(chunks, plans, strict=True):
        ks, ke = _brute_force_ks_ke(step, chunk)
        assert chunk.cu_seqlen_ks.tolist() == ks and chunk.cu_seqlen_ke.tolist() == ke
        # requests tile the chunk's rows, in order.
        rows = [row for lo, hi, _ in plan.requests for row in range(lo, hi)]
        assert rows == list(range(chunk.num_rows))
        for lo, hi, req in plan.requests:
            r = chunk.request_start + req
            assert max(qsl[r], chunk.token_start) - chunk.token_start == lo
            assert min(qsl[r + 1], chunk.token_end) - chunk.token_start == hi
        local = plan.query_start_loc.tolist()
        assert len(local) == chunk.num_reqs + 1
        for lo, hi, req in plan.requests:
            assert (local[req], local[req + 1]) == (lo, hi)
        assert local[0] == 0 and local[-1] == chunk.num_rows
        rs = range(chunk.request_start, chunk.request_start + chunk.num_reqs)
        assert plan.width == max(upper[r] // ratio for r in rs)
        assert plan.use_gather == (plan.width >= 50)
        assert plan.row_ends.tolist() == [b - a for a, b in zip(ks, ke, strict=True)]


def test_plan_with_persistent_outputs_and_separate_chunk_tensors(gen: torch.Generator) -> None:
    """Chunks whose ks/ke are not adjacent views still get exact row ends, per chunk."""
    step = _step([6, 5], [10, 30], 1, gen)
    ks = [torch.tensor([0] * 6, dtype=torch.int32), torch.tensor([10] * 5, dtype=torch.int32)]
    ke = [torch.arange(5, 11, dtype=torch.int32), torch.arange(36, 41, dtype=torch.int32)]
    chunks = [
        PrefillChunk(
            token_start=a,
            token_end=b,
            num_reqs=2,
            block_table=step.table,
            cu_seqlen_ks=k,
            cu_seqlen_ke=e,
        )
        for (a, b), k, e in zip([(0, 6), (6, 11)], ks, ke, strict=True)
    ]
    buffers = Buffers(rows=16)
    plans = _plans(step, chunks, buffers, 4, None)
    assert plans[0].row_ends.tolist() == [5, 6, 7, 8, 9, 10]
    assert plans[1].row_ends.tolist() == [26, 27, 28, 29, 30]
    assert plans[1].block_ends is not None and plans[1].block_ends.tolist() == [7, 7, 7, 8, 8]
    assert plans[1].row_ends.data_ptr() == buffers.row_ends[6:].data_ptr()
    assert (buffers.row_ends[11:] == POISON).all()


def test_plan_persistent_output_errors(gen: torch.Generator) -> None:
    step = _step([20], [40], 1, gen)
    chunks, _ = _chunks(step, 10**6, Buffers())
    with pytest.raises(ValueError, match="block_ends_out is required with row_ends_out"):
        plan_prefill_chunks(
            chunks,
            step.qsl,
            step.qsl[1:],
            step.context,
            1,
            8,
            None,
            step.qsl,
            row_ends_out=torch.empty(32, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="must hold the step's 20 rows"):
        plan_prefill_chunks(
            chunks,
            step.qsl,
            step.qsl[1:],
            step.context,
            1,
            0,
            None,
            step.qsl,
            row_ends_out=torch.empty(19, dtype=torch.int32),
        )
