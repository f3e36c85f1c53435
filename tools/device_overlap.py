"""Do tensor-core MMAs and CUDA-core instructions of *different* programs overlap on one SM?

    python tools/device_overlap.py [--mma-iters 200] [--alu-iters 1500]

The decode kernels' times add up like (issued instructions at one per cycle) + (tensor time)
(BENCHMARKS.md sessions 12-14), as if the SM never ran the MMAs of one program while it
issued another program's decode and epilogue. This measures that directly, with no decode:
four programs per SM (each SM's arrivals numbered through an atomic counter on its %smid),
where programs 0-1 run a chain of 64 x N x 128 bf16 MMAs (A from registers, as the decode's
keys, or from shared memory) and programs 2-3 a loop of independent float32 FMAs (or integer
multiply / logic ops, like the key decode). If the SM overlaps them, "both" takes about
max(mma, alu); if it does not, about mma + alu. Prints one table; needs an NVIDIA GPU with
wgmma (sm_90).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from probe_ptx import global_timer, sm_id

PROGRAMS_PER_SM = 4
MMA_SLOTS = 0b0011
ALU_SLOTS = 0b1100


@triton.jit
def _sm_slot(counter_ptr):
    """This program's arrival number on its SM."""
    return tl.atomic_add(counter_ptr + sm_id(), 1)


@triton.jit
def _overlap_kernel(a_ptr, b_ptr, x_ptr, out_ptr, counter_ptr, span_ptr, mma_iters, alu_iters,
                    mma_slots, alu_slots, N: tl.constexpr, A_IN_REGISTERS: tl.constexpr,
                    INTEGER_ALU: tl.constexpr):  # fmt: skip
    """Program roles by arrival on the SM (`mma_slots` / `alu_slots` bit masks); each
    program's duration in ns goes to span_ptr[pid] (its role, 1 MMA / 2 ALU / 0, beside)."""
    begin = global_timer()
    slot = _sm_slot(counter_ptr)
    m = tl.arange(0, 64)
    k = tl.arange(0, 128)
    n = tl.arange(0, N)
    total = 0.0
    if (mma_slots >> slot) & 1:
        if A_IN_REGISTERS:
            # Built in registers (as the decoded keys are), so the MMA reads A from there.
            bits = tl.load(a_ptr + m[:, None] * 64 + tl.arange(0, 64)[None, :])
            bits = tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [bits], dtype=tl.int32, is_pure=False, pack=1
            )
            low = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
            high = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
            a = tl.reshape(tl.join(low, high), [64, 128])
        else:
            a = tl.load(a_ptr.to(tl.pointer_type(tl.bfloat16)) + m[:, None] * 128 + k[None, :])
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
        acc = tl.zeros([64, N], tl.float32)
        for _ in range(mma_iters):
            acc = tl.dot(a, b, acc)
        total += tl.sum(acc)
    if (alu_slots >> slot) & 1:
        x = tl.load(x_ptr + m[:, None] * N + n[None, :])
        if INTEGER_ALU:
            w = x.to(tl.int32, bitcast=True)
            for i in range(alu_iters):
                w = ((w * 0x1040) & 0x01C081C0) ^ i
            total += tl.sum(w.to(tl.float32))
        else:
            for _ in range(alu_iters):
                x = x * 0.999 + 0.5
            total += tl.sum(x)
    tl.store(out_ptr + tl.program_id(0), total)
    role = ((mma_slots >> slot) & 1) + 2 * ((alu_slots >> slot) & 1)
    tl.store(span_ptr + 2 * tl.program_id(0), global_timer() - begin)
    tl.store(span_ptr + 2 * tl.program_id(0) + 1, role.to(tl.int64))


def _time_us(fn, reps: int = 15) -> float:
    """Median of `reps` timed launches (events), after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn(start, end)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return sorted(times)[len(times) // 2]


def measure(n: int, a_in_registers: bool, integer_alu: bool, mma_iters: int,
            alu_iters: int) -> dict[str, float]:  # fmt: skip
    """Times (us) of the MMA programs alone, the ALU programs alone, and both together."""
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randint(-(2**20), 2**20, (64, 64), dtype=torch.int32, device=device, generator=gen)
    a = (a & 0x3FFF3FFF) | 0x3C003C00  # bf16 pairs near 1, no NaN
    b = torch.rand((128, n), device=device, generator=gen).to(torch.bfloat16)
    x = torch.rand((64, n), device=device, generator=gen)
    out = torch.empty(sms * PROGRAMS_PER_SM, device=device)
    counter = torch.zeros(1024, dtype=torch.int32, device=device)
    spans = torch.zeros((sms * PROGRAMS_PER_SM, 2), dtype=torch.int64, device=device)

    def launch(mma_slots: int, alu_slots: int):
        def run(start=None, end=None):
            counter.zero_()
            if start is not None:
                start.record()
            _overlap_kernel[(sms * PROGRAMS_PER_SM,)](
                a, b, x, out, counter, spans, mma_iters, alu_iters, mma_slots, alu_slots,
                N=n, A_IN_REGISTERS=a_in_registers, INTEGER_ALU=integer_alu,
                num_warps=4, num_stages=1, maxnreg=128,
            )  # fmt: skip
            if end is not None:
                end.record()

        return run

    def role_means() -> tuple[float, float]:
        """Mean program duration (us) of the MMA and of the ALU programs of the last run."""
        torch.cuda.synchronize()
        got = spans.cpu()
        means = []
        for role in (1, 2):
            mine = got[got[:, 1] == role, 0].double()
            means.append(float(mine.mean()) / 1e3 if len(mine) else float("nan"))
        return means[0], means[1]

    result = {"mma": _time_us(launch(MMA_SLOTS, 0))}
    result["mma_prog"] = role_means()[0]
    result["alu"] = _time_us(launch(0, ALU_SLOTS))
    result["alu_prog"] = role_means()[1]
    result["both"] = _time_us(launch(MMA_SLOTS, ALU_SLOTS))
    result["both_mma_prog"], result["both_alu_prog"] = role_means()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mma-iters", type=int, default=200)
    parser.add_argument("--alu-iters", type=int, default=1500)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    rows = []
    for n in (64, 128):
        for a_in_registers in (True, False):
            for integer_alu in (False, True):
                # The integer loop issues ~3 instructions per element and step, the FMA one 1.
                alu_iters = args.alu_iters // 3 if integer_alu else args.alu_iters
                got = measure(n, a_in_registers, integer_alu, args.mma_iters, alu_iters)
                rows.append((n, a_in_registers, integer_alu, got))
                print(rows[-1], flush=True)
    print(
        "\n| N | A from | ALU | mma us | alu us | both us | max | sum | both / max | "
        "MMA program alone -> with ALU us | ALU program alone -> with MMA us |"
    )
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, a_in_registers, integer_alu, got in rows:
        top, total = max(got["mma"], got["alu"]), got["mma"] + got["alu"]
        print(
            f"| {n} | {'registers' if a_in_registers else 'shared'} | "
            f"{'int mul+lop' if integer_alu else 'fp32 fma'} | {got['mma']:.1f} | "
            f"{got['alu']:.1f} | {got['both']:.1f} | {top:.1f} | {total:.1f} | "
            f"{got['both'] / top:.2f} | {got['mma_prog']:.1f} -> {got['both_mma_prog']:.1f} | "
            f"{got['alu_prog']:.1f} -> {got['both_alu_prog']:.1f} |"
        )


if __name__ == "__main__":
    main()
