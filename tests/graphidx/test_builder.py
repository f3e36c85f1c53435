"""The metadata builders (docs/contract.md section 3.5): configuration errors, build()
against brute force, persistent buffers, and the no-device-to-host rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from graphidx.batch import StepBatch
from graphidx.builder import CandidateIndexerMetadataBuilder, IndexerMetadataBuilder
from graphidx.config import MIB, IndexerConfig
from graphidx.metadata import IndexerMetadata

POISON = -777

# Small two-level config: R = 2, pages of 32 entries, C = 8, 16 pool blocks -> 128 columns.
CANDIDATE = IndexerConfig.cpu_demo(
    compress_ratio=2,
    block_size=64,
    max_model_len=8192,
    max_num_seqs=16,
    max_num_batched_tokens=512,
    max_logits_bytes=64 * 1024,
)
# DeepSeek-V3.2's dense indexer (64 heads of 128, R = 1, pages of 64, top-2048), small limits.
DENSE = IndexerConfig.deepseek_v32(
    max_model_len=4096, num_speculative_tokens=2, max_num_seqs=16, max_num_batched_tokens=256,
    max_logits_bytes=32 * 1024,
)  # fmt: skip


def _poisoned(builder: IndexerMetadataBuilder) -> IndexerMetadataBuilder:
    for tensor in builder.buffers().values():
        tensor.fill_(POISON)
    return builder


def _batch(config: IndexerConfig, query_lens, seq_lens, gen, **kw) -> StepBatch:  # type: ignore[no-untyped-def]
    """A batch whose block table is random page ids (not the tidy consecutive allocation)."""
    pages = max([1, *(-(-(s // config.compress_ratio) // config.page_entries) for s in seq_lens)])
    table = torch.randint(0, 10**4, (len(query_lens), pages), generator=gen, dtype=torch.int32)
    return StepBatch.from_lists(config, query_lens, seq_lens, table, **kw)


def _check_against_brute_force(
    config: IndexerConfig, batch: StepBatch, meta: IndexerMetadata
) -> None:
    ratio, c, next_n = config.compress_ratio, config.candidate_block_size, config.next_n
    query_lens = batch.query_lens_cpu.tolist()
    seq_lens = batch.seq_lens.tolist()
    upper = batch.seq_lens_upper_bound.tolist()
    qsl = batch.query_start_loc_cpu.tolist()
    table = batch.block_table
    nd = next((i for i, q in enumerate(query_lens) if q > next_n), len(query_lens))
    has_prefill = nd < len(query_lens)
    decode_rows = qsl[nd] if has_prefill else batch.num_tokens

    assert (meta.num_reqs, meta.num_tokens) == (len(query_lens), batch.num_tokens)
    assert (meta.num_decodes, meta.num_prefills) == (nd, len(query_lens) - nd)
    assert meta.num_decode_tokens == decode_rows
    assert meta.num_prefill_tokens == qsl[-1] - qsl[nd]
    assert meta.context_lens.tolist() == [s // ratio for s in seq_lens]

    if decode_rows == 0:
        assert meta.decode is None
    else:
        assert meta.decode is not None
        lens, rows = [], []
        for r in range(nd):
            for j in range(query_lens[r]):
                lens.append((seq_lens[r] - query_lens[r] + j + 1) // ratio)
                rows.append(table[r].tolist())
        lens += [0] * (decode_rows - len(lens))
        rows += [[0] * table.shape[1]] * (decode_rows - len(rows))
        assert meta.decode.row_lens.tolist() == lens
        assert meta.decode.block_table.tolist() == rows
        if c:
            assert meta.decode.block_ends is not None
            assert meta.decode.block_ends.tolist() == [-(-e // c) for e in lens]
        else:
            assert meta.decode.block_ends is None
        assert meta.decode.schedule is None

    covered: list[int] = []
    for chunk, plan in zip(meta.chunks, meta.plans, strict=True):
        covered += range(chunk.token_start, chunk.token_end)
        ks, ke = [], []
        for t in range(chunk.token_start, chunk.token_end):
            r = next(i for i in range(len(query_lens)) if qsl[i] <= t < qsl[i + 1])
            start = sum(s // ratio for s in seq_lens[chunk.request_start : r])
            ks.append(start)
            ke.append(start + (seq_lens[r] - qsl[r + 1] + t + 1) // ratio)
        assert chunk.cu_seqlen_ks.tolist() == ks
        assert chunk.cu_seqlen_ke.tolist() == ke
        assert plan.row_ends.tolist() == [b - a for a, b in zip(ks, ke, strict=True)]
        rs = range(chunk.request_start, chunk.request_start + chunk.num_reqs)
        assert plan.width == max(upper[r] // ratio for r in rs)
        # The logits budget holds at the planned width, single rows excepted.
        assert chunk.num_rows == 1 or chunk.num_rows * plan.width * 4 <= config.max_logits_bytes
    # Every prefill row is in a chunk unless no key could be visible to it.
    for t in range(qsl[nd], qsl[-1]):
        if t not in covered:
            r = next(i for i in range(len(query_lens)) if qsl[i] <= t < qsl[i + 1])
            assert (upper[r] - qsl[r + 1] + t + 1) // ratio == 0
    assert covered == sorted(set(covered))


# Configuration ------------------------------------------------------------------------


def _without_candidates(config: IndexerConfig) -> IndexerConfig:
    broken = dataclasses.replace(config)
    object.__setattr__(broken, "candidate_block_size", 0)  # bypass IndexerConfig's own check
    return broken


def _unchecked(config: IndexerConfig, **changes: int) -> IndexerConfig:
    """`config` with `changes` set past IndexerConfig's own checks (the builder's are tested)."""
    broken = dataclasses.replace(config)
    for name, value in changes.items():
        object.__setattr__(broken, name, value)
    return broken


@pytest.mark.parametrize(
    ("builder", "config", "kwargs", "message"),
    [
        (
            IndexerMetadataBuilder,
            IndexerConfig(num_heads=32, block_size=16),
            {},
            r"block_size = 16 \(page_entries = 16 at compress_ratio = 1\) cannot be tiled",
        ),
        (
            CandidateIndexerMetadataBuilder,
            IndexerConfig.cpu_demo(compress_ratio=4, block_size=64),
            {},
            r"block_size = 64 \(page_entries = 16 at compress_ratio = 4\) cannot be tiled",
        ),
        (
            CandidateIndexerMetadataBuilder,
            _unchecked(IndexerConfig.cpu_demo(), candidate_topk_blocks=24),
            {},
            r"candidate_topk_blocks must be a power of two, got 24",
        ),
        (
            CandidateIndexerMetadataBuilder,
            _unchecked(IndexerConfig.cpu_demo(), candidate_block_size=12),
            {},
            r"candidate_block_size = 12 must divide page_entries = 64",
        ),
        (
            CandidateIndexerMetadataBuilder,
            IndexerConfig.cpu_demo(candidate_block_size=64),
            {},
            r"candidate_block_size = 64 must divide the cache layout's n_per_tile = 32",
        ),
        (
            CandidateIndexerMetadataBuilder,
            IndexerConfig.cpu_demo(block_size=96, candidate_block_size=24),
            {},
            r"candidate_block_size = 24 must divide the cache layout's n_per_tile = 32",
        ),
        (
            CandidateIndexerMetadataBuilder,
            _without_candidates(IndexerConfig.cpu_demo()),
            {},
            r"sparse_logits=True needs candidate blocks: candidate_block_size = 0",
        ),
        (
            IndexerMetadataBuilder,
            IndexerConfig.cpu_demo(),
            {"num_pages": 0},
            r"num_pages must be a positive int or None, got 0",
        ),
        (
            IndexerMetadataBuilder,
            {"num_heads": 8},
            {},
            r"config must be an IndexerConfig, got dict",
        ),
    ],
)
def test_configuration_errors(builder, config, kwargs, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        builder(config, "cpu", **kwargs)


def test_candidate_settings() -> None:
    builder = CandidateIndexerMetadataBuilder(IndexerConfig.cpu_demo(), "cpu")
    assert builder.num_candidate_cols == 128
    assert builder.rows_per_launch == 4 * MIB // (4 * 128)
    assert builder.min_gather_width == 192
    assert builder.decode_gather_width == 384
    huge = IndexerConfig.cpu_demo(max_logits_bytes=2**40)
    assert CandidateIndexerMetadataBuilder(huge, "cpu").rows_per_launch == (2**31 - 1) // 512
    # One-column pools: 1.5 columns rounds up to a width of 2 (widths are integers).
    tiny = IndexerConfig.cpu_demo(candidate_block_size=1, candidate_topk_blocks=1)
    assert CandidateIndexerMetadataBuilder(tiny, "cpu").min_gather_width == 2


def test_only_sparse_logits_gather() -> None:
    """The gather gates: a dense builder and a candidate builder without sparse logits
    never gather (no gate at all), even under a FULL graph; with sparse logits the gates
    are set and a FULL graph's decode rows gather."""
    from graphidx.builder import IndexerMetadataBuilder

    dense_config = IndexerConfig.cpu_demo(sparse_logits=False)
    for builder in (
        IndexerMetadataBuilder(dense_config, "cpu", full_graph_decode=True),
        CandidateIndexerMetadataBuilder(dense_config, "cpu", full_graph_decode=True),
    ):
        assert builder.decode_gather_width is None and builder.min_gather_width is None
        assert builder.rows_per_launch == 0
        assert builder._gather_plan(None, 1, [], []) == (False, ())  # type: ignore[arg-type]
    sparse = CandidateIndexerMetadataBuilder(IndexerConfig.cpu_demo(), "cpu",
                                             full_graph_decode=True)  # fmt: skip
    assert sparse.decode_gather_width is not None
    assert sparse._gather_plan(None, 1, [], []) == (True, ())  # type: ignore[arg-type]
    dense_model = CandidateIndexerMetadataBuilder(IndexerConfig(num_heads=32), "cpu")
    assert dense_model.num_candidate_cols == 0 and dense_model.min_gather_width is None


