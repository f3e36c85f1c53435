"""The bench's cases: each builds random inputs at full size on the GPU, checks a Triton kernel
against the torch reference (on a sample of rows where the reference would be slow), times it
(`time_case`) and returns a `CaseResult` beside its floor.

`bytes` counts every input read once plus the output written once (an MXFP4 key is 68 bytes at
D = 128, logits are float32, only the visible columns count) and `flops` counts
2 * heads * head_dim per scored (row, key) pair.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from graphidx.bench.checks import check_topk_picks, chunk_maxima, compare_logits
from graphidx.bench.inputs import random_block_table, random_kv_cache, random_queries
from graphidx.bench.roofline import CaseResult, Ceilings, floor_us, timed_result
from graphidx.bench.timing import synchronize, time_case, time_us
from graphidx.config import cdiv
from graphidx.mxfp4 import cache_layout

HEAD_DIM = 128
CHECK_SEQS = 4
ENTRY_BYTES = cache_layout(1, HEAD_DIM, 64).entry_bytes
"""Bytes of one MXFP4 key (and of one query head): codes and scales, 68 at D = 128."""


def _logits_bytes_flops(
    row_lens: list[int], seq_keys: int, rows: int, num_heads: int
) -> tuple[float, float]:
    written = sum(row_lens)
    bytes_moved = (
        seq_keys * ENTRY_BYTES  # K read once
        + rows * num_heads * (ENTRY_BYTES + 4)  # q, q_scale, weights
        + written * 4  # logits
    )
    flops = 2.0 * written * num_heads * HEAD_DIM
    return float(bytes_moved), flops


def _paged_inputs(
    contexts: list[int], rows: int, num_heads: int, page_entries: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """`(block_table, kv_cache, q, q_scale, weights, context_lens)`: a logits case's random
    inputs, one seq per context over shuffled pages of `page_entries` keys and `rows` query
    rows of `num_heads` heads of HEAD_DIM (drawn in that order)."""
    table, pages = random_block_table(contexts, page_entries, device)
    kv = random_kv_cache(pages, num_heads, HEAD_DIM, page_entries, device)
    q, q_scale, weights = random_queries(rows, num_heads, HEAD_DIM, device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return table, kv, q, q_scale, weights, context_lens


def dense_decode_case(
    name: str,
    num_heads: int,
    next_n: int,
    contexts: list[int],
    page_entries: int,
    ceilings: Ceilings,
    device: torch.device,
    *,
    use_schedule: bool = False,
    config: object | None = None,
    precision: str = "exact",
) -> CaseResult:
    from graphidx.ops import paged_mqa_logits
    from graphidx.ops.kernels import logits as triton_logits
    from graphidx.ops.schedule import allocate_schedule, build_decode_schedule

    seqs = len(contexts)
    rows = seqs * next_n
    width = max(contexts)
    table, kv, q, q_scale, weights, context_lens = _paged_inputs(
        contexts, rows, num_heads, page_entries, device
    )
    ends = [c - (next_n - 1 - j) for c in contexts for j in range(next_n)]
    row_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    out = torch.full((rows, width), float("nan"), device=device)
    schedule = None
    notes: dict[str, Any] = {}
    if use_schedule:
        schedule = allocate_schedule(seqs, width, device)
        build_decode_schedule(row_ends, schedule, next_n=next_n, backend="triton")
        notes["schedule_items"] = int(schedule[0])
        notes["schedule_build_us"] = round(
            time_us(
                lambda: build_decode_schedule(row_ends, schedule, next_n=next_n, backend="triton")
            ),
            2,
        )

    def run() -> None:
        triton_logits.paged_mqa_logits(
            q, q_scale, kv, weights, context_lens, table, row_ends, out,
            next_n=next_n, schedule=schedule, page_entries=page_entries, precision=precision,
            config=config,  # type: ignore[arg-type]
        )  # fmt: skip

    run()
    synchronize(device)
    sample = slice(0, min(CHECK_SEQS, seqs) * next_n)
    want = torch.full((sample.stop, width), float("nan"), device=device)
    paged_mqa_logits(
        q[sample], q_scale[sample], kv, weights[sample], context_lens[: sample.stop // next_n],
        table[: sample.stop // next_n], row_ends[sample], want,
        next_n=next_n, page_entries=page_entries, backend="reference",
    )  # fmt: skip
    check = compare_logits(out[sample], want, precision)
    row_lens = [max(0, min(end, contexts[r // next_n])) for r, end in enumerate(ends)]
    bytes_moved, flops = _logits_bytes_flops(row_lens, sum(contexts), rows, num_heads)
    shape = f"H{num_heads} next_n {next_n}, {seqs} seqs, {sum(contexts)} keys, {precision}"
    return timed_result(name, shape, run, bytes_moved, flops, ceilings, check, notes)


def prefill_case(
    num_heads: int,
    rows: int,
    context: int,
    ceilings: Ceilings,
    device: torch.device,
    *,
    name: str = "prefill chunk",
    config: object | None = None,
    precision: str = "exact",
) -> CaseResult:
    from graphidx.ops import paged_mqa_logits
    from graphidx.ops.kernels import logits as triton_logits

    page_entries = 64
    table, kv, q, q_scale, weights, context_lens = _paged_inputs(
        [context], rows, num_heads, page_entries, device
    )
    # The chunk's rows are the last `rows` tokens of the request (causal ends).
    ends = [context - rows + r + 1 for r in range(rows)]
    row_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, rows], dtype=torch.int32, device=device)
    out = torch.empty((rows, context), device=device)

    def run() -> None:
        triton_logits.paged_mqa_logits(
            q, q_scale, kv, weights, context_lens, table, row_ends, out,
            query_start_loc=qsl, page_entries=page_entries, precision=precision,
            config=config,  # type: ignore[arg-type]
        )  # fmt: skip

    out.fill_(float("nan"))
    run()
    synchronize(device)
    checks = []
    for first in (0, rows - 8):
        part = slice(first, first + 8)
        want = torch.full((8, context), float("nan"), device=device)
        paged_mqa_logits(
            q[part], q_scale[part], kv, weights[part], context_lens, table, row_ends[part], want,
            query_start_loc=torch.tensor([0, 8], dtype=torch.int32, device=device),
            page_entries=page_entries, backend="reference",
        )  # fmt: skip
        checks.append(compare_logits(out[part], want, precision))
    check = next((c for c in checks if c != "OK"), "OK")
    bytes_moved, flops = _logits_bytes_flops(ends, context, rows, num_heads)
    shape = f"H{num_heads}, {rows} rows x {context} keys (causal), {precision}"
    return timed_result(name, shape, run, bytes_moved, flops, ceilings, check)


def gather_case(
    num_heads: int,
    next_n: int,
    seqs: int,
    context: int,
    pool_blocks: int,
    block_size: int,
    ceilings: Ceilings,
    device: torch.device,
    *,
    name: str = "gather",
    config: object | None = None,
    precision: str = "exact",
) -> CaseResult:
    from graphidx.ops import gather_mqa_logits, resolve_candidate_pool
    from graphidx.ops.kernels import gather as triton_gather

    page_entries = 128
    rows = seqs * next_n
    contexts = [context] * seqs
    table, kv, q, q_scale, weights, context_lens = _paged_inputs(
        contexts, rows, num_heads, page_entries, device
    )
    row_ends = torch.tensor(
        [context - (next_n - 1 - j) for _ in range(seqs) for j in range(next_n)],
        dtype=torch.int32, device=device,
    )  # fmt: skip
    blocks = cdiv(context, block_size)
    block_ids = torch.argsort(torch.rand(rows, blocks, device=device), dim=1)[:, :pool_blocks]
    positions = torch.empty((rows, pool_blocks), dtype=torch.int32, device=device)
    live = torch.empty(rows, dtype=torch.int32, device=device)
    resolve_candidate_pool(
        block_ids.to(torch.int32), row_ends, block_size, positions, live, backend="triton"
    )
    width = pool_blocks * block_size
    out = torch.full((rows, width), float("nan"), device=device)

    def launch(backend: str, seq_count: int, target: torch.Tensor) -> None:
        part = slice(0, seq_count * next_n)
        gather_mqa_logits(
            q[part], q_scale[part], kv, weights[part], context_lens[:seq_count],
            table[:seq_count], positions[part], live[part], target,
            candidate_block_size=block_size, next_n=next_n, page_entries=page_entries,
            backend=backend,
        )  # fmt: skip

    def run() -> None:
        triton_gather.gather_mqa_logits(
            q, q_scale, kv, weights, context_lens, table, positions, live, out,
            candidate_block_size=block_size, next_n=next_n, page_entries=page_entries,
            precision=precision, config=config,  # type: ignore[arg-type]
        )  # fmt: skip

    run()
    synchronize(device)
    want = torch.full((CHECK_SEQS * next_n, width), float("nan"), device=device)
    launch("reference", CHECK_SEQS, want)
    check = compare_logits(out[: CHECK_SEQS * next_n], want, precision)
    scored = rows * width
    bytes_moved = float(
        scored * ENTRY_BYTES  # every gathered key read once per row
        + rows * pool_blocks * 4  # positions
        + rows * num_heads * (ENTRY_BYTES + 4)
        + scored * 4
    )
    flops = 2.0 * scored * num_heads * HEAD_DIM
    shape = (
        f"H{num_heads}, {rows} rows x {width} cols (C={block_size}), context {context}, {precision}"
    )
    return timed_result(name, shape, run, bytes_moved, flops, ceilings, check)


TOPK_SPLITS = (1, 2, 4, 8, 16)
"""Programs per row the top-k case also times besides the default config's."""
TOPK_MAX_REGISTERS = 80
"""The register cap the top-k case also times (3 programs of 8 warps per multiprocessor)."""


