"""The Triton top-k (graphidx.ops.kernels.topk) on both paths, against exact key math.

Runs under the Triton interpreter on a CPU (tests/conftest.py sets TRITON_INTERPRET=1), so
rows are short and the configs small: groups of 32 or 64, chunks of 64 columns, so the
unmasked steps, the masked tail, every select branch and, with programs_per_row 2 / 4, the
cross-program floor, collect and last-arriver select all run. Outputs are poisoned with a
sentinel before each call.

The check is exact: the picked columns' keys (the order-preserving uint32 image of float32
the kernel compares, computed here in int64) must be the min(k, #pickable) largest keys of
the row as a multiset, the picks distinct and inside the length, then -1. Pickable keys are
those above -inf's, so +NaN ranks above +inf and -NaN like -inf (the kernel's NaN order;
NaN input is undefined by the contract). On NaN-free rows the picked values must also equal
the reference backend's, as float64 multisets.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

ops = pytest.importorskip("graphidx.ops")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
if not ops.backend.triton_interpreted():
    pytest.skip("interpreter tests: TRITON_INTERPRET is not set", allow_module_level=True)
from graphidx.ops.kernels import topk as topk_kernels  # noqa: E402
from graphidx.ops.kernels.topk import (  # noqa: E402
    TopkConfig,
    check_config,
    default_config,
    split_config,
    topk_per_row,
)
from graphidx.ops.topk import topk_per_row_reference  # noqa: E402

SENTINEL = -777
NEG_INF = float("-inf")
NAN = float("nan")
KEY_NEG_INF = 0x007FFFFF


def order_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 copy of the kernel's uint32 order key of each float32."""
    bits = values.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, ~bits & 0xFFFFFFFF, bits | (1 << 31))


def check_rows(logits: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor) -> None:
    width = logits.shape[1]
    want = torch.full_like(out, SENTINEL)
    topk_per_row_reference(logits, lengths, k, want)
    for r in range(logits.shape[0]):
        n = max(0, min(int(lengths[r]), width))
        keys = order_keys(logits[r, :n])
        pickable = keys[keys > KEY_NEG_INF]
        expect = min(k, pickable.numel())
        got = out[r].tolist()
        picks = got[:expect]
        assert all(0 <= c < n for c in picks), (r, got)
        assert len(set(picks)) == expect, (r, got)
        assert got[expect:] == [-1] * (k - expect), (r, got)
        best = torch.sort(pickable, descending=True).values[:expect]
        chosen = torch.sort(keys[picks], descending=True).values
        assert torch.equal(chosen, best), r
        row = logits[r, :n]
        if not bool(row.isnan().any()):
            ref = [c for c in want[r].tolist() if c != -1]
            assert len(ref) == expect, r
            assert torch.equal(row[picks].double().sort().values, row[ref].double().sort().values)


def run(logits: torch.Tensor, lengths: torch.Tensor, k: int, config: TopkConfig | None) -> None:
    out = torch.full((logits.shape[0], k), SENTINEL, dtype=torch.int32)
    topk_per_row(logits, lengths, k, out, config=config)
    check_rows(logits, lengths, k, out)


def small_config(k: int, split: int, groups: int = 32, capacity: int = 0) -> TopkConfig:
    """Small sizes that exercise every phase on short rows; split 0: the whole-row kernel."""
    if split == 0:
        return TopkConfig(groups=groups, capacity=16, num_warps=4, whole_row=True)
    k_pad = 1 << (k - 1).bit_length()
    return TopkConfig(groups=groups, capacity=capacity or max(16, 2 * k_pad), num_warps=4,
                      programs_per_row=split, chunk=64)  # fmt: skip


