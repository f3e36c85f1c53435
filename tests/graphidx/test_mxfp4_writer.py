"""The K writer: written slots hold quantize_mxfp4 of their key, every other byte stays."""

from __future__ import annotations

import pytest
import torch

from graphidx.mxfp4.format import quantize_mxfp4
from graphidx.mxfp4.layout import CacheLayout, cache_layout, read_entries, unpack_page
from graphidx.mxfp4.writer import compressed_slot_mapping, write_k_cache


def poisoned_cache(
    gen: torch.Generator, num_pages: int, row_bytes: int, storage_bytes: int | None = None
) -> torch.Tensor:
    """Random bytes everywhere; rows of `row_bytes` spaced `storage_bytes` apart."""
    storage_bytes = storage_bytes or row_bytes
    raw = torch.randint(0, 256, (num_pages, storage_bytes), generator=gen, dtype=torch.int32)
    return raw.to(torch.uint8)[:, :row_bytes]


def random_keys(gen: torch.Generator, tokens: int, dim: int) -> torch.Tensor:
    scale = 10.0 ** torch.randint(-3, 4, (tokens, 1), generator=gen).float()
    return torch.randn(tokens, dim, generator=gen) * scale


def check_write(
    gen: torch.Generator,
    layout: CacheLayout,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keys = random_keys(gen, slot_mapping.shape[0], layout.head_dim)
    before_storage = kv_cache.as_strided(
        (kv_cache.shape[0], kv_cache.stride(0)), (kv_cache.stride(0), 1)
    ).clone()
    write_k_cache(keys, slot_mapping, kv_cache, layout)
    after_storage = kv_cache.as_strided(
        (kv_cache.shape[0], kv_cache.stride(0)), (kv_cache.stride(0), 1)
    )

    want_values, want_scales = quantize_mxfp4(keys)
    keep = slot_mapping >= 0
    written = slot_mapping[keep]
    pages = written // layout.page_entries
    entries = written % layout.page_entries
    got_values, got_scales = read_entries(kv_cache, layout, pages, entries)
    assert torch.equal(got_values, want_values[keep])
    assert torch.equal(got_scales, want_scales[keep])

    # Expected storage: the old bytes with only the written entries' bytes replaced, at
    # positions spelled out from docs/contract.md section 4 here; padding past page_bytes and
    # the gap between rows must not change.
    expected = before_storage.clone()
    for i, (page, entry) in enumerate(zip(pages.tolist(), entries.tolist(), strict=True)):
        expected[page, _value_positions(layout, entry)] = want_values[keep][i]
        expected[page, _scale_positions(layout, entry)] = want_scales[keep][i]
    assert torch.equal(after_storage, expected)


def _value_positions(layout: CacheLayout, entry: int) -> list[int]:
    # docs/contract.md section 4, written out: [tile][16-byte chunk][entry][byte].
    n, half = layout.n_per_tile, layout.head_dim // 2
    tile, local = divmod(entry, n)
    return [tile * n * half + (b // 16) * n * 16 + local * 16 + b % 16 for b in range(half)]


def _scale_positions(layout: CacheLayout, entry: int) -> list[int]:
    n, lanes, count = layout.n_per_tile, layout.scale_lanes, layout.head_dim // 32
    per = count // lanes
    tile, local = divmod(entry, n)
    base = layout.page_entries * layout.head_dim // 2 + tile * n * count
    return [base + (s % lanes) * n * per + local * per + s // lanes for s in range(count)]


@pytest.mark.parametrize(("heads", "dim", "entries"), [(64, 128, 64), (16, 128, 32), (8, 64, 32)])
def test_write_random_slots(gen: torch.Generator, heads: int, dim: int, entries: int) -> None:
    layout = cache_layout(heads, dim, entries)
    num_pages = 4
    kv_cache = poisoned_cache(gen, num_pages, layout.page_bytes)
    slots = torch.randperm(num_pages * entries, generator=gen)[:40]
    slots[::7] = -1  # tokens without a compressed key
    check_write(gen, layout, kv_cache, slots)


def test_write_into_strided_pages_keeps_padding(gen: torch.Generator) -> None:
    layout = cache_layout(16, 128, 32)
    # Rows longer than a page, spaced further apart than a row: both gaps must survive.
    kv_cache = poisoned_cache(gen, 5, layout.page_bytes + 40, layout.page_bytes + 100)
    assert kv_cache.stride(0) > kv_cache.shape[1] > layout.page_bytes
    slots = torch.tensor([0, 31, 32, -1, 159, 77, 100, -1, 5])
    check_write(gen, layout, kv_cache, slots)


def test_all_minus_one_writes_nothing(gen: torch.Generator) -> None:
    layout = cache_layout(64, 128, 64)
    kv_cache = poisoned_cache(gen, 2, layout.page_bytes)
    before = kv_cache.clone()
    write_k_cache(random_keys(gen, 6, 128), torch.full((6,), -1), kv_cache, layout)
    assert torch.equal(kv_cache, before)


def test_bf16_keys_and_int32_slots(gen: torch.Generator) -> None:
    layout = cache_layout(64, 128, 64)
    kv_cache = poisoned_cache(gen, 3, layout.page_bytes)
    keys = random_keys(gen, 5, 128).to(torch.bfloat16)
    slots = torch.tensor([3, 64, -1, 191, 100], dtype=torch.int32)
    write_k_cache(keys, slots, kv_cache, layout)
    want_values, want_scales = quantize_mxfp4(keys)
    keep = slots >= 0
    got = read_entries(kv_cache, layout, slots[keep] // 64, slots[keep] % 64)
    assert torch.equal(got[0], want_values[keep]) and torch.equal(got[1], want_scales[keep])


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ([0, 5, 128], r"slot_mapping holds slot 128, outside \[-1, 128\)"),
        ([0, -2, 3], r"slot_mapping holds slot -2"),
        ([7, 9, 7], r"slot_mapping writes slot 7 more than once"),
    ],
)
def test_bad_slots_raise_before_any_write(
    gen: torch.Generator, slots: list[int], message: str
) -> None:
    layout = cache_layout(64, 128, 64)
    kv_cache = poisoned_cache(gen, 2, layout.page_bytes)
    before = kv_cache.clone()
    with pytest.raises(ValueError, match=message):
        write_k_cache(random_keys(gen, 3, 128), torch.tensor(slots), kv_cache, layout)
    assert torch.equal(kv_cache, before)


def test_nan_key_raises_before_any_write(gen: torch.Generator) -> None:
    layout = cache_layout(64, 128, 64)
    kv_cache = poisoned_cache(gen, 2, layout.page_bytes)
    before = kv_cache.clone()
    keys = random_keys(gen, 3, 128)
    keys[2, 5] = float("nan")
    with pytest.raises(ValueError, match="contains NaN"):
        write_k_cache(keys, torch.tensor([0, 1, 2]), kv_cache, layout)
    assert torch.equal(kv_cache, before)


def test_writer_argument_errors(gen: torch.Generator) -> None:
    layout = cache_layout(64, 128, 64)
    kv_cache = poisoned_cache(gen, 2, layout.page_bytes)
    keys = random_keys(gen, 3, 128)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"k must have shape \[tokens, 128\].*\(3, 64\)"):
        write_k_cache(keys[:, :64], slots, kv_cache, layout)
    with pytest.raises(ValueError, match="k must be a floating-point tensor"):
        write_k_cache(slots.reshape(3, 1).expand(3, 128), slots, kv_cache, layout)
    with pytest.raises(ValueError, match="slot_mapping must be an integer tensor"):
        write_k_cache(keys, slots.float(), kv_cache, layout)
    with pytest.raises(ValueError, match="slot_mapping has 2 slots for 3 tokens"):
        write_k_cache(keys, slots[:2], kv_cache, layout)
    with pytest.raises(ValueError, match="page stride"):
        write_k_cache(keys, slots, kv_cache[:, :-1], layout)


def hand_slot_mapping(
    positions: list[int], reqs: list[int], table: list[list[int]], ratio: int, entries: int
) -> list[int]:
    out = []
    for p, r in zip(positions, reqs, strict=True):
        if (p + 1) % ratio:
            out.append(-1)
            continue
        c = (p + 1) // ratio - 1
        out.append(table[r][c // entries] * entries + c % entries)
    return out


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_compressed_slot_mapping_matches_hand_loop(gen: torch.Generator, ratio: int) -> None:
    entries = 64 // ratio
    num_reqs, max_blocks = 3, 4
    table = torch.randperm(40, generator=gen)[: num_reqs * max_blocks].reshape(num_reqs, -1)
    table = table.to(torch.int32)
    positions, reqs = [], []
    for r in range(num_reqs):  # each request: a random run of consecutive positions
        start = int(torch.randint(0, 150, (1,), generator=gen))
        length = int(torch.randint(1, 100, (1,), generator=gen))
        positions += list(range(start, start + length))
        reqs += [r] * length
    got = compressed_slot_mapping(
        torch.tensor(positions), torch.tensor(reqs), table, ratio, entries
    )
    assert got.dtype == torch.int64
    want = hand_slot_mapping(positions, reqs, table.tolist(), ratio, entries)
    assert got.tolist() == want
    assert (got >= 0).sum().item() == sum((p + 1) % ratio == 0 for p in positions)


def test_compressed_slot_mapping_errors() -> None:
    table = torch.tensor([[3, 1], [0, -1]], dtype=torch.int32)
    pos = torch.tensor([0, 1, 2, 3])
    req = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="positions holds -3, must be >= 0"):
        compressed_slot_mapping(torch.tensor([0, -3, 2, 3]), req, table, 2, 4)
    with pytest.raises(ValueError, match=r"req_indices holds 2, outside \[0, 2\)"):
        compressed_slot_mapping(pos, torch.tensor([0, 0, 2, 1]), table, 2, 4)
    with pytest.raises(ValueError, match=r"req_indices holds -1"):
        compressed_slot_mapping(pos, torch.tensor([0, -1, 0, 1]), table, 2, 4)
    with pytest.raises(ValueError, match=r"block_table has 2 columns.*position 17.*column 2"):
        compressed_slot_mapping(torch.tensor([0, 17]), torch.tensor([0, 0]), table, 2, 4)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] is -1.*position 9"):
        compressed_slot_mapping(torch.tensor([9]), torch.tensor([1]), table, 2, 4)
    # Position 10 completes no entry at R = 2, so the missing page is never looked at.
    assert compressed_slot_mapping(torch.tensor([10]), torch.tensor([1]), table, 2, 4).tolist() == [
        -1
    ]
    with pytest.raises(ValueError, match="compress_ratio must be a positive integer, got 0"):
        compressed_slot_mapping(pos, req, table, 0, 4)
    with pytest.raises(ValueError, match="page_entries must be a positive integer"):
        compressed_slot_mapping(pos, req, table, 2, -4)
    with pytest.raises(ValueError, match="block_table must be 2-D"):
        compressed_slot_mapping(pos, req, table[0], 2, 4)
    with pytest.raises(ValueError, match="req_indices shape"):
        compressed_slot_mapping(pos, req[:3], table, 2, 4)


def test_slot_mapping_feeds_the_writer(gen: torch.Generator) -> None:
    # End to end at R = 4: the compressed key of position p lands where a reader finds c.
    layout = cache_layout(16, 128, 16)  # n_per_tile 16 tiles a 16-entry page
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    positions = torch.arange(5, 5 + 150)  # entries 0..38: all three pages
    slots = compressed_slot_mapping(positions, torch.zeros_like(positions), table, 4, 16)
    kv_cache = poisoned_cache(gen, 4, layout.page_bytes + 16)
    keys = random_keys(gen, 150, 128)
    write_k_cache(keys, slots, kv_cache, layout)
    values, _ = quantize_mxfp4(keys)
    for i, p in enumerate(positions.tolist()):
        if (p + 1) % 4:
            continue
        c = (p + 1) // 4 - 1
        page_values, _ = unpack_page(kv_cache[int(table[0, c // 16])], layout, 128)
        assert torch.equal(page_values[c % 16], values[i])
