"""Kernel launches with little host work: `launch(kernel, grid, *args, **kwargs)`.

`kernel[grid](*args, **kwargs)` costs Triton ~13 us of host time per call on the H200's host
(binding every argument, a string cache key, knob reads, a check of the kernel's globals, the
launch-metadata hooks), more than many of our kernels run. An eager step launches dozens.

`launch` does the same launch in a few microseconds. The first call for a given
specialization goes through Triton (`kernel[grid]`, which compiles and launches) and keeps the
compiled kernel; later calls with the same specialization key call its launcher directly.
The key is at least as fine as Triton's own specialization (NVIDIA backend): per tensor its
dtype and whether its address is a multiple of 16; per int whether it equals 1, whether it is
a multiple of 16 and whether it fits in int32 and in int64; bools by value, floats by type;
tuples element by element; the constexpr and option keyword values; the current device.
Whenever a key might be coarser than Triton's, the launch takes Triton's path: under the
interpreter, on ROCm (whose backend specializes pointers on buffer ranges as well), with
launch hooks installed (profilers such as Proton see every launch), and for any argument of
another type.

A call is cached only in the shape every call site here uses: every runtime parameter
positional, every constexpr by keyword (constexpr values are part of the key, as in Triton),
options among `num_warps`, `num_stages`, `num_ctas`, `maxnreg`; any other call (a constexpr
passed positionally or left to its default, another Triton option) always takes Triton's
path. Triton knobs read at compile time (`debug`, instrumentation) are not part of the key:
changing them after a kernel's first launch keeps the variant compiled before.

Triton's on-disk cache is shared by every process only if each computes the same source hash
for a kernel, and Triton 3.6's hash depends on the order of computing them: a helper's
constexpr globals join a caller's hash only when the helper was hashed first. Any use of a
JITFunction as a dict key or in a set computes its hash. `settle_hashes()` hashes every JIT
function of `graphidx.ops.kernels` once, in one fixed order (by module, then name); `launch`
calls it before it first uses a kernel as a key, and a warm-up worker before it compiles
(`graphidx.specializations` keys kernels by identity, hashing none), so a serving process
finds what the workers compiled.

On NVIDIA compute capability 9.0 and newer every launch uses programmatic dependent launch
(`launch_pdl`, `with_dependent_launch`): the GPU sets a kernel up while the kernel before it in
the stream still runs, and its programs wait for that one in `wait_for_prior_kernels`
(graphidx.ops.kernels.ptx), the first statement of every graphidx kernel. On the H200 this
took 1-6 us off the V3.2 and V4.1 decode graphs at batch 1 (docs/perf-notes.md).
`GRAPHIDX_PDL=0` in the environment turns it off (read once per device).
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from typing import Any

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from graphidx.ops.backend import device_capability, triton_interpreted

_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl"})
_INT32 = (-(2**31), 2**31)
_INT64 = (-(2**63), 2**63)


class _Compiled:
    """One kernel's compiled variants by specialization key; its parameter names; how many
    runtime parameters lead its signature (every constexpr after them); and whether `launch`
    may call its launchers directly (a JIT kernel on an NVIDIA GPU)."""

    __slots__ = ("constexprs", "direct", "names", "runtime", "variants")

    def __init__(self, kernel: Any) -> None:
        params = list(getattr(kernel, "params", ()))
        self.names: tuple[str, ...] = tuple(p.name for p in params)
        self.constexprs = frozenset(p.name for p in params if p.is_constexpr)
        self.runtime = sum(1 for p in params if not p.is_constexpr)
        leading = all(not p.is_constexpr for p in params[: self.runtime])
        self.direct = (
            isinstance(kernel, JITFunction)
            and leading
            and torch.version.hip is None
            and not triton_interpreted()
        )
        self.variants: dict[tuple[Any, ...], Any] = {}

    def keyable(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a call can be keyed: the runtime parameters positional, every constexpr
        by keyword (keyed by value), nothing else but the known options."""
        if len(args) != self.runtime:
            return False
        named = kwargs.keys() - _OPTIONS
        return named == self.constexprs


_KERNELS: dict[Any, _Compiled] = {}


def _arg_key(value: Any) -> Any:
    """The specialization class of one runtime argument (None: not one `launch` can key)."""
    kind = type(value)
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if kind is bool:
        return ("b", value)
    if kind is int:
        return (
            "i",
            value == 1,
            value % 16 == 0,
            _INT32[0] <= value < _INT32[1],
            _INT64[0] <= value < _INT64[1],
        )
    if kind is float:
        return ("f",)
    if kind is tuple:
        keys = tuple(_arg_key(v) for v in value)
        return None if None in keys else ("t", keys)
    return None


def specialization_key(
    args: tuple[Any, ...], kwargs: dict[str, Any], device: int
) -> tuple[Any, ...] | None:
    """The key `launch` caches a compiled variant of a launch on CUDA device `device` under,
    or None when the call must go through Triton (an argument whose specialization `launch`
    does not model). Keyword values must be hashable."""
    keys = tuple(map(_arg_key, args))
    if None in keys:
        return None
    return (keys, tuple(kwargs.items()), device)


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook is installed (a callable, or a non-empty hook chain)."""
    return hook is not None and bool(getattr(hook, "calls", True))


_settled = False


def settle_hashes() -> None:
    """Compute the source hash of every JIT function in the modules of graphidx.ops.kernels,
    sorted by module and name, once per process (module docstring); nothing under the
    interpreter."""
    global _settled
    if _settled:
        return
    _settled = True
    import graphidx.ops.kernels as package

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for _, value in sorted(vars(module).items()):
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                value.cache_key  # noqa: B018 - computed and kept by Triton


def _kernel(kernel: Any) -> _Compiled:
    if not _settled:
        settle_hashes()  # before the lookup: a JITFunction's hash is its source hash
    compiled = _KERNELS.get(kernel)
    if compiled is None:
        compiled = _KERNELS[kernel] = _Compiled(kernel)
    return compiled


@functools.cache
def dependent_launch(device: int) -> bool:
    """Whether kernels on CUDA device `device` launch with programmatic dependent launch: an
    NVIDIA GPU of compute capability >= 9.0, Triton compiling (not interpreting), and
    GRAPHIDX_PDL not "0" (module docstring)."""
    if triton_interpreted() or torch.version.hip is not None:
        return False
    return os.environ.get("GRAPHIDX_PDL", "1") != "0" and device_capability(device) >= (9, 0)


def _wants_dependent_launch(kwargs: dict[str, Any], device: int) -> bool:
    """Whether a launch on CUDA device `device` gets `launch_pdl=True`: the device has it
    and the caller did not choose `launch_pdl` itself."""
    return "launch_pdl" not in kwargs and dependent_launch(device)


def with_dependent_launch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with the options `launch` adds for this launch (its first argument a CUDA
    tensor on the current device): the ones a warm-up must compile its variant with."""
    first = args[0] if args else None
    if (
        isinstance(first, torch.Tensor)
        and first.is_cuda
        and _wants_dependent_launch(kwargs, torch.cuda.current_device())
    ):
        return {**kwargs, "launch_pdl": True}
    return kwargs


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, with the host work of Triton's launch skipped once
    this specialization ran once, and programmatic dependent launch where the device has it
    (module docstring). `grid`: 1 to 3 ints; `args[0]` a tensor (the direct path needs it on
    a CUDA device). A kernel launched here must call `wait_for_prior_kernels()` first (tests
    check every kernel of this package)."""
    compiled = _kernel(kernel)
    first = args[0] if args else None
    cuda = isinstance(first, torch.Tensor) and first.is_cuda
    device = torch.cuda.current_device() if cuda else -1
    if cuda and _wants_dependent_launch(kwargs, device):
        kwargs["launch_pdl"] = True  # this call's own dict (`with_dependent_launch`'s rule)
    if (
        not compiled.direct
        or not cuda
        or _hooked(knobs.runtime.launch_enter_hook)
        or _hooked(knobs.runtime.launch_exit_hook)
    ):
        kernel[grid](*args, **kwargs)
        return
    key = specialization_key(args, kwargs, device)
    variant = compiled.variants.get(key) if key is not None else None
    if variant is None:
        variant = kernel[grid](*args, **kwargs)
        if key is not None and variant is not None and compiled.keyable(args, kwargs):
            variant[(1, 1, 1)]  # loads the module and function handles once
            compiled.variants[key] = variant
        return
    params = args + tuple(kwargs[name] for name in compiled.names[len(args) :])
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    if g0 * g1 * g2 == 0:
        return
    stream = torch._C._cuda_getCurrentRawStream(device)
    variant.run(
        g0, g1, g2, stream, variant.function, variant.packed_metadata, None, None, None, *params
    )


__all__ = [
    "dependent_launch",
    "launch",
    "settle_hashes",
    "specialization_key",
    "with_dependent_launch",
]
