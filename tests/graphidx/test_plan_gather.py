"""Candidate-consumer prefill launches (SPEC 3.3, `plan_gather_launches`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphidx.metadata import GatherLaunch, PrefillChunk, PrefillPlan
from graphidx.plan import plan_gather_launches

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

    def chunk(
        self, start: int, end: int, req_start: int, num_reqs: int, gather: bool, views: bool = True
    ) -> tuple[PrefillChunk, PrefillPlan]:
        """A chunk over rows [start, end) of requests [req_start, req_start + num_reqs)."""
        requests = tuple(
            (max(self.qsl[r], start) - start, min(self.qsl[r + 1], end) - start, r - req_start)
            for r in range(req_start, req_start + num_reqs)
            if min(self.qsl[r + 1], end) > max(self.qsl[r], start)
        )
        row_ends = self.row_ends[start:end]
        chunk = PrefillChunk(
            token_start=start,
            token_end=end,
            num_reqs=num_reqs,
            block_table=self.table[req_start : req_start + num_reqs],
            cu_seqlen_ks=torch.zeros(end - start, dtype=torch.int32),
            cu_seqlen_ke=row_ends,
            request_start=req_start,
        )
        plan = PrefillPlan(
            first_request=req_start,
            requests=requests,
            query_start_loc=torch.zeros(num_reqs + 1, dtype=torch.int32),
            width=0,
            row_ends=row_ends if views else row_ends.clone(),
            block_ends=None,
            context_lens=self.context[req_start : req_start + num_reqs],
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
        assert launch.context_lens.shape == (1,)
        assert launch.context_lens.data_ptr() == step.context[r:].data_ptr()
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


def test_non_gathering_chunk_breaks_runs() -> None:
    step = Step([30, 5])
    chunks, plans = zip(
        step.chunk(0, 10, 0, 1, True),
        step.chunk(10, 20, 0, 1, False),
        step.chunk(20, 30, 0, 1, True),
        step.chunk(30, 35, 1, 1, True),
        strict=True,
    )
    launches = plan_gather_launches(chunks, plans, 100)
    assert _ranges(launches) == [(0, 10), (20, 30), (30, 35)]
    _check_launch_tensors(step, launches)


def test_runs_follow_requests_across_multi_request_chunks() -> None:
    # Chunk 0 holds requests 0 and 1; request 2 spans chunks 1-2; chunk 3 lists requests 2-4
    # but only request 4 has rows in it.
    step = Step([4, 6, 20, 0, 3])
    chunks, plans = zip(
        step.chunk(0, 10, 0, 2, True),
        step.chunk(10, 22, 2, 1, True),
        step.chunk(22, 30, 2, 1, True),
        step.chunk(30, 33, 2, 3, True),
        strict=True,
    )
    launches = plan_gather_launches(chunks, plans, 7)
    assert _ranges(launches) == [(0, 4), (4, 10), (10, 17), (17, 24), (24, 30), (30, 33)]
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
