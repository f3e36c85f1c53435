"""In-kernel MXFP4 decoding and paged-cache addressing, shared by every logits kernel.

The byte formulas are those of `graphidx.mxfp4.layout` (its docstring is the source of truth);
this module is their one Triton re-derivation. Launchers pass the layout's fields as
constexprs: D = head_dim, E = page_entries, NPT = n_per_tile, LANES = scale_lanes.

Element order. A dot product does not care in which order its D terms are summed, as long as
keys and queries use the same order; so tiles are decoded in *kernel order*, chosen to match
how a tensor-core operand is spread over threads. In the MMA operand layout a thread of a
quad (t = lane % 4) holds the element pairs (8j + 2t, 8j + 2t + 1) of its rows; kernel element
8j + 2t + h is therefore mapped to memory byte t * D/8 + j, nibble h. Thread t then owns
D/8 consecutive bytes of each row (one 16-byte chunk and one scale at D = 128): one vector
load, no byte shuffles, and each register pair is one byte's two nibbles. Tiles are built as
`[M, SUB, 16, 4]` (SUB = D / 128, or one half-chunk row `[M, 1, 8, 4]` at D = 64) and
flattened to `[M, D]`; D must be 64, 128 or 256.

Decoding in float32 (`dequantize_tile`): the e2m1 code is placed in the top of an fp16 whose
exponent bias makes it `value * 2**-14`; one exact hardware conversion (fp16 -> fp32, which
handles the e2m1 subnormal 0.5 correctly), a multiply by `2**14` and one by the e8m0 factor
give the value itself. Undoing the `2**-14` before the scale keeps every value exact: with the
factor left in, a query scaled by 2**-120 would fall below bf16's smallest subnormal.

On NVIDIA GPUs (`OPERANDS_BF16X2`) key tiles skip float32 altogether: a byte's two nibbles
are placed into a bf16 pair whose bits read `value * 2**-126` (exponent field `ee`, the
subnormal 0.5 at `ee == 0` again exact), and one packed multiply per factor scales the pair by
`2**(E - 1)`, split in two powers of two that bf16 always holds.

Exactness: every decoded element is an e2m1 value times a power of two, exact in bf16 (the
tensor-core operand, subnormals included: tools/device_subnormals.py checked that neither
`fma.rn.bf16x2` nor the sm_90 tensor cores flush them) and every product is exact in the
float32 accumulator. An e8m0 byte of 0xFF is NaN and propagates; byte 0 is 2**-127.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphidx.ops.kernels import OPERANDS_BF16X2 as _BF16X2_MODE
from graphidx.ops.kernels import OPERANDS_FP32 as _FP32_MODE

FP16_CODE_FACTOR = tl.constexpr(float(2**14))
"""Undoes the `2**-14` of an e2m1 code read as an fp16 (see the module docstring)."""

FP16_PAIR_MAGNITUDES = tl.constexpr((0x00200200, 0x0E000E00))
"""(multiplier, mask) placing a byte's two 3-bit e2m1 magnitudes at fp16 bits 9..11, 25..27."""
BF16_PAIR_MAGNITUDES = tl.constexpr((0x00040040, 0x01C001C0))
"""(multiplier, mask) placing a byte's two 3-bit e2m1 magnitudes at bf16 bits 6..8, 22..24."""
PAIR_SIGNS = tl.constexpr((0x01001000, -0x7FFF8000))
"""(multiplier, mask) placing a byte's two sign bits at bits 15 and 31 (0x80008000): the
sign of both halves of an fp16 or a bf16 pair."""
FP32_OPERANDS = tl.constexpr(_FP32_MODE)
BF16X2_OPERANDS = tl.constexpr(_BF16X2_MODE)
"""graphidx.ops.kernels.OPERANDS_FP32 / OPERANDS_BF16X2 as constexprs for the kernels."""

SUPPORTED_HEAD_DIMS = (64, 128, 256)


