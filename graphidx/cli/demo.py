"""A small serving simulation: requests arrive, prefill in chunks, decode speculatively, leave.

Every step writes the new tokens' keys into the paged MXFP4 caches, runs every indexer layer
through `IndexerGraphRunner` (replaying a captured graph for uniform decode steps, padded to
the next capture size), and checks the replayed top-k against an eager run of the same step.
On a CPU it runs the `cpu_demo` shape through the tape backend; on a GPU the full
DeepSeek-V4.1-Flash indexer shape through device graphs.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from graphidx.batch import StepBatch
from graphidx.config import IndexerConfig, cdiv
from graphidx.mxfp4 import cache_layout, compressed_slot_mapping, write_k_cache
from graphidx.runner import IndexerGraphRunner, IndexerStack
from graphidx.testing import random_kv_cache, random_layer_input


@dataclass
class Request:
    prompt_len: int
    output_len: int
    seq_len: int = 0  # tokens whose keys are in the cache
    generated: int = 0
    pages: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.seq_len < self.prompt_len

    @property
    def done(self) -> bool:
        return self.generated >= self.output_len


@dataclass(frozen=True)
class DemoSettings:
    config: IndexerConfig
    stack: IndexerStack
    device: torch.device
    graph_backend: str
    num_requests: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]
    max_running: int
    seed: int = 0

    @classmethod
    def for_device(cls, device: torch.device, *, seed: int = 0) -> DemoSettings:
        """The CPU shape on a CPU (tape), the full V4.1-Flash shape on a GPU (device)."""
        if device.type == "cuda":
            config = IndexerConfig.deepseek_v41_flash(max_num_seqs=64, max_model_len=131072)
            consumers, backend, num_requests, max_running = 3, "device", 96, 64
            prompt_lens, output_lens = (2048, 65536), (16, 48)
        else:
            config = IndexerConfig.cpu_demo()
            consumers, backend, num_requests, max_running = 2, "tape", 24, 12
            prompt_lens, output_lens = (32, 1024), (8, 24)
        return cls(
            config,
            IndexerStack(candidate_source=True, consumers=consumers),
            device,
            backend,
            num_requests=num_requests,
            prompt_lens=prompt_lens,
            output_lens=output_lens,
            max_running=max_running,
            seed=seed,
        )

    def random_requests(self, rng: np.random.Generator) -> list[Request]:
        """`num_requests` requests: prompt lengths log-uniform in `prompt_lens`, output
        lengths uniform in `output_lens` (both ends included)."""
        low, high = self.prompt_lens
        return [
            Request(
                int(np.exp(rng.uniform(np.log(low), np.log(high)))),
                int(rng.integers(self.output_lens[0], self.output_lens[1] + 1)),
            )
            for _ in range(self.num_requests)
        ]


@dataclass(frozen=True)
class StepRow:
    step: int
    kind: str
    num_reqs: int
    num_tokens: int
    padded_to: int | None
    mode: str
    millis: float
    eager_millis: float | None
    matches_eager: bool | None
    eager_reason: str | None


class ServingSimulation:
    """Drives the runner like a serving loop would, with a page allocator and a scheduler."""

    def __init__(self, settings: DemoSettings) -> None:
        self.s = settings
        cfg = settings.config
        self.rng = np.random.default_rng(settings.seed)
        self.gen = torch.Generator().manual_seed(settings.seed)
        self.device_gen = torch.Generator(device=settings.device).manual_seed(settings.seed)
        pages_per_req = cdiv(
            cdiv(settings.prompt_lens[1] + settings.output_lens[1] * cfg.next_n, cfg.block_size)
            * cfg.block_size
            // cfg.compress_ratio,
            cfg.page_entries,
        )
        self.num_pages = settings.max_running * pages_per_req + 1
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        self.layout = cache_layout(cfg.num_heads, cfg.head_dim, cfg.page_entries)
        self.caches = [
            random_kv_cache(cfg, self.num_pages, settings.device, self.gen)
            for _ in range(settings.stack.num_layers)
        ]
        self.runner = IndexerGraphRunner(
            cfg,
            settings.stack,
            self.caches,
            settings.device,
            graph_backend=settings.graph_backend,
        )
        self.waiting = settings.random_requests(self.rng)
        self.running: list[Request] = []

    # -- scheduling
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.s.max_running:
            self.running.append(self.waiting.pop(0))

    def _schedule(self) -> list[tuple[Request, int]]:
        """Decodes first (next_n rows each), then prefill chunks within the token budget."""
        cfg = self.s.config
        budget = cfg.max_num_batched_tokens
        decodes = [r for r in self.running if not r.prefilling]
        prefills = [r for r in self.running if r.prefilling]
        plan: list[tuple[Request, int]] = []
        for r in decodes:
            if budget >= cfg.next_n:
                plan.append((r, cfg.next_n))
                budget -= cfg.next_n
        for r in prefills:
            if budget <= cfg.next_n:
                break
            left = r.prompt_len - r.seq_len
            take = min(left, budget)
            if take < left and left - take <= cfg.next_n:
                take = left - cfg.next_n - 1  # never leave a remainder a decode would claim
            if take <= cfg.next_n:  # a prefill chunk must be longer than a decode
                continue
            plan.append((r, take))
            budget -= take
        return plan

    def _grow(self, r: Request, new_len: int) -> None:
        cfg = self.s.config
        need = cdiv(new_len // cfg.compress_ratio, cfg.page_entries)
        while len(r.pages) < need:
            r.pages.append(self.free_pages.pop())

    def _write_keys(self, plan: list[tuple[Request, int]], table: torch.Tensor) -> None:
        """Write the keys of this step's new tokens into every layer's cache."""
        cfg, dev = self.s.config, self.s.device
        positions: list[int] = []
        reqs: list[int] = []
        for i, (r, q) in enumerate(plan):
            positions.extend(range(r.seq_len, r.seq_len + q))
            reqs.extend([i] * q)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        req = torch.tensor(reqs, dtype=torch.int64, device=dev)
        slots = compressed_slot_mapping(pos, req, table, cfg.compress_ratio, cfg.page_entries)
        for cache in self.caches:
            keys = torch.randn(len(positions), cfg.head_dim, generator=self.device_gen, device=dev)
            write_k_cache(keys, slots, cache, self.layout)

    def step(self, index: int) -> StepRow | None:
        self._admit()
        plan = self._schedule()
        if not plan:
            return None
        cfg, dev = self.s.config, self.s.device
        for r, q in plan:
            self._grow(r, r.seq_len + q)
        width = max(len(r.pages) for r, _ in plan)
        table = torch.zeros(len(plan), width, dtype=torch.int32)
        for i, (r, _) in enumerate(plan):
            table[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        table = table.to(dev)
        self._write_keys(plan, table)
        query_lens = [q for _, q in plan]
        seq_lens = [r.seq_len + q for r, q in plan]
        batch = StepBatch.from_lists(
            cfg, query_lens, seq_lens, table, num_pages=self.num_pages, device=dev
        )
        tokens = sum(query_lens)
        inputs = tuple(
            random_layer_input(cfg, tokens, dev, self.gen) for _ in range(self.s.stack.num_layers)
        )
        result = self.runner.step(batch, inputs, synchronize=True)
        matches: bool | None = None
        eager_ms: float | None = None
        if result.replayed:
            # The same step eagerly and unpadded: the answer replay must reproduce.
            replayed = torch.sort(result.topk.to(torch.int64), dim=-1).values.cpu()
            eager = self.runner.step(batch, inputs, pad=False, synchronize=True)
            eager_ms = eager.seconds * 1e3
            eager_sorted = torch.sort(eager.topk.to(torch.int64), -1).values.cpu()
            matches = bool((eager_sorted == replayed).all())
        kinds = {"prefill" if r.prefilling else "decode" for r, _ in plan}
        kind = "mixed" if len(kinds) == 2 else kinds.pop()
        self._advance(plan)
        return StepRow(
            index,
            kind,
            len(plan),
            tokens,
            result.shape.num_tokens if result.shape is not None else None,
            "replay" if result.replayed else "eager",
            result.seconds * 1e3,
            eager_ms,
            matches,
            result.eager_reason,
        )

    def _advance(self, plan: list[tuple[Request, int]]) -> None:
        """Accept speculative tokens (1..next_n), finish requests, free their pages."""
        cfg = self.s.config
        for r, q in plan:
            if r.prefilling:
                r.seq_len += q
            else:
                accepted = int(self.rng.integers(1, cfg.next_n + 1))
                r.seq_len += accepted
                r.generated += accepted
            if r.done:
                self.running.remove(r)
                self.free_pages.extend(r.pages)
                r.pages.clear()

    def run(self, on_row: Callable[[StepRow], None], max_steps: int = 10_000) -> list[StepRow]:
        rows = []
        for index in range(max_steps):
            if not self.waiting and not self.running:
                break
            row = self.step(index)
            if row is not None:
                rows.append(row)
                on_row(row)
        return rows


def format_row(row: StepRow) -> str:
    padded = "-" if row.padded_to is None else str(row.padded_to)
    check = {None: "", True: "yes", False: "NO"}[row.matches_eager]
    eager = "" if row.eager_millis is None else f"{row.eager_millis:.2f}"
    return (
        f"{row.step:>5} {row.kind:>8} {row.num_reqs:>5} {row.num_tokens:>7} {padded:>7} "
        f"{row.mode:>7} {row.millis:>9.2f} {eager:>9} {check:>8}"
    )


HEADER = (
    f"{'step':>5} {'kind':>8} {'reqs':>5} {'tokens':>7} {'padded':>7} {'mode':>7} "
    f"{'ms':>9} {'eager ms':>9} {'==eager':>8}"
)


def run_demo(
    device: torch.device, *, seed: int = 0, print_fn: Callable[[str], None] = print
) -> bool:
    """Run the simulation, print the per-step table and a summary; True when every replayed
    step matched its eager run."""
    settings = DemoSettings.for_device(device, seed=seed)
    cfg = settings.config
    print_fn(
        f"graphidx demo on {device} ({settings.graph_backend} graphs): {cfg.num_heads} heads x "
        f"{cfg.head_dim}, R={cfg.compress_ratio}, next_n={cfg.next_n}, top-{cfg.topk_tokens}, "
        f"candidate pool {cfg.candidate_topk_blocks} x {cfg.candidate_block_size}, "
        f"layers: 1 source + {settings.stack.consumers} consumers"
    )
    sim = ServingSimulation(settings)
    start = time.perf_counter()
    sim.runner.capture(
        on_progress=lambda i, n, shape: (
            print_fn(f"  captured {i}/{n}: {shape.label}") if i == n else None
        )
    )
    capture_s = time.perf_counter() - start
    print_fn(f"captured {len(sim.runner.graphs)} graphs in {capture_s:.2f} s")
    print_fn(HEADER)
    rows = sim.run(lambda row: print_fn(format_row(row)))
    replayed = [r for r in rows if r.mode == "replay"]
    eager = [r for r in rows if r.mode == "eager"]
    bad = [r for r in replayed if r.matches_eager is False]
    padding = sum((r.padded_to or r.num_tokens) - r.num_tokens for r in rows)
    reasons = Counter(r.eager_reason for r in eager)

    def mean_ms(values: list[float]) -> str:
        return f"{np.mean(values):.2f} ms" if values else "-"

    print_fn("")
    print_fn(
        f"summary: {len(rows)} steps; {len(replayed)} replayed, mean "
        f"{mean_ms([r.millis for r in replayed])} (the same steps eagerly: "
        f"{mean_ms([r.eager_millis for r in replayed if r.eager_millis is not None])}); "
        f"{len(eager)} eager, mean {mean_ms([r.millis for r in eager])}; "
        f"{padding} padding rows"
    )
    if settings.graph_backend == "tape":
        print_fn("  (tape backend: these timings are not meaningful; only replay == eager is)")
    for reason, count in sorted(reasons.items(), key=lambda kv: str(kv[0])):
        print_fn(f"  eager: {count} x {reason}")
    print_fn(
        f"replay == eager: {len(replayed) - len(bad)}/{len(replayed)} replayed steps"
        + ("" if not bad else f"  MISMATCH in steps {[r.step for r in bad]}")
    )
    return not bad
