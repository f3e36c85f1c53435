"""H200 script: time bench cases for source trees side by side, in alternating rounds.

    python tools/device_ab.py BASE_ROOT [NEW_ROOT ...] [--rounds 3] [--case ...]

A kernel change is judged against the code before it on the same machine in the same call:
each round runs the chosen `graphidx.bench` cases once per tree, each tree in its own process
(so each imports its own `graphidx`), the order of the trees reversed every other round.
Every case is checked against the reference as in the bench (a FAIL is printed). Prints one
line per case and round (replay time, and the replay's device span where the tree's bench
measures it, `kernel_us`), then each tree's median replay times and their ratio to the first
tree's (where the first tree ran the case), and the same for the spans. Trees are told apart
by folder name (two copies of one tree in `_a` and `_b` give a noise estimate); one tree alone
is just timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASES = {
    # name: Python expression over graphidx.bench names, giving one CaseResult (or a result
    # with `time_us`, `check` and `notes`)
    "decode64": 'dense_decode_case("dense decode", 64, 2, [16384] * 64, 64, C, D)',
    "decode64s": 'dense_decode_case("dense decode", 64, 2, [16384] * 64, 64, C, D,'
    " use_schedule=True)",
    # 66 x 8 = 528 programs: 4 on every SM (64 x 16K leaves 16 of the 528 slots idle)
    "decode64x66": 'dense_decode_case("dense decode 66", 64, 2, [16384] * 66, 64, C, D)',
    "decode32": 'dense_decode_case("dense decode", 32, 2, [65536] * 64, 128, C, D)',
    # short steps, where the per-program query decode weighs most
    "decode64x4k": 'dense_decode_case("dense decode 4K", 64, 2, [4096] * 64, 64, C, D)',
    "decode32x8k": 'dense_decode_case("dense decode 8K", 32, 2, [8192] * 64, 128, C, D)',
    # the bench's schedule cases: one 128K-key request and 63 of 1K, and the same keys spread
    "skewed": 'dense_decode_case("skewed", 64, 2, [131072] + [1024] * 63, 64, C, D,'
    " use_schedule=True)",
    "even": 'dense_decode_case("even", 64, 2, [3056] * 64, 64, C, D, use_schedule=True)',
    "gather": "gather_case(32, 2, 64, 65536, 2048, 8, C, D)",
    "gather64": "gather_case(64, 2, 64, 65536, 2048, 8, C, D)",
    "gatherC16": "gather_case(32, 2, 64, 65536, 1024, 16, C, D)",  # other block sizes
    "gatherC64": "gather_case(32, 2, 64, 65536, 256, 64, C, D)",
    "gather16rows": "gather_case(32, 2, 8, 65536, 2048, 8, C, D)",  # a small batch
    "gather64x16rows": "gather_case(64, 2, 8, 65536, 2048, 8, C, D)",
    # a small batch with the occupancy config at finer splits (GatherConfig fields as below)
    "gather16rows512": "gather_case(32, 2, 8, 65536, 2048, 8, C, D,"
    ' name="gather 16 rows split 512", config=GatherConfig(128, 4, 1, False, 64, 512))',
    "gather16rows256": "gather_case(32, 2, 8, 65536, 2048, 8, C, D,"
    ' name="gather 16 rows split 256", config=GatherConfig(128, 4, 1, False, 64, 256))',
    "gather64x16rows512": "gather_case(64, 2, 8, 65536, 2048, 8, C, D,"
    ' name="gather H64 16 rows split 512", config=GatherConfig(128, 4, 1, True, 128, 512))',
    "prefill": "prefill_case(64, 4096, 32768, C, D)",  # ~4 ms a launch
    # the default with a 168-register cap, and without the register prefetch
    "prefill168": 'prefill_case(64, 4096, 32768, C, D, name="prefill r168",'
    " config=LogitsConfig(64, 2, 4, 1, 168, 4, True))",
    "prefillnopf": 'prefill_case(64, 4096, 32768, C, D, name="prefill no prefetch",'
    " config=LogitsConfig(64, 2, 4, 1, None))",
    "topk512": "topk_default(512)",
    "topk2048": "topk_default(2048)",
    "topk512r16": "topk_default(512, rows=16)",  # the split path, P = 8
    "topk512w1m": "topk_default(512, rows=1, width=1 << 20)",  # one wide row, P = 128
    "read": "logits_read_case(128, 65536, C, D)",  # one read of the top-k's logits (Triton)
    "readamax": "read_logits()",  # the same read by torch.amax per row
    "readsum": "read_logits(per_row=False)",  # the same read as one torch.sum
}
# Gather launch variants: GatherConfig(block_n, num_warps, num_stages, prefetch,
# max_registers, split) on the gather case.
GATHER_VARIANTS = {
    "nopf64s1024": (32, "128, 4, 1, False, 64, 1024"),
    "64pf128": (64, "128, 4, 1, True, 128"),
    "64nopf128": (64, "128, 4, 1, False, 128"),
    "64nopf96": (64, "128, 4, 1, False, 96"),
    "64b64nopf128": (64, "64, 4, 1, False, 128"),
    "64b64nopf96": (64, "64, 4, 1, False, 96"),
    # cp.async pipelining of the key loads (num_stages 2-4), no register prefetch
    "s2": (32, "128, 4, 2, False, None, 2048"),
    "s2c80": (32, "128, 4, 2, False, 80, 2048"),
    "s3c80": (32, "128, 4, 3, False, 80, 2048"),
    "s2c72": (32, "128, 4, 2, False, 72, 2048"),
    "s2c64": (32, "128, 4, 2, False, 64, 2048"),
    "s3c64": (32, "128, 4, 3, False, 64, 2048"),
    "s4c96": (32, "128, 4, 4, False, 96, 2048"),
    "s2c80s1024": (32, "128, 4, 2, False, 80, 1024"),
    "64s2": (64, "128, 4, 2, False, None, 2048"),
    "64s2c128": (64, "128, 4, 2, False, 128, 2048"),
    "64s2c96": (64, "128, 4, 2, False, 96, 2048"),
    # 64-key tiles under a register cap (no spill at 80: the 8 MMAs issue back to back)
    "b64c80": (32, "64, 4, 1, False, 80, 2048"),
    "b64c72": (32, "64, 4, 1, False, 72, 2048"),
    "b64c64": (32, "64, 4, 1, False, 64, 2048"),
    "b64c80s1024": (32, "64, 4, 1, False, 80, 1024"),
    "b64pfc96": (32, "64, 4, 1, True, 96, 2048"),
    # 128-key tiles at caps 72 / 80 (7 / 6 programs per SM)
    "c80s1536": (32, "128, 4, 1, False, 80, 1536"),
    "c72s1024": (32, "128, 4, 1, False, 72, 1024"),
}
# Decode launch variants: LogitsConfig(block_n, block_r, num_warps, num_stages, max_registers,
# programs_per_sm, prefetch, halves, l2_prefetch); "s" in the name: through the decode schedule.
DECODE_VARIANTS = {
    "64r104": (64, "64, 2, 4, 1, 104, 5, True, True"),
    "64r96": (64, "64, 2, 4, 1, 96, 5, True, True"),
    "32r104": (32, "64, 2, 4, 1, 104, 5, True, False"),
    # N = 128 at H64 without halves: at the 128 cap, and uncapped (3 programs per SM)
    "64whole": (64, "64, 2, 4, 1, 128, 4, True, False"),
    "64uncapped": (64, "64, 2, 4, 1, None, 3, True, False"),
    # the same two with the L2 prefetch of the tile after next
    "64wholel2": (64, "64, 2, 4, 1, 128, 4, True, False, True"),
    "64uncappedl2": (64, "64, 2, 4, 1, None, 3, True, False, True"),
}
for name, (heads, fields) in DECODE_VARIANTS.items():
    lens = "[16384] * 64, 64" if heads == 64 else "[65536] * 64, 128"
    for scheduled in (False, True):
        CASES[f"decode{name}{'s' if scheduled else ''}"] = (
            f'dense_decode_case("decode {name}", {heads}, 2, {lens}, C, D, '
            f"use_schedule={scheduled}, config=LogitsConfig({fields}))"
        )
# Keys from L2 instead of DRAM (`hot_pages`): how much of a decode's time is waiting on DRAM.
CASES["decode64hot"] = f"hot_pages(lambda: {CASES['decode64']})"
CASES["decode32hot"] = f"hot_pages(lambda: {CASES['decode32']})"
CASES["decode64uncappedhot"] = f"hot_pages(lambda: {CASES['decode64uncapped']})"
CASES["decode64uncappedshot"] = f"hot_pages(lambda: {CASES['decode64uncappeds']})"
CASES["gatherhot"] = f"hot_pages(lambda: {CASES['gather']})"
CASES["decode32s"] = (
    'dense_decode_case("dense decode", 32, 2, [65536] * 64, 128, C, D, use_schedule=True)'
)
CASES.update(
    {
        f"gather{name}": f"gather_case({heads}, 2, 64, 65536, 2048, 8, C, D, "
        f'name="gather {name}", config=GatherConfig({fields}))'
        for name, (heads, fields) in GATHER_VARIANTS.items()
    }
)

PRELUDE = """
import json, sys, types, torch
import graphidx.bench as bench
from graphidx.ops import topk_per_row
from graphidx.ops.kernels.logits import LogitsConfig
try:
    from graphidx.ops.kernels.gather import GatherConfig
