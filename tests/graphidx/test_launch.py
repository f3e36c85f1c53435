"""`launch`: the direct kernel launch keys every specialization Triton makes and launches
exactly what `kernel[grid]` launches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from graphidx.ops.kernels import launch as launch_module
from graphidx.ops.kernels.launch import launch, specialization_key

GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU"
)


def test_the_key_tells_every_triton_specialization_apart() -> None:
    x = torch.zeros(64)
    base = specialization_key((x, 5), {"BLOCK": 16}, 0)
    variants = [
        ((x[1:], 5), {"BLOCK": 16}, 0),  # address not a multiple of 16
        ((x.to(torch.int32), 5), {"BLOCK": 16}, 0),  # dtype
        ((x, 1), {"BLOCK": 16}, 0),  # an int equal to 1
        ((x, 32), {"BLOCK": 16}, 0),  # a multiple of 16
        ((x, 2**31 + 5), {"BLOCK": 16}, 0),  # past int32
        ((x, 2**63 + 5), {"BLOCK": 16}, 0),  # past int64
        ((x, True), {"BLOCK": 16}, 0),  # a bool is not an int
        ((x, 5), {"BLOCK": 32}, 0),  # a constexpr
        ((x, 5), {"BLOCK": 16, "num_warps": 8}, 0),  # an option
        ((x, 5), {"BLOCK": 16}, 1),  # the device
    ]
    keys = [specialization_key(*v) for v in variants]
    assert base is not None and None not in keys
    assert len({base, *keys}) == len(keys) + 1
    assert specialization_key((x, 7), {"BLOCK": 16}, 0) == base  # same class: same variant
    assert specialization_key((x[16:], 5), {"BLOCK": 16}, 0) == base  # 64-byte offset
    assert specialization_key(((x, 5), 3), {}, 0) != specialization_key(((x, 1), 3), {}, 0)


def test_arguments_it_does_not_model_go_through_triton() -> None:
    import numpy as np

    x = torch.zeros(4)
    assert specialization_key((x, np.int64(3)), {}, 0) is None
    assert specialization_key((x, "name"), {}, 0) is None
    assert specialization_key(((x, object()),), {}, 0) is None


def test_hook_chains_count_as_hooks_only_when_not_empty() -> None:
    class Chain:
        def __init__(self, calls: list[object]) -> None:
            self.calls = calls

    assert not launch_module._hooked(None)
    assert not launch_module._hooked(Chain([]))
    assert launch_module._hooked(Chain([print]))
    assert launch_module._hooked(print)


def _two_params(dst, n, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 3):  # type: ignore[no-untyped-def]
    tl.store(dst + tl.arange(0, BLOCK), n + EXTRA)


def test_only_calls_of_the_call_sites_shape_are_cached() -> None:
    """Runtime parameters positional and every constexpr by keyword: keyed (constexprs by
    value); a constexpr passed positionally or left to its default, or an unknown Triton
    option, always goes through Triton."""
    from triton.runtime.jit import JITFunction

    compiled = launch_module._Compiled(JITFunction(_two_params))
    x = torch.zeros(4)
    assert compiled.runtime == 2 and compiled.constexprs == {"BLOCK", "EXTRA"}
    assert compiled.keyable((x, 5), {"BLOCK": 4, "EXTRA": 1, "num_warps": 4})
    assert not compiled.keyable((x, 5, 4), {"EXTRA": 1})  # a constexpr positionally
    assert not compiled.keyable((x, 5), {"BLOCK": 4})  # a default left to Triton
    assert not compiled.keyable((x, 5), {"BLOCK": 4, "EXTRA": 1, "launch_cooperative_grid": True})
    assert not compiled.keyable((x,), {"n": 5, "BLOCK": 4, "EXTRA": 1})  # runtime by name


@triton.jit
def _scaled_copy(src, dst, n, scale, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(dst + offsets, tl.load(src + offsets, mask=inside) * scale, mask=inside)


@GPU
def test_direct_launches_equal_triton_launches_for_every_specialization() -> None:
    """Aligned and misaligned pointers, n of 1, a multiple of 16 and neither: each first call
    compiles through Triton, each later one launches directly, and every answer is right."""
    src = torch.randn(4096, device="cuda")
    dst = torch.full_like(src, float("nan"))
    cases = [(0, 4000), (1, 4000), (3, 1), (0, 1024), (5, 17), (0, 4000)]
    for _ in range(2):
        for offset, n in cases:
            dst.fill_(float("nan"))
            grid = (triton.cdiv(n, 256),)
            launch(_scaled_copy, grid, src[offset:], dst[offset:], n, 2.0, BLOCK=256)
            torch.cuda.synchronize()
            want = src[offset : offset + n] * 2
            assert torch.equal(dst[offset : offset + n], want), (offset, n)
            assert bool(dst[offset + n :].isnan().all())
    compiled = launch_module._KERNELS[_scaled_copy]
    assert compiled.direct
    # aligned or not x n a multiple of 16, 1 or neither: the 4 classes these cases reach
    assert len(compiled.variants) == 4


@GPU
def test_direct_launches_capture_and_replay() -> None:
    src = torch.randn(1024, device="cuda")
    dst = torch.zeros_like(src)
    launch(_scaled_copy, (4,), src, dst, 1000, 3.0, BLOCK=256)  # compiles
    launch(_scaled_copy, (4,), src, dst, 1000, 3.0, BLOCK=256)  # direct
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(_scaled_copy, (4,), src, dst, 1000, 3.0, BLOCK=256)
    dst.zero_()
    src.copy_(torch.randn_like(src))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst[:1000], src[:1000] * 3)
    assert bool((dst[1000:] == 0).all())


_HASHES_IN_ORDER = """
import hashlib, importlib, pkgutil, random, sys
from triton.runtime.jit import JITFunction
import graphidx.ops.kernels as package
from graphidx import specializations
from graphidx.ops.kernels import launch
functions = []
for info in pkgutil.iter_modules(package.__path__):
    module = importlib.import_module(f"{package.__name__}.{info.name}")
    functions += [v for v in vars(module).values() if isinstance(v, JITFunction)]