def test_buffers_sized_at_their_maximum() -> None:
    buffers = CandidateIndexerMetadataBuilder(CANDIDATE, "cpu").buffers()
    rows, reqs, cols = 512, 16, CANDIDATE.max_blocks_per_seq
    assert buffers["row_lens"].shape == (rows,)
    assert buffers["row_block_table"].shape == (rows, cols)
    assert buffers["block_ends"].shape == (rows,)
    assert buffers["context_lens"].shape == (reqs,)
    assert buffers["cu_seqlen_ks"].shape == (rows,) and buffers["cu_seqlen_ke"].shape == (rows,)
    assert buffers["chunk_query_start_loc"].shape == (2 * (reqs + rows),)
    assert all(b.device.type == "cpu" for b in buffers.values())
    assert "block_ends" not in IndexerMetadataBuilder(DENSE, "cpu").buffers()


# build() ------------------------------------------------------------------------------


def test_mixed_step_matches_brute_force(gen: torch.Generator) -> None:
    # Decodes [2, 1, 0], prefills: one cut across chunks (width 1000 > budget/4/rows), two
    # sharing a chunk, a trailing padding request; graph padding rows after the prefills.
    builder = _poisoned(CandidateIndexerMetadataBuilder(CANDIDATE, "cpu"))
    batch = _batch(
        CANDIDATE, [2, 1, 0, 90, 20, 9, 0], [700, 33, 5, 2000, 60, 800, 4], gen, num_tokens=130
    )
    meta = builder.build(batch)
    _check_against_brute_force(CANDIDATE, batch, meta)
    assert meta.decode is not None and meta.decode.native is None  # ragged decodes
    assert len(meta.chunks) >= 3
    assert all(c.num_reqs == 1 for c in meta.chunks[:-1])