except ImportError:
    GatherConfig = None

def topk_default(k, rows=128, width=65536):
    # The op's default config on rows x width float32, picks checked against torch.topk.
    torch.manual_seed(0)
    logits = torch.randn(rows, width, device="cuda")
    lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
    out = torch.full((rows, k), -1, dtype=torch.int32, device="cuda")
    run = lambda: topk_per_row(logits, lengths, k, out, backend="triton")
    run()
    want = torch.topk(logits, k, dim=1).values.sort(dim=1).values
    got = logits.gather(1, out.clamp(min=0).long()).sort(dim=1).values
    check = "OK" if torch.equal(got, want) else "FAIL: wrong picks"
    time_us, notes = bench.time_case(run)
    return types.SimpleNamespace(time_us=time_us, check=check, notes=notes)

def read_logits(rows=128, width=65536, per_row=True):
    # One read of the top-k cases' logits, timed like them: a measured "one read".
    logits = torch.randn(rows, width, device="cuda")
    if per_row:
        out = torch.empty(rows, device="cuda")
        run = lambda: torch.amax(logits, dim=1, out=out)
        want = logits.max(dim=1).values
    else:
        out = torch.empty((), device="cuda")
        run = lambda: torch.sum(logits, dim=(0, 1), out=out)
        want = logits.sum()
    run()
    check = "OK" if torch.allclose(out, want) else "FAIL: wrong result"
    time_us, notes = bench.time_case(run)
    return types.SimpleNamespace(time_us=time_us, check=check, notes=notes)

