"""H200 script: do bf16 subnormals survive the two steps of the GPU logits path?

    python tools/device_subnormals.py

MXFP4 elements with scale byte 0 or 1 are below 2**-126, subnormal in bf16. On the GPU the
logits kernels (a) make key operands with `fma.rn.bf16x2` and (b) multiply bf16 operands on
the tensor cores (`tl.dot`, wgmma on sm_90). This checks each step on its own with values
whose exact answer is known, and prints which one (if any) flushes subnormals to zero.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _fma_bf16x2(x_ptr, f_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    f = tl.load(f_ptr + i)
    y = tl.inline_asm_elementwise(
        "{ .reg .b32 nz; mov.b32 nz, 0x80008000; fma.rn.bf16x2 $0, $1, $2, nz; }",
        "=r,r,r",
        [x, f],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )
    tl.store(out_ptr + i, y)


@triton.jit
def _dot(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m = tl.arange(0, M)[:, None]
    n = tl.arange(0, N)[None, :]
    k = tl.arange(0, K)
    a = tl.load(a_ptr + m * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n)
    tl.store(out_ptr + m * N + n, tl.dot(a, b))


def bf16_bits(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).view(torch.int16)


def check_fma(device: torch.device) -> bool:
    # Pairs (x, factor): x * factor is exact; results 2**-128, 2**-127, 0.5 * 2**-126, normal.
    xs = [2.0**-126, 2.0**-120, 2.0**-127, 1.0]
    fs = [0.25, 2.0**-7, 1.0, 2.0**-126]
    x = bf16_bits(xs).to(torch.int32) & 0xFFFF
    f = bf16_bits(fs).to(torch.int32) & 0xFFFF
    pack = lambda t: (t | (t << 16)).to(device)  # noqa: E731 - both halves alike
    out = torch.empty(4, dtype=torch.int32, device=device)
    _fma_bf16x2[(1,)](pack(x), pack(f), out, N=4)
    got = (out.cpu() & 0xFFFF).to(torch.int16).view(torch.bfloat16).float()
    want = torch.tensor([a * b for a, b in zip(xs, fs, strict=True)], dtype=torch.float32)
    ok = torch.equal(got, want)
    print(f"fma.rn.bf16x2 subnormal results: got {got.tolist()} want {want.tolist()}: "
          f"{'kept' if ok else 'FLUSHED'}")  # fmt: skip
    return ok


def check_dot(device: torch.device) -> bool:
    m = n = 64
    k = 32
    a = torch.zeros(m, k)
    a[:, 0] = 2.0**-127  # subnormal in bf16 and fp32
    a[:, 1] = 2.0**-130
    b = torch.zeros(k, n)
    b[0, :] = 2.0**100
    b[1, :] = 2.0**100
    out = torch.empty(m, n, device=device)
    _dot[(1,)](a.to(device, torch.bfloat16), b.to(device, torch.bfloat16), out, M=m, N=n, K=k)
    want = 2.0**-27 + 2.0**-30
    got = float(out[0, 0])
    ok = got == want
    print(f"tl.dot with bf16 subnormal A: got {got!r} want {want!r}: "
          f"{'kept' if ok else 'FLUSHED'}")  # fmt: skip
    return ok


def main() -> int:
    device = torch.device("cuda")
    results = [check_fma(device), check_dot(device)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
