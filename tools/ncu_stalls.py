"""Summarize an Nsight Compute source-page CSV: where a kernel's warps stall.

    ncu --clock-control none -k regex:NAME -c 1 --section WarpStateStats \\
        --section SourceCounters -o rep python3 SCRIPT ...
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python tools/ncu_stalls.py rep.csv [--window 0x400] [--top 25]

Prints the stall reasons over all samples, the share of samples per address window of the
SASS (with its most common opcodes and executed-instruction count: loops show up as windows
executed many times), then the instructions with the most samples and their top reasons.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--window", default="0x400", help="bytes of SASS per window (hex)")
    parser.add_argument("--top", type=int, default=25, help="instructions to list")
    args = parser.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
