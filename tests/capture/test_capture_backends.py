"""Behaviours both graph backends share, each test run on the tape (on the CPU) and on the
device backend (torch CUDA/HIP graphs, GPU only)."""

from __future__ import annotations

import pytest
import torch

from capture import GraphCache, StepShape

SHAPE = StepShape(8, 8, 1)
NAN = float("nan")

BACKENDS = [
    pytest.param("tape", "cpu", 1234, id="tape"),
    pytest.param("device", "cuda", 4321, id="device", marks=pytest.mark.gpu),
]
"""(backend, device, generator seed) of each run."""


@pytest.mark.parametrize(("backend", "device", "seed"), BACKENDS)
def test_python_int_replays_captured_value(backend: str, device: str, seed: int) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(8, generator=gen, device=device)
    out = torch.full((8,), NAN, device=device)
    host = {"scale": 3, "length": 5}

    def step() -> None:
        out[: host["length"]].copy_(x[: host["length"]] * host["scale"])

    cache = GraphCache(backend)
    cache.capture(SHAPE, step)
    host["scale"], host["length"] = 7, 8
    x.copy_(torch.randn(8, generator=gen, device=device))
    out.fill_(NAN)
    cache.replay(SHAPE)
    # float32 against float64 math, at float32 tolerances.
    torch.testing.assert_close(out[:5].double(), x.double()[:5] * 3, rtol=2e-6, atol=2e-6)
    assert torch.isnan(out[5:]).all()  # the captured length, not the new one
