"""The Triton backend of every op against the torch reference (docs/contract.md sections 5.1-5.6).

Runs under the Triton interpreter on a CPU (tests/conftest.py sets TRITON_INTERPRET=1), so
shapes are small. On a GPU machine the tests in `GPU_READY` run the kernels on the GPU
(inputs copied there, the reference on the CPU): they cover the code only the GPU compiles
(bf16 operands, packed-bf16 key decode); the others build CPU tensors and are skipped there.
Outputs are poisoned (NaN, or a sentinel int) before each call; the paged
cache has shuffled pages, a page stride wider than a page, and 0xFF in every unwritten byte
(0xFF scales decode to NaN, so a stray read that reaches a compared column shows up as NaN,
and block-table entries past a seq's pages point outside the cache). Unwritten slots of a
live page may be read on purpose (the prefetch's partial tile) but are never written out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import pytest
import torch

from graphidx.config import cdiv
from graphidx.mxfp4 import cache_layout, pack_page

ops = pytest.importorskip("graphidx.ops")
pytest.importorskip("triton")
INTERPRETED = ops.backend.triton_interpreted()
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET or a GPU", allow_module_level=True)
TRITON_DEVICE = "cpu" if INTERPRETED else "cuda"
GPU_READY = {
    "test_dense_logits_match_reference",
    "test_dense_nan_scale_propagates",
    "test_dense_extreme_scales",
    "test_dense_logits_mma_shaped_tile_loads",
    "test_bf16x2_key_decode_is_exact",
    "test_bf16_pair_codes_equal_the_plain_form",
    "test_bf16x2_decode_matches_float32_decode_on_gpu",
    "test_gather_logits_match_reference",
    "test_dense_prefill_mma_shaped_tile_loads",
    "test_logits_config_refused",
    "test_gather_config_refused",
    "test_gather_default_config_on_nvidia",
    "test_dense_logits_halves",
    "test_misaligned_kv_cache_refused",
    "test_cache_words_checks_the_data_pointer",
    "test_tile_decode_follows_kernel_order",
    "test_dense_default_config_at_128_columns",
}


@pytest.fixture(autouse=True)
def _interpreter_unless_gpu_ready(request: pytest.FixtureRequest) -> None:
    if not INTERPRETED and request.node.originalname not in GPU_READY:
        pytest.skip("builds CPU tensors for the interpreter (set TRITON_INTERPRET=1)")


def on_triton_device(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors on the device the triton backend runs on (CPU under the interpreter)."""
    return [None if t is None else t.to(TRITON_DEVICE) for t in tensors]


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from graphidx.ops.kernels.mxfp4_tl import (  # noqa: E402
    bf16_pair_codes,
    bf16x2_scale_factors,
    dequantize_keys_bf16x2,
    dequantize_tile,
    key_tiling,
    nibble_pairs,
    tile_lines,
)
from graphidx.ops.kernels.topk import TopkConfig  # noqa: E402
from graphidx.ops.kernels.topk import topk_per_row as triton_topk_per_row  # noqa: E402


