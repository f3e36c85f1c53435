"""Decode planning (docs/contract.md sections 3.2, 3.4): the decode/prefill split, flattened
decode rows, and the shape-only native-decode decision.

Host values decide only counts and index vectors; every per-step value a graph reads is written
by device ops into caller-given persistent buffers, so nothing here reads a device tensor back.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from graphidx.metadata import NativeDecode
from graphidx.plan._host import HostInts, check_non_negative_int, check_positive_int, host_array


def split_decodes_prefills(query_lens_cpu: HostInts, next_n: int) -> tuple[int, int, int, int]:
    """Split a step's requests into the leading decodes and the trailing prefills.

    `query_lens_cpu`: host ints `[num_reqs]`. A request is a decode when its query length is
    at most `next_n` (zero-length padding requests included); the first longer one starts the
    prefills and every later request is a prefill, whatever its length.
    Returns `(num_decodes, num_decode_tokens, num_prefills, num_prefill_tokens)`, the token
    counts being the real query rows (no graph padding).
    """
    check_positive_int("next_n", next_n)
    query_lens = host_array(query_lens_cpu, "query_lens_cpu")
    num_reqs = int(query_lens.shape[0])
    longer = query_lens > next_n
    first_prefill = int(longer.argmax()) if num_reqs and longer.any() else num_reqs
    num_decode_tokens = int(query_lens[:first_prefill].sum())
    num_prefill_tokens = int(query_lens[first_prefill:].sum())
    return first_prefill, num_decode_tokens, num_reqs - first_prefill, num_prefill_tokens


def native_decode(
    row_lens: torch.Tensor,
    row_block_table: torch.Tensor,
    query_lens: HostInts,
    next_n: int,
    context_lens: torch.Tensor,
) -> NativeDecode | None:
    """The decode rows as `next_n`-row sequences, when the shape allows it (docs/contract.md
    section 3.4).

    `row_lens` `[rows]` and `row_block_table` `[rows, max_blocks]` are the flattened decode
    rows; `query_lens` the decode requests' query lengths (host, `[num_reqs]`); `context_lens`
    (device, `[>= num_reqs]`) their compressed contexts. Native when `next_n > 1`, every
    request before the first short one has exactly `next_n` rows, every request after it has
    none, and `rows == num_reqs * next_n` (padding keeps its `next_n` rows with no context).
    Returns `NativeDecode(next_n, context_lens[:num_reqs], row_block_table[::next_n])`, the
    block table a strided view sharing the row block table's storage, or None. Only shapes and
    query lengths are read, never a length's value, so a graph captured on one batch replays
    the same decision on every batch of its shape.
    """
    check_positive_int("next_n", next_n)
    lens = host_array(query_lens, "query_lens")
    num_reqs = int(lens.shape[0])
    if next_n == 1 or num_reqs == 0:
        return None
    num_rows = int(row_lens.shape[0])
    if num_rows != num_reqs * next_n or int(row_block_table.shape[0]) != num_rows:
        return None
    if int(context_lens.shape[0]) < num_reqs:
        raise ValueError(
            f"context_lens has {context_lens.shape[0]} entries, fewer than the {num_reqs} "
            "decode requests"
        )
    short = lens != next_n
    if short.any():
        first_short = int(short.argmax())
        if lens[first_short] > next_n or lens[first_short + 1 :].any():
            return None
    return NativeDecode(
        next_n=next_n,
        context_lens=context_lens[:num_reqs],
        block_table=row_block_table[::next_n],
    )


class DecodeRows(NamedTuple):
    """Views of the persistent decode-row buffers filled by `build_decode_rows`."""

    row_lens: torch.Tensor
    block_table: torch.Tensor
    block_ends: torch.Tensor | None


def decode_row_index(
    query_start_loc_cpu: np.ndarray, num_decodes: int, out: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Host index vectors of the real decode rows, written into `out` (int32 `[>= 2 * T]`).

    For real decode row t of request r: `request[t] = r` and
    `offset[t] = t + 1 - query_start_loc[r + 1]` (<= 0), so that the row's absolute position
    plus one is `seq_len[r] + offset[t]`. Returns the two views `out[:T]`, `out[T:2T]`.
    """
    num_rows = int(query_start_loc_cpu[num_decodes])
    request = out[:num_rows]
    offset = out[num_rows : 2 * num_rows]
    query_ends = query_start_loc_cpu[1 : num_decodes + 1]
    query_lens = np.diff(query_start_loc_cpu[: num_decodes + 1])
    request[:] = np.repeat(np.arange(num_decodes, dtype=np.int32), query_lens)
    np.subtract(np.arange(1, num_rows + 1, dtype=np.int32), query_ends[request], out=offset)
    return request, offset


