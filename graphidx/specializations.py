"""Triton specialization keys: what decides whether a kernel launch compiles a new variant.

The key of a launch (`launch_key`) is the kernel's name and, per argument, what Triton
specializes on: for a runtime argument a tensor's dtype and whether its address is a multiple
of 16, an int's `== 1`, `% 16 == 0` and whether it fits in int32, a bool's value, a float's
type; for the arguments a kernel lists in `do_not_specialize` only the type (dtype, int32 or
not); every constexpr and launch option by value. Launches with equal keys run one compiled
variant: Triton compiles each new key once per process (and, through its on-disk cache,
once per machine).

Two ways to watch launches:
- `intercepted_launches(handler)`: every graphidx kernel launch (each goes through
  `graphidx.ops.kernels.launch.launch`) calls `handler(kernel, grid, args, kwargs)` instead,
  on any device. The warm-up plans with it (keys recorded, nothing runs) and compiles with it
  (`kernel.warmup`: compiled, not launched).
- `recording_interpreter(log)`: under TRITON_INTERPRET=1 every Triton kernel call, whoever
  makes it, is recorded in `log` instead of executed (outputs are left unwritten): the CPU
  view of what a GPU would compile, for tools/count_specializations.py and the tests.

Neither is thread-safe: each swaps module attributes for the duration of its `with` block.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

Key = tuple[str, tuple[tuple[str, object], ...]]
"""(kernel name, ((argument name, its specialization or constexpr value), ...))."""

LaunchHandler = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], None]
"""handler(kernel, grid, args, kwargs), called in place of a kernel launch."""

_INT32 = (-(2**31), 2**31)


@dataclass(frozen=True)
class _Signature:
    names: tuple[str, ...]
    constexprs: frozenset[str]
    unspecialized: frozenset[str]


def _signature(kernel: Any) -> _Signature:
    """Parameter names, constexpr names and `do_not_specialize` names of a JITFunction or
    an InterpretedFunction, cached by the kernel's identity (hashing a JITFunction computes
    its source hash, whose order `launch.settle_hashes` fixes before the first launch)."""
    found = _SIGNATURES.get(id(kernel))
    if found is None:
        found = _SIGNATURES[id(kernel)] = _signature_of(kernel)
    return found


_SIGNATURES: dict[int, _Signature] = {}
"""By `id(kernel)`: kernels are module globals, alive as long as the process."""


def _signature_of(kernel: Any) -> _Signature:
    params = list(inspect.signature(kernel.fn).parameters.values())
    names = tuple(p.name for p in params)
    constexprs = frozenset(p.name for p in params if "constexpr" in str(p.annotation))
    listed = getattr(kernel, "do_not_specialize", None)
    if listed is None:
        listed = getattr(kernel, "kwargs", {}).get("do_not_specialize")
    unspecialized = frozenset(names[i] if isinstance(i, int) else i for i in listed or ())
    return _Signature(names, constexprs, unspecialized)


def _argument(value: object, specialize: bool) -> object:
    """One runtime argument's specialization (its type alone when not `specialize`)."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        fits = _INT32[0] <= value < _INT32[1]
        return ("int", fits, value == 1, value % 16 == 0) if specialize else ("int", fits)
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype)
        return ("ptr", dtype, value.data_ptr() % 16 == 0) if specialize else ("ptr", dtype)
    if isinstance(value, float):
        return ("float",)
    if value is None:
        return ("none",)
    return ("other", type(value).__name__)


def launch_key(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
    """The specialization key of `kernel[grid](*args, **kwargs)` (module docstring)."""
    sig = _signature(kernel)
    key: list[tuple[str, object]] = [
        (name, _argument(value, name not in sig.unspecialized))
        for name, value in zip(sig.names, args, strict=False)
    ]
    for name, value in sorted(kwargs.items()):
        by_value = name in sig.constexprs or name not in sig.names  # a constexpr or an option
        key.append((name, value if by_value else _argument(value, name not in sig.unspecialized)))
    return (kernel.fn.__name__, tuple(key))


class KeyLog:
    """The distinct keys seen, in the order first seen."""

    def __init__(self) -> None:
        self._keys: dict[Key, None] = {}

    def record(self, key: Key) -> bool:
        """Add `key`; True when it is new."""
        if key in self._keys:
            return False
        self._keys[key] = None
        return True

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[Key]:
        return iter(self._keys)

    def keys(self) -> list[Key]:
        return list(self._keys)

    def by_kernel(self) -> dict[str, list[Key]]:
        """Keys grouped by kernel name, kernels with the most keys first."""
        groups: dict[str, list[Key]] = {}
        for key in self._keys:
            groups.setdefault(key[0], []).append(key)
        return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))


def _import_kernel_modules() -> None:
    """Import every module of graphidx.ops.kernels, so that each has bound `launch`."""
    import graphidx.ops.kernels as kernels

    for info in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{info.name}")


@contextmanager
def intercepted_launches(handler: LaunchHandler) -> Iterator[None]:
    """Inside the block, every `graphidx.ops.kernels.launch.launch(kernel, grid, *args,
    **kwargs)` calls `handler(kernel, grid, args, kwargs)` and launches nothing."""
    from graphidx.ops.kernels import launch as launch_module

    _import_kernel_modules()
    original = launch_module.launch

    def replacement(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
        handler(kernel, grid, args, kwargs)

    modules = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("graphidx.") and getattr(module, "launch", None) is original
    ]
    for module in modules:
        module.launch = replacement  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in modules:
            module.launch = original  # type: ignore[attr-defined]


def recorder(log: KeyLog) -> LaunchHandler:
    """A launch handler that records each launch's key in `log` (and launches nothing)."""

    def record(kernel: Any, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        log.record(launch_key(kernel, args, kwargs))

    return record


@contextmanager
def recording_interpreter(log: KeyLog) -> Iterator[KeyLog]:
    """Inside the block, every Triton kernel call under TRITON_INTERPRET=1 records its key
    in `log` and executes nothing. RuntimeError when the interpreter is off."""
    from graphidx.ops.backend import triton_interpreted

    if not triton_interpreted():
        raise RuntimeError("recording_interpreter needs TRITON_INTERPRET=1")
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        log.record(launch_key(self, args, kwargs))

    InterpretedFunction.run = run
    try:
        yield log
    finally:
        InterpretedFunction.run = original


__all__ = [
    "Key",
    "KeyLog",
    "LaunchHandler",
    "intercepted_launches",
    "launch_key",
    "recorder",
    "recording_interpreter",
]
