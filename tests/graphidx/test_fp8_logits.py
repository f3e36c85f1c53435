"""The `fp8` precision of the logits ops (docs/contract.md section 5, "Precision").

Under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) the e4m3 dots are
computed exactly, so the fp8 kernels must agree with the reference to float32 rounding: that
checks the operand construction (tables, element order, the key walk's factor and the
per-head ones) and the exact rescoring of walks and queries the e4m3 operands cannot hold.
On a GPU the FP8 tensor cores accumulate with fewer bits; those tests check the documented
bound instead.
"""

from __future__ import annotations

import math

import pytest
import torch

from graphidx.config import cdiv
from graphidx.mxfp4 import E2M1_VALUES, cache_layout
from graphidx.mxfp4.layout import pack_page, unpack_page

ops = pytest.importorskip("graphidx.ops")
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from test_ops_triton import (  # noqa: E402
    DENSE_CASES,
    NAN,
    TRITON_DEVICE,
    assert_logits_match,
    grouping,
    make_cache,
    make_queries,
    on_triton_device,
)

from graphidx.ops.backend import resolve_precision  # noqa: E402
from graphidx.ops.kernels.fp8_tl import FP8_EXPONENT_SPREAD, fp8_operand  # noqa: E402

INTERPRETED = ops.backend.triton_interpreted()
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET or a GPU", allow_module_level=True)
GPU = not INTERPRETED


# ---------------------------------------------------------------------------------------
# The operand: tables, element order, factors, the held flag.
# ---------------------------------------------------------------------------------------


@triton.jit
def _operand_kernel(words_ptr, scales_ptr, tile_ptr, factor_ptr, held_ptr, M: tl.constexpr,
                    PTX: tl.constexpr):  # fmt: skip
    """`fp8_operand` of M rows of D = 128 (one run of 4 words per lane t): the e4m3 tile as
    bytes `[M, 128]`, the factor and the held flag of each row."""
    row = tl.arange(0, M)[:, None, None, None]
    w = tl.arange(0, 4)[None, None, :, None]
    t = tl.arange(0, 4)[None, None, None, :]
    words = tl.load(words_ptr + row * 16 + t * 4 + w)  # [M, 1, 4, 4]
    scales = tl.load(scales_ptr + row * 4 + t)  # [M, 1, 1, 4]
    tile, factor, held = fp8_operand(words, scales, PTX)
    offsets = tl.arange(0, M)[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(tile_ptr + offsets, tile.to(tl.int8, bitcast=True))
    tl.store(factor_ptr + tl.arange(0, M), factor)
    tl.store(held_ptr + tl.arange(0, M), held.to(tl.int32))


def _codes(words: torch.Tensor) -> torch.Tensor:
    """int32 words `[M, 4 t, 4 w]` -> codes `[M, t, w, 8]` (nibble n of each word)."""
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes & 7]
    return torch.where(codes & 8 != 0, -magnitudes, magnitudes)


