"""Decode planning: the split, the flattened decode rows, and the native-decode decision."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphidx.batch import StepBatch
from graphidx.builder import CandidateIndexerMetadataBuilder, IndexerMetadataBuilder
from graphidx.config import IndexerConfig
from graphidx.plan import (
    build_decode_rows,
    decode_row_index,
    native_decode,
    split_decodes_prefills,
)

POISON = -777


# split_decodes_prefills ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("query_lens", "next_n", "expected"),
    [
        ([1, 1, 1], 1, (3, 3, 0, 0)),
        ([2, 1, 2, 0], 2, (4, 5, 0, 0)),  # ragged speculative step with a padding request
        ([2, 2, 7, 1, 2], 2, (2, 4, 3, 10)),  # short requests after the first prefill
        ([5, 1], 1, (0, 0, 2, 6)),
        ([0, 0, 3, 0], 2, (2, 0, 2, 3)),  # leading padding decodes, trailing padding prefill
        ([], 3, (0, 0, 0, 0)),
        ([4, 4], 4, (2, 8, 0, 0)),
    ],
)
def test_split_decodes_prefills(query_lens: list[int], next_n: int, expected: tuple) -> None:
    assert split_decodes_prefills(query_lens, next_n) == expected
    tensor = torch.tensor(query_lens, dtype=torch.int32)
    assert split_decodes_prefills(tensor, next_n) == expected
    assert split_decodes_prefills(np.array(query_lens, dtype=np.int64), next_n) == expected


def test_split_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="next_n must be a positive integer, got 0"):
        split_decodes_prefills([1], 0)
    with pytest.raises(ValueError, match="query_lens_cpu must be a host"):
        split_decodes_prefills(torch.ones(2, dtype=torch.int32, device="meta"), 1)
    with pytest.raises(ValueError, match="query_lens_cpu must be 1-D"):
        split_decodes_prefills([[1, 2]], 1)


@given(st.lists(st.integers(0, 9), max_size=30), st.integers(1, 4))
def test_split_matches_definition(query_lens: list[int], next_n: int) -> None:
    nd, ndt, npf, npt = split_decodes_prefills(query_lens, next_n)
    assert nd + npf == len(query_lens)
    assert all(q <= next_n for q in query_lens[:nd])
    assert npf == 0 or query_lens[nd] > next_n
    assert ndt == sum(query_lens[:nd]) and npt == sum(query_lens[nd:])


# native_decode ------------------------------------------------------------------------


def _rows(num_rows: int, cols: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    row_lens = torch.randint(1, 1000, (num_rows,), generator=g, dtype=torch.int32)
    table = torch.randint(0, 100, (num_rows, cols), generator=g, dtype=torch.int32)
    return row_lens, table


def test_native_decode_uniform_is_a_strided_view() -> None:
    row_lens, table = _rows(8)
    context = torch.arange(10, 20, dtype=torch.int32)
    native = native_decode(row_lens, table, [2, 2, 2, 2], 2, context)
    assert native is not None and native.next_n == 2
    assert torch.equal(native.block_table, table[0::2])
    assert native.block_table.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    assert native.block_table.stride() == (10, 1)
    native.block_table[1, 0] = -1  # a view: writes reach the row block table
    assert table[2, 0] == -1
    assert torch.equal(native.context_lens, context[:4])
    assert native.context_lens.data_ptr() == context.data_ptr()


@pytest.mark.parametrize(
    ("query_lens", "num_rows", "native"),
    [
        ([2, 2, 0, 0], 8, True),  # graph padding requests keep their next_n rows
        ([2, 2, 1], 6, True),  # the first short request may be partial, nothing after it
        ([2, 1, 2], 6, False),  # ragged: a full request after a short one
        ([2, 0, 1], 6, False),  # rows after the first short request
        ([2, 2], 5, False),  # rows do not match num_reqs * next_n
        ([2, 3], 6, False),  # not a decode
        ([1, 1, 1], 3, False),  # next_n == 1 is never native (checked with next_n=1 below)
        ([], 0, False),
    ],
)
def test_native_decode_shapes(query_lens: list[int], num_rows: int, native: bool) -> None:
    next_n = 1 if query_lens == [1, 1, 1] else 2
    row_lens, table = _rows(num_rows)
    result = native_decode(row_lens, table, query_lens, next_n, torch.ones(8, dtype=torch.int32))
    assert (result is not None) == native


def test_native_decode_next_n_one() -> None:
    row_lens, table = _rows(3)
    assert native_decode(row_lens, table, [1, 1, 1], 1, torch.ones(3, dtype=torch.int32)) is None


def test_native_decode_rejects_short_context_lens() -> None:
    row_lens, table = _rows(4)
    with pytest.raises(ValueError, match="context_lens has 1 entries, fewer than the 2"):
        native_decode(row_lens, table, [2, 2], 2, torch.ones(1, dtype=torch.int32))


@settings(max_examples=60)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=12),
    st.integers(2, 4),
    st.integers(0, 2**31 - 1),
)
def test_native_decode_depends_on_shapes_only(
    query_lens: list[int], next_n: int, seed: int
) -> None:
    query_lens = [min(q, next_n) for q in query_lens]
    num_rows = len(query_lens) * next_n
    outcomes = set()
    for trial in range(3):
        g = torch.Generator().manual_seed(seed + trial)
        row_lens = torch.randint(0, 10**6, (num_rows,), generator=g, dtype=torch.int32)
        table = torch.randint(0, 10**6, (num_rows, 3), generator=g, dtype=torch.int32)
        context = torch.randint(0, 10**6, (len(query_lens),), generator=g, dtype=torch.int32)
        result = native_decode(row_lens, table, query_lens, next_n, context)
        outcomes.add(None if result is None else (result.next_n, tuple(result.block_table.shape)))
    assert len(outcomes) == 1
    first_short = next((i for i, q in enumerate(query_lens) if q != next_n), len(query_lens))
    expected = all(q == 0 for q in query_lens[first_short + 1 :])
    assert (outcomes.pop() is not None) == expected


# decode rows --------------------------------------------------------------------------


def _brute_force_rows(
    query_lens: list[int],
    seq_lens: list[int],
    table: torch.Tensor,
    num_rows: int,
    ratio: int,
    c: int,
) -> tuple[list[int], list[list[int]], list[int]]:
    lens: list[int] = []
    rows: list[list[int]] = []
    for r, (q, seq) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for j in range(q):
            lens.append((seq - q + j + 1) // ratio)
            rows.append(table[r].tolist())
    pad = num_rows - len(lens)
    lens += [0] * pad
    rows += [[0] * table.shape[1]] * pad
    ends = [-(-v // c) for v in lens] if c else []
    return lens, rows, ends


class _DecodeBuffers:
    def __init__(self, max_rows: int = 64, max_cols: int = 8) -> None:
        self.row_lens = torch.empty(max_rows, dtype=torch.int32)
        self.row_table = torch.empty(max_rows, max_cols, dtype=torch.int32)
        self.block_ends = torch.empty(max_rows, dtype=torch.int32)
        self.staging = torch.empty(2 * max_rows, dtype=torch.int32)
        self.scratch = torch.empty(2 * max_rows, dtype=torch.int32)

    def poison(self) -> None:
        for t in (self.row_lens, self.row_table, self.block_ends, self.scratch):
            t.fill_(POISON)

    def run(self, qsl: torch.Tensor, seq_lens, table, nd, num_rows, ratio, c, **kw):  # type: ignore[no-untyped-def]
        return build_decode_rows(
            qsl,
            seq_lens,
            table,
            nd,
            num_rows,
            ratio,
            c,
            row_lens_out=self.row_lens,
            row_block_table_out=self.row_table,
            block_ends_out=self.block_ends if c else None,
            index_staging=self.staging,
            index_scratch=self.scratch,
            **kw,
        )


def _qsl(query_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "num_decodes", "num_rows", "ratio", "c"),
    [
        ([2, 1, 2, 0], [40, 9, 77, 5], 4, 8, 1, 0),  # ragged speculative + padding rows
        ([2, 1, 2, 0], [40, 9, 77, 5], 4, 5, 4, 8),  # compressed, candidate blocks
        ([3, 3, 9], [300, 3, 500], 2, 6, 2, 4),  # decodes followed by a prefill
        ([0, 0], [17, 4], 2, 4, 1, 8),  # nothing but padding
        ([1], [1], 1, 1, 4, 8),  # sees no entry yet
    ],
)
def test_build_decode_rows(
    query_lens: list[int],
    seq_lens: list[int],
    num_decodes: int,
    num_rows: int,
    ratio: int,
    c: int,
    gen: torch.Generator,
) -> None:
    table = torch.randint(1, 1000, (len(query_lens), 6), generator=gen, dtype=torch.int32)
    buffers = _DecodeBuffers()
    buffers.poison()
    addresses = (buffers.row_lens.data_ptr(), buffers.row_table.data_ptr())
    rows = buffers.run(
        _qsl(query_lens),
        torch.tensor(seq_lens, dtype=torch.int32),
        table,
        num_decodes,
        num_rows,
        ratio,
        c,
    )
    lens, rows_ref, ends = _brute_force_rows(
        query_lens[:num_decodes], seq_lens[:num_decodes], table, num_rows, ratio, c
    )
    assert rows.row_lens.tolist() == lens
    assert rows.block_table.shape == (num_rows, 6) and rows.block_table.is_contiguous()
    assert rows.block_table.tolist() == rows_ref
    assert (rows.block_ends.tolist() if c else rows.block_ends) == (ends if c else None)
    assert (rows.row_lens.data_ptr(), rows.block_table.data_ptr()) == addresses
    # Nothing past the rows was written.
    assert (buffers.row_lens[num_rows:] == POISON).all()
    assert (buffers.row_table.view(-1)[num_rows * 6 :] == POISON).all()


def test_decode_row_index() -> None:
    qsl = np.array([0, 2, 3, 3, 5, 12], dtype=np.int32)
    out = np.full(12, POISON, dtype=np.int32)
    request, offset = decode_row_index(qsl, 4, out)
    assert request.tolist() == [0, 0, 1, 3, 3]
    assert offset.tolist() == [-1, 0, 0, -1, 0]
    assert (out[10:] == POISON).all()


def test_build_decode_rows_errors() -> None:
    buffers = _DecodeBuffers(max_rows=4, max_cols=2)
    qsl = _qsl([2, 2])
    seq = torch.tensor([5, 6], dtype=torch.int32)
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_rows = 3 is below the 4 real decode rows"):
        buffers.run(qsl, seq, table, 2, 3, 1, 0)
    with pytest.raises(ValueError, match="decode buffers too small for 5 rows"):
        buffers.run(qsl, seq, table, 2, 5, 1, 0)
    with pytest.raises(ValueError, match="num_decodes = 3 exceeds the batch's 2 requests"):
        buffers.run(qsl, seq, table, 3, 4, 1, 0)
    with pytest.raises(ValueError, match="decode buffers too small for 4 rows of 3"):
        buffers.run(qsl, seq, torch.zeros(2, 3, dtype=torch.int32), 2, 4, 1, 0)
    with pytest.raises(ValueError, match="block_ends_out is required"):
        build_decode_rows(
            qsl,
            seq,
            table,
            2,
            4,
            1,
            8,
            row_lens_out=buffers.row_lens,
            row_block_table_out=buffers.row_table,
            block_ends_out=None,
            index_staging=buffers.staging,
            index_scratch=buffers.scratch,
        )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 4), max_size=12),
    st.integers(0, 6),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([0, 4, 8]),
    st.integers(0, 2**31 - 1),
)
def test_build_decode_rows_matches_brute_force(
    query_lens: list[int], padding: int, ratio: int, c: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + int(torch.randint(0, 3000, (1,), generator=g)) for q in query_lens]
    table = torch.randint(0, 10**5, (len(query_lens), 8), generator=g, dtype=torch.int32)
    num_rows = sum(query_lens) + padding
    buffers = _DecodeBuffers()
    buffers.poison()
    rows = buffers.run(
        _qsl(query_lens),
        torch.tensor(seq_lens, dtype=torch.int32),
        table,
        len(query_lens),
        num_rows,
        ratio,
        c,
    )
    lens, rows_ref, ends = _brute_force_rows(query_lens, seq_lens, table, num_rows, ratio, c)
    assert rows.row_lens.tolist() == lens
    assert rows.block_table.tolist() == rows_ref
    if c:
        assert rows.block_ends is not None and rows.block_ends.tolist() == ends


# padding conventions (docs/contract.md section 3.2a) -------------------------------------

# query rows and seq_len of one padding request of each convention, for a given next_n.
PADDING = {
    "zero": lambda next_n: (0, 0),  # vLLM: no rows, seq_len 0, block row 0
    "arange": lambda next_n: (next_n, 0),  # vLLM: query_start_loc = arange(., next_n)
    "fill1": lambda next_n: (1, 1),  # SGLang: seq-len fill value 1 on page 0
}


def _padded_step(
    config: IndexerConfig,
    real_query: list[int],
    forms: list[str],
    seed: int,
    prefills: list[int] = (),  # type: ignore[assignment]
) -> StepBatch:
    """Real decodes (random contexts >= rows), optional real prefills, then one padding
    request per entry of `forms`; zero-context padding rows hold stale random pages."""
    g = torch.Generator().manual_seed(seed)
    real_query = [*real_query, *prefills]
    next_n = config.next_n
    real_seq = [q + int(torch.randint(0, 900, (1,), generator=g)) for q in real_query]
    padding = [PADDING[f](next_n) for f in forms]
    query_lens = real_query + [q for q, _ in padding]
    seq_lens = real_seq + [s for _, s in padding]
    used = [-(-(s // config.compress_ratio) // config.page_entries) for s in real_seq]
    table = torch.randint(0, 64, (len(query_lens), max([1, *used])), generator=g, dtype=torch.int32)
    for r, (_, seq) in enumerate(padding, start=len(real_query)):
        if seq:  # fill1: the reserved page 0
            table[r] = 0
    return StepBatch.from_lists(
        config, query_lens, seq_lens, table, num_pages=64, num_real_reqs=len(real_query)
    )


_PAD_CONFIGS = {
    (ratio, c, spec): IndexerConfig(
        num_heads=8,
        head_dim=64,
        compress_ratio=ratio,
        block_size=32 * ratio,  # one tile of entries per page
        max_model_len=1024,
        num_speculative_tokens=spec,
        candidate_block_size=c,
        candidate_topk_blocks=16 if c else 0,
        topk_tokens=64,
        max_num_seqs=24,
        max_num_batched_tokens=256,
        max_logits_bytes=16 * 1024,
    )
    for ratio in (1, 2, 4)
    for c in (0, 8)
    for spec in (0, 1, 2)
}


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from(sorted(_PAD_CONFIGS)),
    st.lists(st.integers(0, 3), max_size=8),
    st.lists(st.sampled_from(sorted(PADDING)), min_size=1, max_size=8),
    st.integers(0, 2**31 - 1),
)
def test_padding_rows_are_zero_and_no_row_end_is_negative(
    key: tuple[int, int, int], real_query: list[int], forms: list[str], seed: int
) -> None:
    """Every convention, mixed in any order: with `num_real_reqs` the padding requests' rows
    are 0 with a zeroed table row and the real rows are exact; without it (every request
    treated as real) no row end is negative either."""
    config = _PAD_CONFIGS[key]
    ratio, c, next_n = config.compress_ratio, config.candidate_block_size, config.next_n
    real_query = [min(q, next_n) for q in real_query]
    batch = _padded_step(config, real_query, forms, seed)
    num_reqs, num_real = batch.num_reqs, batch.num_real_reqs
    qsl = batch.query_start_loc_cpu
    num_rows = int(qsl[-1]) + seed % 4
    buffers = _DecodeBuffers(max_rows=64, max_cols=batch.block_table.shape[1])
    for declared in (num_real, None):
        buffers.poison()
        rows = buffers.run(
            qsl,
            batch.seq_lens,
            batch.block_table,
            num_reqs,
            num_rows,
            ratio,
            c,
            num_real_reqs=declared,
        )
        assert bool((rows.row_lens >= 0).all())
        if c:
            assert rows.block_ends is not None and bool((rows.block_ends >= 0).all())
        if declared is None:
            continue
        lens, rows_ref, ends = _brute_force_rows(
            real_query, batch.seq_lens[:num_real].tolist(), batch.block_table, num_rows, ratio, c
        )
        assert rows.row_lens.tolist() == lens
        assert rows.block_table.tolist() == rows_ref
        if c:
            assert rows.block_ends.tolist() == ends


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(sorted(_PAD_CONFIGS)),
    st.lists(st.integers(0, 3), max_size=6),
    st.lists(st.sampled_from(sorted(PADDING)), min_size=1, max_size=6),
    st.lists(st.integers(4, 40), max_size=2),
    st.integers(0, 2**31 - 1),
)
def test_no_negative_row_end_leaves_planning(
    key: tuple[int, int, int],
    real_query: list[int],
    forms: list[str],
    prefills: list[int],
    seed: int,
) -> None:
    """The builders over padded steps (decode-only, or with prefills and zero-row padding):
    decode row ends, block ends and prefill row ends are never negative."""
    config = _PAD_CONFIGS[key]
    next_n = config.next_n
    real_query = [min(q, next_n) for q in real_query]
    prefills = [p for p in prefills if p > next_n]
    if prefills:
        forms = ["zero"] * len(forms)  # rows of padding may not follow a prefill
    batch = _padded_step(config, real_query, forms, seed, prefills)
    builder_cls = (
        CandidateIndexerMetadataBuilder if config.has_candidates else (IndexerMetadataBuilder)
    )
    for full_graph in (False, True):
        builder = builder_cls(config, "cpu", num_pages=64, full_graph_decode=full_graph)
        meta = builder.build(batch)
        decode = meta.decode
        ends = [decode.row_lens, decode.block_ends] if decode is not None else []
        for plan in meta.plans:
            ends += [plan.row_ends, plan.block_ends]
        for t in [*ends, meta.context_lens]:
            assert t is None or bool((t >= 0).all())
