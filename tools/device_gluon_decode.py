"""H200 script: the warp-specialized Gluon decode kernel against the Triton one, checked and timed.

    python tools/device_gluon_decode.py

Dense decode H64 (64 seqs x 16K keys, 64-slot pages) and H32 (64 x 64K, 128-slot pages),
next_n 2: runs the Triton kernel (default config) and each Gluon variant on the same inputs,
checks every Gluon output against the Triton one (`graphidx.bench.compare`: same NaN and
inf pattern, values to float32 rounding) and against the torch reference on 4 seqs, then
times each as CUDA-graph replays with a clean L2. Prints a table last.
"""

from __future__ import annotations

import functools
import sys

import torch

from graphidx.bench import (
    compare,
    random_block_table,
    random_kv_cache,
    random_queries,
    time_case,
)
from graphidx.ops import paged_mqa_logits
from graphidx.ops.kernels import logits as triton_logits
from graphidx.ops.kernels import logits_hopper_ws as logits_hopper

CASES = {"H64": (64, 16384, 64), "H32": (32, 65536, 128)}
VARIANTS = {
    "nbuf 2 r128": {"nbuf": 2, "max_registers": 128},
    "nbuf 3 r128": {"nbuf": 3, "max_registers": 128},
    "nbuf 2 r168": {"nbuf": 2, "max_registers": 168},
}


def main() -> int:
    device = torch.device("cuda")
    lines = []
    failed = False
    for name, (heads, keys, page_entries) in CASES.items():
        contexts = [keys] * 64
        table, pages = random_block_table(contexts, page_entries, device)
        kv = random_kv_cache(pages, heads, 128, page_entries, device)
        q, q_scale, weights = random_queries(128, heads, 128, device)
        ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
        ends = torch.tensor([c - 1 + j for c in contexts for j in range(2)], dtype=torch.int32,
                            device=device)  # fmt: skip
        args = (q, q_scale, kv, weights, ctx, table, ends)
        want = torch.full((128, keys), float("nan"), device=device)

        triton_run = functools.partial(
            triton_logits.paged_mqa_logits, *args, want, next_n=2, page_entries=page_entries
        )
        triton_run()
        ref = torch.full((8, keys), float("nan"), device=device)
        paged_mqa_logits(q[:8], q_scale[:8], kv, weights[:8], ctx[:4], table[:4], ends[:8], ref,
                         next_n=2, backend="reference")  # fmt: skip
        base_us, _ = time_case(triton_run)
        lines.append(f"{name} triton        {base_us:8.1f} us  {compare(want[:8], ref)}")
        for label, options in VARIANTS.items():
            got = torch.full_like(want, float("nan"))

            run = functools.partial(
                logits_hopper.decode_logits, *args, got, page_entries=page_entries, **options
            )

            try:
                run()
                torch.cuda.synchronize()
                check = compare(got, want)
                check_ref = compare(got[:8], ref)
                us, _ = time_case(run)
            except Exception as err:  # report and go on
                check, check_ref, us = f"FAIL {err!r}"[:200], "-", 0.0
            failed |= check != "OK" or check_ref != "OK"
            speedup = base_us / us if us else 0.0
            lines.append(f"{name} gluon {label:10} {us:8.1f} us  vs triton {check}; "
                         f"vs ref {check_ref}  ({speedup:.2f}x)")  # fmt: skip
            print(lines[-1], flush=True)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
