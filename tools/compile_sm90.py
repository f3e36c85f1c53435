"""Compile the logits kernels for sm_90 on a machine without a GPU and count their SASS.

    python tools/compile_sm90.py [--case decode64|topk512 ...] [--config F,F,...] [--out DIR]
        [--loads]

Device time is scarce; instruction counts are not. This runs the real launchers
(`graphidx.ops.kernels.logits.paged_mqa_logits`) on small CPU tensors shaped like the H200
cases of tools/ncu.py, with Triton's driver replaced by one that reports an sm_90
target and launches nothing, so every kernel is compiled exactly as on the H200 (same
constexprs, same argument specialization) by the local Triton and its bundled ptxas. For each
compiled kernel it prints registers, shared memory and, for the hottest loop (the shortest
loop holding an MMA, else the longest), the instruction count by opcode; `--out` keeps
TTGIR, PTX and SASS. `--loads` adds, for every loop, where each load's result is first
read: a load read in the iteration that issued it is waited for there, whatever the
source meant to prefetch (docs/perf-notes.md has an example: the top-k's streaming pass).

Use the Triton version the H200 has (3.6) for numbers that transfer: a venv with
`pip install torch==2.13.0 numpy triton==3.6.0` works on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from graphidx.bench.inputs import random_block_table, random_kv_cache, random_queries
from graphidx.ops.kernels import gather as triton_gather
from graphidx.ops.kernels import logits as triton_logits
from graphidx.ops.kernels import topk as triton_topk
from graphidx.ops.kernels import topk_radix as triton_topk_radix
from graphidx.ops.kernels.gather import GatherConfig
from graphidx.ops.kernels.logits import LogitsConfig
from graphidx.ops.schedule import allocate_schedule, build_decode_schedule

HEAD_DIM = 128
CASES = {
    # name: (heads, next_n, seqs or prefill rows, keys per seq, page_entries); next_n 0 = prefill
    "decode64": (64, 2, 64, 16384, 64),
    "decode32": (32, 2, 64, 65536, 128),
    "prefill": (64, 0, 4096, 32768, 64),
    "gather": (32, 2, 64, 65536, 128),  # pool of 2048 blocks of C = 8 per row
}
TOPK_CASES = {
    "topk512": (512, 128, 65536),
    "topk2048": (2048, 128, 65536),
    "topk512r16": (512, 16, 65536),
    "topk2048w8256": (2048, 2, 8256),
    "topk2048w8192": (2048, 2, 8192),
    "topk2048w1m": (2048, 1, 1 << 20),
    "topk512w16384": (512, 2, 16384),
    "topk2048r2w65600": (2048, 2, 65600),
}
"""name: (k, rows, columns); 16 rows of 65536 take the split path (P = 8), the narrow rows
the whole-row kernel (V3.2's decode rows at an 8K context: W_PAD 16384 and 8192; the V4.1
consumers' compact rows: 16384 columns at k 512); two rows of 65600 at k 2048 split (P = 16)."""
GATHER_POOL_BLOCKS, GATHER_BLOCK_SIZE = 2048, 8
SMALL_KEYS = 512  # the compiled code depends on shapes' strides and divisibility, not sizes


class _Sm90Driver:
    """Just enough of a Triton driver to compile for sm_90 and launch nothing."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _compile_only(self: JITFunction, *args: object, grid: object, warmup: bool, **kw: object):
    return _ORIGINAL_RUN(self, *args, grid=grid, warmup=True, **kw)


_ORIGINAL_RUN = JITFunction.run


def compile_gather(config: GatherConfig | None, precision: str = "exact") -> None:
    """The gather case's launcher on CPU tensors (positions all valid, one page each)."""
    heads, next_n, seqs, _, page_entries = CASES["gather"]
    rows, keys = seqs * next_n, SMALL_KEYS
    device = torch.device("cpu")
    table, pages = random_block_table([keys] * seqs, page_entries, device)
    kv = random_kv_cache(pages, heads, HEAD_DIM, page_entries, device)
    q, q_scale, weights = random_queries(rows, heads, HEAD_DIM, device)
    positions = torch.zeros((rows, GATHER_POOL_BLOCKS), dtype=torch.int32)
    live = torch.full((rows,), GATHER_POOL_BLOCKS * GATHER_BLOCK_SIZE, dtype=torch.int32)
    out = torch.empty((rows, GATHER_POOL_BLOCKS * GATHER_BLOCK_SIZE))
    triton_gather.gather_mqa_logits(
        q, q_scale, kv, weights, torch.full((seqs,), keys, dtype=torch.int32), table,
        positions, live, out, candidate_block_size=GATHER_BLOCK_SIZE, next_n=next_n,
        page_entries=page_entries, precision=precision, config=config,
    )  # fmt: skip


def compile_topk(k: int, rows: int, width: int) -> None:
    """The top-k launcher at rows x width, default config."""
    logits = torch.zeros((rows, width))
    lengths = torch.full((rows,), width, dtype=torch.int32)
    triton_topk.topk_per_row(logits, lengths, k, torch.empty((rows, k), dtype=torch.int32))


def compile_case(name: str, config: LogitsConfig | None = None, precision: str = "exact") -> None:
    """Run the case's launcher on CPU tensors: compiles (and caches) its kernels for sm_90."""
    heads, next_n, count, keys, page_entries = CASES[name]
    prefill = next_n == 0
    keys = max(SMALL_KEYS, page_entries)
    rows = 64 if prefill else count * next_n
    contexts = [keys] if prefill else [keys] * count
    device = torch.device("cpu")
    table, pages = random_block_table(contexts, page_entries, device)
    kv = random_kv_cache(pages, heads, HEAD_DIM, page_entries, device)
    q, q_scale, weights = random_queries(rows, heads, HEAD_DIM, device)
    context_lens = torch.tensor(contexts, dtype=torch.int32)
    row_ends = torch.full((rows,), keys, dtype=torch.int32)
    out = torch.empty((rows, keys))
    grouping = (
        {"query_start_loc": torch.tensor([0, rows], dtype=torch.int32)}
        if prefill
        else {"next_n": next_n}
    )
    schedules: list[torch.Tensor | None] = [None]
    if not prefill:
        built = allocate_schedule(count, keys, device)
        build_decode_schedule(row_ends, built, next_n=next_n, backend="reference")
        schedules.append(built)
    for schedule in schedules:
        triton_logits.paged_mqa_logits(
            q, q_scale, kv, weights, context_lens, table, row_ends, out, schedule=schedule,
            page_entries=page_entries, precision=precision, config=config, **grouping,
        )  # fmt: skip


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def loop_bodies(sass: str) -> list[list[str]]:
    """Every loop body of a SASS listing: the lines from a backward BRA's target through the
    branch, in listing order."""
    lines = sass.splitlines()
    address = {}
    for index, line in enumerate(lines):
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)
        if found:
            address[int(found.group(1), 16)] = index
    bodies = []
    for index, line in enumerate(lines):
        found = re.search(r"/\*([0-9a-f]{4,})\*/.*\bBRA\b.*?0x([0-9a-f]+)", line)
        if not found:
            continue
        here, target = int(found.group(1), 16), int(found.group(2), 16)
        if target < here and target in address:
            bodies.append(lines[address[target] : index + 1])
    return bodies


