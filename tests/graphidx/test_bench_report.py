"""`graphidx bench` without a GPU: kernels.json round trip, the plot redrawn from it, the table,
the timing helpers that need no device, and the command's refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from graphidx.bench.cases import read_multiples
from graphidx.bench.report import (
    format_table,
    plot_label,
    read_outputs,
    replot,
    write_outputs,
)
from graphidx.bench.roofline import CaseResult, Ceilings
from graphidx.bench.timing import launch_spans
from graphidx.cli import main


def sample_results() -> list[CaseResult]:
    decode = CaseResult(
        "dense decode", "H64 next_n 2, 64 seqs, 1048576 keys", 85.0, 8.0e7, 3.4e10, 43.5, "OK",
        {"kernel_us": 81.5, "eager_dirty_us": 86.0},
    )  # fmt: skip
    topk = CaseResult("top-k 512", "128 rows x 65536 cols, k 512", 33.0, 3.4e7, 0.0, 7.9, "OK")
    variant = CaseResult("top-k 512 P=2", topk.shape, 47.0, 3.4e7, 0.0, 7.9, "OK", variant=True)
    reference = CaseResult(
        "torch.topk 512", topk.shape, 172.0, 3.4e7, 0.0, 7.9, "-", reference=True
    )
    failed = CaseResult("sweep x", "-", 0.0, 0.0, 0.0, 0.0, "FAIL: no", variant=True)
    return [decode, topk, variant, reference, failed]


def test_kernels_json_round_trips(tmp_path: Path) -> None:
    results = sample_results()
    ceilings = Ceilings(measured_copy_bytes_per_s=4.2e12, measured_tiny_kernel_us=4.6)
    written = write_outputs(results, ceilings, tmp_path, {"device": "test"})
    assert written[0] == tmp_path / "kernels.json"
    payload = json.loads(written[0].read_text())
    assert payload["results"][0]["tflops"] == pytest.approx(3.4e10 / 85e-6 / 1e12)
    got, got_ceilings, meta = read_outputs(written[0])
    assert got == results  # every field, the variant and reference flags included
    assert got_ceilings == ceilings
    assert meta == {"device": "test"}


def test_kernels_json_of_another_version_still_reads(tmp_path: Path) -> None:
    # A ceiling missing from the file reads back as its default (None); a ceiling this
    # version does not know is left out.
    written = write_outputs(sample_results(), Ceilings(measured_tiny_kernel_us=4.6), tmp_path, {})
    payload = json.loads(written[0].read_text())
    del payload["ceilings"]["measured_tiny_kernel_us"]
    payload["ceilings"]["measured_something_new"] = 1.0
    written[0].write_text(json.dumps(payload))
    _, ceilings, _ = read_outputs(written[0])
    assert ceilings.measured_tiny_kernel_us is None
    assert ceilings.copy_bytes_per_s == Ceilings().copy_bytes_per_s


def test_plot_label_names_the_heads_only_when_the_shape_starts_with_them() -> None:
    decode, topk, *_ = sample_results()
    assert plot_label(decode) == "dense decode H64"
    assert plot_label(topk) == "top-k 512"


def test_replot_from_json_and_through_the_cli(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    write_outputs(sample_results(), Ceilings(), tmp_path / "run", {})
    png = tmp_path / "again.png"
    assert replot(tmp_path / "run" / "kernels.json", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "cli"
    code = main(["bench", "--replot", str(tmp_path / "run" / "kernels.json"), "--out", str(out)])
    assert code == 0
    assert (out / "roofline.png").stat().st_size > 0


def test_plot_without_a_main_case_still_draws(tmp_path: Path) -> None:
    """Every case failed, or only sweep points ran (`tools/device_kernels.py --sweep-only`):
    the JSON and the plot are still written, not a traceback."""
    pytest.importorskip("matplotlib")
    only_variants = [r for r in sample_results() if r.variant]
    written = write_outputs(only_variants, Ceilings(), tmp_path, {})
    assert [p.name for p in written] == ["kernels.json", "roofline.png"]


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The single stderr line of a refused `graphidx bench`, after `graphidx bench: error: `."""
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and out == "", err
    prefix = "graphidx bench: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0][len(prefix) :]


def test_replot_of_a_missing_file_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.json"
    assert main(["bench", "--replot", str(missing), "--out", str(tmp_path)]) == 2
    assert _one_error_line(capsys) == f"--replot: no such file: {missing}"


