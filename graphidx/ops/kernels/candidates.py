"""Candidate pool resolution and the dense candidate mask in Triton (docs/contract.md sections
5.3 and 5.6).

`resolve_candidate_pool`: a program per row (up to POOL_PROGRAMS, then each takes several)
finds the valid block ids and writes them ascending as first positions, -1 padding and the
live column count. When the row's block ids span at most POOL_MARKS x the pool size, the
program marks each id in a byte of its own scratch and compacts the marks in id order (one
prefix sum per POOL_TILE ids; a few microseconds); a wider row sorts its ids with `tl.sort`
(invalid ones mapped past every valid id; ~25 us for a 2048-id pool on the H200).

`apply_candidate_mask`: the candidate starts of a row need not be sorted or aligned, so a
first kernel sorts each row's starts (-1 mapped to the largest int32) into scratch memory;
the second, over (row, column tile), finds for every column t the largest start <= t by a
branch-free binary search of the sorted starts and writes -inf where t is not inside
[start, start + C). All intervals have the same length C, so that start decides coverage.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphidx.config import cdiv
from graphidx.ops.kernels import next_power_of_2
from graphidx.ops.kernels.launch import launch
from graphidx.ops.kernels.ptx import wait_for_prior_kernels

INT32_MAX = 2**31 - 1
_INT32_MAX_TL = tl.constexpr(INT32_MAX)
MASK_BLOCK = 1024
POOL_MARKS = 4
"""A row whose ids span at most POOL_MARKS x the (power-of-two) pool size resolves by marking
its ids in a byte per block id and compacting the marks; a wider one sorts its ids (H200,
a 2048-id pool, 2 / 64 / 1024 rows: marks at 0.41-0.48x the sort's time for ids below 2048,
0.58-0.65x below 4096, 0.81 / 0.92 / 1.06x below 8192, 1.24-1.87x below 16384)."""
POOL_TILE = 2048
"""Block ids compacted per prefix sum."""
POOL_PROGRAMS = 1024
"""Programs of one resolve launch (each loops over rows; its marks are its own scratch)."""


@triton.jit
def _pool_by_marks(ids, valid, blocks, slot, in_pool, marks, positions, C, TILE: tl.constexpr):
    """Mark each valid id in `marks` (one byte per block id below `blocks`), then write the
    marked ids ascending as first positions by one prefix sum per TILE ids, -1 after them.
    Returns (count, largest id) of the marked ids."""
    for start in range(0, blocks, TILE):
        block = start + tl.arange(0, TILE)
        tl.store(marks + block, tl.zeros([TILE], tl.int8), mask=block < blocks)
    tl.debug_barrier()
    tl.store(marks + ids, tl.full(ids.shape, 1, tl.int8), mask=valid)
    tl.debug_barrier()
    count = tl.sum(tl.zeros([TILE], tl.int32), axis=0)
    last_id = count - 1
    for start in range(0, blocks, TILE):
        block = start + tl.arange(0, TILE)
        marked = tl.load(marks + block, mask=block < blocks, other=0).to(tl.int32)
        rank = count + tl.cumsum(marked, axis=0) - marked
        tl.store(positions + rank, block * C, mask=marked > 0)
        count += tl.sum(marked, axis=0)
        last_id = tl.maximum(last_id, tl.max(tl.where(marked > 0, block, -1), axis=0))
    tl.store(positions + slot, tl.full(slot.shape, -1, tl.int32), mask=in_pool & (slot >= count))
    return count, last_id


@triton.jit(do_not_specialize=["row_ends_ptr", "live_ptr", "rows"])
def _resolve_pool_kernel(
    block_ids_ptr,
    row_ends_ptr,
    positions_ptr,
    live_ptr,
    marks_ptr,
    rows,
    ids_row_stride,
    pos_row_stride,
    pool_blocks,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
    SENTINEL: tl.constexpr,
    MARKS: tl.constexpr,
    TILE: tl.constexpr,
):
    wait_for_prior_kernels()
    program = tl.program_id(0).to(tl.int64)
    marks = marks_ptr + program * MARKS
    slot = tl.arange(0, BLOCK)
    in_pool = slot < pool_blocks
    for turn in range(0, tl.cdiv(rows - program, tl.num_programs(0))):
        row = program + turn * tl.num_programs(0)
        ids = tl.load(block_ids_ptr + row * ids_row_stride + slot, mask=in_pool, other=-1)
        end = tl.maximum(tl.load(row_ends_ptr + row), 0)
        blocks = tl.cdiv(end, C)
        valid = (ids >= 0) & (ids < blocks)
        positions = positions_ptr + row * pos_row_stride
        if blocks <= MARKS:
            count, last_id = _pool_by_marks(
                ids, valid, blocks, slot, in_pool, marks, positions, C, TILE
            )
        else:
            ordered = tl.sort(tl.where(valid, ids, SENTINEL))
            count = tl.sum(valid.to(tl.int32), axis=0)
            first = tl.where(slot < count, ordered * C, -1)
            tl.store(positions + slot, first, mask=in_pool)
            last_id = tl.max(tl.where(valid, ids, -1), axis=0)
        tail = tl.minimum(end - last_id * C, C)
        tl.store(live_ptr + row, tl.where(count > 0, (count - 1) * C + tail, 0))
        tl.debug_barrier()  # this program's marks are reused by its next row


@triton.jit
def _sort_starts_kernel(
    positions_ptr,
    sorted_ptr,
    pos_row_stride,
    pool_blocks,
    BLOCK: tl.constexpr,
    SENTINEL: tl.constexpr,
):
    wait_for_prior_kernels()
    row = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, BLOCK)
    starts = tl.load(positions_ptr + row * pos_row_stride + slot, mask=slot < pool_blocks, other=-1)
    ordered = tl.sort(tl.where(starts >= 0, starts, SENTINEL))
    tl.store(sorted_ptr + row * BLOCK + slot, ordered)


@triton.jit(do_not_specialize=["width"])
def _mask_columns_kernel(
    logits_ptr,
    sorted_ptr,
    row_stride,
    width,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
    STARTS: tl.constexpr,
    LOG2_STARTS: tl.constexpr,
):
    wait_for_prior_kernels()
    row = tl.program_id(0).to(tl.int64)
    column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    starts = sorted_ptr + row * STARTS
    # Binary lifting: at_most = number of sorted starts <= column (padding never is).
    at_most = tl.zeros([BLOCK], tl.int32)
    for level in tl.static_range(LOG2_STARTS):
        step = STARTS >> (level + 1)
        probe = tl.load(starts + at_most + step - 1)
        at_most = tl.where(probe <= column, at_most + step, at_most)
    last = tl.load(starts + at_most, mask=at_most < STARTS, other=_INT32_MAX_TL)
    at_most = tl.where(last <= column, at_most + 1, at_most)
    nearest = tl.load(starts + at_most - 1, mask=at_most > 0, other=0)
    covered = (at_most > 0) & (column < nearest + C)
    tl.store(
        logits_ptr + row * row_stride + column,
        tl.full([BLOCK], float("-inf"), tl.float32),
        mask=(column < width) & ~covered,
    )


def resolve_candidate_pool(
    block_ids: torch.Tensor,
    row_ends: torch.Tensor,
    candidate_block_size: int,
    positions: torch.Tensor,
    live_cols: torch.Tensor,
) -> None:
    """Triton `resolve_candidate_pool` (docs/contract.md section 5.3; arguments validated by the
    wrapper)."""
    rows, pool_blocks = block_ids.shape
    if rows == 0:
        return
    block = next_power_of_2(max(pool_blocks, 2))
    programs = min(rows, POOL_PROGRAMS)
    marks = torch.empty((programs, POOL_MARKS * block), dtype=torch.int8, device=block_ids.device)
    launch(
        _resolve_pool_kernel,
        (programs,),
        block_ids,
        row_ends,
        positions,
        live_cols,
        marks,
        rows,
        block_ids.stride(0),
        positions.stride(0),
        pool_blocks,
        C=candidate_block_size,
        BLOCK=block,
        SENTINEL=INT32_MAX,
        MARKS=POOL_MARKS * block,
        TILE=min(block, POOL_TILE),
        num_warps=4,
    )


def apply_candidate_mask(
    logits: torch.Tensor, positions: torch.Tensor, candidate_block_size: int
) -> None:
    """Triton `apply_candidate_mask` (docs/contract.md section 5.6), in place on `logits`.

    Allocates rows x next_power_of_2(KB) int32 of scratch for the sorted starts.
    """
    rows, width = logits.shape
    if rows == 0 or width == 0:
        return
    starts = next_power_of_2(max(positions.shape[1], 2))
    sorted_starts = torch.empty((rows, starts), dtype=torch.int32, device=logits.device)
    launch(
        _sort_starts_kernel,
        (rows,),
        positions,
        sorted_starts,
        positions.stride(0),
        positions.shape[1],
        BLOCK=starts,
        SENTINEL=INT32_MAX,
        num_warps=4,
    )
    launch(
        _mask_columns_kernel,
        (rows, cdiv(width, MASK_BLOCK)),
        logits,
        sorted_starts,
        logits.stride(0),
        width,
        C=candidate_block_size,
        BLOCK=MASK_BLOCK,
        STARTS=starts,
        LOG2_STARTS=starts.bit_length() - 1,
        num_warps=4,
    )


__all__ = ["apply_candidate_mask", "resolve_candidate_pool"]
