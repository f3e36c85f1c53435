"""H200 script for compute-sanitizer: a padded and a ragged step through every Triton kernel.

    compute-sanitizer --tool memcheck python tools/device_sanitize.py [--heads 64]

Small shapes (the sanitizer slows kernels down a hundredfold) with the real head counts:
a V4.1-like stack (candidate source + 2 consumers, 32 heads x 128 or `--heads`, next_n 2:
64 heads take the decode kernels' N = 128 configs, halves and the register cap) captures two
decode sizes on device graphs, then runs (1) a uniform decode step padded up to the next
capture size and replayed, (2) a ragged speculative decode step (eager), (3) a mixed
prefill + decode step (eager, prefill chunks, gather launches). Each replayed or eager
top-k is compared with the unpadded eager run. Prints one line per step and exits non-zero
on a mismatch; the sanitizer reports any illegal access itself.
"""

from __future__ import annotations

import sys

import torch

from capture import CaptureSizes
from graphidx.config import IndexerConfig
from graphidx.runner import IndexerGraphRunner, IndexerStack
from graphidx.testing import StepGenerator, check_replay


def main() -> int:
    # `--cpu` runs the same steps on the tape, to check the script itself without a GPU.
    device = torch.device("cpu" if "--cpu" in sys.argv else "cuda")
    heads = int(sys.argv[sys.argv.index("--heads") + 1]) if "--heads" in sys.argv else 32
    config = IndexerConfig.cpu_demo(
        num_heads=heads,
        head_dim=128,
        block_size=64,
        max_model_len=4096,
        candidate_topk_blocks=16,
        max_num_seqs=8,
        max_num_batched_tokens=512,
    )
    stack = IndexerStack(candidate_source=True, consumers=2)
    gen = StepGenerator(config, stack, num_pages=256, device=device, seed=5, max_context=3000)
    runner = IndexerGraphRunner(
        config,
        stack,
        gen.kv_caches(),
        device,
        graph_backend="tape" if device.type == "cpu" else "device",
        capture_sizes=CaptureSizes([4, 16], max_size=16, uniform_query_len=config.next_n),
    )
    runner.capture()
    failures = 0
    for kind in ("decode", "ragged", "mixed"):
        case = gen.case(kind)
        while kind == "decode" and case.batch.num_reqs not in (3, 5, 6, 7):
            case = gen.case(kind)  # 6..14 rows: padded up to the 16-row graph
        report = check_replay(runner, [case])
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(
            f"{kind}: {case.batch.num_reqs} requests, {case.num_real_tokens} rows, "
            f"replayed={report.replayed}, mismatches={len(report.mismatches)}",
            flush=True,
        )
        failures += len(report.mismatches)
    print(f"{failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
