"""H200 script: how fast could the key decode make the MQA-logits kernels? Two bounds, timed.

    python tools/device_decode_bounds.py [--rounds 3] [--case decode64 ...] [--dir _bounds]
        [--out DIR]

Writes three copies of this checkout's `graphidx` under `--dir` and times them side by side
with `tools/device_ab.py` (alternating rounds, one process per tree, kernel spans):

- `main`: the kernels as they are (two packed bf16 multiplies per decoded code pair);
- `one_multiply`: `dequantize_keys_bf16x2` with a single `fma.rn.bf16x2` by `2**(E - 1)`.
  Exact only for scale bytes E <= 128 (the bench's keys reach 133, so its checks FAIL on the
  keys above; the instructions are the same): no exact one-multiply decode saves more;
- `no_key_decode`: the code words handed to the MMA as bf16 pairs with no arithmetic but one
  shift per word. Wrong values (its checks FAIL by design): the time of everything but the
  key decode — the MMAs, the epilogue, the loads and the stores (the scale bytes, unused,
  are not loaded: 4 of a key's 68 bytes).

A target that the `no_key_decode` tree misses cannot be met by any key decode in this loop;
one that `one_multiply` misses cannot be met by a cheaper scale step. The patches are checked
to have applied (the script stops otherwise). Prints the medians, then each tree's kernel
span over the case's roofline floor; `--out` also plots those ratios (decode_bounds.png).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys

import device_ab

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KERNEL = os.path.join("graphidx", "ops", "kernels", "mxfp4_tl.py")

TWO_MULTIPLIES = "".join([
    "    low_factors, high_factors = bf16x2_scale_factors(tl.expand_dims(scale_bytes, 3))\n",
    "    pair = tl.inline_asm_elementwise(\n",
    '        "{ .reg .b32 nz, t; mov.b32 nz, 0x80008000; "\n',
    '        "fma.rn.bf16x2 t, $1, $2, nz; fma.rn.bf16x2 $0, t, $3, nz; }",\n',
    '        "=r,r,r,r",\n',
    "        [pair, low_factors, high_factors],\n",
])  # fmt: skip

ONE_MULTIPLY = "".join([
    "    factors = (tl.expand_dims(scale_bytes, 3) + 126) * 0x00800080  # 2**(E - 1)\n",
    "    pair = tl.inline_asm_elementwise(\n",
    '        "{ .reg .b32 nz; mov.b32 nz, 0x80008000; fma.rn.bf16x2 $0, $1, $2, nz; }",\n',
    '        "=r,r,r",\n',
    "        [pair, factors],\n",
])  # fmt: skip

DECODE_START = "    pair = bf16_pair_codes(words)\n"
DECODE_END = "    first = pair.to("

# no decode: each word's bits (and the word shifted by 8) as bf16 pairs, in the decode's shape
RAW_PAIRS = "".join([
    "    upper = words >> 8\n",
    "    pair = tl.join(tl.join(words, upper), tl.join(upper, words))\n",
    "    pair = tl.permute(tl.reshape(pair, [rows, sub, count, 4, 4]), (0, 1, 2, 4, 3))\n",
])  # fmt: skip

VARIANTS = {
    "main": [],
    "one_multiply": [(TWO_MULTIPLIES, ONE_MULTIPLY)],
    "no_key_decode": [(None, RAW_PAIRS)],
}


def write_tree(directory: str, name: str, patches: list[tuple[str | None, str]]) -> str:
    """A copy of `graphidx` at `directory/name` with `patches` applied to the kernel file; a
    patch `(None, new)` replaces the key decode's lines from DECODE_START up to DECODE_END."""
    root = os.path.join(directory, name)
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "graphidx"), os.path.join(root, "graphidx"),
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    path = os.path.join(root, KERNEL)
    with open(path) as handle:
        text = handle.read()
    for old, new in patches:
        if old is None:
            start = text.find(DECODE_START)
            end = text.find(DECODE_END, start)
            old = text[start:end] if 0 <= start < end else ""
        if not old or text.count(old) != 1:
            raise SystemExit(f"{name}: the patched lines are not once in {KERNEL}: update me")
        text = text.replace(old, new)
    with open(path, "w") as handle:
        handle.write(text)
    return root


def bound_rows(spans: dict[tuple[str, str], list[float]], floors: dict[str, float],
               cases: list[str]) -> list[tuple[str, float, list[float]]]:  # fmt: skip
    """Per case its floor and each tree's median kernel span over it (NaN where not run)."""
    rows = []
    for case in cases:
        floor = floors.get(case, float("nan"))
        ratios = []
        for tree in VARIANTS:
            got = spans.get((tree, case))
            ratios.append(statistics.median(got) / floor if got else float("nan"))
        rows.append((case, floor, ratios))
    return rows


def plot_bounds(rows: list[tuple[str, float, list[float]]], path: str) -> None:
    """Bars of kernel span / floor per case and tree, with the <= 1.5x target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(VARIANTS)
    for index, tree in enumerate(VARIANTS):
        places = [case + (index - (len(VARIANTS) - 1) / 2) * width for case in range(len(rows))]
        heights = [ratios[index] for _, _, ratios in rows]
        bars = axes.bar(places, heights, width, label=tree)
        axes.bar_label(bars, fmt="%.2f", fontsize=8)
    axes.axhline(1.5, color="black", linestyle="--", linewidth=1, label="target <= 1.5x")
    axes.axhline(1.0, color="gray", linewidth=1)
    axes.set_xticks(range(len(rows)), [f"{case}\nfloor {floor:.1f} us" for case, floor, _ in rows])
    axes.set_ylabel("kernel span / roofline floor")
    axes.set_title("MQA logits on the H200: what a cheaper key decode could give")
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--case", action="append", choices=sorted(device_ab.CASES))
    parser.add_argument("--dir", default="_bounds", help="where the trees are written")
    parser.add_argument("--out", help="folder for decode_bounds.png")
    args = parser.parse_args()
    trees = {name: write_tree(args.dir, name, patches) for name, patches in VARIANTS.items()}
    cases = args.case or ["decode64", "decode64x66", "decode32", "gather"]
    # no_key_decode fails its checks by design: the failure flag says nothing here
    times, spans, floors, _ = device_ab.time_trees(trees, cases, args.rounds)
    device_ab.print_medians("replay", times, list(trees), cases)
    device_ab.print_medians("kernel span", spans, list(trees), cases)
    rows = bound_rows(spans, floors, cases)
    print("\nkernel span / floor (target <= 1.5)")
    print(f"{'case':12} {'floor us':>9} " + " ".join(f"{tree:>14}" for tree in VARIANTS))
    for case, floor, ratios in rows:
        print(f"{case:12} {floor:9.1f} " + " ".join(f"{ratio:14.3f}" for ratio in ratios))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        plot_bounds(rows, os.path.join(args.out, "decode_bounds.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
