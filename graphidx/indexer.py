"""The indexer layers' entry points (docs/contract.md section 6): `dense_indexer` and
`candidate_consumer`.

Both take one step's `IndexerMetadata` (from the builder), the layer's MXFP4 Q
(`q` uint8 `[>= num_tokens, H, D/2]`, `q_scale` uint8 `[>= num_tokens, H, D/32]`), its head
weights (float32 `[>= num_tokens, H]`), its paged K cache (uint8 `[num_pages, page_stride]`,
pages of `config.page_entries`), the caller's `topk_indices` (int32 `[>= num_tokens,
topk_tokens]`) and an `IndexerWorkspace` for the same config. They fill rows
`[0, metadata.num_tokens)` of `topk_indices`: -1 first, then each real row's top
`topk_tokens` key positions in `[0, row_end)`, any order, -1 padded.

The layers only slice the workspace and the metadata (views) and call graphidx.ops, so the
decode path allocates no buffer itself (a kernel launcher may take per-call scratch; see
graphidx.workspace) and is the same launch sequence on every step of a shape.

Context parallel (docs/contract.md section 10): under `config.dcp_world_size` W > 1 a dense
layer runs on one rank's share (metadata from the builder of that rank, its rank-local K
cache) and takes `dcp`, a `graphidx.distributed.ContextParallelGroup`; its top-k is the
exchange of the ranks' local top-k (`sharded_topk`), so every rank writes the same global
positions, in the selection order. A candidate source merges its block scores the same way
(the candidate pool: global block ids, identical on every rank); a consumer scores its
rank's part of the pool and merges its top-k the same way.
"""

from __future__ import annotations

import torch

from graphidx.config import IndexerConfig
from graphidx.distributed import (
    ContextParallelGroup,
    exchange_group,
    global_positions,
    local_positions,
    sharded_topk,
    sharded_topk_at,
    unpin_foreign_newest_block,
)
from graphidx.metadata import IndexerMetadata, PrefillChunk, PrefillPlan
from graphidx.ops import (
    apply_candidate_mask,
    gather_mqa_logits,
    paged_mqa_logits,
    remap_compact_topk,
    resolve_candidate_pool,
    topk_per_row,
)
from graphidx.ops.validate import check_mxfp4_query, check_tensor
from graphidx.workspace import IndexerWorkspace


def _check_layer_inputs(
    metadata: IndexerMetadata,
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weights: torch.Tensor,
    topk_indices: torch.Tensor,
    workspace: IndexerWorkspace,
    config: IndexerConfig,
) -> None:
    if not isinstance(config, IndexerConfig):
        raise ValueError(f"config must be an IndexerConfig, got {type(config).__name__}")
    if not isinstance(workspace, IndexerWorkspace):
        raise ValueError(f"workspace must be an IndexerWorkspace, got {type(workspace).__name__}")
    if workspace.config != config:
        raise ValueError("workspace was sized for a different config than the layer's")
    rows, num_heads, head_dim, device = check_mxfp4_query(q, q_scale, weights)
    if (num_heads, head_dim) != (config.num_heads, config.head_dim):
        raise ValueError(
            f"q has {num_heads} heads of {head_dim}, config says {config.num_heads} of "
            f"{config.head_dim}"
        )
    if rows < metadata.num_tokens:
        raise ValueError(f"q has {rows} rows, fewer than metadata.num_tokens {metadata.num_tokens}")
    check_tensor(
        "topk_indices",
        topk_indices,
        dtype=torch.int32,
        rank=2,
        device=device,
        shape=(None, config.topk_tokens),
    )
    if topk_indices.shape[0] < metadata.num_tokens:
        raise ValueError(
            f"topk_indices has {topk_indices.shape[0]} rows, fewer than metadata.num_tokens "
            f"{metadata.num_tokens}"
        )


