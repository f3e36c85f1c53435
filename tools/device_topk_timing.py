"""H200 script: how stable are the Triton top-k timings on one fixed input?

    python tools/device_topk_timing.py [--repeat 8] [--k 512] [--once]
    python tools/device_topk_timing.py --sweep [--k 512] [--sweep-groups 2048,4096 ...]
    python tools/device_topk_timing.py --span [--k 512]

The top-k rows of `graphidx bench` move by up to 2x between runs on the same seeded input,
and tools/device_spread.py saw one config flip between ~68 and ~140 us within one process,
within one buffer placement, at a steady SM clock (BENCHMARKS.md). This times every config
`--repeat` rounds, the configs interleaved within each round (so a slow period hits all of
them alike), with triton.testing.do_bench (L2 cleared before each launch), and checks that
every run picks the same columns. Prints each config's times in round order, then its
median and best.

`--sweep` instead times the one-program path (P = 1) over groups x chunk x warps as CUDA-graph
replays with a clean L2 (the bench's method), checking each config's picked values against
torch.topk, and prints them fastest first.

`--span` times the default config the same way on the normal rows and on rows whose group
maxima span the sign bit (one group of every row all negative): the floor search must stay
tight there (FLOOR_LIMIT), not fall back to the whole-row select.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

from graphidx.bench import time_us, time_us_graph
from graphidx.ops.kernels import next_power_of_2
from graphidx.ops.kernels import topk as triton_topk

ROWS, WIDTH = 128, 65536


def configs_for(k: int) -> dict[str, triton_topk.TopkConfig]:
    """The default, P = 1 / 2 / 4 at their default warps, their 4- or 8-warp variants and an
    80-register variant."""
    configs = {"default": triton_topk.default_config(k, ROWS, WIDTH)}
    for split in (1, 2, 4):
        base = triton_topk.split_config(k, split)
        configs[f"P={split}"] = base
        for warps in (4, 8):
            variant = dataclasses.replace(base, num_warps=warps, chunk=512 * warps)
            if variant != base:
                configs[f"P={split} warps={warps}"] = variant
        configs[f"P={split} maxnreg=80"] = dataclasses.replace(base, max_registers=80)
    return configs


SWEEP_GROUPS = (1024, 2048, 4096, 8192, 16384)
SWEEP_CHUNKS = (4096, 8192, 16384)
SWEEP_WARPS = (8, 16)


def sweep(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    grid: tuple[tuple[int, ...], ...] = (SWEEP_GROUPS, SWEEP_CHUNKS, SWEEP_WARPS),
) -> bool:
    """Time every P = 1 config of the sweep grid (groups, chunks, warps) at this k; True
    when all picks are right."""
    want = torch.topk(logits, k, dim=1).values.sort(dim=1).values
    out = torch.full((ROWS, k), -1, dtype=torch.int32, device=logits.device)
    results = []
    right = True
    base = triton_topk.split_config(k, 1)
    for groups in grid[0]:
        for chunk in grid[1]:
            for warps in grid[2]:
                if groups < next_power_of_2(k):
                    continue
                config = dataclasses.replace(base, groups=groups, chunk=chunk, num_warps=warps)

                def run(config: triton_topk.TopkConfig = config) -> None:
                    triton_topk.topk_per_row(logits, lengths, k, out, config=config)

                run()
                got = logits.gather(1, out.clamp(min=0).long()).sort(dim=1).values
                ok = torch.equal(got, want)
                right &= ok
                results.append((time_us_graph(run), groups, chunk, warps, ok))
    for us, groups, chunk, warps, ok in sorted(results):
        print(f"k {k:>4} groups {groups:>5} chunk {chunk:>5} warps {warps:>2}: {us:6.1f} us"
              f"{'' if ok else '  WRONG PICKS'}", flush=True)  # fmt: skip
    return right


def span(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> bool:
    """Default config on the normal rows and on rows with one all-negative group each."""
    spanned = logits.clone()
    config = triton_topk.default_config(k, ROWS, WIDTH)
    group = triton_topk.group_columns(WIDTH, config.groups)
    spanned[:, 5 * group : 6 * group] = -spanned[:, 5 * group : 6 * group].abs() - 1.0
    out = torch.full((ROWS, k), -1, dtype=torch.int32, device=logits.device)
    right = True
    for label, data in (("normal", logits), ("one negative group", spanned)):

        def run(data: torch.Tensor = data) -> None:
            triton_topk.topk_per_row(data, lengths, k, out)

        out.fill_(-1)
        run()
        want = torch.topk(data, k, dim=1).values.sort(dim=1).values
        ok = torch.equal(data.gather(1, out.clamp(min=0).long()).sort(dim=1).values, want)
        right &= ok
        print(f"k {k:>4} default, {label:>18}: {time_us_graph(run):6.1f} us"
              f"{'' if ok else '  WRONG PICKS'}", flush=True)  # fmt: skip
    return right


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=8, help="rounds over all configs")
    parser.add_argument("--k", type=int, action="append", help="k values (default 512, 2048)")
    parser.add_argument(
        "--once", action="store_true", help="one launch per config, no timing (for ncu)"
    )
    parser.add_argument("--sweep", action="store_true", help="P = 1 config grid, graph replays")
    parser.add_argument("--span", action="store_true", help="maxima across the sign bit")
    for name, values in (("groups", SWEEP_GROUPS), ("chunks", SWEEP_CHUNKS),
                         ("warps", SWEEP_WARPS)):  # fmt: skip
        parser.add_argument(
            f"--sweep-{name}", default=",".join(map(str, values)), help=f"--sweep's {name}"
        )
    args = parser.parse_args()
    grid = tuple(
        tuple(int(v) for v in getattr(args, f"sweep_{name}").split(","))
        for name in ("groups", "chunks", "warps")
    )
    device = torch.device("cuda")
    torch.manual_seed(0)
    logits = torch.randn(ROWS, WIDTH, device=device)
    lengths = torch.full((ROWS,), WIDTH, dtype=torch.int32, device=device)
    if args.span:
        return 0 if all([span(logits, lengths, k) for k in args.k or (512, 2048)]) else 1
    if args.sweep:
        return 0 if all([sweep(logits, lengths, k, grid) for k in args.k or (512, 2048)]) else 1
    same = True
    for k in args.k or (512, 2048):
        configs = configs_for(k)
        out = torch.full((ROWS, k), -1, dtype=torch.int32, device=device)
        picks: dict[str, list[torch.Tensor]] = {name: [] for name in configs}
        times: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(1 if args.once else args.repeat):
            for name, config in configs.items():
                out.fill_(-1)
                triton_topk.topk_per_row(logits, lengths, k, out, config=config)
                picks[name].append(torch.sort(out, dim=1).values.cpu())
                if not args.once:
                    times[name].append(time_us(
                        lambda config=config, k=k, out=out: triton_topk.topk_per_row(
                            logits, lengths, k, out, config=config
                        )
                    ))  # fmt: skip
        torch_times = [] if args.once else [
            time_us(lambda k=k: torch.topk(logits, k, dim=1)) for _ in range(3)
        ]  # fmt: skip
        for name, config in configs.items():
            stable = all(torch.equal(p, picks[name][0]) for p in picks[name])
            same &= stable
            row = " ".join(f"{t:6.1f}" for t in times[name])
            summary = (
                f" | median {statistics.median(times[name]):6.1f} best {min(times[name]):6.1f}"
                if times[name]
                else ""
            )
            print(
                f"k {k:>4} {name:>16} (P={config.programs_per_row} w{config.num_warps}): "
                f"{row} us{summary}; picks identical: {stable}",
                flush=True,
            )
        if torch_times:
            print(f"k {k:>4} torch.topk: " + " ".join(f"{t:6.1f}" for t in torch_times) + " us")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
