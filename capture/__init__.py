"""capture: a model-agnostic graph runtime (imports torch only).

- `StepShape`, `CaptureSizes` (shapes.py): the graph key and the padding ladder.
- `StaticBuffers` (buffers.py): persistent named tensors at fixed addresses.
- `GraphCache`, `CacheStats` (cache.py): capture per shape (warm-up, largest first, one
  pool), replay with address checks, stats and eager fallbacks.
- Backends (backends/): "device" (CUDA/HIP graphs) and "tape" (a portable op tape with
  device-graph semantics); `get_backend(name)`.

Graph semantics, common to both backends: the op sequence, every non-tensor argument and
every tensor address are frozen at capture; tensor contents are re-read at every replay;
host syncs during capture and tensors that move after capture raise `CaptureError`. See
`capture.backends.tape` for the full list of what is refused.
"""

from capture.backends import (
    Backend,
    CapturedGraph,
    CaptureError,
    get_backend,
    is_capturing,
)
from capture.buffers import StaticBuffers
from capture.cache import CacheStats, GraphCache, GraphStats
from capture.shapes import CaptureSizes, StepShape

__all__ = [
    "Backend",
    "CacheStats",
    "CaptureError",
    "CaptureSizes",
    "CapturedGraph",
    "GraphCache",
    "GraphStats",
    "StaticBuffers",
    "StepShape",
    "get_backend",
    "is_capturing",
]