def _check_context_parallel(
    config: IndexerConfig,
    dcp: ContextParallelGroup | None,
    metadata: IndexerMetadata,
    layer: str,
) -> ContextParallelGroup | None:
    """The group a layer exchanges through: None on one rank (the single-rank path), else
    `dcp`, which must be given and match the config's sharding, with `metadata` from a
    context-parallel builder. ValueError naming `layer` otherwise, before any kernel."""
    group = exchange_group(config, dcp, layer)
    if group is not None and metadata.global_row_ends is None:
        raise ValueError(
            f"{layer}: metadata has no global_row_ends: not built by a context-parallel builder"
        )
    return group


def _row_topk(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    dcp: ContextParallelGroup | None,
    backend: str | None,
) -> None:
    """A dense launch's top-k: `topk_per_row` on one rank, `sharded_topk` across ranks."""
    if dcp is None:
        topk_per_row(logits, lengths, k, out, backend=backend)
    else:
        sharded_topk(dcp, logits, lengths, k, out)


def _fill_unwritten_rows(
    topk_indices: torch.Tensor, num_tokens: int, written: list[tuple[int, int]]
) -> None:
    """-1 in the rows of `[0, num_tokens)` that no launch of the layer writes: `written` are
    the row ranges whose top-k (or remap) launches write every slot of every row. A uniform
    decode step, whose decode rows are all its tokens, launches nothing here."""
    start = 0
    for first, last in sorted([r for r in written if r[1] > r[0]], key=lambda r: r[0]):
        if first > start:
            topk_indices[start:first].fill_(-1)
        start = max(start, last)
    if num_tokens > start:
        topk_indices[start:num_tokens].fill_(-1)


Placement = tuple[slice, dict[str, object]]
"""The query rows of one logits launch and its grouping keyword arguments."""


def _decode_placement(metadata: IndexerMetadata) -> Placement:
    """The decode rows' dense launch: native next_n grouping, device row offsets or flat
    rows, with the decode schedule."""
    decode = metadata.decode
    assert decode is not None
    where = {"row_ends": decode.row_lens, "schedule": decode.schedule}
    return slice(0, decode.num_rows), {**where, **_decode_grouping(metadata)}


def _chunk_placement(chunk: PrefillChunk, plan: PrefillPlan) -> Placement:
    """One planned prefill chunk's dense launch (chunk-local query_start_loc grouping)."""
    return slice(chunk.token_start, chunk.token_end), {
        "context_lens": plan.context_lens,
        "block_table": chunk.block_table,
        "row_ends": plan.row_ends,
        "query_start_loc": plan.query_start_loc,
    }


def _dense_logits(
    placement: Placement,
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    logits: torch.Tensor,
    config: IndexerConfig,
    backend: str | None,
    block_scores: torch.Tensor | None = None,
) -> None:
    """One dense logits launch of a layer into `logits` (and block scores, when given) at
    the config's precision."""
    rows, where = placement
    paged_mqa_logits(
        q[rows],
        q_scale[rows],
        kv_cache,
        weights[rows],
        out=logits,
        block_scores=block_scores,
        candidate_block_size=config.candidate_block_size if block_scores is not None else 0,
        page_entries=config.page_entries,
        precision=config.precision,
        backend=backend,
        **where,  # type: ignore[arg-type]
    )


def _compact_logits(
    placement: Placement,
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    positions: torch.Tensor,
    live: torch.Tensor,
    compact: torch.Tensor,
    config: IndexerConfig,
    backend: str | None,
) -> None:
    """One gather launch of a consumer: its rows' compact logits over their pools
    (`positions`, `live` columns) into `compact`, at the config's precision."""
    rows, where = placement
    gather_mqa_logits(
        q[rows],
        q_scale[rows],
        kv_cache,
        weights[rows],
        positions=positions,
        live_cols=live,
        out=compact,
        candidate_block_size=config.candidate_block_size,
        page_entries=config.page_entries,
        precision=config.precision,
        backend=backend,
        **where,  # type: ignore[arg-type]
    )


