"""Shared by the graphidx tests: a small dense config and the gloo markers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from graphidx.config import MIB, IndexerConfig
from graphidx.testing import gloo_available

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


needs_gloo = pytest.mark.skipif(
    not gloo_available(), reason="torch.distributed with gloo is unavailable"
)
"""Skips a test that spawns gloo ranks where torch.distributed has no gloo backend."""


def across_gloo_ranks(test: _Test) -> _Test:
    """`test(world_size)` run for 2 and for 4 gloo ranks; skipped without gloo."""
    return needs_gloo(pytest.mark.parametrize("world_size", [2, 4])(test))