READ_CONFIGS = ((4096, 4, 8), (4096, 8, 8), (8192, 4, 16), (2048, 16, 4))
"""(elements per step, steps per program, warps) tried by `logits_read_case`."""


def logits_read_case(rows: int, width: int, ceilings: Ceilings, device: torch.device) -> CaseResult:
    """`one read`: the fastest of READ_CONFIGS of a Triton pass that reads `rows x width`
    float32 once (a max per program, a few KB written), timed like every case: the measured
    "one read of the logits" beside the nominal one (bytes / copy bandwidth), with the same
    fixed cost per replay in it as the top-k's own time; its `kernel_us` is the shortest
    device span of the configs. Each config's partial maxima are checked against torch's."""
    from graphidx.bench.read_kernel import read_max_kernel

    logits = torch.randn(rows, width, device=device)
    n = logits.numel()
    times: dict[str, float] = {}
    kernels: dict[str, float | str] = {}
    check = "OK"
    for block, steps, warps in READ_CONFIGS:
        partial = torch.full((cdiv(n, block * steps),), float("nan"), device=device)

        def run(
            partial: torch.Tensor = partial,
            block: int = block,
            steps: int = steps,
            warps: int = warps,
        ) -> None:
            read_max_kernel[(partial.numel(),)](logits, partial, n, BLOCK=block, STEPS=steps,
                                                 num_warps=warps)  # fmt: skip

        run()
        synchronize(device)
        if not torch.equal(partial, chunk_maxima(logits, block * steps)):
            check = f"FAIL: wrong maxima at {block} x {steps}"
        label = f"{block}x{steps} w{warps}"
        elapsed, timing = time_case(run)
        times[label], kernels[label] = round(elapsed, 1), timing["kernel_us"]
    bytes_moved = float(n * 4)
    spans = [span for span in kernels.values() if isinstance(span, float)]
    return CaseResult(
        "one read", f"{rows} rows x {width} cols float32", min(times.values()), bytes_moved,
        0.0, floor_us(bytes_moved, 0.0, ceilings), check,
        {"kernel_us": min(spans) if spans else next(iter(kernels.values())),
         "configs_us": times, "configs_kernel_us": kernels},
        reference=True,
    )  # fmt: skip