def tile_split(head_dim: int) -> tuple[int, int]:
    """(SUB, RUN): a thread's D/8 bytes per row as SUB runs of RUN <= 16 contiguous bytes."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"the triton backend supports head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}"
        )
    per_thread = head_dim // 8
    return max(1, per_thread // 16), min(16, per_thread)


@triton.jit
def e8m0_factor(scale_bytes):
    """float32 `2**(byte - 127)` for int32 scale bytes; 0xFF is NaN, 0 is 2**-127."""
    bits = tl.where(
        scale_bytes == 255,
        0x7FC00000,
        tl.where(scale_bytes == 0, 0x00400000, scale_bytes << 23),
    )
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dequantize_tile(value_bytes, scale_bytes):
    """Decode a kernel-order tile to float32 values: `[M, SUB * RUN * 4 * 2]`.

    value_bytes: int32 `[M, SUB, RUN, 4]`; scale_bytes: int32 `[M, SUB, 1, 4]` (the scale
    of each thread group's run). Element (m, s, j, t, h) is nibble h of that byte.
    """
    rows: tl.constexpr = value_bytes.shape[0]
    sub: tl.constexpr = value_bytes.shape[1]
    run: tl.constexpr = value_bytes.shape[2]
    # An e2m1 code s|eem placed at fp16 bits 15 and 9..11 is exactly value * 2**-14: the
    # fp16 exponent field is `ee`, and ee == 0 is the fp16 subnormal m * 2**-15. With a
    # byte b = s1 m1 s0 m0 (m: 3 bits), b * (2**9 + 2**21) is a sum of copies of its fields
    # at disjoint bit ranges (no carries) that puts m0 at bits 9..11 and m1 at 25..27 of an
    # fp16 pair; b * (2**12 + 2**24) puts s0 at bit 15 and s1 at bit 31. Masks keep those.
    magnitudes = (value_bytes * FP16_PAIR_MAGNITUDES[0]) & FP16_PAIR_MAGNITUDES[1]
    signs = (value_bytes * PAIR_SIGNS[0]) & PAIR_SIGNS[1]
    pair = magnitudes | signs
    low = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    factor = e8m0_factor(scale_bytes)
    pairs = tl.join((low * FP16_CODE_FACTOR) * factor, (high * FP16_CODE_FACTOR) * factor)
    return tl.reshape(pairs, [rows, sub * run * 8])


@triton.jit
def bf16x2_pair_bits(value_bytes, scale_bytes):
    """The integer half of `dequantize_keys_bf16x2` (the part the interpreter can run):
    int32 (pair, low factors, high factors), element-wise over value bytes and their scale
    bytes. `pair` holds a byte's two codes as a bf16 pair reading `value * 2**-126`; the
    factors are bf16 pairs of powers of two whose product is `2**(E - 1)` (NaN at E = 255).
    """
    # A byte b = s1 m1 s0 m0 times (2**6 + 2**18) puts m0 at bits 6..8 and m1 at 22..24, times
    # (2**12 + 2**24) puts s0 at bit 15 and s1 at bit 31 (copies never overlap, so no carries):
    # a bf16 pair whose exponent fields are the codes' `ee`, each element `value * 2**-126`.
    magnitudes = (value_bytes * BF16_PAIR_MAGNITUDES[0]) & BF16_PAIR_MAGNITUDES[1]
    signs = (value_bytes * PAIR_SIGNS[0]) & PAIR_SIGNS[1]
    # Scale by 2**(E - 1) = 2**low * 2**high, low = floor((E - 1) / 2) in [-1, 126], high in
    # [0, 127]: both factors are normal bf16, and the intermediate (>= 2**-128) stays exact.
    shift = scale_bytes - 1
    low = shift >> 1
    low_bits = (low + 127) << 7
    high_bits = tl.where(scale_bytes == 255, 0x7FC0, (shift - low + 127) << 7)
    return magnitudes | signs, low_bits | (low_bits << 16), high_bits | (high_bits << 16)


@triton.jit
def dequantize_keys_bf16x2(value_bytes, scale_bytes):
    """Decode a kernel-order tile straight to bf16 `value * 2**(E - 127)`: `[M, SUB * RUN * 8]`.

    Same arguments, element order and values as `dequantize_tile`. NVIDIA only
    (inline PTX `fma.rn.bf16x2`, sm_80+). E = 255 gives NaN, E = 0 bf16 subnormals.
    """
    rows: tl.constexpr = value_bytes.shape[0]
    sub: tl.constexpr = value_bytes.shape[1]
    run: tl.constexpr = value_bytes.shape[2]
    pair, low_factors, high_factors = bf16x2_pair_bits(value_bytes, scale_bytes)
    pair = tl.inline_asm_elementwise(
        "{ .reg .b32 nz, t; mov.b32 nz, 0x80008000; "
        "fma.rn.bf16x2 t, $1, $2, nz; fma.rn.bf16x2 $0, t, $3, nz; }",
        "=r,r,r,r",
        [pair, low_factors, high_factors],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )
    first = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)
    second = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(first, second), [rows, sub * run * 8])


@triton.jit
def _kernel_order_bytes(SUB: tl.constexpr, RUN: tl.constexpr):
    """Memory byte (within an entry) and its chunk for every (s, j, t) of a kernel-order tile.

    Returns int32 `[1, SUB, RUN, 4]` byte indices and `[1, SUB, 1, 4]` chunk indices.
    """
    s = tl.arange(0, SUB)[None, :, None, None]
    j = tl.arange(0, RUN)[None, None, :, None]
    t = tl.arange(0, 4)[None, None, None, :]
    first = t * (SUB * RUN) + s * RUN  # first byte of the thread group's run
    return first + j, first // 16


@triton.jit
def _entry_offsets(entry, byte, chunk, D: tl.constexpr, E: tl.constexpr,
                   NPT: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
    """Byte offsets within a page (graphidx.mxfp4.layout): ((value, scale) parts of each
    entry slot, (value, scale) parts of each kernel-order byte / chunk); add a part of each
    kind to the page pointer. Shapes broadcast like the arguments."""
    # Slots are never negative: unsigned division by the power-of-two tile is a shift.
    slot = entry.to(tl.uint32)
    tile = (slot // NPT).to(tl.int32)
    local = (slot % NPT).to(tl.int32)
    scales_per_lane: tl.constexpr = (D // 32) // LANES
    entry_value = tile * (NPT * (D // 2)) + local * 16
    entry_scale = E * (D // 2) + tile * (NPT * (D // 32)) + local * scales_per_lane
    byte_value = (byte // 16) * (NPT * 16) + byte % 16
    chunk_scale = (chunk % LANES) * (NPT * scales_per_lane) + chunk // LANES
    return entry_value, entry_scale, byte_value, chunk_scale


@triton.jit
def key_tile_bytes(
    page_ptr,
    entry,
    live,
    D: tl.constexpr,
    E: tl.constexpr,
    NPT: tl.constexpr,
    LANES: tl.constexpr,
    SUB: tl.constexpr,
    RUN: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Load the raw bytes of keys `entry` of their pages, kernel order: uint8 values
    `[M, SUB, RUN, 4]` and scales `[M, SUB, 1, 4]` (decode with `decode_key_tile`).

    page_ptr: uint8 pointer to each key's page (`[M]` pointers), or one scalar pointer when
    the whole tile lies in one page; entry: int32 `[M]`, each key's slot in its page; live:
    bool `[M]`, the keys to read when MASKED (others read as value 0, scale 127 and touch no
    memory); with MASKED false every key is read.
    """
    byte, chunk = _kernel_order_bytes(SUB, RUN)
    entry_value, entry_scale, byte_value, chunk_scale = _entry_offsets(
        entry, byte, chunk, D, E, NPT, LANES
    )
    value_ptrs = (page_ptr + entry_value)[:, None, None, None] + byte_value
    scale_ptrs = (page_ptr + entry_scale)[:, None, None, None] + chunk_scale
    if MASKED:
        values = tl.load(value_ptrs, mask=live[:, None, None, None], other=0)
        scales = tl.load(scale_ptrs, mask=live[:, None, None, None], other=127)
    else:
        values = tl.load(value_ptrs)
        scales = tl.load(scale_ptrs)
    return values, scales


@triton.jit
def mma_tile_rows(BLOCK_N: tl.constexpr):
    """Tile row of every (g, w, p, r) in `key_tile_bytes_mma`'s index space: int32
    `[1, 8, 4, BLOCK_N // 64, 2, 1, 1]`, row m = g + 8 r + 16 w + 64 p."""
    g = tl.arange(0, 8)[None, :, None, None, None, None, None]
    w = tl.arange(0, 4)[None, None, :, None, None, None, None]
    p = tl.arange(0, BLOCK_N // 64)[None, None, None, :, None, None, None]
    r = tl.arange(0, 2)[None, None, None, None, :, None, None]
    return g + 8 * r + 16 * w + 64 * p


@triton.jit
def key_tile_bytes_mma(
    page_ptr,
    entry,
    live,
    D: tl.constexpr,
    E: tl.constexpr,
    NPT: tl.constexpr,
    LANES: tl.constexpr,
    SUB: tl.constexpr,
    RUN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """`key_tile_bytes` for a tile of BLOCK_N keys (a multiple of 64), loaded straight in the
    thread layout of a 4-warp (one warpgroup) tensor-core A operand, so the decoded tile needs
    no shuffle through shared memory.

    page_ptr, entry, live: each tile row's page (uint8 pointer), slot in it (int32) and
    whether to read it (MASKED only), indexed like `mma_tile_rows(BLOCK_N)` (or scalars).

    In that layout a key row m = g + 8 r + 16 w + 64 p sits in lane 4 g + t of warp w
    (register r, repetition p), and lane t holds the row's bytes t * D/8 ... (kernel order).
    The loads are built as `[t, g, w, p, r, SUB, RUN]`: Triton lays a load's threads along
    its dimensions in order of contiguity, ties in dimension order, so lanes go to t then g
    and warps to w, as the operand wants; a permute and a reshape (no data movement) then
    give the `[BLOCK_N, SUB, RUN, 4]` tile.
    """
    t = tl.arange(0, 4)[:, None, None, None, None, None, None]
    s = tl.arange(0, SUB)[None, None, None, None, None, :, None]
    j = tl.arange(0, RUN)[None, None, None, None, None, None, :]
    first = t * (SUB * RUN) + s * RUN  # first byte of the lane's run (as _kernel_order_bytes)
    entry_value, entry_scale, byte_value, chunk_scale = _entry_offsets(
        entry, first + j, first // 16, D, E, NPT, LANES
    )
    value_ptrs = page_ptr + (entry_value + byte_value)
    scale_ptrs = page_ptr + (entry_scale + chunk_scale)
    if MASKED:
        values = tl.load(value_ptrs, mask=live, other=0)
        scales = tl.load(scale_ptrs, mask=live, other=127)
    else:
        values = tl.load(value_ptrs)
        scales = tl.load(scale_ptrs)
    # [t, g, w, p, r, s, j] -> [p, w, r, g, s, j, t] -> rows m = ((p * 4 + w) * 2 + r) * 8 + g.
    values = tl.reshape(tl.permute(values, (3, 2, 4, 1, 5, 6, 0)), [BLOCK_N, SUB, RUN, 4])
    scales = tl.reshape(tl.permute(scales, (3, 2, 4, 1, 5, 6, 0)), [BLOCK_N, SUB, 1, 4])
    return values, scales


@triton.jit
def decode_key_tile(values, scales, OPERANDS: tl.constexpr):
    """Keys from `key_tile_bytes` or `key_tile_bytes_mma`: `[M, D]` in kernel order, bf16 from
    `dequantize_keys_bf16x2` under OPERANDS_BF16X2, else float32 from `dequantize_tile`."""
    if OPERANDS == BF16X2_OPERANDS:
        keys = dequantize_keys_bf16x2(values.to(tl.int32), scales.to(tl.int32))
    else:
        keys = dequantize_tile(values.to(tl.int32), scales.to(tl.int32))
    return keys


@triton.jit
def load_query_tile(
    q_ptr,
    q_scale_ptr,
    row,
    head,
    live,
    q_row_stride,
    q_head_stride,
    qs_row_stride,
    qs_head_stride,
    SUB: tl.constexpr,
    RUN: tl.constexpr,
):
    """Decode query heads `(row[m], head[m])`: float32 `[M, D]` in kernel order, 0 where not
    live. q: uint8 `[rows, H, D/2]`, q_scale: uint8 `[rows, H, D/32]`, last dims contiguous.
    """
    byte, chunk = _kernel_order_bytes(SUB, RUN)
    row64 = row.to(tl.int64)
    value_base = row64 * q_row_stride + head * q_head_stride
    values = tl.load(
        q_ptr + value_base[:, None, None, None] + byte,
        mask=live[:, None, None, None],
        other=0,
    )
    scale_base = row64 * qs_row_stride + head * qs_head_stride
    scales = tl.load(
        q_scale_ptr + scale_base[:, None, None, None] + chunk,
        mask=live[:, None, None, None],
        other=127,
    )
    return dequantize_tile(values.to(tl.int32), scales.to(tl.int32))


@triton.jit
def mma_operand(x, OPERANDS: tl.constexpr):
    """A decoded tile as a tensor-core operand: bf16 on a GPU (exact for decoded MXFP4),
    float32 under the interpreter (whose bf16 dot is unreliable); same numbers either way.
    Convert loop-invariant operands once, outside the key loop."""
    if OPERANDS == FP32_OPERANDS:  # noqa: SIM108 (a constexpr branch: one side compiles)
        operand = x
    else:
        operand = x.to(tl.bfloat16)
    return operand


@triton.jit
def tile_scores(keys, queries_t, OPERANDS: tl.constexpr):
    """`keys [M, K] @ queries_t [K, N]` with float32 accumulation; queries_t from
    `mma_operand`, keys from `decode_key_tile` with the same OPERANDS."""
    if OPERANDS == FP32_OPERANDS:
        scores = tl.dot(keys, queries_t, input_precision="ieee")
    else:
        scores = tl.dot(keys.to(tl.bfloat16), queries_t)
    return scores


@triton.jit
def relu_propagate_nan(x):
    """max(x, 0) that keeps NaN (a NaN scale must reach the logits, as in the reference)."""
    return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_propagate_nan(a, b):
    """Combine function of a NaN-propagating max reduction (torch.amax semantics)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def seq_of_row(row, qsl_ptr, num_seqs):
    """The seq s with qsl[s] <= row < qsl[s + 1] (largest s with qsl[s] <= row).

    Binary search over the non-decreasing `query_start_loc`; empty seqs are skipped because
    the largest such s always has qsl[s + 1] > row.
    """
    # Tensors from the start: the loop carries them (num_seqs may arrive as a constant).
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(qsl_ptr + mid)
        if start <= row:
            lo = mid
        else:
            hi = mid - 1
    return lo


__all__ = [
    "BF16_PAIR_MAGNITUDES",
    "FP16_CODE_FACTOR",
    "FP16_PAIR_MAGNITUDES",
    "PAIR_SIGNS",
    "SUPPORTED_HEAD_DIMS",
    "bf16x2_pair_bits",
    "decode_key_tile",
    "dequantize_keys_bf16x2",
    "dequantize_tile",
    "e8m0_factor",
    "key_tile_bytes",
    "key_tile_bytes_mma",
    "load_query_tile",
    "max_propagate_nan",
    "mma_operand",
    "mma_tile_rows",
    "relu_propagate_nan",
    "seq_of_row",
    "tile_scores",
    "tile_split",
]
