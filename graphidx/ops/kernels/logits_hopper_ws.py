"""UNTESTED PROTOTYPE (compiled for sm_90 offline only, never run): warp-specialized decode.

A producer warpgroup (worker partition) loads and decodes each 64-key tile into a ring of
NBUF shared-memory stages (the wgmma A operand, K-major, 128-byte swizzle) and signals it
through an mbarrier; the consumer warpgroup (default partition) waits for the stage, runs
one async MMA per row against Q^T in shared memory, releases the stage and runs the
epilogue, so decode and MMA + epilogue overlap across the two partitions. Element order is
*run order* (`_decode_rows`), not mxfp4_tl's kernel order; Q is decoded to match.

Offline SASS (Triton 3.6, sm_90, H64, maxnreg 128: 2 programs of 8 warps per SM by
registers, 64 KB shared memory each): producer loop 278 instructions per warp and tile
(8 STS.128), consumer loop 249 (16 HGMMA); no spills. To check on a GPU first: mbarrier
arrive counts (one arrival per partition is assumed), the named barrier inside the producer,
the phases, and results against the Triton kernel (tools/device_gluon_decode.py).

The rest of the original module docstring follows.

The Triton kernel (graphidx.ops.kernels.logits) waits for each tile's MMA before it does
anything else, so a program's decode and epilogue never overlap its own MMAs. Here the
wgmma is issued asynchronously (`warpgroup_mma(..., is_async=True)`) and waited for only
when its result is needed.

Same inputs, element order (mxfp4_tl's kernel order) and results as `_logits_static_kernel`
for native decode: one program per (seq, SPLIT keys); the seq's two rows x H heads are
the N = 2 * H columns, split in two MMAs (one per row) of N = H; keys are the M dimension,
64 per tile, decoded straight into the wgmma A-operand registers.
"""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from graphidx.config import cdiv
from graphidx.mxfp4 import cache_layout
from graphidx.ops.kernels import next_power_of_2
from graphidx.ops.kernels.logits import DECODE_SPLIT_KEYS
from graphidx.ops.kernels.mxfp4_tl import cache_words

BLOCK_N = gl.constexpr(64)


