"""MXFP4 quantization against an independent float64 model of e2m1 / e8m0."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from graphidx.mxfp4.format import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # written out again on purpose


def model_scale_exponent(amax: float) -> int:
    """Smallest e with 6 * 2**e >= amax (amax floored), clamped: found by search, not frexp."""
    amax = max(amax, 6.0 * 2.0**-126)
    if math.isinf(amax):
        return 127
    e = math.ceil(math.log2(amax / 6.0))
    while 6.0 * 2.0**e < amax:
        e += 1
    while 6.0 * 2.0 ** (e - 1) >= amax:
        e -= 1
    return max(-127, min(127, e))


def model_code(y: float) -> int:
    """Nearest grid point to |y| by distance, ties to the even code; sign from the sign bit."""
    magnitude = min(abs(y), 6.0)  # saturate first: far-off distances would all look equal
    distances = [abs(magnitude - g) for g in GRID]
    best = min(distances)
    candidates = [c for c, d in enumerate(distances) if d == best]
    code = candidates[0] if len(candidates) == 1 else next(c for c in candidates if c % 2 == 0)
    return code | (8 if np.signbit(y) else 0)


def model_quantize(x: np.ndarray, amax_cap: float) -> tuple[np.ndarray, np.ndarray]:
    """Reference quantization of a 2-D float64 array; amax_cap stands for inf's amax."""
    rows, dim = x.shape
    codes = np.zeros((rows, dim), dtype=np.int64)
    scales = np.zeros((rows, dim // 32), dtype=np.int64)
    for r in range(rows):
        for blk in range(dim // 32):
            block = x[r, blk * 32 : (blk + 1) * 32]
            amax = min(float(np.max(np.abs(block))), amax_cap)
            e = model_scale_exponent(amax)
            scales[r, blk] = e + 127
            for i, v in enumerate(block):
                codes[r, blk * 32 + i] = model_code(float(v) / 2.0**e)
    values = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return values.astype(np.uint8), scales.astype(np.uint8)


def check_against_model(x: torch.Tensor) -> None:
    values, scales = quantize_mxfp4(x)
    flat = x.reshape(-1, x.shape[-1]).to(torch.float64).numpy()
    cap = float(torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).max)
    want_values, want_scales = model_quantize(flat, cap)
    assert values.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert values.shape == (*x.shape[:-1], x.shape[-1] // 2)
    assert scales.shape == (*x.shape[:-1], x.shape[-1] // 32)
    np.testing.assert_array_equal(scales.reshape(flat.shape[0], -1).numpy(), want_scales)
    np.testing.assert_array_equal(values.reshape(flat.shape[0], -1).numpy(), want_values)


def random_magnitudes(gen: torch.Generator, rows: int, dim: int) -> torch.Tensor:
    """Mixed-sign normals, each row at its own decade between 1e-30 and 1e30."""
    decades = torch.randint(-30, 31, (rows, 1), generator=gen).to(torch.float64)
    return torch.randn(rows, dim, generator=gen, dtype=torch.float64) * 10.0**decades


def test_grid_constant() -> None:
    assert E2M1_VALUES == GRID


def test_decode_of_every_code_and_scale_byte() -> None:
    # Every byte pair (values byte, scale byte) decodes to sign * grid * 2**(scale - 127).
    byte = torch.arange(256, dtype=torch.uint8)
    values = byte.unsqueeze(1).expand(256, 16).contiguous()  # row b is all b
    for scale_byte in (0, 1, 100, 127, 130, 254):
        scales = torch.full((256, 1), scale_byte, dtype=torch.uint8)
        out = dequantize_mxfp4(values, scales).to(torch.float64)
        for b in range(256):
            for nibble, column in ((b & 0xF, 0), (b >> 4, 1)):
                mag = GRID[nibble & 7] * 2.0 ** (scale_byte - 127)
                want = -mag if nibble & 8 else mag
                got = float(out[b, column])
                if math.isinf(got):
                    assert abs(want) > float(torch.finfo(torch.float32).max)
                    assert math.copysign(1, got) == math.copysign(1, want)
                else:
                    assert got == want, (b, scale_byte, column)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_random_magnitudes_match_model(gen: torch.Generator, dtype: torch.dtype) -> None:
    if dtype in (torch.bfloat16, torch.float16):
        # Stay inside the dtype's range (fp16 spans about 6e-8..6e4).
        decades = torch.randint(-4, 4, (24, 1), generator=gen).to(torch.float64)
        x = torch.randn(24, 64, generator=gen, dtype=torch.float64) * 10.0**decades
    else:
        x = random_magnitudes(gen, 48, 64)
    check_against_model(x.to(dtype))


def test_leading_dims_are_kept(gen: torch.Generator) -> None:
    # Q per head: [rows, H, D] -> [rows, H, D/2], [rows, H, D/32].
    q = torch.randn(3, 4, 128, generator=gen) * 7.0
    values, scales = quantize_mxfp4(q)
    assert values.shape == (3, 4, 64) and scales.shape == (3, 4, 4)
    check_against_model(q)
    flat_values, flat_scales = quantize_mxfp4(q.reshape(12, 128))
    assert torch.equal(values.reshape(12, 64), flat_values)
    assert torch.equal(scales.reshape(12, 4), flat_scales)


@pytest.mark.parametrize("exponent", [-120, -5, 0, 3, 60])
def test_exact_ties_round_to_even_code(exponent: int) -> None:
    # amax is exactly 6 * 2**e, so the block's scale is 2**e and the rest are exact ties.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    row = [6.0] + ties + [-t for t in ties] + [0.5, 1.5, 3.0] * 5 + [-6.0, 4.0]
    assert len(row) == 32
    x = torch.tensor(row, dtype=torch.float64) * 2.0**exponent
    values, scales = quantize_mxfp4(x.to(torch.float32))
    assert int(scales[0]) == exponent + 127
    out = dequantize_mxfp4(values, scales).to(torch.float64) / 2.0**exponent
    assert out[1:8].tolist() == want
    assert out[8:15].tolist() == [-w for w in want]
    check_against_model(x.to(torch.float32).unsqueeze(0))


@pytest.mark.parametrize("exponent", [-100, -1, 0, 1, 7, 100])
def test_scale_exponent_at_powers_of_two(exponent: int) -> None:
    base = torch.full((4, 32), 0.1, dtype=torch.float64) * 2.0**exponent
    # Row 0: amax = 6 * 2**e exactly -> e. Row 1: one ulp above -> e + 1 and saturation
    # would be wrong (3 + tiny rounds to 3). Row 2: amax = 2**e -> e - 2. Row 3: one ulp
    # below 6 * 2**e -> e.
    six = 6.0 * 2.0**exponent
    base[0, 5] = six
    base[1, 5] = float(np.nextafter(np.float32(six), np.float32(np.inf)))
    base[2, 5] = 2.0**exponent
    base[3, 5] = float(np.nextafter(np.float32(six), np.float32(0)))
    x = base.to(torch.float32)
    values, scales = quantize_mxfp4(x)
    assert scales[:, 0].tolist() == [
        exponent + 127,
        exponent + 128,
        exponent + 125,
        exponent + 127,
    ]
    out = dequantize_mxfp4(values, scales).to(torch.float64)
    assert float(out[1, 5]) == 3.0 * 2.0 ** (exponent + 1)
    assert float(out[3, 5]) == 6.0 * 2.0**exponent
    check_against_model(x)


def test_saturation_at_the_exponent_clamp() -> None:
    # In float64 an amax of 1e300 needs e ~ 994 but e clamps at 127: elements saturate at 6.
    x = torch.linspace(-1.0, 1.0, 32, dtype=torch.float64).repeat(2, 1) * 1e300
    x[1] = torch.linspace(0.5, 1.0, 32, dtype=torch.float64) * 6.0 * 2.0**127
    values, scales = quantize_mxfp4(x)
    assert scales.tolist() == [[254], [254]]
    codes = torch.stack((values & 0xF, values >> 4), dim=-1).reshape(2, 32)
    assert int(codes[0, 0]) == 0xF and int(codes[0, -1]) == 0x7
    check_against_model(x)


def test_infinity_saturates() -> None:
    x = torch.linspace(-3.0, 3.0, 32).unsqueeze(0)
    x[0, 3] = float("inf")
    x[0, 4] = float("-inf")
    values, _ = quantize_mxfp4(x)
    codes = torch.stack((values & 0xF, values >> 4), dim=-1).reshape(32)
    assert int(codes[3]) == 0x7 and int(codes[4]) == 0xF
    check_against_model(x)


def test_all_zero_block_uses_the_floor() -> None:
    x = torch.randn(2, 64) + 3.0
    x[1, 32:] = 0.0
    x[0, :32] = -0.0
    values, scales = quantize_mxfp4(x)
    assert int(scales[1, 1]) == 1 and int(scales[0, 0]) == 1  # e = -126
    assert values[1, 16:].eq(0).all()
    assert values[0, :16].eq(0x88).all()  # -0.0 keeps its sign bit
    check_against_model(x)


def test_tiny_subnormal_inputs() -> None:
    tiny = torch.tensor([2.0**-149, -(2.0**-140), 2.0**-127, 3.0 * 2.0**-126] * 8)
    check_against_model(tiny.unsqueeze(0))


def test_nan_scale_poisons_the_whole_block(gen: torch.Generator) -> None:
    values, scales = quantize_mxfp4(torch.randn(3, 128, generator=gen))
    scales[1, 2] = 0xFF
    out = dequantize_mxfp4(values, scales)
    assert out[1, 64:96].isnan().all()
    mask = torch.ones_like(out, dtype=torch.bool)
    mask[1, 64:96] = False
    assert not out[mask].isnan().any()


def test_nan_input_raises() -> None:
    x = torch.randn(2, 64)
    x[1, 7] = float("nan")
    with pytest.raises(ValueError, match=r"x \(shape \(2, 64\)\) contains NaN"):
        quantize_mxfp4(x)


@pytest.mark.parametrize("shape", [(4, 48), (16,), (3, 0), ()])
def test_bad_last_dim_raises(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"x must have a last dim.*" + re.escape(str(shape))):
        quantize_mxfp4(torch.ones(shape))


def test_non_float_input_raises() -> None:
    with pytest.raises(ValueError, match="x must be a floating-point tensor"):
        quantize_mxfp4(torch.ones(2, 32, dtype=torch.int32))


def test_dequantize_validates() -> None:
    values = torch.zeros(2, 64, dtype=torch.uint8)
    scales = torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="values must be a uint8"):
        dequantize_mxfp4(values.to(torch.int32), scales)
    with pytest.raises(ValueError, match="scales must be a uint8"):
        dequantize_mxfp4(values, scales.float())
    with pytest.raises(ValueError, match="does not match scales shape"):
        dequantize_mxfp4(values, scales[:, :3])
    with pytest.raises(ValueError, match="does not match scales shape"):
        dequantize_mxfp4(values, scales[:1])


def test_round_trip_error_is_half_a_grid_step(gen: torch.Generator) -> None:
    x = random_magnitudes(gen, 64, 128).to(torch.float32)
    values, scales = quantize_mxfp4(x)
    out = dequantize_mxfp4(values, scales).to(torch.float64)
    exact = x.to(torch.float64)
    block_scale = (2.0 ** (scales.to(torch.float64) - 127)).repeat_interleave(32, dim=-1)
    scaled = exact.abs() / block_scale
    # Grid spacing is 0.5 below 2, 1 in [2, 4), 2 in [4, 6].
    half_step = torch.where(scaled < 2, 0.25, torch.where(scaled < 4, 0.5, 1.0))
    error = (out - exact).abs()
    assert (error <= half_step * block_scale).all()
    # Some element of every block is exact at the block's top; the bound is not vacuous.
    assert (error > 0).any()


@pytest.mark.gpu
def test_random_data_on_cuda_matches_cpu(gen: torch.Generator) -> None:
    x = random_magnitudes(gen, 32, 128).to(torch.float32)
    cpu = quantize_mxfp4(x)
    gpu = quantize_mxfp4(x.cuda())
    assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu())
    assert torch.equal(dequantize_mxfp4(*cpu), dequantize_mxfp4(*gpu).cpu())
