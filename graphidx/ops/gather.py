"""Compact logits over a row's candidate pool, and the remap of their top-k (docs/contract.md
sections 5.4 and 5.5).

A consumer row scores only its pool: compact column j is key position
`positions[r, j // C] + j % C`. After top-k over the compact row, `remap_compact_topk` turns
compact columns back into positions. Public wrappers validate, resolve the backend and call
the custom ops (reference below, `graphidx.ops.kernels.gather`, or `graphidx.ops.aiter`).
"""

from __future__ import annotations

import torch

from graphidx.mxfp4 import cache_layout, dequantize_mxfp4
from graphidx.ops.backend import resolve_backend
from graphidx.ops.logits import (
    REFERENCE_BATCH_ELEMENTS,
    check_pages,
    read_keys,
    resolve_logits_backend,
    row_seq_index,
    seq_row_ranges,
    weighted_relu_scores,
)
from graphidx.ops.registry import define_op
from graphidx.ops.validate import (
    check_bool,
    check_int,
    check_int32,
    check_paged_query,
    check_rows,
    check_tensor,
)

NEG_INF = float("-inf")


def gather_mqa_logits_reference(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    live_cols: torch.Tensor,
    out: torch.Tensor,
    *,
    candidate_block_size: int,
    query_start_loc: torch.Tensor | None = None,
    next_n: int | None = None,
    clean: bool = False,
    page_entries: int,
    precision: str = "exact",
) -> None:
    """Torch oracle of `gather_mqa_logits` (arguments already validated), for both
    precisions (the fp8 mode's oracle is the exact computation, as for the dense op).

    Like the dense reference it checks, before writing, that every page it reads lies in the
    cache and every block-table column it needs exists (ValueError otherwise).
    """
    rows, num_heads, value_bytes = q.shape
    head_dim = 2 * value_bytes
    size = candidate_block_size
    pool_blocks = positions.shape[1]
    compact_width = out.shape[1]
    layout = cache_layout(num_heads, head_dim, page_entries)
    ranges = seq_row_ranges(rows, context_lens.shape[0], query_start_loc, next_n)
    if rows == 0:
        return
    device = q.device

    live = live_cols.to(torch.int64).clamp(0, compact_width)
    widest = int(live.max())
    if widest == 0:
        if clean:
            out.fill_(NEG_INF)
        return

    # Per row and compact column: the key position it scores, and whether it is a real key.
    seqs = row_seq_index(ranges, rows, device)
    contexts = context_lens.to(torch.int64)[seqs]
    column = torch.arange(widest, device=device)
    block = column // size
    firsts = positions.to(torch.int64).gather(
        1, block.clamp(max=max(pool_blocks - 1, 0)).unsqueeze(0).expand(rows, -1)
    )
    key_pos = firsts + column % size
    written = column.unsqueeze(0) < live.unsqueeze(1)
    # Defensive (never true for a pool from resolve_candidate_pool): a column past the pool,
    # on a -1 padding slot, or outside the context scores -inf and reads nothing.
    scored = (
        written
        & (block < pool_blocks).unsqueeze(0)
        & (firsts >= 0)
        & (key_pos >= 0)
        & (key_pos < contexts.unsqueeze(1))
    )
    page_column = torch.where(scored, key_pos // page_entries, 0)
    max_blocks = block_table.shape[1]
    missing = scored & (page_column >= max_blocks)
    if bool(missing.any()):
        row = int(torch.nonzero(missing)[0, 0])
        raise ValueError(
            f"block_table has {max_blocks} columns but row {row} (seq {int(seqs[row])}, "
            f"context {int(contexts[row])}) reads page column {int(page_column[row].max())}"
        )
    if max_blocks == 0:  # nothing is scored, so no page is read
        pages = torch.zeros_like(page_column)
    else:
        pages = block_table.to(torch.int64)[seqs.unsqueeze(1), page_column]
    check_pages(pages, scored, kv_cache.shape[0], "row, compact column")
    pages = torch.where(scored, pages, 0)
    slots = torch.where(scored, key_pos % page_entries, 0)

    if clean:
        out.fill_(NEG_INF)
    q_rows = dequantize_mxfp4(q, q_scale)
    step = max(1, REFERENCE_BATCH_ELEMENTS // (widest * (head_dim + num_heads)))
    for first in range(0, rows, step):
        last = min(first + step, rows)
        keys = read_keys(kv_cache, layout, pages[first:last], slots[first:last])
        logits = weighted_relu_scores(
            q_rows[first:last].unsqueeze(1), weights[first:last].unsqueeze(1), keys
        ).squeeze(1)
        logits = torch.where(scored[first:last], logits, NEG_INF)
        region = out[first:last, :widest]
        region.copy_(torch.where(written[first:last], logits, region))


def remap_compact_topk_reference(
    compact_topk: torch.Tensor,
    positions: torch.Tensor,
    candidate_block_size: int,
    out: torch.Tensor,
) -> None:
    """Torch oracle of `remap_compact_topk` (out may be compact_topk itself)."""
    if compact_topk.numel() == 0:
        return
    size = candidate_block_size
    compact = compact_topk.to(torch.int64)
    pool_cols = positions.shape[1] * size
    # A compact column past the pool has no position: it stays -1 like padding.
    valid = (compact >= 0) & (compact < pool_cols)
    safe = torch.where(valid, compact, 0)
    if positions.shape[1] == 0:
        out.fill_(-1)
        return
    firsts = positions.to(torch.int64).gather(1, safe // size)
    out.copy_(torch.where(valid, firsts + safe % size, -1).to(torch.int32))


_gather_mqa_logits = define_op(
    "gather_mqa_logits", gather_mqa_logits_reference, "gather", mutates_args=("out",)
)
_remap_compact_topk = define_op(
    "remap_compact_topk", remap_compact_topk_reference, "gather", mutates_args=("out",)
)


def gather_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    live_cols: torch.Tensor,
    out: torch.Tensor,
    *,
    candidate_block_size: int,
    query_start_loc: torch.Tensor | None = None,
    next_n: int | None = None,
    clean: bool = False,
    page_entries: int | None = None,
    precision: str | None = None,
    backend: str | None = None,
) -> None:
    """Compact logits of each row over its candidate pool (docs/contract.md section 5.4).

    q, q_scale, kv_cache, weights, context_lens, block_table and the row grouping as in
    `paged_mqa_logits`; positions int32 `[rows, KB]` and live_cols int32 `[rows]` from
    `resolve_candidate_pool`; out float32 `[rows, Wc]` with Wc >= KB * C. For
    j < min(live_cols[r], Wc), out[r, j] scores position p = positions[r, j // C] + j % C of
    the row's seq with the dense formula; a column whose p is outside [0, context_len), or
    whose pool slot is -1 padding, is -inf and reads nothing. Columns >= live are untouched,
    or -inf when `clean`. `precision` as in `paged_mqa_logits`.
    """
    rows, layout, device = check_paged_query(
        q, q_scale, kv_cache, weights, context_lens, block_table, query_start_loc, next_n,
        page_entries,
    )  # fmt: skip
    check_int("candidate_block_size", candidate_block_size, minimum=1)
    check_int32("positions", positions, (rows, None), device)
    check_rows("live_cols", live_cols, rows, device)
    check_tensor("out", out, dtype=torch.float32, rank=2, device=device, shape=(rows, None))
    pool_cols = positions.shape[1] * candidate_block_size
    if out.shape[1] < pool_cols:
        raise ValueError(
            f"out has {out.shape[1]} columns, fewer than the pool's "
            f"{positions.shape[1]} blocks x {candidate_block_size} = {pool_cols}"
        )
    check_bool("clean", clean)
    resolved, mode = resolve_logits_backend(backend, precision, device)
    _gather_mqa_logits(
        q,
        q_scale,
        kv_cache,
        weights,
        context_lens,
        block_table,
        positions,
        live_cols,
        out,
        candidate_block_size,
        query_start_loc,
        next_n,
        clean,
        layout.page_entries,
        mode,
        resolved,
    )


def remap_compact_topk(
    compact_topk: torch.Tensor,
    positions: torch.Tensor,
    candidate_block_size: int,
    out: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Compact columns back to key positions (docs/contract.md section 5.5).

    compact_topk int32 `[rows, k]` (compact column j or -1); positions int32 `[rows, KB]`;
    out int32 `[rows, k]`, may be compact_topk itself. out = positions[r, j // C] + j % C;
    -1 (and any j outside [0, KB * C)) gives -1.
    """
    check_int32("compact_topk", compact_topk, (None, None))
    rows, k = compact_topk.shape
    device = compact_topk.device
    check_int32("positions", positions, (rows, None), device)
    check_int("candidate_block_size", candidate_block_size, minimum=1)
    check_int32("out", out, (rows, k), device)
    resolved = resolve_backend(backend, device)
    _remap_compact_topk(compact_topk, positions, candidate_block_size, out, resolved)
