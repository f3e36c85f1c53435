"""IndexerConfig: validation, derived quantities, presets and from_hf_config."""

from __future__ import annotations

import pytest

from graphidx.config import MIB, IndexerConfig


def test_derived_quantities() -> None:
    c = IndexerConfig(
        num_heads=64,
        compress_ratio=4,
        block_size=128,
        max_model_len=8192,
        num_speculative_tokens=2,
        candidate_block_size=8,
        candidate_topk_blocks=16,
    )
    assert c.next_n == 3
    assert c.page_entries == 32
    assert c.logits_width == 2048
    assert c.max_blocks_per_seq == 64
    assert c.num_candidate_cols == 128
    assert c.has_candidates


def test_presets() -> None:
    v32 = IndexerConfig.deepseek_v32()
    assert (v32.num_heads, v32.head_dim, v32.topk_tokens, v32.block_size, v32.compress_ratio) == (
        64,
        128,
        2048,
        64,
        1,
    )
    assert not v32.has_candidates and v32.max_logits_bytes == 512 * MIB
    v41 = IndexerConfig.deepseek_v41_flash()
    assert (
        v41.num_heads,
        v41.topk_tokens,
        v41.compress_ratio,
        v41.candidate_block_size,
        v41.candidate_topk_blocks,
        v41.block_size,
    ) == (32, 512, 1, 8, 2048, 128)
    assert v41.sparse_logits and v41.num_candidate_cols == 16384
    demo = IndexerConfig.cpu_demo(max_num_seqs=4)
    assert demo.max_num_seqs == 4 and demo.sparse_logits
    assert IndexerConfig.deepseek_v32(max_num_seqs=8).max_num_seqs == 8


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_heads": 0}, r"num_heads must be a positive integer, got 0"),
        ({"head_dim": 100}, r"head_dim must be a multiple of 32 .*got 100"),
        ({"head_dim": 128.0}, r"head_dim must be a positive integer, got 128.0"),
        ({"compress_ratio": True}, r"compress_ratio must be a positive integer, got True"),
        ({"block_size": 0}, r"block_size must be a positive integer, got 0"),
        (
            {"compress_ratio": 3, "block_size": 64},
            r"block_size \(64\) must be a multiple of "
            r"compress_ratio \(3\)",
        ),
        (
            {"max_model_len": 2, "compress_ratio": 4, "block_size": 128},
            r"max_model_len \(2\) must be at least compress_ratio \(4\)",
        ),
        ({"topk_tokens": -1}, r"topk_tokens must be a positive integer, got -1"),
        ({"max_logits_bytes": 0}, r"max_logits_bytes must be a positive integer, got 0"),
        ({"max_num_seqs": 0}, r"max_num_seqs must be a positive integer, got 0"),
        ({"max_num_batched_tokens": 0}, r"max_num_batched_tokens must be a positive integer"),
        ({"num_speculative_tokens": -1}, r"num_speculative_tokens must be a non-negative"),
        (
            {"candidate_block_size": 8},
            r"candidate_block_size and candidate_topk_blocks must be "
            r"both set or both 0, got 8 and 0",
        ),
        ({"candidate_topk_blocks": 4}, r"both set or both 0, got 0 and 4"),
        ({"sparse_logits": True}, r"sparse_logits=True needs candidate_block_size > 0"),
        ({"precision": "bf16"}, r"precision must be 'exact', 'fp8' or None, got 'bf16'"),
        ({"dcp_world_size": 0}, r"dcp_world_size must be a positive integer, got 0"),
        ({"dcp_world_size": 2, "dcp_rank": 2}, r"dcp_rank must be < dcp_world_size = 2, got 2"),
        ({"dcp_rank": -1}, r"dcp_rank must be a non-negative integer, got -1"),
        (
            {"candidate_block_size": 8, "candidate_topk_blocks": 4, "dcp_interleave": 12},
            r"dcp_interleave = 12 must be a multiple of candidate_block_size = 8",
        ),
    ],
)
def test_validation(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        IndexerConfig(**{"num_heads": 32, **changes})  # type: ignore[arg-type]


SPARSE = {"candidate_block_size": 8, "candidate_topk_blocks": 16, "sparse_logits": True}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {**SPARSE, "candidate_topk_blocks": 24},
            r"^candidate_topk_blocks must be a power of two, got 24$",
        ),
        (
            {**SPARSE, "candidate_block_size": 12},
            r"^candidate_block_size = 12 must divide page_entries = 64 "
            r"\(block_size 64 // compress_ratio 1\)$",
        ),
        (
            {**SPARSE, "compress_ratio": 16, "block_size": 64},
            r"^candidate_block_size = 8 must divide page_entries = 4 "
            r"\(block_size 64 // compress_ratio 16\)$",
        ),
    ],
)
def test_sparse_logits_candidate_pool_is_checked_at_construction(
    changes: dict[str, object], message: str
) -> None:
    """What a candidate builder would refuse later is refused by the config itself."""
    with pytest.raises(ValueError, match=message):
        IndexerConfig(**{"num_heads": 32, **changes})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        IndexerConfig.cpu_demo().replace(**changes)


def test_candidate_pool_without_sparse_logits_is_not_restricted() -> None:
    """The restrictions are those of the sparse-logits consumers, as in the builder."""
    config = IndexerConfig(num_heads=32, candidate_block_size=12, candidate_topk_blocks=24)
    assert config.num_candidate_cols == 288 and not config.sparse_logits
    for preset in (IndexerConfig.cpu_demo(), IndexerConfig.deepseek_v41_flash()):
        assert preset.sparse_logits  # the presets pass the new checks


def test_replace_validates_again() -> None:
    c = IndexerConfig.deepseek_v32()
    assert c.replace(topk_tokens=512).topk_tokens == 512
    with pytest.raises(ValueError, match="topk_tokens"):
        c.replace(topk_tokens=0)


HF = {
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "compress_ratios": [1, 4, 1, 128],
    "candidate_block_size": 8,
    "candidate_topk_blocks": 2048,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 65536,
}


def test_from_hf_config_reads_the_layer() -> None:
    c = IndexerConfig.from_hf_config(HF, layer=1, max_num_seqs=64)
    assert (c.num_heads, c.head_dim, c.topk_tokens, c.compress_ratio) == (32, 128, 512, 4)
    assert (c.candidate_block_size, c.candidate_topk_blocks, c.sparse_logits) == (8, 2048, True)
    assert c.num_speculative_tokens == 1 and c.next_n == 2
    assert c.max_model_len == 65536 and c.max_num_seqs == 64
    assert c.block_size == 128  # the smallest page holding a 32-entry tile at R = 4
    assert IndexerConfig.from_hf_config(HF, layer=0, block_size=64).block_size == 64


def test_from_hf_config_defaults_and_errors() -> None:
    plain = IndexerConfig.from_hf_config({"index_n_heads": 64})
    assert plain.compress_ratio == 1 and not plain.sparse_logits and plain.topk_tokens == 2048
    assert (
        IndexerConfig.from_hf_config({"index_n_heads": 64, "compress_ratios": 2}).compress_ratio
        == 2
    )
    with pytest.raises(ValueError, match="no 'index_n_heads'"):
        IndexerConfig.from_hf_config({"num_attention_heads": 128})
    with pytest.raises(ValueError, match=r"layer 9 is outside compress_ratios \(length 4\)"):
        IndexerConfig.from_hf_config(HF, layer=9)
    with pytest.raises(ValueError, match=r"compress_ratios\[0\] = 0: layer 0 has no"):
        IndexerConfig.from_hf_config({**HF, "compress_ratios": [0, 4]}, layer=0)
