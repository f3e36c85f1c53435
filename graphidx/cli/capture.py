"""`graphidx capture`: the capture sweep a serving runtime runs at start-up.

It builds an `IndexerGraphRunner` for a preset model shape, captures the uniform-decode step
of every size of the runner's capture ladder (largest first, one memory pool), and reports,
per size, the capture time and the graph's memory: on a GPU (device graphs) the bytes the
capture added to the graph pool; on a CPU (the tape backend) the number of recorded ops and
the bytes of the tape's private tensors. It warns when the largest batch the runtime expects
(`--max-batch`) is above the largest captured size: such steps would run eagerly.

Presets (`--preset`; default `cpu-demo` on a CPU, `v41-flash` on a GPU):
- `cpu-demo`: `IndexerConfig.cpu_demo()`, 1 candidate source + 2 consumer layers;
- `v41-flash`: `IndexerConfig.deepseek_v41_flash()`, 1 candidate source + 3 consumer layers;
- `v32`: `IndexerConfig.deepseek_v32()`, 2 dense indexer layers.
The model presets are full size, meant for a GPU; on a CPU they run on the tape too, but
allocate their full workspaces (several GiB for v41-flash's 1M-token window).
Sizes and `--max-batch` count query tokens (rows) of a uniform decode step, so with
`next_n = 2` a batch of 64 decode requests is 128 tokens.

JSON report (`--json PATH`), one object (`schema_version` 1):

    schema_version      int, 1
    preset              str: "cpu-demo" | "v41-flash" | "v32"
    device              str, e.g. "cpu", "cuda:0"
    graph_backend       str: "tape" (CPU) | "device" (CUDA/HIP graphs)
    ops_backend         str: "reference" | "triton" | "aiter"
    config              object: every IndexerConfig field by name
    stack               object: {"dense": int, "candidate_source": bool, "consumers": int}
    capture_sizes       list[int]: the captured token counts, ascending
    max_batch           int | null: --max-batch, in tokens
    largest_captured    int: the largest captured token count
    covered             bool: max_batch is null or <= largest_captured
    warnings            list[str]: e.g. the --max-batch warning (empty when none)
    persistent_bytes    int: the runner's persistent buffers (inputs, top-k, workspace,
                        builder), allocated once; the KV caches are not included
    kv_cache_bytes      int: the KV caches the sweep allocated (one per layer)
    graphs              list[object], ascending by num_tokens, one per captured size:
        num_tokens, num_reqs, uniform_query_len    int: the graph's StepShape
        label                                      str, e.g. "tokens=8,reqs=4,q=2"
        warmup_seconds, capture_seconds            float: eager warm-up run, capture
        num_bytes     int | null: device: bytes the capture added to the graph pool;
                      tape: bytes of the tape's private tensors
        num_ops       int | null: tape: recorded ops; device: null
    totals              object:
        num_graphs       int
        capture_seconds  float: warm-up plus capture of every graph
        wall_seconds     float: the whole sweep (dummy batches, metadata, captures)
        num_bytes        int | null: sum of the graphs' num_bytes
        num_ops          int | null: sum of the graphs' num_ops
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from capture import StepShape
from graphidx.cli.options import check_output_file, resolve_device
from graphidx.config import IndexerConfig
from graphidx.ops import resolve_backend
from graphidx.runner import IndexerGraphRunner, IndexerStack
from graphidx.testing import random_kv_cache

SCHEMA_VERSION = 1
PRESETS = ("cpu-demo", "v41-flash", "v32")


@dataclass(frozen=True)
class SweepSettings:
    """What the sweep captures: a model shape, its indexer stack, where, and how."""

    preset: str
    config: IndexerConfig
    stack: IndexerStack
    device: torch.device
    graph_backend: str


def sweep_settings(preset: str | None, device: torch.device) -> SweepSettings:
    """The settings of `preset` on `device` (None: cpu-demo on a CPU, v41-flash on a GPU).

    Device graphs on a GPU, the tape elsewhere. ValueError for an unknown preset.
    """
    if preset is None:
        preset = "v41-flash" if device.type == "cuda" else "cpu-demo"
    if preset == "cpu-demo":
        config = IndexerConfig.cpu_demo()
        stack = IndexerStack(candidate_source=True, consumers=2)
    elif preset == "v41-flash":
        config = IndexerConfig.deepseek_v41_flash()
        stack = IndexerStack(candidate_source=True, consumers=3)
    elif preset == "v32":
        config = IndexerConfig.deepseek_v32()
        stack = IndexerStack(dense=2)
    else:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    graph_backend = "device" if device.type == "cuda" else "tape"
    return SweepSettings(preset, config, stack, device, graph_backend)


@dataclass
class SweepReport:
    """The sweep's outcome; `to_dict()` is the JSON report (module docstring).

    `stats`: the runner's `GraphCache.stats().to_dict()` right after the captures.
    """

    settings: SweepSettings
    ops_backend: str
    capture_sizes: list[int]
    max_batch: int | None
    persistent_bytes: int
    kv_cache_bytes: int
    stats: dict[str, Any]
    wall_seconds: float
    warnings: list[str] = field(default_factory=list)

    @property
    def largest_captured(self) -> int:
        return self.capture_sizes[-1]

    @property
    def covered(self) -> bool:
        return self.max_batch is None or self.max_batch <= self.largest_captured

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        totals = self.stats["totals"]
        return {
            "schema_version": SCHEMA_VERSION,
            "preset": s.preset,
            "device": str(s.device),
            "graph_backend": s.graph_backend,
            "ops_backend": self.ops_backend,
            "config": dataclasses.asdict(s.config),
            "stack": {
                "dense": s.stack.dense,
                "candidate_source": s.stack.candidate_source,
                "consumers": s.stack.consumers,
            },
            "capture_sizes": list(self.capture_sizes),
            "max_batch": self.max_batch,
            "largest_captured": self.largest_captured,
            "covered": self.covered,
            "warnings": list(self.warnings),
            "persistent_bytes": self.persistent_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "graphs": [{key: graph[key] for key in _GRAPH_KEYS} for graph in self.stats["graphs"]],
            "totals": {
                "num_graphs": totals["num_graphs"],
                "capture_seconds": totals["capture_seconds"],
                "wall_seconds": self.wall_seconds,
                "num_bytes": totals["num_bytes"],
                "num_ops": totals["num_ops"],
            },
        }


_GRAPH_KEYS = (
    "num_tokens",
    "num_reqs",
    "uniform_query_len",
    "label",
    "warmup_seconds",
    "capture_seconds",
    "num_bytes",
    "num_ops",
)


class ProgressBar:
    """A one-line text progress bar, redrawn in place with a carriage return (no dependency)."""

    def __init__(self, stream: TextIO, *, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.start = time.perf_counter()
        self._last_length = 0

    def update(self, done: int, total: int, label: str) -> None:
        """Draw `done` of `total` and a label; end the line once `done == total`."""
        total = max(total, 1)
        filled = self.width * min(done, total) // total
        elapsed = time.perf_counter() - self.start
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {done}/{total} {label} ({elapsed:.1f} s)"
        # Blank out what is left of a longer previous line.
        self.stream.write("\r" + line.ljust(self._last_length))
        self._last_length = len(line)
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def capture_sweep(
    settings: SweepSettings,
    *,
    max_batch: int | None = None,
    on_progress: Callable[[int, int, StepShape], None] | None = None,
) -> SweepReport:
    """Build the runner of `settings` and capture every size of its ladder.

    `max_batch`: the largest uniform decode step the runtime expects, in tokens (>= 1);
    a warning is added when it is above the largest captured size. `on_progress(i, n, shape)`
    is called with i = 0 and the first shape before the first capture, then after each
    capture (largest shape first). The KV caches are random (every page written once), sized
    so that the runner's dummy capture batches fit.
    """
    if max_batch is not None and (
        isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1
    ):
        raise ValueError(f"max_batch must be None or an int >= 1, got {max_batch!r}")
    start = time.perf_counter()
    cfg, device = settings.config, settings.device
    # One page per dummy request: capture batches have up to max_num_seqs requests whose
    # next_n keys fit one page each.
    num_pages = cfg.max_num_seqs
    gen = torch.Generator().manual_seed(0)
    caches = [
        random_kv_cache(cfg, num_pages, device, gen) for _ in range(settings.stack.num_layers)
    ]
    runner = IndexerGraphRunner(
        cfg, settings.stack, caches, device, graph_backend=settings.graph_backend
    )
    if on_progress is not None:
        shapes = runner.capture_sizes.shapes()
        on_progress(0, len(shapes), shapes[-1])
    runner.capture(on_progress=on_progress)
    wall_seconds = time.perf_counter() - start
    sizes = list(runner.capture_sizes.sizes)
    report = SweepReport(
        settings=settings,
        ops_backend=resolve_backend(runner.ops_backend, device),
        capture_sizes=sizes,
        max_batch=max_batch,
        persistent_bytes=runner.total_bytes(),
        kv_cache_bytes=sum(c.numel() * c.element_size() for c in caches),
        stats=runner.graphs.stats().to_dict(),
        wall_seconds=wall_seconds,
    )
    if not report.covered:
        report.warnings.append(
            f"--max-batch {max_batch} tokens is above the largest captured size "
            f"{report.largest_captured}: decode steps of {report.largest_captured + 1}.."
            f"{max_batch} tokens will run eagerly"
        )
    return report


def _mib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:.2f} MiB"


def format_report(report: SweepReport) -> list[str]:
    """The per-size table and the total line, as printed by `graphidx capture`."""
    s = report.settings
    stack = s.stack
    layers = ", ".join(
        part
        for part in (
            f"{stack.dense} dense" if stack.dense else "",
            "1 candidate source" if stack.candidate_source else "",
            f"{stack.consumers} consumers" if stack.consumers else "",
        )
        if part
    )
    tape = s.graph_backend == "tape"
    lines = [
        f"graphidx capture: preset {s.preset} on {s.device} ({s.graph_backend} graphs, "
        f"{report.ops_backend} ops), layers: {layers}; {len(report.capture_sizes)} sizes up "
        f"to {report.largest_captured} tokens",
        f"{'tokens':>7} {'reqs':>5} {'warmup ms':>10} {'capture ms':>11} "
        + (f"{'ops':>7} {'private bytes':>14}" if tape else f"{'graph bytes':>14}"),
    ]
    for graph in report.stats["graphs"]:
        memory = (
            f"{_count(graph['num_ops']):>7} {_count(graph['num_bytes']):>14}"
            if tape
            else f"{_count(graph['num_bytes']):>14}"
        )
        lines.append(
            f"{graph['num_tokens']:>7} {graph['num_reqs']:>5} "
            f"{graph['warmup_seconds'] * 1e3:>10.1f} {graph['capture_seconds'] * 1e3:>11.1f} "
            + memory
        )
    totals = report.stats["totals"]
    memory_total = (
        f"{_count(totals['num_ops'])} recorded ops, {_count(totals['num_bytes'])} private bytes"
        if tape
        else f"{_mib(totals['num_bytes'])} of graph memory"
    )
    lines.append(
        f"total: {totals['num_graphs']} graphs, {totals['capture_seconds']:.2f} s warm-up + "
        f"capture ({report.wall_seconds:.2f} s wall), {memory_total}; persistent buffers "
        f"{_mib(report.persistent_bytes)}, KV caches {_mib(report.kv_cache_bytes)}"
    )
    return lines


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def run_capture_sweep(args: argparse.Namespace) -> int:
    """The `graphidx capture` command: `args.device`, `args.preset`, `args.max_batch`,
    `args.json_path`. Prints the table on stdout, progress and warnings on stderr; 0 on
    success (a warning does not fail the sweep). Bad arguments (the device, --max-batch, a
    --json whose folder does not exist) raise ValueError before the sweep starts."""
    device = resolve_device(args.device)
    settings = sweep_settings(args.preset, device)
    if args.max_batch is not None and args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    json_path = check_output_file("--json", args.json_path) if args.json_path else None
    bar = ProgressBar(sys.stderr)

    def progress(done: int, total: int, shape: StepShape) -> None:
        bar.update(done, total, ("captured " if done else "capturing ") + shape.label)

    report = capture_sweep(settings, max_batch=args.max_batch, on_progress=progress)
    for line in format_report(report):
        print(line)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if json_path is not None:
        with json_path.open("w", encoding="utf-8") as handle:
            json.dump(report.to_dict(), handle, indent=2)
            handle.write("\n")
        print(f"wrote {args.json_path}")
    return 0
