"""Dense MQA logits over the paged MXFP4 K cache, with optional block scores (docs/contract.md
section 5.1).

`paged_mqa_logits` is the public wrapper: it validates its arguments from metadata only (no
host sync), resolves the backend and calls the custom op `graphidx::paged_mqa_logits`, which
dispatches to the torch reference below, to `graphidx.ops.kernels.logits` (Triton) or to
`graphidx.ops.aiter`.

The reference is the oracle of the other backends. It reads the cache through
`graphidx.mxfp4.read_entries` (only the entries a sequence needs, straight from its pages),
dequantizes with `dequantize_mxfp4` and accumulates in float32. It reads a few small device
tensors back to the host (context lengths, row ends, offsets) to size its work; that is a
plain data dependency when it runs as one opaque custom op.
"""

from __future__ import annotations

import torch

from graphidx.config import cdiv
from graphidx.mxfp4 import CacheLayout, cache_layout, dequantize_mxfp4, read_entries
from graphidx.ops.backend import resolve_backend, resolve_precision
from graphidx.ops.registry import define_op
from graphidx.ops.validate import (
    check_block_scores,
    check_bool,
    check_int,
    check_paged_query,
    check_rows,
    check_tensor,
)

# Bound on the float32 elements of one batch of keys plus its scores (~16 MiB each), so the
# reference runs at full model sizes without materialising rows x heads x context at once.
REFERENCE_BATCH_ELEMENTS = 1 << 22

NEG_INF = float("-inf")
POS_INF = float("inf")


# ---------------------------------------------------------------------------------------
# Reference helpers shared with the gather op.
# ---------------------------------------------------------------------------------------


def seq_row_ranges(
    rows: int,
    num_seqs: int,
    query_start_loc: torch.Tensor | None,
    next_n: int | None,
) -> list[tuple[int, int]]:
    """Host `(first row, end row)` of every sequence under the row grouping of docs/contract.md
    section 5.

    query_start_loc must start at 0, end at `rows` and never decrease (it is chunk-local);
    the reference checks that here because it has read the values anyway.
    """
    if query_start_loc is not None:
        offsets = [int(v) for v in query_start_loc.tolist()]
        if offsets[0] != 0 or offsets[-1] != rows:
            raise ValueError(
                f"query_start_loc must run from 0 to the {rows} query rows, got "
                f"{offsets[0]} .. {offsets[-1]}"
            )
        for s in range(num_seqs):
            if offsets[s + 1] < offsets[s]:
                raise ValueError(
                    f"query_start_loc decreases at seq {s}: {offsets[s]} -> {offsets[s + 1]}"
                )
        return [(offsets[s], offsets[s + 1]) for s in range(num_seqs)]
    group = 1 if next_n is None else next_n
    return [(s * group, (s + 1) * group) for s in range(num_seqs)]


def row_seq_index(ranges: list[tuple[int, int]], rows: int, device: torch.device) -> torch.Tensor:
    """int64 `[rows]`: the sequence of each row (every row is covered by `ranges`)."""
    lengths = torch.tensor([end - start for start, end in ranges], dtype=torch.int64)
    seqs = torch.repeat_interleave(torch.arange(len(ranges), dtype=torch.int64), lengths)
    assert seqs.shape[0] == rows
    return seqs.to(device)


def check_pages(
    pages: torch.Tensor,
    used: torch.Tensor,
    num_pages: int,
    describe: str,
) -> None:
    """Raise ValueError when a used page id lies outside `[0, num_pages)` (host sync)."""
    bad = used & ((pages < 0) | (pages >= num_pages))
    if bool(bad.any()):
        where = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"block_table points outside the cache of {num_pages} pages: page "
            f"{int(pages[where])} for {describe} at index {where}"
        )


