"""IndexerGraphRunner: one step of every indexer layer, replayed from a captured graph.

The runner owns everything a FULL graph reads: the persistent step inputs (query offsets,
sequence lengths, block table, and per layer q / q_scale / weights), the metadata builder and
its buffers, the layers' workspace, the per-layer top-k output, and a `capture.GraphCache`.
A step copies the live rows into the persistent inputs, pads a uniform decode step up to the
next captured size (padding requests have zero query rows and zero context, their rows are
zeroed, so they are harmless by construction), builds the metadata into the builder's
persistent buffers, then replays the graph captured for that padded shape — or, for any other
step, runs the very same layer code eagerly.

What the caller owns: the KV caches (one per layer, allocated once; the runner records their
addresses and graphs read them in place) and the step's `StepBatch` and `LayerInput`s, which
are copied, so they may be freed or reused after `step` returns.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from capture import CaptureSizes, GraphCache, StaticBuffers, StepShape, get_backend
from graphidx.batch import StepBatch
from graphidx.builder import (
    CandidateIndexerMetadataBuilder,
    IndexerMetadataBuilder,
    canonical_device,
)
from graphidx.config import IndexerConfig
from graphidx.indexer import candidate_consumer, dense_indexer
from graphidx.metadata import IndexerMetadata
from graphidx.workspace import IndexerWorkspace

logger = logging.getLogger("graphidx.runner")

DENSE, SOURCE, CONSUMER = "dense", "source", "consumer"


@dataclass(frozen=True)
class IndexerStack:
    """The indexer layers a model runs each step, in order.

    `dense`: plain indexer layers (every indexer layer of DeepSeek-V3.2); `candidate_source`:
    the two-level indexer's source layer (dense, also picks the step's candidate blocks);
    `consumers`: later layers that score only the source's candidate pool.
    """

    dense: int = 0
    candidate_source: bool = False
    consumers: int = 0

    def __post_init__(self) -> None:
        if self.dense < 0 or self.consumers < 0:
            raise ValueError(f"layer counts must be >= 0, got {self}")
        if self.consumers and not self.candidate_source:
            raise ValueError("consumers need a candidate_source layer before them")
        if self.num_layers == 0:
            raise ValueError("an IndexerStack needs at least one layer")

    @property
    def kinds(self) -> tuple[str, ...]:
        source = (SOURCE,) if self.candidate_source else ()
        return (DENSE,) * self.dense + source + (CONSUMER,) * self.consumers

    @property
    def num_layers(self) -> int:
        return self.dense + int(self.candidate_source) + self.consumers


@dataclass(frozen=True)
class LayerInput:
    """One indexer layer's per-step input: MXFP4 q (uint8 `[tokens, H, D/2]`), its e8m0
    scales (uint8 `[tokens, H, D/32]`) and the head weights (float32 `[tokens, H]`)."""

    q: torch.Tensor
    q_scale: torch.Tensor
    weights: torch.Tensor


@dataclass
class RunnerCounters:
    """What the runner did, step by step: modes, padding, and time."""

    steps: int = 0
    replayed: int = 0
    eager: int = 0
    padded_tokens: int = 0
    eager_reasons: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class StepResult:
    """How one step ran. `topk` views the runner's output `[layers, tokens, topk_tokens]`
    (real rows only) and is overwritten by the next step."""

    topk: torch.Tensor
    shape: StepShape | None
    replayed: bool
    padded_tokens: int
    seconds: float
    eager_reason: str | None = None


class IndexerGraphRunner:
    """Builder + persistent buffers + workspace + GraphCache for one indexer stack."""

    def __init__(
        self,
        config: IndexerConfig,
        stack: IndexerStack,
        kv_caches: Sequence[torch.Tensor],
        device: torch.device | str,
        *,
        graph_backend: str = "device",
        ops_backend: str | None = None,
        capture_sizes: CaptureSizes | None = None,
        compile_layers: bool = False,
        compile_backend: str | None = None,
    ) -> None:
        """`kv_caches`: one paged uint8 cache per layer (SPEC 4), never reallocated.
        `graph_backend`: "device" (CUDA/HIP graphs) or "tape" (any device). `ops_backend`:
        the kernels' backend (None: the device's default). `compile_layers`: run the
        uniform-decode layer step (captured, replayed, and its eager runs) through
        `torch.compile(fullgraph=True)`; other steps change structure every step and run the
        plain layers. `compile_backend`: torch.compile's backend, by default "inductor" for
        device graphs and "eager" for the tape — the tape records dispatched ops, and
        inductor's fused kernels are not dispatched ops, so only "eager" is sound there."""
        self.config = config
        self.stack = stack
        self.device = canonical_device(device)
        if len(kv_caches) != stack.num_layers:
            raise ValueError(
                f"kv_caches has {len(kv_caches)} caches for {stack.num_layers} indexer layers"
            )
        for i, cache in enumerate(kv_caches):
            if cache.device != self.device or cache.dtype != torch.uint8 or cache.dim() != 2:
                raise ValueError(
                    f"kv_caches[{i}] must be a 2-D uint8 tensor on {self.device}, got "
                    f"{tuple(cache.shape)} {cache.dtype} on {cache.device}"
                )
        self.kv_caches = tuple(kv_caches)
        self.num_pages = min(int(c.shape[0]) for c in kv_caches)
        self.ops_backend = ops_backend
        max_rows = min(config.max_num_batched_tokens, config.max_num_seqs * config.next_n)
        self.capture_sizes = capture_sizes or CaptureSizes(
            max_size=max_rows, uniform_query_len=config.next_n
        )
        if self.capture_sizes.uniform_query_len != config.next_n:
            raise ValueError(
                f"capture_sizes.uniform_query_len ({self.capture_sizes.uniform_query_len}) "
                f"must equal config.next_n ({config.next_n})"
            )
        if self.capture_sizes.largest > max_rows:
            raise ValueError(
                f"capture size {self.capture_sizes.largest} exceeds the largest decode step "
                f"of this config ({max_rows} rows)"
            )
        self.builder: IndexerMetadataBuilder
        if stack.candidate_source:
            self.builder = CandidateIndexerMetadataBuilder(
                config, self.device, num_pages=self.num_pages, full_graph_decode=True
            )
        else:
            self.builder = IndexerMetadataBuilder(
                config, self.device, num_pages=self.num_pages, full_graph_decode=True
            )
        self.workspace = IndexerWorkspace(config, self.device)
        self.buffers = self._allocate_inputs()
        self.graphs = GraphCache(get_backend(graph_backend), buffers=self.buffers)
        self.counters = RunnerCounters()
        self._decode_layers = self._compiled_layers(compile_layers, compile_backend, graph_backend)

    def _compiled_layers(
        self, compile_layers: bool, compile_backend: str | None, graph_backend: str
    ) -> Callable[[IndexerMetadata], None]:
        if not compile_layers:
            if compile_backend is not None:
                raise ValueError("compile_backend is set but compile_layers=False")
            return self._run_layers
        backend = compile_backend or ("eager" if graph_backend == "tape" else "inductor")
        if graph_backend == "tape" and backend != "eager":
            raise ValueError(
                f"compile_backend={backend!r} with the tape: only 'eager' is sound (fused "
                "kernels are not dispatched ops, so the tape would not record them)"
            )
        compiled: Callable[[IndexerMetadata], None] = torch.compile(
            self._run_layers, fullgraph=True, backend=backend
        )
        return compiled

    # ------------------------------------------------------------------ buffers
    def _allocate_inputs(self) -> StaticBuffers:
        cfg, dev = self.config, self.device
        buffers = StaticBuffers(dev)
        tokens, reqs = cfg.max_num_batched_tokens, cfg.max_num_seqs
        buffers.add("query_start_loc", (reqs + 1,), torch.int32)
        buffers.add("seq_lens", (reqs,), torch.int32)
        buffers.add("block_table", (reqs, cfg.max_blocks_per_seq), torch.int32)
        h, d = cfg.num_heads, cfg.head_dim
        for i in range(self.stack.num_layers):
            buffers.add(f"q.{i}", (tokens, h, d // 2), torch.uint8)
            buffers.add(f"q_scale.{i}", (tokens, h, d // 32), torch.uint8)
            buffers.add(f"weights.{i}", (tokens, h), torch.float32)
        buffers.add("topk", (self.stack.num_layers, tokens, cfg.topk_tokens), torch.int32, fill=-1)
        return buffers

    @property
    def topk_buffer(self) -> torch.Tensor:
        """The persistent top-k output `[layers, max_num_batched_tokens, topk_tokens]`."""
        return self.buffers["topk"]

    def input_views(self, num_tokens: int) -> tuple[LayerInput, ...]:
        """Per layer, `LayerInput` views of the persistent inputs' first `num_tokens` rows.

        A model that writes its q / q_scale / weights straight into these views and passes
        them to `step` saves the runner's copies (rows already in place are not copied).
        """
        limit = self.config.max_num_batched_tokens
        if not 0 <= num_tokens <= limit:
            raise ValueError(f"num_tokens = {num_tokens} must be in [0, {limit}]")
        b = self.buffers
        return tuple(
            LayerInput(
                b[f"q.{i}"][:num_tokens],
                b[f"q_scale.{i}"][:num_tokens],
                b[f"weights.{i}"][:num_tokens],
            )
            for i in range(self.stack.num_layers)
        )

    def total_bytes(self) -> int:
        """Persistent bytes: step inputs, top-k, workspace and builder buffers."""
        builder = sum(t.numel() * t.element_size() for t in self.builder.buffers().values())
        return self.buffers.total_bytes() + self.workspace.total_bytes() + builder

    # ------------------------------------------------------------------ capture
    def capture(
        self,
        sizes: CaptureSizes | None = None,
        *,
        on_progress: Callable[[int, int, StepShape], None] | None = None,
    ) -> None:
        """Capture the uniform-decode step of every size (largest first, one memory pool).

        Each graph runs every indexer layer of the stack on a dummy uniform batch of that
        size; later steps of the same padded shape replay it with their own data.
        """
        sizes = sizes or self.capture_sizes
        shapes = sorted((s for s in sizes.shapes() if s not in self.graphs), reverse=True)
        for i, shape in enumerate(shapes, start=1):
            # Metadata built right before its capture: the warm-up reads this shape's rows.
            self.graphs.capture(shape, self._capture_fn(shape))
            if on_progress is not None:
                on_progress(i, len(shapes), shape)

    def _capture_fn(self, shape: StepShape) -> Callable[[], None]:
        """Load a dummy uniform batch of `shape`, build its metadata, and return the
        function the backend captures: every layer on that (shape-only) metadata."""
        next_n = self.config.next_n
        # Every dummy request reads page 0: any cache of at least one page can capture.
        dummy = StepBatch.from_lists(
            self.config,
            query_lens=[next_n] * shape.num_reqs,
            seq_lens=[next_n] * shape.num_reqs,
            block_table=torch.zeros(shape.num_reqs, 1, dtype=torch.int32, device=self.device),
            num_pages=self.num_pages,
            device=self.device,
        )
        self._load_batch(dummy, None, shape)
        metadata = self._build(dummy, shape)
        return lambda: self._decode_layers(metadata)

    # ------------------------------------------------------------------ step
    def step(
        self,
        batch: StepBatch,
        layer_inputs: Sequence[LayerInput],
        *,
        force_eager: bool = False,
        pad: bool = True,
        synchronize: bool = False,
    ) -> StepResult:
        """Run one step of every indexer layer; return the top-k of the real rows.

        A uniform decode step (every request has `next_n` query rows) is padded to the next
        captured size and replayed when that size was captured; anything else runs eagerly
        (counted with its reason). `force_eager` runs the same padded step eagerly;
        `pad=False` runs it unpadded (both used by the replay-correctness harness).
        `synchronize=True` waits for the device before returning, so that `seconds` is the
        step's wall time; by default the step returns as soon as its work is queued.
        """
        start = time.perf_counter()
        if len(layer_inputs) != self.stack.num_layers:
            raise ValueError(
                f"layer_inputs has {len(layer_inputs)} entries for "
                f"{self.stack.num_layers} indexer layers"
            )
        self._check_batch(batch)
        num_real = int(batch.query_start_loc_cpu[-1])
        for i, inp in enumerate(layer_inputs):
            self._check_layer_input(i, inp, batch.num_tokens)
        shape, reason = self._shape_of(batch) if pad else (None, "unpadded (pad=False)")
        self._load_batch(batch, layer_inputs, shape)
        metadata = self._build(batch, shape)
        replay = shape is not None and shape in self.graphs and not force_eager
        if replay:
            assert shape is not None
            self.graphs.replay(shape)
        else:
            if reason is None:
                label = shape.label if shape is not None else "?"
                reason = "forced eager" if force_eager else f"shape {label} not captured"
            if not force_eager and pad:
                self.graphs.record_eager(shape, reason)
            # Only captured shapes use the compiled step: others vary in structure per step.
            captured = shape is not None and shape in self.graphs
            layers = self._decode_layers if captured else self._run_layers
            layers(metadata)
        if synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        padded = (shape.num_tokens if shape is not None else batch.num_tokens) - num_real
        self._count(replay, padded, None if replay else reason)
        logger.debug(
            "step %d: %s, %d real rows, %d padding rows%s",
            self.counters.steps,
            "replay" if replay else "eager",
            num_real,
            padded,
            "" if replay else f" ({reason})",
        )
        topk = self.buffers["topk"][:, :num_real]
        return StepResult(topk, shape, replay, padded, seconds, None if replay else reason)

    def _count(self, replay: bool, padded: int, reason: str | None) -> None:
        c = self.counters
        c.steps += 1
        c.padded_tokens += padded
        if replay:
            c.replayed += 1
        else:
            c.eager += 1
            c.eager_reasons[reason or "?"] += 1

    def _shape_of(self, batch: StepBatch) -> tuple[StepShape | None, str | None]:
        """The padded graph key of a uniform decode step, or None and why not."""
        next_n = self.config.next_n
        query_lens = batch.query_lens_cpu
        if batch.num_reqs == 0 or bool((query_lens != next_n).any()):
            return None, "not a uniform decode step"
        if batch.num_tokens != batch.num_reqs * next_n:
            return None, "step already carries padding rows"
        shape = self.capture_sizes.pad(batch.num_tokens)
        if shape is None:
            logger.debug("%d tokens exceed the largest capture size", batch.num_tokens)
            return None, "above the largest capture size"
        return shape, None

    def _check_batch(self, batch: StepBatch) -> None:
        """The caller's batch must have been validated against this runner's config and
        cache: the padded copy the builder sees is rebuilt from the persistent inputs, so
        its own checks cannot see the caller's config, page count or table width."""
        self.builder.check_batch(batch)
        if batch.num_pages is None or batch.num_pages > self.num_pages:
            raise ValueError(
                f"batch.num_pages = {batch.num_pages}: a runner step needs a batch validated "
                f"against its caches (num_pages <= {self.num_pages})"
            )

    def _check_layer_input(self, i: int, inp: LayerInput, num_tokens: int) -> None:
        cfg = self.config
        want = {
            "q": ((cfg.num_heads, cfg.head_dim // 2), torch.uint8),
            "q_scale": ((cfg.num_heads, cfg.head_dim // 32), torch.uint8),
            "weights": ((cfg.num_heads,), torch.float32),
        }
        for name, (tail, dtype) in want.items():
            t = getattr(inp, name)
            if t.dtype != dtype or tuple(t.shape[1:]) != tail or t.shape[0] < num_tokens:
                raise ValueError(
                    f"layer_inputs[{i}].{name} must be {dtype} [>= {num_tokens}, "
                    f"{', '.join(map(str, tail))}], got {t.dtype} {tuple(t.shape)}"
                )
            if t.device != self.device:
                raise ValueError(
                    f"layer_inputs[{i}].{name} is on {t.device}, the runner on {self.device}"
                )

    # ------------------------------------------------------------------ internals
    def _load_batch(
        self,
        batch: StepBatch,
        layer_inputs: Sequence[LayerInput] | None,
        shape: StepShape | None,
    ) -> None:
        """Copy the step into the persistent inputs; zero the padding requests and rows."""
        n = batch.num_reqs
        reqs = shape.num_reqs if shape is not None else n
        tokens = shape.num_tokens if shape is not None else batch.num_tokens
        real_tokens = int(batch.query_start_loc_cpu[-1])
        b = self.buffers
        qsl = b["query_start_loc"]
        qsl[: n + 1].copy_(batch.query_start_loc, non_blocking=True)
        b["seq_lens"][:n].copy_(batch.seq_lens, non_blocking=True)
        width = batch.block_table.shape[1]
        b["block_table"][:n, :width].copy_(batch.block_table, non_blocking=True)
        if reqs > n:  # padding requests: no rows, no context, no pages
            qsl[n + 1 : reqs + 1].fill_(real_tokens)
            b["seq_lens"][n:reqs].zero_()
            b["block_table"][n:reqs].zero_()
        if layer_inputs is None:
            return
        for i, inp in enumerate(layer_inputs):
            for name in ("q", "q_scale", "weights"):
                dst, src = b[f"{name}.{i}"], getattr(inp, name)
                if src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride():
                    dst[:real_tokens].copy_(src[:real_tokens], non_blocking=True)
                if tokens > real_tokens:
                    dst[real_tokens:tokens].zero_()

    def _build(self, batch: StepBatch, shape: StepShape | None) -> IndexerMetadata:
        """Build metadata for the (padded) step over the persistent inputs."""
        n = batch.num_reqs
        reqs = shape.num_reqs if shape is not None else n
        tokens = shape.num_tokens if shape is not None else batch.num_tokens
        real_tokens = int(batch.query_start_loc_cpu[-1])
        qsl_cpu = torch.full((reqs + 1,), real_tokens, dtype=torch.int32)
        qsl_cpu[: n + 1] = batch.query_start_loc_cpu
        upper = torch.zeros(reqs, dtype=torch.int32)
        upper[:n] = batch.seq_lens_upper_bound
        b = self.buffers
        padded = StepBatch(
            qsl_cpu,
            upper,
            b["query_start_loc"][: reqs + 1],
            b["seq_lens"][:reqs],
            b["block_table"][:reqs],
            config=self.config,
            num_tokens=tokens,
            validate=False,
        )
        return self.builder.build(padded)

    def _run_layers(self, metadata: IndexerMetadata) -> None:
        """Every indexer layer of the stack, in order, on the persistent inputs."""
        b, cfg, tokens = self.buffers, self.config, metadata.num_tokens
        first_consumer = True
        for i, kind in enumerate(self.stack.kinds):
            args = (
                metadata,
                b[f"q.{i}"][:tokens],
                b[f"q_scale.{i}"][:tokens],
                b[f"weights.{i}"][:tokens],
                self.kv_caches[i],
                b["topk"][i, :tokens],
                self.workspace,
            )
            if kind == CONSUMER:
                candidate_consumer(
                    *args, config=cfg, resolve_pool=first_consumer, backend=self.ops_backend
                )
                first_consumer = False
            else:
                dense_indexer(
                    *args,
                    config=cfg,
                    candidate_source=kind == SOURCE,
                    backend=self.ops_backend,
                )
