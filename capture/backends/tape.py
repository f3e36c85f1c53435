"""Portable op tape: device-graph semantics on any device, and the capture guards.

Capture runs the callable once under a `TorchDispatchMode` that executes every dispatched
torch op normally and appends `(op, args, kwargs)` to a list. Replay calls that list again, in
order. The semantics are those of a FULL CUDA/HIP graph, so a bug that only a graph exposes
(a value baked in at capture, a host sync, a buffer that moved) shows up on a CPU:

Frozen at capture
- The op sequence and every Python branch the callable took.
- Every non-tensor argument (ints, floats, lists of ints, dtypes, devices...) is snapshotted:
  a Python int that changes after capture replays its OLD value.
- Tensor arguments are kept by identity (the same tensor objects). A tensor that existed
  before capture (a persistent input or output, a weight) must keep its data_ptr, shape and
  stride: `replay()` checks every one and raises `CaptureError` naming the first op argument
  it was used as when it moved (`t.set_(...)`, `t.resize_(...)`, `t.data = ...`).

Re-read at every replay
- The contents of every tensor: writing new values into a persistent input between replays
  is seen by the next replay; in-place and `out=` ops mutate their arguments as usual.
- Random ops draw fresh numbers at every replay (a device graph advances its generator's
  offset per replay too); an explicit `generator=` argument is kept by identity.

Graph-private memory
- A tensor created by a recorded op (an out-of-place result) is private to the tape and kept
  alive by it, like memory in a graph's pool. At replay the op runs again and its new result
  is copied INTO the originally returned tensor, so later recorded ops, which reference that
  tensor, see fresh values. `num_bytes` is the size of these tensors' storages.
- View ops (results that alias an argument: `view`, `slice`, `select`, `transpose`,
  `split`...) are re-run at replay and the fresh view must land on the same data_ptr, shape
  and stride as the recorded one (CaptureError otherwise); later ops keep using the recorded
  view object, which stays an alias because its base never moves (private bases are refreshed
  in place, pre-existing bases are checked).
- Uninitialised allocations (`empty`, `empty_like`, `empty_strided`, ...) are not re-run: a
  graph's `empty` reads whatever its pool holds, and the tape keeps the previous contents.
  Such a tensor may be resized once during capture by an `out=` op; a view taken of it
  before that resize is re-run at replay but not checked (it keeps its recorded layout).
- Aliasing is decided by storage identity (the StorageImpl), not by data_ptr, so meta
  tensors and empty storages are classified correctly.

Custom ops
- An op registered with `torch.library.custom_op` is dispatched as one `OpOverload` and its
  implementation runs with the recorder and the guards off, so it is ONE tape entry and its
  body is opaque (under TRITON_INTERPRET a Triton kernel reads tensors through numpy, which
  is the kernel's business, not the graph's). Kernels launched
  outside the dispatcher (a raw Triton launch, ctypes) are invisible to the tape: wrap them
  in a custom op, as graphidx does, or they will not be replayed.

Refused during capture (`CaptureError`, with the op and a hint), even on a CPU where nothing
would actually wait, because each is a host sync or a data-dependent shape on a GPU:
- `_HOST_READ_METHODS`: `.item()`, `.tolist()`, `.numpy()`, `__array__`, `bool(t)`, `int(t)`,
  `float(t)`, `complex(t)`, `operator.index(t)`, `repr(t)`/`str(t)`/`format(t)`.
- `_SYNC_OPS`: `aten._local_scalar_dense`, `aten.item`, `aten.is_nonzero`, `aten.equal`,
  `aten.allclose`, `aten.nonzero`, `aten.argwhere`, `aten.masked_select`, `aten._unique`,
  `aten._unique2`, `aten.unique_dim`, `aten.unique_consecutive`,
  `aten.unique_dim_consecutive`, `aten.bincount`.
- Conditionally: `aten.repeat_interleave` with a tensor of repeats and no `output_size`;
  `aten.index` / `aten.index_put(_)` / `aten._index_put_impl_` with a boolean or uint8 index
  (boolean-mask indexing); `aten._to_copy`, `aten.copy_`, `aten._copy_from`,
  `aten._copy_from_and_resize` that copy a non-CPU tensor to the CPU (`.cpu()`,
  `.to("cpu")`).
Also refused: a tensor that existed before capture and was reallocated or resized during it
(allocate persistent tensors at their final size; warm-up runs usually do), and a private
tensor resized after it was produced (except uninitialised allocations used as `out=`).

Replay runs under `torch.no_grad()` (or `torch.inference_mode()` when capture ran in
inference mode): a tape replays inference work; autograd history is not recorded.

torch.compile
- The recorder and the sync guard tell torch.compile to ignore them while it compiles
  (`ignore_compile_internals`), so a compiled callable runs its compiled code under capture
  instead of being refused as "a dispatch mode is active"; at run time the compiled code's
  dispatched ops are recorded like any others. Only dispatched ops can be recorded, so
  compile for the tape with `backend="eager"` (the traced graph, run op by op): inductor's
  generated kernels are not dispatched ops and would be missing from the tape, and
  aot_eager's functionalized custom-op calls (`auto_functionalized` higher-order ops) are
  refused by the recorder. A device graph records every kernel, so it takes any backend.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from capture.backends import CaptureError, recording

aten = torch.ops.aten


def _packets(*names: str) -> tuple[Any, ...]:
    # Looked up by name so that an op missing from an older torch is skipped, not an error.
    return tuple(p for p in (getattr(aten, n, None) for n in names) if p is not None)


_HINT_SCALAR = (
    "it reads a device value on the host; keep the value in a tensor and let later ops read it"
)
_HINT_BOOL = "it reads a device value on the host; use torch.where / a mask tensor instead"
_HINT_COMPARE = "it returns a host bool; compute the comparison into a tensor (torch.eq(...).all())"
_HINT_DATA_SHAPE = (
    "its output size depends on the data; use a fixed-size form (a mask, torch.where, topk, "
    "torch.nonzero_static)"
)
_HINT_MASK_INDEX = (
    "boolean-mask indexing needs nonzero (a host sync); use torch.where / masked_fill_ or "
    "integer indices of fixed length"
)
_HINT_TO_HOST = "copying a device tensor to the CPU waits for the device; keep the value on it"

# Ops refused unconditionally during capture: host syncs and data-dependent output shapes.
_SYNC_OPS: dict[Any, str] = {}
for _packet in _packets("_local_scalar_dense", "item"):
    _SYNC_OPS[_packet] = _HINT_SCALAR
for _packet in _packets("is_nonzero"):
    _SYNC_OPS[_packet] = _HINT_BOOL
for _packet in _packets("equal", "allclose"):
    _SYNC_OPS[_packet] = _HINT_COMPARE
for _packet in _packets(
    "nonzero",
    "argwhere",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
):
    _SYNC_OPS[_packet] = _HINT_DATA_SHAPE
for _packet in _packets("bincount"):
    _SYNC_OPS[_packet] = (
        "its output length depends on the largest value; scatter_add_ into a fixed-size tensor"
    )

_REPEAT_INTERLEAVE = _packets("repeat_interleave")
_MASK_INDEX_OPS = _packets("index", "index_put", "index_put_", "_index_put_impl_")
_TO_COPY = _packets("_to_copy")
_COPY_INTO_DST = _packets("copy_")  # copy_(self=dst, src)
_COPY_FROM = _packets("_copy_from", "_copy_from_and_resize")  # (self=src, dst)

# Uninitialised allocations: replay keeps the private tensor instead of re-running them.
_ALLOC_OPS = frozenset(
    _packets(
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
    )
)

# Tensor methods that read tensor data on the host without (on a CPU) dispatching an op.
_HOST_READ_METHODS: dict[Any, str] = {
    getattr(torch.Tensor, name): label
    for name, label in (
        ("item", ".item()"),
        ("tolist", ".tolist()"),
        ("numpy", ".numpy()"),
        ("__array__", "numpy conversion (__array__)"),
        ("__bool__", "bool(tensor)"),
        ("__int__", "int(tensor)"),
        ("__float__", "float(tensor)"),
        ("__complex__", "complex(tensor)"),
        ("__index__", "operator.index(tensor)"),
        ("__repr__", "repr/str of a tensor"),
        ("__format__", "formatting a tensor"),
    )
    if hasattr(torch.Tensor, name)
}


def _op_name(func: Any) -> str:
    return str(func)


def _bound_argument(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], name: str) -> Any:
    """The value of schema argument `name` as passed (None when absent)."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.name != name:
            continue
        if not argument.kwarg_only and position < len(args):
            return args[position]
        return kwargs.get(name)
    return None