def _expected_rows(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 `[M, 128]` in the fp8 kernel order: element 32 w + 16 h + 4 t + i is nibble
    4 h + i of word w of lane t, times lane t's scale."""
    values = _e2m1(_codes(words)) * torch.pow(2.0, scales.double() - 127).view(-1, 4, 1, 1)
    rows = values.shape[0]
    # [M, t, w, h, i] -> [M, w, h, t, i]
    return values.view(rows, 4, 4, 2, 4).permute(0, 2, 3, 1, 4).reshape(rows, 128)


SPREAD = int(FP8_EXPONENT_SPREAD.value)


@pytest.mark.parametrize("spread", [0, 5, SPREAD, SPREAD + 1, 40])
def test_fp8_operand_holds_every_row_it_claims(spread: int) -> None:
    """Every e2m1 code at every exponent spread up to FP8_EXPONENT_SPREAD: the e4m3 tile
    times the row factor is the decoded row exactly; wider spreads are flagged not held.
    Zero blocks with wild scales do not count; a NaN scale gives a NaN factor or not held."""
    gen = torch.Generator().manual_seed(spread)
    rows = 64
    words = torch.randint(-(2**31), 2**31, (rows, 4, 4), generator=gen, dtype=torch.int64)
    low = torch.randint(0, 254 - spread, (rows, 1), generator=gen)
    scales = low + torch.randint(0, spread + 1, (rows, 4), generator=gen)
    scales[:, 0] = low[:, 0]
    scales[:, 1] = low[:, 0] + spread  # the spread is reached on every row
    words[:4, 2] = 0  # an all-zero block whose scale is far off: it must not count
    scales[:4, 2] = torch.tensor([0, 252, 0, 252])
    words[4, :] = 0  # a row of zeros
    scales[5, 3] = 255  # NaN scale: the largest, or too far from the others
    scales[6] = 255
    words = words.to(torch.int32)
    scales = scales.to(torch.int32)
    tile = torch.empty((rows, 128), dtype=torch.int8)
    factor = torch.empty(rows)
    held = torch.empty(rows, dtype=torch.int32)
    args = on_triton_device(words, scales, tile, factor, held)
    _operand_kernel[(1,)](*args, M=rows, PTX=GPU)
    tile, factor, held = (t.cpu() for t in args[2:])
    values = tile.view(torch.float8_e4m3fn).double() * factor.double().unsqueeze(1)
    want = _expected_rows(words, scales)
    expected_held = []
    for r in range(rows):
        counted = [
            int(scales[r, t])
            for t in range(4)
            if bool((words[r, t] & 0x77777777).any()) or int(scales[r, t]) == 255
        ]
        spread = max(counted) - min(counted) if counted else 0
        # Above scale byte 252 the exact decode overflows: such rows are not held.
        expected_held.append(spread <= SPREAD and max(counted, default=0) <= 252)
    for r in range(rows):
        if r in (5, 6):
            assert math.isnan(float(factor[r])) or not bool(held[r]), r
            continue
        assert bool(held[r]) == expected_held[r], r
        if bool(held[r]):
            torch.testing.assert_close(values[r], want[r], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------
# The ops in fp8 against the reference.
# ---------------------------------------------------------------------------------------


def _fp8_tolerance(want: torch.Tensor) -> float:
    """Absolute tolerance of an fp8 result: float32 rounding under the interpreter, the
    documented bound (relative to the largest |logit|) on FP8 tensor cores."""
    finite = want.isfinite()
    scale = float(want[finite].abs().max()) if finite.any() else 1.0
    return (1e-6 if INTERPRETED else ops.FP8_LOGIT_BOUND) * max(scale, 1.0)


def _assert_fp8_match(got: torch.Tensor, want: torch.Tensor) -> None:
    if INTERPRETED:
        assert_logits_match(got, want)
        return
    assert torch.equal(got.isnan(), want.isnan()), "written / NaN columns differ"
    assert torch.equal(got.isinf(), want.isinf()), "-inf / +inf columns differ"
    finite = want.isfinite()
    if bool(finite.any()):
        assert float((got[finite] - want[finite]).abs().max()) <= _fp8_tolerance(want)


def _clamp_key_scales(cache, heads: int, head_dim: int, page_entries: int, low: int,
                      high: int) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """Clamp every key scale byte of the cache's pages into [low, high], in place."""
    layout = cache_layout(heads, head_dim, page_entries)
    for page in range(cache.kv_cache.shape[0]):
        values, scales = unpack_page(cache.kv_cache[page], layout, head_dim)
        clamped = scales.clamp(low, high)
        cache.kv_cache[page, : layout.page_bytes] = pack_page(values, clamped, layout)


def _dense(precision: str, backend: str, cache, queries, row_ends, width, extra):  # type: ignore[no-untyped-def]
    q, q_scale, weights = queries
    out = torch.full((q.shape[0], width), NAN)
    args = [q, q_scale, cache.kv_cache, weights, cache.context_lens, cache.block_table, row_ends]
    if backend == "triton":
        args = on_triton_device(*args)  # type: ignore[assignment]
        (out,) = on_triton_device(out)
        extra = {k: v.to(TRITON_DEVICE) if isinstance(v, torch.Tensor) else v
                 for k, v in extra.items()}  # fmt: skip
    ops.paged_mqa_logits(*args, out, page_entries=cache.page_entries, backend=backend,
                         precision=precision, **extra)  # fmt: skip
    return out.cpu()


@pytest.mark.parametrize("spread", ["narrow", "wide"])
@pytest.mark.parametrize("case", [case[:5] for case in DENSE_CASES])
def test_dense_fp8_matches_reference(
    gen: torch.Generator, case: tuple[str, list[int], int, int, int], spread: str
) -> None:
    """Narrow: key scales 2**-3 .. 2**4 and query scales 2**-6 .. 2**4, inside every key
    walk's window (its reference is the first tile's largest + 3) and every head's spread:
    the fp8 results are the ones kept; wide: scales 2**-7 .. 2**5, so walks and programs are
    rescored exactly. `case`: the grouping, sizes, heads, head_dim and page_entries of a
    DENSE_CASES row."""
    kind, sizes, heads, head_dim, page_entries = case
    rows, num_seqs, extra = grouping(kind, sizes)
    contexts = [int(c) for c in torch.randint(0, 90, (num_seqs,), generator=gen)]
    contexts[0] = 85
    cache = make_cache(gen, contexts, num_heads=heads, head_dim=head_dim, page_entries=page_entries)
    q, q_scale, weights = make_queries(gen, rows, heads, head_dim)
    if spread == "narrow":
        q_scale = q_scale.clamp(121, 131)
        _clamp_key_scales(cache, heads, head_dim, page_entries, 124, 131)
    row_ends = torch.randint(-3, 95, (rows,), generator=gen).to(torch.int32)
    want = _dense("exact", "reference", cache, (q, q_scale, weights), row_ends, 72, extra)
    fp8_reference = _dense("fp8", "reference", cache, (q, q_scale, weights), row_ends, 72, extra)
    assert torch.equal(want.nan_to_num(), fp8_reference.nan_to_num())
    got = _dense("fp8", "triton", cache, (q, q_scale, weights), row_ends, 72, extra)
    _assert_fp8_match(got, want)


def test_dense_fp8_nan_scales_propagate(gen: torch.Generator) -> None:
    """A 0xFF scale in a key or a query head makes the same logits NaN as the exact mode."""
    rows, _, extra = grouping("next_n", [3, 2])
    cache = make_cache(gen, [40, 33, 17], num_heads=4, head_dim=64, page_entries=32)
    q, q_scale, weights = make_queries(gen, rows, 4, 64)
    q_scale = q_scale.clamp(121, 131)
    q_scale[3, 1, 0] = 255
    page = int(cache.block_table[0, 0])
    scales_start = 32 * 32  # page_entries x D/2 code bytes, then the scales
    cache.kv_cache[page, scales_start + 5] = 255
    row_ends = torch.full((rows,), 64, dtype=torch.int32)
    want = _dense("exact", "reference", cache, (q, q_scale, weights), row_ends, 48, extra)
    got = _dense("fp8", "triton", cache, (q, q_scale, weights), row_ends, 48, extra)
    assert bool(want.isnan().any())
    _assert_fp8_match(got, want)


def test_dense_fp8_rescores_keys_outside_the_first_tiles_window(gen: torch.Generator) -> None:
    """A walk's e4m3 keys share the exponent reference of its first tile: keys far larger
    later in the walk (each one uniform, so a per-key check would hold them) must still come
    out exact, through the walk's exact rescoring."""
    rows, _, extra = grouping("next_n", [1, 2])
    page_entries, head_dim = 32, 64
    cache = make_cache(gen, [85], num_heads=4, head_dim=head_dim, page_entries=page_entries)
    q, q_scale, weights = make_queries(gen, rows, 4, head_dim)
    q_scale = q_scale.clamp(121, 131)
    layout = cache_layout(4, head_dim, page_entries)
    for index in range(cdiv(85, page_entries)):
        page = int(cache.block_table[0, index])
        values, scales = unpack_page(cache.kv_cache[page], layout, head_dim)
        position = index * page_entries + torch.arange(page_entries)
        scales[:] = torch.where(position < 40, 121, 131).to(torch.uint8)[:, None]
        cache.kv_cache[page, : layout.page_bytes] = pack_page(values, scales, layout)
    row_ends = torch.full((rows,), 85, dtype=torch.int32)
    want = _dense("exact", "reference", cache, (q, q_scale, weights), row_ends, 96, extra)
    got = _dense("fp8", "triton", cache, (q, q_scale, weights), row_ends, 96, extra)
    _assert_fp8_match(got, want)


@pytest.mark.parametrize("kind", ["next_n", "qsl"])
def test_gather_fp8_matches_reference(gen: torch.Generator, kind: str) -> None:
    sizes = [2, 2] if kind == "next_n" else [2, 0, 3]
    size, pool_blocks, heads, head_dim = 4, 12, 8, 128
    rows, num_seqs, extra = grouping(kind, sizes)
    contexts = [int(c) for c in torch.randint(20, 60, (num_seqs,), generator=gen)]
    cache = make_cache(gen, contexts, num_heads=heads, head_dim=head_dim, page_entries=16)
    # Key scales inside every walk's window: the fp8 results are the ones kept.
    _clamp_key_scales(cache, heads, head_dim, 16, 124, 131)
    q, q_scale, weights = make_queries(gen, rows, heads, head_dim)
    q_scale = q_scale.clamp(121, 131)
    seqs = (
        [r // 2 for r in range(rows)]
        if kind == "next_n"
        else [s for s, n in enumerate(sizes) for _ in range(n)]
    )
    block_ids = torch.full((rows, pool_blocks), -1, dtype=torch.int32)
    for r in range(rows):
        blocks = -(-contexts[seqs[r]] // size)
        chosen = torch.randperm(blocks, generator=gen)[:pool_blocks]
        block_ids[r, : chosen.numel()] = chosen.to(torch.int32)
    row_ends = torch.tensor([contexts[s] for s in seqs], dtype=torch.int32)
    positions = torch.empty((rows, pool_blocks), dtype=torch.int32)
    live = torch.empty(rows, dtype=torch.int32)
    ops.resolve_candidate_pool(block_ids, row_ends, size, positions, live, backend="reference")
    outs = {}
    for backend, precision in (("reference", "exact"), ("triton", "fp8")):
        args = [q, q_scale, cache.kv_cache, weights, cache.context_lens, cache.block_table,
                positions, live, torch.full((rows, pool_blocks * size), NAN)]  # fmt: skip
        kwargs = dict(extra)
        if backend == "triton":
            args = on_triton_device(*args)  # type: ignore[assignment]
            kwargs = {k: v.to(TRITON_DEVICE) if isinstance(v, torch.Tensor) else v
                      for k, v in kwargs.items()}  # fmt: skip
        ops.gather_mqa_logits(*args, candidate_block_size=size, clean=True,
                              page_entries=16, backend=backend, precision=precision,
                              **kwargs)  # fmt: skip
        outs[backend] = args[-1].cpu()
    _assert_fp8_match(outs["triton"], outs["reference"])


@pytest.mark.parametrize(
    ("heads_pad", "rows", "precision", "want"),
    [
        (64, 2, "fp8", (168, False, True)),  # H64 decode, N = 128: one MMA, 3 programs per SM
        (32, 2, "fp8", (128, False, True)),  # H32 decode, N = 64
        (16, 2, "fp8", (None, False, False)),  # N = 32: not measured, the exact mode's config
        (64, 2, "exact", (128, True, True)),
        (32, 2, "exact", (None, False, False)),
    ],
)  # fmt: skip
def test_decode_default_config_per_precision_on_nvidia(
    monkeypatch: pytest.MonkeyPatch, heads_pad: int, rows: int, precision: str,
    want: tuple[int | None, bool, bool],
) -> None:  # fmt: skip
    """The shape-chosen decode config on NVIDIA: (register cap, halves, L2 prefetch) per
    precision, as measured on the H200 (BENCHMARKS.md, "fp8 precision")."""
    from graphidx.ops.kernels import OPERANDS_BF16X2
    from graphidx.ops.kernels import logits as triton_logits

    monkeypatch.setattr(triton_logits, "operand_mode", lambda: OPERANDS_BF16X2)
    config = triton_logits.default_config(triton_logits.GROUP_FIXED, heads_pad, rows, 1, 64,
                                          precision)  # fmt: skip
    assert (config.max_registers, config.halves, config.l2_prefetch) == want
    assert config.block_n == 64 and config.prefetch


# ---------------------------------------------------------------------------------------
# Resolution.
# ---------------------------------------------------------------------------------------


def test_resolve_precision() -> None:
    cpu = torch.device("cpu")
    assert resolve_precision(None, "reference", cpu) == "exact"
    assert resolve_precision("fp8", "reference", cpu) == "fp8"
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("bf16", "reference", cpu)
    with pytest.raises(ValueError, match="not available on backend 'aiter'"):
        resolve_precision("fp8", "aiter", cpu)
    if INTERPRETED:
        assert resolve_precision("fp8", "triton", cpu) == "fp8"


@pytest.mark.parametrize(("scale", "weight"), [(127, 2.0**105), (254, 1.0), (253, 1.0)])
def test_dense_fp8_extremes_match_exact(gen: torch.Generator, scale: int, weight: float) -> None:
    """Every code 6 at 64 heads: a huge weight whose factored value the fp8 sum could not
    hold takes the exact path (finite, as exact); keys of +6 and -6 at scale bytes 253 /
    254, whose exact decode overflows float32 to +-inf (NaN scores), take it too."""
    heads, dim, entries = 64, 128, 32
    rows, _, extra = grouping("next_n", [2, 2])
    cache = make_cache(gen, [32, 32], num_heads=heads, head_dim=dim, page_entries=entries)
    codes = entries * dim // 2
    for page in cache.block_table[:, 0].tolist():
        cache.kv_cache[page, :codes] = 0x77 if scale == 127 else 0xF7  # +6 (and -6)
        cache.kv_cache[page, codes : codes + entries * dim // 32] = scale
    q = torch.full((rows, heads, dim // 2), 0x77, dtype=torch.uint8)
    q_scale = torch.full((rows, heads, dim // 32), 127, dtype=torch.uint8)
    weights = torch.full((rows, heads), weight)
    row_ends = torch.full((rows,), 32, dtype=torch.int32)
    want = _dense("exact", "reference", cache, (q, q_scale, weights), row_ends, 32, extra)
    got = _dense("fp8", "triton", cache, (q, q_scale, weights), row_ends, 32, extra)
    if scale == 127:
        assert bool(want.isfinite().all())
    _assert_fp8_match(got, want)