@gluon.constexpr_function
def _word_layout():
    """[64 keys m, 4 quad lanes t, 4 words ww] int32: the words lane t of the wgmma A operand
    decodes (kernel order: lane t owns bytes 16 t .. 16 t + 15 of a key); key m = g + 8 r +
    16 w sits in lane 4 g + t of warp w, register r."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[64, 4, 4],
    )


@gluon.constexpr_function
def _mma_layout(columns):
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, 16]
    )


@gluon.constexpr_function
def _query_smem_layout(columns):
    """Q^T [D, columns] bf16, columns contiguous, swizzled for the wgmma B operand."""
    return gl.NVMMASharedLayout(
        swizzle_byte_width=min(128, 2 * columns), element_bitwidth=16, rank=2
    )


@gluon.jit
def _tile_words(page_ptr, first, D: gl.constexpr, E: gl.constexpr, NPT: gl.constexpr,
                LANES: gl.constexpr):  # fmt: skip
    """Codes (int32 [64, 4, 4]) and scale bytes (int32 [64, 4, 1]) of page slots first ..
    first + 63, in `_word_layout` (graphidx.mxfp4.layout offsets, as mxfp4_tl)."""
    WL: gl.constexpr = _word_layout()
    m = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
    ww = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
    slot = first + m
    tile = slot // NPT
    local = slot % NPT
    SPL: gl.constexpr = (D // 32) // LANES
    entry_words = tile * (NPT * (D // 8)) + local * 4
    entry_scale = E * (D // 2) + tile * (NPT * (D // 32)) + local * SPL
    words = gl.load(page_ptr + (entry_words[:, None, None] + t[None, :, None] * (NPT * 4)
                                + ww[None, None, :]))  # fmt: skip
    chunk_scale = (t % LANES) * (NPT * SPL) + t // LANES
    byte_ptr = page_ptr.to(gl.pointer_type(gl.uint8), bitcast=True)
    scales = gl.load(byte_ptr + (entry_scale[:, None, None] + chunk_scale[None, :, None]))
    return words, scales.to(gl.int32)


@gluon.jit
def _bf16_pairs(pairs, scales):
    """Nibble pairs (bits 0..3 and 16..19) scaled by their e8m0 bytes: bf16 pairs as int32,
    exactly as mxfp4_tl.dequantize_keys_bf16x2."""
    codes = (pairs * 0x1040) & -0x7E3F7E40
    shift = scales - 1
    low = shift >> 1
    low_bits = (low + 127) << 7
    high_bits = gl.where(scales == 255, 0x7FC0, (shift - low + 127) << 7)
    return gl.inline_asm_elementwise(
        "{ .reg .b32 nz, t; mov.b32 nz, 0x80008000; "
        "fma.rn.bf16x2 t, $1, $2, nz; fma.rn.bf16x2 $0, t, $3, nz; }",
        "=r,r,r,r",
        [codes, low_bits | (low_bits << 16), high_bits | (high_bits << 16)],
        dtype=gl.int32,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _decode_rows(words, scales):
    """The tile as bf16 [64, 128] in *run order*: element k = 32 t + 8 ww + 2 i + h (nibble i
    of half h of word ww of lane t's 16 bytes), so each thread holds 32 consecutive k of
    each of its keys (16-byte shared-memory stores)."""
    p0 = _bf16_pairs(words & 0x000F000F, scales)
    p1 = _bf16_pairs((words >> 4) & 0x000F000F, scales)
    p2 = _bf16_pairs((words >> 8) & 0x000F000F, scales)
    p3 = _bf16_pairs((words >> 12) & 0x000F000F, scales)
    pairs = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [m, t, ww, i % 2, i // 2]
    first = (pairs & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    second = (pairs >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    keys = gl.permute(gl.join(first, second), (0, 1, 2, 4, 3, 5))  # m, t, ww, i1, i0, h
    return gl.reshape(keys, (64, 128))


@gluon.jit
def _query_run_order(q_ptr, q_scale_ptr, row, q_row_stride, q_head_stride, qs_row_stride,
                     qs_head_stride, H: gl.constexpr, HP: gl.constexpr, D: gl.constexpr):  # fmt: skip
    """Q^T [D, HP] bf16 of one row in run order (`_decode_rows`)."""
    QL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    k = gl.arange(0, D, layout=gl.SliceLayout(1, QL))[:, None]
    head = gl.arange(0, HP, layout=gl.SliceLayout(0, QL))[None, :]
    live = head < H
    t = k // 32
    ww = (k % 32) // 8
    i = (k % 8) // 2
    half = k % 2
    byte = t * 16 + 4 * ww + 2 * half + i // 2
    base = row.to(gl.int64) * q_row_stride + head * q_head_stride
    raw = gl.load(q_ptr + base + byte, mask=live, other=0).to(gl.int32)
    code = (raw >> (4 * (i % 2))) & 0xF
    ee = (code >> 1) & 3
    frac = 0.5 * (code & 1).to(gl.float32)
    power = ((ee + 126) << 23).to(gl.float32, bitcast=True)
    mag = gl.where(ee == 0, frac, power * (1.0 + frac))
    value = gl.where((code & 8) != 0, -mag, mag)
    scale_base = row.to(gl.int64) * qs_row_stride + head * qs_head_stride
    e = gl.load(q_scale_ptr + scale_base + t, mask=live, other=127).to(gl.int32)
    bits = gl.where(e == 255, 0x7FC00000, gl.where(e == 0, 0x00400000, e << 23))
    return (value * bits.to(gl.float32, bitcast=True)).to(gl.bfloat16)


@gluon.jit
def _head_sum(acc, weights):
    scores = gl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL) * weights[None, :]
    return gl.sum(scores, axis=1)


@gluon.jit
def _producer(kv_ptr, block_row, page_stride, key_start, key_stop, ring, ready, empty,
              D: gl.constexpr, E: gl.constexpr, NPT: gl.constexpr, LANES: gl.constexpr,
              NBUF: gl.constexpr):  # fmt: skip
    """Worker partition (4 warps): decode each tile into ring stage t % NBUF once the
    consumer has released it, then signal it ready. ASSUMPTIONS TO CHECK ON A GPU: arrive
    counts once per partition; thread_barrier syncs this partition's warps only."""
    # The next tile's codes load while this one decodes, the page after that's one tile
    # earlier still (the loads are unmasked: a partial last tile reads its page's remaining
    # slots, which exist, as the Triton kernel's prefetch does).
    last_start = key_start + (key_stop - 1 - key_start) // 64 * 64
    page = gl.load(block_row + key_start // E)
    words, scales = _tile_words(kv_ptr + page.to(gl.int64) * page_stride, key_start % E,
                                D, E, NPT, LANES)  # fmt: skip
    page = gl.load(block_row + gl.minimum(key_start + 64, last_start) // E)
    count = 0
    for tile_start in range(key_start, key_stop, 64):
        ahead = gl.minimum(tile_start + 64, last_start)
        next_words, next_scales = _tile_words(kv_ptr + page.to(gl.int64) * page_stride,
                                              ahead % E, D, E, NPT, LANES)  # fmt: skip
        page = gl.load(block_row + gl.minimum(tile_start + 128, last_start) // E)
        keys = _decode_rows(words, scales)
        stage = count % NBUF
        if count >= NBUF:
            mbarrier.wait(empty.index(stage), ((count // NBUF) - 1) & 1)
        ring.index(stage).store(keys)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index(stage))
        words, scales = next_words, next_scales
        count += 1


@gluon.jit
def _consumer(out_ptr, out_row_stride, row_a, len_a, len_b, w_a, w_b, q_a, q_b, key_start,
              key_stop, ring, ready, empty, HP: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
    """Default partition (4 warps): per tile, wait for its stage, two async MMAs (one per
    row), release the stage, then the epilogue."""
    MMA: gl.constexpr = _mma_layout(HP)
    zero = gl.zeros([64, HP], gl.float32, layout=MMA)
    lane_key = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    count = 0
    for tile_start in range(key_start, key_stop, 64):
        stage = count % NBUF
        mbarrier.wait(ready.index(stage), (count // NBUF) & 1)
        keys = ring.index(stage)
        acc_a = warpgroup_mma(keys, q_a, zero, use_acc=False, is_async=True)
        acc_b = warpgroup_mma(keys, q_b, zero, use_acc=False, is_async=True)
        acc_a, acc_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
        mbarrier.arrive(empty.index(stage))
        key = tile_start + lane_key
        out_a = out_ptr + row_a.to(gl.int64) * out_row_stride + key
        gl.store(out_a, _head_sum(acc_a, w_a), mask=key < len_a)
        gl.store(out_a + out_row_stride, _head_sum(acc_b, w_b), mask=key < len_b)
        count += 1


@gluon.jit
def _ws_decode_kernel(
    q_ptr, q_scale_ptr, kv_ptr, w_ptr, ctx_ptr, bt_ptr, row_ends_ptr, out_ptr,
    q_row_stride, q_head_stride, qs_row_stride, qs_head_stride, page_stride, w_row_stride,
    bt_row_stride, out_row_stride, width,
    H: gl.constexpr, HP: gl.constexpr, D: gl.constexpr, E: gl.constexpr, NPT: gl.constexpr,
    LANES: gl.constexpr, SPLIT: gl.constexpr, NBUF: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    seq = gl.program_id(0)
    key_start = gl.program_id(1) * SPLIT
    row_a = seq * 2
    context = gl.load(ctx_ptr + seq)
    len_a = gl.maximum(gl.minimum(gl.minimum(gl.load(row_ends_ptr + row_a), context), width), 0)
    len_b = gl.maximum(gl.minimum(gl.minimum(gl.load(row_ends_ptr + row_a + 1), context), width), 0)
    key_stop = gl.minimum(key_start + SPLIT, gl.maximum(len_a, len_b))
    if key_start < key_stop:
        MMA: gl.constexpr = _mma_layout(HP)
        B_LAYOUT: gl.constexpr = _query_smem_layout(HP)
        A_LAYOUT: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2
        )
        strides = (q_row_stride, q_head_stride, qs_row_stride, qs_head_stride)
        q_a = gl.allocate_shared_memory(gl.bfloat16, [D, HP], B_LAYOUT,
                                        _query_run_order(q_ptr, q_scale_ptr, row_a, *strides, H, HP, D))  # fmt: skip
        q_b = gl.allocate_shared_memory(gl.bfloat16, [D, HP], B_LAYOUT,
                                        _query_run_order(q_ptr, q_scale_ptr, row_a + 1, *strides, H, HP, D))  # fmt: skip
        ring = gl.allocate_shared_memory(gl.bfloat16, [NBUF, 64, D], A_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NBUF):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        head = gl.arange(0, HP, layout=gl.SliceLayout(0, MMA))
        w_a = gl.load(w_ptr + row_a.to(gl.int64) * w_row_stride + head, mask=head < H, other=0.0)
        w_b = gl.load(w_ptr + (row_a + 1).to(gl.int64) * w_row_stride + head, mask=head < H,
                      other=0.0)  # fmt: skip
        block_row = bt_ptr + seq.to(gl.int64) * bt_row_stride
        gl.warp_specialize(
            [
                (_consumer, (out_ptr, out_row_stride, row_a, len_a, len_b, w_a, w_b, q_a, q_b,
                             key_start, key_stop, ring, ready, empty, HP, NBUF)),
                (_producer, (kv_ptr, block_row, page_stride, key_start, key_stop, ring, ready,
                             empty, D, E, NPT, LANES, NBUF)),
            ],
            [4],
            [PRODUCER_REGS],
        )  # fmt: skip


def decode_logits(q, q_scale, kv_cache, weights, context_lens, block_table, row_ends, out, *,
                  page_entries, nbuf=2, producer_regs=96, max_registers=128):  # fmt: skip
    """Launch `_ws_decode_kernel` (next_n = 2, D = 128, page_entries % 64 == 0)."""
    rows, num_heads, value_bytes = q.shape
    head_dim = 2 * value_bytes
    layout = cache_layout(num_heads, head_dim, page_entries)
    kv_words = cache_words(kv_cache)
    width = out.shape[1]
    grid = (rows // 2, cdiv(width, DECODE_SPLIT_KEYS))
    _ws_decode_kernel[grid](
        q, q_scale, kv_words, weights, context_lens, block_table, row_ends, out,
        q.stride(0), q.stride(1), q_scale.stride(0), q_scale.stride(1), kv_words.stride(0),
        weights.stride(0), block_table.stride(0), out.stride(0), width,
        H=num_heads, HP=max(next_power_of_2(num_heads), 16), D=head_dim,
        E=layout.page_entries, NPT=layout.n_per_tile, LANES=layout.scale_lanes,
        SPLIT=DECODE_SPLIT_KEYS, NBUF=nbuf, PRODUCER_REGS=producer_regs, num_warps=4,
        maxnreg=max_registers,
    )  # fmt: skip