def _is_mask(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _is_off_host(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def _is_host_device(device: object) -> bool:
    if not isinstance(device, (str, int, torch.device)):
        return False
    return torch.device(device).type == "cpu"


def check_dispatched_op(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Raise CaptureError when `func(*args, **kwargs)` is a host sync or a data-dependent shape.

    The deny-list is the module docstring's; it is applied before the op runs.
    """
    packet = func.overloadpacket
    hint = _SYNC_OPS.get(packet)
    if hint is None:
        if packet in _REPEAT_INTERLEAVE:
            repeats = _bound_argument(func, args, kwargs, "repeats")
            if isinstance(repeats, torch.Tensor) and (
                _bound_argument(func, args, kwargs, "output_size") is None
            ):
                hint = "with tensor repeats its output size depends on the data; pass output_size="
        elif packet in _MASK_INDEX_OPS:
            indices = _bound_argument(func, args, kwargs, "indices") or ()
            if any(_is_mask(index) for index in indices):
                hint = _HINT_MASK_INDEX
        elif packet in _TO_COPY:
            if _is_off_host(args[0]) and _is_host_device(kwargs.get("device")):
                hint = _HINT_TO_HOST
        elif packet in _COPY_INTO_DST:
            dst, src = args[0], args[1]
            if _is_off_host(src) and isinstance(dst, torch.Tensor) and dst.device.type == "cpu":
                hint = _HINT_TO_HOST
        elif packet in _COPY_FROM:
            src, dst = args[0], _bound_argument(func, args, kwargs, "dst")
            if _is_off_host(src) and isinstance(dst, torch.Tensor) and dst.device.type == "cpu":
                hint = _HINT_TO_HOST
    if hint is not None:
        raise CaptureError(
            f"{_op_name(func)} is not allowed during graph capture: {hint}. A device graph "
            "cannot capture a host sync or a data-dependent shape."
        )


# >0 while a dispatched op executes under a guard: the Python body of a custom op is the op
# author's kernel (a Triton launch, which under TRITON_INTERPRET reads tensors through numpy),
# not graph-level code, so host reads inside it are not the capture's business.
_ops_running = 0


@contextmanager
def _running_op() -> Iterator[None]:
    global _ops_running
    _ops_running += 1
    try:
        yield
    finally:
        _ops_running -= 1


class _HostReadGuard(TorchFunctionMode):
    """Refuses `_HOST_READ_METHODS`, which on a CPU never reach the dispatcher."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        try:
            label = None if _ops_running else _HOST_READ_METHODS.get(func)
        except TypeError:  # an unhashable callable cannot be one of the listed methods
            label = None
        if label is not None:
            raise CaptureError(
                f"{label} is not allowed during graph capture: {_HINT_SCALAR}. A device graph "
                "cannot capture a host read of tensor data."
            )
        return func(*args, **(kwargs or {}))


class _SyncGuard(TorchDispatchMode):
    """Applies `check_dispatched_op` to every op and runs it (`_run`); records nothing."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile'd callables run compiled under the guard, their dispatched ops
        # checked (and, under the recorder, recorded): see the module docstring. Without
        # this torch.compile refuses to run under the mode.
        return True

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        check_dispatched_op(func, args, kwargs)
        return self._run(func, args, kwargs)

    def _run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with _running_op():
            return func(*args, **kwargs)


@contextmanager
def host_sync_guard() -> Iterator[None]:
    """Refuse host syncs and data-dependent shapes (CaptureError) inside the block.

    The device backend wraps its capture in this so that both backends refuse the same
    things with the same message, before the device would invalidate the capture.
    """
    with _HostReadGuard(), _SyncGuard():
        yield


@dataclass(frozen=True)
class TensorSignature:
    """Where a tensor lives and how it is laid out: what a graph bakes in."""

    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSignature:
        return cls(
            tensor.data_ptr(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.device,
        )

    def describe(self) -> str:
        return (
            f"data_ptr=0x{self.data_ptr:x}, shape={self.shape}, stride={self.stride}, "
            f"dtype={self.dtype}, device={self.device}"
        )


_IMMUTABLE = (
    int,
    float,
    bool,
    complex,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
)


def _freeze(value: Any) -> Any:
    """A snapshot of a non-tensor argument; tensors are kept by identity."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, torch.Size):
        return torch.Size(value)
    if isinstance(value, list):
        return [_freeze(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_freeze(item) for item in value)
    if isinstance(value, dict):
        return {key: _freeze(item) for key, item in value.items()}
    if isinstance(value, torch.Generator):
        # Kept by identity on purpose: a device graph also advances its generator per replay.
        return value
    try:
        return copy.deepcopy(value)
    except Exception as exc:
        raise CaptureError(
            f"cannot snapshot an op argument of type {type(value).__name__} for the tape"
        ) from exc


def _tensor_arguments(
    func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(argument label, tensor) for every tensor argument, lists included."""
    schema_args = func._schema.arguments
    named = [
        (schema_args[i].name if i < len(schema_args) else f"#{i}", value)
        for i, value in enumerate(args)
    ]
    named.extend(kwargs.items())
    for label, value in named:
        if isinstance(value, torch.Tensor):
            yield label, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    yield f"{label}[{i}]", item


def _storage_key(tensor: torch.Tensor) -> int | None:
    """Identity of the tensor's storage (its StorageImpl), shared by all its views.

    Not data_ptr(): that is 0 for every meta tensor and every empty storage, which would make
    unrelated tensors look like aliases.
    """
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # storage-less tensors (sparse, subclasses)
        return None


class _Role(enum.Enum):
    PRIVATE = "private"  # fresh result: refreshed in place at replay
    VIEW = "view"  # aliases an argument without being it: re-run and checked at replay
    # A view whose base was resized later in the same capture (an `empty` used as `out=`):
    # re-run but not checked, since the recorded view keeps the layout it had before.
    STALE_VIEW = "stale_view"
    ALIAS = "alias"  # is one of the arguments (in-place / out= result): nothing to do
    VALUE = "value"  # not a tensor


@dataclass(frozen=True)
class TapeEntry:
    """One recorded op: what replay calls, and what it does with the results."""

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[Any, ...]
    roles: tuple[_Role, ...]
    skip_at_replay: bool

    @property
    def needs_results(self) -> bool:
        """Whether replay must look at what the op returns (private results, views)."""
        return any(role is _Role.PRIVATE or role is _Role.VIEW for role in self.roles)

    @property
    def name(self) -> str:
        """The op's name, e.g. "aten.mul.Tensor" or "graphidx.paged_mqa_logits.default"."""
        return _op_name(self.op)


@dataclass
class _Tracked:
    tensor: torch.Tensor
    signature: TensorSignature
    label: str
    resizable: bool = False


class _Recorder(_SyncGuard):
    """Checks and runs every dispatched op as `_SyncGuard` does, and records it; the state
    of one capture."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[TapeEntry] = []
        # Keyed by id(): the tape holds every tensor it saw, so ids cannot be reused.
        self.produced: set[int] = set()
        self.inputs: dict[int, _Tracked] = {}
        self.privates: dict[int, _Tracked] = {}
        self.views: list[tuple[int, int, TensorSignature]] = []

    def _run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        frozen_args = _freeze(tuple(args))
        frozen_kwargs = _freeze(dict(kwargs))
        position = len(self.entries)
        arguments = list(_tensor_arguments(func, args, kwargs))
        for label, tensor in arguments:
            key = id(tensor)
            if key not in self.produced and key not in self.inputs:
                self.inputs[key] = _Tracked(
                    tensor,
                    TensorSignature.of(tensor),
                    f"argument `{label}` of {_op_name(func)} (op #{position})",
                )

        result = super()._run(func, args, kwargs)
        outputs, _ = tree_flatten(result)
        roles = tuple(
            self._classify(func, position, index, output, arguments)
            for index, output in enumerate(outputs)
        )
        self.entries.append(
            TapeEntry(
                op=func,
                args=frozen_args,
                kwargs=frozen_kwargs,
                outputs=tuple(outputs),
                roles=roles,
                skip_at_replay=func.overloadpacket in _ALLOC_OPS,
            )
        )
        return result

    def _classify(
        self,
        func: Any,
        position: int,
        index: int,
        output: object,
        arguments: list[tuple[str, torch.Tensor]],
    ) -> _Role:
        if not isinstance(output, torch.Tensor):
            return _Role.VALUE
        if any(output is tensor for _, tensor in arguments):
            return _Role.ALIAS
        self.produced.add(id(output))
        storage = _storage_key(output)
        if storage is not None and any(storage == _storage_key(t) for _, t in arguments):
            self.views.append((position, index, TensorSignature.of(output)))
            return _Role.VIEW
        self.privates[id(output)] = _Tracked(
            output,
            TensorSignature.of(output),
            f"result of {_op_name(func)} (op #{position})",
            resizable=func.overloadpacket in _ALLOC_OPS,
        )
        return _Role.PRIVATE

    def finish(self, inference: bool) -> Tape:
        """Check what capture left behind and build the tape."""
        for tracked in self.inputs.values():
            now = TensorSignature.of(tracked.tensor)
            if now != tracked.signature:
                raise CaptureError(
                    f"the tensor first used as {tracked.label} was reallocated or resized "
                    f"during capture ({tracked.signature.describe()} -> {now.describe()}); "
                    "allocate persistent tensors at their final size before capture (run a "
                    "warm-up first)"
                )
        for tracked in self.privates.values():
            now = TensorSignature.of(tracked.tensor)
            if now != tracked.signature:
                if not tracked.resizable:
                    raise CaptureError(
                        f"the {tracked.label} was resized during capture "
                        f"({tracked.signature.describe()} -> {now.describe()}); replaying it "
                        "would not reproduce that layout"
                    )
                tracked.signature = now
        for position, index, signature in self.views:
            entry = self.entries[position]
            if TensorSignature.of(entry.outputs[index]) != signature:
                roles = list(entry.roles)
                roles[index] = _Role.STALE_VIEW
                self.entries[position] = dataclasses.replace(entry, roles=tuple(roles))
        return Tape(
            tuple(self.entries),
            tuple(self.inputs.values()),
            tuple(self.privates.values()),
            inference,
        )

    def clear(self) -> None:
        """Drop every reference (a failed capture frees what it took)."""
        self.entries.clear()
        self.produced.clear()
        self.inputs.clear()
        self.privates.clear()
        self.views.clear()


class Tape:
    """A recorded op list that replays like a device graph (see the module docstring)."""

    def __init__(
        self,
        entries: tuple[TapeEntry, ...],
        inputs: tuple[_Tracked, ...],
        privates: tuple[_Tracked, ...],
        inference: bool,
    ) -> None:
        self._entries = entries
        self._checked = inputs + privates
        self._inference = inference
        storages: dict[int, int] = {}
        for tracked in privates:
            key = _storage_key(tracked.tensor)
            if key is not None:
                storages[key] = tracked.tensor.untyped_storage().nbytes()
        self._num_bytes = sum(storages.values())

    @property
    def entries(self) -> tuple[TapeEntry, ...]:
        """The recorded ops, in replay order."""
        return self._entries

    @property
    def num_ops(self) -> int:
        """Number of recorded ops."""
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """Bytes of the storages of the tensors created during capture (graph-private)."""
        return self._num_bytes

    def op_names(self) -> list[str]:
        """The recorded ops' names, in order."""
        return [entry.name for entry in self._entries]

    def check_tensors(self) -> None:
        """Raise CaptureError when a tensor the tape references moved since capture."""
        for tracked in self._checked:
            now = TensorSignature.of(tracked.tensor)
            if now != tracked.signature:
                raise CaptureError(
                    f"the tensor first used as {tracked.label} moved after capture "
                    f"(captured {tracked.signature.describe()}, now {now.describe()}); a "
                    "graph reads the captured address, so persistent tensors must never be "
                    "reallocated (set_, resize_, .data =) after capture"
                )

    def replay(self) -> None:
        """Re-run the recorded ops on the current tensor contents (see module docstring)."""
        self.check_tensors()
        grad_context = torch.inference_mode() if self._inference else torch.no_grad()
        with grad_context:
            for position, entry in enumerate(self._entries):
                if entry.skip_at_replay:
                    continue
                result = entry.op(*entry.args, **entry.kwargs)
                if not entry.needs_results:
                    continue
                fresh, _ = tree_flatten(result)
                if len(fresh) != len(entry.outputs):
                    raise CaptureError(
                        f"{entry.name} (op #{position}) returned {len(fresh)} values at replay, "
                        f"{len(entry.outputs)} at capture"
                    )
                for role, recorded, new in zip(entry.roles, entry.outputs, fresh, strict=True):
                    if role is _Role.PRIVATE:
                        _refresh(entry, position, recorded, new)
                    elif role is _Role.VIEW:
                        _check_view(entry, position, recorded, new)


def _refresh(entry: TapeEntry, position: int, recorded: torch.Tensor, new: torch.Tensor) -> None:
    if new.shape != recorded.shape or new.dtype != recorded.dtype:
        raise CaptureError(
            f"{entry.name} (op #{position}) produced shape {tuple(new.shape)} {new.dtype} at "
            f"replay but {tuple(recorded.shape)} {recorded.dtype} at capture: its output "
            "shape depends on data, which a graph cannot capture"
        )
    recorded.copy_(new)


def _check_view(entry: TapeEntry, position: int, recorded: torch.Tensor, new: object) -> None:
    if not isinstance(new, torch.Tensor) or TensorSignature.of(new) != TensorSignature.of(recorded):
        raise CaptureError(
            f"view op {entry.name} (op #{position}) no longer aliases the memory it aliased at "
            "capture; its base moved"
        )


class TapePool:
    """The tape's stand-in for a graph memory pool: it tallies what its tapes hold."""

    def __init__(self) -> None:
        self.num_graphs = 0
        self.num_bytes = 0

    def add(self, tape: Tape) -> None:
        self.num_graphs += 1
        self.num_bytes += tape.num_bytes


class TapeBackend:
    """Captures callables into `Tape`s; works for tensors on any device."""

    name = "tape"

    def new_pool(self) -> TapePool:
        """A pool tally shared by the graphs of one cache."""
        return TapePool()

    def synchronize(self) -> None:
        """Wait for queued device work, when a GPU is in use; a no-op on CPU-only runs."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def warmup(self, fn: Callable[[], object]) -> None:
        """Run `fn` once eagerly."""
        fn()

    def capture(self, fn: Callable[[], object], pool: object | None) -> Tape:
        """Run `fn` once while recording it; the result replays like a device graph.

        Only inside `GraphCache.capture` (CaptureError otherwise). A capture that raises
        drops every reference it took.
        """
        if pool is not None and not isinstance(pool, TapePool):
            raise ValueError(f"pool={pool!r} is not a TapePool from TapeBackend.new_pool()")
        with recording(self.name):
            recorder = _Recorder()
            inference = torch.is_inference_mode_enabled()
            try:
                with _HostReadGuard(), recorder:
                    fn()
                tape = recorder.finish(inference)
            except BaseException:
                recorder.clear()
                raise
        if pool is not None:
            pool.add(tape)
        return tape


__all__ = [
    "Tape",
    "TapeBackend",
    "TapeEntry",
    "TapePool",
    "TensorSignature",
    "check_dispatched_op",
    "host_sync_guard",
]
