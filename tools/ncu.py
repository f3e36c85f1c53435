"""Nsight Compute helpers for the logits kernels: launches to profile, and a stall summary.

    TRITON_CACHE_DIR=/tmp/tc python tools/ncu.py launch --out DIR [--case decode64] [--schedule]
    ncu --clock-control none -k regex:logits -c 1 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SourceCounters -o rep \\
        python tools/ncu.py launch --case decode64
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python tools/ncu.py stalls rep.csv [--window 0x400] [--top 25]

`launch` (GPU) runs each selected case (dense decode H64 next_n 2 64 x 16K, dense decode H32
64 x 64K, prefill H64 4096 x 32K; `--schedule`: decode cases launch the persistent scheduled
kernel) twice with no timing loop, so ncu can take exactly one launch, and with `--out` tars
every compiled kernel's TTGIR, PTX, SASS and `cuobjdump -res-usage` from TRITON_CACHE_DIR.
`stalls` (any machine) reads the source page of an ncu report of any kernel: the stall
reasons over all samples, the share of samples per SASS address window with its common
opcodes and executed-instruction count (loops show as windows executed many times), then
the instructions with the most samples and their top reasons.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

from graphidx.bench.inputs import random_block_table, random_kv_cache, random_queries
from graphidx.ops.kernels import logits as triton_logits
from graphidx.ops.kernels.logits import LogitsConfig
from graphidx.ops.schedule import allocate_schedule, build_decode_schedule

HEAD_DIM = 128
CASES = {
    # name: (heads, next_n, seqs, keys per seq, page_entries) or prefill rows with next_n 0
    "decode64": (64, 2, 64, 16384, 64),
    "decode32": (32, 2, 64, 65536, 128),
    "prefill": (64, 0, 4096, 32768, 64),
}


def run_case(
    name: str, device: torch.device, config: LogitsConfig | None = None, schedule: bool = False
) -> None:
    heads, next_n, count, keys, page_entries = CASES[name]
    prefill = next_n == 0
    contexts = [keys] if prefill else [keys] * count
    rows = count if prefill else count * next_n
    table, pages = random_block_table(contexts, page_entries, device)
    kv = random_kv_cache(pages, heads, HEAD_DIM, page_entries, device)
    q, q_scale, weights = random_queries(rows, heads, HEAD_DIM, device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    if prefill:
        ends = [keys - rows + r + 1 for r in range(rows)]
    else:
        ends = [c - (next_n - 1 - j) for c in contexts for j in range(next_n)]
    row_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    out = torch.empty((rows, keys), device=device)
    grouping: dict[str, object] = (
        {"query_start_loc": torch.tensor([0, rows], dtype=torch.int32, device=device)}
        if prefill
        else {"next_n": next_n}
    )
    if schedule and not prefill:
        plan = allocate_schedule(count, keys, device)
        build_decode_schedule(row_ends, plan, next_n=next_n, backend="triton")
        grouping["schedule"] = plan
    for _ in range(2):
        triton_logits.paged_mqa_logits(
            q, q_scale, kv, weights, context_lens, table, row_ends, out,
            page_entries=page_entries, config=config, **grouping,  # type: ignore[arg-type]
        )  # fmt: skip
    torch.cuda.synchronize(device)
    print(f"{name}: ran", flush=True)


def collect_artifacts(cache_dir: Path, out_dir: Path) -> Path:
    """Tar every kernel's .ttgir/.ptx/.json from the Triton cache, plus SASS and resource
    usage dumped from each .cubin by cuobjdump."""
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / "artifacts.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(cache_dir.rglob("*")):
            if path.suffix in {".ttgir", ".ptx", ".json"}:
                tar.add(path, arcname=f"{path.parent.name[:8]}/{path.name}")
            if path.suffix == ".cubin":
                for flag, suffix in (("--dump-sass", ".sass"), ("--dump-resource-usage", ".res")):
                    dump = subprocess.run(
                        ["cuobjdump", flag, str(path)], capture_output=True, text=True
                    )
                    text_path = path.with_suffix(suffix)
                    text_path.write_text(dump.stdout + dump.stderr)
                    tar.add(text_path, arcname=f"{path.parent.name[:8]}/{text_path.name}")
    return archive


def launch(args: argparse.Namespace) -> int:
    """One logits launch per case (twice, no timing loop), and the compiled kernels kept."""
    device = torch.device("cuda")
    config = None
    if args.config:
        fields = [None if f == "none" else int(f) for f in args.config.split(",")]
        config = LogitsConfig(*fields)  # type: ignore[arg-type]
    for name in args.case or sorted(CASES):
        run_case(name, device, config, args.schedule)
    if args.out:
        cache = os.environ.get("TRITON_CACHE_DIR")
        if not cache:
            raise SystemExit("--out needs TRITON_CACHE_DIR set to a fresh folder")
        print(f"wrote {collect_artifacts(Path(cache), Path(args.out))}")
    return 0


def stalls(args: argparse.Namespace) -> int:
    """Where a kernel's warps stall, from an Nsight Compute source-page CSV."""
    with open(args.csv, newline="") as handle:
        rows = list(csv.reader(handle))
    header = rows[1]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    data = [r for r in rows[2:] if len(r) >= len(header)]
    base = int(data[0][col["Address"]], 16)
    window = int(args.window, 16)
    totals: collections.Counter[str] = collections.Counter()
    windows: dict[int, list] = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    ranked = []
    for r in data:
        samples = int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
        executed = int(r[col["Instructions Executed"]] or 0)
        source = r[col["Source"]].strip()
        by_reason = {c: int(float(r[col[c]])) for c in reasons if r[col[c]] not in ("", "0")}
        totals.update(by_reason)
        offset = int(r[col["Address"]], 16) - base
        entry = windows[offset // window]
        entry[0] += samples
        entry[1] += executed
        words = source.split()
        if words:
            entry[2][(words[1] if words[0].startswith("@") and len(words) > 1 else words[0])
                     .split(".")[0]] += 1  # fmt: skip
        ranked.append((samples, offset, source, by_reason))
    total = sum(s for s, *_ in ranked) or 1
    print(f"samples {total}")
    for reason, count in totals.most_common(12):
        print(f"  {reason:<24} {count:8d} {100 * count / total:5.1f}%")
    print("windows holding >= 1% of the samples:")
    for key in sorted(windows):
        samples, executed, ops = windows[key]
        if samples >= 0.01 * total:
            top_ops = ", ".join(f"{op} {n}" for op, n in ops.most_common(5))
            print(f"  {key * window:#07x} {100 * samples / total:5.1f}%  exec {executed:>9}  "
                  f"{top_ops}")  # fmt: skip
    ranked.sort(key=lambda item: -item[0])
    for samples, offset, source, by_reason in ranked[: args.top]:
        top = sorted(by_reason.items(), key=lambda kv: -kv[1])[:3]
        print(f"{samples:6d} {offset:#07x} {source[:56]:<56} {top}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("launch", help="one logits launch per case (GPU)")
    run.add_argument("--case", action="append", choices=sorted(CASES))
    run.add_argument(
        "--schedule", action="store_true", help="decode cases run the persistent schedule"
    )
    run.add_argument("--out", help="folder for artifacts.tgz (needs TRITON_CACHE_DIR)")
    run.add_argument(
        "--config", help="LogitsConfig fields in order, comma-separated ints or 'none'"
    )
    run.set_defaults(func=launch)
    summary = sub.add_parser("stalls", help="where the warps stall, from an ncu source CSV")
    summary.add_argument("csv")
    summary.add_argument("--window", default="0x400", help="bytes of SASS per window (hex)")
    summary.add_argument("--top", type=int, default=25, help="instructions to list")
    summary.set_defaults(func=stalls)
    args = parser.parse_args()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
