"""H200 script: the runner on device graphs — replay harness, step table, capture cost.

    python tools/device_runner.py [--cases 1000] [--preset v41|v32 ...]
        [--context 8192 65536] [--batches 1 16 64 256] [--out DIR]

1. `graphidx replay-check --backend device` over the harness shapes (`--cases` cases).
2. For each preset (v41: DeepSeek-V4.1-Flash stack, candidate source + 3 consumers, 32
   heads, next_n 2, top-512, pool 2048 x 8; v32: one DeepSeek-V3.2 layer, 64 heads, next_n 2,
   top-2048) and context, a decode step per batch size: the runner's `step()` replayed with
   inputs copied in and with inputs written in place (`input_views`), the bare graph replay
   (CUDA events), the same padded step run eagerly, and the unpadded eager step (host
   planning); every step synchronized, host work included. Capture seconds per preset.
3. One eager `topk_per_row` call (128 x 65536, k 2048) beside the same call in a graph.
Prints tables last and writes JSON under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from capture import CaptureSizes
from graphidx.batch import StepBatch
from graphidx.bench.step import median_ms
from graphidx.bench.step import preset as step_preset
from graphidx.cli.replay_check import run_replay_check
from graphidx.config import IndexerConfig, cdiv
from graphidx.runner import IndexerGraphRunner
from graphidx.testing import random_kv_cache, random_layer_input

BATCHES = (1, 16, 64, 256)


def _sorted(topk: torch.Tensor) -> torch.Tensor:
    return torch.sort(topk.long(), -1).values


def _profile_eager(
    runner, reqs: int, config: IndexerConfig, context: int, pages_per_req: int, num_pages: int
) -> None:
    """Where an eager padded step's host time goes: cProfile of 20 steps, top functions."""
    table = torch.arange(reqs * pages_per_req, dtype=torch.int32).view(reqs, pages_per_req)
    batch = StepBatch.from_lists(
        config,
        [config.next_n] * reqs,
        [context] * reqs,
        table.cuda(),
        num_pages=num_pages,
        device="cuda",
    )
    views = runner.input_views(reqs * config.next_n)
    _cprofile(lambda: runner.step(batch, views, force_eager=True, synchronize=True), 20, 25)


def _alternating(
    fns: dict[str, tuple[Callable[[], object], bool]], repeat: int
) -> dict[str, float]:
    """Medians of `median_ms` single calls taken in alternating rounds (each round times
    every fn once), so a drift of the machine over time does not favour one of them."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, (fn, event) in fns.items():
            samples[name].append(median_ms(fn, event, 1))
    return {name: statistics.median(values) for name, values in samples.items()}


def _per_call_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Median host microseconds of one `fn()` call, each timed alone (no synchronization)."""
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times)


def _cprofile(fn: Callable[[], object], calls: int, top: int) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def _profile_host(runner, batch: StepBatch, views, shape, copied: StepBatch, inputs) -> dict:
    """Where a replayed step's host microseconds go: each part timed alone, then cProfile of
    the step in place and of the step whose inputs (`copied`, `inputs`) are copied in."""
    graph = runner.graphs._lookup(shape).graph
    live = runner.buffers["num_live_reqs"]
    parts = {
        "synchronize_idle": lambda: torch.cuda.synchronize(),
        "fill_live_count": lambda: live.fill_(batch.num_real_reqs),
        "check_batch": lambda: runner._check_batch(batch),
        "buffer_addresses": lambda: runner.graphs._addresses(),
        "raw_graph_replay_launch": graph.replay,
        "cache_replay_launch": lambda: runner.graphs.replay(shape),
        "step_no_sync": lambda: runner.step(batch, views),
        "step_copied_no_sync": lambda: runner.step(copied, inputs),
        "load_decode_copied": lambda: runner._load_decode(
            copied, runner._checked_sources(inputs, copied.num_tokens)
        ),
    }
    figures = {}
    for name, fn in parts.items():
        torch.cuda.synchronize()
        figures[name] = _per_call_us(fn, 100 if "replay" in name or "step" in name else 300)
        torch.cuda.synchronize()
    for name, value in figures.items():
        print(f"  host {name}: {value:.1f} us", flush=True)
    _cprofile(lambda: runner.step(batch, views, synchronize=True), 200, 18)
    _cprofile(lambda: runner.step(copied, inputs, synchronize=True), 200, 25)
    return figures


