"""The shape-keyed graph cache: capture (warm-up first, largest first, one pool), replay, stats.

`GraphCache.capture` is the only way to capture: it opens the capture phase, runs the
callable `warmup` times eagerly (so lazy allocations and compilations happen outside the
graph), then has the backend capture it into the cache's one shared memory pool. A capture
that raises leaves the cache exactly as it was (only `failed_captures` counts it) and the
backend frees what it took. After the first successful capture the cache's `StaticBuffers`
are frozen; before every replay their addresses are compared with those at capture, and a
moved buffer raises `CaptureError` naming it.

Steps that cannot replay a graph run eagerly; `record_eager` counts them by reason and logs
each distinct reason once at INFO on the "capture" logger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from capture.backends import (
    Backend,
    CapturedGraph,
    CaptureError,
    capture_phase,
    get_backend,
    in_capture_phase,
)
from capture.buffers import StaticBuffers
from capture.shapes import StepShape

logger = logging.getLogger("capture")

ProgressCallback = Callable[[int, int, StepShape], None]


@dataclass
class GraphStats:
    """What one captured graph cost and how often it ran.

    `warmup_seconds`/`capture_seconds`: wall time of the eager warm-up runs and of the capture
    itself (both synchronized). `num_bytes`/`num_ops`: as reported by the backend's graph
    (None when the backend cannot tell). `replays`: replays so far.
    """

    warmup_seconds: float
    capture_seconds: float
    num_bytes: int | None
    num_ops: int | None
    replays: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "warmup_seconds": self.warmup_seconds,
            "capture_seconds": self.capture_seconds,
            "num_bytes": self.num_bytes,
            "num_ops": self.num_ops,
            "replays": self.replays,
        }


@dataclass
class CacheStats:
    """A snapshot of a cache's statistics (`GraphCache.stats()`); changing it changes nothing.

    `graphs`: per captured shape, ascending. `eager_fallbacks`: reason -> count.
    `failed_captures`: captures that raised.
    """

    backend: str
    graphs: dict[StepShape, GraphStats] = field(default_factory=dict)
    eager_fallbacks: dict[str, int] = field(default_factory=dict)
    failed_captures: int = 0

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    @property
    def total_capture_seconds(self) -> float:
        """Warm-up plus capture seconds of every graph."""
        return sum(g.warmup_seconds + g.capture_seconds for g in self.graphs.values())

    @property
    def total_bytes(self) -> int | None:
        """Sum of the graphs' known num_bytes; None when no graph reports it."""
        known = [g.num_bytes for g in self.graphs.values() if g.num_bytes is not None]
        return sum(known) if known else None

    @property
    def total_ops(self) -> int | None:
        """Sum of the graphs' known num_ops; None when no graph reports it."""
        known = [g.num_ops for g in self.graphs.values() if g.num_ops is not None]
        return sum(known) if known else None

    @property
    def total_replays(self) -> int:
        return sum(g.replays for g in self.graphs.values())

    @property
    def total_eager(self) -> int:
        return sum(self.eager_fallbacks.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (shapes as their fields plus a label)."""
        return {
            "backend": self.backend,
            "graphs": [
                {
                    "num_tokens": shape.num_tokens,
                    "num_reqs": shape.num_reqs,
                    "uniform_query_len": shape.uniform_query_len,
                    "label": shape.label,
                    **graph.to_dict(),
                }
                for shape, graph in self.graphs.items()
            ],
            "eager_fallbacks": dict(self.eager_fallbacks),
            "failed_captures": self.failed_captures,
            "totals": {
                "num_graphs": self.num_graphs,
                "capture_seconds": self.total_capture_seconds,
                "num_bytes": self.total_bytes,
                "num_ops": self.total_ops,
                "replays": self.total_replays,
                "eager": self.total_eager,
            },
        }


@dataclass
class _CachedGraph:
    graph: CapturedGraph
    stats: GraphStats
    addresses: dict[str, int] | None
    fingerprint: tuple[int, ...] | None


class GraphCache:
    """Captured graphs by StepShape, all in one memory pool of one backend."""

    def __init__(self, backend: Backend | str, *, buffers: StaticBuffers | None = None) -> None:
        """`backend`: a Backend or its name ("tape", "device"). `buffers`: the persistent
        tensors the graphs read, checked for moved addresses before every replay."""
        if isinstance(backend, str):
            backend = get_backend(backend)
        if not isinstance(backend, Backend):
            raise ValueError(f"backend={backend!r} does not implement the Backend protocol")
        if buffers is not None and not isinstance(buffers, StaticBuffers):
            raise ValueError(f"buffers={buffers!r} must be a StaticBuffers or None")
        self._backend = backend
        self._buffers = buffers
        self._pool: object | None = None
        self._graphs: dict[StepShape, _CachedGraph] = {}
        self._eager: dict[str, int] = {}
        self._failed_captures = 0

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def buffers(self) -> StaticBuffers | None:
        return self._buffers

    def __contains__(self, shape: object) -> bool:
        return shape in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def shapes(self) -> list[StepShape]:
        """Captured shapes, ascending."""
        return sorted(self._graphs)

    def graph(self, shape: StepShape) -> CapturedGraph:
        """The captured graph of `shape` (for inspection); ValueError if not captured."""
        return self._lookup(shape).graph

    def _lookup(self, shape: StepShape) -> _CachedGraph:
        cached = self._graphs.get(shape)
        if cached is None:
            raise ValueError(
                f"shape={shape!r} has no captured graph; captured: "
                f"{[s.label for s in self.shapes()]}"
            )
        return cached

    def capture(self, shape: StepShape, fn: Callable[[], object], *, warmup: int = 1) -> None:
        """Run `fn` `warmup` times eagerly, then capture it as the graph of `shape`.

        `fn` takes no arguments; its return value is discarded (graphs communicate through
        persistent tensors). ValueError if `shape` is already captured or the arguments are
        bad; CaptureError (or `fn`'s own error) if capture fails, leaving the cache unchanged.
        """
        if not isinstance(shape, StepShape):
            raise ValueError(f"shape={shape!r} must be a StepShape")
        if not callable(fn):
            raise ValueError(f"fn={fn!r} must be callable")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup={warmup!r} must be an int >= 0")
        if shape in self._graphs:
            raise ValueError(f"shape={shape!r} is already captured")
        if self._pool is None:
            self._pool = self._backend.new_pool()
        try:
            with capture_phase():
                start = time.perf_counter()
                for _ in range(warmup):
                    self._backend.warmup(fn)
                self._backend.synchronize()
                warmup_seconds = time.perf_counter() - start
                addresses_before = self._addresses()
                start = time.perf_counter()
                graph = self._backend.capture(fn, self._pool)
                self._backend.synchronize()
                capture_seconds = time.perf_counter() - start
            addresses = self._addresses()
            if addresses != addresses_before:
                del graph
                raise CaptureError(
                    "buffers moved during capture: "
                    f"{_moved(addresses_before or {}, addresses or {})}; allocate every "
                    "buffer before capture and never reallocate it"
                )
        except BaseException:
            self._failed_captures += 1
            raise
        if self._buffers is not None:
            self._buffers.freeze()
        self._graphs[shape] = _CachedGraph(
            graph,
            GraphStats(warmup_seconds, capture_seconds, graph.num_bytes, graph.num_ops),
            addresses,
            None if self._buffers is None else self._buffers.fingerprint(),
        )

    def capture_all(
        self,
        shapes_and_fns: Mapping[StepShape, Callable[[], object]]
        | Iterable[tuple[StepShape, Callable[[], object]]],
        *,
        warmup: int = 1,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        """Capture every (shape, fn), largest shape first so smaller graphs reuse the pool.

        Validates all shapes first (ValueError for a duplicate or an already captured shape,
        before anything is captured). `on_progress(i, n, shape)` is called after the i-th
        capture (1-based) of n. If one capture raises, the graphs captured before it stay.
        """
        pairs = list(
            shapes_and_fns.items() if isinstance(shapes_and_fns, Mapping) else shapes_and_fns
        )
        seen: set[StepShape] = set()
        for pair in pairs:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValueError(f"shapes_and_fns holds {pair!r}; expected (StepShape, fn) pairs")
            shape, fn = pair
            if not isinstance(shape, StepShape):
                raise ValueError(f"shapes_and_fns holds shape={shape!r}; expected a StepShape")
            if not callable(fn):
                raise ValueError(f"shapes_and_fns holds fn={fn!r} for {shape.label}; not callable")
            if shape in seen:
                raise ValueError(f"shapes_and_fns holds shape={shape!r} twice")
            if shape in self._graphs:
                raise ValueError(f"shape={shape!r} is already captured")
            seen.add(shape)
        ordered = sorted(pairs, key=lambda pair: pair[0], reverse=True)
        for index, (shape, fn) in enumerate(ordered, start=1):
            self.capture(shape, fn, warmup=warmup)
            if on_progress is not None:
                on_progress(index, len(ordered), shape)

    def replay(self, shape: StepShape) -> None:
        """Replay the graph of `shape` on the current contents of its tensors.

        ValueError if `shape` was not captured; CaptureError inside a capture phase or when
        a buffer's address differs from the one at capture.
        """
        if in_capture_phase():
            raise CaptureError(f"replay of {shape!r} inside a capture phase")
        cached = self._lookup(shape)
        buffers = self._buffers
        if buffers is not None and buffers.fingerprint() != cached.fingerprint:
            raise CaptureError(
                f"cannot replay {shape.label}: buffers moved since capture: "
                f"{_moved(cached.addresses or {}, buffers.addresses())}"
            )
        cached.graph.replay()
        cached.stats.replays += 1

    def record_eager(self, shape: StepShape | None, reason: str) -> None:
        """Count one step that ran eagerly instead of replaying, with why.

        `shape`: the padded shape it would have had, or None (e.g. above the largest size).
        Each distinct `reason` is logged once at INFO; every call is counted.
        """
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason={reason!r} must be a non-empty str")
        if shape is not None and not isinstance(shape, StepShape):
            raise ValueError(f"shape={shape!r} must be a StepShape or None")
        if reason not in self._eager:
            where = shape.label if shape is not None else "no captured shape"
            logger.info(
                "running eagerly (%s): %s; further steps for this reason are only counted",
                where,
                reason,
            )
            self._eager[reason] = 0
        self._eager[reason] += 1

    def stats(self) -> CacheStats:
        """A snapshot of the statistics."""
        return CacheStats(
            backend=self._backend.name,
            graphs={
                shape: GraphStats(**vars(self._graphs[shape].stats)) for shape in self.shapes()
            },
            eager_fallbacks=dict(self._eager),
            failed_captures=self._failed_captures,
        )

    def _addresses(self) -> dict[str, int] | None:
        return None if self._buffers is None else self._buffers.addresses()


def _moved(before: Mapping[str, int], after: Mapping[str, int]) -> str:
    names = sorted(set(before) | set(after))
    return ", ".join(
        f"{name} (0x{before.get(name, 0):x} -> 0x{after.get(name, 0):x})"
        for name in names
        if before.get(name) != after.get(name)
    )


__all__ = ["CacheStats", "GraphCache", "GraphStats"]
