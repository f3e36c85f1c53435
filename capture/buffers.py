"""Persistent named tensors that captured graphs read and write.

A graph bakes in tensor addresses, so everything that changes per step lives in a buffer
allocated once at its maximum size; a step writes its values into the first rows in place
and the graph reads `view(name, rows)`. `fingerprint()` lets `GraphCache` check before every
replay that no buffer was reallocated since capture (`addresses()` names a moved one);
`freeze()` (done by `GraphCache` at the first capture) forbids adding buffers afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


class StaticBuffers:
    """Named persistent tensors on one device, each allocated once at its maximum size."""

    def __init__(self, device: torch.device | str | int) -> None:
        """`device`: where every buffer lives (anything `torch.device` accepts)."""
        self._device = torch.device(device)
        self._tensors: dict[str, torch.Tensor] = {}
        self._in_order: list[torch.Tensor] = []
        self._frozen = False

    @property
    def device(self) -> torch.device:
        """The device of every buffer."""
        return self._device

    @property
    def frozen(self) -> bool:
        """True once `freeze()` ran: no buffer can be added any more."""
        return self._frozen

    def add(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        fill: float | int | bool | None = 0,
    ) -> torch.Tensor:
        """Allocate buffer `name` of `shape` (rows first) and `dtype`, filled with `fill`.

        `fill=None` leaves it uninitialised. Returns the full tensor. ValueError for a
        duplicate or empty name, a shape that is not a non-empty sequence of ints >= 0, a
        non-dtype, or when the buffers are frozen.
        """
        if self._frozen:
            raise ValueError(
                f"cannot add buffer name={name!r}: the buffers are frozen (a graph was captured "
                "and addresses must not change); add every buffer before the first capture"
            )
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} must be a non-empty str")
        if name in self._tensors:
            raise ValueError(f"name={name!r} is already a buffer")
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not shape:
            raise ValueError(f"shape={shape!r} of buffer {name!r} must be a non-empty sequence")
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise ValueError(f"shape={shape!r} of buffer {name!r} must hold ints >= 0")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype={dtype!r} of buffer {name!r} must be a torch.dtype")
        size = tuple(shape)
        if fill is None:
            tensor = torch.empty(size, dtype=dtype, device=self._device)
        else:
            tensor = torch.full(size, fill, dtype=dtype, device=self._device)
        self._tensors[name] = tensor
        self._in_order.append(tensor)
        return tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        """The full tensor of buffer `name` (KeyError naming the known buffers otherwise)."""
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(
                f"no buffer named {name!r}; buffers are {sorted(self._tensors)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def view(self, name: str, length: int) -> torch.Tensor:
        """The first `length` rows of buffer `name`: a view, same address as the buffer.

        ValueError when `length` is negative or above the buffer's row count.
        """
        tensor = self[name]
        rows = tensor.shape[0]
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= rows:
            raise ValueError(
                f"length={length!r} for buffer {name!r} must be an int in [0, {rows}] "
                f"(its max rows)"
            )
        return tensor[:length]

    def names(self) -> list[str]:
        """Buffer names in the order they were added."""
        return list(self._tensors)

    def total_bytes(self) -> int:
        """Bytes of all buffers together."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def addresses(self) -> dict[str, int]:
        """`data_ptr()` of every buffer, by name: what a captured graph depends on."""
        return {name: t.data_ptr() for name, t in self._tensors.items()}

    def fingerprint(self) -> tuple[int, ...]:
        """`data_ptr()` of every buffer in the order added: `addresses()` without the names,
        cheap enough to compare before every replay."""
        return tuple(map(torch.Tensor.data_ptr, self._in_order))

    def freeze(self) -> None:
        """Forbid `add` from now on (idempotent)."""
        self._frozen = True


__all__ = ["StaticBuffers"]
