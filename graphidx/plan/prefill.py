"""Prefill planning (docs/contract.md section 3.3): the logits-budget split, chunk
construction, launch plans.

Coordinates: `split_prefill_chunks` returns row slices counted from the first query row of
each group (the seed's convention); `build_prefill_chunks` adds `query_start_loc` of the
group's first request, so that every `PrefillChunk` and everything planned from it
(`plan_prefill_chunks`, `plan_gather_launches`) uses absolute step rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from graphidx.metadata import PrefillChunk, PrefillPlan
from graphidx.plan._host import (
    HostInts,
    adjacent_views,
    check_non_negative_int,
    check_positive_int,
    host_array,
    spanning_view,
)

FP32_BYTES = 4


def rows_per_slice(max_logits_bytes: int, width: int) -> int:
    """Rows of fp32 logits `width` wide that fit `max_logits_bytes` (at least one)."""
    return max(1, max_logits_bytes // (FP32_BYTES * max(width, 1)))


def split_prefill_chunks(
    context_lens: HostInts,
    query_lens: HostInts,
    max_logits_bytes: int,
    request_offset: int = 0,
) -> list[tuple[slice, slice]]:
    """Split prefill requests into launches whose fp32 logits fit `max_logits_bytes`.

    `context_lens`, `query_lens`: host ints `[num_reqs]` (compressed contexts, from the upper
    bounds, and query rows). With `max_rows(w) = rows_per_slice(max_logits_bytes, w)`, walk
    the requests in order; a group starts empty (`rows = width = 0`) and takes request i
    unless `rows > 0 and rows + query_lens[i] > max_rows(max(width, context_lens[i]))` (the
    widest context, not the sum, counts: K is read in place). So a group always takes its
    first request, and a request of zero rows joins the group it meets unless its context
    narrows `max_rows` below the group's rows. A group's rows are cut into
    `[lo, min(lo + step, rows))` for `lo in range(0, rows, step)`, `step = max_rows(width)`;
    a group without rows yields nothing.

    Returns `(request slice, row slice)` pairs in order: the request slice covers the whole
    group, offset by `request_offset`; the row slice counts from the group's first query row
    (0 for every group). This is the seed's chunker exactly (docs/contract.md section 3.3); a
    caller wanting step rows adds `query_start_loc` of the request slice's start.
    """
    check_positive_int("max_logits_bytes", max_logits_bytes)
    check_non_negative_int("request_offset", request_offset)
    contexts = host_array(context_lens, "context_lens").tolist()
    rows_of = host_array(query_lens, "query_lens").tolist()
    if len(contexts) != len(rows_of):
        raise ValueError(
            f"context_lens has {len(contexts)} requests but query_lens has {len(rows_of)}"
        )
    for name, values in (("context_lens", contexts), ("query_lens", rows_of)):
        for i, v in enumerate(values):
            if v < 0:
                raise ValueError(f"{name}[{i}] = {v} is negative")

    out: list[tuple[slice, slice]] = []
    num_reqs = len(rows_of)
    end = 0
    while end < num_reqs:
        first = end
        rows = width = 0
        while end < num_reqs:
            grown_width = max(width, contexts[end])
            if rows > 0 and rows + rows_of[end] > rows_per_slice(max_logits_bytes, grown_width):
                break
            rows += rows_of[end]
            width = grown_width
            end += 1
        requests = slice(first + request_offset, end + request_offset)
        step = rows_per_slice(max_logits_bytes, width)
        for lo in range(0, rows, step):
            out.append((requests, slice(lo, min(lo + step, rows))))
    return out


def build_prefill_chunks(
    splits: Sequence[tuple[slice, slice]],
    row_offset: int,
    query_start_loc_cpu: torch.Tensor,
    seq_lens_upper_bound: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    compress_ratio: int,
    *,
    cu_seqlen_ks_out: torch.Tensor,
    cu_seqlen_ke_out: torch.Tensor,
    context_cumsum_out: torch.Tensor,
    index_staging: torch.Tensor,
    index_scratch: torch.Tensor,
    cumsum_scratch: torch.Tensor,
) -> list[PrefillChunk]:
    """Turn `split_prefill_chunks` output into `PrefillChunk`s with device `ks`/`ke` rows.

    `splits`: `(request slice, row slice)` pairs as `split_prefill_chunks` returns them,
    request slices in step indices, row slices counted from the first query row of their
    request slice. A split's step rows are `query_start_loc_cpu[requests.start] + rows`; they
    must lie inside the request slice's rows, and the splits must tile the prefill rows
    `[row_offset, row_offset + n)` in order (`row_offset` being `query_start_loc_cpu` of the
    first prefill request).

    A chunk's requests run from the request holding its first row (so `plan_prefill_chunks`
    finds it from `token_start`) to the end of its request slice: the slice's leading
    requests without rows in the chunk are left out. For a row at step position p of request
    r in a chunk whose first request is s: `ks = sum(context_lens[s:r])`,
    `ke = ks + (seq_lens[r] - query_start_loc[r + 1] + p + 1) // R` (device values). A chunk
    is dropped when none of its rows can see a key at the upper bounds (host values), so a
    dropped chunk certainly has none, and its rows stay untouched.

    Buffers: `cu_seqlen_ks_out`, `cu_seqlen_ke_out` int32 `[>= step rows]` indexed by step
    row (chunks get views); `context_cumsum_out` int64 `[>= num_reqs + 1]` (scratch);
    `index_staging` host int32 `[>= 3 * n]`, `index_scratch` device int32 `[>= 3 * n]`,
    `cumsum_scratch` device int64 `[>= 2 * n]`. Host work is proportional to rows and
    requests; device values are never read back.
    """
    check_positive_int("compress_ratio", compress_ratio)
    check_non_negative_int("row_offset", row_offset)
    qsl = host_array(query_start_loc_cpu, "query_start_loc_cpu")
    upper = host_array(seq_lens_upper_bound, "seq_lens_upper_bound")
    if not splits:
        return []
    num_reqs = int(qsl.shape[0]) - 1
    qsl_list = qsl.tolist()
    starts: list[int] = []
    stops: list[int] = []
    for i, (requests, rows) in enumerate(splits):
        if not (0 <= requests.start < requests.stop <= num_reqs):
            raise ValueError(
                f"splits[{i}] requests [{requests.start}, {requests.stop}) fall outside the "
                f"step's {num_reqs} requests"
            )
        if not 0 <= rows.start < rows.stop:
            raise ValueError(f"splits[{i}] rows [{rows.start}, {rows.stop}) are empty or negative")
        group_row = qsl_list[requests.start]
        if group_row + rows.stop > qsl_list[requests.stop]:
            raise ValueError(
                f"splits[{i}] rows [{rows.start}, {rows.stop}) reach past the "
                f"{qsl_list[requests.stop] - group_row} rows of requests "
                f"[{requests.start}, {requests.stop})"
            )
        starts.append(group_row + rows.start)
        stops.append(group_row + rows.stop)
    if starts[0] != row_offset or any(a != b for a, b in zip(stops[:-1], starts[1:], strict=True)):
        raise ValueError(
            f"splits must tile the prefill rows in order from row_offset = {row_offset}"
        )
    row_end = stops[-1]
    num_rows = row_end - row_offset
    if (
        cu_seqlen_ks_out.shape[0] < row_end
        or cu_seqlen_ke_out.shape[0] < row_end
        or context_cumsum_out.shape[0] < num_reqs + 1
        or index_staging.shape[0] < 3 * num_rows
        or index_scratch.shape[0] < 3 * num_rows
        or cumsum_scratch.shape[0] < 2 * num_rows
    ):
        raise ValueError(f"prefill buffers too small for {num_rows} rows of {num_reqs} requests")

    # Each chunk's first request: the one holding its first row (zero-row requests hold none).
    firsts = (np.searchsorted(qsl, np.array(starts, dtype=np.int64), side="right") - 1).tolist()

    # Host index vectors per prefill row: its request, its chunk's first request, and the
    # offset that turns seq_len into the row's absolute position + 1.
    staging = index_staging.numpy()
    request = staging[:num_rows]
    chunk_first = staging[num_rows : 2 * num_rows]
    offset = staging[2 * num_rows : 3 * num_rows]
    query_lens = np.diff(qsl)
    all_rows_request = np.repeat(np.arange(num_reqs, dtype=np.int32), query_lens)
    request[:] = all_rows_request[row_offset:row_end]
    chunk_first[:] = np.repeat(
        np.array(firsts, dtype=np.int32),
        np.array(stops, dtype=np.int64) - np.array(starts, dtype=np.int64),
    )
    steps = np.arange(row_offset + 1, row_end + 1, dtype=np.int64)
    np.subtract(steps, qsl[1:][request], out=offset, casting="unsafe")

    # Device: ks = cumsum[r] - cumsum[s]; ke = ks + (seq_len[r] + offset) // R.
    scratch = index_scratch[: 3 * num_rows]
    scratch.copy_(index_staging[: 3 * num_rows], non_blocking=True)
    context_cumsum_out[0].zero_()
    torch.cumsum(
        context_lens[:num_reqs], 0, dtype=torch.int64, out=context_cumsum_out[1 : num_reqs + 1]
    )
    pair = cumsum_scratch[: 2 * num_rows]
    torch.index_select(context_cumsum_out, 0, scratch[: 2 * num_rows], out=pair)
    ks = cu_seqlen_ks_out[row_offset:row_end]
    ke = cu_seqlen_ke_out[row_offset:row_end]
    torch.sub(pair[:num_rows], pair[num_rows:], out=ks)
    torch.index_select(seq_lens, 0, scratch[:num_rows], out=ke)
    ke.add_(scratch[2 * num_rows :])
    if compress_ratio > 1:
        ke.div_(compress_ratio, rounding_mode="floor")
    ke.add_(ks)

    upper_list = upper.tolist()
    chunks: list[PrefillChunk] = []
    for (group, _), first, token_start, token_end in zip(
        splits, firsts, starts, stops, strict=True
    ):
        requests = slice(first, group.stop)
        if not _sees_a_key(requests, token_start, token_end, qsl_list, upper_list, compress_ratio):
            continue
        chunks.append(
            PrefillChunk(
                token_start=token_start,
                token_end=token_end,
                num_reqs=requests.stop - requests.start,
                block_table=block_table[requests],
                cu_seqlen_ks=cu_seqlen_ks_out[token_start:token_end],
                cu_seqlen_ke=cu_seqlen_ke_out[token_start:token_end],
                request_start=first,
            )
        )
    return chunks


def _sees_a_key(
    requests: slice,
    token_start: int,
    token_end: int,
    qsl: list[int],
    upper: list[int],
    compress_ratio: int,
) -> bool:
    """Whether any row in `[token_start, token_end)` can see a key at the upper bounds.

    A request's last row in the range has its largest end: for row t of request r the end is
    `(seq_len - query_start_loc[r + 1] + t + 1) // R`.
    """
    for r in range(requests.start, requests.stop):
        first_row = max(qsl[r], token_start)
        last_row_end = min(qsl[r + 1], token_end)
        if last_row_end > first_row and (upper[r] - qsl[r + 1] + last_row_end) // compress_ratio:
            return True
    return False


def plan_prefill_chunks(
    chunks: Sequence[PrefillChunk],
    query_start_loc: HostInts,
    seq_lens_upper_bound: HostInts,
    context_lens: torch.Tensor,
    compress_ratio: int,
    candidate_block_size: int,
    min_gather_width: int | None,
    query_start_loc_device: torch.Tensor,
    *,
    query_start_loc_out: torch.Tensor | None = None,
    row_ends_out: torch.Tensor | None = None,
    block_ends_out: torch.Tensor | None = None,
) -> list[PrefillPlan]:
    """One `PrefillPlan` per chunk (docs/contract.md section 3.3).

    A chunk needs only the seed's fields (`token_start`, `token_end`, `num_reqs`,
    `block_table`, `cu_seqlen_ks`, `cu_seqlen_ke`): its first request, the one its block
    table's row 0 describes, is the request holding row `token_start`, found in
    `query_start_loc`; its requests are that one and the next `num_reqs - 1`, and its rows
    must lie inside theirs. A chunk's `request_start`, when set, must name that request.

    `query_start_loc`, `seq_lens_upper_bound`: the step's host offsets and upper bounds;
    `context_lens`, `query_start_loc_device`: the step's device compressed contexts and
    offsets. Per chunk: `first_request` holds row `token_start`; `requests` lists
    `(first row, end row, request)` for the chunk's requests with rows in it (rows from
    `token_start`, request indexing the chunk's block table, so the first entry is
    `(0, ., 0)`); `query_start_loc` is the device offsets of the chunk's requests clamped to
    the chunk and made local (`[num_reqs + 1]`); `width` the widest `upper_bound // R`;
    `row_ends = ke - ks`; `block_ends = ceil(row_ends / C)` when `candidate_block_size`
    C > 0 else None; `context_lens` a view; `use_gather` when `min_gather_width` is not None
    and `width >= min_gather_width`.

    Optional persistent outputs (device int32): `query_start_loc_out` holds the local offsets
    packed chunk after chunk (`>= sum(num_reqs + 1)` entries); `row_ends_out` and
    `block_ends_out` are indexed by step row (`>= max token_end`). Without them the results
    are fresh tensors.
    """
    check_positive_int("compress_ratio", compress_ratio)
    check_non_negative_int("candidate_block_size", candidate_block_size)
    qsl = host_array(query_start_loc, "query_start_loc").tolist()
    upper = host_array(seq_lens_upper_bound, "seq_lens_upper_bound").tolist()
    num_reqs = len(qsl) - 1
    if query_start_loc_out is not None:
        needed = sum(chunk.num_reqs + 1 for chunk in chunks)
        if query_start_loc_out.shape[0] < needed:
            raise ValueError(
                f"query_start_loc_out has {query_start_loc_out.shape[0]} entries, {needed} needed"
            )
    described = [_describe(chunk, qsl, num_reqs) for chunk in chunks]
    ends = _row_and_block_ends(chunks, candidate_block_size, row_ends_out, block_ends_out)

    packed = 0
    plans: list[PrefillPlan] = []
    for chunk, (first_request, requests), (row_ends, block_ends) in zip(
        chunks, described, ends, strict=True
    ):
        start, end = chunk.token_start, chunk.token_end
        req_start, req_end = first_request, first_request + chunk.num_reqs
        source = query_start_loc_device[req_start : req_end + 1]
        if query_start_loc_out is None:
            local_qsl = source - start
        else:
            local_qsl = query_start_loc_out[packed : packed + chunk.num_reqs + 1]
            torch.sub(source, start, out=local_qsl)
            packed += chunk.num_reqs + 1
        local_qsl.clamp_(0, end - start)
        width = max((upper[r] // compress_ratio for r in range(req_start, req_end)), default=0)
        plans.append(
            PrefillPlan(
                first_request=first_request,
                requests=requests,
                query_start_loc=local_qsl,
                width=width,
                row_ends=row_ends,
                block_ends=block_ends,
                context_lens=context_lens[req_start:req_end],
                use_gather=min_gather_width is not None and width >= min_gather_width,
            )
        )
    return plans


def _describe(
    chunk: PrefillChunk, qsl: list[int], num_reqs: int
) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """`(first_request, requests)` of a chunk, checking it against the step."""
    start, end = chunk.token_start, chunk.token_end
    if not 0 <= start < end <= qsl[-1]:
        raise ValueError(f"chunk rows [{start}, {end}) fall outside the step's {qsl[-1]} rows")
    first_request = bisect.bisect_right(qsl, start) - 1
    if chunk.request_start is not None and chunk.request_start != first_request:
        raise ValueError(
            f"chunk request_start = {chunk.request_start} disagrees with token_start = {start}, "
            f"which request {first_request} holds"
        )
    req_end = first_request + chunk.num_reqs
    if chunk.num_reqs < 1 or req_end > num_reqs:
        raise ValueError(
            f"chunk num_reqs = {chunk.num_reqs} from request {first_request} (holding "
            f"token_start = {start}) falls outside the step's {num_reqs} requests"
        )
    if end > qsl[req_end]:
        raise ValueError(
            f"chunk rows [{start}, {end}) reach past the rows of its requests "
            f"[{first_request}, {req_end}), which end at {qsl[req_end]}"
        )
    requests = tuple(
        (max(qsl[r], start) - start, min(qsl[r + 1], end) - start, r - first_request)
        for r in range(first_request, req_end)
        if min(qsl[r + 1], end) > max(qsl[r], start)
    )
    return first_request, requests


def _row_and_block_ends(
    chunks: Sequence[PrefillChunk],
    candidate_block_size: int,
    row_ends_out: torch.Tensor | None,
    block_ends_out: torch.Tensor | None,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each chunk's `ke - ks` and `ceil((ke - ks) / C)`.

    With persistent outputs (indexed by step row), consecutive chunks whose `ks`/`ke` are
    adjacent views of one storage (the builder's case) form a span computed by one set of
    device ops, and each chunk gets views; that keeps the device ops per step independent of
    the chunk count.
    """
    if row_ends_out is None:
        out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for chunk in chunks:
            row_ends = chunk.cu_seqlen_ke - chunk.cu_seqlen_ks
            block_ends = None
            if candidate_block_size:
                block_ends = row_ends + (candidate_block_size - 1)
                block_ends.div_(candidate_block_size, rounding_mode="floor")
            out.append((row_ends, block_ends))
        return out
    if candidate_block_size and block_ends_out is None:
        raise ValueError(
            "block_ends_out is required with row_ends_out when candidate blocks are on"
        )
    last_row = max((chunk.token_end for chunk in chunks), default=0)
    if row_ends_out.shape[0] < last_row or (
        candidate_block_size and block_ends_out is not None and block_ends_out.shape[0] < last_row
    ):
        raise ValueError(f"row_ends_out / block_ends_out must hold the step's {last_row} rows")

    spans: list[list[PrefillChunk]] = []
    for chunk in chunks:
        if spans:
            previous = spans[-1][-1]
            if (
                previous.token_end == chunk.token_start
                and adjacent_views([previous.cu_seqlen_ks, chunk.cu_seqlen_ks])
                and adjacent_views([previous.cu_seqlen_ke, chunk.cu_seqlen_ke])
            ):
                spans[-1].append(chunk)
                continue
        spans.append([chunk])
    for span in spans:
        start, end = span[0].token_start, span[-1].token_end
        ks = spanning_view(span[0].cu_seqlen_ks, end - start)
        ke = spanning_view(span[0].cu_seqlen_ke, end - start)
        torch.sub(ke, ks, out=row_ends_out[start:end])
        if candidate_block_size:
            assert block_ends_out is not None
            block_ends = block_ends_out[start:end]
            torch.add(row_ends_out[start:end], candidate_block_size - 1, out=block_ends)
            block_ends.div_(candidate_block_size, rounding_mode="floor")
    return [
        (
            row_ends_out[chunk.token_start : chunk.token_end],
            block_ends_out[chunk.token_start : chunk.token_end]
            if candidate_block_size and block_ends_out is not None
            else None,
        )
        for chunk in chunks
    ]
