"""Decode H64 per-tile cost by config, on shapes whose static grid fills whole waves.

    python tools/device_decode_balance.py

The prefill kernel spends ~0.47 us of an SM per 64-key tile at N = 128 (3 programs per SM,
uncapped, one MMA per tile), the H64 decode ~0.57 us (4 programs per SM at a 128-register
cap, two half MMAs per tile) on the same tile work. Timing the decode at 64 x 16K keys mixes
the config with wave quantization (512 programs in 396 slots at 3 per SM), so this times
each config on a batch that fills its slots exactly (66 seqs: 66 x 8 = 528 programs = 4 per
SM; 66 x 6 = 396 = 3 per SM at 12288 keys) and prints the kernel span per tile per SM.
Every case is checked against the reference (as in `graphidx bench`). Needs a CUDA GPU.
"""

from __future__ import annotations

import torch

from graphidx.bench import Ceilings, dense_decode_case
from graphidx.ops.kernels.logits import LogitsConfig

CASES = [
    # (label, seqs, keys per seq, config: None = default)
    ("default (cap 128, halves, L2 prefetch), 64 x 16K", 64, 16384, None),
    ("default, 66 x 16K (4 programs per SM, one wave)", 66, 16384, None),
    ("default, 66 x 12K (3 per SM)", 66, 12288, None),
    ("uncapped, one MMA, L2 prefetch, 66 x 12K (3 per SM)", 66, 12288,
     LogitsConfig(64, 2, 4, 1, None, 3, True, False, True)),
    ("uncapped, one MMA, no L2 prefetch, 66 x 12K", 66, 12288,
     LogitsConfig(64, 2, 4, 1, None, 3, True, False, False)),
    ("uncapped, halves, L2 prefetch, 66 x 12K", 66, 12288,
     LogitsConfig(64, 2, 4, 1, None, 3, True, True, True)),
    ("uncapped, one MMA, L2 prefetch, 64 x 16K", 64, 16384,
     LogitsConfig(64, 2, 4, 1, None, 3, True, False, True)),
]  # fmt: skip


def main() -> None:
    device = torch.device("cuda")
    ceilings = Ceilings()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print("| case | kernel us | replay us | check | tiles per SM | us per tile per SM |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for label, seqs, keys, config in CASES:
        result = dense_decode_case(label, 64, 2, [keys] * seqs, 64, ceilings, device,
                                   config=config)  # fmt: skip
        kernel = result.notes.get("kernel_us")
        tiles = seqs * keys / 64 / sms
        per_tile = f"{kernel / tiles:.3f}" if isinstance(kernel, float) else "n/a"
        print(f"| {label} | {kernel} | {result.time_us:.1f} | {result.check} | {tiles:.1f} | "
              f"{per_tile} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
