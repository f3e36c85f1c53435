"""Candidate-consumer prefill launches (docs/contract.md section 3.3, `plan_gather_launches`)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphidx.metadata import GatherLaunch, PrefillChunk, PrefillPlan
from graphidx.plan import (
    build_prefill_chunks,
    plan_gather_launches,
    plan_prefill_chunks,
    split_decodes_prefills,
    split_prefill_chunks,
)

POISON = -777


class Step:
    """Requests' rows, a block table, contexts and step-wide row ends (random values)."""

    def __init__(self, query_lens: list[int], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.query_lens = query_lens
        self.qsl = [0, *np.cumsum(query_lens).tolist()]
        n = len(query_lens)
        self.table = torch.randint(0, 10**5, (n, 4), generator=g, dtype=torch.int32)
        self.context = torch.randint(1, 10**5, (n,), generator=g, dtype=torch.int32)
        self.row_ends = torch.randint(1, 10**5, (self.qsl[-1],), generator=g, dtype=torch.int32)

    def holder(self, row: int) -> int:
        """The request holding step row `row` (zero-row requests hold none)."""
        return next(r for r in range(len(self.query_lens)) if self.qsl[r] <= row < self.qsl[r + 1])

    def chunk(
        self,
        start: int,
        end: int,
        req_start: int,
        num_reqs: int,
        gather: bool,
        views: bool = True,
        table_from: int | None = None,
    ) -> tuple[PrefillChunk, PrefillPlan]:
        """A chunk over rows [start, end) of the group [req_start, req_start + num_reqs).

        As the builder hands it over: seed fields only, its block table starting at the
        request holding `start` (or at `table_from`, the plan's `requests` then indexing from
        there), and its plan per docs/contract.md section 3.3 (`first_request` holds `start`).
        """
        first = self.holder(start)
        base = first if table_from is None else table_from
        stop = req_start + num_reqs
        requests = tuple(
            (max(self.qsl[r], start) - start, min(self.qsl[r + 1], end) - start, r - base)
            for r in range(base, stop)
            if min(self.qsl[r + 1], end) > max(self.qsl[r], start)
        )
        row_ends = self.row_ends[start:end]
        chunk = PrefillChunk(
            token_start=start,
            token_end=end,
            num_reqs=stop - base,
            block_table=self.table[base:stop],
            cu_seqlen_ks=torch.zeros(end - start, dtype=torch.int32),
            cu_seqlen_ke=row_ends,
        )
        plan = PrefillPlan(
            first_request=first,
            requests=requests,
            query_start_loc=torch.zeros(stop - base + 1, dtype=torch.int32),
            width=0,
            row_ends=row_ends if views else row_ends.clone(),
            block_ends=None,
            context_lens=self.context[base:stop],
            use_gather=gather,
        )
        return chunk, plan


def _ranges(launches: list[GatherLaunch]) -> list[tuple[int, int]]:
    return [(launch.token_start, launch.token_end) for launch in launches]


def _check_launch_tensors(step: Step, launches: list[GatherLaunch]) -> None:
    for pool, launch in enumerate(launches):
        assert launch.pool == pool
        r = next(i for i in range(len(step.query_lens)) if step.qsl[i + 1] > launch.token_start)
        assert launch.token_end <= step.qsl[r + 1]  # one request per launch
        assert launch.block_table.shape == (1, 4)
        assert launch.block_table.data_ptr() == step.table[r].data_ptr()
        assert launch.context_len.shape == (1,)
        assert launch.context_len.data_ptr() == step.context[r:].data_ptr()
        assert torch.equal(launch.row_ends, step.row_ends[launch.token_start : launch.token_end])


def test_one_request_cut_in_three_is_joined_then_recut() -> None:
    step = Step([2, 1, 30])
    pieces = [step.chunk(a, a + 10, 2, 1, True) for a in (3, 13, 23)]
    chunks, plans = zip(*pieces, strict=True)
    launches = plan_gather_launches(chunks, plans, 12)
    assert _ranges(launches) == [(3, 15), (15, 27), (27, 33)]
    _check_launch_tensors(step, launches)
    # Joined across chunks yet a view: the plans' row ends are adjacent in one storage.
    assert launches[0].row_ends.data_ptr() == step.row_ends[3:].data_ptr()
    assert _ranges(plan_gather_launches(chunks, plans, 100)) == [(3, 33)]


@pytest.mark.parametrize(
    ("query_lens", "specs", "max_rows", "expected"),
    [
        pytest.param(
            [30, 5],
            [
                (0, 10, 0, 1, True),
                (10, 20, 0, 1, False),
                (20, 30, 0, 1, True),
                (30, 35, 1, 1, True),
            ],
            100,
            [(0, 10), (20, 30), (30, 35)],
            id="a non-gathering chunk breaks runs",
        ),
        # Chunk 0 holds requests 0 and 1; request 2 spans chunks 1-2; chunk 3's group is
        # requests 2-4 but only request 4 has rows in it, so the chunk starts there.
        pytest.param(
            [4, 6, 20, 0, 3],
            [(0, 10, 0, 2, True), (10, 22, 2, 1, True), (22, 30, 2, 1, True), (30, 33, 2, 3, True)],
            7,
            [(0, 4), (4, 10), (10, 17), (17, 24), (24, 30), (30, 33)],
            id="runs follow requests across multi-request chunks",
        ),
    ],
)
def test_launch_runs(
    query_lens: list[int],
    specs: list[tuple[int, int, int, int, bool]],
    max_rows: int,
    expected: list[tuple[int, int]],
) -> None:
    step = Step(query_lens)
    chunks, plans = zip(*(step.chunk(*spec) for spec in specs), strict=True)
    launches = plan_gather_launches(chunks, plans, max_rows)
    assert _ranges(launches) == expected
    _check_launch_tensors(step, launches)


def test_no_gathering_chunk_no_launch() -> None:
    step = Step([8])
    chunk, plan = step.chunk(0, 8, 0, 1, False)
    assert plan_gather_launches([chunk], [plan], 4) == []
    assert plan_gather_launches([], [], 4) == []


@pytest.mark.parametrize("with_buffer", [True, False])
def test_row_ends_copied_when_not_adjacent(with_buffer: bool) -> None:
    step = Step([20])
    chunks, plans = zip(
        step.chunk(0, 10, 0, 1, True, views=False),
        step.chunk(10, 20, 0, 1, True, views=False),
        strict=True,
    )
    buffer = torch.full((32,), POISON, dtype=torch.int32)
    launches = plan_gather_launches(chunks, plans, 15, row_ends_out=buffer if with_buffer else None)
    assert _ranges(launches) == [(0, 15), (15, 20)]
    _check_launch_tensors(step, launches)
    if with_buffer:
        assert launches[0].row_ends.data_ptr() == buffer.data_ptr()
        assert (buffer[15:] == POISON).all()  # the one-chunk launch stays a view
    assert launches[1].row_ends.data_ptr() == plans[1].row_ends[5:].data_ptr()


def test_errors() -> None:
    step = Step([8])
    chunk, plan = step.chunk(0, 8, 0, 1, True)
    with pytest.raises(ValueError, match="max_rows must be a positive integer, got 0"):
        plan_gather_launches([chunk], [plan], 0)
    with pytest.raises(ValueError, match="1 chunks but 2 plans"):
        plan_gather_launches([chunk], [plan, plan], 4)


def _expected(
    step: Step, specs: list[tuple[int, int, int, int, bool]], max_rows: int
) -> list[tuple[int, int]]:
    """Brute force: label every row, join equal labels, cut by max_rows."""
    labels: list[tuple[int, tuple[int, int]]] = []  # (row, (segment, request))
    segment = 0
    for start, end, _, _, gather in specs:
        if not gather:
            segment += 1
            continue
        for t in range(start, end):
            r = next(i for i in range(len(step.query_lens)) if step.qsl[i + 1] > t)
            labels.append((t, (segment, r)))
    runs: list[list[int]] = []
    for i, (t, label) in enumerate(labels):
        if i and labels[i - 1][1] == label and labels[i - 1][0] == t - 1:
            runs[-1][1] = t + 1
        else:
            runs.append([t, t + 1])
    return [(lo, min(lo + max_rows, hi)) for lo, hi in runs for lo in range(lo, hi, max_rows)]


@st.composite
def _chunked_steps(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, int, int, int, bool]]]:
    query_lens = draw(st.lists(st.integers(0, 25), min_size=1, max_size=10))
    qsl = [0, *np.cumsum(query_lens).tolist()]
    specs = []
    r = 0
    while r < len(query_lens):
        if query_lens[r] > 1 and draw(st.booleans()):
            cuts = sorted(draw(st.sets(st.integers(1, query_lens[r] - 1), max_size=4)))
            bounds = [qsl[r], *(qsl[r] + c for c in cuts), qsl[r + 1]]
            for a, b in itertools.pairwise(bounds):
                specs.append((a, b, r, 1, draw(st.booleans())))
            r += 1
        else:
            n = draw(st.integers(1, min(3, len(query_lens) - r)))
            if qsl[r + n] > qsl[r]:
                specs.append((qsl[r], qsl[r + n], r, n, draw(st.booleans())))
            r += n
    return query_lens, specs