def topk_cases(
    rows: int,
    width: int,
    k: int,
    ceilings: Ceilings,
    device: torch.device,
    measured_read: CaseResult | None = None,
    *,
    variants: bool = True,
) -> list[CaseResult]:
    """Rows: `top-k {k}` (the default config, through the op); with `variants` also `top-k
    {k} P={p}` for each other P in TOPK_SPLITS (`split_config(k, P)`), `top-k {k} P={default
    P} warps={w}` (the default config with 8 warps, or 4 when it has 8, the same columns per
    thread), `... maxnreg=80` (with the register cap TOPK_MAX_REGISTERS) and `torch.topk
    {k}`. Each
    top-k row notes its time in reads of the logits: replay time over the nominal read
    (`x_one_read`, bytes / copy bandwidth) and, given `measured_read` (`logits_read_case`),
    over the measured read's (`x_measured_read`); device spans (`kernel_us`) over the nominal
    read (`x_kernel_one_read`) and over the measured read's span (`x_kernel_read`)."""
    from graphidx.ops import topk_per_row
    from graphidx.ops.kernels import topk as triton_topk

    logits = torch.randn(rows, width, device=device)
    lengths = torch.full((rows,), width, dtype=torch.int32, device=device)
    want_values = torch.topk(logits, k, dim=1).values.sort(dim=1).values
    bytes_moved = float(rows * width * 4 + rows * k * 4)
    read_us = 1e6 * rows * width * 4 / ceilings.copy_bytes_per_s
    shape = f"{rows} rows x {width} cols, k {k}"
    torch_us, torch_timing = time_case(lambda: torch.topk(logits, k, dim=1))
    default = triton_topk.default_config(k, rows, width)

    def case(name: str, run: Callable[[torch.Tensor], None], config: Any) -> CaseResult:
        out = torch.full((rows, k), -7, dtype=torch.int32, device=device)
        run(out)
        synchronize(device)
        check = check_topk_picks(logits, out, want_values)
        elapsed, timing = time_case(lambda: run(out))
        return CaseResult(
            name, shape, elapsed, bytes_moved, 0.0, floor_us(bytes_moved, 0.0, ceilings), check,
            {**timing, "vs_torch_topk": round(torch_us / elapsed, 2),
             **read_multiples(elapsed, timing["kernel_us"], read_us, measured_read),
             "config": f"P={config.programs_per_row} groups={config.groups} "
                       f"cap={config.capacity} warps={config.num_warps} chunk={config.chunk} "
                       f"maxnreg={config.max_registers}"},
        )  # fmt: skip

    results = [
        case(f"top-k {k}", lambda out: topk_per_row(logits, lengths, k, out, backend="triton"),
             default),
    ]  # fmt: skip
    if not variants:
        return results
    for split in TOPK_SPLITS:
        if split == default.programs_per_row:
            continue
        config = triton_topk.split_config(k, split)
        label = f"top-k {k} P={split}"

        def run(out: torch.Tensor, config: Any = config) -> None:
            triton_topk.topk_per_row(logits, lengths, k, out, config=config)

        results.append(variant_point(label, functools.partial(case, label, run, config)))
    warps = 8 if default.num_warps != 8 else 4  # another warp count, at the default P
    configs = {
        f"warps={warps}": replace(
            default, num_warps=warps, chunk=default.chunk * warps // default.num_warps
        ),
        f"maxnreg={TOPK_MAX_REGISTERS}": replace(default, max_registers=TOPK_MAX_REGISTERS),
    }
    for suffix, config in configs.items():
        label = f"top-k {k} P={default.programs_per_row} {suffix}"

        def run_variant(out: torch.Tensor, config: Any = config) -> None:
            triton_topk.topk_per_row(logits, lengths, k, out, config=config)

        results.append(variant_point(label, functools.partial(case, label, run_variant, config)))
    results.append(
        CaseResult(
            f"torch.topk {k}", shape, torch_us, bytes_moved, 0.0,
            floor_us(bytes_moved, 0.0, ceilings), "-", torch_timing, reference=True,
        )
    )  # fmt: skip
    return results


