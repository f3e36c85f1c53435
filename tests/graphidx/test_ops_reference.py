"""The torch reference of every op against float64 math on random data (docs/contract.md
sections 5.1-5.6).

Outputs are poisoned (NaN, or a sentinel int) before each call so unwritten elements fail.
The paged cache has shuffled pages with a stride wider than a page, and every byte no op
should read (unused pages, slots past a seq's context, padding between pages) holds 0xFF:
a 0xFF scale decodes to NaN, so a stray read shows up as NaN in a compared column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from graphidx.config import cdiv
from graphidx.mxfp4 import cache_layout, dequantize_mxfp4, pack_page, quantize_mxfp4
from graphidx.ops import (
    apply_candidate_mask,
    check_block_table,
    gather_mqa_logits,
    paged_mqa_logits,
    remap_compact_topk,
    resolve_candidate_pool,
    topk_per_row,
)

NAN = float("nan")
NEG_INF = float("-inf")
SENTINEL = -777
BACKEND = "reference"


# ---------------------------------------------------------------------------------------
# Random paged caches and queries, and their float64 models.
# ---------------------------------------------------------------------------------------


@dataclass
class PagedKeys:
    """A paged MXFP4 cache holding `contexts[s]` keys per seq, and their float64 values."""

    kv_cache: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    keys64: list[torch.Tensor]  # per seq: float64 [context, D]
    page_entries: int


def make_paged_keys(
    gen: torch.Generator,
    contexts: list[int],
    *,
    num_heads: int,
    head_dim: int,
    page_entries: int,
    spare_pages: int = 3,
    spare_columns: int = 2,
) -> PagedKeys:
    layout = cache_layout(num_heads, head_dim, page_entries)
    pages_per_seq = [cdiv(c, page_entries) for c in contexts]
    num_pages = sum(pages_per_seq) + spare_pages
    # Rows 24 bytes apart beyond the page, 8 of them visible as page_stride padding.
    storage = torch.full((num_pages, layout.page_bytes + 24), 0xFF, dtype=torch.uint8)
    kv_cache = storage[:, : layout.page_bytes + 8]
    order = torch.randperm(num_pages, generator=gen)
    max_blocks = max(pages_per_seq, default=0) + spare_columns
    # Unused block-table columns point far outside the cache: they must never be read.
    block_table = torch.full((len(contexts), max_blocks), 10**6, dtype=torch.int32)
    keys64: list[torch.Tensor] = []
    next_page = 0
    for s, context in enumerate(contexts):
        scale = 10.0 ** torch.randint(-1, 2, (context, 1), generator=gen).float()
        keys = torch.randn(context, head_dim, generator=gen) * scale
        values, scales = quantize_mxfp4(keys)
        keys64.append(dequantize_mxfp4(values, scales).double())
        for column in range(pages_per_seq[s]):
            page = int(order[next_page])
            next_page += 1
            block_table[s, column] = page
            lo, hi = column * page_entries, min((column + 1) * page_entries, context)
            page_values = torch.full((page_entries, head_dim // 2), 0xFF, dtype=torch.uint8)
            page_scales = torch.full((page_entries, head_dim // 32), 0xFF, dtype=torch.uint8)
            page_values[: hi - lo] = values[lo:hi]
            page_scales[: hi - lo] = scales[lo:hi]
            kv_cache[page, : layout.page_bytes] = pack_page(page_values, page_scales, layout)
    return PagedKeys(
        kv_cache=kv_cache,
        block_table=block_table,
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        keys64=keys64,
        page_entries=page_entries,
    )


@dataclass
class Queries:
    q: torch.Tensor
    q_scale: torch.Tensor
    weights: torch.Tensor
    q64: torch.Tensor  # [rows, H, D]
    w64: torch.Tensor  # [rows, H]


def make_queries(gen: torch.Generator, rows: int, num_heads: int, head_dim: int) -> Queries:
    values = torch.randn(rows, num_heads, head_dim, generator=gen) * 3.0
    q, q_scale = quantize_mxfp4(values)
    weights = torch.randn(rows, num_heads, generator=gen)
    return Queries(q, q_scale, weights, dequantize_mxfp4(q, q_scale).double(), weights.double())


def score64(queries: Queries, row: int, keys64: torch.Tensor) -> torch.Tensor:
    """float64 `sum_h w[row, h] * relu(q[row, h] . k[t])` for every key t."""
    per_head = torch.relu(queries.q64[row] @ keys64.T)  # [H, T]
    return queries.w64[row] @ per_head


def query_bounds(sizes: list[int] | None) -> list[int]:
    """The `query_start_loc` of seqs of `sizes` rows each."""
    assert sizes is not None
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return bounds


def row_ranges(rows: int, group: str, sizes: list[int] | None, next_n: int) -> list[range]:
    if group == "qsl":
        bounds = query_bounds(sizes)
        return [range(bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)]
    if group == "next_n":
        return [range(s * next_n, (s + 1) * next_n) for s in range(rows // next_n)]
    return [range(r, r + 1) for r in range(rows)]


def grouping_kwargs(group: str, sizes: list[int] | None, next_n: int) -> dict[str, object]:
    if group == "qsl":
        return {"query_start_loc": torch.tensor(query_bounds(sizes), dtype=torch.int32)}
    if group == "next_n":
        return {"next_n": next_n}
    return {}


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 accumulation vs float64: relative to the row's magnitude."""
    scale = want.abs().max().clamp(min=1.0) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5 * float(scale))


