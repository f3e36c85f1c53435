"""Does one program per row stream 128 x 65536 float32 as fast as a read kernel does?

    python tools/device_stream_balance.py

The top-k's first phase streams each row in its own program (one per SM); earlier sessions
quoted it at ~13 us (replay times of tools/device_topk_phases.py) against ~9.3 us for the
kernel span of `graphidx bench`'s read of the same bytes. This times kernel spans with a
clean L2 (`graphidx.bench.kernel_span_us`) of a max over every row by:

- `static`: one program per row, 16 warps, 4096-column steps, DEPTH steps in flight (as the
  top-k's streaming pass), and records each program's duration (%globaltimer, one more run
  after an L2 flush);
- `dynamic`: 128 programs taking 16384-column chunks of any row from an atomic counter (the
  next chunk taken while the current one streams), in case SMs draw unequal bandwidth;
- `read`: `graphidx.ops.kernels.read.read_max_kernel`, 4096 x 4 per program (many programs).

Prints one table; needs a CUDA GPU.
"""

from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl
from probe_ptx import global_timer

from graphidx.bench import kernel_span_us
from graphidx.ops.kernels.read import read_max_kernel

ROWS, WIDTH, STEP, CHUNK = 128, 65536, 4096, 16384


@triton.jit
def _static_stream(src, out, times, n, STEP: tl.constexpr, DEPTH: tl.constexpr):
    """out[row] = max of the row; DEPTH (2 or 3) steps of loads in flight, unrolled so each
    buffer is refilled in place."""
    start = global_timer()
    row = tl.program_id(0)
    base = src + row.to(tl.int64) * n
    col = tl.arange(0, STEP)
    last = n - STEP
    best = tl.full([STEP], float("-inf"), tl.float32)
    a = tl.load(base + col)
    b = tl.load(base + STEP + col)
    if DEPTH == 2:
        for first in range(0, n, 2 * STEP):
            best = tl.maximum(best, a)
            a = tl.load(base + tl.minimum(first + 2 * STEP, last) + col)
            best = tl.maximum(best, b)
            b = tl.load(base + tl.minimum(first + 3 * STEP, last) + col)
    else:
        c = tl.load(base + 2 * STEP + col)
        for first in range(0, n - 3 * STEP + 1, 3 * STEP):
            best = tl.maximum(best, a)
            a = tl.load(base + tl.minimum(first + 3 * STEP, last) + col)
            best = tl.maximum(best, b)
            b = tl.load(base + tl.minimum(first + 4 * STEP, last) + col)
            best = tl.maximum(best, c)
            c = tl.load(base + tl.minimum(first + 5 * STEP, last) + col)
        best = tl.maximum(best, a)  # 16 steps = 5 x 3 + 1: the last one sits in a
    tl.store(out + row, tl.max(best))
    tl.store(times + row, global_timer() - start)


@triton.jit
def _dynamic_stream(src, out, counter, n, total, STEP: tl.constexpr, CHUNK: tl.constexpr):
    """out[chunk] = max of each CHUNK-column chunk (row-major numbering), chunks taken from
    `counter` by whichever program asks first."""
    col = tl.arange(0, STEP)
    chunk = tl.atomic_add(counter, 1)
    while chunk < total:
        following = tl.atomic_add(counter, 1)
        base = src + chunk.to(tl.int64) * CHUNK
        best = tl.full([STEP], float("-inf"), tl.float32)
        for step in tl.static_range(CHUNK // STEP):
            best = tl.maximum(best, tl.load(base + step * STEP + col))
        tl.store(out + chunk, tl.max(best))
        chunk = following


def main() -> None:
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    logits = torch.randn(ROWS, WIDTH, device=device)
    want = logits.amax(dim=1)
    out = torch.empty(ROWS, device=device)
    times = torch.empty(ROWS, dtype=torch.int64, device=device)
    flush = torch.ones(64 << 20, device=device)  # 256 MB, five times the L2
    sink = torch.empty((), device=device)
    rows = []
    for depth in (2, 3):

        def static(depth: int = depth) -> None:
            _static_stream[(ROWS,)](logits, out, times, WIDTH, STEP=STEP, DEPTH=depth,
                                    num_warps=16)  # fmt: skip

        static()
        torch.cuda.synchronize()
        ok = torch.equal(out, want)
        span = kernel_span_us(static)
        torch.sum(flush, dim=0, out=sink)  # an L2 holding none of the logits, as in the span
        static()
        torch.cuda.synchronize()
        each = sorted(times.double().div(1e3).tolist())
        spread = f"{each[0]:.1f} / {statistics.median(each):.1f} / {each[-1]:.1f}"
        rows.append((f"static, {depth} steps in flight", span, ok,
                     f"programs min / median / max {spread} us"))  # fmt: skip
    chunks = ROWS * WIDTH // CHUNK
    partial = torch.empty(chunks, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for programs, warps in ((ROWS, 16), (sms, 16), (2 * sms, 8)):

        def dynamic(programs: int = programs, warps: int = warps) -> None:
            counter.zero_()
            _dynamic_stream[(programs,)](logits, partial, counter, WIDTH, chunks, STEP=STEP,
                                        CHUNK=CHUNK, num_warps=warps)  # fmt: skip

        dynamic()
        torch.cuda.synchronize()
        ok = torch.equal(partial.view(ROWS, -1).amax(dim=1), want)
        rows.append((f"dynamic, {programs} programs x {warps} warps", kernel_span_us(dynamic),
                     ok, "includes a 4-byte memset"))  # fmt: skip
    read_partial = torch.empty(ROWS * WIDTH // (4096 * 4), device=device)

    def read() -> None:
        read_max_kernel[(read_partial.numel(),)](logits, read_partial, logits.numel(),
                                                 BLOCK=4096, STEPS=4, num_warps=8)  # fmt: skip

    read()
    torch.cuda.synchronize()
    ok = torch.equal(read_partial.view(ROWS, -1).amax(dim=1), want)
    rows.append(("read_max_kernel 4096 x 4, 8 warps", kernel_span_us(read), ok, ""))
    print("\n| stream | kernel us | maxima OK | notes |")
    print("| --- | ---: | --- | --- |")
    for name, span, ok, notes in rows:
        print(f"| {name} | {span} | {ok} | {notes} |")


if __name__ == "__main__":
    main()
