"""The model shape the context-parallel tests run (test_dcp_dense, test_dcp_runner)."""

from __future__ import annotations

from graphidx.config import IndexerConfig


def dcp_config(
    next_n: int,
    ratio: int,
    interleave: int,
    world_size: int = 1,
    rank: int = 0,
    candidate_block_size: int = 0,
) -> IndexerConfig:
    """4 heads of 64, pages of 64 entries at compress ratio `ratio`, `next_n` rows per
    decode, top-k 32 and 48 KiB of logits (prefill chunks get cut), up to 8 requests and 128
    tokens; with `candidate_block_size` C > 0, a pool of 8 candidate blocks of C and sparse
    consumer logits. Rank `rank` of `world_size`, sharded with interleave `interleave` when
    world_size > 1 (the W = 1 config has none)."""
    c = candidate_block_size
    return IndexerConfig(
        num_heads=4,
        head_dim=64,
        compress_ratio=ratio,
        block_size=64 * ratio,
        max_model_len=2048 * ratio,
        num_speculative_tokens=next_n - 1,
        topk_tokens=32,
        candidate_block_size=c,
        candidate_topk_blocks=8 if c else 0,
        sparse_logits=bool(c),
        max_logits_bytes=48 * 1024,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        dcp_world_size=world_size,
        dcp_rank=rank,
        dcp_interleave=interleave if world_size > 1 else 0,
    )
