"""The K writer (docs/contract.md section 4): quantize keys and store each at its cache slot.

A slot is `page * page_entries + entry`; the bytes of entry `entry` of page `page` are the
ones `graphidx.mxfp4.layout.entry_offsets` names. Slot -1 means "this token has no key".
"""

from __future__ import annotations

import torch

from graphidx.mxfp4.format import quantize_mxfp4
from graphidx.mxfp4.layout import CacheLayout, check_kv_cache, device_entry_offsets


def _check_index_tensor(name: str, tensor: object, dims: int) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(tensor.shape)}")
    return tensor


def write_k_cache(
    k: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor, layout: CacheLayout
) -> None:
    """Quantize `k` to MXFP4 and store key i at cache slot `slot_mapping[i]`, in place.

    k: float `[tokens, head_dim]`; slot_mapping: integer `[tokens]`, each -1 (write nothing)
    or in `[0, num_pages * page_entries)`, no slot twice; kv_cache: uint8
    `[num_pages, page_stride]` laid out as `layout` (see `check_kv_cache`); all on one
    device. Only the bytes of the written slots change: other entries of the same tile and
    each page's padding past `page_bytes` keep their bytes.

    Everything is validated before the first byte is written, and that needs the slot
    values and a NaN check on the host: this path synchronizes with the device (a few
    small reads), so call it outside graph capture. Raises ValueError naming the argument.
    """
    check_kv_cache(kv_cache, layout)
    if not isinstance(k, torch.Tensor) or not k.is_floating_point():
        raise ValueError(
            f"k must be a floating-point tensor, got {getattr(k, 'dtype', type(k).__name__)}"
        )
    if k.dim() != 2 or k.shape[1] != layout.head_dim:
        raise ValueError(
            f"k must have shape [tokens, {layout.head_dim}] (layout.head_dim), got {tuple(k.shape)}"
        )
    _check_index_tensor("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens of k"
        )
    for name, tensor in (("k", k), ("slot_mapping", slot_mapping)):
        if tensor.device != kv_cache.device:
            raise ValueError(
                f"{name} is on {tensor.device}, kv_cache on {kv_cache.device}: must match"
            )
    if k.shape[0] == 0:
        return

    num_slots = kv_cache.shape[0] * layout.page_entries
    slots = slot_mapping.to(torch.int64)
    bad = (slots < -1) | (slots >= num_slots)
    if bool(bad.any()):
        value = int(slots[bad][0])
        raise ValueError(
            f"slot_mapping holds slot {value}, outside [-1, {num_slots}) "
            f"({kv_cache.shape[0]} pages of {layout.page_entries} entries)"
        )
    keep = slots >= 0
    written = slots[keep]
    unique_slots, counts = torch.unique(written, return_counts=True)
    if bool((counts > 1).any()):
        value = int(unique_slots[counts > 1][0])
        raise ValueError(
            f"slot_mapping writes slot {value} more than once; the stored key would be a "
            "mix of both"
        )
    values, scales = quantize_mxfp4(k[keep])

    value_offsets, scale_offsets = device_entry_offsets(layout, kv_cache.device)
    page_rows = (written // layout.page_entries).unsqueeze(1)
    entries = written % layout.page_entries
    # Advanced-index assignment writes through the view, so a strided cache (page stride
    # beyond its rows) is written in place and no byte outside these entries is touched.
    kv_cache[page_rows, value_offsets[entries]] = values
    kv_cache[page_rows, scale_offsets[entries]] = scales


def compressed_slot_mapping(
    positions: torch.Tensor,
    req_indices: torch.Tensor,
    block_table: torch.Tensor,
    compress_ratio: int,
    page_entries: int,
) -> torch.Tensor:
    """Cache slot of each token's compressed key, or -1 for tokens that complete none.

    positions: integer `[tokens]`, absolute positions (>= 0) in their requests;
    req_indices: integer `[tokens]`, the request (row of block_table) of each token;
    block_table: integer `[num_reqs, max_blocks]` page ids; compress_ratio R and
    page_entries: positive ints. A token at position p completes compressed entry
    c = (p + 1) // R - 1 when (p + 1) % R == 0; its slot is
    `block_table[req, c // page_entries] * page_entries + c % page_entries`.
    Returns int64 `[tokens]` on positions' device. Validation reads the inputs back to the
    host (call it outside graph capture); raises ValueError naming the argument for negative
    positions, requests outside block_table, entries past the block table's columns and
    negative page ids where an entry is written.
    """
    for name, value in (("compress_ratio", compress_ratio), ("page_entries", page_entries)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    _check_index_tensor("positions", positions, 1)
    _check_index_tensor("req_indices", req_indices, 1)
    _check_index_tensor("block_table", block_table, 2)
    if req_indices.shape != positions.shape:
        raise ValueError(
            f"req_indices shape {tuple(req_indices.shape)} differs from positions shape "
            f"{tuple(positions.shape)}"
        )
    for name, tensor in (("req_indices", req_indices), ("block_table", block_table)):
        if tensor.device != positions.device:
            raise ValueError(
                f"{name} is on {tensor.device}, positions on {positions.device}: must match"
            )
    position = positions.to(torch.int64)
    request = req_indices.to(torch.int64)
    if position.numel() and bool((position < 0).any()):
        raise ValueError(f"positions holds {int(position[position < 0][0])}, must be >= 0")
    num_reqs, max_blocks = block_table.shape
    out_of_range = (request < 0) | (request >= num_reqs)
    if request.numel() and bool(out_of_range.any()):
        raise ValueError(
            f"req_indices holds {int(request[out_of_range][0])}, outside [0, {num_reqs}) "
            "(block_table rows)"
        )

    completes = (position + 1) % compress_ratio == 0
    entry = (position + 1) // compress_ratio - 1
    column = entry // page_entries
    too_far = completes & (column >= max_blocks)
    if bool(too_far.any()):
        index = int(too_far.nonzero()[0, 0])
        raise ValueError(
            f"block_table has {max_blocks} columns, but position {int(position[index])} of "
            f"request {int(request[index])} needs column {int(column[index])}"
        )
    # Tokens that complete no entry look up column 0 (always present) and are masked below.
    safe_column = torch.where(completes, column, torch.zeros_like(column))
    if max_blocks == 0:  # too_far rejected every token that would write an entry
        return torch.full_like(position, -1)
    page = block_table[request, safe_column].to(torch.int64)
    negative_page = completes & (page < 0)
    if bool(negative_page.any()):
        index = int(negative_page.nonzero()[0, 0])
        raise ValueError(
            f"block_table[{int(request[index])}, {int(column[index])}] is {int(page[index])}, "
            f"but position {int(position[index])} writes an entry there"
        )
    slot = page * page_entries + entry % page_entries
    return torch.where(completes, slot, torch.full_like(slot, -1))