def read_keys(
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    pages: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Dequantized float32 keys `[*pages.shape, D]` at `(pages, slots)` of the cache."""
    values, scales = read_entries(kv_cache, layout, pages.reshape(-1), slots.reshape(-1))
    return dequantize_mxfp4(values, scales).view(*pages.shape, layout.head_dim)


def weighted_relu_scores(
    q_rows: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """`sum_h w[b, g, h] * relu(q[b, g, h] . k[b, t])` in float32.

    q_rows float32 `[B, G, H, D]`, weights float32 `[B, G, H]`, keys float32 `[B, T, D]`
    -> `[B, G, T]`: batch b's G rows all score batch b's T keys.
    """
    batch, group, heads, head_dim = q_rows.shape
    per_head = torch.bmm(q_rows.reshape(batch, group * heads, head_dim), keys.transpose(1, 2))
    per_head = per_head.relu_().view(batch * group, heads, -1)
    summed = torch.bmm(weights.reshape(batch * group, 1, heads), per_head)
    return summed.view(batch, group, -1)


# ---------------------------------------------------------------------------------------
# Reference.
# ---------------------------------------------------------------------------------------


def _write_rows(
    out_rows: torch.Tensor,
    logits: torch.Tensor,
    row_lens: torch.Tensor,
    block_scores_rows: torch.Tensor | None,
    candidate_block_size: int,
) -> None:
    """Store `logits [R, n]` for columns below each row's length, and its block scores.

    out_rows / block_scores_rows are views of the caller's buffers; only blocks inside
    `[0, ceil(n / C))` change (blocks past a row's end stay as the caller left them, or -inf
    when the op was asked to clean).
    """
    width = logits.shape[1]
    visible = torch.arange(width, device=logits.device).unsqueeze(0) < row_lens.unsqueeze(1)
    region = out_rows[:, :width]
    region.copy_(torch.where(visible, logits, region))
    if block_scores_rows is None:
        return
    size = candidate_block_size
    num_blocks = cdiv(width, size)
    masked = torch.where(visible, logits, NEG_INF)
    masked = torch.nn.functional.pad(masked, (0, num_blocks * size - width), value=NEG_INF)
    block_max = masked.view(-1, num_blocks, size).amax(dim=2)
    block_ends = (row_lens + size - 1) // size
    live = torch.arange(num_blocks, device=logits.device).unsqueeze(0) < block_ends.unsqueeze(1)
    region_blocks = block_scores_rows[:, :num_blocks]
    region_blocks.copy_(torch.where(live, block_max, region_blocks))
    # The block holding the row's newest key must always survive the block top-k.
    newest = ((row_lens - 1).clamp(min=0) // size).unsqueeze(1)
    current = block_scores_rows.gather(1, newest)
    pinned = torch.where((row_lens > 0).unsqueeze(1), POS_INF, current)
    block_scores_rows.scatter_(1, newest, pinned)


def _seq_batches(
    ranges: list[tuple[int, int]], seq_lens: list[int], per_key_elements: int
) -> list[tuple[int, int]]:
    """Consecutive seq ranges whose padded keys and scores fit REFERENCE_BATCH_ELEMENTS."""
    batches: list[tuple[int, int]] = []
    start = 0
    widest = 0
    for s in range(len(ranges)):
        grown = max(widest, seq_lens[s])
        if s > start and (s + 1 - start) * grown * per_key_elements > REFERENCE_BATCH_ELEMENTS:
            batches.append((start, s))
            start, grown = s, seq_lens[s]
        widest = grown
    if ranges:
        batches.append((start, len(ranges)))
    return batches


def paged_mqa_logits_reference(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    row_ends: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = None,
    next_n: int | None = None,
    schedule: torch.Tensor | None = None,
    block_scores: torch.Tensor | None = None,
    candidate_block_size: int = 0,
    clean: bool = False,
    page_entries: int,
    precision: str = "exact",
) -> None:
    """Torch oracle of `paged_mqa_logits` (arguments already validated; schedule ignored).

    Both precisions compute the same float32 answer: the fp8 mode's operands hold every
    decoded value exactly (docs/contract.md section 5, "Precision"), so the oracle of the
    fp8 kernels is the exact computation and their tests bound the distance to it.

    Raises ValueError when a page it must read lies outside the cache or a sequence needs
    more block-table columns than exist: it has the values on the host, so it checks them
    before writing anything.
    """
    del schedule, precision  # Neither changes the oracle's answer (see above).
    rows, num_heads, value_bytes = q.shape
    head_dim = 2 * value_bytes
    width = out.shape[1]
    layout = cache_layout(num_heads, head_dim, page_entries)
    num_seqs = context_lens.shape[0]
    ranges = seq_row_ranges(rows, num_seqs, query_start_loc, next_n)

    contexts = [int(v) for v in context_lens.tolist()]
    ends = [int(v) for v in row_ends.tolist()]
    row_lens = [0] * rows
    seq_lens = [0] * num_seqs
    for s, (start, end) in enumerate(ranges):
        for r in range(start, end):
            row_lens[r] = max(0, min(ends[r], contexts[s], width))
        seq_lens[s] = max(row_lens[start:end], default=0)

    # Every page read below, checked before the first write.
    max_blocks = block_table.shape[1]
    seq_pages = [cdiv(n, page_entries) for n in seq_lens]
    for s, need in enumerate(seq_pages):
        if need > max_blocks:
            raise ValueError(
                f"block_table has {max_blocks} columns but seq {s} reads {seq_lens[s]} keys "
                f"({need} pages of {page_entries})"
            )
    if num_seqs:
        used = torch.arange(max_blocks, device=block_table.device).unsqueeze(0) < torch.tensor(
            seq_pages, device=block_table.device
        ).unsqueeze(1)
        check_pages(block_table, used, kv_cache.shape[0], "block_table[seq, column]")

    if clean:
        out.fill_(NEG_INF)
        if block_scores is not None:
            block_scores.fill_(NEG_INF)
    if rows == 0:
        return

    device = q.device
    q_rows = dequantize_mxfp4(q, q_scale)
    row_lens_t = torch.tensor(row_lens, dtype=torch.int64, device=device)

    if query_start_loc is None:
        # Uniform groups (next_n rows, or one row, per seq): batch whole seqs together.
        group = 1 if next_n is None else next_n
        per_key = head_dim + group * num_heads
        batches = _seq_batches(ranges, seq_lens, per_key)
    else:
        batches = [(s, s + 1) for s in range(num_seqs)]

    for seq_start, seq_end in batches:
        widest = max(seq_lens[seq_start:seq_end])
        if widest == 0:
            continue
        positions = torch.arange(widest, device=device)
        own = positions.unsqueeze(0) < torch.tensor(
            seq_lens[seq_start:seq_end], device=device
        ).unsqueeze(1)
        columns = (positions // page_entries).unsqueeze(0).expand(seq_end - seq_start, -1)
        pages = block_table[seq_start:seq_end].to(torch.int64).gather(1, columns)
        # Positions past a seq's own need are padding of the batch: read page 0, mask later.
        pages = torch.where(own, pages, 0)
        slots = (positions % page_entries).unsqueeze(0).expand_as(pages)
        keys = read_keys(kv_cache, layout, pages, slots)

        row_start, row_end = ranges[seq_start][0], ranges[seq_end - 1][1]
        num_rows = row_end - row_start
        if query_start_loc is None:
            group = num_rows // (seq_end - seq_start)
            logits = weighted_relu_scores(
                q_rows[row_start:row_end].view(-1, group, num_heads, head_dim),
                weights[row_start:row_end].view(-1, group, num_heads),
                keys,
            ).view(num_rows, widest)
            slices = [(row_start, row_end, logits)]
        else:
            # One seq of many rows: split its rows so rows x heads x keys stays bounded.
            step = max(1, REFERENCE_BATCH_ELEMENTS // (widest * num_heads))
            slices = []
            for first in range(row_start, row_end, step):
                last = min(first + step, row_end)
                part = weighted_relu_scores(
                    q_rows[first:last].unsqueeze(0),
                    weights[first:last].unsqueeze(0),
                    keys,
                ).view(last - first, widest)
                slices.append((first, last, part))
        for first, last, part in slices:
            _write_rows(
                out[first:last],
                part,
                row_lens_t[first:last],
                None if block_scores is None else block_scores[first:last],
                candidate_block_size,
            )


# ---------------------------------------------------------------------------------------
# Custom op and public wrapper.
# ---------------------------------------------------------------------------------------


def resolve_logits_backend(
    backend: str | None, precision: str | None, device: torch.device
) -> tuple[str, str]:
    """`(backend, precision)` a logits op runs at on `device` (`resolve_backend`, then
    `resolve_precision` for that backend); ValueError for either that cannot run there."""
    resolved = resolve_backend(backend, device)
    return resolved, resolve_precision(precision, resolved, device)


_paged_mqa_logits = define_op(
    "paged_mqa_logits", paged_mqa_logits_reference, "logits", mutates_args=("out", "block_scores")
)


def paged_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    row_ends: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = None,
    next_n: int | None = None,
    schedule: torch.Tensor | None = None,
    block_scores: torch.Tensor | None = None,
    candidate_block_size: int = 0,
    clean: bool = False,
    page_entries: int | None = None,
    precision: str | None = None,
    backend: str | None = None,
) -> None:
    """Dense logits of every query row over its sequence's paged keys (docs/contract.md section
    5.1).

    q uint8 `[rows, H, D/2]` and q_scale uint8 `[rows, H, D/32]` (MXFP4 per head); kv_cache
    uint8 `[num_pages, page_stride]` (preshuffled pages of `page_entries`, default
    page_stride // entry_bytes); weights float32 `[rows, H]`; context_lens int32 `[num_seqs]`;
    block_table int32 `[num_seqs, max_blocks]`; row_ends int32 `[rows]`; out float32
    `[rows, W]`. Rows are grouped into seqs by `query_start_loc` (int32 `[num_seqs + 1]`), by
    `next_n`, or one per seq. Row r of seq s with n = clamp(min(row_ends[r],
    context_lens[s], W), 0) gets `out[r, t] = sum_h w[r, h] * relu(q[r, h] . k[s, t])` for
    t < n; later columns are untouched, or -inf when `clean`. `block_scores` float32
    `[rows, NB >= ceil(W / C)]` (needs C = candidate_block_size > 0): for blocks
    b < ceil(n / C), the max over the block's visible columns, +inf for the block of the
    newest key; later blocks are untouched, or -inf when `clean`.
    `schedule`: the decode work descriptors of graphidx.ops.schedule (never changes the
    answer). `precision`: "exact" or "fp8" (docs/contract.md section 5, "Precision"; None:
    the device's default, `graphidx.ops.backend.default_precision`). Page ids are not
    range-checked here (see validate.check_block_table).
    """
    rows, layout, device = check_paged_query(
        q, q_scale, kv_cache, weights, context_lens, block_table, query_start_loc, next_n,
        page_entries,
    )  # fmt: skip
    check_rows("row_ends", row_ends, rows, device)
    check_tensor("out", out, dtype=torch.float32, rank=2, device=device, shape=(rows, None))
    if schedule is not None:
        check_tensor("schedule", schedule, dtype=torch.int32, rank=None, device=device)
    check_int("candidate_block_size", candidate_block_size, minimum=0)
    if block_scores is not None:
        check_block_scores(block_scores, candidate_block_size, rows, out.shape[1], device)
    check_bool("clean", clean)
    resolved, mode = resolve_logits_backend(backend, precision, device)
    _paged_mqa_logits(
        q,
        q_scale,
        kv_cache,
        weights,
        context_lens,
        block_table,
        row_ends,
        out,
        query_start_loc,
        next_n,
        schedule,
        block_scores,
        candidate_block_size,
        clean,
        layout.page_entries,
        mode,
        resolved,
    )
