"""H200 script: where does the run-to-run spread of the small launches come from?

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 50 > clocks.csv &
    python tools/device_spread.py

The skewed scheduled decode and the split top-k measured up to 1.7x apart between cases of
one bench run (BENCHMARKS.md), on the same shapes and configs. This times both, each on one
input, several times in one process: once per placement of their buffers (a pad allocation
of a different size before each input is made) and several times per placement. Each line
carries a wall-clock stamp to line up with the SM clock log. If the times move with the
placement and not within it, the buffers' addresses matter; if they move with the clock
log, the clock does. The second figure set times back-to-back launches with no L2 flush in
between (CUDA events over 20 launches, median of 5), as a serving loop runs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from graphidx.bench import random_block_table, random_kv_cache, random_queries, time_us
from graphidx.ops.kernels import logits as triton_logits
from graphidx.ops.kernels import topk as triton_topk
from graphidx.ops.schedule import allocate_schedule, build_decode_schedule

PADS = (0, 4096, 1 << 20, (16 << 20) + 4096, (64 << 20) + 12288)
REPEATS = 3


def skewed_decode(device: torch.device) -> Callable[[], None]:
    """The bench's skewed step: one 128K-key request and 63 of 1K, 64 heads, next_n 2."""
    contexts = [131072] + [1024] * 63
    next_n, heads, page_entries = 2, 64, 64
    rows = len(contexts) * next_n
    table, pages = random_block_table(contexts, page_entries, device)
    kv = random_kv_cache(pages, heads, 128, page_entries, device)
    q, q_scale, weights = random_queries(rows, heads, 128, device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    ends = [c - (next_n - 1 - j) for c in contexts for j in range(next_n)]
    row_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    out = torch.empty((rows, max(contexts)), device=device)
    schedule = allocate_schedule(len(contexts), max(contexts), device)
    build_decode_schedule(row_ends, schedule, next_n=next_n, backend="triton")
    return lambda: triton_logits.paged_mqa_logits(
        q, q_scale, kv, weights, context_lens, table, row_ends, out, next_n=next_n,
        schedule=schedule, page_entries=page_entries,
    )  # fmt: skip


def split_topk(device: torch.device) -> Callable[[], None]:
    """The bench's top-k shape, 128 rows x 65536 columns, k 512, split P = 4."""
    logits = torch.randn(128, 65536, device=device)
    lengths = torch.full((128,), 65536, dtype=torch.int32, device=device)
    out = torch.empty((128, 512), dtype=torch.int32, device=device)
    config = triton_topk.split_config(512, 4)
    return lambda: triton_topk.topk_per_row(logits, lengths, 512, out, config=config)


def back_to_back_us(fn: Callable[[], None], launches: int = 20, samples: int = 5) -> float:
    """Median over `samples` of the mean time of `launches` back-to-back calls (no flush)."""
    times = []
    for _ in range(samples):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(launches):
            fn()
        end.record()
        end.synchronize()
        times.append(1e3 * begin.elapsed_time(end) / launches)
    return sorted(times)[samples // 2]


def main() -> int:
    device = torch.device("cuda")
    torch.manual_seed(0)
    start = time.time()
    for name, make in (("skewed decode", skewed_decode), ("top-k 512", split_topk)):
        for pad_bytes in PADS:
            pad = torch.empty(pad_bytes + 1, dtype=torch.uint8, device=device)
            fn = make(device)
            fn()
            torch.cuda.synchronize(device)
            times = [time_us(fn) for _ in range(REPEATS)]
            times += [back_to_back_us(fn) for _ in range(REPEATS)]
            stamp = time.strftime("%H:%M:%S", time.gmtime())
            print(
                f"{stamp} +{time.time() - start:6.1f}s {name:>13} pad {pad_bytes:>9}: "
                + " ".join(f"{t:6.1f}" for t in times[:REPEATS])
                + " us flushed; "
                + " ".join(f"{t:6.1f}" for t in times[REPEATS:])
                + " us back to back",
                flush=True,
            )
            del fn, pad
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
