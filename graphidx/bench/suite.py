"""The whole suite behind `graphidx bench`: ceilings, every case, the table, the outputs.

A case that raises is reported as FAIL with its error; the others still run.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from graphidx.bench import cases as bench_cases
from graphidx.bench.report import format_table, write_outputs
from graphidx.bench.roofline import (
    NOMINAL_COPY_BYTES_PER_S,
    NOMINAL_MATMUL_FLOPS_PER_S,
    CaseResult,
    Ceilings,
    measure_ceilings,
)

ExtraCases = Callable[[Ceilings, torch.device], list[CaseResult]]
"""More rows for a run (a tile sweep): called with the run's ceilings and device."""


def run_benchmarks(
    device: torch.device, *, quick: bool = False, ceilings: Ceilings | None = None
) -> list[CaseResult]:
    """Every case (quick: 1/4 of the keys and rows); a failing case becomes a FAIL row."""
    ceilings = ceilings or Ceilings()
    div = 4 if quick else 1
    cases: list[tuple[str, Callable[[], list[CaseResult]]]] = [
        ("dense decode H64", lambda: [bench_cases.dense_decode_case(
            "dense decode", 64, 2, [16384 // div] * 64, 64, ceilings, device)]),
        ("dense decode H64 fp8", lambda: [bench_cases.dense_decode_case(
            "dense decode fp8", 64, 2, [16384 // div] * 64, 64, ceilings, device,
            precision="fp8")]),
        ("dense decode H32", lambda: [bench_cases.dense_decode_case(
            "dense decode", 32, 2, [65536 // div] * 64, 128, ceilings, device)]),
        ("dense decode H32 fp8", lambda: [bench_cases.dense_decode_case(
            "dense decode fp8", 32, 2, [65536 // div] * 64, 128, ceilings, device,
            precision="fp8")]),
        ("prefill", lambda: [bench_cases.prefill_case(
            64, 4096 // div, 32768 // div, ceilings, device)]),
        ("prefill fp8", lambda: [bench_cases.prefill_case(
            64, 4096 // div, 32768 // div, ceilings, device, name="prefill chunk fp8",
            precision="fp8")]),
        ("gather", lambda: [bench_cases.gather_case(
            32, 2, 64, 65536 // div, 2048, 8, ceilings, device)]),
        ("gather fp8", lambda: [bench_cases.gather_case(
            32, 2, 64, 65536 // div, 2048, 8, ceilings, device, name="gather fp8",
            precision="fp8")]),
        ("one read", lambda: [bench_cases.logits_read_case(128, 65536, ceilings, device)]),
        ("top-k 512", lambda: bench_cases.topk_cases(
            128, 65536, 512, ceilings, device, one_read())),
        ("top-k 2048", lambda: bench_cases.topk_cases(
            128, 65536, 2048, ceilings, device, one_read())),
        ("skewed decode", lambda: bench_cases.skewed_decode_cases(ceilings, device, scale=div)),
    ]  # fmt: skip
    results: list[CaseResult] = []

    def one_read() -> CaseResult | None:
        """The measured `one read` case, if it ran and passed."""
        found = [r for r in results if r.name == "one read" and r.check == "OK"]
        return found[0] if found else None

    for label, build in cases:
        started = time.time()
        try:
            results.extend(build())
        except Exception as err:  # report and keep going: one broken case must not hide others
            trace = traceback.format_exc(limit=3).strip().splitlines()[-1]
            results.append(CaseResult(label, "-", 0.0, 0.0, 0.0, 0.0, f"FAIL: {err!r}"[:300],
                                      {"trace": trace}))  # fmt: skip
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"  {label}: {time.time() - started:.1f} s", flush=True)
    return results


def run(
    out_dir: Path,
    *,
    quick: bool = False,
    measure: bool = True,
    cases: bool = True,
    extra: ExtraCases | None = None,
) -> list[CaseResult]:
    """Measure the ceilings, run every case (unless `cases` is false) and then `extra`, print
    the table, write JSON + PNG under `out_dir`. RuntimeError without a CUDA/ROCm GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmarks need a CUDA/ROCm GPU")
    device = torch.device("cuda")
    ceilings = Ceilings()
    if measure:
        ceilings = measure_ceilings(device)
        print(
            f"ceilings: copy {(ceilings.measured_copy_bytes_per_s or 0) / 1e12:.2f} TB/s, "
            f"bf16 matmul {(ceilings.measured_matmul_flops_per_s or 0) / 1e12:.0f} TFLOP/s "
            f"(floors use the nominal {NOMINAL_COPY_BYTES_PER_S / 1e12} TB/s, "
            f"{NOMINAL_MATMUL_FLOPS_PER_S / 1e12:.0f} TFLOP/s); one tiny kernel timed like "
            f"the cases: {ceilings.measured_tiny_kernel_us or 0:.2f} us (in every time, in "
            "no floor)",
            flush=True,
        )
    torch.manual_seed(0)  # the same random inputs every run: timings compare across trees
    results = run_benchmarks(device, quick=quick, ceilings=ceilings) if cases else []
    if extra is not None:
        results.extend(extra(ceilings, device))
    print(format_table(results))
    meta = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "quick": quick,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    for path in write_outputs(results, ceilings, out_dir, meta):
        print(f"wrote {path}")
    return results
