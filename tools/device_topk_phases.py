"""H200 script: where does the Triton top-k's time go (128 x 65536 float32, k 512 / 2048)?

    python tools/device_topk_phases.py [--repeat 3] [--quick]

Times each case eagerly with do_bench's flush (a dirty L2, the method before session 4), as
one CUDA-graph replay with that flush, and as a replay with a clean L2 (`time_us_graph`):
- `stream max`: a bare streaming row max at several warps / chunk sizes / programs per row,
  the rate one pass over the logits can reach with this grid, and torch.amax over the rows;
- the P = 1 kernel cut after each phase, built from the library's own jit helpers: group
  maxima only, + the floor search, + the collect pass, + the select's candidate gather and
  key range, + its search (down to the rank step's bracket since session 17); then the full
  op (the rest: the rank step and writing the picks);
- the full op at P = 1 / 2 / 4 (the split launches timed bimodally when eager).
A phase's cost is the difference between consecutive cuts. Prints one table. --quick: only
the cuts and the full op at P = 1, as clean-L2 graph replays (for A/B of two trees).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import statistics
import sys

import torch
import triton
import triton.language as tl

from graphidx.bench import time_us, time_us_graph
from graphidx.ops.kernels import next_power_of_2
from graphidx.ops.kernels import topk as tk

ROWS, WIDTH = 128, 65536
# The cut kernel follows the library of whichever tree is imported (an A/B of this tree and
# the one before it):
RANKED = "BRACKET" in inspect.signature(tk._kth_largest_key.fn).parameters
"""The select's search stops at a small bracket and `_emit_ranked` ranks it (session 17 on;
before it, the session-16 signatures)."""
ONE_READ_US = ROWS * WIDTH * 4 / 4.3e12 * 1e6


@triton.jit
def _stream_max_kernel(src_ptr, out_ptr, row_stride, n, CHUNK: tl.constexpr, SPLIT: tl.constexpr):
    piece = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    src = src_ptr + row * row_stride
    lane = tl.arange(0, CHUNK)
    acc = tl.full([CHUNK], float("-inf"), tl.float32)
    per = n // SPLIT
    for start in range(piece * per, piece * per + per, CHUNK):
        acc = tl.maximum(acc, tl.load(src + start + lane))
    tl.store(out_ptr + row * SPLIT + piece, tl.max(acc, axis=0))


@triton.jit
def _cut_kernel(
    logits_ptr, out_ptr, scratch_ptr, row_stride, n, k,
    K_PAD: tl.constexpr, CAP: tl.constexpr, G: tl.constexpr, SG: tl.constexpr,
    NG_PAD: tl.constexpr, ROW_INTS: tl.constexpr, PHASES: tl.constexpr, PARTS: tl.constexpr,
    RANKED: tl.constexpr, BRACKET: tl.constexpr, PTX: tl.constexpr = True,
):  # fmt: skip
    """The P = 1 top-k kernel stopped after PHASES phases (1 maxima, 2 floor and group
    list, 3 collect; then the select's steps when the candidates fit CAP: 4 their keys
    gathered and their search bracket set up as `_select` does, 5 its search (RANKED: down
    to a bracket of at most BRACKET keys, which `_emit_ranked` takes, else to the k-th
    largest))."""
    row = tl.program_id(0).to(tl.int64)
    src = logits_ptr + row * row_stride
    candidates = scratch_ptr + row * ROW_INTS
    maxima = candidates + CAP + K_PAD
    group_list = maxima + NG_PAD
    RANK: tl.constexpr = (K_PAD + SG - 1) // SG
    RANKS: tl.constexpr = RANK if RANK <= 4 else 0  # as `_topk_row_kernel` picks them
    seen = tk._store_group_maxima(src, n, maxima, G, SG, RANKS, PTX)
    result = tl.zeros([], tl.int32)
    if PHASES >= 2:
        tl.debug_barrier()
        floor, listed, row_max = tk._list_groups(maxima, seen, n, k, group_list, G, NG_PAD,
                                                 RANKS)  # fmt: skip
        result = listed
        if PHASES >= 3:
            tl.debug_barrier()
            above, tied = tk._collect_groups(src, n, floor, group_list, listed, candidates,
                                             candidates + CAP, K_PAD, CAP, G, SG, PARTS,
                                             PTX, True)  # fmt: skip
            result = above + tied
            if PHASES >= 4:
                tl.debug_barrier()
                slot = tl.arange(0, CAP)
                inside = slot < above
                col = tl.load(candidates + slot, mask=inside, other=0, cache_modifier=".cg")
                key = tl.load(src + col, mask=inside, other=0.0)
                key = tl.where(inside, tk._order_key(key), 0)
                largest, smallest, live = row_max, floor + 1, above
                if floor == tk.KEY_NEG_INF:
                    largest, smallest, live = tk._key_range(key)
                result = live
                if PHASES >= 5:
                    if RANKED:
                        _, reaching, _, _ = tk._kth_largest_key(
                            key, k, k, k, largest, smallest, live, 0, 0, 32, BRACKET
                        )
                    else:
                        _, reaching = tk._kth_largest_key(key, k, k, k, largest, smallest,
                                                          live, 0, 0, 32)  # fmt: skip
                    result = reaching
    tl.store(out_ptr + row, result)


def bracket_of(k_pad: int) -> int:
    """The select's largest rank-step bracket at this K_PAD (as `_select` takes it)."""
    return min(tk.RANK_KEYS.value, k_pad // 2) if RANKED else 0


def parts_of(group: int, cfg: tk.TopkConfig) -> int:
    """The library's PARTS for this config."""
    return tk.collect_parts(group, max(1, cfg.chunk // group), cfg.num_warps)


def _timed(fn, repeat: int) -> tuple[float, float, float]:
    """Medians over `repeat` calls: eager with do_bench's dirty L2, a graph replay with a
    dirty L2, a graph replay with a clean L2."""
    eager = statistics.median(time_us(fn, l2="dirty") for _ in range(repeat))
    dirty = statistics.median(time_us_graph(fn, l2="dirty") for _ in range(repeat))
    clean = statistics.median(time_us_graph(fn) for _ in range(repeat))
    return eager, dirty, clean


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="cuts and P = 1, clean L2 only")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    logits = torch.randn(ROWS, WIDTH, device=device)
    lengths = torch.full((ROWS,), WIDTH, dtype=torch.int32, device=device)
    rows: list[tuple[str, float, float, float]] = []

    def add(name: str, fn) -> None:
        if args.quick:
            clean = statistics.median(time_us_graph(fn) for _ in range(args.repeat))
            times: tuple[float, float, float] = (float("nan"), float("nan"), clean)
        else:
            times = _timed(fn, args.repeat)
        rows.append((name, *times))
        print(f"{name:<40} " + " ".join(f"{t:7.1f}" for t in times), flush=True)

    sink = torch.empty(ROWS * 8, device=device)
    streams = ((4, 2048, 1), (8, 4096, 1), (8, 8192, 1), (16, 8192, 1), (16, 16384, 1),
               (8, 4096, 2), (8, 4096, 4))  # fmt: skip
    for warps, chunk, split in streams[4:5] if args.quick else streams:
        add(f"stream max w{warps} chunk {chunk} P={split}", lambda w=warps, c=chunk, s=split:
            _stream_max_kernel[(s, ROWS)](logits, sink, WIDTH, WIDTH, CHUNK=c, SPLIT=s,
                                          num_warps=w))  # fmt: skip
    # torch's own one pass over the logits, timed the same way.
    add("torch.amax over each row", lambda: torch.amax(logits, dim=1))
    out_cut = torch.empty(ROWS, dtype=torch.int32, device=device)
    stats: list[str] = []
    for k in (512, 2048):
        cfg = tk.default_config(k, ROWS, WIDTH)
        k_pad = next_power_of_2(k)
        group = tk.group_columns(WIDTH, cfg.groups)
        groups_pad = next_power_of_2(WIDTH // group)
        row_ints = cfg.capacity + k_pad + 2 * groups_pad
        scratch = torch.empty((ROWS, row_ints), dtype=torch.int32, device=device)
        cuts = (
            (1, "maxima"),
            (2, "+ floor, list"),
            (3, "+ collect"),
            (4, "+ select: gather, range"),
            (5, "+ select: search" + (" to the rank bracket" if RANKED else "")),
        )
        for phases, label in cuts:
            add(f"k {k} cut {label}", lambda p=phases, cfg=cfg, k=k, k_pad=k_pad, g=group,
                gp=groups_pad, r=row_ints, s=scratch: _cut_kernel[(ROWS,)](
                    logits, out_cut, s, WIDTH, WIDTH, k, K_PAD=k_pad, CAP=cfg.capacity, G=g,
                    SG=cfg.chunk // g, NG_PAD=gp, ROW_INTS=r, PHASES=p,
                    PARTS=parts_of(g, cfg), RANKED=RANKED, BRACKET=bracket_of(k_pad),
                    num_warps=cfg.num_warps))  # fmt: skip
            if phases in (2, 3):
                stats.append(
                    f"k {k}: {'listed groups' if phases == 2 else 'candidates + ties'}"
                    f" per row: mean {out_cut.float().mean():.0f}, max "
                    f"{int(out_cut.max())}"
                )
        out = torch.full((ROWS, k), -1, dtype=torch.int32, device=device)
        want = torch.sort(torch.topk(logits, k, dim=1).indices.int(), dim=1).values
        for split in (1,) if args.quick else (1, 2, 4):
            config = cfg if split == 1 else tk.split_config(k, split)
            out.fill_(-1)
            tk.topk_per_row(logits, lengths, k, out, config=config)
            ok = torch.equal(torch.sort(out, dim=1).values, want)
            add(f"k {k} full P={split} ({'OK' if ok else 'WRONG'})", lambda c=config, k=k,
                o=out: tk.topk_per_row(logits, lengths, k, o, config=c))  # fmt: skip
        for warps, chunk in () if args.quick else ((16, 8192), (8, 8192)):
            config = dataclasses.replace(cfg, num_warps=warps, chunk=chunk)
            out.fill_(-1)
            tk.topk_per_row(logits, lengths, k, out, config=config)
            ok = torch.equal(torch.sort(out, dim=1).values, want)
            add(
                f"k {k} full P=1 w{warps} chunk {chunk} ({'OK' if ok else 'WRONG'})",
                lambda c=config, k=k, o=out: tk.topk_per_row(logits, lengths, k, o, config=c),
            )
        if not args.quick:
            add(f"k {k} torch.topk", lambda k=k: torch.topk(logits, k, dim=1))
    print(f"\none read of the logits: {ONE_READ_US:.1f} us (4.3 TB/s)")
    print(
        f"{'case (us)':<40} {'eager dirty':>11} {'graph dirty':>11} {'graph clean':>11} "
        f"{'clean/read':>10}"
    )
    for name, eager, dirty, clean in rows:
        print(f"{name:<40} {eager:11.1f} {dirty:11.1f} {clean:11.1f} {clean / ONE_READ_US:10.2f}")
    print("\n".join(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