def test_pure_decode_padding_rows_are_decode_rows(gen: torch.Generator) -> None:
    builder = _poisoned(IndexerMetadataBuilder(DENSE, "cpu"))
    batch = _batch(DENSE, [3, 3, 0, 0], [100, 3000, 7, 0], gen, num_tokens=12)
    meta = builder.build(batch)
    _check_against_brute_force(DENSE, batch, meta)
    assert meta.num_decode_tokens == 12 and meta.num_prefills == 0
    assert meta.decode is not None and meta.decode.num_rows == 12
    native = meta.decode.native
    assert native is not None and native.next_n == 3
    assert native.block_table.shape == (4, batch.block_table.shape[1])
    assert native.block_table.data_ptr() == builder.buffers()["row_block_table"].data_ptr()
    assert native.block_table.stride()[0] == 3 * batch.block_table.shape[1]
    assert native.context_lens.tolist() == [100, 3000, 7, 0]
    assert (meta.chunks, meta.plans, meta.gather_launches) == ((), (), ())


def test_adaptive_verification_forces_next_n_one(gen: torch.Generator) -> None:
    config = DENSE.replace(adaptive_verification=True)
    meta = IndexerMetadataBuilder(config, "cpu").build(_batch(config, [3, 3], [50, 60], gen))
    assert meta.decode is not None and meta.decode.native is None
    assert meta.num_decodes == 2  # the split still uses next_n = 3


