"""The bench's random inputs (graphidx.bench.inputs): shapes, valid MXFP4 keys read back
through the cache layout, block tables that cover every page once, and reproducibility from
torch's global seed."""

from __future__ import annotations

import torch

from graphidx.bench.inputs import random_block_table, random_kv_cache, random_queries
from graphidx.config import cdiv
from graphidx.mxfp4 import cache_layout, dequantize_mxfp4, read_entries

CPU = torch.device("cpu")


def test_block_table_gives_every_seq_its_own_pages() -> None:
    contexts = [130, 64, 1, 300]
    table, total = random_block_table(contexts, 64, CPU)
    counts = [cdiv(c, 64) for c in contexts]
    assert total == sum(counts) and table.shape == (4, max(counts))
    assert table.dtype == torch.int32
    used = torch.cat([table[s, :n] for s, n in enumerate(counts)])
    assert sorted(used.tolist()) == list(range(total))


def test_cache_and_queries_have_the_kernel_shapes() -> None:
    torch.manual_seed(0)
    heads, dim, page_entries, pages = 8, 64, 64, 3
    kv = random_kv_cache(pages, heads, dim, page_entries, CPU)
    layout = cache_layout(heads, dim, page_entries)
    assert kv.shape == (pages, layout.page_bytes) and kv.dtype == torch.uint8
    q, q_scale, weights = random_queries(5, heads, dim, CPU)
    assert q.shape == (5, heads, dim // 2) and q.dtype == torch.uint8
    assert q_scale.shape == (5, heads, dim // 32) and q_scale.dtype == torch.uint8
    assert weights.shape == (5, heads) and weights.dtype == torch.float32


def test_every_key_is_written_and_finite() -> None:
    torch.manual_seed(0)
    heads, dim, page_entries, pages = 8, 64, 64, 2
    kv = random_kv_cache(pages, heads, dim, page_entries, CPU)
    layout = cache_layout(heads, dim, page_entries)
    entries = torch.arange(pages * page_entries)
    values, scales = read_entries(kv, layout, entries // page_entries, entries % page_entries)
    keys = dequantize_mxfp4(values, scales)
    assert keys.shape == (pages * page_entries, dim)
    assert bool(keys.isfinite().all())
    assert int((keys.abs().sum(dim=1) == 0).sum()) == 0  # no entry left unwritten


def test_inputs_follow_the_global_seed() -> None:
    def draw() -> list[torch.Tensor]:
        torch.manual_seed(7)
        table, pages = random_block_table([200, 100], 64, CPU)
        return [table, random_kv_cache(pages, 8, 64, 64, CPU), *random_queries(3, 8, 64, CPU)]

    first, second = draw(), draw()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    torch.manual_seed(8)
    assert not torch.equal(random_queries(3, 8, 64, CPU)[0], first[2])
