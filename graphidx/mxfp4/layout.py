"""Byte order of the preshuffled paged MXFP4 K cache (docs/contract.md section 4).

This module is the one source of truth for where each byte of a key lives. Kernels that
cannot import it (Triton, aiter) re-derive exactly these formulas.

Notation: D = head_dim, E = page_entries, n = n_per_tile, S = D // 32 scale bytes per entry,
L = scale_lanes, P = S // L scales per entry per lane. Entry `c` of a page lives in tile
`t = c // n` at local index `e = c % n`.

The cache is a uint8 tensor `[num_pages, page_stride]`; page `p` starts at byte
`p * kv_cache.stride(0)` of its storage, and bytes past `page_bytes` in a page are padding
that nobody writes. Within a page:

    values (first E * D/2 bytes; byte b of an entry, 0 <= b < D/2):
        offset = t * n * (D/2)               # the tile's value region
               + (b // 16) * (n * 16)         # 16-byte chunk of the entry
               + e * 16                       # entry within the chunk
               + b % 16                       # byte within the chunk

    scales (from scale_base = E * D/2; scale s of an entry, 0 <= s < S):
        offset = scale_base + t * n * S      # the tile's scale region
               + (s % L) * (n * P)            # lane
               + e * P                        # entry within the lane
               + s // L                       # scale within the entry's lane slot

i.e. values as `[chunk, entry, byte]` and scales as `[lane, entry, s // L]` per tile: the
order aiter's gfx950 kernel reads. Choice of tile (a function of heads and head_dim only):
n = 16 when num_heads < 32 and head_dim > 64, else 32; 16-byte value chunks (d_per_tile);
L = 64 // n. A layout requires S % L == 0, so D = 32 never tiles; D = 64 tiles with n = 32
and D = 128 with either n.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from graphidx.mxfp4.format import BLOCK_SIZE

VALUE_CHUNK_BYTES = 16
SCALE_LANE_SLOTS = 64  # n_per_tile * scale_lanes


def _require_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class CacheLayout:
    """Tiling of one K-cache page; build it with `cache_layout`.

    n_per_tile: entries per tile; d_per_tile: bytes per value chunk; scale_lanes: lanes the
    scale bytes of a tile are spread over; head_dim: elements per key; page_entries: entries
    per page. Construction checks that the fields tile a page (see module docstring).
    """

    n_per_tile: int
    d_per_tile: int
    scale_lanes: int
    head_dim: int
    page_entries: int

    def __post_init__(self) -> None:
        for name in ("n_per_tile", "d_per_tile", "scale_lanes", "head_dim", "page_entries"):
            _require_positive_int(name, getattr(self, name))
        if self.head_dim % BLOCK_SIZE:
            raise ValueError(
                f"head_dim must be a multiple of {BLOCK_SIZE} (one scale per {BLOCK_SIZE} "
                f"elements), got {self.head_dim}"
            )
        if (self.head_dim // 2) % self.d_per_tile:
            raise ValueError(
                f"head_dim // 2 ({self.head_dim // 2} value bytes) must be a multiple of "
                f"d_per_tile ({self.d_per_tile}), got head_dim {self.head_dim}"
            )
        if self.page_entries % self.n_per_tile:
            raise ValueError(
                f"page_entries must be a multiple of n_per_tile ({self.n_per_tile}), "
                f"got {self.page_entries}"
            )
        if self.scale_bytes_per_entry % self.scale_lanes:
            raise ValueError(
                f"head_dim // {BLOCK_SIZE} ({self.scale_bytes_per_entry} scales per entry) "
                f"must be a multiple of scale_lanes ({self.scale_lanes}), "
                f"got head_dim {self.head_dim}"
            )

    @property
    def value_bytes_per_entry(self) -> int:
        return self.head_dim // 2

    @property
    def scale_bytes_per_entry(self) -> int:
        return self.head_dim // BLOCK_SIZE

    @property
    def entry_bytes(self) -> int:
        return self.value_bytes_per_entry + self.scale_bytes_per_entry

    @property
    def page_bytes(self) -> int:
        """The smallest page; a cache's page stride may be larger."""
        return self.page_entries * self.entry_bytes

    @property
    def scale_base(self) -> int:
        """Byte offset of the first scale in a page: all values come first."""
        return self.page_entries * self.value_bytes_per_entry


