"""H200 script: the runner on device graphs — replay harness, step benchmark, capture cost.

    python tools/device_runner.py [--cases 1000] [--context 8192] [--out DIR]

1. `graphidx replay-check --backend device` over the harness shapes (`--cases` cases).
2. A decode step of a DeepSeek-V4.1-Flash-shaped indexer stack (candidate source + 3
   consumers, 32 heads, next_n 2, top-512, pool 2048 x 8) for batch 1..256 requests of
   `--context` tokens: the runner's full `step()` replayed vs eager (host build, copies and
   sync included), and the bare graph replay timed with CUDA events; capture seconds and
   graph memory per captured size. Prints a table last and writes JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from capture import CaptureSizes
from graphidx.batch import StepBatch
from graphidx.cli.replay_check import run_replay_check
from graphidx.config import IndexerConfig, cdiv
from graphidx.runner import IndexerGraphRunner, IndexerStack
from graphidx.testing import random_kv_cache, random_layer_input

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _median_ms(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _event_ms(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_step(context: int, repeat: int) -> dict[str, object]:
    device = torch.device("cuda")
    config = IndexerConfig.deepseek_v41_flash(max_num_seqs=256, max_model_len=max(context, 4096))
    stack = IndexerStack(candidate_source=True, consumers=3)
    pages_per_req = cdiv(context // config.compress_ratio, config.page_entries)
    num_pages = 256 * pages_per_req
    gen = torch.Generator().manual_seed(0)
    caches = [random_kv_cache(config, num_pages, device, gen) for _ in range(stack.num_layers)]
    runner = IndexerGraphRunner(
        config,
        stack,
        caches,
        device,
        graph_backend="device",
        capture_sizes=CaptureSizes(
            [b * config.next_n for b in BATCHES], max_size=512, uniform_query_len=config.next_n
        ),
    )
    start = time.perf_counter()
    runner.capture()
    capture_total = time.perf_counter() - start
    stats = runner.graphs.stats().to_dict()
    rows = []
    for b in BATCHES:
        table = torch.arange(b * pages_per_req, dtype=torch.int32).view(b, pages_per_req)
        batch = StepBatch.from_lists(
            config,
            [config.next_n] * b,
            [context] * b,
            table.to(device),
            num_pages=num_pages,
            device=device,
        )
        inputs = tuple(
            random_layer_input(config, b * config.next_n, device, gen)
            for _ in range(stack.num_layers)
        )
        first = runner.step(batch, inputs)
        assert first.replayed, f"batch {b} did not replay"
        replay_ref = torch.sort(first.topk.long(), -1).values.clone()
        eager = runner.step(batch, inputs, force_eager=True)
        same = bool((torch.sort(eager.topk.long(), -1).values == replay_ref).all())
        step_replay = _median_ms(lambda: runner.step(batch, inputs), repeat)  # noqa: B023
        step_eager = _median_ms(
            lambda: runner.step(batch, inputs, force_eager=True),  # noqa: B023
            repeat,
        )
        shape = first.shape
        assert shape is not None
        graph_only = _event_ms(lambda: runner.graphs.replay(shape), repeat)  # noqa: B023
        rows.append(
            dict(
                batch=b,
                tokens=b * config.next_n,
                step_replay_ms=step_replay,
                step_eager_ms=step_eager,
                graph_replay_ms=graph_only,
                speedup=step_eager / step_replay,
                replay_equals_eager=same,
            )
        )
        print(
            f"batch {b:>3}: step replay {step_replay:.3f} ms, eager {step_eager:.3f} ms "
            f"({step_eager / step_replay:.2f}x), graph alone {graph_only:.3f} ms, same={same}",
            flush=True,
        )
    return dict(
        config=repr(config),
        stack=repr(stack),
        context=context,
        capture_total_s=capture_total,
        capture=stats,
        rows=rows,
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--skip-harness", action="store_true")
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mismatches = None
    if not args.skip_harness:
        start = time.perf_counter()
        mismatches = run_replay_check(
            backend="device",
            cases=args.cases,
            seed=11,
            device=torch.device("cuda"),
            progress=False,
        )
        print(f"harness: {time.perf_counter() - start:.1f} s", flush=True)
    result = bench_step(args.context, args.repeat)
    result["harness_mismatches"] = mismatches
    (out / "device_runner.json").write_text(json.dumps(result, indent=2, default=str))
    print("\ncapture per size (device graphs, V4.1-Flash stack, source + 3 consumers):")
    for g in result["capture"]["graphs"]:  # type: ignore[index]
        mib = (g["num_bytes"] or 0) / 2**20
        print(
            f"  {g['label']:>20}: capture {g['capture_seconds']:.3f} s "
            f"(+ warm-up {g['warmup_seconds']:.3f} s), graph memory {mib:.1f} MiB"
        )
    print(
        f"\n{'batch':>5} {'tokens':>6} {'replay ms':>10} {'eager ms':>9} {'x':>6} "
        f"{'graph ms':>9} same"
    )
    for r in result["rows"]:  # type: ignore[union-attr]
        print(
            f"{r['batch']:>5} {r['tokens']:>6} {r['step_replay_ms']:>10.3f} "
            f"{r['step_eager_ms']:>9.3f} {r['speedup']:>6.2f} {r['graph_replay_ms']:>9.3f} "
            f"{r['replay_equals_eager']}"
        )
    print(f"harness mismatches: {mismatches}")
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