def read_multiples(
    replay: float, kernel: float | str, nominal_read: float, measured_read: CaseResult | None
) -> dict[str, float]:
    """A top-k's `replay` time and device span `kernel` (us) in reads of its logits, for
    `topk_cases`' notes; the kernel ones only where both spans are numbers."""
    found = {"x_one_read": round(replay / nominal_read, 2)}
    if isinstance(kernel, float):
        found["x_kernel_one_read"] = round(kernel / nominal_read, 2)
    if measured_read is not None:
        found["x_measured_read"] = round(replay / measured_read.time_us, 2)
        read_kernel = measured_read.notes.get("kernel_us")
        if isinstance(kernel, float) and isinstance(read_kernel, float):
            found["x_kernel_read"] = round(kernel / read_kernel, 2)
    return found


def skewed_decode_cases(
    ceilings: Ceilings, device: torch.device, *, scale: int = 1
) -> list[CaseResult]:
    """One 128K-key request + 63 of 1K vs the same keys spread evenly (64 heads, next_n 2)."""
    long_keys, short_keys, seqs = 131072 // scale, 1024 // scale, 64
    skewed = [long_keys] + [short_keys] * (seqs - 1)
    even = [sum(skewed) // seqs] * seqs
    results = [
        dense_decode_case("decode skewed (schedule)", 64, 2, skewed, 64, ceilings, device,
                          use_schedule=True),
        dense_decode_case("decode even (schedule)", 64, 2, even, 64, ceilings, device,
                          use_schedule=True),
        dense_decode_case("decode skewed (static)", 64, 2, skewed, 64, ceilings, device),
    ]  # fmt: skip
    results[0].notes["vs_even"] = round(results[0].time_us / results[1].time_us, 2)
    return results


def variant_point(label: str, build: Callable[[], CaseResult]) -> CaseResult:
    """`build()` marked as a variant; a config that cannot compile or run is a FAIL row."""
    try:
        result = build()
    except Exception as err:  # a config that cannot compile or run is a data point
        result = CaseResult(label, "-", 0.0, 0.0, 0.0, 0.0, f"FAIL: {err!r}"[:200])
    result.variant = True
    return result