def _decode_grouping(metadata: IndexerMetadata) -> dict[str, object]:
    """Keyword arguments of the decode rows' grouping: requests by device row offsets, native
    next_n sequences, or flat rows."""
    decode = metadata.decode
    assert decode is not None
    if decode.request_rows is not None:
        rows = decode.request_rows
        return {
            "context_lens": rows.context_lens,
            "block_table": rows.block_table,
            "query_start_loc": rows.query_start_loc,
        }
    if decode.native is not None:
        return {
            "context_lens": decode.native.context_lens,
            "block_table": decode.native.block_table,
            "next_n": decode.native.next_n,
        }
    # Flattened: every row is its own sequence whose context is the row's own end.
    return {"context_lens": decode.row_lens, "block_table": decode.block_table}


def dense_indexer(
    metadata: IndexerMetadata,
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_indices: torch.Tensor,
    workspace: IndexerWorkspace,
    *,
    config: IndexerConfig,
    candidate_source: bool = False,
    backend: str | None = None,
    dcp: ContextParallelGroup | None = None,
) -> None:
    """A layer that scores its rows' whole visible context (docs/contract.md section 6).

    Decode rows: one dense launch (native next_n grouping when `metadata.decode.native`,
    else flattened rows, with the decode schedule) into the workspace's decode logits, then
    top-k with the row ends as lengths. Prefill: one launch per planned chunk
    (chunk-local query_start_loc grouping, logits `[rows, plan.width]`), then top-k.
    `candidate_source=True` (needs candidate blocks in the config) also writes block scores
    in the same pass and picks the step's candidate blocks: the top `candidate_topk_blocks`
    block scores per row, block ends as lengths, into `workspace.candidate_ids` (row i of
    the step at row i), for the consumers of this step.
    `dcp`: this rank's `ContextParallelGroup`, required when `config.dcp_world_size` > 1
    (then `kv_cache` is the rank's cache, `metadata` its builder's, and each top-k the
    exchange across the group, identical on every rank; see the module docstring); on one
    rank it is ignored and nothing changes.
    """
    _check_layer_inputs(metadata, q, q_scale, weights, topk_indices, workspace, config)
    if candidate_source and not config.has_candidates:
        raise ValueError("candidate_source=True needs candidate_block_size > 0 in the config")
    group = _check_context_parallel(
        config, dcp, metadata, "candidate_source=True" if candidate_source else "dense_indexer"
    )
    k = config.topk_tokens
    decode = metadata.decode
    decode_rows = decode.num_rows if decode is not None else 0
    chunk_rows = [(c.token_start, c.token_end) for c in metadata.chunks]
    _fill_unwritten_rows(topk_indices, metadata.num_tokens, [(0, decode_rows), *chunk_rows])

    if decode is not None and decode.num_rows:
        rows = decode.num_rows
        logits = workspace.decode_logits_view(rows, decode.width)
        block_scores = None
        if candidate_source:
            block_scores = workspace.block_scores_view(rows, logits.shape[1])
        _dense_logits(_decode_placement(metadata), q, q_scale, weights, kv_cache, logits,
                      config, backend, block_scores)  # fmt: skip
        _row_topk(logits, decode.row_lens, k, topk_indices[:rows], group, backend)
        if block_scores is not None:
            if group is not None:
                _unpin(group, metadata, logits, block_scores, decode.row_lens, 0, config)
            _pick_candidate_blocks(
                block_scores, decode.block_ends, 0, rows, workspace, config, group, backend
            )

    for chunk, plan in zip(metadata.chunks, metadata.plans, strict=True):
        start, end = chunk.token_start, chunk.token_end
        rows = end - start
        logits = workspace.prefill_logits_view(rows, plan.width)
        block_scores = None
        if candidate_source:
            block_scores = workspace.block_scores_view(rows, plan.width)
        _dense_logits(_chunk_placement(chunk, plan), q, q_scale, weights, kv_cache, logits,
                      config, backend, block_scores)  # fmt: skip
        _row_topk(logits, plan.row_ends, k, topk_indices[start:end], group, backend)
        if block_scores is not None:
            if group is not None:
                _unpin(group, metadata, logits, block_scores, plan.row_ends, start, config)
            _pick_candidate_blocks(
                block_scores, plan.block_ends, start, end, workspace, config, group, backend
            )