def lengths_for(width: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """0, 1, short, the width, past it, negative, then random lengths."""
    fixed = [0, 1, 7, width, width + 50, -3, width - 1, 200]
    rand = torch.randint(0, width + 1, (max(0, rows - len(fixed)),), generator=gen).tolist()
    return torch.tensor((fixed + rand)[:rows], dtype=torch.int32)


@pytest.mark.parametrize("split", [0, 1, 2, 4])
@pytest.mark.parametrize("k", [1, 13, 40])
def test_random_rows_every_length(gen: torch.Generator, split: int, k: int) -> None:
    logits = torch.randn(10, 300, generator=gen) * 3.0
    run(logits, lengths_for(300, 10, gen), k, small_config(k, split))


@pytest.mark.parametrize("k", [1, 300, 2048])
def test_whole_rows_held_in_the_half_tile_when_short(gen: torch.Generator, k: int) -> None:
    """From W_PAD = HALF_ROW_TIER on, rows of at most W_PAD / 2 live columns take the
    half-size tile, longer ones the full tile: both exact, at lengths on either side of the
    cut and at it (width 4200: W_PAD 8192, the cut at 4096), with ties and -inf."""
    width = 4200
    assert topk_kernels.next_power_of_2(width) == topk_kernels.HALF_ROW_TIER.value
    logits = torch.randn(8, width, generator=gen)
    logits[1] = torch.round(logits[1] * 2.0) / 2.0  # many ties
    logits[2, ::3] = NEG_INF
    lengths = torch.tensor([4096, 4096, 4097, width, 3000, 4095, 2100, 4150], dtype=torch.int32)
    run(logits, lengths, k, small_config(k, 0))


@pytest.mark.parametrize("short_rows", [True, False])
@pytest.mark.parametrize("k", [1, 100, 2047])
def test_short_rows_of_a_wide_buffer_held_whole(
    gen: torch.Generator, k: int, short_rows: bool
) -> None:
    """P = 1 over a buffer wider than the whole-row tile (4 warps: 2048 columns): rows of at
    most 2048 live columns take the whole-row picks, longer ones the grouped path; with
    short_rows off every row takes the grouped path. Exact either way, ties and -inf too."""
    width = 2600
    config = dataclasses.replace(small_config(k, 1), short_rows=short_rows)
    group = topk_kernels.group_columns(width, config.groups)
    padded = topk_kernels.next_power_of_2(-(-width // group)) * group
    assert topk_kernels.short_row_columns(config, k, padded) == (2048 if short_rows else 0)
    logits = torch.randn(8, width, generator=gen)
    logits[1] = torch.round(logits[1] * 2.0) / 2.0
    logits[2, ::3] = NEG_INF
    lengths = torch.tensor([2048, 2048, 2049, width, 1000, 2047, 5, 0], dtype=torch.int32)
    run(logits, lengths, k, config)


@pytest.mark.parametrize("k", [1, 40, 100])
def test_short_rows_cut_into_narrower_groups(gen: torch.Generator, k: int) -> None:
    """P = 1 without the whole-row tile: a row of at most width >> t live columns is cut
    into groups of G >> t columns (tiers down to 4-column groups); lengths on both sides of
    every tier's bound, exact. Also the tier counts `_plan` derives."""
    width = 2600
    config = dataclasses.replace(small_config(k, 1), short_rows=False)
    group = topk_kernels.group_columns(width, config.groups)
    assert (group, topk_kernels.group_tiers(group, 4096, 0)) == (128, 5)
    assert topk_kernels.group_tiers(128, 4096, 2048) == 0  # every shorter row is held whole
    assert topk_kernels.group_tiers(32, 262144, 8192) == 3  # V3.2's 163840 columns, k 2048
    assert topk_kernels.group_tiers(8, 65536, 8192) == 1
    assert topk_kernels._plan(k, 12, width, config).constexprs[0]["TIERS"] == 5
    logits = torch.randn(12, width, generator=gen)
    logits[3] = torch.round(logits[3] * 2.0) / 2.0
    lengths = torch.tensor([1300, 1301, 650, 651, 325, 326, 162, 163, 81, 80, width, 2],
                           dtype=torch.int32)  # fmt: skip
    run(logits, lengths, k, config)


def tie_rows(gen: torch.Generator, width: int) -> torch.Tensor:
    rows = [
        torch.full((width,), 1.5),
        torch.randint(0, 3, (width,), generator=gen).float(),
        torch.round(torch.randn(width, generator=gen) * 4.0) / 4.0,  # few mantissa bits
        torch.randn(width, generator=gen),
        -torch.rand(width, generator=gen) - 1.0,  # negatives only, one binade
    ]
    rows[3][::2] = -0.0  # signed zeros: distinct keys, equal floats
    rows[3][1::2] = 0.0
    return torch.stack(rows)


@pytest.mark.parametrize("split", [0, 1, 2, 4])
@pytest.mark.parametrize("k", [1, 16, 40])
def test_ties(gen: torch.Generator, split: int, k: int) -> None:
    logits = tie_rows(gen, 300)
    lengths = torch.tensor([300, 300, 299, 300, 131], dtype=torch.int32)
    # capacity == K_PAD at k = 16: the candidate and tie buffers are as small as allowed.
    run(logits, lengths, k, small_config(k, split, capacity=16 if k == 16 else 0))


def inf_nan_rows(gen: torch.Generator, width: int) -> torch.Tensor:
    base = torch.randn(6, width, generator=gen)
    base[0] = NEG_INF
    base[1] = torch.where(torch.rand(width, generator=gen) < 0.9, NEG_INF, base[1])
    base[2] = torch.where(torch.rand(width, generator=gen) < 0.5, NEG_INF, 2.0)
    base[3, ::7] = NAN
    base[4, 5::11] = -torch.tensor(NAN)  # a NaN with the sign bit: ranks like -inf
    base[4, ::13] = float("inf")
    base[5] = torch.where(torch.rand(width, generator=gen) < 0.97, NEG_INF, base[5])
    return base


@pytest.mark.parametrize("split", [0, 1, 4])
@pytest.mark.parametrize("k", [1, 24])
def test_inf_and_nan(gen: torch.Generator, split: int, k: int) -> None:
    logits = inf_nan_rows(gen, 256)
    lengths = torch.tensor([256, 256, 255, 256, 256, 100], dtype=torch.int32)
    run(logits, lengths, k, small_config(k, split))


@pytest.mark.parametrize("split", [0, 1, 2])
def test_finite_values_in_fewer_groups_than_k(gen: torch.Generator, split: int) -> None:
    """Every finite value in 2-4 of the row's 32 groups of 8 columns, more of them than k:
    the floor is -inf's key (fewer than k group maxima are finite), every finite column a
    candidate (row 0: exactly CAP = 32 of them), and the exact search runs over them; also
    with +inf and -FLT_MAX (the key just above -inf's, 24 ties) among them."""
    logits = torch.full((3, 256), NEG_INF)
    logits[0, 16:32] = torch.randn(16, generator=gen)
    logits[0, 200:216] = torch.randn(16, generator=gen)
    logits[1, 40:56] = torch.randn(16, generator=gen).abs() * -1e30
    logits[1, 41] = float("inf")
    logits[2, 0:24] = -torch.finfo(torch.float32).max  # the smallest finite key, 24 ties
    logits[2, 100:104] = 1.0
    lengths = torch.tensor([256, 256, 256], dtype=torch.int32)
    run(logits, lengths, 12, small_config(12, split))


@pytest.mark.parametrize("split", [0, 1, 2])
def test_k_equal_to_and_wider_than_the_row(gen: torch.Generator, split: int) -> None:
    logits = torch.randn(4, 64, generator=gen)
    logits[1, ::3] = NEG_INF
    lengths = torch.tensor([64, 64, 30, 0], dtype=torch.int32)
    run(logits, lengths, 64, small_config(64, split, groups=64))
    run(logits, lengths, 100, small_config(100, split, groups=64))


@pytest.mark.parametrize("width", [1, 2, 3, 5])
def test_rows_of_fewer_groups_than_a_list_run(gen: torch.Generator, width: int) -> None:
    # One column per group: 1, 2, 4 and 8 padded groups, so the list is numbered in runs of
    # 1 (fewer than 4 groups) as well as 4 (`_list_groups`).
    logits = torch.randn(3, width, generator=gen)
    lengths = torch.tensor([width, width - 1, 0], dtype=torch.int32)
    for k in {1, max(1, width - 1), width}:
        run(logits, lengths, k, None)


def crowded_rows(gen: torch.Generator, width: int, groups: int) -> torch.Tensor:
    """The top keys crowded into a few groups: more candidates than CAP (the row fallback)."""
    rows = torch.randn(4, width, generator=gen) - 10.0
    crowd = rows[0, ::groups]
    rows[0, ::groups] = torch.arange(crowd.numel()).float() + 100.0
    rows[1, ::groups] = 100.0  # ... with ties at the threshold
    rows[1, 1::groups] = 50.0
    rows[2, 3::groups] = torch.randn(crowd.numel(), generator=gen) + 20.0
    # Every binade from 1e-30 to 1e30, both signs: the searches span all 32 key bits.
    rows[3] = torch.randn(width, generator=gen) * 10.0 ** (
        60 * torch.rand(width, generator=gen) - 30
    )
    return rows


@pytest.mark.parametrize("split", [0, 1, 2, 4])
@pytest.mark.parametrize("k", [5, 13])
def test_candidate_overflow_falls_back_exactly(gen: torch.Generator, split: int, k: int) -> None:
    logits = crowded_rows(gen, 600, 32)
    lengths = torch.tensor([600, 599, 600, 600], dtype=torch.int32)
    run(logits, lengths, k, small_config(k, split))


@pytest.mark.parametrize("split", [0, 1, 2, 4])
@pytest.mark.parametrize("k", [3, 20])
def test_huge_negative_rows_with_never_picked_columns(
    gen: torch.Generator, split: int, k: int
) -> None:
    """Values in [-3.4e38, -2e29] (keys below 0x10000000: the searches' top digits are 0, the
    digit never-picked keys of 0 have too) with -inf columns and short lengths."""
    width = 320
    magnitude = 10.0 ** (29.3 + 9.2 * torch.rand(6, width, generator=gen))
    logits = -magnitude
    logits[1] = torch.where(torch.rand(width, generator=gen) < 0.7, NEG_INF, logits[1])
    logits[2, ::2] = NEG_INF
    logits[3, : width // 2] = NEG_INF
    lengths = torch.tensor([width, width, width, width, 37, 200], dtype=torch.int32)
    run(logits, lengths, k, small_config(k, split))


def test_strided_rows_and_several_scratch_batches(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = torch.randn(7, 400, generator=gen)
    storage[2] = torch.randint(0, 4, (400,), generator=gen).float()
    logits = storage[:, :333]  # row stride 400
    lengths = torch.tensor([333, 100, 333, 0, 250, 333, 17], dtype=torch.int32)
    config = small_config(9, 4)
    row_bytes = 4 * (config.capacity + 16 + config.groups)
    monkeypatch.setattr(topk_kernels, "SCRATCH_BYTES", 3 * row_bytes)  # batches of 3 rows
    run(logits, lengths, 9, config)
    run(logits, lengths, 9, dataclasses.replace(config, programs_per_row=1, max_registers=64))


def test_default_config_path_and_sizes(gen: torch.Generator) -> None:
    logits = torch.randn(3, 1500, generator=gen)
    logits[1, ::2] = 0.5
    lengths = torch.tensor([1500, 1499, 640], dtype=torch.int32)
    out = torch.full((3, 64), SENTINEL, dtype=torch.int32)
    ops.topk_per_row(logits, lengths, 64, out, backend="triton")
    check_rows(logits, lengths, 64, out)


def test_default_config_choice() -> None:
    h200 = default_config(512, 128, 65536)
    assert (h200.programs_per_row, h200.groups, h200.capacity) == (1, 4096, 1024)
    assert (h200.num_warps, h200.chunk) == (16, 4096)  # a wide row at P = 1
    assert default_config(512, 128, 32768).num_warps == 4
    assert default_config(512, 8, 65536).programs_per_row == 16  # few rows: split
    assert default_config(2048, 128, 65536).programs_per_row == 1  # k above SPLIT_MAX_K
    assert default_config(2048, 3, 65600).programs_per_row == 1
    assert default_config(2048, 2, 65600).programs_per_row == 16  # few rows split at any k
    assert default_config(2048, 2, 163840).programs_per_row == 32
    assert default_config(2048, 2, 8256).whole_row  # held whole first
    assert default_config(2048, 128, 65536).groups == 8192
    assert default_config(512, 4096, 65536).programs_per_row == 1  # many rows
    assert default_config(2048, 1, 1 << 20).radix  # one very wide row
    assert not default_config(512, 1, 1 << 20).radix  # the split path at small k
    assert not default_config(2048, 2, 1 << 20).radix
    assert not default_config(2048, 2, 65600).radix
    assert default_config(512, 64, 32768).programs_per_row == 2  # 128 programs
    assert default_config(512, 8, 20000).programs_per_row == 4  # width-limited
    for width in (1, 4096, topk_kernels.WHOLE_ROW_COLUMNS):  # few narrow rows: held whole
        assert default_config(512, 8, width).whole_row, width
    many = topk_kernels.WHOLE_ROW_MAX_ROWS + 1
    assert default_config(512, 4096, topk_kernels.WHOLE_ROW_NARROW).whole_row
    assert not default_config(512, many, topk_kernels.WHOLE_ROW_NARROW + 1).whole_row
    assert default_config(topk_kernels.WHOLE_ROW_MIN_K, 4096, 16384).whole_row  # large k
    assert default_config(2048, 1, 8192).num_warps == 16  # 16 keys per thread
    assert default_config(2048, 1, 1024).num_warps == 4
    assert not default_config(512, 8, topk_kernels.WHOLE_ROW_COLUMNS + 1).whole_row
    wide = default_config(512, 1, 1 << 20)
    assert (wide.programs_per_row, wide.groups) == (128, 16384)
    for k, rows, width in ((1, 1, 40000), (2048, 128, 65536), (9000, 3, 1 << 20)):
        config = default_config(k, rows, width)
        check_config(config, k)
        assert config.groups // config.programs_per_row >= topk_kernels.MIN_SLICE_GROUPS
        base = split_config(k, config.programs_per_row)
        assert config == dataclasses.replace(base, num_warps=config.num_warps,
                                             chunk=config.chunk)  # fmt: skip
    assert split_config(512, 1).num_warps == 4  # the one-program path keeps small k light
    assert split_config(512, 16).groups == 2048


def test_collect_parts_give_about_a_piece_per_thread() -> None:
    """Collect steps cut groups into pieces of >= 4 columns until there is about one piece per
    thread (the bench shapes: k 2048 keeps whole 8-column groups, k 512 halves 16-column
    ones); groups under 8 columns and steps with enough groups stay whole."""
    parts = topk_kernels.collect_parts
    assert parts(8, 512, 16) == 1
    assert parts(16, 256, 16) == 2
    assert parts(4096, 2, 4) == 64
    assert parts(2, 2048, 4) == parts(4, 64, 16) == parts(16, 1024, 8) == 1
    for group, steps, warps in ((8, 8, 4), (32, 2, 4), (64, 32, 8), (16, 4, 16)):
        count = parts(group, steps, warps)
        assert count & (count - 1) == 0 and group // count >= 4
        assert steps * count <= 32 * warps


def test_bad_config_raises_before_any_launch() -> None:
    logits = torch.randn(2, 50)
    lengths = torch.tensor([50, 50], dtype=torch.int32)
    out = torch.full((2, 8), SENTINEL, dtype=torch.int32)
    bad = [
        (small_config(8, 2, capacity=4), "capacity"),
        (dataclasses.replace(small_config(8, 2), programs_per_row=3), "programs_per_row"),
        (dataclasses.replace(small_config(8, 2), programs_per_row=16), "programs_per_row"),
        (dataclasses.replace(small_config(8, 2), chunk=0), "chunk"),
        (dataclasses.replace(small_config(8, 2), max_registers=8), "max_registers"),
    ]
    for config, field in bad:
        with pytest.raises(ValueError, match=field):
            topk_per_row(logits, lengths, 8, out, config=config)
    assert bool((out == SENTINEL).all())


@pytest.mark.parametrize("split", [0, 1, 8])
def test_long_rows_default_sizes(gen: torch.Generator, split: int) -> None:
    # Real sizes (2048 groups, 8192-column steps): the unmasked steps and the wide tiles run.
    logits = torch.randn(3, 70000, generator=gen)
    lengths = torch.tensor([70000, 68766, 33333], dtype=torch.int32)
    config = split_config(512, split) if split else default_config(512, 3, 70000)
    assert config.programs_per_row == (split or 16)
    run(logits, lengths, 512, config)


def tied_threshold_rows(width: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, big): 3 rows of distinct negatives (never reached) with large values and ties
    at the k = 20 threshold in scattered columns `big`: row 0 6 large values, then 0.0 in
    300 columns; row 1 8 large and 1.0 in 40 (more candidates than k, tied at 1.0); row 2 8
    large and 2.0 in 15."""
    rows = torch.full((3, width), -5.0) - torch.rand(3, width, generator=gen)
    big = torch.randperm(width, generator=gen)[:306]
    rows[0, big[:6]] = torch.arange(6, dtype=torch.float32) + 10.0
    rows[0, big[6:]] = 0.0
    rows[1, big[:8]] = torch.arange(8, dtype=torch.float32) + 10.0
    rows[1, big[8:48]] = 1.0
    rows[2, big[:8]] = torch.arange(8, dtype=torch.float32) + 10.0
    rows[2, big[8:23]] = 2.0
    return rows, big


@pytest.mark.parametrize("split", [0, 1, 2, 4])
def test_ties_at_the_threshold_picked_in_column_order(gen: torch.Generator, split: int) -> None:
    """When only some of the columns tied at the k-th value can be picked, the picks are the
    tied columns of smallest index (not the buffers' arrival order): equal inputs always give
    equal picks, which a replayed graph relies on. Both select paths: the threshold at the
    floor (ties in the tie buffer) and above it (ties among the candidates), the latter
    with more ties than the select's rank step takes (40) and with fewer (15: ranked by key,
    then column, `_emit_ranked`)."""
    width, k = 700, 20
    rows, big = tied_threshold_rows(width, gen)
    lengths = torch.full((3,), width, dtype=torch.int32)
    for config in (small_config(k, split, groups=64, capacity=64), None):
        out = torch.full((3, k), SENTINEL, dtype=torch.int32)
        topk_per_row(rows, lengths, k, out, config=config)
        check_rows(rows, lengths, k, out)
        for r, (large, tie_value) in enumerate(((6, 0.0), (8, 1.0), (8, 2.0))):
            tied = (rows[r] == tie_value).nonzero().flatten().tolist()
            want = set(big[:large].tolist()) | set(tied[: k - large])
            assert set(out[r].tolist()) == want, (r, split)


def test_selection_past_16_bit_counts_numbers_each_kind_apart(gen: torch.Generator) -> None:
    """The select numbers its picks by one prefix sum with the above / tied counts packed in
    16 bits, or, from 65536 keys of capacity on, by one prefix sum each: both must pick the
    candidates above the k-th value, then the tied columns of smallest index. The large and
    tied values sit in 4 adjacent groups, so the floor (the k-th largest group max) falls
    among the small values and every one of them is a candidate (more than k)."""
    width, k = 700, 20
    row = -5.0 - torch.rand(width, generator=gen)
    row[100:108] = torch.arange(8, dtype=torch.float32) + 10.0
    row[108:148] = 1.0  # 40 columns tied at the k-th value
    logits, lengths = row[None, :], torch.tensor([width], dtype=torch.int32)
    for capacity in (1024, 65536):
        out = torch.full((1, k), SENTINEL, dtype=torch.int32)
        topk_per_row(logits, lengths, k, out, config=small_config(k, 1, 64, capacity))
        check_rows(logits, lengths, k, out)
        assert set(out[0].tolist()) == set(range(100, 120)), capacity


def test_selection_with_more_ties_than_16_bits_can_rank(gen: torch.Generator) -> None:
    """35000 columns tied at the k-th value among 49152, capacity 65536: the select's ranks
    pass 32767, too many for the 16-bit halves of a packed prefix sum, so it must number
    the two kinds apart, and write only the row's k slots (guards on both sides)."""
    width, k, guard = 49152, 16, 64
    row = -5.0 - torch.rand(width, generator=gen)
    row[:35000] = 1.0  # the last 4 groups of 4096 hold no 1.0: the floor is negative
    row[40000:40004] = torch.tensor([10.0, 11.0, 12.0, 13.0])
    logits, lengths = row[None, :], torch.tensor([width], dtype=torch.int32)
    buffer = torch.full((1, k + 2 * guard), SENTINEL, dtype=torch.int32)
    out = buffer[:, guard : guard + k]
    config = TopkConfig(groups=16, capacity=65536, num_warps=4, chunk=8192)
    topk_per_row(logits, lengths, k, out, config=config)
    assert set(out[0].tolist()) == {40000, 40001, 40002, 40003, *range(12)}
    assert bool((buffer[:, :guard] == SENTINEL).all())
    assert bool((buffer[:, guard + k :] == SENTINEL).all())


def test_collect_step_of_32768_tied_columns() -> None:
    """A collect step of the largest size (32768 columns) all tied at the floor: the tie
    count fills bit 31 of the packed step total and must still read as 32768."""
    width, k = 32768, 8
    logits = torch.ones(1, width)
    lengths = torch.tensor([width], dtype=torch.int32)
    out = torch.full((1, k), SENTINEL, dtype=torch.int32)
    config = TopkConfig(groups=1024, capacity=16, num_warps=4, chunk=32768)
    topk_per_row(logits, lengths, k, out, config=config)
    assert out[0].tolist() == list(range(k))


def test_oversized_step_refused_before_any_launch() -> None:
    logits = torch.randn(2, 600)
    lengths = torch.tensor([600, 600], dtype=torch.int32)
    out = torch.full((2, 8), SENTINEL, dtype=torch.int32)
    config = dataclasses.replace(small_config(8, 1), chunk=65536)
    with pytest.raises(ValueError, match=r"config\.chunk 65536"):
        topk_per_row(logits, lengths, 8, out, config=config)
    assert bool((out == SENTINEL).all())


@triton.jit
def _floor_kernel(maxima_ptr, out_ptr, k, NG: tl.constexpr):
    """The library's floor over NG group-maximum keys (uint32 stored as int32)."""
    group_max = tl.load(maxima_ptr + tl.arange(0, NG)).to(tl.uint32, bitcast=True)
    floor, reaching = topk_kernels._row_floor(
        group_max, k, *topk_kernels._key_range(group_max), 0, 0
    )
    tl.store(out_ptr, floor.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 1, reaching)


def test_floor_stays_tight_when_the_maxima_span_the_sign_bit(gen: torch.Generator) -> None:
    # 4095 maxima within 1/16 of 1.0 (same exponent, same top mantissa bits) and one
    # negative: the first differing bit is the sign, so FLOOR_BITS bits alone would end on a
    # floor under all of them (every group listed). The search must go on until at most
    # FLOOR_LIMIT * k maxima reach the floor, and the floor must stay a lower bound.
    k, groups = 64, 4096
    values = 1.0 + torch.rand(groups, generator=gen) / 16
    values[7] = -1.0
    keys = order_keys(values)
    maxima = (keys - (1 << 32) * (keys >= 1 << 31)).to(torch.int32)  # the uint32 bits
    out = torch.zeros(2, dtype=torch.int32)
    _floor_kernel[(1,)](maxima, out, k, NG=groups)
    floor = int(out[0]) & 0xFFFFFFFF
    reaching = int((keys >= floor).sum())
    assert int(out[1]) == reaching  # the count the list phase takes as its length
    assert k <= reaching <= topk_kernels.FLOOR_LIMIT.value * k
    assert floor <= int(torch.sort(keys, descending=True).values[k - 1])


def test_floor_on_normal_maxima_is_mostly_within_the_slack(gen: torch.Generator) -> None:
    # Maxima of 16 |normals| per group, as the P = 1 path sees them at k 512 (4096 groups),
    # 6 rows: every floor is a lower bound reached by at most FLOOR_LIMIT * k maxima (the
    # contract), and the interpolating search gets most under k + k / FLOOR_SLACK (what the
    # speed rests on; the FLOOR_BITS exit may end a row's search a little above it).
    k, groups = 512, 4096
    slack = k + k // topk_kernels.FLOOR_SLACK.value
    within = 0
    for _ in range(6):
        keys = order_keys(torch.randn(groups, 16, generator=gen).abs()).amax(dim=1)
        maxima = (keys - (1 << 32) * (keys >= 1 << 31)).to(torch.int32)
        out = torch.zeros(2, dtype=torch.int32)
        _floor_kernel[(1,)](maxima, out, k, NG=groups)
        floor = int(out[0]) & 0xFFFFFFFF
        assert int(out[1]) == int((keys >= floor).sum())
        assert k <= int(out[1]) <= topk_kernels.FLOOR_LIMIT.value * k
        assert floor <= int(torch.sort(keys, descending=True).values[k - 1])
        within += int(out[1]) <= slack
    assert within >= 5


@triton.jit
def _kth_kernel(keys_ptr, out_ptr, k, seed_lo, seed_hi, N: tl.constexpr, BRACKET: tl.constexpr):
    """The library's exact search over N keys (uint32 stored as int32), from the seeds
    (`_kth_largest_key`; 0, 0: none), stopping at BRACKET keys (0: exact): (t, count, hi,
    count above hi)."""
    keys = tl.load(keys_ptr + tl.arange(0, N)).to(tl.uint32, bitcast=True)
    largest, smallest, live = topk_kernels._key_range(keys)
    threshold, reaching, hi, above_hi = topk_kernels._kth_largest_key(
        keys, k, k, k, largest, smallest, live, seed_lo.to(tl.uint32), seed_hi.to(tl.uint32), 32,
        BRACKET,
    )  # fmt: skip
    tl.store(out_ptr, threshold.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 1, reaching)
    tl.store(out_ptr + 2, hi.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 3, above_hi)


SEARCH_CASES = [
    "random",
    "few bits",
    "exactly k live",
    "one value",
    "two clusters",
    "extremes",
    "extremes only",
    "normals",
]


def search_keys(gen: torch.Generator, case: str, n: int, k: int) -> torch.Tensor:
    """n uint32 keys (in int64, 0 = never picked) of one kind, at least k of them live."""
    keys = torch.randint(1, 1 << 32, (n,), generator=gen, dtype=torch.int64)
    keys[::9] = 0
    if case == "few bits":
        keys = (keys & 0xF0000007) | 0x80000000 * (keys > 0)  # runs of equal digits, ties
    elif case == "exactly k live":
        keys[keys.nonzero()[k:]] = 0
    elif case == "one value":
        keys[:] = 0x3F800000
    elif case == "two clusters":  # fewer than k live keys near the top, the rest near 1
        keys = torch.where(keys % 7 == 0, 0xFFFFFF00 + keys % 200, 1 + keys % 1000)
        keys[::9] = 0
    elif case == "extremes":  # the largest and smallest keys there are, around mid-range ones
        keys[1:100:3], keys[2:200:5] = 0xFFFFFFFF, 1
    elif case == "extremes only":  # t* = 1: k - 3 keys at the top, the rest at 1
        keys[keys > 0] = 1
        keys[keys.nonzero()[: k - 3]] = 0xFFFFFFFF
    elif case == "normals":
        keys = order_keys(torch.randn(n, generator=gen))
    assert int((keys > 0).sum()) >= k
    return keys


def signed_keys(keys: torch.Tensor) -> torch.Tensor:
    """uint32 keys held in int64, as the int32 bits the kernels load."""
    return (keys - (1 << 32) * (keys >= 1 << 31)).to(torch.int32)


@pytest.mark.parametrize("case", SEARCH_CASES)
@pytest.mark.parametrize("seeds", ["none", "around t*", "above t*", "below t*", "extremes"])
def test_exact_search_threshold_and_count(gen: torch.Generator, case: str, seeds: str) -> None:
    """t is the k-th largest nonzero key (or a t with exactly k keys >= it), t > 0, and the
    returned count is count(keys >= t); zero keys (never picked) are not counted. The cases
    lead the bracket search's interpolation astray (clusters, ties, the ends of the key
    range) as well as where it works (normals). First-round seeds only move its trials:
    good ones, ones on one side of t*, and the ends of the key range give the same
    guarantees."""
    n, k = 256, 37
    keys = search_keys(gen, case, n, k)
    live = keys[keys > 0]
    ranked = torch.sort(live, descending=True).values
    seed_lo, seed_hi = {
        "none": (0, 0),
        "around t*": (int(ranked[min(k + 5, live.numel() - 1)]), int(ranked[max(k - 6, 0)])),
        "above t*": (int(ranked[0]), int(ranked[0])),
        "below t*": (int(ranked[-1]), int(ranked[-1])),
        "extremes": (1, 0xFFFFFFFF),
    }[seeds]
    out = torch.zeros(4, dtype=torch.int32)
    _kth_kernel[(1,)](signed_keys(keys), out, k, seed_lo, seed_hi, N=n, BRACKET=0)
    threshold = int(out[0]) & 0xFFFFFFFF
    assert threshold > 0
    assert int(out[1]) == int((live >= threshold).sum())
    assert int((live >= threshold).sum()) >= k
    assert int((live > threshold).sum()) <= k - 1 or int((live >= threshold).sum()) == k
    assert threshold <= int(ranked[k - 1])


@pytest.mark.parametrize("case", SEARCH_CASES)
@pytest.mark.parametrize("bracket", [1, 8, 64])
def test_search_stopped_at_a_bracket(gen: torch.Generator, case: str, bracket: int) -> None:
    """With BRACKET > 0 the search returns (t, count(keys >= t), hi, count(keys > hi)) with
    count(keys >= t) >= k > count(keys > hi) and t <= hi: the k-th largest key t* lies in
    [t, hi]. Unless t is exact (t = t*, or exactly k keys reach it), at most BRACKET keys
    lie in [t, hi] (what `_emit_ranked` ranks)."""
    n, k = 256, 37
    keys = search_keys(gen, case, n, k)
    live = keys[keys > 0]
    kth = int(torch.sort(live, descending=True).values[k - 1])
    out = torch.zeros(4, dtype=torch.int32)
    _kth_kernel[(1,)](signed_keys(keys), out, k, 0, 0, N=n, BRACKET=bracket)
    threshold, hi = int(out[0]) & 0xFFFFFFFF, int(out[2]) & 0xFFFFFFFF
    reaching, above_hi = int(out[1]), int(out[3])
    assert 0 < threshold <= kth <= hi
    assert reaching == int((live >= threshold).sum()) >= k
    assert above_hi == int((live > hi).sum()) < k
    if reaching > k and threshold != kth:
        assert reaching - above_hi <= bracket


@triton.jit
def _seeds_kernel(src_ptr, maxima_ptr, out_ptr, n, k, G: tl.constexpr, SG: tl.constexpr,
                  RANKS: tl.constexpr):  # fmt: skip
    """The stream's group maxima and the floor search's seeds from its lanes (row of n)."""
    seen = topk_kernels._store_group_maxima(src_ptr, n, maxima_ptr, G, SG, RANKS, False)
    _, _, live, seed_lo, seed_hi = topk_kernels._maxima_range(seen, k, RANKS)
    tl.store(out_ptr, seed_lo.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 1, seed_hi.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 2, live)


@pytest.mark.parametrize(
    ("n", "k", "group", "step_groups"),
    [
        (4096, 64, 4, 64),
        (4096, 200, 4, 64),
        (4096, 256, 8, 128),
        (1000, 100, 4, 32),
        (600, 130, 4, 64),
    ],
)
def test_floor_seeds_bracket_the_kth_largest_maximum(
    gen: torch.Generator, n: int, k: int, group: int, step_groups: int
) -> None:
    # With j = cdiv(k, lanes) <= 4: at least k maxima are >= the low seed, fewer than k
    # exceed the high one (`_maxima_range`); short rows leave lanes with fewer than j groups,
    # whose missing ranks count as 0 (a low seed of 0 is no trial at all, still a bound).
    values = torch.randn(n, generator=gen)
    values[::13] = float("-inf")
    ranks = -(-k // step_groups)
    assert ranks <= 4
    maxima = torch.zeros(-(-n // group) + 2 * step_groups, dtype=torch.int32)
    out = torch.zeros(3, dtype=torch.int32)
    _seeds_kernel[(1,)](values, maxima, out, n, k, G=group, SG=step_groups, RANKS=ranks)
    padded = torch.full((-(-n // group) * group,), float("-inf"))
    padded[:n] = values
    keys = order_keys(padded).reshape(-1, group).amax(dim=1)
    keys = torch.where(keys > topk_kernels.KEY_NEG_INF.value, keys, 0)
    seed_lo, seed_hi = (int(v) & 0xFFFFFFFF for v in out[:2])
    assert int(out[2]) == int((keys > 0).sum())
    assert seed_lo <= seed_hi
    assert int((keys >= seed_lo).sum()) >= k
    assert int((keys > seed_hi).sum()) < k


def first_by_value_then_column(row: torch.Tensor, n: int, k: int) -> set[int]:
    """The columns of the k largest of row[:n] by (key descending, column ascending)."""
    keys = order_keys(row[:n])
    live = (keys > KEY_NEG_INF).nonzero().flatten()
    order = sorted(live.tolist(), key=lambda c: (-int(keys[c]), c))
    return set(order[:k])


def run_radix(logits: torch.Tensor, lengths: torch.Tensor, k: int, config: TopkConfig) -> None:
    """The radix path, checked exactly: the picks are the first k by (key, column)."""
    out = torch.full((logits.shape[0], k), SENTINEL, dtype=torch.int32)
    topk_per_row(logits, lengths, k, out, config=config)
    check_rows(logits, lengths, k, out)
    width = logits.shape[1]
    for r in range(logits.shape[0]):
        n = max(0, min(int(lengths[r]), width))
        picks = {c for c in out[r].tolist() if c != -1}
        assert picks == first_by_value_then_column(logits[r], n, k), r


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("k", [1, 13, 40, 300])
def test_radix_random_rows_every_length(gen: torch.Generator, chunk: int, k: int) -> None:
    """Slices of 16 / 64 columns (19 / 5 programs per 300-column row, every row's last
    arrival picking), lengths 0, 1, past the width, negative, fewer live keys than k (all
    taken, -1 after them), both signs, -inf columns."""
    logits = torch.randn(10, 300, generator=gen) * 3.0
    logits[3, ::5] = NEG_INF
    logits[4] = -logits[4].abs()
    run_radix(logits, lengths_for(300, 10, gen), k, topk_kernels.radix_config(chunk, 4))


@pytest.mark.parametrize("capacity", [128, 1024])
def test_radix_staged_keys_past_the_rank_step(gen: torch.Generator, capacity: int) -> None:
    """Keys sharing their top 22 bits (values one ulp apart around 1.0, with duplicates): 600
    staged keys, more than the rank step takes (128), so the counting searches pick them
    (capacity 1024) or, past the capacity (128), the whole-row selection; the tied columns
    picked are the smallest either way. Row 2 has ties at the k-th value across slices."""
    width, k = 640, 40
    ulps = torch.randint(0, 300, (3, width), generator=gen, dtype=torch.int32)
    logits = (torch.full((3, width), 1.0).view(torch.int32) + ulps).view(torch.float32)
    logits[0, :40] = 0.5  # below: never staged
    logits[2] = 1.0
    logits[2, torch.randperm(width, generator=gen)[:10]] = 2.0
    lengths = torch.tensor([width, 600, width], dtype=torch.int32)
    config = dataclasses.replace(topk_kernels.radix_config(64, 4), capacity=capacity)
    run_radix(logits, lengths, k, config)


def test_radix_ties_at_the_threshold_picked_in_column_order(gen: torch.Generator) -> None:
    """The rows of the tie test above on the radix path: few staged keys (the rank step) and
    hundreds of equal keys (the whole-row selection at capacity 128, searches at 1024)."""
    width, k = 700, 20
    rows, _ = tied_threshold_rows(width, gen)
    lengths = torch.full((3,), width, dtype=torch.int32)
    for capacity in (128, 1024):
        config = dataclasses.replace(topk_kernels.radix_config(64, 4), capacity=capacity)
        run_radix(rows, lengths, k, config)


def test_radix_many_row_batches_and_strided_rows(gen: torch.Generator) -> None:
    """A row stride wider than the row (a view), a width not a multiple of 4 (loads masked
    per column) and every row's state zeroed per call."""
    base = torch.randn(6, 211, generator=gen)
    logits = base[:, :203]
    lengths = torch.tensor([203, 150, 0, 90, 203, 7], dtype=torch.int32)
    config = topk_kernels.radix_config(32, 4)
    run_radix(logits, lengths, 9, config)
    run_radix(logits, lengths, 9, config)


def test_radix_bad_config_raises_before_any_launch() -> None:
    with pytest.raises(ValueError, match=r"config\.chunk"):
        check_config(topk_kernels.radix_config(16384, 8), 10)
    with pytest.raises(ValueError, match=r"config\.capacity"):
        check_config(dataclasses.replace(topk_kernels.radix_config(64, 4), capacity=64), 10)