def build_decode_rows(
    query_start_loc_cpu: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_decodes: int,
    num_rows: int,
    compress_ratio: int,
    candidate_block_size: int,
    *,
    row_lens_out: torch.Tensor,
    row_block_table_out: torch.Tensor,
    block_ends_out: torch.Tensor | None,
    index_staging: torch.Tensor,
    index_scratch: torch.Tensor,
    num_real_reqs: int | None = None,
) -> DecodeRows:
    """Fill the flattened decode rows of docs/contract.md section 3.2 into persistent buffers.

    Inputs: `query_start_loc_cpu` host int32 `[num_reqs + 1]`; device `seq_lens` int32
    `[num_reqs]` and `block_table` int32 `[num_reqs, max_blocks]`; the first `num_decodes`
    requests are the decodes, their rows the first `T = query_start_loc_cpu[num_decodes]`
    rows; `num_rows >= T` rows are produced, rows `[T, num_rows)` being padding.
    Row j of a decode request with q rows and seq_len L gets row end
    `max(0, (L - q + j + 1) // R)` and that request's block-table row; padding rows get end 0
    and a zeroed row. Padding rows are the rows past `T`, and the rows of every request at
    index >= `num_real_reqs` (runtime padding requests, docs/contract.md section 3.2a; None:
    every request is real), which therefore read no page whatever their lengths and table
    rows. The clamp at 0
    makes a request with `seq_len < q` (vLLM's `arange` padding) give ends of 0, never
    negative, even when it is not declared padding.
    `block_ends = ceil(row_lens / C)` when `candidate_block_size` C > 0.

    Buffers (persistent, contiguous, int32): `row_lens_out` `[>= num_rows]` on the device;
    `row_block_table_out` with room for `num_rows * max_blocks` elements (viewed as a
    contiguous `[num_rows, max_blocks]` block at its start); `block_ends_out` `[>= num_rows]`
    or None when C == 0; `index_staging` host `[>= 2 * T]` (pinned for a GPU) and
    `index_scratch` device `[>= 2 * T]`. The host computes index vectors from the host offsets
    only and ships them with one non-blocking copy; everything else is device ops, so host
    work is proportional to the rows, never to the context length, and nothing is copied back.
    `num_real_reqs` is a host int: the padding requests' rows are found from the host offsets.
    Returns views `[num_rows]`, `[num_rows, max_blocks]`, `[num_rows]` of the buffers.
    """
    check_non_negative_int("num_decodes", num_decodes)
    if num_real_reqs is not None:
        check_non_negative_int("num_real_reqs", num_real_reqs)
    check_positive_int("compress_ratio", compress_ratio)
    check_non_negative_int("candidate_block_size", candidate_block_size)
    qsl = query_start_loc_cpu.numpy()
    if num_decodes >= qsl.shape[0]:
        raise ValueError(
            f"num_decodes = {num_decodes} exceeds the batch's {qsl.shape[0] - 1} requests"
        )
    num_real = int(qsl[num_decodes])
    # Rows [num_scored, num_real) belong to padding requests and are planned as padding.
    num_scoring = num_decodes if num_real_reqs is None else min(num_real_reqs, num_decodes)
    num_scored = int(qsl[num_scoring])
    if num_rows < num_real:
        raise ValueError(f"num_rows = {num_rows} is below the {num_real} real decode rows")
    max_blocks = int(block_table.shape[1])
    if (
        row_lens_out.shape[0] < num_rows
        or row_block_table_out.numel() < num_rows * max_blocks
        or index_staging.shape[0] < 2 * num_real
        or index_scratch.shape[0] < 2 * num_real
        or (block_ends_out is not None and block_ends_out.shape[0] < num_rows)
    ):
        raise ValueError(
            f"decode buffers too small for {num_rows} rows of {max_blocks} block-table columns"
        )
    if candidate_block_size and block_ends_out is None:
        raise ValueError("block_ends_out is required when candidate_block_size > 0")

    row_lens = row_lens_out[:num_rows]
    row_table = row_block_table_out.view(-1)[: num_rows * max_blocks].view(num_rows, max_blocks)
    if num_scored:
        decode_row_index(qsl, num_scoring, index_staging.numpy())
        scratch = index_scratch[: 2 * num_scored]
        scratch.copy_(index_staging[: 2 * num_scored], non_blocking=True)
        request = scratch[:num_scored]
        real_lens = row_lens[:num_scored]
        torch.index_select(seq_lens, 0, request, out=real_lens)
        real_lens.add_(scratch[num_scored:])
        # Never negative: a row of seq_len < q (or a stale length) sees nothing, not less.
        real_lens.clamp_(min=0)
        if compress_ratio > 1:
            real_lens.div_(compress_ratio, rounding_mode="floor")
        torch.index_select(block_table, 0, request, out=row_table[:num_scored])
    if num_rows > num_scored:
        row_lens[num_scored:].zero_()
        row_table[num_scored:].zero_()
    block_ends = None
    if candidate_block_size:
        assert block_ends_out is not None
        block_ends = block_ends_out[:num_rows]
        torch.add(row_lens, candidate_block_size - 1, out=block_ends)
        block_ends.div_(candidate_block_size, rounding_mode="floor")
    return DecodeRows(row_lens, row_table, block_ends)


