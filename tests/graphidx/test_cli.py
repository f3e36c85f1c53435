"""Smoke tests of the `graphidx` command: replay-check, demo, and every subcommand's --help.

The capture subcommand has its own tests (test_capture_sweep.py).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from graphidx.cli import build_parser, main

SUBCOMMANDS = ("demo", "replay-check", "capture", "bench")


def test_replay_check_as_a_process_prints_the_count_last_and_exits_0() -> None:
    command = [sys.executable, "-m", "graphidx.cli", "replay-check"]
    args = ["--backend", "tape", "--cases", "12", "--seed", "5"]
    # The child inherits TRITON_INTERPRET from conftest's setdefault on GPU-less machines.
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "12 cases, 0 mismatches"
    # The summary before it says how many steps replayed a graph: some must have.
    replayed = re.search(r"; (\d+) replayed;", lines[-2])
    assert replayed is not None and int(replayed.group(1)) > 0, lines[-2]
    # The progress bar goes to stderr and ends complete.
    assert "12/12 cases" in done.stderr


def test_replay_check_in_process_with_another_seed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay-check", "--backend", "tape", "--cases", "12", "--seed", "11"]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "12 cases, 0 mismatches"


def test_demo_runs_on_the_cpu_and_every_replayed_step_matches_eager(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "graphidx demo on cpu (tape graphs)" in out
    steps = re.search(r"summary: (\d+) steps", out)
    matched = re.search(r"replay == eager: (\d+)/(\d+) replayed steps", out)
    assert steps is not None and matched is not None, out[-2000:]
    same, replayed = int(matched.group(1)), int(matched.group(2))
    assert int(steps.group(1)) > replayed > 0
    assert same == replayed
    assert "MISMATCH" not in out


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: graphidx {command}")
    assert "--help" in out


def test_top_level_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in SUBCOMMANDS:
        assert command in out
    # And nothing is registered that this test does not know about.
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(SUBCOMMANDS)  # type: ignore[arg-type]


def test_a_subcommand_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "required" in capsys.readouterr().err


def test_bad_arguments_give_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay-check", "--backend", "device", "--cases", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "graphidx replay-check: error: --backend device needs a CUDA/ROCm GPU "
        "(use --backend tape on a CPU)"
    ]
    assert main(["replay-check", "--cases", "0", "--quiet"]) == 2
    assert "cases must be >= 1, got 0" in capsys.readouterr().err
