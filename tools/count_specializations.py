"""Count the Triton kernel variants the GPU demo would compile, without a GPU.

    TRITON_INTERPRET=1 python tools/count_specializations.py [--steps 12]

Runs the GPU demo's serving simulation (full V4.1-Flash heads and pool, 128K window) on the
CPU with the Triton backend, but with every kernel launch *recorded instead of executed*
(outputs are garbage; only the launches matter). For each launch it forms the key that
decides whether Triton compiles a new variant: the kernel, its constexpr values and launch
options, and for every other argument Triton's specialization — an int's `== 1` and
`% 16 == 0`, a tensor's 16-byte alignment and dtype (none for the arguments a kernel lists
in `do_not_specialize`). It prints, per step, how many new keys
that step introduced, and per kernel the number of distinct keys: a proxy for the compile
time the first steps of `graphidx demo` spend on the H200.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (kernels are recorded, not executed)")

import torch
from triton.runtime.interpreter import InterpretedFunction

import graphidx.cli.demo as demo
import graphidx.testing as testing
from graphidx.builder import CandidateIndexerMetadataBuilder
from graphidx.config import IndexerConfig
from graphidx.mxfp4 import cache_layout
from graphidx.runner import IndexerStack

KEYS: dict[str, set[tuple[object, ...]]] = collections.defaultdict(set)
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _specialization(value: object) -> object:
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0, -(2**31) <= value < 2**31)
    if isinstance(value, torch.Tensor):
        return ("ptr", str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, float):
        return ("float",)
    return ("other", repr(value))


def _record(self: InterpretedFunction, *args: object, grid: object, warmup: bool, **kwargs: object):  # type: ignore[no-untyped-def]
    params = list(self.arg_names)
    unspecialized = set(self.kwargs.get("do_not_specialize") or ())
    key: list[object] = []
    for name, value in zip(params, args, strict=False):
        key.append((name, "-" if name in unspecialized else _specialization(value)))
    for name, value in sorted(kwargs.items()):
        constexpr = name not in params or name.isupper() or name in LAUNCH_OPTIONS
        key.append((name, value if constexpr else _specialization(value)))
    KEYS[self.fn.__name__].add(tuple(key))


def _zero_cache(config: IndexerConfig, num_pages: int, device: object, gen: object) -> torch.Tensor:
    layout = cache_layout(config.num_heads, config.head_dim, config.page_entries)
    return torch.zeros(num_pages, layout.page_bytes, dtype=torch.uint8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    InterpretedFunction.run = _record  # type: ignore[method-assign]
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
    sim.runner = type(sim.runner)(
        config,
        settings.stack,
        sim.caches,
        "cpu",
        graph_backend="tape",
        ops_backend="triton",
    )
    # As on a GPU: the builder fills the device decode schedule every decode step.
    sim.runner.builder = CandidateIndexerMetadataBuilder(
        config, "cpu", num_pages=sim.num_pages, full_graph_decode=True, decode_schedule=True
    )
    seen = 0
    for index in range(args.steps):
        row = sim.step(index)
        total = sum(len(v) for v in KEYS.values())
        kind = row.kind if row is not None else "-"
        print(f"step {index:>3} {kind:>8}: {total - seen:>3} new kernel variants", flush=True)
        seen = total
    print("\nvariants per kernel:")
    for name, keys in sorted(KEYS.items(), key=lambda kv: -len(kv[1])):
        print(f"  {name:<32} {len(keys)}")
    print(f"total {seen}")
    print("\narguments whose specialization differs between variants:")
    for name, keys in sorted(KEYS.items(), key=lambda kv: -len(kv[1])):
        if len(keys) < 2:
            continue
        columns = list(zip(*keys, strict=False))
        varying = [col[0][0] for col in columns if len({v for _, v in col}) > 1]
        print(f"  {name}: {', '.join(varying)}")


if __name__ == "__main__":
    main()