def _operands(cache: PagedKeys, queries: Queries) -> tuple[torch.Tensor, ...]:
    """The leading arguments of both logits ops: queries, scales, cache, weights, lens, table."""
    return (
        queries.q,
        queries.q_scale,
        cache.kv_cache,
        queries.weights,
        cache.context_lens,
        cache.block_table,
    )


def dense_logits(
    cache: PagedKeys, queries: Queries, row_ends: torch.Tensor, out: torch.Tensor, **kwargs: Any
) -> None:
    """`paged_mqa_logits` of the reference backend: `queries` against `cache`."""
    paged_mqa_logits(
        *_operands(cache, queries),
        row_ends,
        out,
        page_entries=cache.page_entries,
        backend=BACKEND,
        **kwargs,
    )


def gather_logits(
    cache: PagedKeys,
    queries: Queries,
    positions: torch.Tensor,
    live_cols: torch.Tensor,
    compact: torch.Tensor,
    **kwargs: Any,
) -> None:
    """`gather_mqa_logits` of the reference backend: `queries` against `cache`."""
    gather_mqa_logits(
        *_operands(cache, queries),
        positions,
        live_cols,
        compact,
        page_entries=cache.page_entries,
        backend=BACKEND,
        **kwargs,
    )


# ---------------------------------------------------------------------------------------
# Dense logits.
# ---------------------------------------------------------------------------------------


GROUPINGS = [
    ("qsl", [3, 0, 5, 2, 1], 1),
    ("next_n", None, 1),
    ("next_n", None, 2),
    ("next_n", None, 3),
    ("next_n", None, 4),
    ("flat", None, 1),
]


def _setup_grouping(
    gen: torch.Generator, group: str, sizes: list[int] | None, next_n: int, num_seqs: int = 5
) -> tuple[int, list[range], list[int]]:
    if group == "qsl":
        assert sizes is not None
        num_seqs = len(sizes)
        rows = sum(sizes)
    elif group == "next_n":
        rows = num_seqs * next_n
    else:
        rows = num_seqs
    ranges = row_ranges(rows, group, sizes, next_n)
    contexts = [int(c) for c in torch.randint(1, 150, (len(ranges),), generator=gen)]
    contexts[0] = 130  # wider than the output below: the width clamp matters
    return rows, ranges, contexts


def _grouped_step(
    gen: torch.Generator,
    group: str,
    sizes: list[int] | None,
    next_n: int,
    num_heads: int,
    ends: tuple[int, int],
    *,
    head_dim: int = 64,
    page_entries: int = 32,
) -> tuple[int, list[range], list[int], PagedKeys, Queries, torch.Tensor]:
    """(rows, ranges, contexts, cache, queries, row_ends) of one grouping: each row's end
    drawn from [low, context + extra) with (low, extra) = `ends`."""
    rows, ranges, contexts = _setup_grouping(gen, group, sizes, next_n)
    cache = make_paged_keys(
        gen, contexts, num_heads=num_heads, head_dim=head_dim, page_entries=page_entries
    )
    queries = make_queries(gen, rows, num_heads, head_dim)
    row_ends = torch.empty(rows, dtype=torch.int32)
    low, extra = ends
    for s, rng in enumerate(ranges):
        for r in rng:
            row_ends[r] = int(torch.randint(low, contexts[s] + extra, (1,), generator=gen))
    return rows, ranges, contexts, cache, queries, row_ends