def cache_layout(num_heads: int, head_dim: int, page_entries: int) -> CacheLayout:
    """The cache layout for a model with `num_heads` index heads of `head_dim`.

    page_entries: compressed entries per page (block_size // compress_ratio).
    Raises ValueError naming the argument when the page cannot be tiled: head_dim not a
    positive multiple of 32, head_dim // 32 not a multiple of the scale lanes (D = 32),
    page_entries not a positive multiple of the tile's entries.
    """
    _require_positive_int("num_heads", num_heads)
    _require_positive_int("head_dim", head_dim)
    _require_positive_int("page_entries", page_entries)
    return _cached_layout(num_heads, head_dim, page_entries)


@functools.lru_cache(maxsize=64)
def _cached_layout(num_heads: int, head_dim: int, page_entries: int) -> CacheLayout:
    """`cache_layout` of checked ints, made once per shape (every op call asks for it; the
    layout is frozen, so sharing it is safe; a bad shape raises and is not cached)."""
    n_per_tile = 16 if (num_heads < 32 and head_dim > 64) else 32
    return CacheLayout(
        n_per_tile=n_per_tile,
        d_per_tile=VALUE_CHUNK_BYTES,
        scale_lanes=SCALE_LANE_SLOTS // n_per_tile,
        head_dim=head_dim,
        page_entries=page_entries,
    )