def hot_pages(make_case):
    # The case with every seq's block-table row equal to seq 0's: all seqs read the same
    # pages, which stay in L2, so the kernel runs as if its key loads never went to DRAM.
    cases = getattr(bench, "cases", bench)  # the module whose cases read the block table
    original = cases.random_block_table
    def shared(contexts, page_entries, device):
        table, pages = original(contexts, page_entries, device)
        return table[:1].expand_as(table).contiguous(), pages
    cases.random_block_table = shared
    try:
        return make_case()
    finally:
        cases.random_block_table = original

scope = dict(vars(bench), C=bench.Ceilings(), D=torch.device("cuda"), topk_default=topk_default,
             read_logits=read_logits, LogitsConfig=LogitsConfig,
             GatherConfig=GatherConfig, hot_pages=hot_pages)
"""
"""Defines `scope`, where every CASES expression evaluates to one result with `time_us`,
`check` and `notes` (its device span `kernel_us` there when the tree's bench measures it)."""

CHILD = (
    PRELUDE
    + """
for name in sys.argv[1:]:
    result = eval(CASES[name], scope)
    kernel = result.notes.get("kernel_us")
    floor = getattr(result, "floor_us", None)
    print("AB " + json.dumps([name, result.time_us, result.check, kernel, floor]), flush=True)
"""
)


def run_tree(root: str, cases: list[str]) -> dict[str, tuple[float, str, object, object]]:
    """Time `cases` with the graphidx of `root` in a fresh process: per case the replay time,
    the check, the kernel span and the roofline floor (None where the case has none)."""
    env = dict(os.environ, PYTHONPATH=root)
    code = f"CASES = {CASES!r}\n{CHILD}"
    done = subprocess.run(
        [sys.executable, "-c", code, *cases], env=env, capture_output=True, text=True, cwd=root
    )
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("AB "):
            name, time_us, check, kernel, floor = json.loads(line[3:])
            found[name] = (time_us, check, kernel, floor)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
    return found


def print_medians(title: str, samples: dict[tuple[str, str], list[float]], names: list[str],
                  cases: list[str]) -> None:  # fmt: skip
    """One line per case: each tree's median of `samples` and its ratio to the first tree's."""
    print(f"\nmedian {title} us (ratio to {names[0]})")
    print(f"{'case':10} " + " ".join(f"{t:>20}" for t in names))
    for name in cases:
        base = samples.get((names[0], name))
        cells = []
        for tree in names:
            got = samples.get((tree, name))
            if not got:
                cells.append(f"{'-':>20}")
                continue
            median = statistics.median(got)
            ratio = f"{median / statistics.median(base):5.3f}" if base else "    -"
            cells.append(f"{median:11.1f} ({ratio})")
        print(f"{name:10} " + " ".join(cells))


Samples = dict[tuple[str, str], list[float]]


def time_trees(trees: dict[str, str], cases: list[str], rounds: int
               ) -> tuple[Samples, Samples, dict[str, float], bool]:  # fmt: skip
    """Run `cases` on every tree for `rounds` alternating rounds, printing a line per run.

    Returns the replay times and kernel spans by (tree, case), each case's roofline floor,
    and whether any check failed."""
    names = list(trees)
    times: Samples = {}
    spans: Samples = {}
    floors: dict[str, float] = {}
    failed = False
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for tree in order:
            for name, (time_us, check, kernel, floor) in run_tree(trees[tree], cases).items():
                times.setdefault((tree, name), []).append(time_us)
                if isinstance(kernel, float):
                    spans.setdefault((tree, name), []).append(kernel)
                if isinstance(floor, float):
                    floors[name] = floor
                failed |= check != "OK"
                span = f"kernel {kernel:7.1f} us" if isinstance(kernel, float) else ""
                print(f"round {round_index} {tree:12} {name:10} {time_us:9.1f} us  {span}  {check}")
    return times, spans, floors, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", help="source trees; the first is the base")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    args = parser.parse_args()
    cases = args.case or sorted(CASES)
    trees = {os.path.basename(os.path.abspath(r)) or r: os.path.abspath(r) for r in args.roots}
    if len(trees) < len(args.roots):
        parser.error("the trees are told apart by folder name: give each a different one")
    times, spans, _, failed = time_trees(trees, cases, args.rounds)
    print_medians("replay", times, list(trees), cases)
    if spans:
        print_medians("kernel span", spans, list(trees), cases)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