def _unpin(
    group: ContextParallelGroup,
    metadata: IndexerMetadata,
    logits: torch.Tensor,
    block_scores: torch.Tensor,
    local_ends: torch.Tensor,
    start: int,
    config: IndexerConfig,
) -> None:
    """Under context parallel: only the rank holding a row's newest key keeps its pinned
    block (`unpin_foreign_newest_block`), so the ranks' block scores are the single-rank
    ones."""
    global_ends = metadata.global_row_ends
    assert global_ends is not None  # `_check_context_parallel` refused metadata without them
    rows = logits.shape[0]
    unpin_foreign_newest_block(
        group.ctx, logits, block_scores, local_ends, global_ends[start : start + rows],
        config.candidate_block_size,
    )  # fmt: skip


def _pick_candidate_blocks(
    block_scores: torch.Tensor,
    block_ends: torch.Tensor | None,
    start: int,
    end: int,
    workspace: IndexerWorkspace,
    config: IndexerConfig,
    group: ContextParallelGroup | None,
    backend: str | None,
) -> None:
    """The source's candidate blocks of step rows [start, end): top-KB block scores (under
    context parallel merged across the ranks, as global block ids)."""
    if block_ends is None:
        raise ValueError("metadata has no block_ends: built without candidate blocks")
    ids, _, _ = workspace.pool(start, end)
    kb = config.candidate_topk_blocks
    if group is None:
        topk_per_row(block_scores, block_ends, kb, ids, backend=backend)
    else:
        blocks = group.ctx.blocks(config.candidate_block_size)
        sharded_topk(group, block_scores, block_ends, kb, ids, ctx=blocks)


def candidate_consumer(
    metadata: IndexerMetadata,
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_indices: torch.Tensor,
    workspace: IndexerWorkspace,
    *,
    config: IndexerConfig,
    resolve_pool: bool,
    backend: str | None = None,
    dcp: ContextParallelGroup | None = None,
) -> None:
    """A layer that scores only the candidate source's pool (docs/contract.md section 6).

    `resolve_pool=True` (the step's first consumer) turns `workspace.candidate_ids`, written
    by this step's `dense_indexer(candidate_source=True)`, into sorted pool positions and
    live column counts for every row (decode rows against decode.row_lens, prefill rows
    against their plan's row ends); later consumers pass False and reuse them. Decode rows
    gather when `metadata.decode_use_gather` (compact logits, top-k over the live columns,
    remap to positions), else dense logits masked to the pool and top-k over the row ends.
    Prefill chunks whose plan does not gather go dense + mask; the gathering ones run as
    `metadata.gather_launches` (one request each, its rows as one next_n sequence).
    `dcp`: as for `dense_indexer`. Under context parallel the pool (global block ids, the
    same on every rank) is resolved to this rank's part of it (its blocks, at their local
    positions), the layer scores that part only, and each top-k is the exchange across the
    ranks (`sharded_topk`, `sharded_topk_at`), so every rank writes the same global positions.
    """
    _check_layer_inputs(metadata, q, q_scale, weights, topk_indices, workspace, config)
    group = _check_context_parallel(config, dcp, metadata, "candidate_consumer")
    if not config.sparse_logits:
        raise ValueError("candidate_consumer needs sparse_logits=True in the config")
    size = config.candidate_block_size
    k = config.topk_tokens
    decode = metadata.decode
    written = [(0, decode.num_rows if decode is not None else 0)]
    written += [
        (c.token_start, c.token_end)
        for c, p in zip(metadata.chunks, metadata.plans, strict=True)
        if not p.use_gather
    ]
    written += [(g.token_start, g.token_end) for g in metadata.gather_launches]
    _fill_unwritten_rows(topk_indices, metadata.num_tokens, written)

    if resolve_pool:
        if decode is not None and decode.num_rows:
            _resolve_pool(workspace, 0, decode.num_rows, decode.row_lens, config, group, backend)
        for chunk, plan in zip(metadata.chunks, metadata.plans, strict=True):
            _resolve_pool(
                workspace, chunk.token_start, chunk.token_end, plan.row_ends, config, group,
                backend,
            )  # fmt: skip

    if decode is not None and decode.num_rows:
        rows = decode.num_rows
        _, positions, live = workspace.pool(0, rows)
        if metadata.decode_use_gather:
            compact, compact_topk = workspace.compact_views(rows)
            placement = slice(0, rows), _decode_grouping(metadata)
            _compact_logits(placement, q, q_scale, weights, kv_cache, positions, live, compact,
                            config, backend)  # fmt: skip
            _pool_topk(compact, compact_topk, positions, live, topk_indices[:rows], config,
                       group, backend)  # fmt: skip
        else:
            logits = workspace.decode_logits_view(rows, decode.width)
            _dense_logits(
                _decode_placement(metadata), q, q_scale, weights, kv_cache, logits, config, backend
            )
            apply_candidate_mask(logits, positions, size, backend=backend)
            _row_topk(logits, decode.row_lens, k, topk_indices[:rows], group, backend)

    for chunk, plan in zip(metadata.chunks, metadata.plans, strict=True):
        if plan.use_gather:
            continue  # served by the gather launches below
        start, end = chunk.token_start, chunk.token_end
        _, positions, _ = workspace.pool(start, end)
        logits = workspace.prefill_logits_view(end - start, plan.width)
        _dense_logits(
            _chunk_placement(chunk, plan), q, q_scale, weights, kv_cache, logits, config, backend
        )
        apply_candidate_mask(logits, positions, size, backend=backend)
        _row_topk(logits, plan.row_ends, k, topk_indices[start:end], group, backend)

    for launch in metadata.gather_launches:
        start, end = launch.token_start, launch.token_end
        rows = end - start
        _, positions, live = workspace.pool(start, end)
        compact, compact_topk = workspace.compact_views(rows)
        # One request's rows as one next_n sequence.
        where = {"context_lens": launch.context_len, "block_table": launch.block_table,
                 "next_n": rows}  # fmt: skip
        _compact_logits((slice(start, end), where), q, q_scale, weights, kv_cache, positions,
                        live, compact, config, backend)  # fmt: skip
        _pool_topk(compact, compact_topk, positions, live, topk_indices[start:end], config,
                   group, backend)  # fmt: skip


