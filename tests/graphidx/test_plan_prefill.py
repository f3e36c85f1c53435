"""Prefill planning: the logits-budget split, chunk construction, and chunk plans
(docs/contract.md section 3.3)."""

from __future__ import annotations

from dataclasses import dataclass, replace

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


# The seed's rule (docs/contract.md section 3.3), written independently: groups first, then
# their slices. ------------------------------------------------------------------------------


def _seed_split(
    contexts: list[int], query_lens: list[int], budget: int, offset: int = 0
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """docs/contract.md section 3.3 verbatim in plain loops: `((request lo, hi), (row lo, hi))`
    pairs."""

    def max_rows(width: int) -> int:
        return max(1, budget // (4 * max(width, 1)))

    groups: list[list[int]] = []
    current: list[int] = []
    for i in range(len(query_lens)):
        rows = sum(query_lens[j] for j in current)
        width = max([0] + [contexts[j] for j in current])
        if rows > 0 and rows + query_lens[i] > max_rows(max(width, contexts[i])):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)

    pairs = []
    for group in groups:
        rows = sum(query_lens[j] for j in group)
        step = max_rows(max([0] + [contexts[j] for j in group]))
        requests = (group[0] + offset, group[-1] + 1 + offset)
        lo = 0
        while lo < rows:
            pairs.append((requests, (lo, min(lo + step, rows))))
            lo += step
    return pairs


# split_prefill_chunks -----------------------------------------------------------------


def test_split_spec_example_wide_second_request() -> None:
    # docs/contract.md section 3.3: contexts [1, 5000], rows [17, 300], 4000 bytes -> 301 pairs.
    out = _pairs(split_prefill_chunks([1, 5000], [17, 300], 4000))
    assert len(out) == 301
    assert out[:3] == [((0, 1), (0, 17)), ((1, 2), (0, 1)), ((1, 2), (1, 2))]
    assert out[1:] == [((1, 2), (lo, lo + 1)) for lo in range(300)]
    assert out[-1] == ((1, 2), (299, 300))
    assert out == _seed_split([1, 5000], [17, 300], 4000)


def test_split_spec_example_zero_contexts() -> None:
    # docs/contract.md section 3.3: a zero context counts as width 1 (50 rows per slice at 200
    # bytes) -> 71 pairs.
    out = _pairs(split_prefill_chunks([0, 0, 5000], [2, 300, 64], 200))
    assert len(out) == 71
    assert out[:3] == [((0, 1), (0, 2)), ((1, 2), (0, 50)), ((1, 2), (50, 100))]
    assert out[1:7] == [((1, 2), (lo, lo + 50)) for lo in range(0, 300, 50)]
    assert out[7:] == [((2, 3), (lo, lo + 1)) for lo in range(64)]
    assert out == _seed_split([0, 0, 5000], [2, 300, 64], 200)


def test_split_spec_example_zero_rows_join_the_next_group() -> None:
    # docs/contract.md section 3.3: the zero-row request 0 joins request 1's group -> 65 pairs.
    out = _pairs(split_prefill_chunks([65536, 1, 999], [0, 64, 64], 262144))
    assert len(out) == 65
    assert out[:2] == [((0, 2), (0, 1)), ((0, 2), (1, 2))]
    assert out[:64] == [((0, 2), (lo, lo + 1)) for lo in range(64)]
    assert out[64] == ((2, 3), (0, 64))  # 262144 // (4 * 999) = 65 rows fit
    assert out == _seed_split([65536, 1, 999], [0, 64, 64], 262144)


def test_split_returns_request_then_row_slices() -> None:
    ((requests, rows),) = split_prefill_chunks([3], [5], 10**6, request_offset=4)
    assert (requests, rows) == (slice(4, 5), slice(0, 5))


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
    # 100 breaks the group and is cut into 6-row slices (2400 // 400), rows counted from the
    # group's own first row.
    out = split_prefill_chunks([10, 20, 5, 100], [10, 10, 10, 10], 2400, request_offset=5)
    assert _pairs(out) == [((5, 8), (0, 30)), ((8, 9), (0, 6)), ((8, 9), (6, 10))]


def test_split_zero_length_groups_yield_nothing() -> None:
    # Request 1 is too wide to join request 0 (4 rows > 1 row at width 5000); requests 1 and 2
    # form a group with no rows.
    out = split_prefill_chunks([50, 5000, 5000], [4, 0, 0], 4000)
    assert _pairs(out) == [((0, 1), (0, 4))]
    assert split_prefill_chunks([7, 9], [0, 0], 100) == []
    assert split_prefill_chunks([], [], 100) == []


def test_split_trailing_padding_requests_join_the_group() -> None:
    out = split_prefill_chunks([50, 0, 0], [4, 0, 0], 4000, request_offset=3)
    assert _pairs(out) == [((3, 6), (0, 4))]


def test_split_zero_row_request_after_an_overfull_group_starts_the_next() -> None:
    # Request 0's 5 rows already exceed max_rows(100) = 1, so the zero-row request 1 cannot
    # join; it leads request 2's group.
    out = _pairs(split_prefill_chunks([100, 1, 1], [5, 0, 3], 400))
    assert out == [((0, 1), (lo, lo + 1)) for lo in range(5)] + [((1, 3), (0, 3))]


def test_split_zero_width_group() -> None:
    # Width 0 counts as 1 for the slice size: 8 // 4 = 2 rows per slice, so request 1 (5 more
    # rows) cannot join request 0.
    out = split_prefill_chunks([0, 0], [5, 5], 8)
    expected = [((r, r + 1), (lo, min(lo + 2, 5))) for r in (0, 1) for lo in range(0, 5, 2)]
    assert _pairs(out) == expected


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


_CONTEXTS = st.one_of(st.just(0), st.integers(0, 8), st.integers(0, 3000), st.integers(0, 70_000))
_ROWS = st.one_of(st.just(0), st.integers(0, 4), st.integers(0, 300))
_BUDGETS = st.one_of(st.integers(1, 64), st.integers(1, 200_000), st.integers(1, 2**22))


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(_CONTEXTS, _ROWS), max_size=16),
    _BUDGETS,
    st.integers(0, 7),
    st.sampled_from(["list", "numpy", "tensor"]),
)
def test_split_matches_the_seed_rule(
    requests: list[tuple[int, int]], budget: int, offset: int, kind: str
) -> None:
    contexts = [c for c, _ in requests]
    query_lens = [q for _, q in requests]
    args: tuple[object, object]
    if kind == "numpy":
        args = (np.array(contexts, dtype=np.int64), np.array(query_lens, dtype=np.int32))
    elif kind == "tensor":
        args = (torch.tensor(contexts, dtype=torch.int64), torch.tensor(query_lens))
    else:
        args = (contexts, query_lens)
    out = split_prefill_chunks(*args, budget, request_offset=offset)  # type: ignore[arg-type]
    assert all(isinstance(r, slice) and isinstance(q, slice) for r, q in out)
    assert _pairs(out) == _seed_split(contexts, query_lens, budget, offset)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_CONTEXTS, _ROWS), max_size=15), _BUDGETS, st.integers(0, 5))
