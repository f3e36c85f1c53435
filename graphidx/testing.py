"""The replay-correctness harness: random serving steps, and proof that replay == eager.

`StepGenerator` draws random steps of the kinds a serving runtime produces (uniform and
ragged speculative decode, steps already carrying padding, adaptive verification, mixed
prefill + decode, pure prefill; short and long contexts) over KV caches filled with random
MXFP4 keys. `check_replay(runner, cases)` runs each step three ways — eager and unpadded (the
reference: the real requests alone), eager on the padded shape, and through the runner's
normal path (replaying a captured graph whenever the padded shape was captured) — and reports
every real row whose top-k set differs. Padding rows must stay -1 and must change nothing a
real row reads, which the unpadded reference checks.

Steps already padded by the caller come in four forms (`PADDED_KINDS`): "padded", trailing
zero-row requests and rows past the last request, all counted real (`num_real_reqs` unset);
and the runtimes' padding requests of docs/contract.md section 3.2a, declared by
`num_real_reqs` — "pad-vllm-zero" (0 rows, seq_len 0, block row 0 or a stale row),
"pad-vllm-arange" (next_n rows, seq_len 0, so seq_len < query_len) and "pad-sglang-fill1" (1
row, seq_len 1, page 0).
A request for kind "padded" draws one of the four, and the case's kind names which.
"""

from __future__ import annotations

import datetime
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

from capture import CaptureSizes
from graphidx.batch import StepBatch
from graphidx.config import IndexerConfig, cdiv
from graphidx.distributed import ContextParallel, global_positions, local_topk
from graphidx.mxfp4 import cache_layout, quantize_mxfp4, write_k_cache
from graphidx.mxfp4.layout import entry_offsets
from graphidx.runner import IndexerGraphRunner, IndexerStack, LayerInput

RUNTIME_PADDING = {
    "pad-vllm-zero": "zero",
    "pad-vllm-arange": "arange",
    "pad-sglang-fill1": "fill1",
}
"""Case kinds of the runtimes' padding conventions -> `graphidx.batch.PADDING_FORMS` name."""
PADDED_KINDS = ("padded", *RUNTIME_PADDING)
KINDS = ("decode", "ragged", "padded", "mixed", "prefill", *RUNTIME_PADDING, "adaptive")


@dataclass(frozen=True)
class StepCase:
    """One random step: its kind, the batch, and one LayerInput per indexer layer."""

    kind: str
    batch: StepBatch
    inputs: tuple[LayerInput, ...]
    device_rows: StepBatch | None = None

    @property
    def num_real_tokens(self) -> int:
        """Rows of the real requests (runtime padding requests' rows excluded)."""
        return self.reference.num_real_tokens

    @property
    def reference(self) -> StepBatch:
        """The real requests alone, unpadded: what the replayed step must agree with. For
        an "adaptive" case, the step as its device offsets lay it out (`device_rows`)."""
        if self.device_rows is not None:
            return self.device_rows
        return self.batch.without_padding()


def random_kv_cache(
    config: IndexerConfig, num_pages: int, device: torch.device | str, gen: torch.Generator
) -> torch.Tensor:
    """A paged MXFP4 cache (docs/contract.md section 4) whose every entry holds a random key."""
    layout = cache_layout(config.num_heads, config.head_dim, config.page_entries)
    cache = torch.zeros(num_pages, layout.page_bytes, dtype=torch.uint8, device=device)
    # Keys are drawn on the cache's device, in slices, from a generator seeded by `gen`.
    device_gen = _device_generator(device, gen)
    total = num_pages * config.page_entries
    step = 1 << 20
    for start in range(0, total, step):
        slots = torch.arange(start, min(start + step, total), device=device)
        keys = torch.randn(slots.numel(), config.head_dim, generator=device_gen, device=device)
        write_k_cache(keys, slots, cache, layout)
    return cache


def random_layer_input(
    config: IndexerConfig, tokens: int, device: torch.device | str, gen: torch.Generator
) -> LayerInput:
    """MXFP4 queries (quantized per head) and positive-leaning head weights, drawn on
    `device` from a generator seeded by `gen`."""
    device_gen = _device_generator(device, gen)
    shape = (tokens, config.num_heads, config.head_dim)
    q = torch.randn(shape, generator=device_gen, device=device)
    values, scales = quantize_mxfp4(q)
    weights = torch.rand(tokens, config.num_heads, generator=device_gen, device=device) + 0.05
    return LayerInput(values, scales, weights)