def hottest_loop(sass: str) -> list[str]:
    """Instructions of the key-tile loop: the shortest loop body holding a tensor-core
    instruction, else the longest loop body."""
    bodies = loop_bodies(sass)
    if not bodies:
        return []
    with_mma = [body for body in bodies if any("MMA" in line for line in body)]
    return min(with_mma, key=len) if with_mma else max(bodies, key=len)


_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_STORES = ("ST", "STG", "STS", "STL", "RED", "BAR")


def _instructions(lines: list[str]) -> list[tuple[int, str, list[str]]]:
    """(address, opcode with modifiers, operands) of each instruction line."""
    parsed = []
    for line in lines:
        found = _INSTRUCTION.match(line)
        if found:
            operands = [op.strip() for op in found.group(3).split(",") if op.strip()]
            parsed.append((int(found.group(1), 16), found.group(2), operands))
    return parsed


def load_first_reads(body: list[str]) -> list[str]:
    """For each global or local load of a loop body: how many instructions later its result
    register is first read, and whether that read comes in the same iteration (the loop
    waits for the load in the iteration that issued it: a prefetch there overlaps nothing)
    or in the next one (wrapping around the loop)."""
    code = _instructions(body)
    lines = []
    for index, (address, opcode, operands) in enumerate(code):
        if not opcode.startswith(("LDG", "LDL")) or not operands:
            continue
        first = re.match(r"R(\d+)$", operands[0])
        if not first:
            continue
        width = 4 if ".128" in opcode else 2 if ".64" in opcode else 1
        results = {f"R{int(first.group(1)) + i}" for i in range(width)}
        lines.append(f"{address:05x} {opcode} {operands[0]}: " + _first_read(code, index, results))
    return lines


