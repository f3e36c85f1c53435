"""The SASS reading of tools/compile_sm90.py (loop finding, opcode counts) on a made-up listing,
and its sm_90 driver standing in for a Hopper host's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import compile_sm90

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD R2, R3, R4, R5 ;
        /*0020*/                   LOP3.LUT R2, R2, 0xff, RZ, 0xc0, !PT ;
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, R100, gdesc[UR20].tnspB, RZ ;
        /*0040*/              @!P0 FMNMX R6, R24, RZ, !PT ;
        /*0050*/               @P1 BRA 0x10 ;
        /*0060*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0070*/                   BRA 0x0 ;
        /*0080*/                   EXIT ;
"""


def test_hottest_loop_is_the_shortest_loop_with_a_tensor_core_op() -> None:
    loop = compile_sm90.hottest_loop(SASS)
    # Two backward branches: 0x50 -> 0x10 (holds the HGMMA) and 0x70 -> 0x0 (holds it too,
    # but longer): the shorter one is the key-tile loop.
    assert [line.split("*/")[0].strip() + "*/" for line in loop] == [
        "/*0010*/", "/*0020*/", "/*0030*/", "/*0040*/", "/*0050*/",
    ]  # fmt: skip


def test_opcode_counts_skip_predicates_and_modifiers() -> None:
    counts = compile_sm90.opcode_counts(compile_sm90.hottest_loop(SASS))
    assert counts == {"IMAD": 1, "LOP3": 1, "HGMMA": 1, "FMNMX": 1, "BRA": 1}


def test_longest_loop_without_tensor_core_ops() -> None:
    plain = "\n".join(line for line in SASS.splitlines() if "HGMMA" not in line)
    loop = compile_sm90.hottest_loop(plain)
    assert loop[0].strip().startswith("/*0000*/") and "BRA 0x0" in loop[-1]


LOADS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   SHF.R.S32.HI R9, RZ, 0x1f, R4 ;
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LDG.E R8, desc[UR4][R2.64+0x10] ;
        /*0040*/                   IMAD.MOV.U32 R10, RZ, RZ, R8 ;
        /*0050*/                   STG.E desc[UR4][R2.64], R11 ;
        /*0060*/              @!P0 BRA 0x10 ;
        /*0070*/                   EXIT ;
"""


def test_load_first_reads_tell_the_same_iteration_from_the_next() -> None:
    (body,) = compile_sm90.loop_bodies(LOADS)
    assert compile_sm90.load_first_reads(body) == [
        # R4..R7: first read by the SHF at the top of the loop, past the branch.
        "00020 LDG.E.128 R4: first read at +5 instructions, next iteration (SHF.R.S32.HI)",
        # R8: copied at once, so the loop waits for it where it was issued.
        "00030 LDG.E R8: first read at +1 instructions, same iteration (IMAD.MOV.U32)",
    ]


def test_a_store_reads_its_value_and_an_unread_load_is_named() -> None:
    listing = LOADS.replace("R11 ;", "R6 ;").replace("RZ, R8 ;", "RZ, R12 ;")
    (body,) = compile_sm90.loop_bodies(listing)
    assert compile_sm90.load_first_reads(body) == [
        "00020 LDG.E.128 R4: first read at +3 instructions, same iteration (STG.E)",
        "00030 LDG.E R8: not read in the loop",
    ]


def test_the_interpreter_runs_kernels_beside_a_hopper_gpu() -> None:
    """Under the interpreter the grid wait is skipped even when Triton's driver reports sm_90
    (`TRITON_INTERPRET=1` on a GPU host), where the interpreter has no `griddepcontrol`."""
    import torch
    from triton.runtime.driver import driver

    from graphidx.ops import topk_per_row
    from graphidx.ops.backend import triton_interpreted

    if not triton_interpreted():
        pytest.skip("runs kernels under the Triton interpreter")
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    lengths = torch.full((4,), 300, dtype=torch.int32)
    out = torch.full((4, 16), -7, dtype=torch.int32)
    previous = driver._active  # None on a CPU-only host, where no driver can be made
    driver.set_active(compile_sm90._Sm90Driver())
    try:
        topk_per_row(logits, lengths, 16, out, backend="triton")
    finally:
        driver._active = previous
    want = torch.topk(logits, 16, dim=1).indices.sort(dim=1).values
    assert torch.equal(out.long().sort(dim=1).values, want)
