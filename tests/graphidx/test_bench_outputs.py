"""`graphidx bench` outputs without a GPU: kernels.json round trip and the plot redrawn from it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from graphidx.bench import (
    CaseResult,
    Ceilings,
    _plot_label,
    format_table,
    launch_spans,
    read_multiples,
    read_outputs,
    replot,
    write_outputs,
)
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
    # Runs before the tiny-kernel calibration wrote no such ceiling: it reads back as None;
    # a ceiling this version does not know (a later one's) is left out.
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
    assert _plot_label(decode) == "dense decode H64"
    assert _plot_label(topk) == "top-k 512"


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


def test_replot_of_a_missing_file_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(SystemExit, match="no such file"):
        main(["bench", "--replot", str(missing), "--out", str(tmp_path)])


def test_read_kernel_takes_each_programs_max() -> None:
    """The `one read` case's kernel (the interpreter without a GPU, tests/conftest.py):
    program p writes the max of its BLOCK * STEPS elements, the last one's range masked."""
    import torch

    from graphidx.ops.kernels.read import read_max_kernel

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

    from graphidx.bench import _captured, kernel_span_us, time_us

    values = torch.randn(64 << 20, device="cuda")
    total = torch.empty((), device="cuda")
    graph = _captured(lambda: torch.sum(values, dim=0, out=total))
    span, replay = kernel_span_us(graph.replay), time_us(graph.replay)
    assert isinstance(span, float)
    assert 256e6 / 10e12 * 1e6 < span < replay  # faster than 10 TB/s is impossible
