"""The device backend (torch CUDA/HIP graphs) mirrors the tape's key behaviours. GPU only."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

from capture import CaptureError, GraphCache, StaticBuffers, StepShape, is_capturing

pytestmark = pytest.mark.gpu

SHAPE = StepShape(8, 8, 1)
NAN = float("nan")


@pytest.fixture
def cuda_gen() -> torch.Generator:
    g = torch.Generator(device="cuda")
    g.manual_seed(4321)
    return g


def randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device="cuda")


def assert_matches(actual: torch.Tensor, expected64: torch.Tensor) -> None:
    torch.cuda.synchronize()
    torch.testing.assert_close(actual.double(), expected64, rtol=2e-5, atol=2e-5)


def test_inplace_update_and_private_chain(cuda_gen: torch.Generator) -> None:
    x = randn(6, 4, gen=cuda_gen)
    weight = randn(4, 3, gen=cuda_gen)
    out = torch.empty(6, 3, device="cuda")

    def step() -> None:
        hidden = x @ weight  # private: lives in the graph pool
        out.copy_(torch.tanh(hidden) + 1)

    cache = GraphCache("device")
    cache.capture(SHAPE, step)
    for _ in range(3):
        x.copy_(randn(6, 4, gen=cuda_gen))
        out.fill_(NAN)
        cache.replay(SHAPE)
        assert_matches(out, torch.tanh(x.double() @ weight.double()) + 1)
    stats = cache.stats()
    assert stats.graphs[SHAPE].replays == 3
    assert isinstance(stats.graphs[SHAPE].num_bytes, int) and stats.graphs[SHAPE].num_bytes >= 0
    assert stats.graphs[SHAPE].num_ops is None
    json.dumps(stats.to_dict())


def test_custom_op_replays(cuda_gen: torch.Generator, scale_into: Callable[..., None]) -> None:
    x = randn(7, gen=cuda_gen)
    out = torch.empty(7, device="cuda")
    cache = GraphCache("device")
    cache.capture(SHAPE, lambda: scale_into(x, out))
    x.copy_(randn(7, gen=cuda_gen))
    out.fill_(NAN)
    cache.replay(SHAPE)
    assert_matches(out, 2 * x.double() + 1)


@pytest.mark.parametrize(
    ("action", "needle"),
    [
        (lambda x: x[0].item(), "item"),
        (lambda x: x.tolist(), "tolist"),
        (lambda x: torch.nonzero(x > 0), "aten.nonzero"),
        (lambda x: x[x > 0], "aten.index.Tensor"),
        (lambda x: x.cpu(), "aten._to_copy"),
    ],
)
def test_host_syncs_are_refused(
    action: Callable[[torch.Tensor], object], needle: str, cuda_gen: torch.Generator
) -> None:
    x = randn(8, gen=cuda_gen)
    out = torch.empty(8, device="cuda")
    cache = GraphCache("device")

    def step() -> None:
        out.copy_(x * 2)
        action(x)

    with pytest.raises(CaptureError, match=needle):
        cache.capture(SHAPE, step)
    assert SHAPE not in cache and cache.stats().failed_captures == 1
    assert not is_capturing()
    # The device is still usable for a proper capture afterwards.
    cache.capture(SHAPE, lambda: out.copy_(x * 2))
    x.copy_(randn(8, gen=cuda_gen))
    out.fill_(NAN)
    cache.replay(SHAPE)
    assert_matches(out, 2 * x.double())


def test_capture_all_largest_first_shared_pool(cuda_gen: torch.Generator) -> None:
    buffers = StaticBuffers("cuda")
    x = buffers.add("x", (32, 16), torch.float32)
    out = buffers.add("out", (32, 16), torch.float32, fill=NAN)
    x.copy_(randn(32, 16, gen=cuda_gen))
    order: list[int] = []

    def make_step(rows: int) -> Callable[[], None]:
        def step() -> None:
            if is_capturing():
                order.append(rows)
            buffers.view("out", rows).copy_(torch.softmax(buffers.view("x", rows), dim=-1))

        return step

    cache = GraphCache("device", buffers=buffers)
    sizes = [4, 8, 16, 32]
    cache.capture_all({StepShape(n, n, 1): make_step(n) for n in sizes})
    assert order == [32, 16, 8, 4]
    for n in sizes:
        x.copy_(randn(32, 16, gen=cuda_gen))
        out.fill_(NAN)
        cache.replay(StepShape(n, n, 1))
        assert_matches(out[:n], torch.softmax(x.double()[:n], dim=-1))
        assert torch.isnan(out[n:]).all()

    x.set_(torch.empty(32, 16, device="cuda"))
    with pytest.raises(CaptureError, match="buffers moved since capture: x"):
        cache.replay(StepShape(4, 4, 1))