def bench_step(
    preset: str,
    context: int,
    batches: tuple[int, ...],
    repeat: int,
    profile: bool = False,
    profile_host: bool = False,
) -> dict[str, object]:
    device = torch.device("cuda")
    config, stack = step_preset(preset, context, max(batches))
    pages_per_req = cdiv(context // config.compress_ratio, config.page_entries)
    num_pages = max(batches) * pages_per_req
    gen = torch.Generator().manual_seed(0)
    caches = [random_kv_cache(config, num_pages, device, gen) for _ in range(stack.num_layers)]
    runner = IndexerGraphRunner(
        config,
        stack,
        caches,
        device,
        graph_backend="device",
        capture_sizes=CaptureSizes(
            [b * config.next_n for b in batches],
            max_size=max(batches) * config.next_n,
            uniform_query_len=config.next_n,
        ),
    )
    start = time.perf_counter()
    runner.capture()
    capture_total = time.perf_counter() - start
    rows = []
    for b in batches:
        table = torch.arange(b * pages_per_req, dtype=torch.int32).view(b, pages_per_req)
        batch = StepBatch.from_lists(
            config,
            [config.next_n] * b,
            [context] * b,
            table.to(device),
            num_pages=num_pages,
            device=device,
        )
        tokens = b * config.next_n
        inputs = tuple(
            random_layer_input(config, tokens, device, gen) for _ in range(stack.num_layers)
        )
        views = runner.input_views(tokens)
        for view, given in zip(views, inputs, strict=True):
            for name in ("q", "q_scale", "weights"):
                getattr(view, name).copy_(getattr(given, name))
        seq_view = runner.buffers["seq_lens"][:b]
        table_view = runner.buffers["block_table"][:b, :pages_per_req]
        seq_view.copy_(batch.seq_lens)
        table_view.copy_(batch.block_table)
        batch_in_place = dataclasses.replace(
            batch, seq_lens=seq_view, block_table=table_view, validate=False
        )
        first = runner.step(batch, inputs, synchronize=True)
        assert first.replayed, f"batch {b} did not replay"
        want = _sorted(first.topk).clone()
        eager = runner.step(batch, inputs, force_eager=True, synchronize=True)
        unpadded = runner.step(batch, inputs, pad=False, synchronize=True)
        same = bool((_sorted(eager.topk) == want).all()) and bool(
            (_sorted(unpadded.topk) == want).all()
        )
        figures = {
            "step_copied_ms": lambda: runner.step(batch, inputs, synchronize=True),  # noqa: B023
            "step_in_place_ms": lambda: runner.step(batch, views, synchronize=True),  # noqa: B023
            "step_all_in_place_ms": lambda: runner.step(
                batch_in_place,  # noqa: B023
                views,  # noqa: B023
                synchronize=True,
            ),
            "eager_padded_ms": lambda: runner.step(
                batch,  # noqa: B023
                views,  # noqa: B023
                force_eager=True,
                synchronize=True,
            ),
            "eager_unpadded_ms": lambda: runner.step(
                batch,  # noqa: B023
                inputs,  # noqa: B023
                pad=False,
                synchronize=True,
            ),
        }
        row: dict[str, object] = {"batch": b, "tokens": tokens, "same": same}
        shape = first.shape
        assert shape is not None
        step_now = figures.pop("step_all_in_place_ms")
        for key, fn in figures.items():
            row[key] = median_ms(fn, False, repeat if "step" in key else max(3, repeat // 4))
        row.update(
            _alternating(
                {
                    "step_all_in_place_ms": (step_now, False),
                    "graph_ms": (runner.graphs.graph(shape).replay, True),
                    "replay_wall_ms": (runner.graphs.graph(shape).replay, False),
                },
                repeat,
            )
        )
        replay = runner.graphs.replay
        runner.graphs.replay = lambda shape: None  # type: ignore[method-assign]
        row["host_only_ms"] = median_ms(lambda: runner.step(batch_in_place, views), False, repeat)  # noqa: B023
        runner.graphs.replay = replay  # type: ignore[method-assign]
        if profile_host and b == batches[0]:
            row["host_parts_us"] = _profile_host(
                runner, batch_in_place, views, shape, batch, inputs
            )
        rows.append(row)
        print(
            f"{preset} ctx {context} batch {b:>3}: step {row['step_copied_ms']:.3f} / in place "
            f"{row['step_in_place_ms']:.3f} ms, graph {row['graph_ms']:.3f} ms, eager "
            f"{row['eager_padded_ms']:.3f} / unpadded {row['eager_unpadded_ms']:.3f} ms, "
            f"replay wall {row['replay_wall_ms']:.3f} ms, host only {row['host_only_ms']:.3f} ms, "
            f"same={same}",
            flush=True,
        )
    if profile:
        _profile_eager(runner, batches[0], config, context, pages_per_req, num_pages)
    return dict(
        preset=preset,
        config=repr(config),
        stack=repr(stack),
        context=context,
        capture_total_s=capture_total,
        capture=runner.graphs.stats().to_dict(),
        rows=rows,
    )


def bench_eager_topk(repeat: int, profile: bool = False) -> dict[str, float]:
    """One eager `topk_per_row` call (wall, synchronized) beside the same call replayed."""
    from graphidx.ops import topk_per_row

    device = torch.device("cuda")
    rows, cols, k = 128, 65536, 2048
    logits = torch.randn(rows, cols, device=device)
    lengths = torch.full((rows,), cols, dtype=torch.int32, device=device)
    out = torch.empty(rows, k, dtype=torch.int32, device=device)
    call = lambda: topk_per_row(logits, lengths, k, out)  # noqa: E731
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    figures = {
        "eager_call_ms": median_ms(call, False, repeat),
        "graph_ms": median_ms(graph.replay, True, repeat),
        "eager_call_no_sync_us": _per_call_us(call, 100),
    }
    if profile:
        figures.update(_launch_floor(logits, lengths, out))
        for name, value in figures.items():
            print(f"  topk {name}: {value:.4g}", flush=True)
        _cprofile(call, 200, 18)
    return figures


def _launch_floor(logits: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> dict:
    """Host microseconds of launching a trivial Triton kernel of the top-k's argument count:
    through `kernel[grid](...)` and through the compiled kernel's own launcher."""
    import triton
    import triton.language as tl

    @triton.jit
    def touch(src, lens, dst, scratch, s0, s1, width, k, A: tl.constexpr, B: tl.constexpr):
        tl.store(dst + tl.program_id(0), tl.load(lens + tl.program_id(0)))

    args = (logits, lengths, out, out, logits.stride(0), out.stride(0), logits.shape[1], 2048)
    grid = (1, 1, 1)
    compiled = touch[grid](*args, A=1, B=2)
    torch.cuda.synchronize()
    jit_us = _per_call_us(lambda: touch[grid](*args, A=1, B=2), 300)
    launch = compiled[grid]
    direct_us = _per_call_us(lambda: launch(*args, 1, 2), 300)
    torch.cuda.synchronize()
    return {"triton_launch_us": jit_us, "compiled_launch_us": direct_us}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--preset", nargs="+", default=["v41", "v32"], choices=["v41", "v32"])
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--skip-harness", action="store_true")
    parser.add_argument("--profile-eager", action="store_true")
    parser.add_argument(
        "--profile-host", action="store_true", help="time the replayed step's host parts"
    )
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
        print(f"harness: {mismatches} mismatches, {time.perf_counter() - start:.1f} s", flush=True)
    results = [
        bench_step(
            preset,
            context,
            tuple(args.batches),
            args.repeat,
            args.profile_eager,
            args.profile_host,
        )
        for preset in args.preset
        for context in args.context
    ]
    topk = bench_eager_topk(args.repeat, args.profile_host)
    (out / "device_runner.json").write_text(
        json.dumps(
            {"steps": results, "eager_topk": topk, "harness_mismatches": mismatches},
            indent=2,
            default=str,
        )
    )
    print(
        f"\n{'preset':>6} {'context':>7} {'batch':>5} {'step':>7} {'q in place':>10} "
        f"{'all in place':>12} {'graph':>7} "
        f"{'step-graph us':>13} {'host':>6} {'replay':>7} {'eager':>7} {'unpadded':>8} same"
    )
    for result in results:
        for r in result["rows"]:  # type: ignore[attr-defined]
            print(
                f"{result['preset']:>6} {result['context']:>7} {r['batch']:>5} "
                f"{r['step_copied_ms']:>7.3f} {r['step_in_place_ms']:>10.3f} "
                f"{r['step_all_in_place_ms']:>12.3f} "
                f"{r['graph_ms']:>7.3f} "
                f"{(r['step_all_in_place_ms'] - r['graph_ms']) * 1e3:>13.1f} "
                f"{r['host_only_ms']:>6.3f} {r['replay_wall_ms']:>7.3f} "
                f"{r['eager_padded_ms']:>7.3f} {r['eager_unpadded_ms']:>8.3f} {r['same']}"
            )
        print(
            f"  capture {result['preset']} {result['context']}: {result['capture_total_s']:.1f} s"
        )
    print(
        f"eager topk_per_row 128 x 65536 k 2048: call {topk['eager_call_ms'] * 1e3:.1f} us, "
        f"graph {topk['graph_ms'] * 1e3:.1f} us"
    )
    print(f"harness mismatches: {mismatches}")
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
