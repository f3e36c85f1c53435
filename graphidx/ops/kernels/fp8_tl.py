"""e4m3 tensor-core operands from MXFP4 codes: the `fp8` precision of the logits kernels
(docs/contract.md section 5, "Precision").

Every e2m1 value times a power of two 2**s with -5 <= s <= 6 is a normal e4m3 number, so a
row of D/32 blocks with exponents E_b is held exactly as e4m3 values `code * 2**(E_b - B +
6)` times one factor `2**(B - 133)` whenever every E_b lies in [B - FP8_EXPONENT_SPREAD, B].
The MMA then multiplies exact operands; the factors are applied after the ReLU, which
commutes with a positive factor.
- Query heads (`fp8_operand`, `fp8_queries`): B is the head's largest exponent over its
  blocks with a nonzero code, and the head's factor is folded into its weight.
- Keys (`fp8_keys`): B is one reference for a whole walk over key tiles
  (`fp8_key_reference`, from its first tile), so the factor is one scalar and a tile needs
  no per-key exponent reduction; the walk records the span of exponents it met
  (`fp8_key_span`) and `fp8_keys_held` says afterwards whether all were inside the window.
A scale byte of 0xFF (NaN) makes a head's factor NaN, as the exact path's decode does, and
puts a key outside every window.

Element order. The e4m3 A operand of a one-warpgroup MMA holds, in lane t of a quad, four
consecutive k per register: k = 32 c + 16 h + 4 t + i (register h of chunk c, byte i). A
thread of the MXFP4 kernel order (see `mxfp4_tl`) owns its words in the same lanes, so word
c of thread t becomes the two registers of chunk c: nibble 4 h + i -> byte i of register h.
That is element `32 c + 16 h + 4 t + i` here and element `32 c + 8 i + 2 t + h` in the bf16
kernel order (`fp8_order` permutes a bf16-order tile to this one): the same nibble, so keys
and queries built by the same functions always agree.

The lookup (`fp8_code_words`): the 8 magnitudes of a code, scaled, are 8 bytes — two words
(`fp8_tables`); on NVIDIA one `prmt` per 4 codes picks them and a second `prmt` in its
sign-replicating mode recovers the signs; elsewhere (the interpreter) the same bytes come
from shifts.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphidx.ops.kernels.mxfp4_tl import e8m0_factor

FP8_EXPONENT_SPREAD = tl.constexpr(11)
"""Widest spread (largest minus smallest) of block exponents that e4m3 operands hold exactly:
of a query head's blocks with a nonzero code, or of a key walk's blocks (all of them)
below its reference."""
FP8_TABLE_BASES = tl.constexpr((0x0C080000, 0x1C181410))
FP8_TABLE_STEPS = tl.constexpr((0x08080800, 0x08080808))
"""Tables of `fp8_tables`: byte m holds the e4m3 bits of e2m1 magnitude m times 2**(k - 6) as
base + k * step (k in [1, 12]; the exponent field grows by k, magnitude 0 stays 0)."""
MAGNITUDES = tl.constexpr(0x77777777)
"""The magnitude bits of the 8 codes of a word (a code's sign is its bit 3)."""
FP8_FACTOR_SHIFT = tl.constexpr(2.0**-6)
"""`2**(B - 133)` is `e8m0_factor(B) * FP8_FACTOR_SHIFT`, exact in float32 for B in [0, 254]."""


FP8_WEIGHT_RANGE = tl.constexpr((2.0**-100, 2.0**90))
"""Magnitudes of a head's weight times its e4m3 factor that the fp8 path takes (besides 0,
inf and NaN, which it handles as the exact path does): inside it a row's weighted sum of
ReLU'd e4m3 scores (each at most 384**2 * D, 2**31.2 over 256 heads at D = 256) neither
overflows nor loses bits to float32 subnormals."""
LARGEST_HELD_SCALE = tl.constexpr(252)
"""Above it (253, 254) the exact decode of a large code overflows float32 to inf; such rows
take the exact path, so the fp8 mode gives the same inf / NaN. A query head with a 255 (NaN)
scale is held (its factor is NaN); a key walk's reference is at most this, so keys with
253-255 are never held and the walk is rescored exactly."""


@triton.jit
def fp8_tables(shift):
    """(low, high) int32 tables for `fp8_code_words`: 8 bytes, byte m the e4m3 bits of e2m1
    magnitude m times 2**(shift - 6); shift int32 in [1, 12] (all normal, at most 384)."""
    return (
        FP8_TABLE_BASES[0] + shift * FP8_TABLE_STEPS[0],
        FP8_TABLE_BASES[1] + shift * FP8_TABLE_STEPS[1],
    )


@triton.jit
def _portable_code_bytes(words, low, high, FIRST: tl.constexpr):
    """`fp8_code_words`' register for nibbles FIRST .. FIRST + 3, with shifts only."""
    out = tl.zeros_like(words)
    for i in tl.static_range(4):
        code = (words >> (4 * (FIRST + i))) & 0xF
        magnitude = code & 7
        table = tl.where(magnitude < 4, low, high)
        byte = (table >> (8 * (magnitude & 3))) & 0x7F
        byte = byte | ((code & 8) << 4)
        out = out | (byte << (8 * i))
    return out


@triton.jit
def fp8_code_words(words, low, high, PTX: tl.constexpr):
    """The 8 codes of each int32 word as e4m3 bytes: (register 0, register 1), int32 each,
    byte i of register h the code at nibble 4 h + i. Magnitudes are looked up in the tables
    (`fp8_tables`, broadcast against words), signs kept (-0 for a negative zero code)."""
    if PTX:
        # The tables' bytes with the sign bit set give every magnitude as a negative number;
        # a sign-replicating prmt of 0x01 bytes gives 1 where the code is positive (0 where
        # negative), and subtracting 0x80 times it clears the sign bit there: one mad.
        first, second = tl.inline_asm_elementwise(
            "{ .reg .b32 s, m, n, one, w, lo, hi;"
            " mov.b32 one, 0x01010101;"
            " or.b32 lo, $3, 0x80808080; or.b32 hi, $4, 0x80808080;"
            " and.b32 s, $2, 0x7777; prmt.b32 m, lo, hi, s;"
            " prmt.b32 n, one, one, $2; mad.lo.u32 $0, n, 0xFFFFFF80, m;"
            " shr.u32 w, $2, 16;"
            " and.b32 s, w, 0x7777; prmt.b32 m, lo, hi, s;"
            " prmt.b32 n, one, one, w; mad.lo.u32 $1, n, 0xFFFFFF80, m; }",
            "=r,=r,r,r,r",
            [words, low, high],
            dtype=(tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    else:
        first = _portable_code_bytes(words, low, high, 0)
        second = _portable_code_bytes(words, low, high, 4)
    return first, second


@triton.jit
def _word_bytes(x):
    """int32 `[...]` -> int8 `[..., 4]`, byte i of each word at index i."""
    return tl.join(
        tl.join(x.to(tl.int8), (x >> 16).to(tl.int8)),
        tl.join((x >> 8).to(tl.int8), (x >> 24).to(tl.int8)),
    )


@triton.jit
def fp8_tile(first, second):
    """Registers of `fp8_code_words` for words `[M, SUB, W, 4]` -> e4m3 `[M, SUB * W * 32]` in
    the fp8 kernel order (module docstring)."""
    rows: tl.constexpr = first.shape[0]
    sub: tl.constexpr = first.shape[1]
    count: tl.constexpr = first.shape[2]
    lanes = tl.join(tl.reshape(_word_bytes(first), [rows, sub, count, 4, 4]),
                    tl.reshape(_word_bytes(second), [rows, sub, count, 4, 4]))  # fmt: skip
    # [M, SUB, W, t, i, h] -> [M, SUB, W, h, t, i]
    tile = tl.reshape(tl.permute(lanes, (0, 1, 2, 5, 3, 4)), [rows, sub * count * 32])
    return tile.to(tl.float8e4nv, bitcast=True)


@triton.jit
def fp8_order(tile):
    """A float `[N, D]` tile in the bf16 kernel order, permuted to the fp8 kernel order."""
    rows: tl.constexpr = tile.shape[0]
    dim: tl.constexpr = tile.shape[1]
    parts = tl.reshape(tile, [rows, dim // 32, 4, 4, 2])  # [N, c, i, t, h]
    return tl.reshape(tl.permute(parts, (0, 1, 4, 3, 2)), [rows, dim])


@triton.jit
def fp8_operand(words, scales, PTX: tl.constexpr):
    """e4m3 operand of a tile of MXFP4 rows (keys, or query heads), with its per-row factor.

    words int32 `[M, SUB, W, 4]` and scales int32 `[M, SUB, 1, 4]` (kernel order, one scale
    per run) -> (e4m3 `[M, D]` in the fp8 kernel order, float32 factor `[M]` with row value
    = operand row * factor, bool `[M]` whether the operand holds the row exactly: its
    nonzero blocks' exponents spread at most FP8_EXPONENT_SPREAD, the largest is at most
    LARGEST_HELD_SCALE, and a NaN scale (0xFF) is either the largest, making the factor NaN,
    or makes the row not held).
    """
    rows: tl.constexpr = words.shape[0]
    sub: tl.constexpr = words.shape[1]
    # A NaN scale counts like a nonzero block: it either is the largest (factor NaN) or
    # widens the spread past what the operand holds (the caller's exact path gives NaN).
    counted = (tl.max(words & MAGNITUDES, axis=2, keep_dims=True) != 0) | (scales == 255)
    top = tl.max(tl.reshape(tl.where(counted, scales, 0), [rows, sub * 4]), axis=1)
    low = tl.min(tl.reshape(tl.where(counted, scales, 255), [rows, sub * 4]), axis=1)
    exact = (low >= top - FP8_EXPONENT_SPREAD) & ((top <= LARGEST_HELD_SCALE) | (top == 255))
    shift = scales - top[:, None, None, None] + (FP8_EXPONENT_SPREAD + 1)
    table_low, table_high = fp8_tables(tl.minimum(tl.maximum(shift, 1), FP8_EXPONENT_SPREAD + 1))
    first, second = fp8_code_words(words, table_low, table_high, PTX)
    factor = e8m0_factor(top) * FP8_FACTOR_SHIFT
    return fp8_tile(first, second), factor, exact


KEY_REFERENCE_MARGIN = tl.constexpr(3)
"""How far above the largest block exponent of a walk's first key tile its reference sits
(`fp8_key_reference`): later keys up to that much larger are still held."""


@triton.jit
def fp8_key_reference(scales, live):
    """The exponent reference of a walk over key tiles: the largest block exponent of the live
    keys of its first tile (scales `[M, SUB, 1, 4]`, live broadcast against them) plus
    KEY_REFERENCE_MARGIN, at most LARGEST_HELD_SCALE."""
    counted = tl.where(live, scales, 0)
    top = tl.max(tl.reshape(counted, [counted.numel]), axis=0)
    return tl.minimum(top + KEY_REFERENCE_MARGIN, LARGEST_HELD_SCALE)


@triton.jit
def fp8_keys(words, scales, reference, PTX: tl.constexpr):
    """e4m3 operand of a key tile (words, scales as `fp8_operand` takes them) against one
    exponent reference B for every key: block b of exponent E_b becomes `code * 2**(E_b - B
    + 6)`, exact when B - FP8_EXPONENT_SPREAD <= E_b <= B (`fp8_keys_held`), and the key is
    the operand row times `fp8_key_factor(B)`. A block outside that window gets wrong bytes
    unless its codes are all zero: the caller must not keep what such a tile scored (the
    kernels score the walk again on the exact path)."""
    shift = scales - reference + (FP8_EXPONENT_SPREAD + 1)
    table_low, table_high = fp8_tables(shift)
    first, second = fp8_code_words(words, table_low, table_high, PTX)
    return fp8_tile(first, second)


@triton.jit
def fp8_key_factor(reference):
    """float32 `2**(reference - 133)`: e4m3 key rows of `fp8_keys` times it are the keys."""
    return e8m0_factor(reference) * FP8_FACTOR_SHIFT


@triton.jit
def fp8_key_span(low, high, scales, live):
    """The running smallest and largest block exponent of the live keys of a walk."""
    low = tl.minimum(low, tl.where(live, scales, 255))
    high = tl.maximum(high, tl.where(live, scales, 0))
    return low, high


@triton.jit
def fp8_keys_held(low, high, reference):
    """int32 1 when every exponent of a walk's span (`fp8_key_span`) lies in the window of
    `fp8_keys` around reference, else 0 (scales above LARGEST_HELD_SCALE, NaN included,
    never do: the reference is at most that)."""
    smallest = tl.min(tl.reshape(low, [low.numel]), axis=0)
    largest = tl.max(tl.reshape(high, [high.numel]), axis=0)
    inside = (smallest >= reference - FP8_EXPONENT_SPREAD) & (largest <= reference)
    return inside.to(tl.int32)


@triton.jit
def fp8_queries(words, scales, weights, PTX: tl.constexpr):
    """The e4m3 side of a set of query heads: codes as `fp8_operand` takes them (`[N, SUB, W,
    4]`, `[N, SUB, 1, 4]`), float32 weights `[N]` -> (Q^T e4m3 `[D, N]`, weights times each
    head's factor, whether every head is held exactly with its factored weight inside
    FP8_WEIGHT_RANGE: a scalar the caller ANDs with its keys' before taking the fp8 path)."""
    queries, factor, held = fp8_operand(words, scales, PTX)
    scaled = weights * factor
    size = tl.abs(scaled)
    ranged = (size >= FP8_WEIGHT_RANGE[0]) & (size <= FP8_WEIGHT_RANGE[1])
    ranged = ranged | (size == 0.0) | (size == float("inf")) | (size != size)
    return tl.trans(queries), scaled, tl.min((held & ranged).to(tl.int32), axis=0) != 0


__all__ = [
    "FP8_EXPONENT_SPREAD",
    "FP8_WEIGHT_RANGE",
    "fp8_code_words",
    "fp8_key_factor",
    "fp8_key_reference",
    "fp8_key_span",
    "fp8_keys",
    "fp8_keys_held",
    "fp8_operand",
    "fp8_order",
    "fp8_queries",
    "fp8_tables",
    "fp8_tile",
]
