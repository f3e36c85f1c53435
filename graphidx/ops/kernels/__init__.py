"""Triton implementations of the graphidx ops (the `triton` backend, SPEC section 5).

One module per op family, each with its kernels and their launchers side by side:
`logits` (dense paged MQA logits), `gather` (compact logits over a candidate pool and the
remap of its top-k), `topk` (exact per-row top-k), `candidates` (pool resolution and the dense
candidate mask), `schedule` (the device-built decode work schedule); `mxfp4_tl` holds the
in-kernel MXFP4 decoding and page addressing that every logits kernel shares.

The custom ops in `graphidx.ops` import these modules lazily, so importing graphidx never needs
Triton. Launchers read only shapes and strides on the host (never device values), so every launch
is capturable in a CUDA graph and replays correctly at any data.
"""

from __future__ import annotations

import functools

import torch

from graphidx.ops.backend import triton_interpreted


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def dot_in_fp32() -> bool:
    """True when tile products must use fp32 operands instead of bf16.

    The Triton interpreter mishandles bf16 `tl.dot` operands; every operand value here is an
    e2m1 element times a power of two, exact in bf16 and fp32 alike, so fp32 gives the same
    products there.
    """
    return triton_interpreted()


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors (CUs) of `device`; 4 on the CPU under the interpreter.

    A host constant of the device, never of the data: persistent grids sized from it keep a
    captured graph valid for every later step.
    """
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


__all__ = ["dot_in_fp32", "multiprocessor_count", "next_power_of_2"]