def test_ragged_speculative_step(gen: torch.Generator) -> None:
    builder = _poisoned(IndexerMetadataBuilder(DENSE, "cpu"))
    batch = _batch(DENSE, [3, 1, 2, 3], [10, 2000, 3, 64], gen)
    meta = builder.build(batch)
    _check_against_brute_force(DENSE, batch, meta)
    assert meta.decode is not None and meta.decode.native is None


def test_prefill_only_and_empty_steps(gen: torch.Generator) -> None:
    builder = _poisoned(CandidateIndexerMetadataBuilder(CANDIDATE, "cpu"))
    batch = _batch(CANDIDATE, [40, 7], [40, 300], gen)
    meta = builder.build(batch)
    _check_against_brute_force(CANDIDATE, batch, meta)
    assert meta.decode is None and meta.num_decode_tokens == 0
    empty = builder.build(StepBatch.from_lists(CANDIDATE, [], []))
    assert empty.decode is None and empty.chunks == () and empty.num_tokens == 0
    padding_only = builder.build(StepBatch.from_lists(CANDIDATE, [0, 0], [0, 0], num_tokens=4))
    assert padding_only.decode is not None
    assert padding_only.decode.row_lens.tolist() == [0, 0, 0, 0]
    assert padding_only.decode.native is not None  # two padding requests of next_n rows


def test_gates(gen: torch.Generator) -> None:
    builder = CandidateIndexerMetadataBuilder(CANDIDATE, "cpu")  # 128 columns
    ratio = CANDIDATE.compress_ratio

    def decode_gather(upper: int, full: bool = False) -> bool:
        b = (
            CandidateIndexerMetadataBuilder(CANDIDATE, "cpu", full_graph_decode=True)
            if full
            else builder
        )
        batch = _batch(CANDIDATE, [2, 1], [10, 20], gen, seq_lens_upper_bound=[upper, 20])
        return b.build(batch).decode_use_gather

    assert decode_gather(384 * ratio)  # widest context exactly 3.0x the pool
    assert decode_gather(384 * ratio + 1)
    assert not decode_gather(384 * ratio - 1)  # 383 entries
    assert decode_gather(10, full=True)
    prefill_only = _batch(CANDIDATE, [5], [900], gen)
    assert not builder.build(prefill_only).decode_use_gather
    assert (
        CandidateIndexerMetadataBuilder(CANDIDATE, "cpu", full_graph_decode=True)
        .build(prefill_only)
        .decode_use_gather
    )

    def prefill_gather(upper: int) -> bool:
        batch = _batch(CANDIDATE, [5], [5], gen, seq_lens_upper_bound=[upper])
        (plan,) = builder.build(batch).plans
        return plan.use_gather

    assert prefill_gather(192 * ratio)  # exactly 1.5x
    assert not prefill_gather(192 * ratio - 1)
    dense = IndexerMetadataBuilder(CANDIDATE, "cpu").build(_batch(CANDIDATE, [5], [900], gen))
    assert not dense.plans[0].use_gather and not dense.decode_use_gather
    assert dense.gather_launches == ()


