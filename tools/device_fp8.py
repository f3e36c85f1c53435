"""H200 script: the fp8 precision of the logits — the tensor cores' accumulation, the error
and top-k recall per data kind, and exact vs fp8 timings of the bench's logits cases.

    python tools/device_fp8.py [--quick] [--out DIR]

1. Accumulation probe: one e4m3 MMA sums 2**16 and 2**-e (in the same 32-element k chunk,
   and in another chunk) for e = -8 .. 18; the largest e up to which every term survives,
   plus 16, is the number of bits the accumulation keeps below the largest term.
2. `graphidx.bench.precision.measure_precision` at H64 and H32 (8 rows x 16384 keys).
3. The bench's dense decode (H64 64 x 16K, H32 64 x 64K; static grid and with the decode
   schedule), prefill (H64 4096 x 32K) and gather (H32 128 rows x 16K) cases in both
   precisions, each checked against the reference first.
Prints the tables; writes `fp8.json` under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from graphidx.bench.cases import dense_decode_case, gather_case, prefill_case
from graphidx.bench.precision import format_precision, measure_precision
from graphidx.bench.report import format_table
from graphidx.bench.roofline import measure_ceilings
from graphidx.ops.kernels.gather import GatherConfig
from graphidx.ops.kernels.logits import LogitsConfig

PROBE_EXPONENTS = range(-8, 19)


@triton.jit
def _mma_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m = tl.arange(0, M)
    n = tl.arange(0, N)
    k = tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :]).to(tl.float8e4nv, bitcast=True)
    b = tl.load(b_ptr + k[:, None] * N + n[None, :]).to(tl.float8e4nv, bitcast=True)
    tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


def accumulation_probe(device: torch.device) -> dict[str, int]:
    """Bits kept below the largest term (23 would be float32's), within one k chunk of 32
    and across chunks: row r sums 2**16 and 2**-e, e = r - 8, as e4m3 products (the small
    term a product 2**(-e - 9) * 2**9 ... 2**(9 - e) * 2**-9, each factor in e4m3 range)."""
    rows, cols, depth = 64, 64, 64
    a = torch.zeros((rows, depth))
    b = torch.zeros((depth, cols))
    a[:, 0] = 256.0
    b[0, 0] = b[0, 1] = 256.0
    b[1, 0] = b[33, 1] = 2.0**-9  # small terms with e >= 1
    b[2, 0] = b[34, 1] = 2.0**8  # small terms with e <= 0
    for r, e in enumerate(PROBE_EXPONENTS):
        column = 1 if e >= 1 else 2
        a[r, column] = a[r, column + 32] = 2.0 ** ((9 - e) if e >= 1 else (-e - 8))
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn)
    exact = a8.double() @ b8.double()
    assert bool((exact[: len(PROBE_EXPONENTS), 0] == 2.0**16 + torch.pow(2.0, -torch.tensor(
        list(PROBE_EXPONENTS), dtype=torch.float64))).all())  # fmt: skip
    out = torch.empty((rows, cols), device=device)
    _mma_kernel[(1,)](
        a8.view(torch.int8).to(device), b8.view(torch.int8).to(device), out, rows, cols, depth
    )
    got = out.cpu().double()
    kept = {}
    for col, label in ((0, "same chunk"), (1, "other chunk")):
        surviving = [
            e for r, e in enumerate(PROBE_EXPONENTS) if float(got[r, col]) == float(exact[r, col])
        ]
        # The largest e such that every smaller e survives too.
        last = PROBE_EXPONENTS[0] - 1
        for e in PROBE_EXPONENTS:
            if e not in surviving:
                break
            last = e
        kept[label] = 16 + last
    return kept


def timing_cases(device: torch.device, quick: bool) -> list:  # type: ignore[type-arg]
    ceilings = measure_ceilings(device)
    div = 4 if quick else 1
    results = []
    for precision in ("exact", "fp8"):
        label = "" if precision == "exact" else " fp8"
        results += [
            dense_decode_case(f"decode H64{label}", 64, 2, [16384 // div] * 64, 64, ceilings,
                              device, precision=precision),
            dense_decode_case(f"decode H64 sched{label}", 64, 2, [16384 // div] * 64, 64,
                              ceilings, device, use_schedule=True, precision=precision),
            dense_decode_case(f"decode H32{label}", 32, 2, [65536 // div] * 64, 128, ceilings,
                              device, precision=precision),
            dense_decode_case(f"decode H32 sched{label}", 32, 2, [65536 // div] * 64, 128,
                              ceilings, device, use_schedule=True, precision=precision),
            prefill_case(64, 4096 // div, 32768 // div, ceilings, device,
                         name=f"prefill{label}", precision=precision),
            gather_case(32, 2, 64, 65536 // div, 2048, 8, ceilings, device,
                        name=f"gather{label}", precision=precision),
        ]  # fmt: skip
        torch.cuda.empty_cache()
    # fp8 config variants around the defaults (BENCHMARKS.md "fp8 precision"): the H64
    # default is one MMA capped at 168 registers; against it the exact mode's cap 128 with
    # halves, and 3 persistent programs per SM (what 168 registers hold); the gather's
    # uncapped and 64-key-tile configs.
    fp8_h64 = LogitsConfig(64, 2, 4, 1, 168, 4, True, False, True)
    h64 = (64, 2, [16384 // div] * 64, 64, ceilings, device)
    results += [
        dense_decode_case("decode H64 sched fp8 cap128 halves", *h64, use_schedule=True,
                          precision="fp8",
                          config=dataclasses.replace(fp8_h64, max_registers=128, halves=True)),
        dense_decode_case("decode H64 sched fp8 3 per SM", *h64, use_schedule=True,
                          precision="fp8", config=dataclasses.replace(fp8_h64, programs_per_sm=3)),
        gather_case(32, 2, 64, 65536 // div, 2048, 8, ceilings, device,
                    name="gather fp8 uncapped", precision="fp8",
                    config=GatherConfig(128, 4, 1, True, None, 2048)),
        gather_case(32, 2, 64, 65536 // div, 2048, 8, ceilings, device,
                    name="gather fp8 64-key tiles", precision="fp8",
                    config=GatherConfig(64, 4, 1, True, None, 2048)),
    ]  # fmt: skip
    for result in results[-4:]:
        result.variant = True
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("out/device_fp8"))
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    probe = accumulation_probe(device)
    print(f"accumulation keeps bits below the largest term: {probe}", flush=True)
    precision = {}
    for heads in (64, 32):
        rows = measure_precision(device, seqs=8, keys=4096 if args.quick else 16384,
                                 num_heads=heads)  # fmt: skip
        precision[heads] = rows
        print(format_precision(rows), flush=True)
    results = timing_cases(device, args.quick)
    print(format_table(results), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": torch.cuda.get_device_name(device),
        "probe": probe,
        "precision": {h: [dataclasses.asdict(r) for r in rows] for h, rows in precision.items()},
        "cases": [dataclasses.asdict(r) for r in results],
    }
    (args.out / "fp8.json").write_text(json.dumps(payload, indent=1))
    failed = [r.name for r in results if r.check != "OK"]
    if failed:
        print(f"FAILED checks: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
