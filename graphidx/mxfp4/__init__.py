"""MXFP4 keys and queries, and the preshuffled paged K cache (docs/contract.md section 4)."""

from graphidx.mxfp4.format import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4
from graphidx.mxfp4.layout import (
    CacheLayout,
    cache_layout,
    check_kv_cache,
    device_entry_offsets,
    entry_offsets,
    pack_page,
    read_entries,
    unpack_page,
)
from graphidx.mxfp4.writer import compressed_slot_mapping, write_k_cache

__all__ = [
    "E2M1_VALUES",
    "CacheLayout",
    "cache_layout",
    "check_kv_cache",
    "compressed_slot_mapping",
    "dequantize_mxfp4",
    "device_entry_offsets",
    "entry_offsets",
    "pack_page",
    "quantize_mxfp4",
    "read_entries",
    "unpack_page",
    "write_k_cache",
]
