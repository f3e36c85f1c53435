"""Shared by the graphidx tests: a small dense config, the context-parallel suites' setup and
the gloo markers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import torch

from graphidx.config import MIB, IndexerConfig
from graphidx.runner import IndexerStack
from graphidx.testing import StepCase, StepGenerator, context_parallel_config, gloo_available

_Test = TypeVar("_Test", bound=Callable[..., Any])


def small_dense_config(**overrides: Any) -> IndexerConfig:
    """A small dense (one-level) model for the CPU: 8 heads of 64, R = 1, pages of 64,
    top-64, 4096 tokens, 1 MiB of logits, 16 requests of 256 tokens, no speculative token
    and no candidate pool; `overrides` win."""
    base: dict[str, Any] = dict(
        num_heads=8, head_dim=64, compress_ratio=1, block_size=64, max_model_len=4096,
        num_speculative_tokens=0, topk_tokens=64, max_logits_bytes=1 * MIB, max_num_seqs=16,
        max_num_batched_tokens=256,
    )  # fmt: skip
    return IndexerConfig(**{**base, **overrides})


@dataclass(frozen=True)
class DcpSetup:
    """A context-parallel suite's setup: a stack over `context_parallel_config`'s small model
    (the W = 1 config's fields that differ between setups, in that function's order), a seed
    and the longest context of the random steps, which read pages `[0, num_pages)`."""

    name: str
    stack: IndexerStack
    next_n: int
    ratio: int
    candidate_block_size: int
    interleave: int
    seed: int
    max_context: int = 1500
    num_pages: int = 96

    def config(self, world_size: int = 1, rank: int = 0) -> IndexerConfig:
        """Rank `rank` of `world_size` (the W = 1 config by default)."""
        return context_parallel_config(
            self.next_n, self.ratio, self.candidate_block_size, self.interleave, world_size, rank
        )

    def cases(self, kinds: Sequence[str]) -> tuple[list[torch.Tensor], list[StepCase]]:
        """The single-rank caches and one step of each of `kinds` (identical in every
        process)."""
        gen = StepGenerator(
            self.config(),
            self.stack,
            num_pages=self.num_pages,
            seed=self.seed,
            max_context=self.max_context,
        )
        return gen.kv_caches(), [gen.case(kind) for kind in kinds]


needs_gloo = pytest.mark.skipif(
    not gloo_available(), reason="torch.distributed with gloo is unavailable"
)
"""Skips a test that spawns gloo ranks where torch.distributed has no gloo backend."""


def across_gloo_ranks(test: _Test) -> _Test:
    """`test(world_size)` run for 2 and for 4 gloo ranks; skipped without gloo."""
    return needs_gloo(pytest.mark.parametrize("world_size", [2, 4])(test))
