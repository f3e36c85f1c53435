"""Device graphs: torch CUDA graphs (HIP graphs on ROCm, through the same torch API).

Capture records the kernels the callable launches on a side stream into a
`torch.cuda.CUDAGraph`; replay relaunches exactly those kernels with exactly the captured
arguments and addresses. So:

- Frozen: every kernel, its launch configuration and its scalar arguments (a Python int the
  callable read is baked into the launch), every tensor address, the Python branches taken.
- Re-read at replay: tensor contents at the captured addresses. Persistent inputs must be
  updated in place (`copy_`), never reallocated.
- Memory the capture allocates comes from the graph memory pool that `GraphCache` passes in
  (`torch.cuda.graph_pool_handle()`, one per cache, shared by all its graphs: captured
  largest first, smaller graphs reuse the blocks). Graphs of one pool must not run
  concurrently, and a graph's results must be written into persistent tensors, because pool
  memory is reused by the next graph.
- Refused: the capture runs under `capture.backends.tape.host_sync_guard`, so `.item()`,
  `.tolist()`, `nonzero`, boolean-mask indexing, device-to-host copies... raise
  `CaptureError` with the same message as on the tape, before the device would invalidate the
  capture. Any other failure of the device capture is raised as `CaptureError` chained to
  torch's error. A failed capture resets its graph so that it holds no memory.

`num_bytes` of a graph is the increase of `torch.cuda.memory_reserved(device)` across the
capture, after emptying the allocator's cache first: the device memory the capture made the
caching allocator reserve for the pool. With a shared pool a later graph reports only what it
added. `memory_allocated` would count only blocks still live after capture (the callable's
surviving results), not the pool the graph keeps, so it is not used. `num_ops` is None: a
device graph does not expose its kernel count through torch.

Warm-up runs (`warmup`) go on the same side stream as capture, as torch recommends, so that
lazily created per-stream state (cuBLAS workspaces, Triton's first-launch compilation) exists
before capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from capture.backends import CaptureError, recording
from capture.backends.tape import host_sync_guard


class DeviceGraph:
    """One captured `torch.cuda.CUDAGraph`."""

    def __init__(self, graph: torch.cuda.CUDAGraph, num_bytes: int) -> None:
        self._graph = graph
        self._num_bytes = num_bytes

    @property
    def num_bytes(self) -> int:
        """Device memory the capture added to the allocator's reservation, in bytes."""
        return self._num_bytes

    @property
    def num_ops(self) -> None:
        """Not known for a device graph."""
        return None

    def replay(self) -> None:
        """Launch the captured kernels on the current stream (asynchronous)."""
        self._graph.replay()


class DeviceBackend:
    """Captures callables into CUDA/HIP graphs on one GPU."""

    name = "device"

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        """`device`: the GPU (default: the current CUDA device). ValueError without a GPU."""
        if not torch.cuda.is_available():
            raise ValueError(
                "backend 'device' needs a CUDA/ROCm GPU, but torch.cuda.is_available() is "
                "False; use backend 'tape' instead"
            )
        if device is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, int):
            resolved = torch.device("cuda", device)
        else:
            resolved = torch.device(device)
        if resolved.type != "cuda":
            raise ValueError(f"device={device!r} is not a CUDA/ROCm device")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        self.device = resolved
        self._stream: torch.cuda.Stream | None = None

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def new_pool(self) -> object:
        """A graph memory pool handle that the graphs of one cache share."""
        with torch.cuda.device(self.device):
            return torch.cuda.graph_pool_handle()

    def synchronize(self) -> None:
        """Wait for all work on the device."""
        torch.cuda.synchronize(self.device)

    def warmup(self, fn: Callable[[], object]) -> None:
        """Run `fn` eagerly on the capture side stream, ordered after the current stream."""
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            side = self._side_stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                fn()
            current.wait_stream(side)

    def capture(self, fn: Callable[[], object], pool: object | None) -> DeviceGraph:
        """Capture `fn` into a CUDA/HIP graph allocating from `pool`.

        Only inside `GraphCache.capture` (CaptureError otherwise). On failure the graph is
        reset and CaptureError (or the callable's own non-runtime error) is raised.
        """
        with recording(self.name), torch.cuda.device(self.device):
            graph = torch.cuda.CUDAGraph()
            # torch.cuda.graph empties the cache on entry; do it first so that the reserved
            # figure measured here is the one capture starts from. Only cudaMalloc/cudaFree
            # move `reserved`, and nothing frees to the device during capture.
            self.synchronize()
            torch.cuda.empty_cache()
            reserved_before = torch.cuda.memory_reserved(self.device)
            try:
                # The pool is the opaque handle from new_pool(); torch types it privately.
                pool_handle: Any = pool
                with (
                    torch.cuda.graph(graph, pool=pool_handle, stream=self._side_stream()),
                    host_sync_guard(),
                ):
                    fn()
                self.synchronize()
            except BaseException as exc:
                # The original failure is the one worth reporting, not a failing reset.
                with contextlib.suppress(Exception):
                    graph.reset()
                del graph
                if isinstance(exc, CaptureError) or not isinstance(exc, RuntimeError):
                    raise
                raise CaptureError(f"device graph capture failed: {exc}") from exc
            num_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved_before)
        return DeviceGraph(graph, num_bytes)


__all__ = ["DeviceBackend", "DeviceGraph"]