@triton.jit
def _pair_bits_kernel(words_ptr, scales_ptr, out_ptr, N: tl.constexpr):
    """Pair 0 of `bf16_pair_codes` for N words [N // 4, 1, 1, 4] and the scale factors of N
    scale bytes."""
    m = tl.arange(0, N // 4)[:, None, None, None]
    t = tl.arange(0, 4)[None, None, None, :]
    codes = bf16_pair_codes(tl.load(words_ptr + m * 4 + t))  # [N // 4, 1, 1, pair, t]
    pair0 = tl.sum(tl.where(tl.arange(0, 4)[None, None, None, :, None] == 0, codes, 0), axis=3)
    tl.store(out_ptr + m * 4 + t, pair0)
    i = tl.arange(0, N)
    low, high = bf16x2_scale_factors(tl.load(scales_ptr + i))
    tl.store(out_ptr + N + i, low)
    tl.store(out_ptr + 2 * N + i, high)


@triton.jit
def _pair_codes_kernel(words_ptr, fast_ptr, plain_ptr, N: tl.constexpr):
    """`bf16_pair_codes` and the plain form `(nibble_pairs * multiplier) & mask` of N words."""
    m = tl.arange(0, N // 16)[:, None, None, None]
    w = tl.arange(0, 4)[None, None, :, None]
    t = tl.arange(0, 4)[None, None, None, :]
    words = tl.load(words_ptr + m * 16 + w * 4 + t)  # [N // 16, 1, 4, 4]
    pair = tl.arange(0, 4)[None, None, None, :, None]
    lane = tl.arange(0, 4)[None, None, None, None, :]
    out = m[:, :, :, :, None] * 64 + w[:, :, :, :, None] * 16 + pair * 4 + lane
    tl.store(fast_ptr + out, bf16_pair_codes(words))
    tl.store(plain_ptr + out, (nibble_pairs(words) * 0x1040) & -0x7E3F7E40)


@triton.jit
def _test_tile(words_ptr, scales_ptr):
    """Rows of 4 runs (t) of 4 words each, every run under one scale, and the [1024, 128]
    output offsets of their decoded elements."""
    row = tl.arange(0, 1024)[:, None, None, None]
    w = tl.arange(0, 4)[None, None, :, None]
    run = tl.arange(0, 4)[None, None, None, :]
    words = tl.load(words_ptr + row * 16 + run * 4 + w)
    scales = tl.load(scales_ptr + row * 4 + run)
    return words, scales, tl.arange(0, 1024)[:, None] * 128 + tl.arange(0, 128)[None, :]


@triton.jit
def _both_decodes_kernel(words_ptr, scales_ptr, bf16x2_ptr, float32_ptr):
    words, scales, out = _test_tile(words_ptr, scales_ptr)
    tl.store(bf16x2_ptr + out, dequantize_keys_bf16x2(words, scales).to(tl.float32))
    tl.store(float32_ptr + out, dequantize_tile(words, scales))


@triton.jit
def _float32_decode_kernel(words_ptr, scales_ptr, float32_ptr):
    words, scales, out = _test_tile(words_ptr, scales_ptr)
    tl.store(float32_ptr + out, dequantize_tile(words, scales))


NAN = float("nan")
NEG_INF = float("-inf")
SENTINEL = -777


# ---------------------------------------------------------------------------------------
# Inputs.
# ---------------------------------------------------------------------------------------


@dataclass
class Cache:
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    page_entries: int


def make_cache(
    gen: torch.Generator, contexts: list[int], *, num_heads: int, head_dim: int, page_entries: int
) -> Cache:
    """Random MXFP4 keys (every e2m1 code, scales 2**-7 .. 2**5) in shuffled pages."""
    layout = cache_layout(num_heads, head_dim, page_entries)
    pages_per_seq = [cdiv(c, page_entries) for c in contexts]
    num_pages = sum(pages_per_seq) + 2
    storage = torch.full((num_pages, layout.page_bytes + 40), 0xFF, dtype=torch.uint8)
    kv_cache = storage[:, : layout.page_bytes + 8]
    order = torch.randperm(num_pages, generator=gen)
    max_blocks = max(pages_per_seq, default=0) + 2
    block_table = torch.full((len(contexts), max_blocks), 10**6, dtype=torch.int32)
    used = 0
    for s, context in enumerate(contexts):
        for column in range(pages_per_seq[s]):
            page = int(order[used])
            used += 1
            block_table[s, column] = page
            live = min(page_entries, context - column * page_entries)
            values = torch.full((page_entries, head_dim // 2), 0xFF, dtype=torch.uint8)
            scales = torch.full((page_entries, head_dim // 32), 0xFF, dtype=torch.uint8)
            values[:live] = torch.randint(0, 256, (live, head_dim // 2), generator=gen).to(
                torch.uint8
            )
            scales[:live] = torch.randint(120, 133, (live, head_dim // 32), generator=gen).to(
                torch.uint8
            )
            kv_cache[page, : layout.page_bytes] = pack_page(values, scales, layout)
    return Cache(kv_cache, block_table, torch.tensor(contexts, dtype=torch.int32), page_entries)


def make_queries(
    gen: torch.Generator, rows: int, num_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 256, (rows, num_heads, head_dim // 2), generator=gen).to(torch.uint8)
    q_scale = torch.randint(120, 133, (rows, num_heads, head_dim // 32), generator=gen).to(
        torch.uint8
    )
    weights = torch.randn(rows, num_heads, generator=gen)
    return q, q_scale, weights


def grouping(kind: str, sizes: list[int]) -> tuple[int, int, dict[str, object]]:
    """(rows, num_seqs, kwargs) for a row grouping: 'qsl' sizes, 'next_n' n, or 'flat' n."""
    if kind == "qsl":
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        qsl = torch.tensor(bounds, dtype=torch.int32)
        return bounds[-1], len(sizes), {"query_start_loc": qsl}
    seqs, next_n = sizes
    if kind == "next_n":
        return seqs * next_n, seqs, {"next_n": next_n}
    return seqs, seqs, {}


def seq_of_rows(kind: str, sizes: list[int], rows: int) -> list[int]:
    if kind == "qsl":
        return [s for s, size in enumerate(sizes) for _ in range(size)]
    if kind == "next_n":
        return [r // sizes[1] for r in range(rows)]
    return list(range(rows))


def row_lengths(
    row_ends: torch.Tensor, contexts: list[int], seqs: list[int], width: int
) -> list[int]:
    return [max(0, min(int(row_ends[r]), contexts[seqs[r]], width)) for r in range(len(seqs))]


def assert_logits_match(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same NaN/inf pattern; finite values equal up to float32 summation order."""
    assert torch.equal(got.isnan(), want.isnan()), "written / NaN columns differ"
    assert torch.equal(got.isinf(), want.isinf()), "-inf / +inf columns differ"
    finite = want.isfinite()
    scale = float(want[finite].abs().max()) if finite.any() else 1.0
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-6 * max(scale, 1.0))


# ---------------------------------------------------------------------------------------
# Dense logits.
# ---------------------------------------------------------------------------------------


def run_dense(
    backend: str,
    cache: Cache,
    queries: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    row_ends: torch.Tensor,
    width: int,
    extra: dict[str, object],
    *,
    block_size: int = 0,
    block_cols: int = 0,
    clean: bool = False,
    schedule: torch.Tensor | None = None,
    config: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    q, q_scale, weights = queries
    out = torch.full((q.shape[0], width), NAN)
    block_scores = torch.full((q.shape[0], block_cols), NAN) if block_size else None
    args = [q, q_scale, cache.kv_cache, weights, cache.context_lens, cache.block_table, row_ends]
    if backend == "triton" and TRITON_DEVICE != "cpu":
        args = on_triton_device(*args)  # type: ignore[assignment]
        out, block_scores, schedule = on_triton_device(out, block_scores, schedule)
        extra = {k: v.to(TRITON_DEVICE) if isinstance(v, torch.Tensor) else v
                 for k, v in extra.items()}  # fmt: skip
    if config is not None:
        from graphidx.ops.kernels.logits import paged_mqa_logits as triton_logits

        triton_logits(*args, out, schedule=schedule, block_scores=block_scores,  # type: ignore
                      candidate_block_size=block_size, clean=clean,
                      page_entries=cache.page_entries, config=config, **extra)  # fmt: skip
        return out.cpu(), None if block_scores is None else block_scores.cpu()
    ops.paged_mqa_logits(
        *args,
        out,
        schedule=schedule,
        block_scores=block_scores,
        candidate_block_size=block_size,
        clean=clean,
        page_entries=cache.page_entries,
        backend=backend,
        **extra,
    )
    return out.cpu(), None if block_scores is None else block_scores.cpu()


DENSE_CASES = [
    # kind, sizes, heads, head_dim, page_entries, block size C, clean
    ("next_n", [3, 1], 4, 64, 32, 8, False),
    ("next_n", [3, 2], 4, 64, 32, 16, True),
    ("next_n", [2, 3], 8, 128, 16, 8, False),
    ("next_n", [2, 4], 4, 64, 32, 0, True),
    ("flat", [5, 1], 8, 128, 16, 8, True),
    ("flat", [4, 1], 4, 64, 64, 0, False),
    ("flat", [3, 1], 4, 256, 16, 8, False),  # two 16-byte runs per thread group
    ("qsl", [3, 0, 6, 1, 0, 2], 4, 64, 32, 8, True),
    ("qsl", [5, 2], 8, 128, 16, 0, False),
]


@pytest.mark.parametrize(
    ("kind", "sizes", "heads", "head_dim", "page_entries", "block_size", "clean"), DENSE_CASES
)
def test_dense_logits_match_reference(
    gen: torch.Generator,
    kind: str,
    sizes: list[int],
    heads: int,
    head_dim: int,
    page_entries: int,
    block_size: int,
    clean: bool,
) -> None:
    rows, num_seqs, extra = grouping(kind, sizes)
    contexts = [int(c) for c in torch.randint(0, 90, (num_seqs,), generator=gen)]
    contexts[0] = 85  # wider than the output: the width clamp matters
    width = 72
    cache = make_cache(gen, contexts, num_heads=heads, head_dim=head_dim, page_entries=page_entries)
    queries = make_queries(gen, rows, heads, head_dim)
    # R-like ragged ends: some past the context, some short, one negative, one zero.
    row_ends = torch.randint(-3, 95, (rows,), generator=gen).to(torch.int32)
    block_cols = cdiv(width, block_size) + 2 if block_size else 0
    want, want_bs = run_dense(
        "reference", cache, queries, row_ends, width, extra,
        block_size=block_size, block_cols=block_cols, clean=clean,
    )  # fmt: skip
    got, got_bs = run_dense(
        "triton", cache, queries, row_ends, width, extra,
        block_size=block_size, block_cols=block_cols, clean=clean,
    )  # fmt: skip
    assert_logits_match(got, want)
    if block_size:
        assert got_bs is not None and want_bs is not None
        seqs = seq_of_rows(kind, sizes, rows)
        lengths = row_lengths(row_ends, contexts, seqs, width)
        for r, n in enumerate(lengths):
            written = cdiv(n, block_size)
            assert_logits_match(got_bs[r, :written], want_bs[r, :written])
            tail = got_bs[r, written:]
            # Past the row's blocks: -inf when cleaned, else untouched.
            assert bool((tail == NEG_INF).all() if clean else tail.isnan().all()), (r, n)


@pytest.mark.parametrize("scheduled", [False, True])
def test_dense_native_rows_split_into_row_blocks(gen: torch.Generator, scheduled: bool) -> None:
    """next_n wider than the tile's rows: each seq's rows are scored in several blocks."""
    from graphidx.ops.kernels.logits import LogitsConfig
    from graphidx.ops.kernels.logits import paged_mqa_logits as triton_logits
    from graphidx.ops.schedule import allocate_schedule, build_decode_schedule

    next_n, contexts, width = 3, [40, 0, 25], 48
    rows = next_n * len(contexts)
    cache = make_cache(gen, contexts, num_heads=4, head_dim=64, page_entries=32)
    q, q_scale, weights = make_queries(gen, rows, 4, 64)
    row_ends = torch.randint(0, 45, (rows,), generator=gen).to(torch.int32)
    want, _ = run_dense("reference", cache, (q, q_scale, weights), row_ends, width,
                        {"next_n": next_n})  # fmt: skip
    schedule = None
    if scheduled:
        schedule = allocate_schedule(len(contexts), width, "cpu", split_keys=256)
        build_decode_schedule(row_ends, schedule, next_n=next_n, split_keys=256)
    got = torch.full((rows, width), NAN)
    triton_logits(
        q, q_scale, cache.kv_cache, weights, cache.context_lens, cache.block_table, row_ends,
        got, next_n=next_n, schedule=schedule, page_entries=cache.page_entries,
        config=LogitsConfig(block_n=16, block_r=2, num_warps=4, num_stages=1),
    )  # fmt: skip
    assert_logits_match(got, want)


def test_dense_nan_scale_propagates(gen: torch.Generator) -> None:
    cache = make_cache(gen, [40, 20], num_heads=4, head_dim=64, page_entries=32)
    layout = cache_layout(4, 64, 32)
    from graphidx.mxfp4 import entry_offsets

    _, scale_offsets = entry_offsets(layout)
    page = int(cache.block_table[0, 0])
    cache.kv_cache[page, int(scale_offsets[5, 1])] = 0xFF  # key 5 of seq 0: NaN block
    queries = make_queries(gen, 2, 4, 64)
    row_ends = torch.tensor([40, 20], dtype=torch.int32)
    args = ("flat", [2, 1])
    _, _, extra = grouping(*args)
    want, want_bs = run_dense(
        "reference", cache, queries, row_ends, 48, extra, block_size=8, block_cols=6
    )
    got, got_bs = run_dense(
        "triton", cache, queries, row_ends, 48, extra, block_size=8, block_cols=6
    )
    assert bool(want[0, 5].isnan())
    assert_logits_match(got, want)
    assert got_bs is not None and want_bs is not None
    assert_logits_match(got_bs[:, :3], want_bs[:, :3])


def test_dense_extreme_scales(gen: torch.Generator) -> None:
    """Scale bytes at both ends of e8m0, per 32-element block: keys scaled 2**-127 / 2**-126
    (their elements below 2**-126 are subnormal in float32 and bf16) against queries scaled
    2**125; keys of 2**125 against queries of 2**-125 / 2**-124; queries of 2**-127 /
    2**-126 against keys of 2**125. Every product stays a normal float32, so kernel and
    reference must agree."""
    heads, head_dim, page_entries = 4, 128, 64
    contexts = [150, 70]
    cache = make_cache(gen, contexts, num_heads=heads, head_dim=head_dim, page_entries=page_entries)
    layout = cache_layout(heads, head_dim, page_entries)
    from graphidx.mxfp4 import entry_offsets

    _, scale_offsets = entry_offsets(layout)  # [entries, D / 32] byte offsets in a page
    for s, context in enumerate(contexts):
        for column in range(cdiv(context, page_entries)):
            page = cache.kv_cache[int(cache.block_table[s, column])]
            tiny = torch.randint(0, 2, (page_entries,), generator=gen).to(torch.uint8)
            page[scale_offsets[:, 0].long()] = tiny  # block 0: 2**-127 or 2**-126
            page[scale_offsets[:, 1].long()] = 252  # block 1: 2**125
            page[scale_offsets[:, 2].long()] = 252  # block 2: 2**125
    rows = 4
    q, q_scale, weights = make_queries(gen, rows, heads, head_dim)
    q_scale[:, :, 0] = 252
    q_scale[:, :, 1] = torch.randint(2, 4, (rows, heads), generator=gen).to(torch.uint8)
    q_scale[:, :, 2] = torch.randint(0, 2, (rows, heads), generator=gen).to(torch.uint8)
    row_ends = torch.tensor([150, 149, 70, 69], dtype=torch.int32)
    extra = {"next_n": 2}
    want, _ = run_dense("reference", cache, (q, q_scale, weights), row_ends, 160, extra)
    got, _ = run_dense("triton", cache, (q, q_scale, weights), row_ends, 160, extra)
    for r, end in enumerate(row_ends.tolist()):
        assert bool(want[r, :end].isfinite().all())  # the test is about numbers, not NaN
    assert_logits_match(got, want)


@pytest.mark.parametrize(
    ("block_n", "page_entries", "heads", "head_dim", "prefetch"),
    [
        (64, 64, 4, 128, "none"),
        (64, 64, 4, 128, "registers"),  # a seq's span ends on a page boundary: the clamp
        (64, 64, 4, 128, "l2"),
        (64, 128, 8, 64, "registers"),
        (64, 128, 8, 64, "l2"),  # two tiles per page
        (128, 128, 4, 256, "none"),
    ],
)
def test_dense_logits_mma_shaped_tile_loads(
    gen: torch.Generator,
    block_n: int,
    page_entries: int,
    heads: int,
    head_dim: int,
    prefetch: str,
) -> None:
    """4 warps and one page per tile: keys load straight in the tensor-core operand's thread
    layout (`key_tile_words_mma`), full tiles and masked tails alike, without a prefetch,
    with the next tile in registers, and with the tile after it into L2 as well (its pages
    read two tiles ahead)."""
    from graphidx.ops.kernels.logits import LogitsConfig, uses_mma_rows
    from graphidx.ops.kernels.logits import paged_mqa_logits as triton_logits

    config = LogitsConfig(
        block_n=block_n, block_r=2, num_warps=4, num_stages=1 if prefetch != "none" else 2,
        prefetch=prefetch != "none", l2_prefetch=prefetch == "l2",
    )  # fmt: skip
    assert uses_mma_rows(config, page_entries)
    # Spans: two full tiles and a partial one; exactly one page; a partial first tile.
    next_n, contexts, width = 2, [block_n * 2 + 37, page_entries, 5], block_n * 3
    rows = next_n * len(contexts)
    cache = make_cache(gen, contexts, num_heads=heads, head_dim=head_dim, page_entries=page_entries)
    q, q_scale, weights = make_queries(gen, rows, heads, head_dim)
    row_ends = torch.tensor(
        [c - (next_n - 1 - j) for c in contexts for j in range(next_n)], dtype=torch.int32
    )
    want, want_bs = run_dense(
        "reference", cache, (q, q_scale, weights), row_ends, width, {"next_n": next_n},
        block_size=16, block_cols=width // 16,
    )  # fmt: skip
    got, got_bs, *args = on_triton_device(
        torch.full((rows, width), NAN), torch.full((rows, width // 16), NAN),
        q, q_scale, cache.kv_cache, weights, cache.context_lens, cache.block_table, row_ends,
    )  # fmt: skip
    triton_logits(
        *args, got, next_n=next_n, page_entries=cache.page_entries,  # type: ignore[arg-type]
        block_scores=got_bs, candidate_block_size=16, config=config,
    )  # fmt: skip
    assert got is not None and got_bs is not None
    got, got_bs = got.cpu(), got_bs.cpu()
    assert_logits_match(got, want)
    assert want_bs is not None
    for r in range(rows):
        written = cdiv(max(0, min(int(row_ends[r]), width)), 16)
        assert_logits_match(got_bs[r, :written], want_bs[r, :written])


@pytest.mark.parametrize("kind", ["next_n", "next_n_schedule", "qsl"])
def test_dense_logits_halves(gen: torch.Generator, kind: str) -> None:
    """`LogitsConfig.halves`: each tile's two MMAs over the first and the second half of the
    row block give the reference's logits and block scores (decode next_n 4 with 2-row
    halves on the static grid and through a schedule; prefill blocks of 4 rows over seqs of
    5 / 0 / 9 rows; all with the register prefetch)."""
    from graphidx.ops.kernels.logits import LogitsConfig
    from graphidx.ops.schedule import allocate_schedule, build_decode_schedule

    decode = kind != "qsl"
    config = LogitsConfig(block_n=64, block_r=4, num_warps=4, num_stages=1, max_registers=None,
                          prefetch=True, halves=True)  # fmt: skip
    schedule = None
    if decode:
        contexts, next_n = [150, 64, 3], 4
        rows, extra = len(contexts) * next_n, {"next_n": next_n}
        row_ends = torch.tensor(
            [c - (next_n - 1 - j) for c in contexts for j in range(next_n)], dtype=torch.int32
        )
    else:
        contexts = [131, 40, 192]
        rows, _, extra = grouping("qsl", [5, 0, 9])
        seqs = seq_of_rows("qsl", [5, 0, 9], rows)
        row_ends = torch.tensor(
            [contexts[s] - (rows - 1 - r) % 7 for r, s in enumerate(seqs)], dtype=torch.int32
        )
    if kind == "next_n_schedule":
        schedule = allocate_schedule(len(contexts), 208, "cpu", split_keys=256)
        build_decode_schedule(row_ends, schedule, next_n=4, split_keys=256, backend="reference")
    cache = make_cache(gen, contexts, num_heads=4, head_dim=128, page_entries=64)
    queries = make_queries(gen, rows, 4, 128)
    blocks = {"block_size": 16, "block_cols": 208 // 16}
    want, want_bs = run_dense("reference", cache, queries, row_ends, 208, extra, **blocks)
    got, got_bs = run_dense("triton", cache, queries, row_ends, 208, extra, config=config,
                            schedule=schedule, **blocks)  # fmt: skip
    assert_logits_match(got, want)
    assert want_bs is not None and got_bs is not None
    for r in range(rows):
        written = cdiv(max(0, min(int(row_ends[r]), 208)), 16)
        assert_logits_match(got_bs[r, :written], want_bs[r, :written])


def test_dense_default_config_at_128_columns(gen: torch.Generator) -> None:
    """64 heads, next_n 2: N = 128 columns, where the GPU default caps registers at 128 and
    splits each tile in halves (`default_config`), static grid and schedule, against the
    reference (with block scores)."""
    from graphidx.ops.schedule import allocate_schedule, build_decode_schedule

    contexts, next_n, width = [300, 64, 5], 2, 320
    rows, extra = len(contexts) * next_n, {"next_n": next_n}
    row_ends = torch.tensor(
        [c - (next_n - 1 - j) for c in contexts for j in range(next_n)], dtype=torch.int32
    )
    cache = make_cache(gen, contexts, num_heads=64, head_dim=128, page_entries=64)
    queries = make_queries(gen, rows, 64, 128)
    schedule = allocate_schedule(len(contexts), width, "cpu", split_keys=256)
    build_decode_schedule(row_ends, schedule, next_n=next_n, split_keys=256, backend="reference")
    blocks = {"block_size": 16, "block_cols": width // 16}
    want, want_bs = run_dense("reference", cache, queries, row_ends, width, extra, **blocks)
    for plan in (None, schedule):
        got, got_bs = run_dense("triton", cache, queries, row_ends, width, extra,
                                schedule=plan, **blocks)  # fmt: skip
        assert_logits_match(got, want)
        assert want_bs is not None and got_bs is not None
        for r in range(rows):
            written = cdiv(max(0, min(int(row_ends[r]), width)), 16)
            assert_logits_match(got_bs[r, :written], want_bs[r, :written])


@pytest.mark.parametrize("prefetch", [False, True])
def test_dense_prefill_mma_shaped_tile_loads(gen: torch.Generator, prefetch: bool) -> None:
    """Prefill row blocks (query_start_loc, seqs of 5 / 0 / 9 rows) through the operand-layout
    loads, with and without the register prefetch (the default when tiles lie within a
    page): unaligned seq heads, causal ends inside and on tile boundaries."""
    from graphidx.ops.kernels.logits import LogitsConfig, uses_mma_rows

    config = LogitsConfig(block_n=64, block_r=4, num_warps=4, num_stages=1, max_registers=None,
                          prefetch=prefetch)  # fmt: skip
    assert uses_mma_rows(config, 64)
    rows, _, extra = grouping("qsl", [5, 0, 9])
    contexts = [131, 40, 192]
    cache = make_cache(gen, contexts, num_heads=4, head_dim=128, page_entries=64)
    queries = make_queries(gen, rows, 4, 128)
    seqs = seq_of_rows("qsl", [5, 0, 9], rows)
    row_ends = torch.tensor(
        [contexts[s] - (rows - 1 - r) % 7 for r, s in enumerate(seqs)], dtype=torch.int32
    )
    want, _ = run_dense("reference", cache, queries, row_ends, 200, extra)
    got, _ = run_dense("triton", cache, queries, row_ends, 200, extra, config=config)
    assert_logits_match(got, want)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_n", 48),
        ("block_r", 3),
        ("num_warps", 2),
        ("num_stages", 0),
        ("programs_per_sm", 0),
        ("max_registers", 300),
        ("prefetch", True),  # block_n 64 does not divide page_entries 32
        ("halves", True),  # with block_r 1
        ("l2_prefetch", True),  # without prefetch
    ],
)
def test_logits_config_refused(gen: torch.Generator, field: str, value: object) -> None:
    """A config the kernels cannot run raises ValueError naming the field, before launch."""
    from graphidx.ops.kernels.logits import LogitsConfig

    block_r = 1 if field == "halves" else 2
    config = replace(LogitsConfig(block_n=64, block_r=block_r, num_warps=4, num_stages=1),
                     **{field: value})  # fmt: skip
    cache = make_cache(gen, [40], num_heads=4, head_dim=64, page_entries=32)
    queries = make_queries(gen, 2, 4, 64)
    row_ends = torch.tensor([40, 39], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"config.{field}"):
        run_dense("triton", cache, queries, row_ends, 48, {"next_n": 2}, config=config)


def test_misaligned_kv_cache_refused(gen: torch.Generator) -> None:
    """The kernels read codes as 4-byte words: a cache view starting off a word boundary is a
    ValueError naming kv_cache, raised by both logits launchers before any launch (the
    outputs keep their poison)."""
    from graphidx.ops.kernels.gather import gather_mqa_logits as triton_gather
    from graphidx.ops.kernels.logits import paged_mqa_logits as triton_logits

    cache = make_cache(gen, [40, 39], num_heads=4, head_dim=64, page_entries=32)
    pages, page_bytes = cache.kv_cache.shape
    # Made on the kernels' device: moving a strided view there would copy it contiguously.
    wide = torch.zeros(pages, page_bytes + 4, dtype=torch.uint8, device=TRITON_DEVICE)
    shifted = wide[:, 1 : 1 + page_bytes]
    shifted.copy_(cache.kv_cache)
    q, q_scale, weights, context_lens, block_table = on_triton_device(
        *make_queries(gen, 4, 4, 64), cache.context_lens, cache.block_table
    )
    row_ends = torch.tensor([39, 40, 38, 39], dtype=torch.int32, device=TRITON_DEVICE)
    out = torch.full((4, 48), NAN, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match="kv_cache as 4-byte words"):
        triton_logits(q, q_scale, shifted, weights, context_lens, block_table, row_ends, out,
                      next_n=2, page_entries=32)  # type: ignore[arg-type]  # fmt: skip
    positions = torch.zeros((4, 2), dtype=torch.int32, device=TRITON_DEVICE)
    live = torch.full((4,), 8, dtype=torch.int32, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match="kv_cache as 4-byte words"):
        triton_gather(q, q_scale, shifted, weights, context_lens, block_table, positions, live,
                      out, candidate_block_size=4, next_n=2, page_entries=32)  # type: ignore[arg-type]  # fmt: skip
    assert bool(out.isnan().all())


def test_cache_words_checks_the_data_pointer() -> None:
    """A tensor whose storage starts off a word boundary (storage offset 0, data pointer odd)
    is refused too; an aligned one becomes its int32 view."""
    from graphidx.ops.kernels.mxfp4_tl import cache_words

    buffer = bytearray(4 * 68 + 1)
    odd = torch.frombuffer(buffer, dtype=torch.uint8, offset=1).view(4, 68)
    assert odd.storage_offset() == 0 and odd.data_ptr() % 4 == 1
    with pytest.raises(ValueError, match="data pointer"):
        cache_words(odd)
    aligned = torch.zeros(4, 68, dtype=torch.uint8)
    assert cache_words(aligned).shape == (4, 17)


def test_bf16x2_key_decode_is_exact() -> None:
    """The integer half of `dequantize_keys_bf16x2` (`bf16x2_pair_bits`, run as a kernel) and
    its two bf16 multiplies (replayed in torch: each is by a power of two, so torch's rounding
    and fma.rn.bf16x2's agree) give e2m1 * 2**(E - 127) for every nibble pair under every
    scale byte, as float64 math does (NaN at E = 255, inf where float32 overflows)."""
    from graphidx.mxfp4.format import E2M1_VALUES

    lo_hi = torch.arange(256, dtype=torch.int32).repeat_interleave(256)
    # Every nibble of a word's low half is lo, of its high half hi: pair 0 is (lo, hi).
    words = (lo_hi & 0xF) * 0x1111 | ((lo_hi >> 4) * 0x1111) << 16
    scale = torch.arange(256, dtype=torch.int32).repeat(256)
    out = torch.empty(3 * 65536, dtype=torch.int32, device=TRITON_DEVICE)
    _pair_bits_kernel[(1,)](words.to(TRITON_DEVICE), scale.to(TRITON_DEVICE), out, N=65536)
    pair, low_factors, high_factors = out.cpu().view(3, 65536).long()

    def as_bf16(bits: torch.Tensor) -> torch.Tensor:
        return (bits & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16)

    codes = [*E2M1_VALUES, *(-v for v in E2M1_VALUES)]
    code = torch.tensor(codes, dtype=torch.float64)
    for half, nibble in ((0, lo_hi & 0xF), (16, lo_hi >> 4)):
        value = as_bf16(pair >> half) * as_bf16(low_factors >> half)
        got = (value * as_bf16(high_factors >> half)).float()
        want = (code[nibble.long()] * torch.pow(2.0, (scale - 127).double())).float()
        want = torch.where(scale == 255, float("nan"), want)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~want.isnan()], want[~want.isnan()])


def test_bf16_pair_codes_equal_the_plain_form() -> None:
    """The one-shift extraction gives the bits of `(nibble_pairs * multiplier) & mask` for
    every pair of random words (and of words with every nibble set)."""
    gen = torch.Generator().manual_seed(11)
    words = torch.randint(-(2**31), 2**31, (4096,), generator=gen, dtype=torch.int64)
    words[:16] = -1
    fast = torch.empty(4 * 4096, dtype=torch.int32, device=TRITON_DEVICE)
    plain = torch.full_like(fast, 7)
    fast.fill_(5)
    _pair_codes_kernel[(1,)](words.to(torch.int32).to(TRITON_DEVICE), fast, plain, N=4096)
    assert torch.equal(fast, plain)


@triton.jit
def _tile_lines_kernel(offset_ptr, used_ptr, first_entry, KEYS: tl.constexpr,
                       BLOCK_N: tl.constexpr, N: tl.constexpr):  # fmt: skip
    line = tl.arange(0, N)
    offset, used = tile_lines(first_entry, line, KEYS, BLOCK_N)
    tl.store(offset_ptr + line, offset)
    tl.store(used_ptr + line, used.to(tl.int32))


@pytest.mark.parametrize(
    ("head_dim", "page_entries", "block_n"), [(128, 64, 64), (128, 256, 256), (64, 64, 32),
                                              (256, 128, 128)],
)  # fmt: skip
def test_tile_lines_cover_the_tile(head_dim: int, page_entries: int, block_n: int) -> None:
    """`tile_lines` (the L2 prefetch's addresses): every 128-byte line holding a byte of the
    tile's codes or scales, as the kernels read them, gets an address, wherever the page
    starts within a line, and no address leaves the page."""
    layout = cache_layout(8, head_dim, page_entries)
    assert block_n % layout.n_per_tile == 0
    slots = 512
    for first in range(0, page_entries, block_n):
        offsets = torch.empty(slots, dtype=torch.int32)
        used = torch.empty(slots, dtype=torch.int32)
        _tile_lines_kernel[(1,)](offsets, used, first, key_tiling(layout), block_n, slots)
        picked = offsets[used.bool()].tolist()
        assert min(picked) >= 0 and max(picked) < layout.page_bytes
        # The bytes of the tile's keys: their code words and scale bytes in the page.
        entries = torch.arange(first, first + block_n)
        read = set()
        for e in entries.tolist():
            tile, local = divmod(e, layout.n_per_tile)
            for chunk in range(head_dim // 32):
                base = tile * layout.n_per_tile * head_dim // 2
                read.update(base + chunk * layout.n_per_tile * 16 + local * 16 + b
                            for b in range(16))  # fmt: skip
                lane, slot = chunk % layout.scale_lanes, chunk // layout.scale_lanes
                per_lane = head_dim // 32 // layout.scale_lanes
                scales = page_entries * head_dim // 2 + tile * layout.n_per_tile * head_dim // 32
                read.add(scales + lane * layout.n_per_tile * per_lane + local * per_lane + slot)
        for start in (0, 4, 100):  # the page's first byte within its line
            lines = {(start + offset) // 128 for offset in picked}
            assert {(start + b) // 128 for b in read} <= lines, (first, start)


def test_tile_decode_follows_kernel_order() -> None:
    """`dequantize_tile` puts element 8j + 2t + h of a run's words where the module docstring
    says: byte t * D/8 + 4 (j // 4) + 2h + (j % 4) // 2, nibble j % 2, times the run's scale
    (random codes under random scale bytes but 255, as float64 math rounded to float32 gives:
    exact, inf past float32's range)."""
    from graphidx.mxfp4.format import E2M1_VALUES

    gen = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (1024, 4, 16), generator=gen, dtype=torch.uint8)  # [row, t, byte]
    scales = torch.randint(0, 255, (1024, 4), generator=gen, dtype=torch.int32)
    words = data.view(torch.int32)  # little-endian: byte 4w + i is bits 8i of word w
    got = torch.empty(1024, 128, dtype=torch.float32, device=TRITON_DEVICE)
    _float32_decode_kernel[(1,)](*on_triton_device(words.contiguous(), scales), got)
    codes = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], dtype=torch.float64)
    element = torch.arange(128)
    j, t, h = element // 8, (element % 8) // 2, element % 2
    byte = 4 * (j // 4) + 2 * h + (j % 4) // 2
    nibble = (data[:, t, byte].long() >> (4 * (j % 2))) & 0xF
    want = codes[nibble] * torch.pow(2.0, (scales[:, t] - 127).double())
    assert torch.equal(got.cpu(), want.float())


@pytest.mark.skipif(INTERPRETED, reason="inline PTX: NVIDIA GPUs only")
def test_bf16x2_decode_matches_float32_decode_on_gpu() -> None:
    """`dequantize_keys_bf16x2` (PTX) and `dequantize_tile` (float32) decode every code pair
    under every scale byte to the same numbers on the GPU (rows of 4 runs of 4 words, each run
    under one scale: 1024 rows cover all 65536 (byte, scale) pairs)."""
    device = torch.device(TRITON_DEVICE)
    row = torch.arange(1024)[:, None, None]
    run, i = torch.arange(4)[None, :, None], torch.arange(16)[None, None, :]
    data = ((row % 4) * 64 + run * 16 + i).to(torch.uint8)  # [1024, 4 runs, 16 bytes]
    words = data.contiguous().view(torch.int32).to(device)
    scales = (row[:, :, 0] // 4 + 0 * run[:, :, 0]).to(torch.int32).to(device)  # [1024, 4]
    got = torch.empty(1024, 128, dtype=torch.float32, device=device)
    want = torch.empty_like(got)
    _both_decodes_kernel[(1,)](words, scales, got, want)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


# ---------------------------------------------------------------------------------------
# Decode schedule: same logits with and without it.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "next_n"), [("flat", 1), ("next_n", 2)])
def test_dense_logits_with_schedule(gen: torch.Generator, kind: str, next_n: int) -> None:
    from graphidx.ops.schedule import allocate_schedule, build_decode_schedule

    split = 256
    # Skewed: one long seq, short ones, an empty one (padding).
    contexts = [700, 30, 0, 90]
    num_seqs = len(contexts)
    rows = num_seqs * next_n
    extra = {"next_n": next_n} if kind == "next_n" else {}
    cache = make_cache(gen, contexts, num_heads=4, head_dim=64, page_entries=32)
    queries = make_queries(gen, rows, 4, 64)
    width = 720
    ends = torch.tensor(
        [c - (next_n - 1 - j) for c in contexts for j in range(next_n)], dtype=torch.int32
    )
    schedule = allocate_schedule(num_seqs, width, "cpu", split_keys=split)

    def check(row_ends: torch.Tensor, built_ends: torch.Tensor | None) -> None:
        if built_ends is not None:
            build_decode_schedule(
                built_ends, schedule, next_n=next_n, split_keys=split, backend="triton"
            )
        want, _ = run_dense("reference", cache, queries, row_ends, width, extra)
        plain, _ = run_dense("triton", cache, queries, row_ends, width, extra)
        sched, _ = run_dense("triton", cache, queries, row_ends, width, extra, schedule=schedule)
        assert_logits_match(plain, want)
        assert_logits_match(sched, want)

    check(ends, ends)
    assert int(schedule[0]) > num_seqs  # the long seq was split into several items
    # Rows change in place (the next step): rebuilt into the same buffer, then replayed.
    shorter = (ends - 400).clamp(min=1).to(torch.int32)
    ends.copy_(shorter)
    check(ends, ends)
    # A stale schedule (built for shorter rows) still covers every key.
    longer = torch.tensor(
        [c - (next_n - 1 - j) for c in contexts for j in range(next_n)], dtype=torch.int32
    )
    check(longer, None)
    # An unbuilt (zeroed) schedule is not trusted: the static walk runs.
    schedule.zero_()
    check(longer, None)
    # A hand-made buffer marked complete whose items start below 0 or off SPLIT_ALIGNMENT:
    # each start is taken as max(start, 0) rounded down to it, so these cover everything.
    schedule[:4] = torch.tensor([num_seqs, num_seqs, next_n, 1], dtype=torch.int32)
    starts = [-5, 100, -(2**31), 255]
    for s, start in enumerate(starts):
        schedule[4 + 3 * s : 7 + 3 * s] = torch.tensor([s, start, 2**31 - 1], dtype=torch.int32)
    check(longer, None)


# ---------------------------------------------------------------------------------------
# Gather logits and remap.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "sizes", "clean", "prefetch", "size", "split_tiles"),
    [("qsl", [2, 0, 3], True, True, 4, None), ("next_n", [2, 2], False, True, 4, None),
     ("next_n", [2, 2], True, False, 4, None), ("next_n", [2, 1], False, True, 8, None),
     ("next_n", [2, 2], True, True, 4, 2)],
)  # fmt: skip
def test_gather_logits_match_reference(
    gen: torch.Generator,
    kind: str,
    sizes: list[int],
    clean: bool,
    prefetch: bool,
    size: int,
    split_tiles: int | None,
) -> None:
    """Gather logits against the reference over 4-10 tiles per row (the prefetching loop,
    with one prefetch per column or, at C = 8, per 8-column run, and the plain loop), with
    padding slots, positions past the context and a live count wider than the pool; with
    `split_tiles`, each program scores that many tiles (several programs per row, the last
    ones past the live columns)."""
    from graphidx.ops.kernels.gather import default_config

    pool_blocks, heads, head_dim = 20, 8, 128
    rows, num_seqs, extra = grouping(kind, sizes)
    contexts = [int(c) for c in torch.randint(20, 70, (num_seqs,), generator=gen)]
    cache = make_cache(gen, contexts, num_heads=heads, head_dim=head_dim, page_entries=16)
    queries = make_queries(gen, rows, heads, head_dim)
    seqs = seq_of_rows(kind, sizes, rows)
    block_ids = torch.full((rows, pool_blocks), -1, dtype=torch.int32)
    for r in range(rows):
        blocks = cdiv(contexts[seqs[r]], size)
        chosen = torch.randperm(blocks + 2, generator=gen)[:pool_blocks]
        block_ids[r, : chosen.numel()] = chosen.to(torch.int32) - 1  # some -1, some past end
    row_ends = torch.tensor([contexts[s] for s in seqs], dtype=torch.int32)
    positions = torch.empty((rows, pool_blocks), dtype=torch.int32)
    live = torch.empty(rows, dtype=torch.int32)
    ops.resolve_candidate_pool(block_ids, row_ends, size, positions, live, backend="reference")
    # Defensive columns: a padding slot inside the live range, a slot past the context.
    positions[0, 0] = -1
    positions[-1, 1] = contexts[seqs[-1]] + 3
    live[-1] = pool_blocks * size + 5  # wider than the pool: clamped by the output width
    width = pool_blocks * size + 3
    outs = []
    for backend in ("reference", "triton"):
        args = [*queries, cache.kv_cache, cache.context_lens, cache.block_table, positions,
                live, torch.full((rows, width), NAN)]  # fmt: skip
        kwargs = dict(extra)
        if backend == "triton":
            args = on_triton_device(*args)  # type: ignore[assignment]
            kwargs = {k: v.to(TRITON_DEVICE) if isinstance(v, torch.Tensor) else v
                      for k, v in kwargs.items()}  # fmt: skip
        q, q_scale, weights, kv_cache, context_lens, block_table, pos, live_cols, out = args
        if backend == "triton":
            from graphidx.ops.kernels.gather import gather_mqa_logits as triton_gather

            config = default_config(size, heads, rows, width, 4)
            config = dataclasses.replace(config, prefetch=prefetch)
            if split_tiles is not None:  # 16-column tiles on a GPU too: the width is 83
                config = dataclasses.replace(config, block_n=16, split=split_tiles * 16)
            triton_gather(
                q, q_scale, kv_cache, weights, context_lens, block_table, pos, live_cols, out,
                candidate_block_size=size, clean=clean, page_entries=cache.page_entries,
                config=config, **kwargs,  # type: ignore[arg-type]
            )  # fmt: skip
        else:
            ops.gather_mqa_logits(
                q, q_scale, kv_cache, weights, context_lens, block_table, pos, live_cols, out,
                candidate_block_size=size, clean=clean, page_entries=cache.page_entries,
                backend=backend, **kwargs,  # type: ignore[arg-type]
            )  # fmt: skip
        outs.append(out.cpu())
    assert_logits_match(outs[1], outs[0])
    assert bool((outs[1][-1, pool_blocks * size :] == NEG_INF).all())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_n", 24),
        ("block_n", 4096),
        ("num_warps", 3),
        ("num_stages", 0),
        ("split", 96),
        ("split", 0),
        ("max_registers", 8),
        pytest.param(
            "max_registers",
            64,
            marks=pytest.mark.skipif(
                torch.version.hip is None and not INTERPRETED, reason="a valid cap on NVIDIA"
            ),
        ),
    ],
)
def test_gather_config_refused(field: str, value: int) -> None:
    """A gather config the kernel cannot run raises ValueError naming the field."""
    from graphidx.ops.kernels.gather import GatherConfig, check_config

    bad = dataclasses.replace(GatherConfig(block_n=64, num_warps=4, num_stages=1), **{field: value})
    with pytest.raises(ValueError, match=f"config.{field}"):
        check_config(bad)


@pytest.mark.parametrize(
    ("size", "heads", "rows", "width", "want"),
    [(8, 32, 128, 16384, (128, 64, False, 2048)), (8, 16, 128, 16384, (128, 64, False, 2048)),
     (8, 32, 16, 16384, (128, 64, False, 512)), (8, 32, 1, 16384, (128, None, True, 512)),
     (8, 64, 128, 16384, (128, 128, True, 2048)), (8, 64, 16, 16384, (128, 128, True, 512)),
     (8, 128, 10**4, 16384, (128, None, True, 2048)),
     (256, 32, 10**4, 16384, (256, None, True, 2048)),
     # narrow rows: halving stops where it no longer adds programs
     (8, 32, 16, 512, (128, None, True, 2048)), (8, 32, 16, 1536, (128, None, True, 512)),
     (8, 32, 200, 2048, (128, 64, False, 1024)), (8, 32, 200, 1024, (128, None, True, 2048))],
)  # fmt: skip
def test_gather_default_config_on_nvidia(
    monkeypatch: pytest.MonkeyPatch, size: int, heads: int, rows: int, width: int,
    want: tuple[int, int | None, bool, int],
) -> None:  # fmt: skip
    """On NVIDIA (132 SMs) a small batch's rows are split finer while that adds programs and
    the grid still fits what the SMs hold uncapped; the register cap (and, at <= 32 heads, no
    prefetch) only once it outgrows them, and only at the measured tile and head sizes."""
    from graphidx.ops.kernels import OPERANDS_BF16X2
    from graphidx.ops.kernels import gather as triton_gather

    monkeypatch.setattr(triton_gather, "operand_mode", lambda: OPERANDS_BF16X2)
    config = triton_gather.default_config(size, heads, rows, width, 132)
    assert (config.block_n, config.max_registers, config.prefetch, config.split) == want
    triton_gather.check_config(config)


def test_remap_compact_topk_in_place(gen: torch.Generator) -> None:
    size, rows, pool_blocks, k = 4, 3, 5, 9
    positions = torch.randint(-1, 200, (rows, pool_blocks), generator=gen).to(torch.int32)
    compact = torch.randint(-1, pool_blocks * size + 2, (rows, k), generator=gen).to(torch.int32)
    want = torch.full_like(compact, SENTINEL)
    ops.remap_compact_topk(compact, positions, size, want, backend="reference")
    got = compact.clone()
    ops.remap_compact_topk(got, positions, size, got, backend="triton")
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------
# Top-k.
# ---------------------------------------------------------------------------------------


def check_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Exactly min(k, finite values) distinct picks, each >= every unpicked value; -1 after."""
    width = logits.shape[1]
    for r in range(logits.shape[0]):
        n = max(0, min(int(lengths[r]), width))
        row = logits[r, :n]
        expect = int((row != NEG_INF).sum().clamp(max=k))
        got = out[r].tolist()
        picks = [c for c in got if c != -1]
        assert len(picks) == expect, (r, got)
        assert got.count(-1) == k - expect, (r, got)
        assert len(set(picks)) == expect and all(0 <= c < n for c in picks), (r, got)
        if expect:
            chosen = row[picks]
            assert bool((chosen != NEG_INF).all())
            rest = torch.ones(n, dtype=torch.bool)
            rest[picks] = False
            if rest.any():
                assert float(chosen.min()) >= float(row[rest].max()), r


def topk_rows(gen: torch.Generator, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Adversarial rows: random, all equal, few levels (many ties), -inf mixed in, crowded."""
    rows = [
        torch.randn(width, generator=gen),
        torch.full((width,), 1.5),
        torch.randint(0, 3, (width,), generator=gen).float(),
        torch.where(torch.rand(width, generator=gen) < 0.7, NEG_INF, 2.0),
        torch.randn(width, generator=gen),
        torch.randn(width, generator=gen),
        torch.randn(width, generator=gen) - 10.0,
        torch.randn(width, generator=gen) - 10.0,
        torch.full((width,), NEG_INF),
        # Every binade from 1e-30 to 1e30, both signs: the searches span all 32 key bits.
        torch.randn(width, generator=gen) * 10.0 ** (60 * torch.rand(width, generator=gen) - 30),
        -torch.rand(width, generator=gen) - 1.0,  # negatives only, one binade
    ]
    rows[5][::2] = -0.0  # signed zeros tie with +0.0 under float order
    rows[5][1::2] = 0.0
    # Top values crowded into a few interleaved groups (the slow exact path).
    rows[6][::32] = torch.arange(len(rows[6][::32])).float() + 100.0
    rows[7][::32] = 100.0  # ... with ties at the threshold
    rows[7][1::32] = 50.0
    lengths = torch.tensor(
        [width, width, width - 7, width, 3, width + 50, width, width, width, width, width]
    )
    return torch.stack(rows), lengths.to(torch.int32)


@pytest.mark.parametrize("k", [1, 8, 13])
def test_topk_small_buffers_every_path(gen: torch.Generator, k: int) -> None:
    # groups = 32, capacity = 16: rows of 300 columns take the refine and fallback paths.
    logits, lengths = topk_rows(gen, 300)
    lengths[0] = 0
    out = torch.full((logits.shape[0], k), SENTINEL, dtype=torch.int32)
    config = TopkConfig(groups=32, capacity=max(16, 2 * (1 << (k - 1).bit_length())), num_warps=4)
    triton_topk_per_row(logits, lengths, k, out, config=config)
    check_topk(logits, lengths, k, out)


def test_topk_default_config(gen: torch.Generator) -> None:
    logits, lengths = topk_rows(gen, 1500)
    logits = torch.cat((logits, torch.zeros(logits.shape[0], 20)), dim=1)[:, :1500]
    out = torch.full((logits.shape[0], 64), SENTINEL, dtype=torch.int32)
    ops.topk_per_row(logits, lengths, 64, out, backend="triton")
    check_topk(logits, lengths, 64, out)


def test_topk_strided_rows_and_k_wider_than_row(gen: torch.Generator) -> None:
    storage = torch.randn(4, 40, generator=gen)
    logits = storage[:, :25]  # row stride 40
    lengths = torch.tensor([25, 10, 0, 30], dtype=torch.int32)
    out = torch.full((4, 32), SENTINEL, dtype=torch.int32)
    ops.topk_per_row(logits, lengths, 32, out, backend="triton")
    check_topk(logits, lengths, 32, out)


# ---------------------------------------------------------------------------------------
# Candidate pool and mask.
# ---------------------------------------------------------------------------------------


def _check_pool_against_reference(
    block_ids: torch.Tensor, row_ends: torch.Tensor, size: int
) -> torch.Tensor:
    """Triton's pool positions and live counts equal the reference's (outputs poisoned);
    returns the live counts."""
    rows, pool_blocks = block_ids.shape
    results = []
    for backend in ("reference", "triton"):
        positions = torch.full((rows, pool_blocks), SENTINEL, dtype=torch.int32)
        live = torch.full((rows,), SENTINEL, dtype=torch.int32)
        ops.resolve_candidate_pool(block_ids, row_ends, size, positions, live, backend=backend)
        results.append((positions, live))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    return results[0][1]


def test_resolve_candidate_pool_matches_reference(gen: torch.Generator) -> None:
    rows, pool_blocks, size = 6, 12, 4
    block_ids = torch.stack(
        [torch.randperm(40, generator=gen)[:pool_blocks] for _ in range(rows)]
    ).to(torch.int32)
    block_ids[block_ids > 30] = -1
    row_ends = torch.tensor([0, -4, 7, 50, 100, 33], dtype=torch.int32)
    _check_pool_against_reference(block_ids, row_ends, size)


@pytest.mark.parametrize(
    ("programs", "tile", "span"),
    [(1024, 2048, 4), (2, 2048, 4), (3, 4, 4), (1024, 2048, 9), (2, 8, 40)],
    ids=["marks", "rows-per-program", "tiles", "sort", "mixed"],
)
def test_resolve_candidate_pool_paths(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, programs: int, tile: int, span: int
) -> None:
    """Both ways a row resolves (marks when its ids span <= POOL_MARKS x the pool, else a
    sort), programs that take several rows and marks compacted over several tiles all
    equal the reference; `span` x pool is the widest row's block count."""
    from graphidx.ops.kernels import candidates

    monkeypatch.setattr(candidates, "POOL_PROGRAMS", programs)
    monkeypatch.setattr(candidates, "POOL_TILE", tile)
    rows, pool_blocks, size = 7, 16, 3
    blocks = span * pool_blocks * candidates.POOL_MARKS // 4
    block_ids = torch.stack(
        [torch.randperm(blocks + 5, generator=gen)[:pool_blocks] for _ in range(rows)]
    ).to(torch.int32)
    block_ids[:, ::5] = -1
    block_ids[1] = -1  # no valid id
    ends = torch.randint(0, blocks * size + 9, (rows,), generator=gen)
    ends[2], ends[3] = 0, blocks * size  # empty row, widest row
    row_ends = ends.to(torch.int32)
    live = _check_pool_against_reference(block_ids, row_ends, size)
    assert bool((live > 0).any())


def test_apply_candidate_mask_unsorted_unaligned_starts(gen: torch.Generator) -> None:
    rows, width, size = 5, 130, 4
    starts = torch.randint(-3, 135, (rows, 9), generator=gen).to(torch.int32)
    starts[0] = -1  # no candidate at all: the whole row is masked
    logits = torch.randn(rows, width, generator=gen)
    want, got = logits.clone(), logits.clone()
    ops.apply_candidate_mask(want, starts, size, backend="reference")
    ops.apply_candidate_mask(got, starts, size, backend="triton")
    assert torch.equal(got, want)
    assert bool((got[0] == NEG_INF).all())
