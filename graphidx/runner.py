"""IndexerGraphRunner: one step of every indexer layer, replayed from a captured graph.

The runner owns everything a FULL graph reads, in one `capture.StaticBuffers` (so the replay
guard checks every address): the persistent step inputs (sequence lengths, block table, the
live-request count, and per layer q / q_scale / weights), the metadata builder's buffers,
the layers' workspace, the per-layer top-k output; and a `capture.GraphCache`.

A uniform decode step (every real request has `next_n` rows) pads up to the next captured
size. Its graph derives its own metadata: it starts with one device op that computes the row
ends, block ends, compressed contexts and decode schedule from the persistent sequence
lengths and live count (requests past the live count are padding: zero context, whatever
their stale bytes hold), then runs the layers, whose kernels read the request block table
directly. So the host's replayed step is O(1) checks, the copies of inputs the caller did
not write in place, one scalar write and one replay. Every other step (prefill, mixed,
ragged, above the largest size) plans on the host with the builder and runs the same layer
code eagerly, on the caller's tensors, its block table first copied into the persistent one
(one layout for every eager step: one compiled kernel variant); except that under adaptive
verification a uniform step above the largest size runs the captured step's code eagerly at
its own size, since its host offsets may be a placeholder that only the device offsets
correct.

Start-up: `graphidx.warmup.warmup(runner)` compiles every kernel variant of the eager steps,
`capture()` those of the captured ones.

Context parallel (docs/contract.md section 10): a runner per rank, given its
`ContextParallelGroup`, its rank-local caches and the rank's batches, replays the same
graphs as every other rank (the host decisions are the global ones); each layer's top-k is
the exchange across the ranks, recorded in the graph.

What the caller owns: the KV caches (one per layer, allocated once; the runner records their
addresses and graphs read them in place) and the step's `StepBatch` and `LayerInput`s, which
are copied when needed, so they may be freed or reused after `step` returns.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from capture import CaptureSizes, GraphCache, StaticBuffers, StepShape, get_backend
from graphidx.batch import StepBatch
from graphidx.builder import (
    CandidateIndexerMetadataBuilder,
    CapturedDecode,
    IndexerMetadataBuilder,
    canonical_device,
)
from graphidx.config import IndexerConfig
from graphidx.distributed import ContextParallelGroup, exchange_group
from graphidx.indexer import candidate_consumer, dense_indexer
from graphidx.metadata import IndexerMetadata
from graphidx.mxfp4.layout import cache_layout
from graphidx.ops.backend import resolve_backend
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
        dcp: ContextParallelGroup | None = None,
    ) -> None:
        """`kv_caches`: one paged uint8 cache per layer (docs/contract.md section 4), never
        reallocated. `graph_backend`: "device" (CUDA/HIP graphs) or "tape" (any device).
        `ops_backend`: the kernels' backend (None: the device's default). `compile_layers`:
        run the uniform-decode layer step (captured, replayed, and its eager runs) through
        `torch.compile(fullgraph=True)`; other steps change structure every step and run the
        plain layers. `compile_backend`: torch.compile's backend, by default "inductor" for
        device graphs and "eager" for the tape — the tape records dispatched ops, and
        inductor's fused kernels are not dispatched ops, so only "eager" is sound there.
        `dcp`: this rank's `ContextParallelGroup` (docs/contract.md section 10), required when
        `config.dcp_world_size` > 1 (then `kv_caches` are the rank's caches and every step's
        batch the rank's: global lengths, its block table; every rank must run the same
        steps, since each layer launch is one collective); ignored on one rank.
        Raises ValueError naming the option for anything that would fail later."""
        if not isinstance(config, IndexerConfig):
            raise ValueError(f"config must be an IndexerConfig, got {type(config).__name__}")
        if not isinstance(stack, IndexerStack):
            raise ValueError(f"stack must be an IndexerStack, got {type(stack).__name__}")
        self.config = config
        self.stack = stack
        self.dcp = _check_dcp(config, dcp, compile_layers)
        self.device = canonical_device(device)
        self._check_caches(kv_caches)
        self.kv_caches = tuple(kv_caches)
        self.num_pages = min(int(c.shape[0]) for c in kv_caches)
        resolve_backend(ops_backend, self.device)  # an unknown or unusable backend fails here
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
        # Under adaptive verification a captured step's rows follow the device offsets.
        self._rows_from_device = config.adaptive_verification and config.next_n > 1
        self.graphs = GraphCache(get_backend(graph_backend), buffers=StaticBuffers(self.device))
        self.buffers = self._allocate_inputs()
        builder_type = (
            CandidateIndexerMetadataBuilder if stack.candidate_source else IndexerMetadataBuilder
        )
        self.builder: IndexerMetadataBuilder = builder_type(
            config,
            self.device,
            num_pages=self.num_pages,
            full_graph_decode=True,  # eager decode planned as a captured one: same ties
            buffers=self.buffers,
        )
        self.workspace = IndexerWorkspace(config, self.device, buffers=self.buffers)
        self.counters = RunnerCounters()
        self._uniform: dict[StepShape, CapturedDecode] = {}
        self._padded: dict[int, StepShape | None] = {}
        self._offset_ramp: np.ndarray | None = None  # 0, next_n, 2 next_n, ... (`_uniform_offsets`)
        self._views: dict[int, tuple[LayerInput, ...]] = {}
        self._bytes: dict[int, tuple[torch.Tensor, ...]] = {}  # `_input_bytes`
        h, d = config.num_heads, config.head_dim
        self._input_specs = (  # (field, dtype, shape after the token dimension)
            ("q", torch.uint8, (h, d // 2)),
            ("q_scale", torch.uint8, (h, d // 32)),
            ("weights", torch.float32, (h,)),
        )
        self._topk_views: dict[int, torch.Tensor] = {}
        # The live-request count last written to the device (None: unknown): a step with the
        # same count skips the write.
        self._live_written: int | None = None
        self._warned_above_largest = False
        self._decode_layers = self._compiled_layers(compile_layers, compile_backend, graph_backend)

    def _check_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if len(kv_caches) != self.stack.num_layers:
            raise ValueError(
                f"kv_caches has {len(kv_caches)} caches for {self.stack.num_layers} indexer layers"
            )
        cfg = self.config
        layout = cache_layout(cfg.num_heads, cfg.head_dim, cfg.page_entries)
        for i, cache in enumerate(kv_caches):
            if (
                not isinstance(cache, torch.Tensor)
                or cache.device != self.device
                or cache.dtype != torch.uint8
                or cache.dim() != 2
            ):
                got = (
                    f"{tuple(cache.shape)} {cache.dtype} on {cache.device}"
                    if isinstance(cache, torch.Tensor)
                    else type(cache).__name__
                )
                raise ValueError(
                    f"kv_caches[{i}] must be a 2-D uint8 tensor on {self.device}, got {got}"
                )
            if cache.shape[0] < 1 or cache.shape[1] < layout.page_bytes:
                raise ValueError(
                    f"kv_caches[{i}] has shape {tuple(cache.shape)}: a page needs "
                    f"{layout.page_bytes} bytes ({cfg.page_entries} entries of "
                    f"{layout.entry_bytes}) and the cache at least one page"
                )
            if cache.stride(1) != 1 or cache.stride(0) < cache.shape[1]:
                raise ValueError(
                    f"kv_caches[{i}] must have contiguous, non-overlapping pages, got strides "
                    f"{cache.stride()} for shape {tuple(cache.shape)}"
                )

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
        cfg = self.config
        buffers = self.graphs.buffers
        assert buffers is not None
        tokens, reqs = cfg.max_num_batched_tokens, cfg.max_num_seqs
        buffers.add("seq_lens", (reqs,), torch.int32)
        buffers.add("block_table", (reqs, cfg.max_blocks_per_seq), torch.int32)
        buffers.add("num_live_reqs", (1,), torch.int32)
        if self._rows_from_device:
            buffers.add("query_start_loc", (reqs + 1,), torch.int32)
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
        views = self._views.get(num_tokens)
        if views is None:
            b = self.buffers
            views = tuple(
                LayerInput(
                    b[f"q.{i}"][:num_tokens],
                    b[f"q_scale.{i}"][:num_tokens],
                    b[f"weights.{i}"][:num_tokens],
                )
                for i in range(self.stack.num_layers)
            )
            self._views[num_tokens] = views
        return views

    def _own_views(self, layer_inputs: Sequence[LayerInput], num_tokens: int) -> bool:
        """Whether `layer_inputs` is a tuple `input_views` returned, of >= num_tokens rows:
        then it needs neither checks nor copies."""
        first = layer_inputs[0] if layer_inputs else None
        rows = first.q.shape[0] if isinstance(first, LayerInput) else -1
        return self._views.get(rows) is layer_inputs and rows >= num_tokens

    def total_bytes(self) -> int:
        """Persistent bytes: step inputs, top-k, workspace and builder buffers."""
        return self.buffers.total_bytes()

    # ------------------------------------------------------------------ capture
    def _run_warmup_step(
        self, batch: StepBatch, inputs: Sequence[LayerInput], out: torch.Tensor
    ) -> None:
        """A warm-up step: `batch` planned by the builder and every layer run eagerly on
        `inputs`, into `out` (shaped like `topk_buffer`); never counted."""
        self._run_layers(self.builder.build(batch), inputs, out)

    def _run_uniform_eagerly(self, shape: StepShape) -> None:
        """The captured step of `shape`, run eagerly on capture's dummy batch, with the
        plain layers (what a pool worker compiles for the capture)."""
        self._load_dummy_decode(shape)
        self._uniform_step(shape, compiled=False)()

    def capture(
        self,
        sizes: CaptureSizes | None = None,
        *,
        on_progress: Callable[[int, int, StepShape], None] | None = None,
    ) -> None:
        """Capture the uniform-decode step of every size (largest first, one memory pool).

        Each graph derives the step's metadata on the device and runs every indexer layer of
        the stack; later steps of the same padded shape replay it with their own data.
        Capturing compiles the decode kernels; `graphidx.warmup.warmup(self)` before it
        compiles the eager steps' (and, with a pool, these too).
        """
        sizes = sizes or self.capture_sizes
        shapes = sorted((s for s in sizes.shapes() if s not in self.graphs), reverse=True)
        for i, shape in enumerate(shapes, start=1):
            self.graphs.capture(shape, self._capture_fn(shape))
            if on_progress is not None:
                on_progress(i, len(shapes), shape)

    def _capture_fn(self, shape: StepShape) -> Callable[[], None]:
        """Load a dummy uniform batch of `shape` and return the callable the backend
        captures."""
        self._load_dummy_decode(shape)
        return self._uniform_step(shape)

    def _load_dummy_decode(self, shape: StepShape) -> None:
        """A dummy uniform batch of `shape` in the persistent step inputs: every request
        `next_n` tokens on page 0 (any cache of one page can capture)."""
        reqs = shape.num_reqs
        b = self.buffers
        b["seq_lens"][:reqs].fill_(self.config.next_n)
        b["block_table"][:reqs].zero_()
        self._write_live_count(reqs)
        if self._rows_from_device:
            next_n = self.config.next_n
            b["query_start_loc"][: reqs + 1].copy_(
                torch.arange(0, (reqs + 1) * next_n, next_n, dtype=torch.int32)
            )

    def _uniform_step(self, shape: StepShape, *, compiled: bool = True) -> Callable[[], None]:
        """The uniform decode step of `shape`: derive its metadata, then every layer
        (`compiled=False`: the plain layers, whatever `compile_layers` says)."""
        captured = self._uniform_decode(shape)
        layers = self._decode_layers if compiled else self._run_layers

        def step() -> None:
            captured.derive()
            layers(captured.metadata)

        return step

    def _uniform_decode(self, shape: StepShape) -> CapturedDecode:
        """The shape's metadata over the persistent inputs, made once per shape."""
        captured = self._uniform.get(shape)
        if captured is None:
            b, reqs = self.buffers, shape.num_reqs
            captured = self.builder.uniform_decode(
                reqs,
                b["seq_lens"][:reqs],
                b["block_table"][:reqs],
                b["num_live_reqs"],
                query_start_loc=b["query_start_loc"][: reqs + 1]
                if self._rows_from_device
                else None,
                backend=self.ops_backend,
            )
            self._uniform[shape] = captured
        return captured

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

        A uniform decode step (every real request has `next_n` query rows by the host
        offsets; runtime padding requests after them, `batch.num_real_reqs`, are ignored) is
        padded to the next captured size and replayed when that size was captured. Under
        adaptive verification the host offsets may be that uniform placeholder while the
        device `batch.query_start_loc` holds the real rows (packed from row 0, at most
        `next_n * num_real_reqs` of them): the graph derives the rows' owners and ends from
        the device offsets, and rows past the real ones get no picks; such a step above the
        largest capture size runs the same derivation eagerly, unpadded. Anything else runs eagerly
        (counted with its reason). `force_eager` runs the same padded step eagerly;
        `pad=False` plans the real requests on the host and runs them eagerly, unpadded
        (both used by the replay-correctness harness). `synchronize=True` waits for the
        device before returning, so that `seconds` is the step's wall time; by default the
        step returns as soon as its work is queued.
        """
        start = time.perf_counter()
        if not isinstance(batch, StepBatch):
            raise ValueError(f"batch must be a StepBatch, got {type(batch).__name__}")
        if len(layer_inputs) != self.stack.num_layers:
            raise ValueError(
                f"layer_inputs has {len(layer_inputs)} entries for "
                f"{self.stack.num_layers} indexer layers"
            )
        self._check_batch(batch)
        offsets = batch.query_start_loc_cpu.numpy()  # host reads without torch dispatch
        num_real = int(offsets[batch.num_real_reqs])
        in_place = self._own_views(layer_inputs, num_real)
        shape, reason = (
            self._shape_of(offsets, batch.num_real_reqs) if pad else (None, "unpadded (pad=False)")
        )
        # Every step checks its inputs; only a padded decode step copies them (and caches
        # the views of its size: a bounded set, where eager prefill sizes are not).
        sources = (
            None
            if in_place
            else self._checked_sources(layer_inputs, num_real, pair=shape is not None)
        )
        replay = False
        if shape is not None:
            self._load_decode(batch, sources)
            replay = shape in self.graphs and not force_eager
            if replay:
                self.graphs.replay(shape)
            else:
                if reason is None:
                    reason = "forced eager" if force_eager else f"shape {shape.label} not captured"
                if not force_eager:
                    self.graphs.record_eager(shape, reason)
                # A size above the ladder is never captured: the plain layers, so that
                # compile_layers does not compile again for every such size.
                self._uniform_step(shape, compiled=shape.num_tokens <= self.capture_sizes.largest)()
        else:
            if pad:
                self.graphs.record_eager(None, reason or "?")
            metadata = self.builder.build(self._on_persistent_table(batch.without_padding()))
            self._run_layers(metadata, layer_inputs)
        if synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        padded = (shape.num_tokens if shape is not None else batch.num_tokens) - num_real
        self._count(replay, padded, None if replay else reason)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "step %d: %s, %d real rows, %d padding rows%s",
                self.counters.steps,
                "replay" if replay else "eager",
                num_real,
                padded,
                "" if replay else f" ({reason})",
            )
        topk = self._topk_views.get(num_real)
        if topk is None:
            topk = self._topk_views[num_real] = self.buffers["topk"][:, :num_real]
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

    def _shape_of(self, offsets: np.ndarray, live: int) -> tuple[StepShape | None, str | None]:
        """The padded graph key of a uniform decode step (host `offsets`, `live` real
        requests), or None and why not. Under adaptive verification a step above the
        largest capture size gets its own unpadded shape (never captured: it runs eagerly)
        and the reason."""
        next_n = self.config.next_n
        tokens = int(offsets[live])
        if live == 0 or tokens != live * next_n:
            return None, "not a uniform decode step"
        if live > 1 and not self._uniform_offsets(offsets, live):
            return None, "not a uniform decode step"
        if tokens not in self._padded:
            self._padded[tokens] = self.capture_sizes.pad(tokens)
        shape = self._padded[tokens]
        if shape is None:
            if not self._warned_above_largest:
                logger.warning(
                    "%d tokens exceed the largest capture size (%d): such steps run eagerly",
                    tokens,
                    self.capture_sizes.largest,
                )
                self._warned_above_largest = True
            if self._rows_from_device:
                # The host offsets may be the uniform placeholder, which the host planner
                # would take for the real rows: only the device offsets fix them, so the
                # step runs the captured step's derivation eagerly, at its own size.
                return StepShape(tokens, live, next_n), "above the largest capture size"
            return None, "above the largest capture size"
        return shape, None

    def _uniform_offsets(self, offsets: np.ndarray, live: int) -> bool:
        """Whether offsets[:live + 1] is 0, next_n, 2 next_n, ...: a byte comparison with a
        cached ramp of the offsets' dtype (a tenth of the time of a diff on the host)."""
        ramp = self._offset_ramp
        if ramp is None or ramp.dtype != offsets.dtype or ramp.shape[0] <= live:
            size = max(live + 1, self.config.max_num_seqs + 1)
            ramp = np.arange(size, dtype=offsets.dtype) * self.config.next_n
            self._offset_ramp = ramp
        return offsets[: live + 1].tobytes() == ramp[: live + 1].tobytes()

    def _check_batch(self, batch: StepBatch) -> None:
        """O(1) checks: the caller's batch must have been validated against this runner's
        config and cache (the captured step reads the persistent copies, whose own checks
        cannot see the caller's config, page count or table width)."""
        self.builder.check_batch(batch)
        if batch.num_pages is None or batch.num_pages > self.num_pages:
            raise ValueError(
                f"batch.num_pages = {batch.num_pages}: a runner step needs a batch validated "
                f"against its caches (num_pages = {self.num_pages})"
            )

    def _input_bytes(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """The first `num_tokens` rows of every persistent layer input as uint8, in the order
        of the layers and, per layer, of `_input_specs` (cached per size)."""
        got = self._bytes.get(num_tokens)
        if got is None:
            views = self.input_views(num_tokens)
            got = tuple(
                _as_bytes(getattr(v, name)) for v in views for name, _, _ in self._input_specs
            )
            self._bytes[num_tokens] = got
        return got

    def _checked_sources(
        self, layer_inputs: Sequence[LayerInput], num_tokens: int, *, pair: bool = True
    ) -> CopyPairs | None:
        """Check every layer input against `_input_specs` (ValueError naming the first bad
        one) and, when `pair`, pair the first `num_tokens` rows of each field with its
        persistent copy: `(dst, src)` as bytes where src is contiguous, the plain views
        otherwise (a field already in place is left out); None when not `pair`. One pass, so
        a copied step touches each tensor once."""
        dsts = self._input_bytes(num_tokens) if pair else ()
        views = self.input_views(num_tokens) if pair else ()
        pairs = CopyPairs([], [])
        j = 0
        for i, inp in enumerate(layer_inputs):
            if not isinstance(inp, LayerInput):
                raise ValueError(
                    f"layer_inputs[{i}] must be a LayerInput, got {type(inp).__name__}"
                )
            for name, dtype, tail in self._input_specs:
                t = getattr(inp, name)
                shape = t.shape
                if t.dtype != dtype or shape[1:] != tail or shape[0] < num_tokens:
                    raise ValueError(
                        f"layer_inputs[{i}].{name} must be {dtype} [>= {num_tokens}, "
                        f"{', '.join(map(str, tail))}], got {t.dtype} {tuple(shape)}"
                    )
                if t.device != self.device:
                    raise ValueError(
                        f"layer_inputs[{i}].{name} is on {t.device}, the runner on {self.device}"
                    )
                if not pair:
                    continue
                dst = dsts[j]
                j += 1
                if shape[0] != num_tokens:
                    t = t[:num_tokens]
                if t.is_contiguous() and t.stride(-1) == 1:
                    if t.data_ptr() != dst.data_ptr():
                        pairs.as_bytes.append((dst, _as_bytes(t)))
                else:
                    pairs.strided.append((getattr(views[i], name), t))
        return pairs if pair else None

    # ------------------------------------------------------------------ internals
    def _load_decode(self, batch: StepBatch, sources: CopyPairs | None) -> None:
        """Copy a uniform decode step's raw inputs into the persistent buffers — seq_lens,
        the block table, the device offsets where the graph reads them, and the layer inputs'
        `(dst, src)` pairs from `_checked_sources` (None: all in place) — in one foreach
        where the layouts allow, and write the live-request count. Padding requests and rows
        are left as they are: the graph gives them zero context."""
        b = self.buffers
        live = batch.num_real_reqs
        pairs = [(b["seq_lens"], batch.seq_lens, live), (b["block_table"], batch.block_table, live)]
        if self._rows_from_device:
            pairs.append((b["query_start_loc"], batch.query_start_loc, live + 1))
        _copy_rows(pairs, sources)
        self._write_live_count(live)

    def _on_persistent_table(self, batch: StepBatch) -> StepBatch:
        """`batch` with its block table copied into the persistent one (rows [0, num_reqs),
        the batch's columns; later columns keep stale page ids, which no kernel reads: a
        request reads only the pages of its context). So every eager step's kernels see one
        table layout, `[max_num_seqs, max_blocks_per_seq]` rows, and compile one variant
        whatever the width, stride or alignment of the caller's table."""
        table = self.buffers["block_table"]
        reqs = batch.num_reqs
        _copy_rows([(table, batch.block_table, reqs)])
        return StepBatch(
            batch.query_start_loc_cpu,
            batch.seq_lens_upper_bound,
            batch.query_start_loc,
            batch.seq_lens,
            table[:reqs],
            config=batch.config,
            num_tokens=batch.num_tokens,
            num_pages=batch.num_pages,
            num_real_reqs=batch.num_real_reqs,
            validate=False,
        )

    def _write_live_count(self, live: int) -> None:
        """Write the live-request count the graphs read, unless the device holds it already
        (only the runner writes that buffer)."""
        if live != self._live_written:
            self.buffers["num_live_reqs"].fill_(live)
            self._live_written = live

    def _run_layers(
        self,
        metadata: IndexerMetadata,
        layer_inputs: Sequence[LayerInput] | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        """Every indexer layer of the stack, in order: on the persistent inputs, or on
        `layer_inputs` (an eager step's own tensors); into the persistent top-k output, or
        `out` (shaped like it)."""
        b, cfg, tokens = self.buffers, self.config, metadata.num_tokens
        topk = b["topk"] if out is None else out
        first_consumer = True
        for i, kind in enumerate(self.stack.kinds):
            if layer_inputs is None:
                q, q_scale, weights = b[f"q.{i}"], b[f"q_scale.{i}"], b[f"weights.{i}"]
            else:
                inp = layer_inputs[i]
                q, q_scale, weights = inp.q, inp.q_scale, inp.weights
            args = (
                metadata,
                q[:tokens],
                q_scale[:tokens],
                weights[:tokens],
                self.kv_caches[i],
                topk[i, :tokens],
                self.workspace,
            )
            if kind == CONSUMER:
                candidate_consumer(
                    *args,
                    config=cfg,
                    resolve_pool=first_consumer,
                    backend=self.ops_backend,
                    dcp=self.dcp,
                )
                first_consumer = False
            else:
                dense_indexer(
                    *args,
                    config=cfg,
                    candidate_source=kind == SOURCE,
                    backend=self.ops_backend,
                    dcp=self.dcp,
                )


def _check_dcp(
    config: IndexerConfig, dcp: ContextParallelGroup | None, compile_layers: bool
) -> ContextParallelGroup | None:
    """The group the layers exchange through: None on one rank (the single-rank path), else
    `dcp`, which must be a `ContextParallelGroup` matching the config's sharding
    (`exchange_group`), with the layers not compiled."""
    group = exchange_group(config, dcp)
    if group is not None and compile_layers:
        raise ValueError(
            f"compile_layers=True with config.dcp_world_size = {config.dcp_world_size}: the "
            "context-parallel exchange is not traced by torch.compile"
        )
    return group


class CopyPairs(NamedTuple):
    """A step's layer-input copies (`dst`, `src`): `as_bytes`, contiguous uint8 views of both
    sides (one foreach takes them all); `strided`, plain views, one `copy_` each."""

    as_bytes: list[tuple[torch.Tensor, torch.Tensor]]
    strided: list[tuple[torch.Tensor, torch.Tensor]]


def _copy_rows(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor, int]],
    sources: CopyPairs | None = None,
) -> None:
    """`dst[:rows, :width] = src[:rows]` for every `(dst, src, rows)`, except where src already
    is that view of dst, and `dst.copy_(src)` for every pair of `sources`. Every pair whose
    two sides share a dtype and are contiguous with unit last stride goes, as bytes, into one
    `torch._foreach_copy_` (a single launch on a GPU); any other pair is one `copy_`."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for dst, src, rows in pairs:
        if src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride():
            continue
        if dst.shape[0] == rows and dst.shape[1:] == src.shape[1:]:
            view = dst
        elif src.dim() == 2 and dst.dim() == 2:
            view = dst[:rows, : src.shape[1]]
        else:
            view = dst[:rows]
        part = src if src.shape[0] == rows else src[:rows]
        whole = view.is_contiguous() and part.is_contiguous()
        if src.dtype != dst.dtype or not whole or view.stride(-1) != 1 or part.stride(-1) != 1:
            view.copy_(part, non_blocking=True)
        else:
            dsts.append(_as_bytes(view))
            srcs.append(_as_bytes(part))
    if sources is not None:
        for dst, src in sources.as_bytes:
            dsts.append(dst)
            srcs.append(src)
        for dst, src in sources.strided:
            dst.copy_(src, non_blocking=True)
    if dsts:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` (unit last stride) viewed as uint8."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)
