"""The SASS reading of tools/compile_sm90.py (loop finding, opcode counts) on a made-up listing."""

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
