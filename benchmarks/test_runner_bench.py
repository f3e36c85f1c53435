"""Runner step cost: a replayed graph against the same step run eagerly, and the layers alone
(pytest-benchmark; never part of CI pass/fail).

Run: `python -m pytest benchmarks/test_runner_bench.py --benchmark-enable -q`. On the CPU the
cpu_demo shape (1 candidate source + 2 consumers, reference ops) replays through the tape,
which skips the layers' Python (validation, views) but runs the same ops, so on a CPU the two
modes mostly differ by that host cost. On a GPU (`gpu`-marked cases) a V4.1-Flash-shaped
stack at a 64K window replays CUDA graphs; there the step time is the device time plus the
host `build()`.
Every timed call ends with a device synchronization. Without `--benchmark-enable` each case
runs once, as a smoke test of the setup.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture

from capture import CaptureSizes
from graphidx.batch import StepBatch
from graphidx.builder import CandidateIndexerMetadataBuilder
from graphidx.config import IndexerConfig
from graphidx.indexer import candidate_consumer, dense_indexer
from graphidx.metadata import IndexerMetadata
from graphidx.runner import IndexerGraphRunner, IndexerStack, LayerInput
from graphidx.testing import random_kv_cache, random_layer_input
from graphidx.workspace import IndexerWorkspace

STACK = IndexerStack(candidate_source=True, consumers=2)


@dataclass(frozen=True)
class Shape:
    """A benchmarked model shape on one device: its config, KV pages and decode batches."""

    device: str
    config: IndexerConfig
    num_pages: int
    num_reqs: tuple[int, ...]


SHAPES = {
    "cpu": Shape("cpu", IndexerConfig.cpu_demo(), num_pages=256, num_reqs=(1, 8, 32)),
    "cuda": Shape(
        "cuda",
        IndexerConfig.deepseek_v41_flash(max_model_len=65536, max_num_seqs=64),
        num_pages=8192,
        num_reqs=(1, 16, 64),
    ),
}
# tests/conftest.py does not reach benchmarks/, so the GPU cases skip themselves.
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]
CASES = [
    pytest.param(device, n, id=f"{device}-reqs{n}", marks=GPU if device == "cuda" else [])
    for device, shape in SHAPES.items()
    for n in shape.num_reqs
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Setup:
    runner: IndexerGraphRunner
    batches: dict[int, tuple[StepBatch, list[LayerInput]]]


_setups: dict[str, Setup] = {}


def _decode_batch(
    shape: Shape, num_reqs: int, gen: torch.Generator
) -> tuple[StepBatch, list[LayerInput]]:
    """`num_reqs` uniform decode requests, contexts spread up to the window, random pages."""
    cfg = shape.config
    seq_lens = torch.randint(cfg.next_n, cfg.max_model_len + 1, (num_reqs,), generator=gen)
    table = torch.randint(
        0, shape.num_pages, (num_reqs, cfg.max_blocks_per_seq), generator=gen, dtype=torch.int32
    )
    batch = StepBatch.from_lists(
        cfg,
        [cfg.next_n] * num_reqs,
        seq_lens.tolist(),
        table,
        num_pages=shape.num_pages,
        device=shape.device,
    )
    tokens = batch.num_tokens
    inputs = [random_layer_input(cfg, tokens, shape.device, gen) for _ in range(STACK.num_layers)]
    return batch, inputs


def _setup(device: str) -> Setup:
    """One runner per device, its ladder captured at exactly the benchmarked sizes."""
    if device not in _setups:
        shape = SHAPES[device]
        cfg = shape.config
        gen = torch.Generator().manual_seed(0)
        caches = [
            random_kv_cache(cfg, shape.num_pages, device, gen) for _ in range(STACK.num_layers)
        ]
        sizes = [n * cfg.next_n for n in shape.num_reqs]
        runner = IndexerGraphRunner(
            cfg,
            STACK,
            caches,
            device,
            graph_backend="device" if device == "cuda" else "tape",
            capture_sizes=CaptureSizes(sizes, max_size=max(sizes), uniform_query_len=cfg.next_n),
        )
        runner.capture()
        batches = {n: _decode_batch(shape, n, gen) for n in shape.num_reqs}
        _setups[device] = Setup(runner, batches)
    return _setups[device]


@pytest.mark.parametrize("mode", ["replay", "eager"])
@pytest.mark.parametrize(("device", "num_reqs"), CASES)
def test_decode_step(benchmark: BenchmarkFixture, device: str, num_reqs: int, mode: str) -> None:
    """One decode step of every layer: `runner.step`, replayed or forced eager."""
    setup = _setup(device)
    batch, inputs = setup.batches[num_reqs]
    result = benchmark(setup.runner.step, batch, inputs, force_eager=mode == "eager")
    assert result.replayed == (mode == "replay")
    assert result.padded_tokens == 0


def _layer_fn(device: str, num_reqs: int, layer: str) -> tuple[Callable[[], None], IndexerMetadata]:
    """A layer alone on eagerly built decode metadata (no padding, no graph)."""
    shape = SHAPES[device]
    cfg = shape.config
    setup = _setup(device)
    batch, inputs = setup.batches[num_reqs]
    builder = CandidateIndexerMetadataBuilder(cfg, device, num_pages=shape.num_pages)
    metadata = builder.build(batch)
    workspace = IndexerWorkspace(cfg, device)
    topk = torch.empty(batch.num_tokens, cfg.topk_tokens, dtype=torch.int32, device=device)
    dev = torch.device(device)
    caches = setup.runner.kv_caches

    def source() -> None:
        inp = inputs[0]
        args = (metadata, inp.q, inp.q_scale, inp.weights, caches[0], topk, workspace)
        dense_indexer(*args, config=cfg, candidate_source=True)

    def consumer() -> None:
        inp = inputs[1]
        args = (metadata, inp.q, inp.q_scale, inp.weights, caches[1], topk, workspace)
        candidate_consumer(*args, config=cfg, resolve_pool=True)

    source()  # the consumer reads the source's candidate blocks
    _sync(dev)
    run = source if layer == "source" else consumer

    def timed() -> None:
        run()
        _sync(dev)

    return timed, metadata


@pytest.mark.parametrize("layer", ["source", "consumer"])
@pytest.mark.parametrize(("device", "num_reqs"), CASES)
def test_decode_layer(benchmark: BenchmarkFixture, device: str, num_reqs: int, layer: str) -> None:
    """One indexer layer's kernels on a decode step (eager launch, synchronized)."""
    timed, metadata = _layer_fn(device, num_reqs, layer)
    benchmark(timed)
    rows = num_reqs * SHAPES[device].config.next_n
    assert metadata.decode is not None and metadata.decode.num_rows == rows
