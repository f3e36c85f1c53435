"""A bandwidth yardstick, not an op: one pass that reads a float32 tensor once and writes the
max of each program's chunk (the bench's `one read` case, the measured "one read of the
logits" the top-k is compared with)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def read_max_kernel(src, partial, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """partial[p] = max of src's elements [p * BLOCK * STEPS, (p + 1) * BLOCK * STEPS) below
    n (-inf where the chunk is empty); launch cdiv(n, BLOCK * STEPS) programs."""
    start = tl.program_id(0).to(tl.int64) * (BLOCK * STEPS)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for step in range(STEPS):
        offs = start + step * BLOCK + tl.arange(0, BLOCK)
        best = tl.maximum(best, tl.load(src + offs, mask=offs < n, other=float("-inf")))
    tl.store(partial + tl.program_id(0), tl.max(best, axis=0))
