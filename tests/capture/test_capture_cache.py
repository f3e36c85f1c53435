"""GraphCache: capture/replay bookkeeping, largest-first order, failed captures, buffer
address checks, eager fallbacks and stats (on the tape backend, CPU)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

import capture
from capture import (
    CacheStats,
    CaptureError,
    GraphCache,
    StaticBuffers,
    StepShape,
    get_backend,
    is_capturing,
)
from capture.backends import recording
from capture.backends.tape import Tape, TapeBackend, TapePool

NAN = float("nan")


def shape(num_tokens: int) -> StepShape:
    return StepShape(num_tokens, num_tokens, 1)


@pytest.fixture
def step_buffers(gen: torch.Generator) -> StaticBuffers:
    buffers = StaticBuffers("cpu")
    buffers.add("x", (16,), torch.float32).copy_(torch.randn(16, generator=gen))
    buffers.add("out", (16,), torch.float32, fill=NAN)
    return buffers


def scaled_copy(buffers: StaticBuffers, rows: int, scale: float) -> object:
    def step() -> None:
        buffers.view("out", rows).copy_(buffers.view("x", rows) * scale)

    return step


def test_capture_replay_and_stats(step_buffers: StaticBuffers, gen: torch.Generator) -> None:
    cache = GraphCache("tape", buffers=step_buffers)
    assert cache.backend.name == "tape" and cache.buffers is step_buffers
    cache.capture(shape(4), scaled_copy(step_buffers, 4, 2.0))
    cache.capture(shape(8), scaled_copy(step_buffers, 8, 3.0), warmup=0)
    assert shape(4) in cache and shape(16) not in cache and len(cache) == 2
    assert cache.shapes() == [shape(4), shape(8)]
    assert step_buffers.frozen

    x, out = step_buffers["x"], step_buffers["out"]
    for _ in range(2):
        x.copy_(torch.randn(16, generator=gen))
        out.fill_(NAN)
        cache.replay(shape(8))
        torch.testing.assert_close(out[:8].double(), x[:8].double() * 3)
        assert torch.isnan(out[8:]).all()
    cache.replay(shape(4))

    stats = cache.stats()
    assert isinstance(stats, CacheStats) and stats.backend == "tape"
    assert list(stats.graphs) == [shape(4), shape(8)]
    four, eight = stats.graphs[shape(4)], stats.graphs[shape(8)]
    assert (four.replays, eight.replays) == (1, 2)
    tape = cache.graph(shape(8))
    assert isinstance(tape, Tape)
    assert eight.num_ops == tape.num_ops == len(tape.entries) > 0
    assert eight.num_bytes == 8 * 4  # the private `x[:8] * 3`
    assert four.capture_seconds > 0 and four.warmup_seconds > 0
    assert stats.total_replays == 3
    assert stats.total_ops == four.num_ops + eight.num_ops
    assert stats.total_bytes == 2 * 8 * 4 - 4 * 4
    # A snapshot: editing it does not touch the cache.
    stats.graphs[shape(4)].replays = 99
    assert cache.stats().graphs[shape(4)].replays == 1

    as_json = json.loads(json.dumps(stats.to_dict()))
    assert as_json["totals"]["num_graphs"] == 2
    assert as_json["graphs"][1]["num_tokens"] == 8
    assert as_json["graphs"][1]["label"] == "tokens=8,reqs=8,q=1"


def test_eager_fallbacks_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    cache = GraphCache("tape")
    with caplog.at_level(logging.INFO, logger="capture"):
        cache.record_eager(None, "above the largest capture size")
        cache.record_eager(None, "above the largest capture size")
        cache.record_eager(shape(8), "prefill in the batch")
        cache.record_eager(None, "above the largest capture size")
    messages = [r.getMessage() for r in caplog.records if r.name == "capture"]
    assert len(messages) == 2
    assert "above the largest capture size" in messages[0]
    assert "tokens=8" in messages[1]
    stats = cache.stats()
    assert stats.eager_fallbacks == {"above the largest capture size": 3, "prefill in the batch": 1}
    assert stats.total_eager == 4
    with pytest.raises(ValueError, match="reason"):
        cache.record_eager(None, "")
    with pytest.raises(ValueError, match="shape"):
        cache.record_eager(8, "x")  # type: ignore[arg-type]


def test_capture_all_is_largest_first(step_buffers: StaticBuffers) -> None:
    order: list[int] = []
    progress: list[tuple[int, int, StepShape]] = []

    def recording_step(rows: int) -> object:
        inner = scaled_copy(step_buffers, rows, 1.5)

        def step() -> None:
            if is_capturing():
                order.append(rows)
            inner()  # type: ignore[operator]

        return step

    cache = GraphCache(TapeBackend(), buffers=step_buffers)
    sizes = [1, 2, 4, 8, 16]
    cache.capture_all(
        [(shape(n), recording_step(n)) for n in sizes],
        on_progress=lambda i, n, s: progress.append((i, n, s)),
    )
    assert order == [16, 8, 4, 2, 1]
    assert progress == [(i + 1, 5, shape(n)) for i, n in enumerate([16, 8, 4, 2, 1])]
    assert cache.shapes() == [shape(n) for n in sizes]
    # All graphs went into the one pool of the cache.
    pool = cache._pool
    assert isinstance(pool, TapePool) and pool.num_graphs == 5


def test_capture_all_validates_before_capturing(step_buffers: StaticBuffers) -> None:
    cache = GraphCache("tape", buffers=step_buffers)
    step = scaled_copy(step_buffers, 4, 1.0)
    with pytest.raises(ValueError, match="twice"):
        cache.capture_all([(shape(4), step), (shape(8), step), (shape(4), step)])
    assert len(cache) == 0
    cache.capture_all({shape(4): step})
    with pytest.raises(ValueError, match="already captured"):
        cache.capture_all({shape(8): step, shape(4): step})
    assert cache.shapes() == [shape(4)]
    with pytest.raises(ValueError, match="StepShape"):
        cache.capture_all([(4, step)])  # type: ignore[list-item]


def test_failed_capture_leaves_cache_as_it_was(step_buffers: StaticBuffers) -> None:
    cache = GraphCache("tape", buffers=step_buffers)
    cache.capture(shape(4), scaled_copy(step_buffers, 4, 2.0))
    cache.replay(shape(4))
    before = cache.stats()

    def syncing_step() -> None:
        step_buffers.view("out", 8).copy_(step_buffers.view("x", 8))
        step_buffers["out"][0].item()

    def raising_step() -> None:
        raise KeyError("model error")

    with pytest.raises(CaptureError, match="item"):
        cache.capture(shape(8), syncing_step)
    with pytest.raises(KeyError, match="model error"):
        cache.capture(shape(8), raising_step)
    after = cache.stats()
    assert cache.shapes() == [shape(4)]
    assert after.graphs == before.graphs
    assert after.failed_captures == 2
    assert not is_capturing()
    # The shape can still be captured properly afterwards.
    cache.capture(shape(8), scaled_copy(step_buffers, 8, 2.0))
    assert cache.shapes() == [shape(4), shape(8)]


def test_capture_errors(step_buffers: StaticBuffers) -> None:
    cache = GraphCache("tape")
    step = scaled_copy(step_buffers, 4, 1.0)
    cache.capture(shape(4), step)
    with pytest.raises(ValueError, match="already captured"):
        cache.capture(shape(4), step)
    with pytest.raises(ValueError, match="StepShape"):
        cache.capture(4, step)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fn="):
        cache.capture(shape(8), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup=-1"):
        cache.capture(shape(8), step, warmup=-1)
    with pytest.raises(ValueError, match="no captured graph"):
        cache.replay(shape(8))
    with pytest.raises(ValueError, match="no captured graph"):
        cache.graph(shape(8))
    assert cache.stats().failed_captures == 0


def test_moved_buffer_is_detected_at_replay(
    step_buffers: StaticBuffers, gen: torch.Generator
) -> None:
    cache = GraphCache("tape", buffers=step_buffers)
    cache.capture(shape(8), scaled_copy(step_buffers, 8, 2.0))
    with pytest.raises(ValueError, match="frozen"):
        step_buffers.add("late", (4,), torch.float32)
    step_buffers["x"].set_(torch.randn(16, generator=gen))
    with pytest.raises(CaptureError, match=r"buffers moved since capture: x \(0x"):
        cache.replay(shape(8))
    assert cache.stats().graphs[shape(8)].replays == 0


class RerunGraph:
    """Test double: a "graph" that re-runs the callable (no recording, no checks)."""

    num_bytes = None
    num_ops = None

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class RerunBackend:
    """Test double backend, to exercise GraphCache's own checks in isolation."""

    name = "rerun"

    def new_pool(self) -> object:
        return object()

    def synchronize(self) -> None:
        pass

    def warmup(self, fn: Callable[[], object]) -> None:
        fn()

    def capture(self, fn: Callable[[], object], pool: object | None) -> RerunGraph:
        with recording(self.name):
            fn()
        return RerunGraph(fn)


@pytest.mark.parametrize("backend", ["tape", "rerun"])
def test_buffer_moved_during_capture_is_refused(step_buffers: StaticBuffers, backend: str) -> None:
    cache = GraphCache(RerunBackend() if backend == "rerun" else backend, buffers=step_buffers)
    replacement = torch.zeros(16)

    def step() -> None:
        step_buffers["out"].copy_(step_buffers["x"])
        if is_capturing():
            step_buffers["out"].set_(replacement)

    # The tape notices first (a recorded tensor moved); otherwise the cache's buffer check.
    needle = "reallocated or resized during capture" if backend == "tape" else "buffers moved"
    with pytest.raises(CaptureError, match=needle):
        cache.capture(shape(8), step)
    assert len(cache) == 0 and not step_buffers.frozen
    assert cache.stats().failed_captures == 1


def test_stats_with_unknown_sizes(step_buffers: StaticBuffers) -> None:
    cache = GraphCache(RerunBackend(), buffers=step_buffers)
    cache.capture(shape(4), scaled_copy(step_buffers, 4, 2.0))
    stats = cache.stats()
    assert stats.total_bytes is None and stats.total_ops is None
    assert json.loads(json.dumps(stats.to_dict()))["totals"]["num_bytes"] is None


def test_backend_selection() -> None:
    assert get_backend("tape").name == "tape"
    with pytest.raises(ValueError, match="name='graph'"):
        get_backend("graph")
    with pytest.raises(ValueError, match="Backend protocol"):
        GraphCache(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffers"):
        GraphCache("tape", buffers={})  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_device_backend_needs_a_gpu() -> None:
    from capture.backends.device import DeviceBackend

    with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False"):
        get_backend("device")
    with pytest.raises(ValueError, match="CUDA/ROCm GPU"):
        DeviceBackend()
    with pytest.raises(ValueError, match="CUDA/ROCm GPU"):
        GraphCache("device")


def test_public_api() -> None:
    expected = {
        "StepShape",
        "CaptureSizes",
        "StaticBuffers",
        "GraphCache",
        "CacheStats",
        "CaptureError",
        "is_capturing",
        "get_backend",
    }
    assert expected <= set(capture.__all__)
    assert issubclass(CaptureError, RuntimeError)


def test_capture_imports_torch_only() -> None:
    """The arrow points one way: capture never imports graphidx (checked in a fresh process)."""
    code = (
        "import sys, capture, capture.backends.tape, capture.backends.device; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'graphidx'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"