@functools.lru_cache(maxsize=64)
def entry_offsets(layout: CacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offsets within a page of every entry's values and scales (CPU, int64).

    Returns `(value_offsets [page_entries, D/2], scale_offsets [page_entries, D/32])`:
    `value_offsets[c, b]` is where byte b of entry c's values lives, `scale_offsets[c, s]`
    where its scale s lives. Cached per layout: treat the tensors as read-only.
    """
    n = layout.n_per_tile
    chunk = layout.d_per_tile
    lanes = layout.scale_lanes
    per_lane = layout.scale_bytes_per_entry // lanes
    entry = torch.arange(layout.page_entries, dtype=torch.int64).unsqueeze(1)
    tile, local = entry // n, entry % n

    byte = torch.arange(layout.value_bytes_per_entry, dtype=torch.int64).unsqueeze(0)
    value_offsets = (
        tile * n * layout.value_bytes_per_entry
        + (byte // chunk) * (n * chunk)
        + local * chunk
        + byte % chunk
    )

    scale = torch.arange(layout.scale_bytes_per_entry, dtype=torch.int64).unsqueeze(0)
    scale_offsets = (
        layout.scale_base
        + tile * n * layout.scale_bytes_per_entry
        + (scale % lanes) * (n * per_lane)
        + local * per_lane
        + scale // lanes
    )
    return value_offsets, scale_offsets


@functools.lru_cache(maxsize=64)
def device_entry_offsets(
    layout: CacheLayout, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`entry_offsets(layout)` on `device`, copied once per device and then cached.

    Call it once before a graph capture: the first call copies from the host. Read-only.
    """
    value_offsets, scale_offsets = entry_offsets(layout)
    return value_offsets.to(device), scale_offsets.to(device)


def _check_entry_bytes(values: torch.Tensor, scales: torch.Tensor, layout: CacheLayout) -> None:
    expected = {
        "values": (layout.page_entries, layout.value_bytes_per_entry),
        "scales": (layout.page_entries, layout.scale_bytes_per_entry),
    }
    for name, tensor in (("values", values), ("scales", scales)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8:
            raise ValueError(
                f"{name} must be a uint8 tensor, got "
                f"{getattr(tensor, 'dtype', type(tensor).__name__)}"
            )
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"{name} must have shape {expected[name]} for this layout, "
                f"got {tuple(tensor.shape)}"
            )
    if values.device != scales.device:
        raise ValueError(
            f"values and scales must share a device, got {values.device} and {scales.device}"
        )


def pack_page(values: torch.Tensor, scales: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
    """Lay out one whole page of entries.

    values: uint8 `[page_entries, D/2]`, scales: uint8 `[page_entries, D/32]` (entry c in
    row c). Returns uint8 `[page_bytes]` on their device, every byte written.
    """
    _check_entry_bytes(values, scales, layout)
    value_offsets, scale_offsets = device_entry_offsets(layout, values.device)
    page = torch.empty(layout.page_bytes, dtype=torch.uint8, device=values.device)
    page[value_offsets.reshape(-1)] = values.reshape(-1)
    page[scale_offsets.reshape(-1)] = scales.reshape(-1)
    return page


def unpack_page(
    page: torch.Tensor, layout: CacheLayout, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_page`: `(values [page_entries, D/2], scales [page_entries, D/32])`.

    page: 1-D uint8 with at least page_bytes bytes (bytes past page_bytes are ignored).
    head_dim must equal layout.head_dim (it states what the caller expects to read).
    """
    if head_dim != layout.head_dim:
        raise ValueError(f"head_dim {head_dim!r} does not match layout.head_dim {layout.head_dim}")
    if not isinstance(page, torch.Tensor) or page.dtype != torch.uint8 or page.dim() != 1:
        raise ValueError(
            f"page must be a 1-D uint8 tensor, got "
            f"{getattr(page, 'dtype', type(page).__name__)} of shape "
            f"{tuple(getattr(page, 'shape', ()))}"
        )
    if page.shape[0] < layout.page_bytes:
        raise ValueError(
            f"page has {page.shape[0]} bytes, fewer than layout.page_bytes {layout.page_bytes}"
        )
    value_offsets, scale_offsets = device_entry_offsets(layout, page.device)
    return page[value_offsets], page[scale_offsets]


def check_kv_cache(kv_cache: torch.Tensor, layout: CacheLayout) -> None:
    """Raise ValueError unless kv_cache can hold pages of `layout`.

    Needs: uint8, 2-D `[num_pages, page_stride]`, last dim contiguous, page_stride (the
    row length) >= layout.page_bytes, and rows that do not overlap (stride(0) >= row length).
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8:
        raise ValueError(f"kv_cache must be uint8, got {kv_cache.dtype}")
    if kv_cache.dim() != 2:
        raise ValueError(
            f"kv_cache must be 2-D [num_pages, page_stride], got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[1] > 1 and kv_cache.stride(1) != 1:
        raise ValueError(
            f"kv_cache must be contiguous in its last dim, got strides {kv_cache.stride()}"
        )
    if kv_cache.shape[1] < layout.page_bytes:
        raise ValueError(
            f"kv_cache page stride {kv_cache.shape[1]} is smaller than the layout's "
            f"page_bytes {layout.page_bytes}"
        )
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) < kv_cache.shape[1]:
        raise ValueError(
            f"kv_cache pages overlap: stride(0) {kv_cache.stride(0)} < page stride "
            f"{kv_cache.shape[1]}"
        )


def read_entries(
    kv_cache: torch.Tensor, layout: CacheLayout, pages: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the bytes of entries `(pages[i], slots[i])` straight from the cache.

    kv_cache: uint8 `[num_pages, page_stride]`; pages, slots: integer `[n]` on its device
    (slots are entries within a page, 0 <= slot < page_entries). Returns
    `(values [n, D/2], scales [n, D/32])` uint8 on the cache's device. Only those entries'
    bytes are read. Indices are not range-checked here (no host sync): out-of-range ones
    raise from torch's indexing on the CPU and are undefined on a GPU.
    """
    check_kv_cache(kv_cache, layout)
    for name, index in (("pages", pages), ("slots", slots)):
        if index.dtype.is_floating_point or index.dtype in (torch.bool, torch.uint8):
            raise ValueError(f"{name} must be a signed integer tensor, got {index.dtype}")
        if index.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(index.shape)}")
        if index.device != kv_cache.device:
            raise ValueError(
                f"{name} is on {index.device}, kv_cache on {kv_cache.device}: must match"
            )
    if pages.shape != slots.shape:
        raise ValueError(
            f"pages shape {tuple(pages.shape)} and slots shape {tuple(slots.shape)} differ"
        )
    value_offsets, scale_offsets = device_entry_offsets(layout, kv_cache.device)
    page_rows = pages.to(torch.int64).unsqueeze(1)
    entry_rows = slots.to(torch.int64)
    values = kv_cache[page_rows, value_offsets[entry_rows]]
    scales = kv_cache[page_rows, scale_offsets[entry_rows]]
    return values, scales
