"""Small helpers shared by the planners (internal)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

HostInts = torch.Tensor | np.ndarray | Sequence[int]


def host_array(values: HostInts, name: str) -> np.ndarray:
    """`values` as a 1-D numpy integer array, without a copy where possible.

    Raises `ValueError` for a tensor that is not on the CPU: planners never read device values.
    """
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be a host (CPU) tensor, got device {values.device}")
        array = values.numpy()
    else:
        array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    return array


def check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_non_negative_int(name: str, value: object) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def adjacent_views(parts: Sequence[torch.Tensor]) -> bool:
    """Whether 1-D `parts` lie back to back, in order, in one storage (so one view spans them)."""
    return all(
        a.stride() == (1,)
        and b.stride() == (1,)
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() + a.shape[0] == b.storage_offset()
        for a, b in itertools.pairwise(parts)
    )


def spanning_view(first: torch.Tensor, length: int) -> torch.Tensor:
    """`length` elements from `first`'s start, for parts that `adjacent_views` accepted."""
    return first.as_strided((length,), (1,), first.storage_offset())
