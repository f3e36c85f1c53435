"""IndexerConfig: the static shape of one model's lightning indexer, and its presets.

Everything here is fixed for the life of a serving process; per-step values live in
`StepBatch`. Derived quantities (docs/contract.md section 2) are properties so that each
formula lives in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIB = 2**20


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class IndexerConfig:
    """Static configuration of one indexer layer stack.

    Units: `block_size` counts uncompressed tokens per KV page; `max_model_len` counts
    uncompressed tokens; `max_logits_bytes` bounds one prefill launch's fp32 logits.
    `candidate_block_size` (C) of 0 means no candidate blocks (single-level indexer).
    The model defaults (head_dim through topk_tokens) are DeepSeek-V3.2's indexer.
    `precision` is the logits ops' mode ("exact", "fp8" or None for the device's default;
    docs/contract.md section 5.8); whether the device can run it is checked by the ops.
    `dcp_world_size`, `dcp_rank`, `dcp_interleave`: decode context parallel (section 10): rank
    `dcp_rank` of `dcp_world_size` holds the positions p with (p // S) % W == rank, S =
    `dcp_interleave` (0: the candidate block size, or 1 without candidates).
    """

    num_heads: int
    head_dim: int = 128
    compress_ratio: int = 1
    block_size: int = 64
    max_model_len: int = 163840
    num_speculative_tokens: int = 0
    adaptive_verification: bool = False
    topk_tokens: int = 2048
    candidate_block_size: int = 0
    candidate_topk_blocks: int = 0
    sparse_logits: bool = False
    max_logits_bytes: int = 512 * MIB
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    precision: str | None = None
    dcp_world_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_heads",
            "head_dim",
            "compress_ratio",
            "block_size",
            "max_model_len",
            "topk_tokens",
            "max_logits_bytes",
            "max_num_seqs",
            "max_num_batched_tokens",
            "dcp_world_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in (
            "num_speculative_tokens",
            "candidate_block_size",
            "candidate_topk_blocks",
            "dcp_rank",
            "dcp_interleave",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.head_dim % 32:
            raise ValueError(
                f"head_dim must be a multiple of 32 (one MXFP4 scale per 32 elements), "
                f"got {self.head_dim}"
            )
        if self.block_size % self.compress_ratio:
            raise ValueError(
                f"block_size ({self.block_size}) must be a multiple of compress_ratio "
                f"({self.compress_ratio})"
            )
        if self.max_model_len < self.compress_ratio:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be at least compress_ratio "
                f"({self.compress_ratio})"
            )
        if (self.candidate_block_size == 0) != (self.candidate_topk_blocks == 0):
            raise ValueError(
                "candidate_block_size and candidate_topk_blocks must be both set or both 0, "
                f"got {self.candidate_block_size} and {self.candidate_topk_blocks}"
            )
        self._check_context_parallel()
        if self.precision is not None and self.precision not in ("exact", "fp8"):
            raise ValueError(f"precision must be 'exact', 'fp8' or None, got {self.precision!r}")
        if self.sparse_logits:
            self._check_sparse_logits()

    def _check_context_parallel(self) -> None:
        """The rank inside the world; the interleave a multiple of the candidate block size
        (a candidate block lives on one rank)."""
        if self.dcp_rank >= self.dcp_world_size:
            raise ValueError(
                f"dcp_rank must be < dcp_world_size = {self.dcp_world_size}, got {self.dcp_rank}"
            )
        c = self.candidate_block_size
        if self.dcp_interleave and c and self.dcp_interleave % c:
            raise ValueError(
                f"dcp_interleave = {self.dcp_interleave} must be a multiple of "
                f"candidate_block_size = {c} (a candidate block must live on one rank)"
            )

    @property
    def dcp_interleave_size(self) -> int:
        """The interleave S in use: dcp_interleave, or by default C (1 without candidates)."""
        return self.dcp_interleave or max(1, self.candidate_block_size)

    def _check_sparse_logits(self) -> None:
        """The candidate pool the consumers of a two-level indexer read: a block size
        dividing a page and a power-of-two number of blocks (`CandidateIndexerMetadataBuilder`
        refuses the same; it also needs a block within one tile of the cache layout)."""
        c, blocks = self.candidate_block_size, self.candidate_topk_blocks
        if c == 0:
            raise ValueError("sparse_logits=True needs candidate_block_size > 0, got 0")
        if not is_power_of_two(blocks):
            raise ValueError(f"candidate_topk_blocks must be a power of two, got {blocks}")
        if self.page_entries % c:
            raise ValueError(
                f"candidate_block_size = {c} must divide page_entries = {self.page_entries} "
                f"(block_size {self.block_size} // compress_ratio {self.compress_ratio})"
            )

    # Derived quantities (docs/contract.md section 2).
    @property
    def next_n(self) -> int:
        """Query rows of a full speculative decode request: 1 + num_speculative_tokens."""
        return 1 + self.num_speculative_tokens

    @property
    def page_entries(self) -> int:
        """Compressed entries per KV page: block_size // compress_ratio."""
        return self.block_size // self.compress_ratio

    @property
    def logits_width(self) -> int:
        """Widest possible row of logits: max_model_len // compress_ratio."""
        return self.max_model_len // self.compress_ratio

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table columns a request of max_model_len tokens needs."""
        return cdiv(self.max_model_len, self.block_size)

    @property
    def num_candidate_cols(self) -> int:
        """Columns of a candidate pool: candidate_topk_blocks * candidate_block_size."""
        return self.candidate_topk_blocks * self.candidate_block_size

    @property
    def consumer_rows_per_launch(self) -> int:
        """Rows of one candidate-consumer prefill launch (docs/contract.md section 3.5): its fp32
        compact logits, `rows x num_candidate_cols`, fit `max_logits_bytes` (and int32
        indexing); 0 without sparse logits."""
        cols = self.num_candidate_cols
        if not self.sparse_logits or cols == 0:
            return 0
        return max(1, min(self.max_logits_bytes, 2**31 - 1) // (4 * cols))

    @property
    def has_candidates(self) -> bool:
        return self.candidate_block_size > 0

    def replace(self, **changes: Any) -> IndexerConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # Presets.
    @classmethod
    def deepseek_v32(cls, **overrides: Any) -> IndexerConfig:
        """DeepSeek-V3.2's lightning indexer: 64 heads of 128, top-2048, pages of 64, R = 1
        (the class defaults with 64 heads)."""
        return cls(**{"num_heads": 64, **overrides})

    @classmethod
    def deepseek_v41_flash(cls, **overrides: Any) -> IndexerConfig:
        """DeepSeek-V4.1-Flash's two-level indexer (candidate source and consumers).

        32 heads of 128, top-512, R = 1, candidate blocks of 8, a pool of 2048 blocks,
        pages of 128 tokens, one speculative token.
        """
        base: dict[str, Any] = dict(
            num_heads=32,
            head_dim=128,
            compress_ratio=1,
            block_size=128,
            max_model_len=1048576,
            num_speculative_tokens=1,
            topk_tokens=512,
            candidate_block_size=8,
            candidate_topk_blocks=2048,
            sparse_logits=True,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def cpu_demo(cls, **overrides: Any) -> IndexerConfig:
        """`deepseek_v41_flash` scaled down to run in seconds on a CPU: the same R = 1,
        speculative token and candidate blocks of 8, with 8 heads of 64, top-64, a pool of 16
        blocks, pages of 64 and small serving limits."""
        scaled: dict[str, Any] = dict(
            num_heads=8,
            head_dim=64,
            block_size=64,
            max_model_len=4096,
            topk_tokens=64,
            candidate_topk_blocks=16,
            max_logits_bytes=4 * MIB,
            max_num_seqs=32,
            max_num_batched_tokens=1024,
        )
        return cls.deepseek_v41_flash(**{**scaled, **overrides})

    @classmethod
    def from_hf_config(
        cls, hf_config: Mapping[str, Any], *, layer: int = 0, **overrides: Any
    ) -> IndexerConfig:
        """Read a DeepSeek-style `config.json` dict for indexer layer `layer`.

        Keys read: index_n_heads, index_head_dim, index_topk, compress_ratios (a per-layer
        list or one int; absent means 1), candidate_block_size, candidate_topk_blocks
        (sparse logits on when both are set), num_nextn_predict_layers (the speculative
        tokens), max_position_embeddings. `overrides` win over the file (serving options such
        as block_size or max_num_seqs).
        """
        if "index_n_heads" not in hf_config:
            raise ValueError("hf_config has no 'index_n_heads': not a lightning-indexer model")
        ratios = hf_config.get("compress_ratios", 1)
        if isinstance(ratios, (list, tuple)):
            if not 0 <= layer < len(ratios):
                raise ValueError(f"layer {layer} is outside compress_ratios (length {len(ratios)})")
            ratio = ratios[layer]
        else:
            ratio = ratios
        if not isinstance(ratio, int) or ratio <= 0:
            raise ValueError(
                f"compress_ratios[{layer}] = {ratio!r}: layer {layer} has no compressed indexer"
            )
        cand_c = int(hf_config.get("candidate_block_size", 0) or 0)
        cand_k = int(hf_config.get("candidate_topk_blocks", 0) or 0)
        fields: dict[str, Any] = dict(
            num_heads=int(hf_config["index_n_heads"]),
            head_dim=int(hf_config.get("index_head_dim", 128)),
            compress_ratio=ratio,
            topk_tokens=int(hf_config.get("index_topk", 2048)),
            candidate_block_size=cand_c,
            candidate_topk_blocks=cand_k,
            sparse_logits=cand_c > 0 and cand_k > 0,
            num_speculative_tokens=int(hf_config.get("num_nextn_predict_layers", 0) or 0),
        )
        if "max_position_embeddings" in hf_config:
            fields["max_model_len"] = int(hf_config["max_position_embeddings"])
        fields.update(overrides)
        if "block_size" not in fields:
            # The smallest page that holds a whole tile of entries at this ratio.
            fields["block_size"] = max(64, 32 * ratio)
        return cls(**fields)
