"""In-kernel MXFP4 decoding and paged-cache addressing, shared by every logits kernel.

The byte formulas are those of `graphidx.mxfp4.layout` (its docstring is the source of truth);
this module is their one Triton re-derivation. Launchers pass the layout's fields as
constexprs: D = head_dim, E = page_entries, NPT = n_per_tile, LANES = scale_lanes, and
CHUNKS = next_power_of_2(D // 32): one "chunk" is 16 value bytes = 32 elements = one scale.

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

E8M0_NAN_BYTE = 0xFF


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
def dequantize_chunks(value_bytes, scale_bytes):
    """Decode MXFP4 chunks to float32 `value * 2**-14`, in natural element order.

    value_bytes: int32 `[M, CHUNKS, 16]` (byte i of chunk j holds elements 32j + 2i, low
    nibble, and 32j + 2i + 1, high nibble); scale_bytes: int32 `[M, CHUNKS]`.
    Returns float32 `[M, CHUNKS * 32]`.
    """
    rows: tl.constexpr = value_bytes.shape[0]
    chunks: tl.constexpr = value_bytes.shape[1]
    # An e2m1 code s|eem placed at fp16 bits 15 and 9..11 is exactly value * 2**-14: the
    # fp16 exponent field is `ee`, and ee == 0 is the fp16 subnormal m * 2**-15.
    low = ((value_bytes & 0x7) << 9) | ((value_bytes & 0x8) << 12)
    high = ((value_bytes & 0x70) << 5) | ((value_bytes & 0x80) << 8)
    low = low.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = high.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    factor = e8m0_factor(scale_bytes)[:, :, None]
    pairs = tl.join(low * factor, high * factor)
    return tl.reshape(pairs, [rows, chunks * 32])


@triton.jit
def load_key_tile(
    kv_ptr,
    page_base,
    entry,
    live,
    D: tl.constexpr,
    E: tl.constexpr,
    NPT: tl.constexpr,
    LANES: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """Decode the keys at `(page_base, entry)` of the paged cache: float32 `[M, CHUNKS * 32]`.

    page_base: int64 `[M]`, byte offset of each key's page (page id * page stride); entry:
    int32 `[M]`, its slot in the page; live: bool `[M]`, keys to read (others decode to 0 and
    touch no memory). Each key's 16-byte value chunks are contiguous, so a chunk is one
    vector load.
    """
    tile = entry // NPT
    local = entry % NPT
    scales_per_lane: tl.constexpr = (D // 32) // LANES
    value_base = page_base + (tile * (NPT * (D // 2)) + local * 16)
    scale_base = page_base + (E * (D // 2) + tile * (NPT * (D // 32)) + local * scales_per_lane)
    chunk = tl.arange(0, CHUNKS)
    byte = tl.arange(0, 16)
    chunk_ok = chunk < D // 32
    value_offsets = (chunk * (NPT * 16))[None, :, None] + byte[None, None, :]
    values = tl.load(
        kv_ptr + value_base[:, None, None] + value_offsets,
        mask=live[:, None, None] & chunk_ok[None, :, None],
        other=0,
    ).to(tl.int32)
    scale_offsets = (chunk % LANES) * (NPT * scales_per_lane) + chunk // LANES
    scales = tl.load(
        kv_ptr + scale_base[:, None] + scale_offsets[None, :],
        mask=live[:, None] & chunk_ok[None, :],
        other=127,
    ).to(tl.int32)
    return dequantize_chunks(values, scales)


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
    D: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """Decode query heads `(row[m], head[m])`: float32 `[M, CHUNKS * 32]`, 0 where not live.

    q: uint8 `[rows, H, D/2]`, q_scale: uint8 `[rows, H, D/32]`, last dims contiguous.
    """
    chunk = tl.arange(0, CHUNKS)
    byte = tl.arange(0, 16)
    chunk_ok = chunk < D // 32
    row64 = row.to(tl.int64)
    value_base = row64 * q_row_stride + head * q_head_stride
    values = tl.load(
        q_ptr + value_base[:, None, None] + (chunk * 16)[None, :, None] + byte[None, None, :],
        mask=live[:, None, None] & chunk_ok[None, :, None],
        other=0,
    ).to(tl.int32)
    scale_base = row64 * qs_row_stride + head * qs_head_stride
    scales = tl.load(
        q_scale_ptr + scale_base[:, None] + chunk[None, :],
        mask=live[:, None] & chunk_ok[None, :],
        other=127,
    ).to(tl.int32)
    return dequantize_chunks(values, scales)


@triton.jit
def tile_scores(keys, queries_t, FP32_DOT: tl.constexpr):
    """`keys [M, K] @ queries_t [K, N]` with float32 accumulation.

    On a GPU the operands go to the tensor cores as bf16 (exact for decoded MXFP4); under
    the interpreter (FP32_DOT) they stay float32 with IEEE products, the same numbers.
    """
    if FP32_DOT:
        return tl.dot(keys, queries_t, input_precision="ieee")
    return tl.dot(keys.to(tl.bfloat16), queries_t.to(tl.bfloat16))


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
    lo = 0
    hi = num_seqs - 1
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
    "WEIGHT_RESCALE",
    "dequantize_chunks",
    "e8m0_factor",
    "load_key_tile",
    "load_query_tile",
    "max_propagate_nan",
    "relu_propagate_nan",
    "seq_of_row",
    "tile_scores",
]