@settings(max_examples=150, deadline=None)
@given(_chunked_steps(), st.integers(1, 30))
def test_launches_match_brute_force(
    drawn: tuple[list[int], list[tuple[int, int, int, int, bool]]], max_rows: int
) -> None:
    query_lens, specs = drawn
    step = Step(query_lens)
    pieces = [step.chunk(*spec) for spec in specs]
    chunks = [c for c, _ in pieces]
    plans = [p for _, p in pieces]
    launches = plan_gather_launches(chunks, plans, max_rows)
    assert _ranges(launches) == _expected(step, specs, max_rows)
    assert all(launch.num_rows <= max_rows for launch in launches)
    gathered = [t for a, b, _, _, g in specs if g for t in range(a, b)]
    assert [t for launch in launches for t in range(launch.token_start, launch.token_end)] == (
        gathered
    )
    _check_launch_tensors(step, launches)


def test_requests_index_a_block_table_that_starts_before_the_holder() -> None:
    # Group [1, 4): request 1 has no rows, yet the chunk's block table starts there, so the
    # plan's requests index from request 1 while `first_request` is 2, the holder of row 4.
    step = Step([4, 0, 6, 3])
    chunk, plan = step.chunk(4, 13, 1, 3, True, table_from=1)
    assert (plan.first_request, plan.requests) == (2, ((0, 6, 1), (6, 9, 2)))
    launches = plan_gather_launches([chunk], [plan], 4)
    assert _ranges(launches) == [(4, 8), (8, 10), (10, 13)]
    _check_launch_tensors(step, launches)