def test_split_properties(requests: list[tuple[int, int]], budget: int, offset: int) -> None:
    contexts = [c for c, _ in requests]
    query_lens = [q for _, q in requests]
    out = split_prefill_chunks(contexts, query_lens, budget, request_offset=offset)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(int)
    # Step rows (group row + slice row) tile every prefill row exactly once, in order.
    covered = [
        int(qsl[reqs.start - offset]) + row
        for reqs, rows in out
        for row in range(rows.start, rows.stop)
    ]
    assert covered == list(range(int(qsl[-1])))
    previous_requests = None
    for reqs, rows in out:
        assert rows.stop > rows.start >= 0
        local = range(reqs.start - offset, reqs.stop - offset)
        assert 0 <= local.start < local.stop <= len(requests)
        # A group's slices count from its first row and stay inside its rows.
        assert rows.stop <= qsl[local.stop] - qsl[local.start]
        if reqs != previous_requests:
            assert rows.start == 0
        width = max(contexts[r] for r in local)
        # The logits budget holds except for single rows (the smallest possible launch).
        assert rows.stop - rows.start == 1 or (rows.stop - rows.start) * width * 4 <= budget
        # Request groups never overlap and go forward.
        if previous_requests is not None and previous_requests != reqs:
            assert reqs.start >= previous_requests.stop
        previous_requests = reqs
    # Every request is in some group, or in a group without rows.
    grouped = {r for reqs, _ in out for r in range(reqs.start - offset, reqs.stop - offset)}
    assert all(query_lens[r] == 0 for r in range(len(requests)) if r not in grouped)


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

    def holder(self, row: int) -> int:
        """The request holding step row `row` (plain loop; zero-row requests hold none)."""
        qsl = self.qsl.tolist()
        return next(r for r in range(len(self.query_lens)) if qsl[r] <= row < qsl[r + 1])


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