def _first_read(code: list[tuple[int, str, list[str]]], index: int, results: set[str]) -> str:
    for distance in range(1, len(code) + 1):
        _, opcode, operands = code[(index + distance) % len(code)]
        read = operands if opcode.startswith(_STORES) else operands[1:]
        if any(re.search(rf"\b{reg}\b", operand) for operand in read for reg in results):
            where = "next iteration" if index + distance >= len(code) else "same iteration"
            return f"first read at +{distance} instructions, {where} ({opcode})"
    return "not read in the loop"


def opcode_counts(lines: list[str]) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for line in lines:
        found = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if found:
            counts[found.group(1)] += 1
    return counts


def report(kernel: object, label: str, out_dir: Path | None, loads: bool = False) -> None:
    asm = kernel.asm  # type: ignore[attr-defined]
    meta = kernel.metadata  # type: ignore[attr-defined]
    cubin = Path("/tmp") / f"graphidx_{label}.cubin"
    cubin.write_bytes(asm["cubin"])
    sass = subprocess.run(
        [_tool("cuobjdump"), "--dump-sass", str(cubin)], capture_output=True, text=True
    ).stdout
    usage = subprocess.run(
        [_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True
    ).stdout
    registers = re.search(r"REG:(\d+)", usage)
    spills = len(re.findall(r"\b(?:LDL|STL)\b", sass))
    loop = hottest_loop(sass)
    counts = opcode_counts(loop)
    print(
        f"{label}: warps {meta.num_warps} stages {meta.num_stages} "
        f"regs {registers.group(1) if registers else '?'} smem {meta.shared} B, "
        f"{spills} local loads/stores; "
        f"hottest loop {sum(counts.values())} instructions per warp"
    )
    print("   " + ", ".join(f"{op} {n}" for op, n in counts.most_common(24)))
    if loads:
        for body in loop_bodies(sass):
            reads = load_first_reads(body)
            if reads:
                print(f"   loop at {body[0].split('*/')[0].strip()}*/, {len(body)} lines:")
                print("\n".join(f"      {line}" for line in reads))
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (out_dir / f"{label}.{ext}").write_text(asm[ext])
        (out_dir / f"{label}.sass").write_text(sass)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted([*CASES, *TOPK_CASES]))
    parser.add_argument("--out", type=Path, help="keep TTGIR/PTX/SASS here")
    parser.add_argument(
        "--loads",
        action="store_true",
        help="for every loop, where each global / local load's result is first read",
    )
    parser.add_argument(
        "--config",
        help="fields of the case's config in order (LogitsConfig, or GatherConfig for the "
        "gather case), comma-separated ints or 'none' (else the default)",
    )
    parser.add_argument(
        "--precision",
        choices=("exact", "fp8"),
        default="exact",
        help="of the logits and gather cases",
    )
    args = parser.parse_args()
    print(f"triton {triton.__version__}, target sm_90")
    driver.set_active(_Sm90Driver())
    JITFunction.run = _compile_only
    kernels = [
        triton_logits._logits_static_kernel,
        triton_logits._logits_scheduled_kernel,
        triton_gather._gather_logits_kernel,
        triton_topk._topk_row_kernel,
        triton_topk._topk_whole_row_kernel,
        triton_topk._split_floor_kernel,
        triton_topk._split_collect_kernel,
        triton_topk_radix._radix_high_kernel,
        triton_topk_radix._radix_low_kernel,
        triton_topk_radix._radix_collect_kernel,
    ]
    for name in args.case or sorted(CASES):
        for kernel in kernels:
            kernel.device_caches.clear()
        fields = (
            [None if f == "none" else int(f) for f in args.config.split(",")]
            if args.config
            else None
        )
        if name in TOPK_CASES:
            compile_topk(*TOPK_CASES[name])
        elif name == "gather":
            gather_config = GatherConfig(*fields) if fields else None  # type: ignore[arg-type]
            compile_gather(gather_config, args.precision)
        else:
            config = LogitsConfig(*fields) if fields else None  # type: ignore[arg-type]
            compile_case(name, config, args.precision)
        for kernel in kernels:
            for cache in kernel.device_caches.values():
                for index, compiled in enumerate(cache[0].values()):
                    report(compiled, f"{name}-{kernel.__name__}-{index}", args.out, args.loads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
