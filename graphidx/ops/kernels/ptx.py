"""Inline-PTX memory operations for the NVIDIA kernels: stores issued from a tensor's own
layout, byte loads into whole registers, L1 / L2 prefetches, and the grid dependency wait of
programmatic dependent launch (`wait_for_prior_kernels`).

Each helper takes `PTX`, a constexpr that is true when the kernel is compiled for an NVIDIA GPU
(`operand_mode() == OPERANDS_BF16X2`). Without it (ROCm, the interpreter) the store is a plain
`tl.store`, the load a plain `tl.load` and the prefetch does nothing, so results never depend
on it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.target_info import cuda_capability_geq

from graphidx.ops.backend import triton_interpreted

_PREDICATED = "{{ .reg .pred p; setp.ne.b32 p, $2, 0; @p {} mov.b32 $0, 0; }}"
STORE_ASM = tl.constexpr(_PREDICATED.format("st.global.b32 [$1], $3;"))
PREFETCH_L1_ASM = tl.constexpr(_PREDICATED.format("prefetch.global.L1 [$1];"))
PREFETCH_L2_ASM = tl.constexpr(_PREDICATED.format("prefetch.global.L2 [$1];"))
"""Each instruction runs only where operand $2 (the mask) is nonzero; $0 is a dummy result."""
LOAD_U8_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, $3; @p ld.global.u8 $0, [$1]; }"
)
"""$0 = the byte at $1 zero-extended where the mask $2 is nonzero, else $3."""
COMPILED = tl.constexpr(not triton_interpreted())
"""Whether the kernels are compiled (not interpreted), as Triton decided when it decorated
them: the interpreter knows no `griddepcontrol`, even where the GPU beside it has one."""


@triton.jit
def store_b32(ptrs, values, mask, PTX: tl.constexpr):
    """`tl.store(ptrs, values, mask=mask)` for 32-bit values (float32, int32, uint32), issued
    by inline PTX from the threads that hold them when PTX: for a reduction's or an MMA's
    result Triton would first move the values into a coalesced layout through shared memory,
    with barriers. Threads holding the same element store the same value, which is harmless."""
    bits = values.to(tl.int32, bitcast=True)
    if PTX:
        tl.inline_asm_elementwise(
            STORE_ASM,
            "=r,l,r,r",
            [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32), bits],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(ptrs.to(tl.pointer_type(tl.int32), bitcast=True), bits, mask=mask)


@triton.jit
def load_byte_b32(ptrs, mask, other, PTX: tl.constexpr):
    """`tl.load(ptrs, mask=mask, other=other).to(tl.int32)` for uint8 `ptrs` (mask None: every
    byte), loaded by inline PTX straight into a 32-bit register each when PTX. A uint8 tensor
    carried to a later loop iteration is first packed into shared registers (PRMT), and the
    packing waits for the load where it is issued; one register per byte lets a prefetch stay
    in flight until its use. Only for memory no thread writes while the kernel runs, and
    only where every address (every masked one: where the mask holds) is valid wherever the
    operands are computed: the asm is marked pure, so copies of one element share one load
    and the compiler may move it, even ahead of a loop that runs no iteration."""
    if PTX:
        if mask is None:
            loaded = tl.inline_asm_elementwise(
                "ld.global.u8 $0, [$1];",
                "=r,l",
                [ptrs.to(tl.int64, bitcast=True)],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
        else:
            flags = mask.to(tl.int32)
            loaded = tl.inline_asm_elementwise(
                LOAD_U8_ASM,
                "=r,l,r,r",
                [ptrs.to(tl.int64, bitcast=True), flags, tl.zeros_like(flags) + other],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
    elif mask is None:
        loaded = tl.load(ptrs).to(tl.int32)
    else:
        loaded = tl.load(ptrs, mask=mask, other=other).to(tl.int32)
    return loaded


@triton.jit
def _prefetch_lines(ASM: tl.constexpr, ptrs, mask, PTX: tl.constexpr):
    """Issue the prefetch instruction ASM (`_PREDICATED` form) for `ptrs` where `mask`."""
    if PTX:
        tl.inline_asm_elementwise(
            ASM,
            "=r,l,r",
            [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def prefetch_l1(ptrs, mask, PTX: tl.constexpr):
    """Ask for the cache lines holding `ptrs` (where `mask`) to be brought into L1 ahead of
    the loads that will read them: `prefetch.global.L1`, which holds no register and is never
    waited on. Pass only addresses the kernel may read. A no-op without PTX."""
    _prefetch_lines(PREFETCH_L1_ASM, ptrs, mask, PTX)


@triton.jit
def prefetch_l2(ptrs, mask, PTX: tl.constexpr):
    """`prefetch_l1` into L2 only (`prefetch.global.L2`): for lines wanted a tile or more later,
    which L1 might not keep that long. A no-op without PTX."""
    _prefetch_lines(PREFETCH_L2_ASM, ptrs, mask, PTX)


@triton.jit
def wait_for_prior_kernels():
    """The first statement of every graphidx kernel. On NVIDIA sm_90+ (`griddepcontrol.wait`):
    wait until the kernels before this one in the stream have finished and their writes are
    visible. Launched with programmatic dependent launch (`graphidx.ops.kernels.launch`), a
    kernel is set up while its predecessor still runs and its programs start as soon as the
    predecessor's end, which shortens the gap between two kernels of a graph; launched
    without it, the wait returns at once. Every program waits before it reads or writes
    anything, even one that then exits, so kernel N finishing still means that kernel N - 1
    finished. No kernel signals its dependents early (`griddepcontrol.launch_dependents`):
    waiting programs then sit on the SMs beside the running kernel, and on the H200 that
    slowed a candidate gather by ~10% (docs/perf-notes.md). Nothing elsewhere (ROCm, the
    interpreter, older GPUs)."""
    if COMPILED and cuda_capability_geq(9, 0):
        tl.extra.cuda.gdc_wait()


__all__ = ["load_byte_b32", "prefetch_l1", "prefetch_l2", "store_b32", "wait_for_prior_kernels"]