random.Random(int(sys.argv[1])).shuffle(functions)
kernels = [f for f in functions if f.fn.__name__.endswith("_kernel")]
specializations._signature(kernels[0])  # keys a kernel, as a warm-up plan does first
launch._kernel(kernels[1])  # as a first launch does
keys = sorted(f.fn.__qualname__ + f.cache_key for f in functions)
print(hashlib.sha256("".join(keys).encode()).hexdigest())
"""


def test_kernel_hashes_do_not_depend_on_the_order_they_are_asked_for() -> None:
    """Processes that reach the kernels in different orders (a warm-up worker, the serving
    process) compute the same source hashes, whether a kernel is first keyed by a launch or
    by a warm-up plan, so they share Triton's on-disk cache (Triton 3.6 otherwise: a helper's
    globals join a caller's hash only when the helper was hashed first)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    digests = {
        subprocess.run(
            [sys.executable, "-c", _HASHES_IN_ORDER, str(seed)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (1, 2, 3)
    }
    assert len(digests) == 1, digests


def _kernels() -> list[object]:
    """Every JIT kernel (a `*_kernel` function) defined in graphidx.ops.kernels."""
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import graphidx.ops.kernels as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found += [
            v
            for v in vars(module).values()
            if isinstance(v, (JITFunction, InterpretedFunction))
            and v.fn.__module__ == module.__name__
            and v.fn.__name__.endswith("_kernel")
        ]
    return found


def test_every_kernel_waits_for_the_kernel_before_it_first() -> None:
    """Under programmatic dependent launch kernel N's programs run while kernel N - 1 may
    still run; N finishing means N - 1 finished only if every program of every kernel waits
    (`wait_for_prior_kernels`) before anything else."""
    import ast
    import inspect
    import textwrap

    kernels = _kernels()
    assert len(kernels) >= 13
    for kernel in kernels:
        tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = body[0]
        assert (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Call)
            and getattr(first.value.func, "id", None) == "wait_for_prior_kernels"
        ), kernel.fn.__qualname__


def test_dependent_launch_only_for_cuda_tensors_where_the_device_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CPU arguments (and the interpreter) never get `launch_pdl`; on an sm_90+ GPU every
    launch does unless GRAPHIDX_PDL=0."""
    kwargs = {"BLOCK": 4}
    assert launch_module.with_dependent_launch((torch.zeros(4),), kwargs) == kwargs
    assert launch_module.with_dependent_launch((), kwargs) == kwargs
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return
    from graphidx.ops.backend import device_capability, triton_interpreted

    device = torch.cuda.current_device()
    expected = not triton_interpreted() and device_capability(device) >= (9, 0)
    x = torch.zeros(4, device="cuda")
    launch_module.dependent_launch.cache_clear()
    got = launch_module.with_dependent_launch((x,), kwargs)
    assert got.get("launch_pdl", False) is expected and kwargs == {"BLOCK": 4}
    chosen = {"BLOCK": 4, "launch_pdl": False}
    assert launch_module.with_dependent_launch((x,), chosen) == chosen  # the caller's choice
    monkeypatch.setenv("GRAPHIDX_PDL", "0")
    launch_module.dependent_launch.cache_clear()
    assert launch_module.with_dependent_launch((x,), kwargs) == kwargs
    launch_module.dependent_launch.cache_clear()

