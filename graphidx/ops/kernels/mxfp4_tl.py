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

Decoded values carry a constant factor: an element is produced as `value * 2**-14`
(`DEQUANT_EXPONENT_SHIFT`). That lets one exact hardware conversion (fp16 -> fp32, which
handles the e2m1 subnormal 0.5 correctly) and one multiply by the e8m0 factor do the whole
decode: the e2m1 code is placed in the top of an fp16 whose exponent bias makes it
`value * 2**-14`. A product of a decoded key and a decoded query therefore carries
`2**-28`; kernels multiply their float32 head weights by `WEIGHT_RESCALE = 2**28` once,
which restores exactly the same float32 result (scaling by a power of two commutes with
rounding) unless a partial sum leaves float32's normal range (|x| < 2**-98).

Exactness: every decoded element is an e2m1 value times a power of two, so it is exact in
bf16 (the tensor-core operand) and every product is exact in the float32 accumulator. An
e8m0 byte of 0xFF is NaN and propagates; byte 0 is 2**-127 (subnormal in float32).
"""

from __future__ import annotations

import triton
import triton.language as tl

DEQUANT_EXPONENT_SHIFT = 14
"""Decoded elements are `value * 2**-DEQUANT_EXPONENT_SHIFT`."""

WEIGHT_RESCALE = tl.constexpr(float(2 ** (2 * DEQUANT_EXPONENT_SHIFT)))
"""Multiply head weights by this to undo the factor of a key-query product (a constexpr:
Triton kernels may only read constexpr globals)."""

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
    """Decode a kernel-order tile to float32 `value * 2**-14`: `[M, SUB * RUN * 4 * 2]`.

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
    magnitudes = (value_bytes * 0x00200200) & 0x0E000E00
    signs = (value_bytes * 0x01001000) & -0x7FFF8000  # 0x80008000 as int32
    pair = magnitudes | signs
    low = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    factor = e8m0_factor(scale_bytes)
    pairs = tl.join(low * factor, high * factor)
    return tl.reshape(pairs, [rows, sub * run * 8])


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
def load_key_tile(
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
    """Decode keys `entry` of their pages in the paged cache: float32 `[M, D]`, kernel order.

    page_ptr: uint8 pointer to each key's page (`[M]` pointers), or one scalar pointer when
    the whole tile lies in one page; entry: int32 `[M]`, each key's slot in its page; live:
    bool `[M]`, the keys to read when MASKED (others decode to 0 and touch no memory); with
    MASKED false every key is read.
    """
    # Slots are never negative: unsigned division by the power-of-two tile is a shift.
    slot = entry.to(tl.uint32)
    tile = (slot // NPT).to(tl.int32)
    local = (slot % NPT).to(tl.int32)
    scales_per_lane: tl.constexpr = (D // 32) // LANES
    value_base = page_ptr + (tile * (NPT * (D // 2)) + local * 16)
    scale_base = page_ptr + (E * (D // 2) + tile * (NPT * (D // 32)) + local * scales_per_lane)
    byte, chunk = _kernel_order_bytes(SUB, RUN)
    value_offsets = (byte // 16) * (NPT * 16) + byte % 16
    scale_offsets = (chunk % LANES) * (NPT * scales_per_lane) + chunk // LANES
    value_ptrs = value_base[:, None, None, None] + value_offsets
    scale_ptrs = scale_base[:, None, None, None] + scale_offsets
    if MASKED:
        values = tl.load(value_ptrs, mask=live[:, None, None, None], other=0)
        scales = tl.load(scale_ptrs, mask=live[:, None, None, None], other=127)
    else:
        values = tl.load(value_ptrs)
        scales = tl.load(scale_ptrs)
    return dequantize_tile(values.to(tl.int32), scales.to(tl.int32))


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
def mma_operand(x, FP32_DOT: tl.constexpr):
    """A decoded tile as a tensor-core operand: bf16 on a GPU (exact for decoded MXFP4),
    float32 under the interpreter (whose bf16 dot is unreliable); same numbers either way.
    Convert loop-invariant operands once, outside the key loop."""
    if FP32_DOT:
        return x
    return x.to(tl.bfloat16)


@triton.jit
def tile_scores(keys, queries_t, FP32_DOT: tl.constexpr):
    """`keys [M, K] @ queries_t [K, N]` with float32 accumulation; queries_t from
    `mma_operand`, keys decoded float32."""
    if FP32_DOT:
        return tl.dot(keys, queries_t, input_precision="ieee")
    return tl.dot(keys.to(tl.bfloat16), queries_t)


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
    "DEQUANT_EXPONENT_SHIFT",
    "SUPPORTED_HEAD_DIMS",
    "WEIGHT_RESCALE",
    "dequantize_tile",
    "e8m0_factor",
    "load_key_tile",
    "load_query_tile",
    "max_propagate_nan",
    "mma_operand",
    "relu_propagate_nan",
    "seq_of_row",
    "tile_scores",
    "tile_split",
]
