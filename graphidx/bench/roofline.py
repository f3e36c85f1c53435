"""The roofline the cases are measured against: the device's ceilings, a case's floor, its
result.

    floor = max(bytes / copy bandwidth, flops / tensor-core throughput)

Floors use the nominal ceilings of the H200: 4.3 TB/s, and 1435 TFLOP/s, the e4m3 tensor-core
rate (e4m3 holds every e2m1 value exactly, so that is the rate the MXFP4 logits could reach
in either precision). The measured copy bandwidth and bf16 matmul throughput are reported
beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graphidx.bench.timing import time_case, time_us, time_us_graph

NOMINAL_COPY_BYTES_PER_S = 4.3e12
NOMINAL_MATMUL_FLOPS_PER_S = 1435e12


@dataclass(frozen=True)
class Ceilings:
    """The device's copy bandwidth and tensor-core throughput (nominal: the floors' e4m3
    rate; measured beside them: a copy and a bf16 matmul), and the time of one tiny kernel
    under the cases' timing."""

    copy_bytes_per_s: float = NOMINAL_COPY_BYTES_PER_S
    matmul_flops_per_s: float = NOMINAL_MATMUL_FLOPS_PER_S
    measured_copy_bytes_per_s: float | None = None
    measured_matmul_flops_per_s: float | None = None
    measured_tiny_kernel_us: float | None = None
    """One tiny kernel timed like every case (`time_us_graph`): the fixed cost each case's
    time carries (launch, events) and no floor counts (about 4.6 us on the H200)."""


@dataclass
class CaseResult:
    """One timed kernel launch and its roofline floor."""

    name: str
    shape: str
    time_us: float
    bytes_moved: float
    flops: float
    floor_us: float
    check: str
    notes: dict[str, Any] = field(default_factory=dict)
    variant: bool = False
    """A sweep point or an alternative config of a case (in the table and the JSON, not in the
    plot)."""
    reference: bool = False
    """A yardstick, not a graphidx op (torch.topk, the bare `one read`): gray in the plot, as
    is any row without a check."""

    @property
    def tbps(self) -> float:
        return self.bytes_moved / (self.time_us * 1e-6) / 1e12 if self.time_us > 0 else 0.0

    @property
    def tflops(self) -> float:
        return self.flops / (self.time_us * 1e-6) / 1e12 if self.time_us > 0 else 0.0

    @property
    def pct_of_floor(self) -> float:
        """100 = at the floor; 50 = twice the floor."""
        return 100.0 * self.floor_us / self.time_us if self.time_us > 0 else 0.0


def floor_us(bytes_moved: float, flops: float, ceilings: Ceilings) -> float:
    """max(bytes / bandwidth, flops / matmul throughput), in microseconds."""
    return 1e6 * max(bytes_moved / ceilings.copy_bytes_per_s, flops / ceilings.matmul_flops_per_s)


def timed_result(
    name: str,
    shape: str,
    run: Callable[[], object],
    bytes_moved: float,
    flops: float,
    ceilings: Ceilings,
    check: str,
    notes: dict[str, Any] | None = None,
    *,
    reference: bool = False,
) -> CaseResult:
    """A case's row: `run` timed by `time_case`, beside its floor (`floor_us`); the notes are
    `notes` (when given) with the timing's notes added over them."""
    elapsed, timing = time_case(run)
    floor = floor_us(bytes_moved, flops, ceilings)
    notes = {**(notes or {}), **timing}
    return CaseResult(
        name, shape, elapsed, bytes_moved, flops, floor, check, notes, reference=reference
    )


def measure_ceilings(device: torch.device) -> Ceilings:
    """The nominal ceilings with measured ones beside them: a 1 GiB device copy (read +
    write), an 8192^3 bf16 matmul, and one tiny kernel (one float incremented) timed as the
    cases are."""
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = time_us(lambda: dst.copy_(src)) * 1e-6
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_s = time_us(lambda: a @ b) * 1e-6
    one = torch.zeros(1, device=device)
    return Ceilings(
        measured_copy_bytes_per_s=2 * size / copy_s,
        measured_matmul_flops_per_s=2 * n**3 / mm_s,
        measured_tiny_kernel_us=time_us_graph(lambda: one.add_(1)),
    )