@pytest.mark.parametrize(("group", "sizes", "next_n"), GROUPINGS)
@pytest.mark.parametrize("clean", [False, True])
def test_dense_logits_each_grouping(
    gen: torch.Generator, group: str, sizes: list[int] | None, next_n: int, clean: bool
) -> None:
    num_heads, head_dim, page_entries, width = 4, 64, 32, 120
    # Row ends: some past the context (context clamp), some negative, some past the width.
    rows, ranges, contexts, cache, queries, row_ends = _grouped_step(
        gen, group, sizes, next_n, num_heads, (-3, 10), head_dim=head_dim, page_entries=page_entries
    )
    if rows:
        row_ends[ranges[0][0]] = 10**6
    out = torch.full((rows, width + 3), NAN)[:, :width]  # row stride != width
    dense_logits(
        cache,
        queries,
        row_ends,
        out,
        clean=clean,
        **grouping_kwargs(group, sizes, next_n),
    )
    for s, rng in enumerate(ranges):
        for r in rng:
            n = max(0, min(int(row_ends[r]), contexts[s], width))
            close(out[r, :n], score64(queries, r, cache.keys64[s][:n]))
            rest = out[r, n:]
            if clean:
                assert torch.all(rest == NEG_INF)
            else:
                assert torch.all(torch.isnan(rest)), f"row {r} wrote past its end {n}"


