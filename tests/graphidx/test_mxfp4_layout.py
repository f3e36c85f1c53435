"""The preshuffled page layout, checked byte by byte against docs/contract.md section 4's order."""

from __future__ import annotations

import pytest
import torch

from graphidx.mxfp4.layout import (
    CacheLayout,
    cache_layout,
    check_kv_cache,
    entry_offsets,
    pack_page,
    read_entries,
    unpack_page,
)

# (num_heads, head_dim, page_entries, expected n_per_tile)
LAYOUTS = [
    (64, 128, 64, 32),  # V3.2: n = 32, 2 scale lanes, 2 scales per lane slot
    (16, 128, 32, 16),  # few heads: n = 16, 4 lanes, 1 scale per lane slot
    (8, 64, 64, 32),  # D = 64 keeps n = 32 whatever the heads
    (8, 256, 32, 16),  # n = 16, 4 lanes, 2 scales per lane slot
]


def spec_offsets(layout: CacheLayout) -> tuple[dict[tuple[int, int], int], dict]:
    """Walk a page in storage order, as docs/contract.md section 4 words it, and record who
    owns each byte."""
    n = layout.n_per_tile
    d = layout.head_dim
    value_at: dict[tuple[int, int], int] = {}
    scale_at: dict[tuple[int, int], int] = {}
    cursor = 0
    for tile in range(layout.page_entries // n):  # values: [tile][chunk][entry][byte]
        for chunk in range(d // 2 // 16):
            for local in range(n):
                for byte in range(16):
                    value_at[(tile * n + local, chunk * 16 + byte)] = cursor
                    cursor += 1
    lanes = layout.scale_lanes
    for tile in range(layout.page_entries // n):  # scales: [tile][lane][entry][s // lanes]
        for lane in range(lanes):
            for local in range(n):
                for slot in range(d // 32 // lanes):
                    scale_at[(tile * n + local, slot * lanes + lane)] = cursor
                    cursor += 1
    return value_at, scale_at


@pytest.fixture(params=LAYOUTS, ids=lambda row: "-".join(map(str, row)))
def layout(request: pytest.FixtureRequest) -> CacheLayout:
    """The layout of each LAYOUTS row, for its head_dim and page_entries."""
    heads, dim, entries, _ = request.param
    made = cache_layout(heads, dim, entries)
    assert (made.head_dim, made.page_entries) == (dim, entries)
    return made


def random_entries(gen: torch.Generator, layout: CacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    shape_v = (layout.page_entries, layout.head_dim // 2)
    shape_s = (layout.page_entries, layout.head_dim // 32)
    values = torch.randint(0, 256, shape_v, generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 256, shape_s, generator=gen, dtype=torch.int32).to(torch.uint8)
    return values, scales


@pytest.mark.parametrize(("heads", "dim", "entries", "n"), LAYOUTS)
def test_layout_fields(heads: int, dim: int, entries: int, n: int) -> None:
    layout = cache_layout(heads, dim, entries)
    assert layout.n_per_tile == n
    assert layout.d_per_tile == 16
    assert layout.scale_lanes == 64 // n
    assert layout.value_bytes_per_entry == dim // 2
    assert layout.scale_bytes_per_entry == dim // 32
    assert layout.entry_bytes == dim // 2 + dim // 32
    assert layout.page_bytes == entries * (dim // 2 + dim // 32)
    assert layout.scale_base == entries * dim // 2
    assert hash(layout) == hash(cache_layout(heads, dim, entries))


@pytest.mark.parametrize(
    ("heads", "dim", "n"), [(32, 128, 32), (31, 128, 16), (1, 256, 16), (16, 64, 32)]
)
def test_tile_choice_boundaries(heads: int, dim: int, n: int) -> None:
    assert cache_layout(heads, dim, 64).n_per_tile == n


def test_v32_entry_is_68_bytes() -> None:
    assert cache_layout(64, 128, 64).entry_bytes == 68


def test_every_offset_matches_the_spec_walk(layout: CacheLayout) -> None:
    entries, dim = layout.page_entries, layout.head_dim
    value_at, scale_at = spec_offsets(layout)
    value_offsets, scale_offsets = entry_offsets(layout)
    assert value_offsets.dtype == torch.int64 and value_offsets.device.type == "cpu"
    assert value_offsets.shape == (entries, dim // 2)
    assert scale_offsets.shape == (entries, dim // 32)
    for (entry, byte), offset in value_at.items():
        assert int(value_offsets[entry, byte]) == offset, (entry, byte)
    for (entry, scale), offset in scale_at.items():
        assert int(scale_offsets[entry, scale]) == offset, (entry, scale)
    # The walk covers the page exactly once.
    assert sorted([*value_at.values(), *scale_at.values()]) == list(range(layout.page_bytes))


def test_pack_page_places_every_byte(gen: torch.Generator, layout: CacheLayout) -> None:
    values, scales = random_entries(gen, layout)
    page = pack_page(values, scales, layout)
    assert page.dtype == torch.uint8 and page.shape == (layout.page_bytes,)
    value_at, scale_at = spec_offsets(layout)
    page_list = page.tolist()
    for (entry, byte), offset in value_at.items():
        assert page_list[offset] == int(values[entry, byte])
    for (entry, scale), offset in scale_at.items():
        assert page_list[offset] == int(scales[entry, scale])


def test_round_trip_with_page_padding(gen: torch.Generator, layout: CacheLayout) -> None:
    values, scales = random_entries(gen, layout)
    padding = torch.randint(0, 256, (37,), generator=gen, dtype=torch.int32).to(torch.uint8)
    page = torch.cat((pack_page(values, scales, layout), padding))
    got_values, got_scales = unpack_page(page, layout, layout.head_dim)
    assert torch.equal(got_values, values)
    assert torch.equal(got_scales, scales)


def test_read_entries_gathers_from_strided_pages(gen: torch.Generator) -> None:
    layout = cache_layout(16, 128, 32)
    num_pages, stride = 5, layout.page_bytes + 24
    storage = torch.randint(0, 256, (num_pages, stride + 8), generator=gen, dtype=torch.int32)
    kv_cache = storage.to(torch.uint8)[:, :stride]  # row stride > page stride > page_bytes
    pages = torch.tensor([4, 0, 2, 2, 4, 1])
    slots = torch.tensor([31, 0, 5, 17, 16, 9])
    values, scales = read_entries(kv_cache, layout, pages, slots)
    assert values.shape == (6, 64) and scales.shape == (6, 4)
    for i, (p, s) in enumerate(zip(pages.tolist(), slots.tolist(), strict=True)):
        page_values, page_scales = unpack_page(kv_cache[p], layout, 128)
        assert torch.equal(values[i], page_values[s])
        assert torch.equal(scales[i], page_scales[s])


def test_read_entries_validates() -> None:
    layout = cache_layout(64, 128, 64)
    kv_cache = torch.zeros(2, layout.page_bytes, dtype=torch.uint8)
    good = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="pages must be a signed integer"):
        read_entries(kv_cache, layout, good.float(), good)
    with pytest.raises(ValueError, match="slots must be 1-D"):
        read_entries(kv_cache, layout, good, good.reshape(3, 1))
    with pytest.raises(ValueError, match="pages shape"):
        read_entries(kv_cache, layout, good[:2], good)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 128, 64), "num_heads must be a positive integer, got 0"),
        ((64, 0, 64), "head_dim must be a positive integer, got 0"),
        ((64, -32, 64), "head_dim must be a positive integer, got -32"),
        ((64, 48, 64), "head_dim must be a multiple of 32.*got 48"),
        (
            (64, 32, 64),
            r"head_dim // 32 \(1 scales per entry\) must be a multiple of "
            r"scale_lanes \(2\)",
        ),
        ((16, 96, 64), r"head_dim // 32 \(3 scales.*scale_lanes \(4\).*got head_dim 96"),
        ((64, 96, 64), r"head_dim // 32 \(3 scales.*scale_lanes \(2\)"),
        ((64, 128, 0), "page_entries must be a positive integer, got 0"),
        ((64, 128, 48), r"page_entries must be a multiple of n_per_tile \(32\), got 48"),
        ((16, 128, 24), r"page_entries must be a multiple of n_per_tile \(16\), got 24"),
        ((True, 128, 64), "num_heads must be a positive integer, got True"),
    ],
)
def test_tiling_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cache_layout(*args)


def test_direct_layout_with_bad_chunk_raises() -> None:
    with pytest.raises(ValueError, match=r"must be a multiple of d_per_tile \(24\)"):
        CacheLayout(n_per_tile=32, d_per_tile=24, scale_lanes=2, head_dim=128, page_entries=64)


def test_pack_and_unpack_validate(gen: torch.Generator) -> None:
    layout = cache_layout(64, 128, 64)
    values, scales = random_entries(gen, layout)
    with pytest.raises(ValueError, match=r"values must have shape \(64, 64\)"):
        pack_page(values[:32], scales, layout)
    with pytest.raises(ValueError, match="scales must be a uint8"):
        pack_page(values, scales.to(torch.int32), layout)
    page = pack_page(values, scales, layout)
    with pytest.raises(ValueError, match=r"fewer than layout\.page_bytes"):
        unpack_page(page[:-1], layout, 128)
    with pytest.raises(ValueError, match="head_dim 64 does not match"):
        unpack_page(page, layout, 64)


def test_check_kv_cache() -> None:
    layout = cache_layout(64, 128, 64)
    check_kv_cache(torch.zeros(3, layout.page_bytes + 64, dtype=torch.uint8), layout)
    with pytest.raises(ValueError, match="kv_cache must be uint8"):
        check_kv_cache(torch.zeros(3, layout.page_bytes, dtype=torch.int8), layout)
    with pytest.raises(ValueError, match="kv_cache must be 2-D"):
        check_kv_cache(torch.zeros(3 * layout.page_bytes, dtype=torch.uint8), layout)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        check_kv_cache(torch.zeros(layout.page_bytes, 3, dtype=torch.uint8).T, layout)
    with pytest.raises(ValueError, match="page stride 4351 is smaller"):
        check_kv_cache(torch.zeros(3, layout.page_bytes - 1, dtype=torch.uint8), layout)
    overlapping = torch.zeros(3 * layout.page_bytes, dtype=torch.uint8).as_strided(
        (3, layout.page_bytes), (layout.page_bytes - 1, 1)
    )
    with pytest.raises(ValueError, match="kv_cache pages overlap"):
        check_kv_cache(overlapping, layout)
