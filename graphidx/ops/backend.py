"""Which implementation of an op runs: `reference`, `triton` or `aiter` (docs/contract.md
section 5).

`None` picks the default for the tensors' device: `triton` on CUDA and ROCm GPUs, `reference`
on the CPU. An explicit choice that cannot run on that device raises instead of falling back.
`triton` runs on the CPU only under the Triton interpreter (`TRITON_INTERPRET=1`), which the
tests use; `aiter` needs a gfx950 GPU with aiter importable.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

BACKENDS = ("reference", "triton", "aiter")
PRECISIONS = ("exact", "fp8")
"""Precision modes of the logits ops (docs/contract.md section 5, "Precision")."""
FP8_LOGIT_BOUND = 2e-3
"""Bound on |fp8 logit - exact logit| relative to the row's largest |logit| (docs/contract.md
section 5, "Precision", has how it was measured)."""


_interpreted: bool | None = None


def triton_interpreted() -> bool:
    """True when Triton kernels run under the interpreter (CPU tensors allowed):
    TRITON_INTERPRET as it is at the first call, as Triton itself reads it once, when it
    decorates a kernel (every op of an eager step asks, so it is not read again)."""
    global _interpreted
    if _interpreted is None:
        _interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return _interpreted


# Looked up once, at import: a plain constant keeps `resolve_backend` free of cached calls,
# which torch.compile would otherwise trace through (with a warning) inside the layers.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """True when the triton package is installed."""
    return _TRITON_INSTALLED


@functools.cache
def _device_arch(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return str(getattr(props, "gcnArchName", "") or "")


def aiter_available(device: torch.device) -> bool:
    """aiter runs only on gfx950 (ROCm) with the `aiter` package importable."""
    if device.type != "cuda" or torch.version.hip is None:
        return False
    arch = _device_arch(device.index if device.index is not None else torch.cuda.current_device())
    return arch.startswith("gfx950") and importlib.util.find_spec("aiter") is not None


def default_backend(device: torch.device) -> str:
    """`triton` on a GPU when Triton is installed, else `reference`."""
    if device.type == "cuda" and triton_available():
        return "triton"
    return "reference"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Validate `backend` for tensors on `device`; `None` means the device's default.

    Raises `ValueError` for an unknown name or a backend that cannot run on `device`.
    """
    if backend is None:
        return default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' but the triton package is not installed")
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                f"backend='triton' cannot run on device {device} "
                "(set TRITON_INTERPRET=1 to run it on the CPU under the interpreter)"
            )
    if backend == "aiter" and not aiter_available(device):
        raise ValueError(
            f"backend='aiter' needs a gfx950 GPU with aiter installed; device is {device}"
        )
    return backend


@functools.cache
def device_capability(index: int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device `index` (a host constant)."""
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def fp8_tensor_cores(device: torch.device) -> bool:
    """True on NVIDIA GPUs with e4m3 tensor cores (compute capability 8.9 or newer)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return device_capability(index) >= (8, 9)


def default_precision(backend: str, device: torch.device) -> str:
    """The precision a logits op runs at when none is asked for: the fastest mode that meets
    its bound on the device. That is `exact` everywhere today: on the H200 the fp8 dense
    logits are faster than exact (decode 8-14%, prefill 22%) but the fp8 gather is slower
    (its keys do not load in the operand layout), and one mode serves every op of a stack
    (BENCHMARKS.md, "fp8 precision")."""
    del backend, device
    return "exact"


def resolve_precision(precision: str | None, backend: str, device: torch.device) -> str:
    """Validate `precision` for a resolved `backend` on `device`; `None` means the default.

    `exact` runs everywhere. `fp8` runs on the reference (which computes it exactly: the fp8
    operands hold every decoded value, see docs/contract.md) and on the triton backend on FP8
    tensor cores or under the interpreter; anywhere else it raises ValueError.
    """
    if precision is None:
        return default_precision(backend, device)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp8" and backend != "reference":
        if backend != "triton":
            raise ValueError(f"precision='fp8' is not available on backend {backend!r}")
        if not (triton_interpreted() or fp8_tensor_cores(device)):
            raise ValueError(
                f"precision='fp8' needs FP8 tensor cores (NVIDIA compute capability >= 8.9); "
                f"device is {device}"
            )
    return precision


def implementation(
    backend: str, reference: Callable[..., Any], kernels: str, name: str
) -> Callable[..., Any]:
    """The function that runs op `name` on a resolved `backend`: `reference` itself, `name`
    from `graphidx.ops.kernels.<kernels>` (Triton), or `name` from `graphidx.ops.aiter` —
    the last two imported on first use, so a CPU-only process never loads Triton code, and
    looked up once per process (eager steps resolve an op per launch)."""
    if backend == "reference":
        return reference
    found = _IMPLEMENTATIONS.get((backend, kernels, name))
    if found is not None:
        return found
    if backend == "triton":
        module = importlib.import_module(f"graphidx.ops.kernels.{kernels}")
    elif backend == "aiter":
        module = importlib.import_module("graphidx.ops.aiter")
    else:
        raise ValueError(f"unknown backend {backend!r}")
    fn: Callable[..., Any] = getattr(module, name)
    _IMPLEMENTATIONS[(backend, kernels, name)] = fn
    return fn


_IMPLEMENTATIONS: dict[tuple[str, str, str], Callable[..., Any]] = {}


def run_op(op: Any, body: Callable[..., None], *args: Any) -> None:
    """Run a graphidx custom op: `op` (its `torch.ops.graphidx` overload packet) when
    something must see it as one dispatched op — torch.compile tracing it, or an active
    TorchDispatchMode such as the capture tape or a FakeTensorMode — else `body`, the
    function registered as its implementation, called directly. Both run the same code;
    the direct call skips the dispatcher's per-call host work (custom-op dispatch costs
    more host time than launching the kernel), which is what eager steps pay per kernel.
    """
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        op(*args)
    else:
        body(*args)