def expected_block_scores(
    logits64: torch.Tensor, n: int, size: int, num_blocks: int
) -> torch.Tensor:
    blocks = torch.full((num_blocks,), NEG_INF, dtype=torch.float64)
    for b in range(cdiv(n, size)):
        blocks[b] = logits64[b * size : min((b + 1) * size, n)].max()
    if n > 0:
        blocks[(n - 1) // size] = float("inf")
    return blocks


@pytest.mark.parametrize("clean", [False, True])
@pytest.mark.parametrize(("group", "sizes", "next_n"), [GROUPINGS[0], GROUPINGS[3], GROUPINGS[5]])
def test_dense_block_scores(
    gen: torch.Generator, group: str, sizes: list[int] | None, next_n: int, clean: bool
) -> None:
    num_heads, head_dim, page_entries, width, size = 2, 64, 32, 100, 8
    rows, ranges, contexts, cache, queries, row_ends = _grouped_step(
        gen, group, sizes, next_n, num_heads, (-1, 4), head_dim=head_dim, page_entries=page_entries
    )
    row_ends[0] = 0  # a row with no key: no block written, no pin
    num_blocks = cdiv(width, size) + 2  # wider than needed: spare columns like empty blocks
    out = torch.full((rows, width), NAN)
    block_scores = torch.full((rows, num_blocks), NAN)
    dense_logits(
        cache,
        queries,
        row_ends,
        out,
        block_scores=block_scores,
        candidate_block_size=size,
        clean=clean,
        **grouping_kwargs(group, sizes, next_n),
    )
    for s, rng in enumerate(ranges):
        for r in rng:
            n = max(0, min(int(row_ends[r]), contexts[s], width))
            want = expected_block_scores(
                score64(queries, r, cache.keys64[s][:n]), n, size, num_blocks
            )
            got = block_scores[r].double()
            # Blocks past the row's end: untouched (the NaN poison) unless clean (-inf).
            written = cdiv(n, size)
            past = got[written:]
            assert bool((past == float("-inf")).all() if clean else past.isnan().all()), (r, past)
            got, want = got[:written], want[:written]
            assert torch.equal(torch.isinf(got), torch.isinf(want)), (r, got, want)
            assert torch.equal(got[torch.isinf(got)], want[torch.isinf(want)])
            finite = torch.isfinite(want)
            close(got[finite], want[finite])
            if n > 0:
                assert got[(n - 1) // size] == float("inf")


def test_dense_out_of_cache_page_raises_before_writing(gen: torch.Generator) -> None:
    cache = make_paged_keys(gen, [40, 70], num_heads=2, head_dim=64, page_entries=32)
    queries = make_queries(gen, 2, 2, 64)
    cache.block_table[1, 2] = cache.kv_cache.shape[0]  # used column 2 of seq 1: 64 <= t < 70
    out = torch.full((2, 80), NAN)
    with pytest.raises(ValueError, match="block_table"):
        dense_logits(
            cache,
            queries,
            torch.tensor([40, 70], dtype=torch.int32),
            out,
            clean=True,
        )
    assert torch.all(torch.isnan(out))
    with pytest.raises(ValueError, match=r"block_table\[1, 2\]"):
        check_block_table(
            cache.block_table,
            cache.kv_cache.shape[0],
            context_lens=cache.context_lens,
            page_entries=32,
        )


def test_check_block_table() -> None:
    table = torch.tensor([[0, 3, 9], [2, -1, 7]], dtype=torch.int32)
    lens = torch.tensor([64, 32], dtype=torch.int32)
    check_block_table(table, 4, context_lens=lens, page_entries=32)  # only used columns count
    with pytest.raises(ValueError, match=r"block_table\[0, 2\] = 9"):
        check_block_table(table, 4)
    with pytest.raises(ValueError, match="needs 3 pages"):
        check_block_table(
            table[:, :2], 4, context_lens=torch.tensor([65, 0]).int(), page_entries=32
        )
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1"):
        check_block_table(table, 4, context_lens=torch.tensor([1, 33]).int(), page_entries=32)


# ---------------------------------------------------------------------------------------
# Top-k.
# ---------------------------------------------------------------------------------------


def check_topk_row(picks: torch.Tensor, row: torch.Tensor, length: int, k: int) -> None:
    """picks: the row's k outputs. Same multiset of values as the float64 top-k, -1 after."""
    length = max(0, min(length, row.shape[0]))
    prefix = row[:length].double()
    finite = prefix[prefix != NEG_INF]
    want = torch.sort(finite, descending=True).values[:k]
    count = want.shape[0]
    valid = picks[picks >= 0]
    assert valid.shape[0] == count, (picks, length)
    assert int((picks == -1).sum()) == k - count
    assert torch.unique(valid).shape[0] == count, "duplicate pick"
    assert torch.all(valid < length)
    got = torch.sort(prefix[valid.long()], descending=True).values
    assert torch.equal(got, want), (got, want)


def test_topk_per_row(gen: torch.Generator) -> None:
    rows, width, k = 9, 50, 8
    logits = torch.randn(rows, width + 5, generator=gen)[:, :width]
    # Ties: a row of few distinct values.
    logits[1] = torch.randint(0, 3, (width,), generator=gen).float()
    # Masked entries: exactly -inf inside the length is never picked.
    logits[2, ::2] = NEG_INF
    logits[3, :] = NEG_INF
    logits[3, 7] = 1.0
    lengths = torch.tensor([50, 50, 30, 50, 0, 5, 10**6, -4, 8], dtype=torch.int32)
    out = torch.full((rows, k), SENTINEL, dtype=torch.int32)
    topk_per_row(logits, lengths, k, out, backend=BACKEND)
    for r in range(rows):
        check_topk_row(out[r], logits[r], int(lengths[r]), k)
    assert out[3].tolist().count(-1) == k - 1
    assert torch.all(out[4] == -1) and torch.all(out[7] == -1)


def test_topk_k_wider_than_row(gen: torch.Generator) -> None:
    logits = torch.randn(3, 4, generator=gen)
    out = torch.full((3, 6), SENTINEL, dtype=torch.int32)
    topk_per_row(logits, torch.tensor([4, 2, 3], dtype=torch.int32), 6, out, backend=BACKEND)
    for r, length in enumerate([4, 2, 3]):
        check_topk_row(out[r], logits[r], length, 6)


def test_topk_traces_under_torch_compile(gen: torch.Generator) -> None:
    logits = torch.randn(4, 32, generator=gen)
    lengths = torch.tensor([32, 3, 0, 17], dtype=torch.int32)
    out = torch.full((4, 5), SENTINEL, dtype=torch.int32)

    def step(logits: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        topk_per_row(logits, lengths, 5, out, backend=BACKEND)
        return out

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(logits, lengths, out)
    for r in range(4):
        check_topk_row(out[r], logits[r], int(lengths[r]), 5)


# ---------------------------------------------------------------------------------------
# Candidate pool, mask, gather, remap.
# ---------------------------------------------------------------------------------------


def expected_pool(ids: list[int], end: int, size: int, pool_blocks: int) -> tuple[list[int], int]:
    block_end = cdiv(max(end, 0), size)
    valid = sorted(i for i in ids if 0 <= i < block_end)
    positions = [i * size for i in valid] + [-1] * (pool_blocks - len(valid))
    if not valid:
        return positions, 0
    return positions, (len(valid) - 1) * size + min(size, end - valid[-1] * size)


def random_block_ids(
    gen: torch.Generator, rows: int, pool_blocks: int, max_id: int
) -> torch.Tensor:
    ids = torch.full((rows, pool_blocks), -1, dtype=torch.int32)
    for r in range(rows):
        count = int(torch.randint(0, pool_blocks + 1, (1,), generator=gen))
        picks = torch.randperm(max_id, generator=gen)[:count]  # unique, unsorted
        slots = torch.randperm(pool_blocks, generator=gen)[:count]  # -1 anywhere
        ids[r, slots] = picks.int()
    return ids


def test_resolve_candidate_pool(gen: torch.Generator) -> None:
    size, pool_blocks = 8, 6
    ends = [0, 1, 8, 9, 17, 50, 200, -5, 64, 63]
    rows = len(ends)
    block_ids = random_block_ids(gen, rows, pool_blocks, max_id=12)
    block_ids[0] = torch.tensor([3, -1, 0, 1, -1, 2])  # end 0: nothing valid
    block_ids[4] = torch.tensor([-1, 2, 0, 9, -1, 1])  # end 17: last block (2) partial, 9 drops
    block_ids[9] = torch.tensor([7, 6, 5, 4, 3, 2])  # end 63: last block 7 holds 7 columns
    row_ends = torch.tensor(ends, dtype=torch.int32)
    positions = torch.full((rows, pool_blocks), SENTINEL, dtype=torch.int32)
    live_cols = torch.full((rows,), SENTINEL, dtype=torch.int32)
    resolve_candidate_pool(block_ids, row_ends, size, positions, live_cols, backend=BACKEND)
    for r in range(rows):
        want_positions, want_live = expected_pool(block_ids[r].tolist(), ends[r], size, pool_blocks)
        assert positions[r].tolist() == want_positions, r
        assert int(live_cols[r]) == want_live, r
    assert int(live_cols[0]) == 0 and positions[0].tolist() == [-1] * pool_blocks
    assert positions[4].tolist()[:3] == [0, 8, 16] and int(live_cols[4]) == 17
    assert int(live_cols[9]) == 5 * 8 + 7


def test_apply_candidate_mask(gen: torch.Generator) -> None:
    rows, width, size = 5, 45, 8
    logits = torch.randn(rows, width, generator=gen)
    before = logits.clone()
    positions = torch.tensor(
        [[0, 16, -1], [40, -1, -1], [-1, -1, -1], [8, 24, 32], [3, -1, 44]], dtype=torch.int32
    )
    apply_candidate_mask(logits, positions, size, backend=BACKEND)
    for r in range(rows):
        keep = torch.zeros(width, dtype=torch.bool)
        for p in positions[r].tolist():
            if p >= 0:
                keep[p : p + size] = True
        assert torch.equal(logits[r][keep], before[r][keep])
        assert torch.all(logits[r][~keep] == NEG_INF)


def test_remap_compact_topk(gen: torch.Generator) -> None:
    size = 8
    positions = torch.tensor([[0, 24, 80, -1], [16, -1, -1, -1]], dtype=torch.int32)
    compact = torch.tensor([[0, 7, 8, 23, -1, 17], [3, -1, -1, 7, 0, -1]], dtype=torch.int32)
    want = [[0, 7, 24, 87, -1, 81], [19, -1, -1, 23, 16, -1]]
    out = torch.full_like(compact, SENTINEL)
    remap_compact_topk(compact, positions, size, out, backend=BACKEND)
    assert out.tolist() == want
    remap_compact_topk(compact, positions, size, compact, backend=BACKEND)  # in place
    assert compact.tolist() == want


@pytest.mark.parametrize(("group", "sizes", "next_n"), [GROUPINGS[0], GROUPINGS[2], GROUPINGS[5]])
@pytest.mark.parametrize("clean", [False, True])
def test_gather_logits_match_dense_and_float64(
    gen: torch.Generator, group: str, sizes: list[int] | None, next_n: int, clean: bool
) -> None:
    num_heads, head_dim, page_entries, size, pool_blocks = 4, 64, 32, 8, 5
    rows, ranges, _, cache, queries, row_ends = _grouped_step(
        gen, group, sizes, next_n, num_heads, (0, 1), head_dim=head_dim, page_entries=page_entries
    )
    block_ids = random_block_ids(gen, rows, pool_blocks, max_id=cdiv(150, size))
    positions = torch.full((rows, pool_blocks), SENTINEL, dtype=torch.int32)
    live_cols = torch.full((rows,), SENTINEL, dtype=torch.int32)
    resolve_candidate_pool(block_ids, row_ends, size, positions, live_cols, backend=BACKEND)
    compact_width = pool_blocks * size + 3
    compact = torch.full((rows, compact_width), NAN)
    grouping = grouping_kwargs(group, sizes, next_n)
    gather_logits(
        cache,
        queries,
        positions,
        live_cols,
        compact,
        candidate_block_size=size,
        clean=clean,
        **grouping,
    )
    dense = torch.full((rows, 160), NAN)
    dense_logits(
        cache,
        queries,
        row_ends,
        dense,
        **grouping,
    )
    for s, rng in enumerate(ranges):
        for r in rng:
            live = int(live_cols[r])
            cols = torch.arange(live)
            keys = positions[r].long()[cols // size] + cols % size
            assert torch.all(keys < int(row_ends[r]))
            close(compact[r, :live], score64(queries, r, cache.keys64[s][keys]))
            torch.testing.assert_close(compact[r, :live], dense[r, keys], rtol=1e-6, atol=1e-5)
            rest = compact[r, live:]
            assert torch.all(rest == NEG_INF) if clean else torch.all(torch.isnan(rest))


def test_gather_defensive_columns_are_neg_inf(gen: torch.Generator) -> None:
    """Positions outside the context or on -1 padding score -inf and read nothing."""
    cache = make_paged_keys(gen, [20], num_heads=2, head_dim=64, page_entries=32)
    queries = make_queries(gen, 1, 2, 64)
    positions = torch.tensor([[8, 16, -1, 40]], dtype=torch.int32)
    compact = torch.full((1, 32), NAN)
    gather_logits(
        cache,
        queries,
        positions,
        torch.tensor([32], dtype=torch.int32),
        compact,
        candidate_block_size=8,
    )
    close(compact[0, :12], score64(queries, 0, cache.keys64[0][8:20]))
    assert torch.all(compact[0, 12:] == NEG_INF)


def test_dense_logits_with_block_scores_trace_under_torch_compile(gen: torch.Generator) -> None:
    """The mutation annotations (out and the optional block_scores) let a fullgraph trace
    functionalize the op and still write the caller's buffers."""
    cache = make_paged_keys(gen, [50, 20], num_heads=2, head_dim=64, page_entries=32)
    queries = make_queries(gen, 4, 2, 64)
    row_ends = torch.tensor([49, 50, 19, 20], dtype=torch.int32)
    out = torch.full((4, 64), NAN)
    block_scores = torch.full((4, 8), NAN)

    def step(out: torch.Tensor, block_scores: torch.Tensor) -> None:
        dense_logits(
            cache,
            queries,
            row_ends,
            out,
            next_n=2,
            block_scores=block_scores,
            candidate_block_size=8,
        )

    torch.compile(step, backend="aot_eager", fullgraph=True)(out, block_scores)
    for r in range(4):
        n = int(row_ends[r])
        scores = score64(queries, r, cache.keys64[r // 2][:n])
        close(out[r, :n], scores)
        assert torch.all(torch.isnan(out[r, n:]))
        want = expected_block_scores(scores, n, 8, 8)
        written = cdiv(n, 8)
        got = block_scores[r, :written]
        assert torch.equal(torch.isinf(got), torch.isinf(want[:written]))
        assert bool(block_scores[r, written:].isnan().all())  # past the end: untouched
