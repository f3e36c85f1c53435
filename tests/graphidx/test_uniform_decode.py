"""The captured uniform decode step's metadata: `derive_uniform_decode` and
`IndexerMetadataBuilder.uniform_decode`, against brute force and against `build()`."""

from __future__ import annotations

import pytest
import torch

from graphidx.batch import StepBatch
from graphidx.builder import CandidateIndexerMetadataBuilder, IndexerMetadataBuilder
from graphidx.config import IndexerConfig
from graphidx.ops.backend import triton_interpreted
from graphidx.ops.schedule import allocate_schedule, build_decode_schedule, derive_uniform_decode

POISON = -777
BACKENDS = ["reference", "triton"] if triton_interpreted() else ["reference"]


def brute_force(
    seq_lens: list[int], live: int, next_n: int, ratio: int, size: int
) -> tuple[list[int], list[int], list[int]]:
    contexts, rows, blocks = [], [], []
    for r, length in enumerate(seq_lens):
        length = max(length, 0) if r < live else 0
        contexts.append(length // ratio)
        for j in range(next_n):
            end = max(length - next_n + j + 1, 0) // ratio
            rows.append(end)
            blocks.append(-(-end // size) if size else 0)
    return contexts, rows, blocks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("next_n", "ratio", "size", "group_rows", "target"),
    [(1, 1, 0, 1, 0), (2, 1, 8, 2, 0), (2, 4, 8, 1, 0), (3, 2, 0, 3, 0), (4, 1, 8, 4, 0),
     (2, 1, 8, 2, 40), (2, 4, 0, 1, 200)],
)  # fmt: skip
def test_derive_matches_brute_force_and_the_schedule_builder(
    backend: str, next_n: int, ratio: int, size: int, group_rows: int, target: int
) -> None:
    gen = torch.Generator().manual_seed(next_n * 10 + ratio)
    reqs, live = 23, 17
    seq = torch.randint(0, 3000, (reqs,), generator=gen, dtype=torch.int32)
    seq[0], seq[1], seq[2] = 0, 1, next_n - 1  # shorter than the step's rows
    seq[live:] = torch.randint(-(2**30), 2**30, (reqs - live,), generator=gen, dtype=torch.int32)
    num_live = torch.tensor([live], dtype=torch.int32)
    contexts = torch.full((reqs,), POISON, dtype=torch.int32)
    rows = torch.full((reqs * next_n,), POISON, dtype=torch.int32)
    blocks = torch.full((reqs * next_n,), POISON, dtype=torch.int32) if size else None
    split = 2048 if target else 256  # a target cuts items finer than split_keys
    schedule = allocate_schedule(reqs * next_n, 3000, "cpu", split_keys=split, target_items=target)
    schedule.fill_(POISON)
    derive_uniform_decode(
        seq,
        num_live,
        contexts,
        rows,
        blocks,
        schedule,
        next_n=next_n,
        compress_ratio=ratio,
        candidate_block_size=size,
        group_rows=group_rows,
        split_keys=split,
        target_items=target,
        backend=backend,
    )
    want_ctx, want_rows, want_blocks = brute_force(seq.tolist(), live, next_n, ratio, size)
    assert contexts.tolist() == want_ctx
    assert rows.tolist() == want_rows
    if blocks is not None:
        assert blocks.tolist() == want_blocks
    expected = allocate_schedule(reqs * next_n, 3000, "cpu", split_keys=split, target_items=target)
    build_decode_schedule(
        torch.tensor(want_rows, dtype=torch.int32),
        expected,
        next_n=group_rows,
        split_keys=split,
        target_items=target,
        backend="reference",
    )
    used = 4 + 3 * int(expected[0])
    assert schedule[:used].tolist() == expected[:used].tolist()
    assert bool((schedule[used:] == POISON).all())  # unused slots keep their bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_derive_without_a_schedule_or_block_ends(backend: str) -> None:
    seq = torch.tensor([5, 9, 0, 70], dtype=torch.int32)
    contexts = torch.full((4,), POISON, dtype=torch.int32)
    rows = torch.full((8,), POISON, dtype=torch.int32)
    derive_uniform_decode(
        seq, torch.tensor([3], dtype=torch.int32), contexts, rows, next_n=2, backend=backend
    )
    assert contexts.tolist() == [5, 9, 0, 0]
    assert rows.tolist() == [4, 5, 8, 9, 0, 0, 0, 0]


def test_derive_refuses_bad_arguments() -> None:
    seq = torch.zeros(4, dtype=torch.int32)
    live = torch.tensor([4], dtype=torch.int32)
    ctx = torch.zeros(4, dtype=torch.int32)
    rows = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="row_lens"):
        derive_uniform_decode(seq, live, ctx, rows[:7], next_n=2)
    with pytest.raises(ValueError, match="num_live_reqs"):
        derive_uniform_decode(seq, live.long(), ctx, rows, next_n=2)
    with pytest.raises(ValueError, match="block_ends"):
        derive_uniform_decode(seq, live, ctx, rows, next_n=2, candidate_block_size=8)
    with pytest.raises(ValueError, match="group_rows"):
        derive_uniform_decode(seq, live, ctx, rows, next_n=2, group_rows=3)
    with pytest.raises(ValueError, match="schedule holds"):
        derive_uniform_decode(
            seq, live, ctx, rows, None, torch.zeros(7, dtype=torch.int32), next_n=2
        )


@pytest.mark.parametrize("adaptive", [False, True])
def test_uniform_decode_agrees_with_build(adaptive: bool) -> None:
    """The captured-shape metadata, derived on the device, equals what the host planner
    builds for the same padded step (rows, contexts, block ends, native grouping)."""
    config = IndexerConfig.cpu_demo(
        max_num_seqs=8, max_num_batched_tokens=64, adaptive_verification=adaptive
    )
    builder = CandidateIndexerMetadataBuilder(
        config, "cpu", decode_schedule=True, full_graph_decode=True
    )
    next_n, reqs, live = config.next_n, 6, 4
    lens = [100, 7, 2, 300]
    table = torch.arange(reqs * 5, dtype=torch.int32).view(reqs, 5) % 40
    seq = torch.tensor([*lens, 2**20, -5], dtype=torch.int32)  # stale padding values
    offsets = torch.arange(0, (reqs + 1) * next_n, next_n, dtype=torch.int32)
    captured = builder.uniform_decode(
        reqs,
        seq,
        table,
        torch.tensor([live], dtype=torch.int32),
        query_start_loc=offsets if adaptive else None,
        backend="reference",
    )
    captured.derive()
    got = captured.metadata
    assert got.decode is not None and got.decode.block_ends is not None
    assert got.num_tokens == reqs * next_n
    derived = [
        t.clone()
        for t in (got.decode.row_lens, got.decode.block_ends, got.context_lens, got.decode.schedule)
        if t is not None  # no schedule for rows grouped by device offsets
    ]
    batch = StepBatch.from_lists(
        config,
        query_lens=[next_n] * live + [0] * (reqs - live),
        seq_lens=lens + [0] * (reqs - live),
        block_table=table,
        num_tokens=reqs * next_n,
    )
    want = builder.build(batch)  # overwrites the same buffers: compare the copies
    assert want.decode is not None
    theirs = [want.decode.row_lens, want.decode.block_ends, want.context_lens]
    if not adaptive:  # the host planner flattens adaptive rows: one schedule group per row
        theirs.append(want.decode.schedule)
    for mine, built in zip(derived, theirs, strict=False):
        assert built is not None
        assert mine.tolist() == built.tolist()
    assert got.decode_use_gather == want.decode_use_gather
    # Grouped per request over the request table itself: no per-row block table.
    grouped = got.decode.request_rows if adaptive else got.decode.native
    assert grouped is not None
    assert grouped.block_table.data_ptr() == table.data_ptr()
    assert got.decode.block_table.data_ptr() == table.data_ptr()


def test_uniform_decode_refuses_bad_shapes() -> None:
    config = IndexerConfig.cpu_demo(max_num_seqs=8, max_num_batched_tokens=64)
    builder = IndexerMetadataBuilder(config, "cpu")
    seq = torch.zeros(4, dtype=torch.int32)
    live = torch.tensor([4], dtype=torch.int32)
    table = torch.zeros(4, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_reqs = 9"):
        builder.uniform_decode(9, torch.zeros(9, dtype=torch.int32), table, live)
    with pytest.raises(ValueError, match="seq_lens"):
        builder.uniform_decode(4, seq[:3], table, live)
    with pytest.raises(ValueError, match="block_table"):
        builder.uniform_decode(4, seq, table[:3], live)


def test_request_rows_follow_the_device_offsets() -> None:
    """Rows owned as the device offsets say (adaptive verification), against brute force;
    padding requests and rows past the real ones end at 0; garbage offsets are clamped."""
    from graphidx.plan import derive_request_rows

    next_n, ratio, size, reqs, live = 3, 2, 8, 5, 4
    real = [1, 4, 3, 2]  # 10 of the 15 rows, one request above next_n
    offsets = [0, 1, 5, 8, 10, 777]  # the padding request's offset is stale
    seq = [9, 40, 3, 100, 2**30]
    contexts = torch.full((reqs,), POISON, dtype=torch.int32)
    rows = torch.full((reqs * next_n,), POISON, dtype=torch.int32)
    blocks = torch.full((reqs * next_n,), POISON, dtype=torch.int32)
    grouping = torch.full((reqs + 1,), POISON, dtype=torch.int32)

    def derive(offsets: list[int]) -> None:
        derive_request_rows(
            torch.tensor(seq, dtype=torch.int32),
            torch.tensor([live], dtype=torch.int32),
            torch.tensor(offsets, dtype=torch.int32),
            next_n,
            ratio,
            size,
            context_lens_out=contexts,
            row_lens_out=rows,
            block_ends_out=blocks,
            query_start_loc_out=grouping,
        )

    derive(offsets)
    want = []
    for q, length in zip(real, seq, strict=False):
        want += [max(length - q + j + 1, 0) // ratio for j in range(q)]
    want += [0] * (reqs * next_n - len(want))
    assert rows.tolist() == want
    assert blocks.tolist() == [-(-w // size) for w in want]
    assert contexts.tolist() == [s // ratio for s in seq[:live]] + [0]
    assert grouping.tolist() == [0, 1, 5, 8, 10, 15]
    # Offsets that decrease or leave the step are clamped into a valid grouping.
    derive([5, -3, 99, 2, 12, 0])
    bounds = grouping.tolist()
    assert bounds[0] == 0 and bounds[-1] == 15 and bounds == sorted(bounds)
    assert all(r >= 0 for r in rows.tolist())
