"""Kernel benchmarks against the roofline, behind `graphidx bench` and tools/device_kernels.py.

Each case checks a Triton kernel against the torch reference at full size on the GPU, times it
as graphidx runs it (one CUDA-graph replay, L2 emptied first) and compares it with its floor,
max(bytes / copy bandwidth, flops / bf16 matmul throughput).

- `timing`: replay timing, device spans; `roofline`: ceilings, floors, `CaseResult`;
- `inputs`: random caches, queries and block tables; `checks`: kernel output vs reference;
- `cases`: the cases; `suite`: the whole run; `report`: table, kernels.json, plot;
- `read_kernel`: the `one read` yardstick kernel (imported by its case only: it needs Triton).
"""

from graphidx.bench.cases import (
    dense_decode_case,
    gather_case,
    logits_read_case,
    prefill_case,
    skewed_decode_cases,
    topk_cases,
    variant_point,
)
from graphidx.bench.inputs import random_block_table, random_kv_cache, random_queries
from graphidx.bench.report import format_table, plot_roofline, read_outputs, replot, write_outputs
from graphidx.bench.roofline import CaseResult, Ceilings, floor_us, measure_ceilings
from graphidx.bench.suite import run, run_benchmarks
from graphidx.bench.timing import kernel_span_us, time_case, time_us, time_us_graph

__all__ = [
    "CaseResult",
    "Ceilings",
    "dense_decode_case",
    "floor_us",
    "format_table",
    "gather_case",
    "kernel_span_us",
    "logits_read_case",
    "measure_ceilings",
    "plot_roofline",
    "prefill_case",
    "random_block_table",
    "random_kv_cache",
    "random_queries",
    "read_outputs",
    "replot",
    "run",
    "run_benchmarks",
    "skewed_decode_cases",
    "time_case",
    "time_us",
    "time_us_graph",
    "topk_cases",
    "variant_point",
    "write_outputs",
]
