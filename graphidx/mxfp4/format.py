"""MXFP4 numbers: e2m1 elements with one e8m0 scale per 32 elements (docs/contract.md section 4).

Element codes are 4 bits: bit 3 is the sign, bits 0..2 index `E2M1_VALUES`. Two codes share
a byte, the LOW nibble holding the even element. A scale byte `b` means `2 ** (b - 127)`;
`0xFF` is NaN and makes its whole block NaN.

Q is quantized per head with the same function: `quantize_mxfp4(q)` on `[rows, H, D]` gives
`[rows, H, D/2]` values and `[rows, H, D/32]` scales (every leading dim is kept).
"""

from __future__ import annotations

import torch

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the e2m1 codes 0..7; code | 8 is the negative of code."""

BLOCK_SIZE = 32
"""Elements per e8m0 scale."""

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_MAX = 6.0

_MIN_SCALE_EXP = -127
_MAX_SCALE_EXP = 127
# amax is floored here so an all-zero block gets a finite scale (exponent -126).
_AMAX_FLOOR = 6.0 * 2.0**-126

# Rounding to the nearest e2m1 value, ties to the even code: the code is the number of
# decision thresholds that |x| passes. A threshold sits halfway between codes c and c + 1;
# when c is even the tie stays at c (strict `>`), when c is odd it goes up (`>=`).
_TIES_STAY_DOWN = (0.25, 1.25, 2.5, 5.0)  # halfway after codes 0, 2, 4, 6
_TIES_GO_UP = (0.75, 1.75, 3.5)  # halfway after codes 1, 3, 5


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float16/bfloat16 embed exactly in float32; float64 keeps its own range and precision.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _power_of_two(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exactly 2**exponent (int tensor, inside dtype's normal range) built from its bits."""
    if dtype == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Exactly ceil(log2(amax / 6)) for finite amax >= 6 * 2**-126, as int32.

    With amax = m * 2**k (frexp, 0.5 <= m < 1) and 6 = 0.75 * 2**3, amax / 6 =
    (m / 0.75) * 2**(k - 3) where m / 0.75 lies in [2/3, 4/3): its ceil(log2) is 0 when
    m <= 0.75, else 1. Integer math only, so exact powers of two cannot land one off.
    """
    mantissa, exponent = torch.frexp(amax)
    return exponent.to(torch.int32) - 3 + (mantissa > 0.75).to(torch.int32)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` to MXFP4 along its last dim.

    x: float tensor of any float dtype and device, shape `[..., D]` with D a multiple of 32.
    Returns `(values, scales)`, both uint8 on x's device: values `[..., D/2]` (two e2m1 codes
    per byte, low nibble = even element), scales `[..., D/32]` (e8m0 bytes).

    Per 32-element block: amax = max|x| floored at 6 * 2**-126; scale exponent
    e = clamp(ceil(log2(amax / 6)), -127, 127); each element is x * 2**-e rounded to the
    nearest e2m1 value, ties to the even code, saturating at 6 (so +-inf becomes +-6). The
    code's sign bit is x's sign bit (a negative value that rounds to zero gives code 8).
    Raises ValueError for a NaN in x; that check reads one flag back to the host.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(
            f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}"
        )
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"x must have a last dim that is a positive multiple of {BLOCK_SIZE}, "
            f"got shape {tuple(x.shape)}"
        )
    if bool(torch.isnan(x).any()):
        raise ValueError(f"x (shape {tuple(x.shape)}) contains NaN; a NaN key is a bug upstream")

    compute = _compute_dtype(x.dtype)
    lead = x.shape[:-1]
    num_blocks = x.shape[-1] // BLOCK_SIZE
    blocks = x.to(compute).reshape(*lead, num_blocks, BLOCK_SIZE)

    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # clamp(max=...) maps an inf amax to the largest finite value; the inf elements then
    # saturate at 6 like any other out-of-range value.
    amax = amax.clamp(min=_AMAX_FLOOR, max=torch.finfo(compute).max)
    scale_exp = _scale_exponent(amax).clamp(_MIN_SCALE_EXP, _MAX_SCALE_EXP)

    # Multiplying by a power of two is exact; 2**-e stays normal because e >= -126 after
    # the floor and, in float32, e <= 126 for any finite amax.
    scaled = blocks.abs() * _power_of_two(-scale_exp, compute)
    codes = torch.zeros(scaled.shape, dtype=torch.uint8, device=x.device)
    for threshold in _TIES_STAY_DOWN:
        codes += (scaled > threshold).to(torch.uint8)
    for threshold in _TIES_GO_UP:
        codes += (scaled >= threshold).to(torch.uint8)
    codes |= torch.signbit(blocks).to(torch.uint8) << 3

    pairs = codes.reshape(*lead, x.shape[-1] // 2, 2)
    values = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = (scale_exp + E8M0_BIAS).to(torch.uint8).reshape(*lead, num_blocks)
    return values, scales


def _e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """2**(byte - 127) as float32 bits; byte 0 is the subnormal 2**-127, 0xFF is NaN."""
    byte = scales.to(torch.int32)
    bits = torch.where(
        byte == 0,
        torch.full_like(byte, 1 << 22),
        torch.where(byte == E8M0_NAN, torch.full_like(byte, 0x7FC00000), byte << 23),
    )
    return bits.view(torch.float32)


def _e2m1_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """The value of each 4-bit code (E2M1_VALUES with sign), computed without a table.

    Magnitude bits are eem: in quarter units the value is 2*m when ee == 0, else
    (2 + m) << ee, which reproduces 0, .5, 1, 1.5, 2, 3, 4, 6.
    """
    code = codes.to(torch.int32)
    exponent = (code >> 1) & 3
    mantissa = code & 1
    quarters = torch.where(exponent == 0, 2 * mantissa, (2 + mantissa) << exponent)
    magnitude = quarters.to(torch.float32) * 0.25
    return torch.where((code & 8) != 0, -magnitude, magnitude)


def dequantize_mxfp4(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Decode MXFP4 back to float32.

    values: uint8 `[..., D/2]`; scales: uint8 `[..., D/32]` with the same leading dims and
    device, values' last dim = 16 * scales' last dim. Returns float32 `[..., D]`. A scale
    byte of 0xFF makes its whole block NaN; products beyond float32's range become +-inf.
    """
    for name, tensor in (("values", values), ("scales", scales)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8:
            raise ValueError(
                f"{name} must be a uint8 tensor, got "
                f"{getattr(tensor, 'dtype', type(tensor).__name__)}"
            )
        if tensor.dim() == 0:
            raise ValueError(f"{name} must have at least one dim, got a scalar")
    if values.shape[:-1] != scales.shape[:-1] or values.shape[-1] != 16 * scales.shape[-1]:
        raise ValueError(
            f"values shape {tuple(values.shape)} does not match scales shape "
            f"{tuple(scales.shape)}: need equal leading dims and values' last dim = 16 x scales'"
        )
    if values.device != scales.device:
        raise ValueError(
            f"values and scales must share a device, got {values.device} and {scales.device}"
        )
    lead = values.shape[:-1]
    num_blocks = scales.shape[-1]
    codes = torch.stack((values & 0xF, values >> 4), dim=-1)
    elements = _e2m1_to_float32(codes).reshape(*lead, num_blocks, BLOCK_SIZE)
    scale = _e8m0_to_float32(scales).unsqueeze(-1)
    return (elements * scale).reshape(*lead, num_blocks * BLOCK_SIZE)
