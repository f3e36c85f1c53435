"""In-kernel MXFP4 decoding and paged-cache addressing, shared by every logits kernel.

The byte formulas are those of `graphidx.mxfp4.layout` (its docstring is the source of truth);
this module is their one Triton re-derivation. Launchers pass the layout's fields and the
thread split of a row as one constexpr `KEYS` (`KeyTiling`: D = head_dim, E = page_entries,
NPT = n_per_tile, LANES = scale_lanes, SUB, RUN).

Element order. A dot product does not care in which order its D terms are summed, as long as
keys and queries use the same order; so tiles are decoded in *kernel order*, chosen to match
how a tensor-core operand is spread over threads and so that whole 32-bit words of codes
decode without byte shuffles. In the MMA operand layout a thread of a quad (t = lane % 4)
holds the element pairs (8j + 2t, 8j + 2t + 1) of its rows; thread t owns the D/8 consecutive
bytes t * D/8 ... of each row (one 16-byte chunk and one scale at D = 128: one vector load),
read as words w = j // 4 (`RUN // 4` words per run, SUB runs). Pair j takes nibble j % 4 of
the word's low half (bits 4i..4i+3, i = j % 4) as element 8j + 2t and nibble i of its high
half (bits 16 + 4i..) as element 8j + 2t + 1: one shift and one mask put both codes of a
pair where a packed 16-bit pair wants them. In bytes: element 8j + 2t + h is memory byte
t * D/8 + 4 (j // 4) + 2h + (j % 4) // 2, nibble j % 2. Tiles are built as
`[M, SUB, RUN // 4, 4, 4]` (word, pair in word, thread of the quad; SUB = D / 128, or one
half-chunk `RUN = 8` at D = 64) and flattened to `[M, D]`; D must be 64, 128 or 256.

Decoding in float32 (`dequantize_tile`): each code is placed in the top of an fp16 whose
exponent bias makes it `value * 2**-14`; one exact hardware conversion (fp16 -> fp32, which
handles the e2m1 subnormal 0.5 correctly), a multiply by `2**14` and one by the e8m0 factor
give the value itself. Undoing the `2**-14` before the scale keeps every value exact: with the
factor left in, a query scaled by 2**-120 would fall below bf16's smallest subnormal.

On NVIDIA GPUs (`OPERANDS_BF16X2`) key tiles skip float32 altogether: a pair's two codes are
placed into a bf16 pair whose bits read `value * 2**-126` (exponent field `ee`, the subnormal
0.5 at `ee == 0` again exact) by one integer multiply and a mask (`bf16_pair_codes`, which
folds the shift of pairs 1 and 3 into the multiplier: one shift per word), and one packed
multiply per factor scales the pair by `2**(E - 1)`, split in two powers of two that bf16
always holds.

Exactness: every decoded element is an e2m1 value times a power of two, exact in bf16 (the
tensor-core operand, subnormals included: a known-answer check on the H200 found that neither
`fma.rn.bf16x2` nor the sm_90 tensor cores flush them) and every product is exact in the
float32 accumulator. An e8m0 byte of 0xFF is NaN and propagates; byte 0 is 2**-127.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphidx.mxfp4.layout import CacheLayout
from graphidx.ops.kernels import OPERANDS_BF16X2 as _BF16X2_MODE
from graphidx.ops.kernels import OPERANDS_FP32 as _FP32_MODE
from graphidx.ops.kernels.ptx import load_byte_b32, prefetch_l1, prefetch_l2

FP16_CODE_FACTOR = tl.constexpr(float(2**14))
"""Undoes the `2**-14` of an e2m1 code read as an fp16 (see the module docstring)."""

PAIR_NIBBLES = tl.constexpr(0x000F000F)
"""Keeps nibble 0 of both 16-bit halves of a word (pair i's nibbles, shifted down by 4 i)."""
ODD_PAIR_NIBBLES = tl.constexpr(0x00F000F0)
"""Keeps nibble 1 of both halves, in place (`bf16_pair_codes`)."""
FP16_PAIR_FIELDS = tl.constexpr((0x00070007, 0x00080008))
"""(magnitude, sign) bits of a nibble pair, moved up by 9 and 12 to make an fp16 pair."""
BF16_PAIR_CODES = tl.constexpr((0x1040, -0x7E3F7E40))
"""(multiplier, mask 0x81C081C0) turning a nibble pair into a bf16 pair reading
`value * 2**-126`: times 2**6 + 2**12 copies the magnitude to bits 6..8 and the sign to bit
15 of each half (the copies never overlap, so no carries); the mask keeps those bits."""
LINE_ENTRIES = tl.constexpr(8)
"""Page slots whose 16-byte code chunks share one 128-byte line (`prefetch_key_tile`)."""
FP32_OPERANDS = tl.constexpr(_FP32_MODE)
BF16X2_OPERANDS = tl.constexpr(_BF16X2_MODE)
"""graphidx.ops.kernels.OPERANDS_FP32 / OPERANDS_BF16X2 as constexprs for the kernels."""

SUPPORTED_HEAD_DIMS = (64, 128, 256)


class KeyTiling(NamedTuple):
    """The key-tile constexprs every logits kernel takes as one `KEYS: tl.constexpr`: the
    cache layout (D = head_dim, E = page_entries, NPT = n_per_tile, LANES = scale_lanes) and
    the thread split of a row's codes (a thread's D/8 bytes as SUB runs of RUN <= 16
    contiguous bytes)."""

    D: int
    E: int
    NPT: int
    LANES: int
    SUB: int
    RUN: int


def key_tiling(layout: CacheLayout) -> KeyTiling:
    """The `KeyTiling` of a cache layout; ValueError for a head_dim the kernels do not tile."""
    head_dim = layout.head_dim
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"the triton backend supports head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}"
        )
    per_thread = head_dim // 8
    return KeyTiling(
        D=head_dim,
        E=layout.page_entries,
        NPT=layout.n_per_tile,
        LANES=layout.scale_lanes,
        SUB=max(1, per_thread // 16),
        RUN=min(16, per_thread),
    )


def cache_words(kv_cache: torch.Tensor) -> torch.Tensor:
    """The paged cache as int32 words `[pages, row_length / 4]` (same memory), the kernels'
    `kv_ptr`: codes load as words, scales through the same pointer read as bytes.
    ValueError unless the page stride, the row length, the storage offset and the data
    pointer are multiples of 4 bytes (a whole tensor of the layout's page_bytes always is)."""
    fields = {
        "page stride": kv_cache.stride(0),
        "row length": kv_cache.shape[1],
        "storage offset": kv_cache.storage_offset(),
        "data pointer": kv_cache.data_ptr(),
    }
    if any(value % 4 for value in fields.values()):
        listed = ", ".join(f"{name} {value}" for name, value in fields.items())
        raise ValueError(
            f"the triton backend reads kv_cache as 4-byte words: its {listed} must all be "
            "multiples of 4"
        )
    return kv_cache.view(torch.int32)


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
def nibble_pairs(words):
    """The code pairs of kernel-order words: int32 `[M, SUB, W, 4]` -> `[M, SUB, W, 4, 4]`
    (the new axis, before the thread one, is the pair in the word).

    Pair i of a word holds nibble i of its low half at bits 0..3 and nibble i of its high half
    at bits 16..19 (see the module docstring), every other bit 0.
    """
    rows: tl.constexpr = words.shape[0]
    sub: tl.constexpr = words.shape[1]
    count: tl.constexpr = words.shape[2]
    pairs = tl.join(
        tl.join(words & PAIR_NIBBLES, (words >> 8) & PAIR_NIBBLES),
        tl.join((words >> 4) & PAIR_NIBBLES, (words >> 12) & PAIR_NIBBLES),
    )  # [M, SUB, W, 4, 2, 2]: pair 2 a + b at [a, b]
    pairs = tl.reshape(pairs, [rows, sub, count, 4, 4])
    return tl.permute(pairs, (0, 1, 2, 4, 3))


@triton.jit
def _fp16_pairs(pairs):
    """Nibble pairs as fp16 pairs reading `value * 2**-14`: magnitude at bits 9..11 (the
    exponent field is the code's `ee`, ee == 0 the subnormal m * 2**-15), sign at bit 15."""
    return ((pairs & FP16_PAIR_FIELDS[0]) << 9) | ((pairs & FP16_PAIR_FIELDS[1]) << 12)


@triton.jit
def dequantize_tile(words, scale_bytes):
    """Decode a kernel-order tile to float32 values: `[M, SUB * W * 32]`.

    words: int32 `[M, SUB, W, 4]` (W = RUN // 4 words of each thread group's run);
    scale_bytes: int32 `[M, SUB, 1, 4]` (the scale of each run).
    """
    rows: tl.constexpr = words.shape[0]
    sub: tl.constexpr = words.shape[1]
    count: tl.constexpr = words.shape[2]
    pair = _fp16_pairs(nibble_pairs(words))  # [M, SUB, W, 4, 4]
    low = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    factor = tl.expand_dims(e8m0_factor(scale_bytes), 3)
    pairs = tl.join((low * FP16_CODE_FACTOR) * factor, (high * FP16_CODE_FACTOR) * factor)
    return tl.reshape(pairs, [rows, sub * count * 32])


@triton.jit
def bf16_pair_codes(words):
    """The code pairs of kernel-order words as bf16 pairs reading `value * 2**-126`: int32
    `[M, SUB, W, 4]` -> `[M, SUB, W, 4, 4]`, the order of `nibble_pairs` and the bits of
    `(nibble_pairs(words) * BF16_PAIR_CODES[0]) & BF16_PAIR_CODES[1]`.

    Pairs 1 and 3 are not shifted down first: `(w & 0x00F000F0) * (multiplier >> 4)` is the
    same number as `((w >> 4) & 0x000F000F) * multiplier`, so a word takes one shift (by 8,
    for pairs 2 and 3), not three.
    """
    rows: tl.constexpr = words.shape[0]
    sub: tl.constexpr = words.shape[1]
    count: tl.constexpr = words.shape[2]
    even: tl.constexpr = BF16_PAIR_CODES[0]
    odd: tl.constexpr = BF16_PAIR_CODES[0] >> 4
    upper = words >> 8
    pairs = tl.join(
        tl.join((words & PAIR_NIBBLES) * even, (upper & PAIR_NIBBLES) * even),
        tl.join((words & ODD_PAIR_NIBBLES) * odd, (upper & ODD_PAIR_NIBBLES) * odd),
    )  # [M, SUB, W, 4, 2, 2]: pair 2 a + b at [a, b]
    pairs = tl.reshape(pairs & BF16_PAIR_CODES[1], [rows, sub, count, 4, 4])
    return tl.permute(pairs, (0, 1, 2, 4, 3))


@triton.jit
def bf16x2_scale_factors(scale_bytes):
    """(low, high) factors of int32 scale bytes: bf16 pairs (as int32) of powers of two whose
    product is `2**(E - 1)` (NaN at E = 255), so a code pair reading `value * 2**-126` times
    low, then times high, is `value * 2**(E - 127)`."""
    # 2**(E - 1) = 2**low * 2**high, low = floor((E - 1) / 2) in [-1, 126], high in [0, 127]:
    # both factors are normal bf16, and the intermediate (>= 2**-128) stays exact.
    # (x + 127) * 0x00800080 is bf16 2**x in both halves (x + 127 in [126, 254]).
    shift = scale_bytes - 1
    low = shift >> 1
    high_pair = tl.where(scale_bytes == 255, 0x7FC07FC0, (shift - low + 127) * 0x00800080)
    return (low + 127) * 0x00800080, high_pair


@triton.jit
def dequantize_keys_bf16x2(words, scale_bytes):
    """Decode a kernel-order tile straight to bf16 `value * 2**(E - 127)`: `[M, SUB * W * 32]`.

    Same arguments, element order and values as `dequantize_tile`. NVIDIA only
    (inline PTX `fma.rn.bf16x2`, sm_80+). E = 255 gives NaN, E = 0 bf16 subnormals.
    """
    rows: tl.constexpr = words.shape[0]
    sub: tl.constexpr = words.shape[1]
    count: tl.constexpr = words.shape[2]
    pair = bf16_pair_codes(words)
    low_factors, high_factors = bf16x2_scale_factors(tl.expand_dims(scale_bytes, 3))
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
    return tl.reshape(tl.join(first, second), [rows, sub * count * 32])


@triton.jit
def _run_starts(KEYS: tl.constexpr):
    """First byte (within an entry) and chunk of every thread group's run: int32
    `[1, SUB, 1, 4]` each (byte t * SUB * RUN + s * RUN, chunk byte // 16)."""
    s = tl.arange(0, KEYS.SUB)[None, :, None, None]
    t = tl.arange(0, 4)[None, None, None, :]
    first = t * (KEYS.SUB * KEYS.RUN) + s * KEYS.RUN
    return first, first // 16


@triton.jit
def _entry_offsets(entry, first, chunk, KEYS: tl.constexpr):  # fmt: skip
    """Offsets within a page (graphidx.mxfp4.layout): ((codes in words, scales in bytes) of
    each entry slot, (codes in words, scales in bytes) of each run starting at entry byte
    `first` / chunk); add a part of each kind to the page pointer of its unit. Shapes
    broadcast like the arguments."""
    # Slots are never negative: unsigned division by the power-of-two tile is a shift.
    slot = entry.to(tl.uint32)
    tile = (slot // KEYS.NPT).to(tl.int32)
    local = (slot % KEYS.NPT).to(tl.int32)
    scales_per_lane: tl.constexpr = (KEYS.D // 32) // KEYS.LANES
    entry_words = tile * (KEYS.NPT * (KEYS.D // 8)) + local * 4
    entry_scale = (
        KEYS.E * (KEYS.D // 2) + tile * (KEYS.NPT * (KEYS.D // 32)) + local * scales_per_lane
    )
    run_words = (first // 16) * (KEYS.NPT * 4) + (first % 16) // 4
    chunk_scale = (chunk % KEYS.LANES) * (KEYS.NPT * scales_per_lane) + chunk // KEYS.LANES
    return entry_words, entry_scale, run_words, chunk_scale


@triton.jit
def as_bytes(word_ptr):
    """An int32 page pointer as a uint8 one (scales are single bytes)."""
    return word_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)


@triton.jit
def _key_runs(page_ptr, entry, KEYS: tl.constexpr):  # fmt: skip
    """Where keys `entry` of their pages keep their codes and scales (`_entry_offsets`):
    (pointer to each key's first code word `[M, 1, 1, 1]`, word offset of each thread
    group's run `[1, SUB, 1, 4]`, pointer to each run's scale byte `[M, SUB, 1, 4]`)."""
    first, chunk = _run_starts(KEYS)
    entry_words, entry_scale, run_words, chunk_scale = _entry_offsets(entry, first, chunk, KEYS)
    code_base = (page_ptr + entry_words)[:, None, None, None]
    scale_ptrs = (as_bytes(page_ptr) + entry_scale)[:, None, None, None] + chunk_scale
    return code_base, run_words, scale_ptrs


@triton.jit
def key_tile_words(
    page_ptr,
    entry,
    live,
    KEYS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Load the raw codes of keys `entry` of their pages, kernel order: int32 words
    `[M, SUB, RUN // 4, 4]` and uint8 scales `[M, SUB, 1, 4]` (decode with `decode_key_tile`).

    page_ptr: int32 pointer to each key's page (`[M]` pointers, `cache_words`), or one scalar
    pointer when the whole tile lies in one page; entry: int32 `[M]`, each key's slot in its
    page; live: bool `[M]`, the keys to read when MASKED (others read as codes 0, scale 127
    and touch no memory); with MASKED false every key is read.
    """
    code_base, run_words, scale_ptrs = _key_runs(page_ptr, entry, KEYS)
    word = tl.arange(0, KEYS.RUN // 4)[None, None, :, None]
    # A lane's run is RUN // 4 contiguous words from a multiple of RUN // 4 (beyond what
    # Triton's analysis can tell): the hints let each run load as one vector.
    W: tl.constexpr = KEYS.RUN // 4
    words = tl.max_contiguous(tl.multiple_of(run_words + word, [1, 1, W, 1]), [1, 1, W, 1])
    value_ptrs = code_base + words
    if MASKED:
        values = tl.load(value_ptrs, mask=live[:, None, None, None], other=0)
        scales = tl.load(scale_ptrs, mask=live[:, None, None, None], other=127)
    else:
        values = tl.load(value_ptrs)
        scales = tl.load(scale_ptrs)
    return values, scales


@triton.jit
def prefetch_key_tile(
    page_ptr,
    entry,
    live,
    KEYS: tl.constexpr,
    PTX: tl.constexpr,
):
    """Prefetch into L1 the cache lines `key_tile_words(page_ptr, entry, live, ...)` reads
    for these entries (same arguments): every run of codes and every scale byte of each live
    entry, so a later load of the tile waits tens of cycles instead of a DRAM round trip.
    A 128-byte line holds one 16-byte chunk of LINE_ENTRIES consecutive slots, so a caller
    covering a run of slots passes one slot per aligned LINE_ENTRIES of them. Only a hint: a
    no-op without PTX (`graphidx.ops.kernels.ptx.prefetch_l1`), never changes a result."""
    code_base, run_words, scale_ptrs = _key_runs(page_ptr, entry, KEYS)
    live = live[:, None, None, None]
    prefetch_l1(code_base + run_words, live, PTX)
    prefetch_l1(scale_ptrs, live, PTX)


@triton.jit
def tile_lines(first_entry, line, KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One address in each 128-byte line holding the codes or the scales of the tile of BLOCK_N
    entries from slot `first_entry` of a page (first_entry a multiple of BLOCK_N, BLOCK_N a
    multiple of the layout's n_per_tile, so each is one contiguous run of the page): for line
    numbers `line` (int32), (byte offset within the page, whether that number is used).
    Codes then scales; a run of S bytes need not start on a line, so it takes cdiv(S, 128) + 1
    numbers, 128 bytes apart and the last at the run's last byte: every line it touches gets
    one."""
    CODE_BYTES: tl.constexpr = BLOCK_N * (KEYS.D // 2)
    SCALE_BYTES: tl.constexpr = BLOCK_N * (KEYS.D // 32)
    CODE_LINES: tl.constexpr = (CODE_BYTES + 127) // 128 + 1
    SCALE_LINES: tl.constexpr = (SCALE_BYTES + 127) // 128 + 1
    offset = tl.where(
        line < CODE_LINES,
        first_entry * (KEYS.D // 2) + tl.minimum(line * 128, CODE_BYTES - 1),
        KEYS.E * (KEYS.D // 2)
        + first_entry * (KEYS.D // 32)
        + tl.minimum((line - CODE_LINES) * 128, SCALE_BYTES - 1),
    )
    return offset, line < CODE_LINES + SCALE_LINES


@triton.jit
def prefetch_tile_l2(page_ptr, first_entry, KEYS: tl.constexpr,
                     BLOCK_N: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """Prefetch into L2 every line of the tile `tile_lines` describes, of the page at int32
    `page_ptr`: 128 lines per step, one per thread of a 4-warp program (8 warps issue each
    twice). A no-op without PTX."""
    LINES: tl.constexpr = (
        (BLOCK_N * (KEYS.D // 2) + 127) // 128 + (BLOCK_N * (KEYS.D // 32) + 127) // 128 + 2
    )
    for first_line in tl.static_range(0, LINES, 128):
        offset, used = tile_lines(first_entry, first_line + tl.arange(0, 128), KEYS, BLOCK_N)
        prefetch_l2(as_bytes(page_ptr) + offset, used, PTX)


@triton.jit
def mma_tile_rows(BLOCK_N: tl.constexpr):
    """Tile row of every (g, w, p, r) in `key_tile_words_mma`'s index space: int32
    `[1, 8, 4, BLOCK_N // 64, 2, 1, 1]`, row m = g + 8 r + 16 w + 64 p."""
    g = tl.arange(0, 8)[None, :, None, None, None, None, None]
    w = tl.arange(0, 4)[None, None, :, None, None, None, None]
    p = tl.arange(0, BLOCK_N // 64)[None, None, None, :, None, None, None]
    r = tl.arange(0, 2)[None, None, None, None, :, None, None]
    return g + 8 * r + 16 * w + 64 * p


@triton.jit
def key_tile_words_mma(
    page_ptr,
    first_entry,
    rows,
    live,
    KEYS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    PTX: tl.constexpr,
):
    """`key_tile_words` for a tile of BLOCK_N keys (a multiple of 64), loaded straight in the
    thread layout of a 4-warp (one warpgroup) tensor-core A operand, so the decoded tile needs
    no shuffle through shared memory.

    page_ptr: the tile's page (int32 pointer); first_entry: its first slot there, a multiple
    of NPT; rows, live: each tile row's slot past first_entry and whether to read it (MASKED
    only), indexed like `mma_tile_rows(BLOCK_N)`. The rows' offsets do not depend on the
    tile (a loop keeps them), whole NPT tiles of slots just shift them: the tile adds
    first_entry * D / 8 words to its codes and first_entry * D / 32 bytes to its scales.

    In that layout a key row m = g + 8 r + 16 w + 64 p sits in lane 4 g + t of warp w
    (register r, repetition p), and lane t holds the row's bytes t * D/8 ... (kernel order).
    The loads are built as `[t, g, w, p, r, SUB, RUN // 4]`: Triton lays a load's threads
    along its dimensions in order of contiguity, ties in dimension order, so lanes go to t
    then g and warps to w, as the operand wants; a permute and a reshape (no data movement)
    then give the `[BLOCK_N, SUB, RUN // 4, 4]` tile. Scales come back as int32
    (`load_byte_b32`: one register each when PTX).
    """
    t = tl.arange(0, 4)[:, None, None, None, None, None, None]
    s = tl.arange(0, KEYS.SUB)[None, None, None, None, None, :, None]
    word = tl.arange(0, KEYS.RUN // 4)[None, None, None, None, None, None, :]
    # The first byte of the lane's run (as _run_starts).
    first = t * (KEYS.SUB * KEYS.RUN) + s * KEYS.RUN
    entry_words, entry_scale, run_words, chunk_scale = _entry_offsets(
        rows, first, first // 16, KEYS
    )
    # Each lane's run is RUN // 4 contiguous words starting at a multiple of RUN // 4 (beyond
    # what Triton's analysis can tell): the hints let each run load as one vector.
    W: tl.constexpr = KEYS.RUN // 4
    words = tl.max_contiguous(
        tl.multiple_of(entry_words + run_words + word, [1, 1, 1, 1, 1, 1, W]),
        [1, 1, 1, 1, 1, 1, W],
    )
    value_ptrs = (page_ptr + first_entry * (KEYS.D // 8)) + words
    scale_ptrs = (as_bytes(page_ptr) + first_entry * (KEYS.D // 32)) + (entry_scale + chunk_scale)
    # Scale bytes each in a 32-bit register (`load_byte_b32`): a prefetched tile's scales then
    # stay in flight until the tile is decoded.
    if MASKED:
        values = tl.load(value_ptrs, mask=live, other=0)
        scales = load_byte_b32(scale_ptrs, live, 127, PTX)
    else:
        values = tl.load(value_ptrs)
        scales = load_byte_b32(scale_ptrs, None, 127, PTX)
    # [t, g, w, p, r, s, word] -> [p, w, r, g, s, word, t]: rows m = ((p * 4 + w) * 2 + r) * 8 + g.
    values = tl.reshape(
        tl.permute(values, (3, 2, 4, 1, 5, 6, 0)), [BLOCK_N, KEYS.SUB, KEYS.RUN // 4, 4]
    )
    scales = tl.reshape(tl.permute(scales, (3, 2, 4, 1, 5, 6, 0)), [BLOCK_N, KEYS.SUB, 1, 4])
    return values, scales


@triton.jit
def decode_key_tile(values, scales, OPERANDS: tl.constexpr):
    """Keys from `key_tile_words` or `key_tile_words_mma`: `[M, D]` in kernel order, bf16 from
    `dequantize_keys_bf16x2` under OPERANDS_BF16X2, else float32 from `dequantize_tile`."""
    if OPERANDS == BF16X2_OPERANDS:
        keys = dequantize_keys_bf16x2(values, scales.to(tl.int32))
    else:
        keys = dequantize_tile(values, scales.to(tl.int32))
    return keys


@triton.jit
def load_query_codes(
    q_ptr,
    q_scale_ptr,
    row,
    head,
    live,
    q_row_stride,
    q_head_stride,
    qs_row_stride,
    qs_head_stride,
    KEYS: tl.constexpr,
):
    """Raw codes of query heads `(row[m], head[m])` in kernel order, as `key_tile_words`
    returns a key tile's: int32 words `[M, SUB, RUN // 4, 4]` and int32 scales
    `[M, SUB, 1, 4]`, codes 0 and scale 127 where not live. q: uint8 `[rows, H, D/2]`,
    q_scale: uint8 `[rows, H, D/32]`, last dims contiguous (any alignment: bytes are loaded
    one by one and assembled into words).
    """
    first, chunk = _run_starts(KEYS)
    word = tl.arange(0, KEYS.RUN // 4)[None, None, :, None, None]
    byte = tl.arange(0, 4)[None, None, None, None, :]
    row64 = row.to(tl.int64)
    value_base = row64 * q_row_stride + head * q_head_stride
    values = tl.load(
        q_ptr + value_base[:, None, None, None, None] + first[:, :, :, :, None] + 4 * word + byte,
        mask=live[:, None, None, None, None],
        other=0,
    )  # [M, SUB, W, 4, 4 bytes]
    words = tl.sum(values.to(tl.int32) << (8 * byte), axis=4)
    scale_base = row64 * qs_row_stride + head * qs_head_stride
    scales = tl.load(
        q_scale_ptr + scale_base[:, None, None, None] + chunk,
        mask=live[:, None, None, None],
        other=127,
    )
    return words, scales.to(tl.int32)


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
    "BF16_PAIR_CODES",
    "FP16_CODE_FACTOR",
    "FP16_PAIR_FIELDS",
    "LINE_ENTRIES",
    "ODD_PAIR_NIBBLES",
    "PAIR_NIBBLES",
    "SUPPORTED_HEAD_DIMS",
    "KeyTiling",
    "as_bytes",
    "bf16_pair_codes",
    "bf16x2_scale_factors",
    "cache_words",
    "decode_key_tile",
    "dequantize_keys_bf16x2",
    "dequantize_tile",
    "e8m0_factor",
    "key_tile_words",
    "key_tile_words_mma",
    "key_tiling",
    "load_query_codes",
    "max_propagate_nan",
    "mma_operand",
    "mma_tile_rows",
    "nibble_pairs",
    "prefetch_key_tile",
    "relu_propagate_nan",
    "seq_of_row",
    "tile_scores",
]