def _resolve_pool(
    workspace: IndexerWorkspace,
    start: int,
    end: int,
    row_ends: torch.Tensor,
    config: IndexerConfig,
    group: ContextParallelGroup | None,
    backend: str | None,
) -> None:
    """The pool of step rows [start, end): sorted first positions and live columns. Under
    context parallel, of this rank's blocks of the pool, at local positions (the ids of the
    other ranks' blocks become -1, the local row ends bound the rest)."""
    ids, positions, live = workspace.pool(start, end)
    size = config.candidate_block_size
    if group is not None:
        ids = local_positions(group.ctx.blocks(size), ids)
    resolve_candidate_pool(ids, row_ends, size, positions, live, backend=backend)


def _pool_topk(
    compact: torch.Tensor,
    compact_topk: torch.Tensor,
    positions: torch.Tensor,
    live: torch.Tensor,
    out: torch.Tensor,
    config: IndexerConfig,
    group: ContextParallelGroup | None,
    backend: str | None,
) -> None:
    """The top-k of compact logits over the live columns, as key positions in `out`: on one
    rank through `compact_topk` and the remap; under context parallel each compact column's
    global position (`_compact_positions`) goes into the exchange."""
    size, k = config.candidate_block_size, config.topk_tokens
    if group is None:
        topk_per_row(compact, live, k, compact_topk, backend=backend)
        remap_compact_topk(compact_topk, positions, size, out, backend=backend)
    else:
        columns = _compact_positions(group, positions, size, compact.shape[1])
        sharded_topk_at(group, compact, columns, live, k, out)


def _compact_positions(
    group: ContextParallelGroup, positions: torch.Tensor, size: int, width: int
) -> torch.Tensor:
    """int32 `[rows, width]`: the global position of compact column j, that of local
    position `positions[r, j // C] + j % C` (-1 where the pool slot is -1)."""
    cols = torch.arange(width, device=positions.device)
    first = positions[:, cols // size]
    local = torch.where(first >= 0, first + (cols % size).to(first.dtype), -1)
    return global_positions(group.ctx, local)
