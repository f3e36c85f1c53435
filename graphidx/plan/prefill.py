"""Prefill planning (SPEC 3.3): the logits-budget split, chunk construction, launch plans.

Coordinates: `split_prefill_chunks` returns row slices relative to the first row of the
requests it was given (prefill-relative); `build_prefill_chunks` adds the step row of that
request (`row_offset`) so that every `PrefillChunk` and everything planned from it
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
    bounds, and query rows). Walk requests in order, growing a group while
    `rows * widest_context * 4 <= max_logits_bytes` (the widest context, not the sum, counts:
    K is read in place); a group always takes its first request. Each group's rows are cut
    into slices of at most `rows_per_slice(max_logits_bytes, width)` rows; a group without
    rows yields nothing. Returns `(request slice, row slice)` pairs in order: request slices
    offset by `request_offset`, each covering the whole group; row slices relative to the
    first row of request 0 of the input (prefill-relative). The row slices tile
    `[0, sum(query_lens))` exactly.
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
    row_start = 0
    first = 0
    while first < num_reqs:
        rows = rows_of[first]
        width = contexts[first]
        end = first + 1
        while end < num_reqs:
            grown_rows = rows + rows_of[end]
            grown_width = max(width, contexts[end])
            if grown_rows * grown_width * FP32_BYTES > max_logits_bytes:
                break
            rows, width = grown_rows, grown_width
            end += 1
        requests = slice(first + request_offset, end + request_offset)
        step = rows_per_slice(max_logits_bytes, width)
        for lo in range(row_start, row_start + rows, step):
            out.append((requests, slice(lo, min(lo + step, row_start + rows))))
        row_start += rows
        first = end
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

    `splits` must tile the prefill rows `[row_offset, row_offset + n)` in order (as
    `split_prefill_chunks` returns them, `row_offset` being `query_start_loc_cpu` of its first
    request). For a row at absolute position p of request r in a chunk whose first request is
    s: `ks = sum(context_lens[s:r])`, `ke = ks + (p + 1) // R` (device values). A chunk is
    dropped when none of its rows can see a key at the upper bounds (host values) — so a
    dropped chunk certainly has none, and its rows stay untouched.

    Buffers: `cu_seqlen_ks_out`, `cu_seqlen_ke_out` int32 `[>= step rows]` indexed by step
    row (chunks get views); `context_cumsum_out` int64 `[>= num_reqs + 1]` (scratch);
    `index_staging` host int32 `[>= 3 * n]`, `index_scratch` device int32 `[>= 3 * n]`,
    `cumsum_scratch` device int64 `[>= 2 * n]`. Host work is proportional to rows and
    requests; device values are never read back.
    """
    check_positive_int("compress_ratio", compress_ratio)
    qsl = host_array(query_start_loc_cpu, "query_start_loc_cpu")
    upper = host_array(seq_lens_upper_bound, "seq_lens_upper_bound")
    if not splits:
        return []
    num_reqs = int(qsl.shape[0]) - 1
    starts = [rows.start for _, rows in splits]
    stops = [rows.stop for _, rows in splits]
    if starts[0] != 0 or any(a != b for a, b in zip(stops[:-1], starts[1:], strict=True)):
        raise ValueError("splits must tile the prefill rows in order from row 0")
    num_rows = stops[-1]
    row_end = row_offset + num_rows
    if row_end > int(qsl[-1]):
        raise ValueError(
            f"splits cover rows up to {row_end}, past the step's {int(qsl[-1])} real rows"
        )
    if (
        cu_seqlen_ks_out.shape[0] < row_end
        or cu_seqlen_ke_out.shape[0] < row_end
        or context_cumsum_out.shape[0] < num_reqs + 1
        or index_staging.shape[0] < 3 * num_rows
        or index_scratch.shape[0] < 3 * num_rows
        or cumsum_scratch.shape[0] < 2 * num_rows
    ):
        raise ValueError(f"prefill buffers too small for {num_rows} rows of {num_reqs} requests")

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
        np.array([reqs.start for reqs, _ in splits], dtype=np.int32),
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

    qsl_list = qsl.tolist()
    upper_list = upper.tolist()
    chunks: list[PrefillChunk] = []
    for requests, rows in splits:
        token_start = row_offset + rows.start
        token_end = row_offset + rows.stop
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
                request_start=requests.start,
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
    """One `PrefillPlan` per chunk (SPEC 3.3).

    `query_start_loc`, `seq_lens_upper_bound`: the step's host offsets and upper bounds;
    `context_lens`, `query_start_loc_device`: the step's device compressed contexts and
    offsets. Per chunk: `first_request` holds row `token_start`; `requests` lists
    `(first row, end row, request)` for the chunk's requests with rows in it (rows from
    `token_start`, request from the chunk's first); `query_start_loc` is the device offsets of
    the chunk's requests clamped to the chunk and made local (`[num_reqs + 1]`); `width` the
    widest `upper_bound // R`; `row_ends = ke - ks`; `block_ends = ceil(row_ends / C)` when
    `candidate_block_size` C > 0 else None; `context_lens` a view; `use_gather` when
    `min_gather_width` is not None and `width >= min_gather_width`.

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
        req_start, req_end = chunk.request_start, chunk.request_start + chunk.num_reqs
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
    req_start, req_end = chunk.request_start, chunk.request_start + chunk.num_reqs
    if not (0 <= req_start <= req_end <= num_reqs) or not (0 <= start < end <= qsl[-1]):
        raise ValueError(
            f"chunk rows [{start}, {end}) / requests [{req_start}, {req_end}) fall outside "
            f"the step's {qsl[-1]} rows / {num_reqs} requests"
        )
    first_request = bisect.bisect_right(qsl, start) - 1
    requests = tuple(
        (max(qsl[r], start) - start, min(qsl[r + 1], end) - start, r - req_start)
        for r in range(req_start, req_end)
        if min(qsl[r + 1], end) > max(qsl[r], start)
    )
    if not requests or requests[0][0] != 0 or first_request - req_start != requests[0][2]:
        raise ValueError(
            f"chunk rows [{start}, {end}) do not start inside its requests [{req_start}, {req_end})"
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
