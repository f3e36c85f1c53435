"""Count the Triton kernel variants the GPU demo would compile, without a GPU.

    TRITON_INTERPRET=1 python tools/count_specializations.py [--steps 12] [--warmup]

Runs the GPU demo's serving simulation (full V4.1-Flash heads and pool, 128K window) on the
CPU with the Triton backend, but with every kernel launch *recorded instead of executed*
(outputs are garbage; only the launches matter). For each launch it forms the key that
decides whether Triton compiles a new variant (`graphidx.specializations.launch_key`: the
kernel, its constexpr values and launch options, and for every other argument Triton's
specialization — an int's `== 1` and `% 16 == 0`, a tensor's 16-byte alignment and dtype,
only the type for the arguments a kernel lists in `do_not_specialize`). It prints, per step,
how many new keys that step introduced, and per kernel the number of distinct keys: a proxy
for the compile time the first steps of `graphidx demo` spend on the H200.

`--warmup` first runs what `graphidx demo` runs before its steps: `graphidx.warmup.warmup`
(in this process) and `runner.capture()` (tape graphs), and prints the keys each introduced;
every step after them should then introduce none. Without it the steps run uncaptured,
every uniform decode step eagerly. The interpreter sees the interpreter's configs (e.g.
16-key tiles), not the GPU's, so a GPU's counts differ somewhat.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (kernels are recorded, not executed)")

import torch

import graphidx.cli.demo as demo
import graphidx.testing as testing
from graphidx.builder import CandidateIndexerMetadataBuilder
from graphidx.config import IndexerConfig
from graphidx.mxfp4 import cache_layout
from graphidx.runner import IndexerStack
from graphidx.specializations import KeyLog, recording_interpreter
from graphidx.warmup import warmup


def _zero_cache(config: IndexerConfig, num_pages: int, device: object, gen: object) -> torch.Tensor:
    layout = cache_layout(config.num_heads, config.head_dim, config.page_entries)
    return torch.zeros(num_pages, layout.page_bytes, dtype=torch.uint8)


def gpu_demo_simulation() -> demo.ServingSimulation:
    """The GPU demo's simulation on the CPU: Triton kernels, tape graphs, zero caches, and
    the decode schedule built every decode step as on a GPU."""
    demo.random_kv_cache = _zero_cache  # type: ignore[assignment]
    testing.random_kv_cache = _zero_cache  # type: ignore[assignment]
    config = IndexerConfig.deepseek_v41_flash(max_num_seqs=64, max_model_len=131072)
    settings = demo.DemoSettings(
        config,
        IndexerStack(candidate_source=True, consumers=3),
        torch.device("cpu"),
        "tape",
        num_requests=96,
        prompt_lens=(2048, 65536),
        output_lens=(16, 48),
        max_running=64,
    )
    sim = demo.ServingSimulation(settings)
    runner = type(sim.runner)(
        config, settings.stack, sim.caches, "cpu", graph_backend="tape", ops_backend="triton"
    )
    runner.builder = CandidateIndexerMetadataBuilder(
        config,
        "cpu",
        num_pages=sim.num_pages,
        full_graph_decode=True,
        decode_schedule=True,
    )
    sim.runner = runner
    return sim


def _warm_up(sim: demo.ServingSimulation, log: KeyLog) -> None:
    report = warmup(sim.runner, workers=1)
    print(f"warm-up: {len(log):>3} kernel variants; {report.summary()}", flush=True)
    before, start = len(log), time.perf_counter()
    sim.runner.capture()
    print(
        f"capture: {len(log) - before:>3} new kernel variants "
        f"({len(sim.runner.graphs)} graphs, {time.perf_counter() - start:.1f} s)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", action="store_true", help="warm up and capture first")
    args = parser.parse_args()
    sim = gpu_demo_simulation()
    log = KeyLog()
    with recording_interpreter(log):
        if args.warmup:
            _warm_up(sim, log)
        seen = len(log)
        for index in range(args.steps):
            row = sim.step(index)
            kind = row.kind if row is not None else "-"
            new = len(log) - seen
            print(f"step {index:>3} {kind:>8}: {new:>3} new kernel variants", flush=True)
            seen = len(log)
    groups = log.by_kernel()
    print("\nvariants per kernel:")
    for name, keys in groups.items():
        print(f"  {name:<32} {len(keys)}")
    print(f"total {len(log)}")
    print("\narguments whose specialization differs between variants:")
    for name, keys in groups.items():
        if len(keys) < 2:
            continue
        columns = list(zip(*(arguments for _, arguments in keys), strict=False))
        varying = [col[0][0] for col in columns if len({v for _, v in col}) > 1]
        print(f"  {name}: {', '.join(varying)}")


if __name__ == "__main__":
    main()
