"""The demo's serving scheduler: every request prefills to the end and finishes."""

from __future__ import annotations

import numpy as np
import torch

from graphidx.cli.demo import DemoSettings, ServingSimulation


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
