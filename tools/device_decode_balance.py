"""Decode H64 per-tile cost by config, on shapes whose static grid fills whole waves.

    python tools/device_decode_balance.py [--match TEXT]

The prefill kernel spends ~0.47 us of an SM per 64-key tile at N = 128 (3 programs per SM,
uncapped, one MMA per tile), the H64 decode ~0.57 us (4 programs per SM at a 128-register
cap, two half MMAs per tile) on the same tile work. Timing the decode at 64 x 16K keys mixes
the config with wave quantization (512 programs in 396 slots at 3 per SM), so this times
each config on a batch that fills its slots exactly (66 seqs: 66 x 8 = 528 programs = 4 per
SM; 66 x 6 = 396 = 3 per SM at 12288 keys) and prints the kernel span per tile per SM.
"keys in L2": every seq's block-table row made seq 0's, so all keys come from L2 (the
prefill's keys do: its 2048 row groups read one seq's pages). Every case is checked against
the reference (as in `graphidx bench`). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from graphidx import bench
from graphidx.bench import Ceilings, dense_decode_case
from graphidx.ops.kernels import logits
from graphidx.ops.kernels.logits import LogitsConfig

DEFAULT_SPLIT = logits.DECODE_SPLIT_KEYS

PREFILL_LIKE = LogitsConfig(64, 2, 4, 1, None, 3, True, False, False)
"""Uncapped, one N = 128 MMA per tile, next tile prefetched in registers only: the prefill's
config (3 programs per SM at 160 registers)."""

CASES = [
    # (label, seqs, keys per seq, config: None = default[, keys in L2[, keys per program]])
    ("default (cap 128, halves, L2 prefetch), 64 x 16K", 64, 16384, None),
    ("default, 66 x 16K (4 programs per SM, one wave)", 66, 16384, None),
    ("default, 66 x 12K (3 per SM)", 66, 12288, None),
    ("uncapped, one MMA, L2 prefetch, 66 x 12K (3 per SM)", 66, 12288,
     LogitsConfig(64, 2, 4, 1, None, 3, True, False, True)),
    ("uncapped, one MMA, no L2 prefetch (prefill config), 66 x 12K (one wave)", 66, 12288,
     PREFILL_LIKE),
    ("uncapped, halves, L2 prefetch, 66 x 12K", 66, 12288,
     LogitsConfig(64, 2, 4, 1, None, 3, True, True, True)),
    ("uncapped, one MMA, L2 prefetch, 64 x 16K", 64, 16384,
     LogitsConfig(64, 2, 4, 1, None, 3, True, False, True)),
    ("default, 66 x 12K, keys in L2", 66, 12288, None, True),
    ("prefill config, 66 x 12K, keys in L2", 66, 12288, PREFILL_LIKE, True),
    ("default, 66 x 16K, keys in L2", 66, 16384, None, True),
    # programs of 16 / 64 tiles instead of 32 (the static grid's split): the per-program cost
    ("prefill config, 66 x 6K, 1024 keys per program (one wave)", 66, 6144, PREFILL_LIKE,
     False, 1024),
    ("prefill config, 66 x 24K, 4096 keys per program (one wave)", 66, 24576, PREFILL_LIKE,
     False, 4096),
    ("default, 66 x 8K, 1024 keys per program (one wave)", 66, 8192, None, False, 1024),
    ("default, 66 x 32K, 4096 keys per program (one wave)", 66, 32768, None, False, 4096),
]  # fmt: skip


@contextlib.contextmanager
def keys_in_l2():
    """Every seq's block-table row equal to seq 0's while the case is built (device_ab's
    `hot_pages`, which stays inside that tool's child prelude so it runs with any tree)."""
    original = bench.random_block_table

    def shared(contexts, page_entries, device):
        table, pages = original(contexts, page_entries, device)
        return table[:1].expand_as(table).contiguous(), pages

    bench.random_block_table = shared
    try:
        yield
    finally:
        bench.random_block_table = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--match", default="", help="only the cases whose label holds this")
    args = parser.parse_args()
    device = torch.device("cuda")
    ceilings = Ceilings()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print("| case | kernel us | replay us | check | tiles per SM | us per tile per SM |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for label, seqs, keys, config, *extra in CASES:
        if args.match not in label:
            continue
        hot, split = [*extra, False, DEFAULT_SPLIT][:2]
        logits.DECODE_SPLIT_KEYS = split
        with keys_in_l2() if hot else contextlib.nullcontext():
            result = dense_decode_case(label, 64, 2, [keys] * seqs, 64, ceilings, device,
                                       config=config)  # fmt: skip
        logits.DECODE_SPLIT_KEYS = DEFAULT_SPLIT
        kernel = result.notes.get("kernel_us")
        tiles = seqs * keys / 64 / sms
        per_tile = f"{kernel / tiles:.3f}" if isinstance(kernel, float) else "n/a"
        print(f"| {label} | {kernel} | {result.time_us:.1f} | {result.check} | {tiles:.1f} | "
              f"{per_tile} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