def _build(
    step: Step, splits: list[tuple[slice, slice]], row_offset: int, buffers: Buffers
) -> list[PrefillChunk]:
    return build_prefill_chunks(
        splits,
        row_offset,
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


def _chunks(
    step: Step, budget: int, buffers: Buffers, next_n: int = 2
) -> tuple[list[PrefillChunk], int]:
    nd, _, _, _ = split_decodes_prefills(step.query_lens, next_n)
    upper_context = [u // step.ratio for u in step.upper]
    splits = split_prefill_chunks(
        upper_context[nd:], step.query_lens[nd:], budget, request_offset=nd
    )
    return _build(step, splits, int(step.qsl[nd]), buffers), nd


def _brute_force_ks_ke(step: Step, chunk: PrefillChunk) -> tuple[list[int], list[int]]:
    qsl = step.qsl.tolist()
    first = step.holder(chunk.token_start)
    ks, ke = [], []
    for t in range(chunk.token_start, chunk.token_end):
        r = step.holder(t)
        assert first <= r < first + chunk.num_reqs
        start = sum(s // step.ratio for s in step.seq_lens[first:r])
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
        first = step.holder(chunk.token_start)
        rs = slice(first, first + chunk.num_reqs)
        assert torch.equal(chunk.block_table, step.table[rs])
        assert chunk.block_table.data_ptr() == step.table[rs].data_ptr()  # a view
    assert (buffers.ks[:3] == POISON).all() and (buffers.ks[52:] == POISON).all()


def test_build_chunks_turn_group_rows_into_step_rows(gen: torch.Generator) -> None:
    # Decode [1]; prefills 1..3 with contexts [105, 7, 4] and rows [5, 0, 3] at 400 bytes:
    # request 1 is cut into single rows; the zero-row request 2 cannot join it and leads
    # request 3's group, whose rows the split counts from 0.
    step = _step([1, 5, 0, 3], [10, 105, 7, 4], 1, gen)
    nd, _, _, _ = split_decodes_prefills(step.query_lens, 1)
    splits = split_prefill_chunks([105, 7, 4], [5, 0, 3], 400, request_offset=nd)
    assert _pairs(splits) == [((1, 2), (lo, lo + 1)) for lo in range(5)] + [((2, 4), (0, 3))]
    buffers = Buffers()
    chunks = _build(step, splits, int(step.qsl[nd]), buffers)
    # The group (2, 4)'s chunk starts at request 3, which holds its first row: request 2 has
    # no rows in it (and its context is not counted in ks).
    assert [(c.token_start, c.token_end, c.request_start, c.num_reqs) for c in chunks] == [
        *((t, t + 1, 1, 1) for t in range(1, 6)),
        (6, 9, 3, 1),
    ]
    assert chunks[-1].cu_seqlen_ks.tolist() == [0, 0, 0]
    assert chunks[-1].cu_seqlen_ke.tolist() == [2, 3, 4]
    assert chunks[-1].block_table.data_ptr() == step.table[3].data_ptr()
    for chunk in chunks:
        assert (chunk.cu_seqlen_ks.tolist(), chunk.cu_seqlen_ke.tolist()) == _brute_force_ks_ke(
            step, chunk
        )


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

    def run(
        splits: list[tuple[slice, slice]], row_offset: int = 0, into: Buffers = buffers
    ) -> list[PrefillChunk]:
        return _build(step, splits, row_offset, into)

    with pytest.raises(ValueError, match="splits must tile the prefill rows in order from row"):
        run([(slice(0, 1), slice(1, 5))])
    with pytest.raises(ValueError, match="splits must tile the prefill rows"):
        run([(slice(0, 1), slice(0, 2)), (slice(0, 1), slice(3, 5))])
    with pytest.raises(ValueError, match="from row_offset = 6"):
        run([(slice(1, 2), slice(0, 5))], row_offset=6)
    with pytest.raises(ValueError, match=r"splits\[0\] rows \[0, 6\) reach past the 5 rows of"):
        run([(slice(1, 2), slice(0, 6))], row_offset=5)
    with pytest.raises(ValueError, match=r"splits\[1\] requests \[1, 3\) fall outside the step"):
        run([(slice(0, 1), slice(0, 5)), (slice(1, 3), slice(0, 5))])
    with pytest.raises(ValueError, match=r"splits\[0\] rows \[2, 2\) are empty"):
        run([(slice(0, 1), slice(2, 2))])
    with pytest.raises(ValueError, match="row_offset must be a non-negative integer, got -1"):
        run([(slice(0, 1), slice(0, 5))], row_offset=-1)
    with pytest.raises(ValueError, match="prefill buffers too small for 5 rows"):
        run([(slice(0, 1), slice(0, 5))])
    assert run([]) == []
    # Row slices count from each group's first row: request 1's rows [0, 5) are step rows
    # [5, 10).
    chunks = run([(slice(0, 1), slice(0, 5)), (slice(1, 2), slice(0, 5))], into=Buffers())
    assert [(c.token_start, c.token_end, c.request_start) for c in chunks] == [
        (0, 5, 0),
        (5, 10, 1),
    ]


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


def _seed_chunk(
    step: Step,
    rows: tuple[int, int],
    reqs: tuple[int, int],
    ks: torch.Tensor,
    ke: torch.Tensor,
    request_start: int | None = None,
) -> PrefillChunk:
    """A chunk set by hand: step rows `rows` = [start, end), the `reqs` = (first, count)
    requests' block-table rows, and the given ks / ke."""
    (start, end), (first, num_reqs) = rows, reqs
    return PrefillChunk(
        token_start=start,
        token_end=end,
        num_reqs=num_reqs,
        block_table=step.table[first : first + num_reqs],
        cu_seqlen_ks=ks,
        cu_seqlen_ke=ke,
        request_start=request_start,
    )


def _seed_fields(chunk: PrefillChunk) -> PrefillChunk:
    """The chunk as a runtime following the seed would hand it over: no `request_start`."""
    return replace(chunk, request_start=None)


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
        rs = slice(plan.first_request, plan.first_request + chunk.num_reqs)
        assert plan.context_lens.tolist() == step.context[rs].tolist()
    if persistent:
        assert plans[3].row_ends.data_ptr() == buffers.row_ends[33:].data_ptr()
        assert plans[1].query_start_loc.data_ptr() == buffers.local_qsl[2:].data_ptr()
        assert (buffers.row_ends[:3] == POISON).all() and (buffers.row_ends[52:] == POISON).all()
        assert (buffers.local_qsl[10:] == POISON).all()


def test_plan_of_seed_fields_only_equals_the_builders(gen: torch.Generator) -> None:
    step = _step([2, 1, 30, 0, 12, 7, 0], [50, 9, 400, 60, 130, 107, 3], 2, gen)
    chunks, _ = _chunks(step, 10 * 200 * 4, Buffers())
    assert all(chunk.request_start is not None for chunk in chunks)
    with_start = _plans(step, chunks, None, 8, 100)
    without = _plans(step, [_seed_fields(chunk) for chunk in chunks], None, 8, 100)
    for a, b in zip(with_start, without, strict=True):
        assert (a.first_request, a.requests, a.width, a.use_gather) == (
            b.first_request,
            b.requests,
            b.width,
            b.use_gather,
        )
        for x, y in ((a.query_start_loc, b.query_start_loc), (a.row_ends, b.row_ends)):
            assert torch.equal(x, y)
        assert a.block_ends is not None and b.block_ends is not None
        assert torch.equal(a.block_ends, b.block_ends)
        assert torch.equal(a.context_lens, b.context_lens)


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
    # A chunk of seed fields only, over rows 5..8 of request 1 (rows 4..9), listing requests
    # 1 and 2: its first request is found from token_start.
    step = _step([4, 5, 3], [10, 10, 10], 1, gen)
    chunk = _seed_chunk(
        step, (5, 8), (1, 2), torch.zeros(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    )
    (plan,) = _plans(step, [chunk], None, 0, None)
    assert plan.first_request == 1
    assert plan.requests == ((0, 3, 0),)
    assert plan.query_start_loc.tolist() == [0, 3, 3]  # 4 - 5 clamps to 0, 12 - 5 to 3
    assert plan.context_lens.storage_offset() == 1  # a view from request 1


def test_plan_first_request_skips_zero_row_requests(gen: torch.Generator) -> None:
    # Requests 1 and 2 have no rows: row 4 is held by request 3.
    step = _step([4, 0, 0, 6], [10, 3, 5, 20], 1, gen)
    ke = torch.arange(15, 21, dtype=torch.int32)
    chunk = _seed_chunk(step, (4, 10), (3, 1), torch.zeros(6, dtype=torch.int32), ke)
    (plan,) = _plans(step, [chunk], None, 0, None)
    assert (plan.first_request, plan.requests, plan.width) == (3, ((0, 6, 0),), 20)
    assert plan.query_start_loc.tolist() == [0, 6]


def test_plan_errors(gen: torch.Generator) -> None:
    step = _step([4, 5], [10, 10], 1, gen)

    def chunk(
        start: int, end: int, num_reqs: int, request_start: int | None = None
    ) -> PrefillChunk:
        rows = torch.zeros(end - start, dtype=torch.int32)
        first = request_start if request_start is not None else 0
        return _seed_chunk(step, (start, end), (first, num_reqs), rows, rows, request_start)

    with pytest.raises(ValueError, match=r"chunk rows \[4, 10\) fall outside the step's 9 rows"):
        _plans(step, [chunk(4, 10, 1)], None, 0, None)
    with pytest.raises(ValueError, match=r"chunk rows \[9, 9\) fall outside"):
        _plans(step, [chunk(9, 9, 1)], None, 0, None)
    with pytest.raises(
        ValueError,
        match="chunk request_start = 1 disagrees with token_start = 2, which request 0 holds",
    ):
        _plans(step, [chunk(2, 6, 1, request_start=1)], None, 0, None)
    with pytest.raises(ValueError, match="request_start = 0 disagrees with token_start = 4"):
        _plans(step, [chunk(4, 9, 1, request_start=0)], None, 0, None)
    with pytest.raises(ValueError, match=r"num_reqs = 2 from request 1 .* outside the step's 2"):
        _plans(step, [chunk(4, 9, 2)], None, 0, None)
    with pytest.raises(ValueError, match="num_reqs = 0 from request 0"):
        _plans(step, [chunk(0, 4, 0)], None, 0, None)
    with pytest.raises(
        ValueError, match=r"chunk rows \[2, 6\) reach past the rows of its requests \[0, 1\)"
    ):
        _plans(step, [chunk(2, 6, 1)], None, 0, None)
    small = Buffers(rows=8, reqs=0)
    with pytest.raises(ValueError, match="query_start_loc_out has 16 entries, 18 needed"):
        _plans(step, [chunk(0, 4, 1)] * 9, small, 0, None)


# Differential: builder + planner against docs/contract.md section 3.3 applied by hand ----


@dataclass
class Expected:
    """One chunk and its plan, computed row by row from docs/contract.md section 3.3 in plain
    loops."""

    token_start: int
    token_end: int
    first: int
    num_reqs: int
    ks: list[int]
    ke: list[int]
    requests: tuple[tuple[int, int, int], ...]
    local_qsl: list[int]
    width: int


def _expected_chunks(step: Step, nd: int, budget: int) -> list[Expected]:
    qsl = step.qsl.tolist()
    ratio = step.ratio
    upper_context = [u // ratio for u in step.upper]
    pairs = _seed_split(upper_context[nd:], step.query_lens[nd:], budget, nd)
    out = []
    for (g, e), (lo, hi) in pairs:
        start, end = qsl[g] + lo, qsl[g] + hi
        first = step.holder(start)
        # Kept when some row can see a key at the upper bounds.
        if not any(
            (step.upper[step.holder(t)] - qsl[step.holder(t) + 1] + t + 1) // ratio > 0
            for t in range(start, end)
        ):
            continue
        ks, ke = [], []
        for t in range(start, end):
            r = step.holder(t)
            base = sum(step.seq_lens[j] // ratio for j in range(first, r))
            ks.append(base)
            ke.append(base + (step.seq_lens[r] - qsl[r + 1] + t + 1) // ratio)
        requests = []
        local = []
        for r in range(first, e):
            a, b = max(qsl[r], start), min(qsl[r + 1], end)
            if b > a:
                requests.append((a - start, b - start, r - first))
            local.append(min(max(qsl[r] - start, 0), end - start))
        local.append(min(max(qsl[e] - start, 0), end - start))
        width = max(step.upper[r] // ratio for r in range(first, e))
        out.append(Expected(start, end, first, e - first, ks, ke, tuple(requests), local, width))
    return out


@st.composite
def _steps(draw: st.DrawFn) -> tuple[Step, int, int]:
    next_n = draw(st.integers(1, 3))
    ratio = draw(st.sampled_from([1, 2, 4]))
    decodes = draw(st.lists(st.integers(0, next_n), max_size=3))
    first_prefill = draw(st.integers(next_n + 1, next_n + 40))
    rest = draw(st.lists(st.one_of(st.just(0), st.integers(0, 5), st.integers(0, 60)), max_size=7))
    query_lens = [*decodes, first_prefill, *rest]
    # History beyond the query rows: often none (small or zero contexts), sometimes long.
    history = draw(
        st.lists(
            st.one_of(st.just(0), st.integers(0, 8), st.integers(0, 3000)),
            min_size=len(query_lens),
            max_size=len(query_lens),
        )
    )
    slack = draw(st.lists(st.integers(0, 9), min_size=len(query_lens), max_size=len(query_lens)))
    seq_lens = [q + h for q, h in zip(query_lens, history, strict=True)]
    upper = [s + x for s, x in zip(seq_lens, slack, strict=True)]
    seed = draw(st.integers(0, 2**31 - 1))
    table = torch.randint(
        0,
        10**4,
        (len(query_lens), 5),
        generator=torch.Generator().manual_seed(seed),
        dtype=torch.int32,
    )
    budget = draw(st.one_of(st.integers(1, 64), st.integers(64, 40_000)))
    return Step(query_lens, seq_lens, upper, ratio, table), next_n, budget


@settings(max_examples=150, deadline=None)
@given(_steps(), st.sampled_from([0, 4, 8]), st.sampled_from([None, 1, 50]))
def test_build_and_plan_match_the_spec_by_hand(
    drawn: tuple[Step, int, int], c: int, min_width: int | None
) -> None:
    step, next_n, budget = drawn
    buffers = Buffers()
    chunks, nd = _chunks(step, budget, buffers, next_n=next_n)
    expected = _expected_chunks(step, nd, budget)
    assert [(ch.token_start, ch.token_end, ch.request_start, ch.num_reqs) for ch in chunks] == [
        (x.token_start, x.token_end, x.first, x.num_reqs) for x in expected
    ]
    for plans in (
        _plans(step, chunks, buffers, c, min_width),
        _plans(step, [_seed_fields(ch) for ch in chunks], None, c, min_width),
    ):
        for chunk, plan, x in zip(chunks, plans, expected, strict=True):
            assert chunk.cu_seqlen_ks.tolist() == x.ks
            assert chunk.cu_seqlen_ke.tolist() == x.ke
            assert torch.equal(chunk.block_table, step.table[x.first : x.first + x.num_reqs])
            assert plan.first_request == x.first
            assert plan.requests == x.requests
            assert plan.query_start_loc.tolist() == x.local_qsl
            assert plan.width == x.width
            assert plan.use_gather == (min_width is not None and x.width >= min_width)
            row_ends = [b - a for a, b in zip(x.ks, x.ke, strict=True)]
            assert plan.row_ends.tolist() == row_ends
            if c:
                assert plan.block_ends is not None
                assert plan.block_ends.tolist() == [-(-e // c) for e in row_ends]
            else:
                assert plan.block_ends is None
            assert plan.context_lens.tolist() == [
                s // step.ratio for s in step.seq_lens[x.first : x.first + x.num_reqs]
            ]


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
            r = step.holder(t)
            assert (seq_lens[r] - (qsl[r + 1] - t) + 1) // ratio == 0
    starts = [c.token_start for c in chunks]
    assert starts == sorted(starts)

    for chunk, plan in zip(chunks, plans, strict=True):
        ks, ke = _brute_force_ks_ke(step, chunk)
        assert chunk.cu_seqlen_ks.tolist() == ks and chunk.cu_seqlen_ke.tolist() == ke
        assert plan.first_request == step.holder(chunk.token_start) == chunk.request_start
        # requests tile the chunk's rows, in order.
        rows = [row for lo, hi, _ in plan.requests for row in range(lo, hi)]
        assert rows == list(range(chunk.num_rows))
        for lo, hi, req in plan.requests:
            r = plan.first_request + req
            assert max(qsl[r], chunk.token_start) - chunk.token_start == lo
            assert min(qsl[r + 1], chunk.token_end) - chunk.token_start == hi
        local = plan.query_start_loc.tolist()
        assert len(local) == chunk.num_reqs + 1
        for lo, hi, req in plan.requests:
            assert (local[req], local[req + 1]) == (lo, hi)
        assert local[0] == 0 and local[-1] == chunk.num_rows
        rs = range(plan.first_request, plan.first_request + chunk.num_reqs)
        assert plan.width == max(upper[r] // ratio for r in rs)
        # The logits budget holds at the planned width, single rows excepted.
        assert chunk.num_rows == 1 or chunk.num_rows * plan.width * 4 <= budget
        assert plan.use_gather == (plan.width >= 50)
        assert plan.row_ends.tolist() == [b - a for a, b in zip(ks, ke, strict=True)]


def test_plan_with_persistent_outputs_and_separate_chunk_tensors(gen: torch.Generator) -> None:
    """Chunks whose ks/ke are not adjacent views still get exact row ends, per chunk."""
    step = _step([6, 5], [10, 30], 1, gen)
    ks = [torch.tensor([0] * 6, dtype=torch.int32), torch.tensor([10] * 5, dtype=torch.int32)]
    ke = [torch.arange(5, 11, dtype=torch.int32), torch.arange(36, 41, dtype=torch.int32)]
    chunks = [
        _seed_chunk(step, (a, b), (first, n), k, e)
        for (a, b, first, n), k, e in zip([(0, 6, 0, 2), (6, 11, 1, 1)], ks, ke, strict=True)
    ]
    buffers = Buffers(rows=16)
    plans = _plans(step, chunks, buffers, 4, None)
    assert plans[0].row_ends.tolist() == [5, 6, 7, 8, 9, 10]
    assert plans[1].row_ends.tolist() == [26, 27, 28, 29, 30]
    assert plans[1].block_ends is not None and plans[1].block_ends.tolist() == [7, 7, 7, 8, 8]
    assert plans[1].row_ends.data_ptr() == buffers.row_ends[6:].data_ptr()
    assert (buffers.row_ends[11:] == POISON).all()


@pytest.mark.parametrize(
    ("c", "out_rows", "match"),
    [
        (8, 32, "block_ends_out is required with row_ends_out"),
        (0, 19, "must hold the step's 20 rows"),
    ],
)
def test_plan_persistent_output_errors(
    gen: torch.Generator, c: int, out_rows: int, match: str
) -> None:
    step = _step([20], [40], 1, gen)
    chunks, _ = _chunks(step, 10**6, Buffers())
    with pytest.raises(ValueError, match=match):
        plan_prefill_chunks(
            chunks,
            step.qsl,
            step.qsl[1:],
            step.context,
            1,
            c,
            None,
            step.qsl,
            row_ends_out=torch.empty(out_rows, dtype=torch.int32),
        )