FOREIGN = {
    "not JSON": ("{results: [", "is not JSON: "),
    "a list": ("[1, 2]", "is not a kernels.json of graphidx bench: the top level is a list"),
    "a capture report": (
        json.dumps({"schema_version": 1, "preset": "cpu-demo", "graphs": []}),
        "is not a kernels.json of graphidx bench: no list 'results'",
    ),
    "a row without a time": (
        json.dumps({"meta": {}, "ceilings": {}, "results": [{"name": "x", "shape": "-"}]}),
        "is not a kernels.json of graphidx bench: results[0] has no 'time_us'",
    ),
    "a row with a string time": (
        json.dumps({"meta": {}, "ceilings": {}, "results": [{
            "name": "x", "shape": "-", "time_us": "5", "bytes_moved": 1, "flops": 0,
            "floor_us": 1, "check": "OK"}]}),
        "results[0]['time_us'] = '5' has the wrong type",
    ),
    "a ceiling that is not a number": (
        json.dumps({"meta": {}, "ceilings": {"copy_bytes_per_s": "fast"}, "results": []}),
        "ceilings['copy_bytes_per_s'] = 'fast' is not a number",
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", FOREIGN)
def test_replot_of_a_foreign_file_is_one_line_and_exit_2(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, message = FOREIGN[kind]
    path = tmp_path / "foreign.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_outputs(path)
    out = tmp_path / "out"
    assert main(["bench", "--replot", str(path), "--out", str(out)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"--replot: {path} ") and message in line
    assert not out.exists()  # refused before anything was written


def test_out_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_outputs(sample_results(), Ceilings(), tmp_path / "run", {})
    taken = tmp_path / "taken"
    taken.write_text("")
    argv = ["bench", "--replot", str(tmp_path / "run" / "kernels.json"), "--out", str(taken)]
    assert main(argv) == 2
    assert _one_error_line(capsys) == f"--out {taken}: is a file, not a folder"


def test_bench_without_a_gpu_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--out", str(tmp_path / "out")]) == 2
    assert _one_error_line(capsys).startswith("the kernel benchmarks need a CUDA/ROCm GPU")
    assert not (tmp_path / "out").exists()


def test_read_kernel_takes_each_programs_max() -> None:
    """The `one read` case's kernel (the interpreter without a GPU, tests/conftest.py):
    program p writes the max of its BLOCK * STEPS elements, the last one's range masked."""
    import torch

    from graphidx.bench.read_kernel import read_max_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    values = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3)).to(device)
    chunk = 128 * 2
    partial = torch.full((-(-values.numel() // chunk),), float("nan"), device=device)
    read_max_kernel[(partial.numel(),)](values, partial, values.numel(), BLOCK=128, STEPS=2)
    flat = values.flatten()
    want = torch.stack([flat[i : i + chunk].max() for i in range(0, flat.numel(), chunk)])
    assert torch.equal(partial, want)


def test_launch_spans_take_each_runs_own_activities() -> None:
    # Two reps of (flush: 2 activities) then (run: 2 activities); each span is the run's
    # first start to its last end, the flush's activities left out.
    activities = [(0.0, 50.0), (50.0, 60.0), (61.0, 70.0), (70.5, 80.0),
                  (100.0, 150.0), (150.0, 160.0), (162.0, 170.0), (171.0, 175.0)]  # fmt: skip
    assert launch_spans(activities, 2, 2, 2) == [19.0, 13.0]
    assert launch_spans(activities, 3, 1, 2) == [9.5, 4.0]


@pytest.mark.parametrize("before, per_run, reps", [(2, 2, 3), (2, 1, 2), (1, 0, 4), (-1, 3, 2)])
def test_launch_spans_refuse_a_count_that_does_not_add_up(
    before: int, per_run: int, reps: int
) -> None:
    activities = [(float(i), i + 0.5) for i in range(8)]
    with pytest.raises(ValueError, match="device activities"):
        launch_spans(activities, before, per_run, reps)


def test_table_has_the_kernel_span_column() -> None:
    decode, topk, *_ = sample_results()
    unmeasured = CaseResult("x", "-", 5.0, 1.0, 0.0, 1.0, "OK", {"kernel_us": "n/a: why"})
    lines = format_table([decode, topk, unmeasured]).splitlines()
    assert "kernel us" in lines[0]
    assert " 85.0       81.5 " in lines[2] and "kernel_us" not in lines[2]
    assert re.search(r" 33\.0 +- ", lines[3])  # no notes, no span
    assert "'kernel_us': 'n/a: why'" in lines[4]


def test_read_multiples_of_a_topk() -> None:
    read = CaseResult("one read", "-", 12.0, 1.0, 0.0, 1.0, "OK", {"kernel_us": 9.0})
    assert read_multiples(24.0, 18.0, 8.0, read) == {
        "x_one_read": 3.0, "x_kernel_one_read": 2.25, "x_measured_read": 2.0,
        "x_kernel_read": 2.0,
    }  # fmt: skip
    assert read_multiples(24.0, "n/a: none", 8.0, None) == {"x_one_read": 3.0}
    no_span = CaseResult("one read", "-", 12.0, 1.0, 0.0, 1.0, "OK", {"kernel_us": "n/a"})
    assert read_multiples(24.0, 18.0, 8.0, no_span) == {
        "x_one_read": 3.0, "x_kernel_one_read": 2.25, "x_measured_read": 2.0,
    }  # fmt: skip


@pytest.mark.gpu
def test_kernel_span_of_a_replay_sits_under_its_replay_time() -> None:
    """On a GPU: one replayed kernel (a 256 MB read) has a device span that is a number,
    above the nominal read time at the copy ceiling's order and below the replay's event
    time, which also carries the launch."""
    import torch

    from graphidx.bench.timing import captured, kernel_span_us, time_us

    values = torch.randn(64 << 20, device="cuda")
    total = torch.empty((), device="cuda")
    graph = captured(lambda: torch.sum(values, dim=0, out=total))
    span, replay = kernel_span_us(graph.replay), time_us(graph.replay)
    assert isinstance(span, float)
    assert 256e6 / 10e12 * 1e6 < span < replay  # faster than 10 TB/s is impossible


def test_bench_peers_need_the_peer_libraries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import graphidx.bench.peers as peers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(peers, "peers_available", lambda: ["flashinfer"])
    assert main(["bench", "--peers", "--out", str(tmp_path / "out")]) == 2
    assert _one_error_line(capsys).startswith("--peers needs deep_gemm and flashinfer")


def test_bench_step_without_a_gpu_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--step", "--out", str(tmp_path / "out")]) == 2
    assert _one_error_line(capsys).startswith("the kernel benchmarks need a CUDA/ROCm GPU")


def test_step_presets_and_table() -> None:
    """The step presets' stacks, and the table's peer columns (V3.2 rows only)."""
    from graphidx.bench.step import StepRow, format_step, preset

    assert preset("v32", 8192, 4)[1].kinds == ("dense",)
    assert preset("v41", 8192, 4)[1].kinds == ("source", "consumer", "consumer", "consumer")
    with pytest.raises(ValueError, match="unknown step preset"):
        preset("v3", 8192, 4)
    rows = [
        StepRow("v32", 8192, 1, 0.2, 0.05, 5, {"dense": 4, "step": 1}),
        StepRow("v41", 8192, 1, 0.3, 0.15, 20, {"consumer": 4, "source + step": 8}),
    ]
    table = format_step(rows, {(8192, 1): (0.03, 0.02)}).splitlines()
    assert "0.030" in table[1] and "dense 4, step 1" in table[1]
    assert "0.030" not in table[2] and table[2].rstrip().endswith("-")


def test_peer_ratio_table_pairs_each_case_with_its_peer() -> None:
    from graphidx.bench.peers import format_peer_ratios
    from graphidx.bench.roofline import CaseResult

    rows = [
        CaseResult("dense decode", "H64 next_n 2, 64 seqs, 1 keys, exact", 70.0, 1, 1, 1, "OK"),
        CaseResult("dense decode", "H64 next_n 2, 64 seqs, 1 keys, fp8", 77.0, 1, 1, 1, "OK"),
        CaseResult("DeepGEMM decode H64", "H64 ...", 35.0, 1, 1, 1, "OK", reference=True),
        CaseResult("top-k 512", "128 rows x 65536 cols, k 512", 24.0, 1, 0, 1, "OK"),
    ]
    table = format_peer_ratios(rows).splitlines()
    assert len(table) == 3  # no FlashInfer row: its top-k has no peer line
    assert table[1].split()[-1] == "2.00" and table[2].split()[-1] == "2.20"
    assert "fp8" in table[2] and "fp8" not in table[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-len", "163840"], "--model-len applies to --step only"),
        (["--step", "--model-len", "8192"], "--model-len 8192 must be at least 65600"),
        (["--step", "--quick", "--model-len", "8192"], "--model-len 8192 must be at least 8256"),
    ],
)
def test_bad_model_len_is_one_line_and_exit_2_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["bench", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("graphidx bench: error:") and message in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_step_presets_take_a_deployment_width() -> None:
    from graphidx.bench.step import min_model_len, preset

    assert preset("v32", 8192, 4)[0].max_model_len == min_model_len(8192) == 8256
    config, _ = preset("v32", 8192, 4, model_len=163840)
    assert config.max_model_len == 163840
    assert preset("v41", 65536, 4, model_len=163840)[0].max_model_len == 163840
    with pytest.raises(ValueError, match="model_len=8192 must be at least 8256"):
        preset("v32", 8192, 4, model_len=8192)
