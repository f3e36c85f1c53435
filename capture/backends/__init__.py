"""Graph backends: what a backend is, the capture phase, and the error a capture raises.

A backend turns a zero-argument callable into a `CapturedGraph` that can be replayed:

- `device` (`capture.backends.device`): torch CUDA graphs, which are HIP graphs on ROCm.
- `tape` (`capture.backends.tape`): a portable op tape that records every dispatched torch op
  and replays that list; it emulates device-graph semantics on any device, the CPU included.

Both follow the same contract, which is the contract of a FULL device graph:

- What is frozen at capture: the sequence of ops, every non-tensor argument (Python ints,
  floats, lists of ints, dtypes...), every shape, every Python branch the callable took, and
  the identity (address, shape, stride) of every tensor the ops touch.
- What is re-read at every replay: the *contents* of the tensors, so writing new values into
  a persistent input tensor between replays is seen by the next replay.
- What raises `CaptureError`: host syncs during capture (`.item()`, `.tolist()`, `bool(t)`,
  data-dependent output shapes such as `nonzero` or boolean-mask indexing, device-to-host
  copies), capturing outside `GraphCache.capture`, nested captures, and a tensor that moved
  after capture (detected at replay).

The callable's return value is discarded: a graph communicates only through persistent
tensors (`capture.StaticBuffers`). Capture happens only inside `GraphCache.capture`, which
opens the capture phase (`capture_phase`); a backend's `capture` refuses to run outside it,
and `is_capturing()` is true exactly while a backend records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

BACKEND_NAMES = ("tape", "device")


class CaptureError(RuntimeError):
    """A capture or replay broke graph semantics (host sync, moved tensor, wrong phase)."""


@runtime_checkable
class CapturedGraph(Protocol):
    """One captured callable. `replay()` re-runs the captured work on the current tensor data.

    `num_bytes`: memory the graph holds privately (device: bytes the capture added to the
    allocator's reservation; tape: bytes of the tensors created during capture), or None
    when the backend cannot tell. `num_ops`: number of recorded ops (tape), or None (device).
    """

    @property
    def num_bytes(self) -> int | None: ...

    @property
    def num_ops(self) -> int | None: ...

    def replay(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """What `GraphCache` needs from a backend."""

    @property
    def name(self) -> str: ...

    def new_pool(self) -> object:
        """A memory pool that every graph of one cache shares."""
        ...

    def synchronize(self) -> None:
        """Wait until all work this backend launched has finished."""
        ...

    def warmup(self, fn: Callable[[], object]) -> None:
        """Run `fn` once eagerly, the way the backend wants warm-up runs done."""
        ...

    def capture(self, fn: Callable[[], object], pool: object | None) -> CapturedGraph:
        """Capture `fn` into a replayable graph; only inside the capture phase."""
        ...


# Capture is single-threaded by nature (a device graph captures one stream), so module
# state is enough; thread-locals would let a second thread dodge the nesting checks.
_phase_depth = 0
_capturing_backend: str | None = None


def is_capturing() -> bool:
    """True while a backend records a graph (not during warm-up runs)."""
    return _capturing_backend is not None


def in_capture_phase() -> bool:
    """True inside `GraphCache.capture` (warm-up runs and the capture itself)."""
    return _phase_depth > 0


@contextlib.contextmanager
def capture_phase() -> Iterator[None]:
    """Open the explicit capture phase. Internal: `GraphCache.capture` is its only user."""
    global _phase_depth
    if _phase_depth > 0:
        raise CaptureError(
            "nested capture: GraphCache.capture was called while another capture is in progress"
        )
    _phase_depth += 1
    try:
        yield
    finally:
        _phase_depth -= 1


@contextlib.contextmanager
def recording(backend_name: str) -> Iterator[None]:
    """Mark the span in which `backend_name` records; backends wrap their capture in it.

    Raises CaptureError outside the capture phase (capture only through `GraphCache.capture`)
    or when another recording is already active.
    """
    global _capturing_backend
    if _phase_depth == 0:
        raise CaptureError(
            f"{backend_name} backend: capture outside the capture phase; capture only through "
            "GraphCache.capture"
        )
    if _capturing_backend is not None:
        raise CaptureError(
            f"{backend_name} backend: nested capture while the {_capturing_backend} backend "
            "is recording"
        )
    _capturing_backend = backend_name
    try:
        yield
    finally:
        _capturing_backend = None


def get_backend(name: str) -> Backend:
    """The backend called `name`: "tape" (any device) or "device" (CUDA/HIP graphs).

    Raises ValueError for an unknown name, and for "device" when no CUDA/ROCm GPU is usable.
    """
    if name == "tape":
        from capture.backends.tape import TapeBackend

        return TapeBackend()
    if name == "device":
        from capture.backends.device import DeviceBackend

        return DeviceBackend()
    raise ValueError(f"backend name={name!r} is unknown; choose one of {BACKEND_NAMES}")


__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "CaptureError",
    "CapturedGraph",
    "capture_phase",
    "get_backend",
    "in_capture_phase",
    "is_capturing",
    "recording",
]
