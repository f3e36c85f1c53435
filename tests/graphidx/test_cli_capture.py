"""`graphidx capture` (graphidx.cli.capture): the JSON report's schema, the table, the
--max-batch warning, the progress bar, and bad arguments refused before the sweep."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from capture import StepShape
from graphidx.cli import capture as capture_command
from graphidx.cli import main
from graphidx.cli.capture import (
    SCHEMA_VERSION,
    ProgressBar,
    SweepReport,
    SweepSettings,
    capture_sweep,
    format_report,
    sweep_settings,
)
from graphidx.config import IndexerConfig
from graphidx.runner import IndexerStack

TOP_KEYS = {
    "schema_version": int,
    "preset": str,
    "device": str,
    "graph_backend": str,
    "ops_backend": str,
    "config": dict,
    "stack": dict,
    "capture_sizes": list,
    "max_batch": (int, type(None)),
    "largest_captured": int,
    "covered": bool,
    "warnings": list,
    "persistent_bytes": int,
    "kv_cache_bytes": int,
    "graphs": list,
    "totals": dict,
}
GRAPH_KEYS = {
    "num_tokens": int,
    "num_reqs": int,
    "uniform_query_len": int,
    "label": str,
    "warmup_seconds": float,
    "capture_seconds": float,
    "num_bytes": (int, type(None)),
    "num_ops": (int, type(None)),
}
TOTAL_KEYS = {
    "num_graphs": int,
    "capture_seconds": float,
    "wall_seconds": float,
    "num_bytes": (int, type(None)),
    "num_ops": (int, type(None)),
}


def _check_keys(obj: dict[str, Any], schema: dict[str, Any], where: str) -> None:
    assert set(obj) == set(schema), f"{where}: keys {sorted(obj)} != {sorted(schema)}"
    for key, kind in schema.items():
        value = obj[key]
        assert isinstance(value, kind), f"{where}.{key} = {value!r} is not {kind}"
        if kind is int or kind is float:
            assert not isinstance(value, bool), f"{where}.{key} is a bool"


def check_report_schema(report: dict[str, Any]) -> None:
    """Every key of the documented schema, with its type, and the cross-field rules."""
    _check_keys(report, TOP_KEYS, "report")
    assert report["schema_version"] == SCHEMA_VERSION
    config_fields = {f.name for f in dataclasses.fields(IndexerConfig)}
    assert set(report["config"]) == config_fields
    _check_keys(
        report["stack"], {"dense": int, "candidate_source": bool, "consumers": int}, "stack"
    )
    sizes = report["capture_sizes"]
    assert sizes == sorted(sizes) and all(isinstance(s, int) for s in sizes)
    assert report["largest_captured"] == sizes[-1]
    assert report["covered"] == (report["max_batch"] is None or report["max_batch"] <= sizes[-1])
    assert [g["num_tokens"] for g in report["graphs"]] == sizes
    for i, graph in enumerate(report["graphs"]):
        _check_keys(graph, GRAPH_KEYS, f"graphs[{i}]")
        shape = StepShape(graph["num_tokens"], graph["num_reqs"], graph["uniform_query_len"])
        assert graph["label"] == shape.label
        assert graph["warmup_seconds"] > 0 and graph["capture_seconds"] > 0
    totals = report["totals"]
    _check_keys(totals, TOTAL_KEYS, "totals")
    assert totals["num_graphs"] == len(sizes)
    graphs = report["graphs"]
    seconds = sum(g["warmup_seconds"] + g["capture_seconds"] for g in graphs)
    assert totals["capture_seconds"] == pytest.approx(seconds)
    assert totals["wall_seconds"] >= totals["capture_seconds"]
    for key in ("num_bytes", "num_ops"):
        known = [g[key] for g in graphs if g[key] is not None]
        assert totals[key] == (sum(known) if known else None)
    if report["graph_backend"] == "tape":
        # The tape reports recorded ops and private bytes for every graph.
        assert all(g["num_ops"] > 0 and g["num_bytes"] >= 0 for g in graphs)
    else:
        assert all(g["num_ops"] is None and g["num_bytes"] >= 0 for g in graphs)


def test_cli_writes_the_documented_json_and_warns_above_the_largest_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sweep.json"
    rc = main(["capture", "--device", "cpu", "--max-batch", "100", "--json", str(path)])
    assert rc == 0
    out, err = capsys.readouterr()
    report = json.loads(path.read_text())
    check_report_schema(report)

    # Defaults on a CPU: the cpu-demo preset on the tape, the demo's candidate stack.
    assert report["preset"] == "cpu-demo"
    assert (report["device"], report["graph_backend"]) == ("cpu", "tape")
    assert report["ops_backend"] == "reference"
    assert report["config"] == dataclasses.asdict(IndexerConfig.cpu_demo())
    assert report["stack"] == {"dense": 0, "candidate_source": True, "consumers": 2}
    cfg = IndexerConfig.cpu_demo()
    assert report["largest_captured"] == cfg.max_num_seqs * cfg.next_n == 64
    assert all(size % cfg.next_n == 0 for size in report["capture_sizes"])
    assert report["persistent_bytes"] > report["kv_cache_bytes"] > 0

    # 100 tokens > 64: warned on stderr and in the JSON.
    assert report["max_batch"] == 100 and report["covered"] is False
    assert len(report["warnings"]) == 1
    assert "100" in report["warnings"][0] and "64" in report["warnings"][0]
    assert f"warning: {report['warnings'][0]}" in err
    # Progress on stderr, ending complete; one table row per size and a total on stdout.
    sizes = report["capture_sizes"]
    assert f"{len(sizes)}/{len(sizes)} captured" in err and err.endswith("\n")
    rows = [line.split() for line in out.splitlines()]
    table = [row for row in rows if row and row[0].isdigit()]
    assert [int(row[0]) for row in table] == sizes
    assert [int(row[4]) for row in table] == [g["num_ops"] for g in report["graphs"]]
    total = next(line for line in out.splitlines() if line.startswith("total:"))
    assert f"{len(sizes)} graphs" in total
    assert f"{report['totals']['num_ops']} recorded ops" in total
    assert str(path) in out


def _tiny_settings() -> SweepSettings:
    config = IndexerConfig.cpu_demo(max_num_seqs=4, max_num_batched_tokens=64)
    stack = IndexerStack(dense=1, candidate_source=True, consumers=1)
    return SweepSettings("cpu-demo", config, stack, torch.device("cpu"), "tape")


@pytest.mark.parametrize("max_batch", [None, 1, 8])
def test_no_warning_when_the_ladder_covers_max_batch(max_batch: int | None) -> None:
    seen: list[tuple[int, int, str]] = []
    report = capture_sweep(
        _tiny_settings(),
        max_batch=max_batch,
        on_progress=lambda i, n, shape: seen.append((i, n, shape.label)),
    )
    data = report.to_dict()
    check_report_schema(data)
    assert data["capture_sizes"] == [2, 4, 8]
    assert data["covered"] is True and data["warnings"] == []
    assert data["stack"] == {"dense": 1, "candidate_source": True, "consumers": 1}
    # 0 of n before the first capture, then one call per capture, largest first.
    assert [(i, n) for i, n, _ in seen] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert [label for _, _, label in seen[1:]] == [StepShape(s, s // 2, 2).label for s in (8, 4, 2)]


def test_warning_names_the_uncovered_range() -> None:
    report = capture_sweep(_tiny_settings(), max_batch=9)
    assert report.covered is False
    assert report.warnings == [
        "--max-batch 9 tokens is above the largest captured size 8: decode steps of 9..9 "
        "tokens will run eagerly"
    ]
    assert report.to_dict()["warnings"] == report.warnings


@pytest.mark.parametrize("bad", [0, -3, True, 2.5])
def test_bad_max_batch_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="max_batch must be None or an int >= 1"):
        capture_sweep(_tiny_settings(), max_batch=bad)  # type: ignore[arg-type]


def _refused_before_the_sweep(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> str:
    """Run `graphidx capture` with `argv`, a sweep that fails the test if it starts; the one
    error line's message after `graphidx capture: error: ` (exit status 2)."""

    def no_sweep(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sweep started before the arguments were checked")

    monkeypatch.setattr(capture_command, "capture_sweep", no_sweep)
    assert main(["capture", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    prefix = "graphidx capture: error: "
    assert err.startswith(prefix)
    return err.strip()[len(prefix) :]


def test_cli_refuses_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--device", "cpu", "--max-batch", "0"]
    assert _refused_before_the_sweep(argv, capsys, monkeypatch) == "--max-batch must be >= 1, got 0"
    with pytest.raises(SystemExit):  # argparse: not one of the presets
        main(["capture", "--preset", "v99"])


def test_json_into_a_missing_folder_is_refused_before_the_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "no-such-folder" / "sweep.json"
    message = _refused_before_the_sweep(
        ["--device", "cpu", "--json", str(target)], capsys, monkeypatch
    )
    assert message == f"--json {target}: the folder {target.parent} does not exist"
    assert not target.parent.exists()


def test_json_onto_a_folder_is_refused_before_the_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    message = _refused_before_the_sweep(
        ["--device", "cpu", "--json", str(tmp_path)], capsys, monkeypatch
    )
    assert message == f"--json {tmp_path}: is a folder, not a file"


def test_presets() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    default_cpu = sweep_settings(None, cpu)
    assert (default_cpu.preset, default_cpu.graph_backend) == ("cpu-demo", "tape")
    default_gpu = sweep_settings(None, gpu)
    assert (default_gpu.preset, default_gpu.graph_backend) == ("v41-flash", "device")
    assert default_gpu.config == IndexerConfig.deepseek_v41_flash()
    assert default_gpu.stack == IndexerStack(candidate_source=True, consumers=3)
    v32 = sweep_settings("v32", gpu)
    assert v32.config == IndexerConfig.deepseek_v32()
    assert v32.stack == IndexerStack(dense=2)
    with pytest.raises(ValueError, match=r"preset must be one of .* got 'v4'"):
        sweep_settings("v4", cpu)


def test_progress_bar_redraws_in_place_and_ends_the_line() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream, width=10)
    bar.update(0, 4, "capturing a-long-label")
    bar.update(2, 4, "short")
    assert "\n" not in stream.getvalue()
    bar.update(4, 4, "done")
    text = stream.getvalue()
    assert text.endswith("\n")
    frames = text.rstrip("\n").split("\r")[1:]
    assert frames[0].startswith("[..........] 0/4 capturing a-long-label")
    assert frames[1].startswith("[#####.....] 2/4 short")
    assert frames[2].startswith("[##########] 4/4 done")
    # A shorter line is padded over the longer one it replaces.
    assert len(frames[1]) >= len(frames[0])


def test_device_report_table_shows_graph_bytes() -> None:
    # The device backend's columns, from stats as a GPU run reports them (no GPU needed).
    settings = sweep_settings("v32", torch.device("cuda"))
    graphs = [
        {
            "num_tokens": n,
            "num_reqs": n,
            "uniform_query_len": 1,
            "label": StepShape(n, n, 1).label,
            "warmup_seconds": 0.01 * n,
            "capture_seconds": 0.002 * n,
            "num_bytes": nbytes,
            "num_ops": None,
            "replays": 0,
        }
        for n, nbytes in ((1, 1024), (2, 3 * 2**20))
    ]
    stats = {
        "graphs": graphs,
        "totals": {
            "num_graphs": 2,
            "capture_seconds": 0.036,
            "num_bytes": 1024 + 3 * 2**20,
            "num_ops": None,
        },
    }
    report = SweepReport(settings, "triton", [1, 2], 4, 10 * 2**20, 2**20, stats, 0.5)
    lines = format_report(report)
    assert "device graphs" in lines[0] and "2 dense" in lines[0]
    assert "graph bytes" in lines[1] and "ops" not in lines[1]
    assert lines[2].split() == ["1", "1", "10.0", "2.0", "1024"]
    assert lines[3].split()[-1] == str(3 * 2**20)
    assert "3.00 MiB of graph memory" in lines[4]
    check_report_schema(report.to_dict())


@pytest.mark.gpu
def test_device_sweep_on_gpu(tmp_path: Path) -> None:
    path = tmp_path / "sweep.json"
    assert main(["capture", "--preset", "cpu-demo", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    check_report_schema(report)
    assert report["graph_backend"] == "device"
