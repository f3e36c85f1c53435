"""Shared by the capture tests: a custom op that writes into its `out` argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


@torch.library.custom_op("capture_test::scale_into", mutates_args=("out",))
def _scale_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """out = 2 * x + 1, written with several aten ops inside (none may reach a tape)."""
    out.copy_(x * 2)
    out.add_(1)


@pytest.fixture
def scale_into() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The custom op `capture_test::scale_into`: out = 2 * x + 1."""
    return _scale_into