def derive_request_rows(
    seq_lens: torch.Tensor,
    num_live_reqs: torch.Tensor,
    query_start_loc: torch.Tensor,
    next_n: int,
    compress_ratio: int,
    candidate_block_size: int,
    *,
    context_lens_out: torch.Tensor,
    row_lens_out: torch.Tensor,
    block_ends_out: torch.Tensor | None,
    query_start_loc_out: torch.Tensor,
) -> None:
    """A uniform decode shape's rows owned as the device row offsets say (device ops only).

    For a step captured as `reqs` requests of `next_n` rows whose real query lengths live on
    the device (adaptive verification: the host's offsets are a uniform placeholder).
    Inputs, persistent int32 device tensors: `seq_lens` `[reqs]`, `num_live_reqs` `[1]`
    (requests past it are padding: no rows, no context), `query_start_loc` `[reqs + 1]`, the
    live requests' device row offsets (values past the live count are ignored). Offsets are
    clamped into `[0, reqs * next_n]` and made non-decreasing, so no value can send a kernel
    outside the step's rows. Writes: `context_lens_out[r] = L_r // R` (0 for padding);
    `row_lens_out[t]` for every row t < reqs * next_n: row j of request r with q rows ends at
    `max(L_r - q + j + 1, 0) // R`, rows past the live requests' rows at 0; `block_ends_out =
    ceil(row_lens / C)` when given; `query_start_loc_out` `[reqs + 1]`: the clamped offsets
    with the last entry at `reqs * next_n`, so the rows past the real ones belong to the last
    request (a padding request, or a real one whose extra rows end at 0).
    """
    check_positive_int("next_n", next_n)
    check_positive_int("compress_ratio", compress_ratio)
    reqs = int(seq_lens.shape[0])
    rows = reqs * next_n
    device = seq_lens.device
    bounds = torch.arange(reqs + 1, device=device)
    live = num_live_reqs.to(torch.int64).clamp(0, reqs)
    offsets = query_start_loc.to(torch.int64).clamp(0, rows)
    offsets = torch.where(bounds == 0, 0, offsets).cummax(0).values
    offsets = torch.where(bounds <= live, offsets, offsets.gather(0, live))
    lens = torch.where(bounds[:reqs] < live, seq_lens.to(torch.int64), 0).clamp(min=0)
    context_lens_out.copy_(lens // compress_ratio)
    row = torch.arange(rows, device=device)
    owner = torch.searchsorted(offsets[1:], row, right=True).clamp(max=reqs - 1)
    query_lens = offsets[1:] - offsets[:-1]
    step = row - offsets[owner]
    ends = (lens[owner] - query_lens[owner] + step + 1).clamp(min=0) // compress_ratio
    row_lens_out.copy_(torch.where(row < offsets[-1], ends, 0))
    if block_ends_out is not None:
        size = candidate_block_size
        block_ends_out.copy_((row_lens_out + size - 1) // size)
    query_start_loc_out.copy_(torch.where(bounds == reqs, rows, offsets))