def _device_generator(device: torch.device | str, gen: torch.Generator) -> torch.Generator:
    """A generator on `device` seeded from the host generator `gen` (reproducible)."""
    device_gen = torch.Generator(device=device)
    device_gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    return device_gen


class StepGenerator:
    """Random steps for one config and stack, reading pages `[0, num_pages)`."""

    def __init__(
        self,
        config: IndexerConfig,
        stack: IndexerStack,
        *,
        num_pages: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        max_context: int | None = None,
    ) -> None:
        self.config = config
        self.stack = stack
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.max_context = min(max_context or config.max_model_len, config.max_model_len)

    def kv_caches(self) -> list[torch.Tensor]:
        """One random cache per layer of the stack."""
        return [
            random_kv_cache(self.config, self.num_pages, self.device, self.gen)
            for _ in range(self.stack.num_layers)
        ]

    # -- lengths
    def _context(self, query_len: int) -> int:
        """A sequence length >= query_len: short or long, uniformly on a log scale."""
        low = max(query_len, 1)
        high = max(low, self.max_context)
        value = int(np.exp(self.rng.uniform(np.log(low), np.log(high + 1))))
        return int(min(max(value, low), high))

    def _max_reqs(self, rows_each: int) -> int:
        cfg = self.config
        return max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // max(rows_each, 1)))

    def _decode_query_lens(self, kind: str) -> list[int]:
        next_n = self.config.next_n
        n = int(self.rng.integers(1, self._max_reqs(next_n) + 1))
        if kind == "ragged":
            return [int(x) for x in self.rng.integers(0, next_n + 1, size=n)]
        return [next_n] * n

    def _prefill_query_lens(self, budget: int, max_reqs: int) -> list[int]:
        lens: list[int] = []
        while budget > self.config.next_n and len(lens) < max_reqs:
            q = int(self.rng.integers(self.config.next_n + 1, min(budget, 256) + 1))
            lens.append(q)
            budget -= q
            if self.rng.random() < 0.4:
                break
        return lens

    # -- steps
    def case(self, kind: str) -> StepCase:
        """A random step of `kind` (one of KINDS; "padded" draws one of PADDED_KINDS)."""
        cfg = self.config
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if kind == "padded":
            kind = PADDED_KINDS[int(self.rng.integers(0, len(PADDED_KINDS)))]
        if kind in RUNTIME_PADDING:
            return self._runtime_padded_case(kind)
        if kind == "adaptive":
            return self._adaptive_case()
        if kind in ("decode", "ragged", "padded"):
            query_lens = self._decode_query_lens(kind)
        elif kind == "mixed":
            query_lens = self._decode_query_lens("ragged")[: cfg.max_num_seqs // 2]
            room = cfg.max_num_batched_tokens - sum(query_lens)
            query_lens += self._prefill_query_lens(room, cfg.max_num_seqs - len(query_lens))
        else:
            query_lens = self._prefill_query_lens(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        query_lens = query_lens or [cfg.next_n]
        seq_lens = [self._context(q) for q in query_lens]
        num_tokens = sum(query_lens)
        if kind == "padded":
            # A step the runtime already padded: trailing empty requests and rows.
            extra_reqs = int(self.rng.integers(0, 3))
            if len(query_lens) + extra_reqs <= cfg.max_num_seqs:
                query_lens += [0] * extra_reqs
                seq_lens += [0] * extra_reqs
            # Decode rows (padding included) never exceed a full decode batch.
            limit = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.next_n)
            num_tokens = min(limit, num_tokens + int(self.rng.integers(1, 8)))
        batch = StepBatch.from_lists(
            cfg,
            query_lens,
            seq_lens,
            self._block_table(seq_lens),
            num_tokens=num_tokens,
            num_pages=self.num_pages,
            device=self.device,
        )
        return StepCase(kind, batch, self._inputs(num_tokens))

    def _inputs(self, num_tokens: int) -> tuple[LayerInput, ...]:
        return tuple(
            random_layer_input(self.config, num_tokens, self.device, self.gen)
            for _ in range(self.stack.num_layers)
        )

    def _runtime_padded_case(self, kind: str) -> StepCase:
        """Real decodes (uniform, or now and then ragged) followed by 1-4 padding requests of
        the runtime convention `kind`, declared by `num_real_reqs` (docs/contract.md section
        3.2a)."""
        cfg = self.config
        next_n = cfg.next_n
        form = RUNTIME_PADDING[kind]
        max_reqs = self._max_reqs(next_n)
        if max_reqs < 2:
            raise ValueError(f"kind {kind!r} needs room for 2 requests, the config has {max_reqs}")
        num_pad = int(self.rng.integers(1, min(4, max_reqs - 1) + 1))
        query_lens = self._decode_query_lens("ragged" if self.rng.random() < 0.25 else "decode")
        query_lens = query_lens[: max_reqs - num_pad] or [next_n]
        seq_lens = [self._context(q) for q in query_lens]
        num_real = len(query_lens)
        pad_query, pad_seq = {"zero": (0, 0), "arange": (next_n, 0), "fill1": (1, 1)}[form]
        table = self._block_table([*seq_lens, *([0] * num_pad)])
        if form != "fill1" and self.rng.random() < 0.5:
            # A stale block row: a zero-context request's row is never read.
            table[num_real:] = torch.from_numpy(
                self.rng.integers(0, self.num_pages, size=tuple(table[num_real:].shape))
            ).to(table)
        query_lens += [pad_query] * num_pad
        seq_lens += [pad_seq] * num_pad
        num_tokens = sum(query_lens)
        if form == "zero":
            # vLLM also pads the token count to the padded batch: next_n rows per request.
            limit = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * next_n)
            num_tokens = max(num_tokens, min(limit, len(query_lens) * next_n))
        batch = StepBatch.from_lists(
            cfg,
            query_lens,
            seq_lens,
            table,
            num_tokens=num_tokens,
            num_pages=self.num_pages,
            device=self.device,
            num_real_reqs=num_real,
        )
        return StepCase(kind, batch, self._inputs(num_tokens))

    def _adaptive_case(self) -> StepCase:
        """Adaptive verification: the drafts reallocated between requests. The host offsets
        are the uniform placeholder (next_n rows each, as vLLM passes them); the device
        offsets hold each request's real rows (1 to next_n + 1, at most next_n per request
        on average), packed from row 0. `device_rows` is the same step with real offsets on
        both sides, the reference. Needs a config with adaptive verification and next_n > 1
        (otherwise a uniform decode case)."""
        cfg = self.config
        next_n = cfg.next_n
        if not cfg.adaptive_verification or next_n == 1:
            return self.case("decode")
        n = int(self.rng.integers(1, self._max_reqs(next_n) + 1))
        budget = n * next_n
        real: list[int] = []
        for i in range(n):
            left = n - i - 1  # every later request keeps at least one row
            real.append(int(self.rng.integers(1, min(next_n + 1, budget - left) + 1)))
            budget -= real[-1]
        seq_lens = [self._context(next_n + 1) for _ in real]
        table = self._block_table(seq_lens)
        tokens = n * next_n
        device_rows = StepBatch.from_lists(
            cfg, real, seq_lens, table, num_pages=self.num_pages, device=self.device
        )
        placeholder = StepBatch.from_lists(
            cfg, [next_n] * n, seq_lens, table, num_pages=self.num_pages, device=self.device
        )
        batch = StepBatch(
            placeholder.query_start_loc_cpu,
            placeholder.seq_lens_upper_bound,
            device_rows.query_start_loc,
            device_rows.seq_lens,
            table,
            config=cfg,
            num_tokens=tokens,
            num_pages=self.num_pages,
            validate=False,
        )
        inputs = self._inputs(tokens)
        return StepCase("adaptive", batch, inputs, device_rows)

    def _block_table(self, seq_lens: list[int]) -> torch.Tensor:
        """Random pages for each request's used entries: distinct within a request (so no
        two keys of a row are equal and its top-k has no ties, which any kernel may break
        its own way), possibly shared between requests."""
        cfg = self.config
        used = [cdiv(s // cfg.compress_ratio, cfg.page_entries) for s in seq_lens]
        width = max(1, *used)
        if width > self.num_pages:
            raise ValueError(
                f"a request needs {width} pages but the cache has num_pages={self.num_pages}"
            )
        table = np.zeros((len(seq_lens), width), dtype=np.int32)
        for i, n in enumerate(used):
            table[i, :n] = self.rng.choice(self.num_pages, size=n, replace=False)
        return torch.from_numpy(table).to(self.device)

    def cases(self, n: int, kinds: Iterable[str] = KINDS) -> Iterator[StepCase]:
        """`n` random steps, kinds drawn uniformly from `kinds`."""
        kinds = tuple(kinds)
        for _ in range(n):
            yield self.case(kinds[int(self.rng.integers(0, len(kinds)))])


# --- context parallel: a rank's share of a step ------------------------------------------------


def context_parallel_config(
    next_n: int, ratio: int, candidate_block_size: int, interleave: int, world_size: int, rank: int
) -> IndexerConfig:
    """The small model the context-parallel suites shard: 4 heads of 64, compress ratio
    `ratio` (pages of 64 * ratio tokens, 2048 * ratio tokens at most), `next_n` rows per
    decode request, top-32, 48 KiB of logits (prefill chunks get cut), 8 requests of 128
    tokens; with `candidate_block_size` C > 0 two-level (a pool of 8 blocks, sparse logits),
    dense with 0. Rank `rank` of `world_size`, positions interleaved by `interleave` (unused
    on one rank, where the config's interleave is 0)."""
    c = candidate_block_size
    return IndexerConfig(
        num_heads=4,
        head_dim=64,
        compress_ratio=ratio,
        block_size=64 * ratio,
        max_model_len=2048 * ratio,
        num_speculative_tokens=next_n - 1,
        topk_tokens=32,
        candidate_block_size=c,
        candidate_topk_blocks=8 if c else 0,
        sparse_logits=bool(c),
        max_logits_bytes=48 * 1024,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        dcp_world_size=world_size,
        dcp_rank=rank,
        dcp_interleave=interleave if world_size > 1 else 0,
    )


def rank_cache_pages(config: IndexerConfig) -> int:
    """Pages a rank's cache needs for any step `shard_kv_cache` shards: page 0 (left empty)
    and, per request, the pages of the rank's share of a whole-length context."""
    ctx = ContextParallel.from_config(config)
    return 1 + config.max_num_seqs * cdiv(ctx.local_count(config.logits_width), config.page_entries)


def shard_kv_cache(
    config: IndexerConfig,
    ctx: ContextParallel,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: list[int],
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `ctx.rank`'s share of a single-rank paged cache, as an ordinary paged cache.

    `block_table` `[reqs, cols]` and `context_lens` (compressed entries per request; 0 for a
    request that reads nothing) describe the single-rank cache. Request i's owned positions
    p < context_lens[i] move to local index l (`global_positions(ctx, l) = p`) on fresh pages
    of the rank's cache (page 0 is left empty, for the runtimes' padding forms), entry bytes
    copied as they are. Returns `(rank_cache, rank_table)`: the table keeps the single-rank
    table's width (unused columns page 0), so the batch validation that counts single-rank
    pages accepts it. `out`: a cache to write into (its first pages; it must hold them), for
    a runner whose caches never move; None: a fresh cache of just the pages used.
    """
    layout = cache_layout(config.num_heads, config.head_dim, config.page_entries)
    values, scales = entry_offsets(layout)
    pe = config.page_entries
    local_lens = [ctx.local_count(n) for n in context_lens]
    table = torch.zeros_like(block_table)
    next_page = 1
    for i, n in enumerate(local_lens):
        pages = cdiv(n, pe)
        table[i, :pages] = torch.arange(next_page, next_page + pages, dtype=table.dtype)
        next_page += pages
    if out is None:
        out = torch.zeros(next_page, kv_cache.shape[1], dtype=torch.uint8, device=kv_cache.device)
    elif out.shape[0] < next_page or out.shape[1] != kv_cache.shape[1]:
        raise ValueError(
            f"out has shape {tuple(out.shape)}; this step needs [>= {next_page}, "
            f"{kv_cache.shape[1]}]"
        )
    out[0].zero_()
    for i, n in enumerate(local_lens):
        local = torch.arange(n, dtype=torch.int64, device=kv_cache.device)
        glob = global_positions(ctx, local)
        src_page = block_table[i].to(torch.int64)[glob // pe].unsqueeze(1)
        dst_page = table[i].to(torch.int64)[local // pe].unsqueeze(1)
        for offsets in (values, scales):
            offsets = offsets.to(kv_cache.device)
            out[dst_page, offsets[local % pe]] = kv_cache[src_page, offsets[glob % pe]]
    return out, table


def rank_batch(
    batch: StepBatch, config: IndexerConfig, table: torch.Tensor, num_pages: int
) -> StepBatch:
    """The step as one rank sees it: the same lengths and offsets, its block table."""
    return StepBatch(
        batch.query_start_loc_cpu,
        batch.seq_lens_upper_bound,
        batch.query_start_loc,
        batch.seq_lens,
        table,
        config=config,
        num_tokens=batch.num_tokens,
        num_pages=num_pages,
        num_real_reqs=batch.num_real_reqs,
    )


def request_contexts(batch: StepBatch) -> list[int]:
    """Compressed entries each request may read (0 for runtime padding requests)."""
    lens = (batch.seq_lens // batch.config.compress_ratio).tolist()
    return [n if i < batch.num_real_reqs else 0 for i, n in enumerate(lens)]


def shard_case(
    case: StepCase,
    config: IndexerConfig,
    kv_caches: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor],
) -> StepCase:
    """The rank's view of a single-rank `case` (`config` the rank's): every layer's cache
    sharded into `out` (the rank runner's caches, `shard_kv_cache`), the batch with the
    rank's block table and page count. "adaptive" cases are not sharded (ValueError)."""
    if case.device_rows is not None:
        raise ValueError(f"case kind {case.kind!r} (device rows) cannot be sharded")
    ctx = ContextParallel.from_config(config)
    contexts = request_contexts(case.batch)
    table = case.batch.block_table
    for cache, rank_cache in zip(kv_caches, out, strict=True):
        _, table = shard_kv_cache(
            config, ctx, cache, case.batch.block_table, contexts, out=rank_cache
        )
    num_pages = min(int(c.shape[0]) for c in out)
    return StepCase(case.kind, rank_batch(case.batch, config, table, num_pages), case.inputs)


def _ordered_topk(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """`topk_per_row` in the selection order (one rank's `local_topk`)."""
    del backend
    local_topk(ContextParallel(), logits, lengths, k, out)


@contextmanager
def selection_order() -> Iterator[None]:
    """Single-rank layers pick every top-k (tokens and candidate blocks) in the selection
    order of docs/contract.md section 10 (larger score first, ties to the smaller position),
    the order a context-parallel merge follows: ReLU scores tie often, and the single-rank
    kernels may break ties any way. For references only (the reference top-k's speed)."""
    with mock.patch("graphidx.indexer.topk_per_row", _ordered_topk):
        yield


def tape_runner(
    config: IndexerConfig,
    stack: IndexerStack,
    kv_caches: list[torch.Tensor],
    *,
    capture_sizes: CaptureSizes | None = None,
    capture: bool = True,
    **runner_options: Any,
) -> IndexerGraphRunner:
    """A CPU runner on the tape backend over `kv_caches`. Capture sizes: `capture_sizes`,
    else uniform decode up to 16 rows; the graphs are captured unless `capture` is False."""
    runner = IndexerGraphRunner(
        config,
        stack,
        kv_caches,
        "cpu",
        graph_backend="tape",
        capture_sizes=capture_sizes or CaptureSizes(max_size=16, uniform_query_len=config.next_n),
        **runner_options,
    )
    if capture:
        runner.capture()
    return runner


def random_tape_runner(
    config: IndexerConfig,
    stack: IndexerStack,
    *,
    seed: int,
    num_pages: int = 96,
    max_context: int = 1500,
    **options: Any,
) -> tuple[IndexerGraphRunner, StepGenerator]:
    """A `StepGenerator` and a `tape_runner` (given `options`) over its random caches."""
    gen = StepGenerator(config, stack, num_pages=num_pages, seed=seed, max_context=max_context)
    return tape_runner(config, stack, gen.kv_caches(), **options), gen


@dataclass(frozen=True)
class Mismatch:
    case: int
    kind: str
    layer: int
    row: int
    what: str


@dataclass
class ReplayReport:
    """What `check_replay` saw: cases by kind, replays, and every mismatching row."""

    cases: int = 0
    replayed: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.by_kind.items()))
        return (
            f"{self.cases} cases ({kinds}); {self.replayed} replayed; "
            f"{len(self.mismatches)} mismatches"
        )


def _sorted_rows(topk: torch.Tensor) -> torch.Tensor:
    return torch.sort(topk.to("cpu", torch.int64), dim=-1).values


def _compare(
    report: ReplayReport, index: int, kind: str, ref: torch.Tensor, got: torch.Tensor, what: str
) -> None:
    differs = (_sorted_rows(ref) != _sorted_rows(got)).any(dim=-1)
    for layer, row in differs.nonzero().tolist():
        report.mismatches.append(Mismatch(index, kind, layer, row, what))


def check_replay(
    runner: IndexerGraphRunner,
    cases: Iterable[StepCase],
    *,
    on_case: object = None,
    expected: Iterable[torch.Tensor] | None = None,
) -> ReplayReport:
    """Run every case eager-unpadded, eager-padded and normally; compare real rows' top-k.

    The reference is `case.reference` (the real requests alone) run eagerly without padding;
    the padded runs take `case.batch` as the caller gave it, runtime padding requests
    included, and only their real rows (`case.num_real_tokens`) are compared. A mismatch
    names the case, layer, row and which comparison failed. The runner's own padding rows
    (past the real rows, up to the padded shape) must hold only -1. `expected`: one top-k
    `[layers, real rows, topk_tokens]` per case (a context-parallel rank's W = 1 answers),
    which the reference must match too.
    """
    report = ReplayReport()
    poison = runner.topk_buffer
    answers = iter(expected) if expected is not None else None
    for index, case in enumerate(cases):
        n = case.num_real_tokens
        # Every run writes the same persistent top-k buffer: poison it first, so that a run
        # which writes nothing (a replay that does no work) cannot pass on the previous
        # run's answer.
        poison.fill_(-2)
        ref = runner.step(case.reference, case.inputs, pad=False).topk[:, :n].clone()
        if answers is not None:
            _compare(report, index, case.kind, next(answers), ref, "unpadded eager != W = 1")
        poison.fill_(-2)
        eager = runner.step(case.batch, case.inputs, force_eager=True)
        eager_topk = eager.topk[:, :n].clone()
        poison.fill_(-2)
        normal = runner.step(case.batch, case.inputs)
        report.cases += 1
        report.by_kind[case.kind] += 1
        report.replayed += int(normal.replayed)
        _compare(report, index, case.kind, ref, eager_topk, "padded eager != unpadded eager")
        _compare(report, index, case.kind, ref, normal.topk[:, :n], "replay != unpadded eager")
        if normal.shape is not None:
            pad_rows = runner.topk_buffer[:, n : normal.shape.num_tokens]
            if bool((pad_rows != -1).any()):
                report.mismatches.append(
                    Mismatch(index, case.kind, -1, n, "a padding row holds a pick")
                )
        if callable(on_case):
            on_case(index, report)
    return report


def gloo_available() -> bool:
    """Whether this torch build can run CPU process groups (torch.distributed with gloo)."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_gloo_available())


def _gloo_rank(
    rank: int, target: Callable[..., Any], world_size: int, folder: str, args: tuple[Any, ...]
) -> None:
    """A spawned process: join the gloo group of `folder`, run `target(rank, world_size,
    shared, *args)` on one thread, save what it returns for the parent."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    try:
        shared = torch.load(Path(folder) / "shared.pt", weights_only=False)
        result = target(rank, world_size, shared, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        dist.barrier()
        (Path(folder) / f"rank{rank}.done").touch()  # every rank's answer is saved
    finally:
        dist.destroy_process_group()


def run_gloo_ranks(
    target: Callable[..., Any],
    world_size: int,
    shared: Any,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float = 1800,
) -> list[Any]:
    """Run `target(rank, world_size, shared, *args)` in `world_size` spawned CPU processes,
    each rank of one gloo process group (the default group, initialised before `target`
    runs; one torch thread each). `target` must be a module-level function; `shared` and
    `args` reach the ranks, and their return values come back, through files (pickled).
    Returns the values in rank order. A rank that raises or dies ends the run
    (`torch.multiprocessing.ProcessRaisedException` / `ProcessExitedException`), except a
    rank that dies in gloo's teardown once every rank has saved its answer and passed the
    final barrier (gloo can abort in `destroy_process_group` or at exit; the answers stand,
    and a warning says so); past `timeout_s` the processes are killed and TimeoutError
    raised."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        torch.save(shared, Path(folder) / "shared.pt")
        context = mp.spawn(
            _gloo_rank, args=(target, world_size, folder, args), nprocs=world_size, join=False
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    for proc in context.processes:
                        proc.kill()
                    raise TimeoutError(f"{world_size} gloo ranks did not finish in {timeout_s} s")
        except mp.ProcessExitedException as error:
            done = all((Path(folder) / f"rank{r}.done").exists() for r in range(world_size))
            if not done:
                raise
            warnings.warn(f"a gloo rank died after every answer was saved: {error}", stacklevel=2)
        return [
            torch.load(Path(folder) / f"rank{r}.pt", weights_only=False) for r in range(world_size)
        ]
