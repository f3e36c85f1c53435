"""Triton implementations of the graphidx ops (the `triton` backend, docs/contract.md section 5).

One module per op family, each with its kernels and their launchers side by side:
`logits` (dense paged MQA logits), `gather` (compact logits over a candidate pool and the
remap of its top-k), `topk` (exact per-row top-k; `topk_radix` its radix select for one very
wide row, `topk_select` the selection helpers both share), `candidates` (pool resolution and
the dense candidate mask), `schedule` (the device-built decode work schedule); `mxfp4_tl` holds the
in-kernel MXFP4 decoding and page addressing that every logits kernel shares.

The custom ops in `graphidx.ops` import these modules lazily, so importing graphidx never needs
Triton. Launchers read only shapes and strides on the host (never device values), so every launch
is capturable in a CUDA graph and replays correctly at any data.
"""

from __future__ import annotations

import functools

import torch

from graphidx.ops.backend import device_capability, triton_interpreted


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


OPERANDS_FP32 = 0
"""Tiles stay float32 and `tl.dot` runs in IEEE fp32: the interpreter, whose bf16 dot is
unreliable (every operand value is exact in fp32 too, so the products are the same)."""
OPERANDS_BF16 = 1
"""Tiles decode in float32 and are rounded to bf16 (exactly) for the tensor cores: portable
Triton, used on ROCm."""
OPERANDS_BF16X2 = 2
"""Key tiles decode straight to bf16 pairs with packed PTX arithmetic (`fma.rn.bf16x2`): about
half the decode instructions of OPERANDS_BF16; NVIDIA sm_80+ only."""


def operand_mode() -> int:
    """How the logits kernels turn decoded MXFP4 tiles into tensor-core operands (a kernel
    constexpr): OPERANDS_FP32 under the interpreter, OPERANDS_BF16X2 on NVIDIA GPUs,
    OPERANDS_BF16 elsewhere (ROCm). A property of the platform, never of the data."""
    if triton_interpreted():
        return OPERANDS_FP32
    if torch.version.hip is not None:
        return OPERANDS_BF16
    return OPERANDS_BF16X2


def require_bf16_tensor_cores(device: torch.device) -> None:
    """ValueError unless the logits kernels can run on `device`: bf16 tensor cores and
    `fma.rn.bf16x2` need NVIDIA compute capability 8.0 or newer (a host constant)."""
    if device.type != "cuda" or torch.version.hip is not None or triton_interpreted():
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if device_capability(index) < (8, 0):
        raise ValueError(
            f"the triton logits kernels need compute capability >= 8.0 (bf16 tensor cores), "
            f"got {device_capability(index)} on {device}"
        )


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


__all__ = [
    "OPERANDS_BF16",
    "OPERANDS_BF16X2",
    "OPERANDS_FP32",
    "multiprocessor_count",
    "next_power_of_2",
    "operand_mode",
    "require_bf16_tensor_cores",
]
