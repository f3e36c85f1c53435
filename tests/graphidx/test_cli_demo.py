"""The demo: its serving scheduler (every request prefills to the end and finishes), and
the demo under context parallel (`--dcp W`: W gloo ranks against the single-rank answer)
with its refused arguments."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from graphidx.cli import demo, main
from graphidx.cli.demo import DemoSettings, RankReport, ServingSimulation, StepRow, report_ranks


def _scheduler_only(seed: int) -> ServingSimulation:
    """A simulation without caches or runner: just its scheduling state."""
    settings = DemoSettings.for_device(torch.device("cpu"), seed=seed)
    sim = ServingSimulation.__new__(ServingSimulation)
    sim.s = settings
    sim.rng = np.random.default_rng(seed)
    sim.free_pages = list(range(100_000))
    sim.running = []
    sim.waiting = settings.random_requests(sim.rng)
    return sim


def test_no_prefill_is_left_with_a_remainder_a_decode_would_claim() -> None:
    """A budget-cut chunk must not leave 1..next_n prompt tokens: such a request would be
    neither a prefill (too short) nor a decode, and would stall forever."""
    next_n = DemoSettings.for_device(torch.device("cpu")).config.next_n
    for seed in range(60):
        sim = _scheduler_only(seed)
        steps = 0
        while (sim.waiting or sim.running) and steps < 3000:
            sim._admit()
            plan = sim._schedule()
            for request, rows in plan:
                if request.prefilling:
                    left = request.prompt_len - request.seq_len - rows
                    assert left == 0 or left > next_n, (seed, left)
                sim._grow(request, request.seq_len + rows)
            sim._advance(plan)
            steps += 1
        assert not sim.waiting and not sim.running, f"seed {seed} stalled after {steps} steps"


def test_demo_under_context_parallel_matches_the_single_rank_answer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`demo --dcp 2`: two gloo ranks run the same simulation over their shares of the
    cache; every step of each is compared with the single-rank answer."""
    assert main(["demo", "--device", "cpu", "--dcp", "2", "--requests", "8"]) == 0
    out = capsys.readouterr().out
    assert "context parallel over 2 gloo ranks" in out
    answers = re.search(r"single-rank answers: (\d+) steps", out)
    steps = re.search(r"summary: (\d+) steps; (\d+) replayed", out)
    assert answers is not None and steps is not None, out[-2000:]
    assert int(steps.group(1)) == int(answers.group(1)) > int(steps.group(2)) > 0
    for rank in (0, 1):
        line = re.search(rf"rank {rank}: (\d+) steps compared .*, (\d+) mismatches; (.*)", out)
        assert line is not None, out[-2000:]
        assert int(line.group(1)) == int(steps.group(1))
        assert int(line.group(2)) == 0
        assert line.group(3) == "replay == eager: yes"
    assert "MISMATCH" not in out and "MISSING" not in out


def _row(step: int, matches: bool | None = True) -> StepRow:
    return StepRow(step, "decode", 1, 2, 2, "replay", 1.0, 1.0, matches, None)


def test_a_rank_that_disagrees_fails_the_demo() -> None:
    """Any mismatch, missing or extra step, or replay != eager on a rank makes it fail."""
    steps = [0, 1, 2]
    good = RankReport(0, [_row(i) for i in steps], 1, 0.1, steps, [])
    lines: list[str] = []
    assert report_ranks([good, dataclasses.replace(good, rank=1)], steps, lines.append)
    assert lines[1].startswith("rank 1: 3 steps compared with the single-rank answer, 0 mis")
    for bad in (
        dataclasses.replace(good, mismatched=[2]),
        dataclasses.replace(good, compared=[0, 1]),
        dataclasses.replace(good, compared=[0, 1, 2, 3]),
        dataclasses.replace(good, rows=[_row(0), _row(1, False), _row(2)]),
    ):
        lines.clear()
        assert not report_ranks([good, bad], steps, lines.append)
        assert "rank 0: 3 steps compared" in lines[0] and "NO" not in lines[0]
        assert "MISMATCH" in lines[1] or "MISSING" in lines[1] or "NO" in lines[1], lines[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cuda", "--dcp", "2"], "--dcp 2 runs CPU processes over gloo: it needs "
         "--device cpu, got cuda"),
        (["--device", "cpu", "--dcp", "0"], "--dcp must be an int >= 1, got 0"),
        (["--device", "cpu", "--dcp", "-3"], "--dcp must be an int >= 1, got -3"),
        (["--device", "cpu", "--requests", "0"], "--requests must be >= 1, got 0"),
        (["--device", "cpu", "--warmup-workers", "0"], "--warmup-workers must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_bad_dcp_arguments_are_one_line_and_exit_2_before_any_work(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_work(*_: object, **__: object) -> None:
        raise AssertionError("the demo started")

    monkeypatch.setattr(demo, "ServingSimulation", no_work)
    monkeypatch.setattr(demo, "run_gloo_ranks", no_work)
    assert main(["demo", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"graphidx demo: error: {message}"]
