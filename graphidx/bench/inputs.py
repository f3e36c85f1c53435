"""Random kernel inputs at a case's shape, drawn by `graphidx.testing`'s generators.

The cases call the kernels directly, so they need a cache, queries and a block table for a
head count, head_dim and page size rather than for a whole `IndexerConfig`: these functions
build the config those generators read and return plain tensors. Every draw is seeded from
torch's global generator (`graphidx bench` seeds it once), so a run's inputs are the same on
every run.
"""

from __future__ import annotations

import torch

from graphidx.config import IndexerConfig, cdiv
from graphidx.testing import random_kv_cache as _random_cache
from graphidx.testing import random_layer_input


def _kernel_config(num_heads: int, head_dim: int, page_entries: int) -> IndexerConfig:
    """The config whose cache has pages of `page_entries` keys (compress_ratio 1)."""
    return IndexerConfig(num_heads=num_heads, head_dim=head_dim, block_size=page_entries)


def _host_generator() -> torch.Generator:
    """A host generator seeded from torch's global one."""
    return torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))


def random_kv_cache(
    num_pages: int, num_heads: int, head_dim: int, page_entries: int, device: torch.device
) -> torch.Tensor:
    """`[num_pages, page_bytes]` uint8: an MXFP4 cache whose every entry holds a random key
    (`graphidx.testing.random_kv_cache`)."""
    config = _kernel_config(num_heads, head_dim, page_entries)
    return _random_cache(config, num_pages, device, _host_generator())


def random_queries(
    rows: int, num_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q `[rows, num_heads, head_dim // 2]` uint8 e2m1 pairs, q_scale `[rows, num_heads,
    head_dim // 32]` uint8 e8m0, weights `[rows, num_heads]` float32): MXFP4 queries and
    head weights (`graphidx.testing.random_layer_input`)."""
    config = IndexerConfig(num_heads=num_heads, head_dim=head_dim)
    layer = random_layer_input(config, rows, device, _host_generator())
    return layer.q, layer.q_scale, layer.weights


def random_block_table(
    contexts: list[int], page_entries: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """(block table `[len(contexts), max pages]` int32, total pages): every seq's pages,
    shuffled over the cache (pages are never adjacent in order)."""
    pages = [cdiv(c, page_entries) for c in contexts]
    total = sum(pages)
    order = torch.randperm(total, device=device).to(torch.int32)
    table = torch.zeros((len(contexts), max(pages, default=1)), dtype=torch.int32, device=device)
    start = 0
    for s, count in enumerate(pages):
        table[s, :count] = order[start : start + count]
        start += count
    return table, total