def _planned(
    query_lens: list[int], seq_lens: list[int], budget: int, min_width: int, seed: int
) -> tuple[Step, list[PrefillChunk], list[PrefillPlan]]:
    """A step's chunks and plans as the builder makes them (next_n = 1, R = 1)."""
    step = Step(query_lens, seed)
    step.context = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.tensor(step.qsl, dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    nd, _, _, _ = split_decodes_prefills(query_lens, 1)
    splits = split_prefill_chunks(seq_lens[nd:], query_lens[nd:], budget, request_offset=nd)
    rows = max(step.qsl[-1], 1)
    chunks = build_prefill_chunks(
        splits,
        step.qsl[nd],
        qsl,
        seq,
        seq,
        step.table,
        step.context,
        1,
        cu_seqlen_ks_out=torch.empty(rows, dtype=torch.int32),
        cu_seqlen_ke_out=torch.empty(rows, dtype=torch.int32),
        context_cumsum_out=torch.empty(len(query_lens) + 1, dtype=torch.int64),
        index_staging=torch.empty(3 * rows, dtype=torch.int32),
        index_scratch=torch.empty(3 * rows, dtype=torch.int32),
        cumsum_scratch=torch.empty(2 * rows, dtype=torch.int64),
    )
    # Seed fields only from here on, as a runtime following the seed hands them over.
    chunks = [dataclasses.replace(chunk, request_start=None) for chunk in chunks]
    plans = plan_prefill_chunks(chunks, qsl, seq, step.context, 1, 0, min_width, qsl.clone())
    for chunk, plan in zip(chunks, plans, strict=True):
        step.row_ends[chunk.token_start : chunk.token_end] = plan.row_ends
    return step, chunks, plans


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 1), max_size=3),
    st.lists(
        st.tuples(
            st.one_of(st.just(0), st.integers(0, 3), st.integers(0, 40)),
            st.one_of(st.just(0), st.integers(0, 5), st.integers(0, 400)),
        ),
        min_size=1,
        max_size=8,
    ),
    st.one_of(st.integers(1, 64), st.integers(64, 20_000)),
    st.integers(0, 300),
    st.integers(1, 30),
)
def test_launches_over_planned_chunks_match_brute_force(
    decodes: list[int],
    prefills: list[tuple[int, int]],
    budget: int,
    min_width: int,
    max_rows: int,
) -> None:
    query_lens = [*decodes, 2 + prefills[0][0], *(q for q, _ in prefills[1:])]
    history = [3] * len(decodes) + [h for _, h in prefills]
    seq_lens = [q + h for q, h in zip(query_lens, history, strict=True)]
    step, chunks, plans = _planned(query_lens, seq_lens, budget, min_width, len(query_lens))
    launches = plan_gather_launches(chunks, plans, max_rows)
    # Brute force over the chunks as they were planned; rows of dropped chunks (no key
    # visible) are absent, so they break runs as the planner's "starts where the last ended".
    specs = [
        (c.token_start, c.token_end, 0, 0, p.use_gather) for c, p in zip(chunks, plans, strict=True)
    ]
    assert _ranges(launches) == _expected(step, specs, max_rows)
    _check_launch_tensors(step, launches)
    for launch in launches:
        r = step.holder(launch.token_start)
        assert launch.context_len.tolist() == [seq_lens[r]]
