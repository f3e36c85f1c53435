"""Shared test setup: Triton's interpreter on machines without a GPU, GPU marker, seeds."""

from __future__ import annotations

import os

# Must precede the first `import triton`: without a GPU, Triton kernels run interpreted.
try:
    import torch as _torch

    _HAS_GPU = _torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _HAS_GPU = False
if not _HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator, fresh per test."""
    g = torch.Generator()
    g.manual_seed(1234)
    return g