def test_gather_launches_join_a_request_cut_across_chunks(gen: torch.Generator) -> None:
    config = CANDIDATE.replace(max_logits_bytes=4 * 1000 * 10)  # 10 rows at width 1000
    builder = _poisoned(CandidateIndexerMetadataBuilder(config, "cpu"))
    assert builder.rows_per_launch == 4 * 1000 * 10 // (4 * 128)  # 78
    batch = _batch(config, [1, 95, 3], [50, 2000, 300], gen)
    meta = builder.build(batch)
    _check_against_brute_force(config, batch, meta)
    assert len(meta.chunks) == 11 and all(p.use_gather for p in meta.plans[:10])
    assert not meta.plans[10].use_gather  # width 150 < 192
    assert [(g.token_start, g.token_end) for g in meta.gather_launches] == [(1, 79), (79, 96)]
    row_ends = builder.buffers()["prefill_row_ends"]
    for pool, launch in enumerate(meta.gather_launches):
        assert launch.pool == pool
        assert launch.row_ends.data_ptr() == row_ends[launch.token_start :].data_ptr()
        expected = [(2000 - 96 + t + 1) // 2 for t in range(launch.token_start, launch.token_end)]
        assert launch.row_ends.tolist() == expected
        assert launch.block_table.tolist() == batch.block_table[1:2].tolist()
        assert launch.context_len.tolist() == [1000]


def test_one_row_chunks_fit_the_chunk_offsets_buffer(gen: torch.Generator) -> None:
    # A logits budget of one fp32 per launch cuts every prefill request into one-row chunks,
    # each holding 2 local offsets: 2 * rows of them, more than reqs + rows.
    config = CANDIDATE.replace(max_logits_bytes=4)
    builder = _poisoned(CandidateIndexerMetadataBuilder(config, "cpu"))
    batch = _batch(config, [1, 300, 200], [50, 2000, 1500], gen)
    meta = builder.build(batch)
    assert len(meta.chunks) == 500 and all(c.num_rows == 1 for c in meta.chunks)
    _check_against_brute_force(config, batch, meta)


def test_buffer_addresses_never_change(gen: torch.Generator) -> None:
    builder = _poisoned(CandidateIndexerMetadataBuilder(CANDIDATE, "cpu"))
    before = {name: (t.data_ptr(), t.shape) for name, t in builder.buffers().items()}
    batches = [
        _batch(CANDIDATE, [2] * 16, [100 + 7 * i for i in range(16)], gen),
        _batch(CANDIDATE, [1, 2, 300], [4000, 9, 5000], gen, num_tokens=400),
        _batch(CANDIDATE, [0, 0], [0, 0], gen, num_tokens=512),
        _batch(CANDIDATE, [200, 200, 100], [8000, 300, 100], gen),
        _batch(CANDIDATE, [2, 2], [30, 40], gen),
    ]
    for batch in batches:
        meta = builder.build(batch)
        _check_against_brute_force(CANDIDATE, batch, meta)
        after = {name: (t.data_ptr(), t.shape) for name, t in builder.buffers().items()}
        assert after == before
        # Every tensor of the metadata lives in a persistent buffer (or the batch).
        storages = {t.untyped_storage().data_ptr() for t in builder.buffers().values()}
        storages.add(batch.block_table.untyped_storage().data_ptr())
        tensors = [meta.context_lens]
        if meta.decode is not None:
            tensors += [meta.decode.row_lens, meta.decode.block_table, meta.decode.block_ends]
        for plan in meta.plans:
            tensors += [plan.query_start_loc, plan.row_ends, plan.block_ends, plan.context_lens]
        for chunk in meta.chunks:
            tensors += [chunk.cu_seqlen_ks, chunk.cu_seqlen_ke, chunk.block_table]
        for launch in meta.gather_launches:
            tensors += [launch.row_ends, launch.context_len, launch.block_table]
        for tensor in tensors:
            assert tensor is not None and tensor.untyped_storage().data_ptr() in storages


class _Trace(TorchDispatchMode):
    """Records every dispatched op; refuses reads of a tensor's value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            raise AssertionError(f"host read of a tensor value: {func}")
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_build_never_reads_device_values(gen: torch.Generator) -> None:
    """On the meta device no value exists: any read back would raise."""
    cpu = _batch(
        CANDIDATE, [2, 1, 0, 90, 20, 9, 0], [700, 33, 5, 2000, 60, 800, 4], gen, num_tokens=140
    )
    meta_batch = StepBatch(
        cpu.query_start_loc_cpu,
        cpu.seq_lens_upper_bound,
        cpu.query_start_loc.to("meta"),
        cpu.seq_lens.to("meta"),
        cpu.block_table.to("meta"),
        config=CANDIDATE,
        num_tokens=140,
        validate=False,
    )
    builder = CandidateIndexerMetadataBuilder(CANDIDATE, "meta")
    with _Trace():
        meta = builder.build(meta_batch)
    reference = CandidateIndexerMetadataBuilder(CANDIDATE, "cpu").build(cpu)
    assert meta.decode is not None and reference.decode is not None
    assert meta.decode.row_lens.device.type == "meta"
    assert [(c.token_start, c.token_end) for c in meta.chunks] == [
        (c.token_start, c.token_end) for c in reference.chunks
    ]
    assert len(meta.gather_launches) == len(reference.gather_launches)
    assert meta.decode_use_gather == reference.decode_use_gather


def test_host_work_does_not_grow_with_context(gen: torch.Generator) -> None:
    """The same shapes with contexts 100x longer dispatch exactly the same ops."""
    config = CANDIDATE.replace(max_model_len=2**20, max_logits_bytes=2**40)
    traces = []
    # Both scales pass every gate (the gates legitimately follow the host upper bounds).
    for scale in (100, 10_000):
        batch = StepBatch.from_lists(
            config,
            [2, 2, 1, 30],
            [s * scale for s in (40, 50, 60, 70)],
            torch.zeros(4, config.max_blocks_per_seq, dtype=torch.int32),
        )
        builder = CandidateIndexerMetadataBuilder(config, "cpu")
        with _Trace() as trace:
            builder.build(batch)
        traces.append(trace.ops)
    assert traces[0] == traces[1] and len(traces[0]) > 5


def test_batch_mismatches_are_refused(gen: torch.Generator) -> None:
    builder = IndexerMetadataBuilder(DENSE, "cpu", num_pages=100)
    other = _batch(DENSE.replace(max_num_seqs=15), [1], [5], gen)
    with pytest.raises(ValueError, match=r"batch\.config differs from the builder's config"):
        builder.build(other)
    with pytest.raises(ValueError, match=r"batch\.num_pages = 99 but the builder's cache has 100"):
        builder.build(StepBatch.from_lists(DENSE, [1], [5], num_pages=99))
    good = _batch(DENSE, [1], [5], gen)
    wide = dataclasses.replace(
        good, block_table=torch.zeros(1, 65, dtype=torch.int32), validate=False
    )
    with pytest.raises(
        ValueError, match=r"block_table has 65 columns, more than config\.max_blocks_per_seq = 64"
    ):
        builder.build(wide)
    many = StepBatch.from_lists(DENSE.replace(max_num_seqs=17), [1] * 17, [5] * 17)
    object.__setattr__(many, "config", DENSE)
    with pytest.raises(ValueError, match=r"batch\.num_reqs = 17 exceeds config\.max_num_seqs = 16"):
        builder.build(many)
    long = dataclasses.replace(good, num_tokens=257, validate=False)
    with pytest.raises(ValueError, match=r"batch\.num_tokens = 257 exceeds"):
        builder.build(long)
    on_meta = dataclasses.replace(
        good,
        query_start_loc=good.query_start_loc.to("meta"),
        seq_lens=good.seq_lens.to("meta"),
        block_table=good.block_table.to("meta"),
        validate=False,
    )
    with pytest.raises(ValueError, match="batch is on meta but the builder is on cpu"):
        builder.build(on_meta)


@st.composite
def _steps(draw: st.DrawFn, config: IndexerConfig):  # type: ignore[no-untyped-def]
    next_n = config.next_n
    decodes = draw(st.lists(st.integers(0, next_n), max_size=6))
    prefills = draw(st.lists(st.integers(next_n + 1, 60), max_size=4))
    if prefills:
        prefills += draw(st.lists(st.integers(0, 3), max_size=2))  # short requests after it
    query_lens = decodes + prefills
    seq_lens = [q + draw(st.integers(0, 2000)) for q in query_lens]
    upper = [s + draw(st.sampled_from([0, 0, 3, 300])) for s in seq_lens]
    upper = [min(u, config.max_model_len) for u in upper]
    padding = draw(st.integers(0, 8))
    return query_lens, seq_lens, upper, sum(query_lens) + padding


_BUILDER = CandidateIndexerMetadataBuilder(CANDIDATE, "cpu")  # shared: builds must not leak


@settings(max_examples=40, deadline=None)
@given(_steps(CANDIDATE), st.integers(0, 2**31 - 1))
def test_builder_matches_brute_force(drawn, seed: int) -> None:  # type: ignore[no-untyped-def]
    query_lens, seq_lens, upper, num_tokens = drawn
    g = torch.Generator().manual_seed(seed)
    batch = _batch(
        CANDIDATE, query_lens, seq_lens, g, num_tokens=num_tokens, seq_lens_upper_bound=upper
    )
    builder = _BUILDER
    meta = builder.build(batch)
    _check_against_brute_force(CANDIDATE, batch, meta)
    rows = [t for g_ in meta.gather_launches for t in range(g_.token_start, g_.token_end)]
    gathered = [
        t
        for c, p in zip(meta.chunks, meta.plans, strict=True)
        if p.use_gather
        for t in range(c.token_start, c.token_end)
    ]
    assert rows == gathered


def test_numpy_inputs_untouched(gen: torch.Generator) -> None:
    """build() leaves the batch's host and device tensors as they were."""
    batch = _batch(CANDIDATE, [2, 1, 50], [400, 30, 900], gen, num_tokens=60)
    before = [
        t.clone()
        for t in (
            batch.query_start_loc_cpu,
            batch.seq_lens_upper_bound,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_table,
        )
    ]
    CandidateIndexerMetadataBuilder(CANDIDATE, "cpu").build(batch)
    after = (
        batch.query_start_loc_cpu,
        batch.seq_lens_upper_bound,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
    )
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert np.array_equal(batch.query_lens_cpu.numpy(), [2, 1, 50])


def test_decode_width_is_shape_only_under_full_graph(gen: torch.Generator) -> None:
    """Eager steps narrow the decode logits to the widest row; a FULL graph never does."""
    config = IndexerConfig.cpu_demo(compress_ratio=2, block_size=128)
    batch = _batch(config, [2, 2], [40, 301], gen)
    eager = IndexerMetadataBuilder(config, "cpu").build(batch)
    assert eager.decode is not None and eager.decode.width == 301 // 2
    for builder in (
        IndexerMetadataBuilder(config, "cpu", full_graph_decode=True),
        CandidateIndexerMetadataBuilder(config, "cpu", full_graph_decode=True),
    ):
        meta = builder.build(batch)
        assert meta.decode is not None and meta.decode.width is None


def test_decode_schedule_is_built_into_one_persistent_buffer(gen: torch.Generator) -> None:
    """With the schedule on, every decode build fills the same buffer on the device."""
    config = IndexerConfig.cpu_demo()
    builder = IndexerMetadataBuilder(config, "cpu", decode_schedule=True)
    address = builder.buffers()["schedule"].data_ptr()
    for query_lens, seq_lens in (([2, 2], [40, 3000]), ([2, 2, 2], [9, 9, 9]), ([1], [1])):
        meta = builder.build(_batch(config, query_lens, seq_lens, gen))
        assert meta.decode is not None and meta.decode.schedule is not None
        schedule = meta.decode.schedule
        assert schedule.data_ptr() == address
        groups = len(query_lens) if meta.decode.native is not None else sum(query_lens)
        assert int(schedule[1]) == groups and int(schedule[0]) >= groups
    assert (
        IndexerMetadataBuilder(config, "cpu").build(_batch(config, [2], [40], gen)).decode.schedule
        is None
    )  # type: ignore[union-attr]


@pytest.mark.parametrize("builder_type", [IndexerMetadataBuilder, CandidateIndexerMetadataBuilder])
def test_decode_schedule_and_buffers_options_reach_every_builder(builder_type) -> None:  # type: ignore[no-untyped-def]
    """Both builders honour decode_schedule (on a CPU it is off by default) and allocate
    into the StaticBuffers they are given."""
    from capture import StaticBuffers

    config = IndexerConfig.cpu_demo(max_num_seqs=4, max_num_batched_tokens=32)
    assert "schedule" not in builder_type(config, "cpu").buffers()
    owner = StaticBuffers("cpu")
    builder = builder_type(config, "cpu", decode_schedule=True, buffers=owner)
    assert "schedule" in builder.buffers()
    assert owner["builder.schedule"] is builder.buffers()["schedule"]
    assert set(owner.names()) == {f"builder.{name}" for name in builder.buffers()}
    with pytest.raises(ValueError, match="buffers live on"):
        builder_type(config, "cpu", buffers=StaticBuffers("meta"))
