"""Smoke tests of the `graphidx` command: replay-check, demo, every subcommand's --help,
--version, and the one-line errors of bad arguments.

The capture and bench subcommands have their own tests (test_cli_capture.py,
test_bench_report.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata

import pytest
import torch

import graphidx
from graphidx.cli import build_parser, main
from graphidx.cli.commands import SUBCOMMANDS, package_version


def test_replay_check_as_a_process_prints_the_count_last_and_exits_0() -> None:
    command = [sys.executable, "-m", "graphidx", "replay-check"]
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
    assert main(["replay-check", "--dcp", "0", "--quiet"]) == 2
    assert "dcp must be an int >= 1, got 0" in capsys.readouterr().err


def test_version_as_a_process_is_the_package_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "graphidx", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"graphidx {package_version()}\n"
    assert package_version() == metadata.version("graphidx") == graphidx.__version__


def test_version_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"graphidx {package_version()}\n"


def test_version_falls_back_to_the_module_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert package_version() == graphidx.__version__
    monkeypatch.delattr(graphidx, "__version__")
    assert package_version() == "unknown"


def _one_error_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The single stderr line of a refused command, without its `graphidx <cmd>: error: `."""
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    prefix = f"graphidx {command}: error: "
    assert lines[0].startswith(prefix), lines[0]
    assert out == ""
    return lines[0][len(prefix) :]


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("foo", "--device foo: not a device; use cpu, cuda or cuda:N"),
        ("cuda:x", "--device cuda:x: not a device; use cpu, cuda or cuda:N"),
        ("meta", "--device meta: the 'meta' device type is not supported; use cpu, cuda or cuda:N"),
    ],
)
@pytest.mark.parametrize("command", ["demo", "replay-check", "capture"])
def test_a_bad_device_is_one_line_and_exit_2(
    command: str, device: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--device", device]) == 2
    assert _one_error_line(capsys, command) == message


def test_a_missing_gpu_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        assert main(["demo", "--device", f"cuda:{count}"]) == 2
        assert _one_error_line(capsys, "demo") == (
            f"--device cuda:{count}: only {count} GPU(s) are visible"
        )
    else:
        assert main(["demo", "--device", "cuda"]) == 2
        assert _one_error_line(capsys, "demo") == "--device cuda: no CUDA/ROCm GPU is available"


def test_verbose_shows_the_traceback_instead() -> None:
    with pytest.raises(ValueError, match="--device foo: not a device"):
        main(["-v", "demo", "--device", "foo"])
