"""Inline-PTX reads for the device tools' timing probes (NVIDIA only, not used by graphidx):
the global nanosecond timer and the SM a program runs on."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def global_timer():
    """%globaltimer: nanoseconds, comparable across the programs of a launch."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [tl.zeros([], tl.int32)], dtype=tl.int64,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def sm_id():
    """%smid: the multiprocessor running this program."""
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r,r", [tl.zeros([], tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip
