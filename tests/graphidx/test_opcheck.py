"""`torch.library.opcheck` on every graphidx custom op, with the reference backend on the CPU.

opcheck checks each op's schema against what its body mutates, that autograd is registered
correctly (none of these ops is differentiable), that FakeTensor runs it, and that AOT
dispatch with dynamic shapes gives the eager answer. Every op returns nothing and only writes
its output arguments, so torch derives its fake implementation from the schema (no
`register_fake` in graphidx.ops); these checks are what that relies on.

Each op is called as its public wrapper calls it: `torch.ops.graphidx.<name>(...)` with the
operands the wrapper passes to the launcher `graphidx.ops.registry.define_op` made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from graphidx.config import IndexerConfig, cdiv
from graphidx.ops.schedule import allocate_schedule
from graphidx.testing import random_kv_cache, random_layer_input

BACKEND = "reference"
SPLIT_KEYS = 256
CONFIG = IndexerConfig.cpu_demo(num_heads=2, head_dim=64, block_size=32, candidate_block_size=8)
SIZE = CONFIG.candidate_block_size  # candidate block: 8 keys
WIDTH = 40  # dense logits columns: the 45-key context below is clamped to it
POOL_BLOCKS = 3


def opcheck(op: Callable[..., object], args: tuple[object, ...]) -> None:
    """Every opcheck test of `op` on `args`, failing on the first problem."""
    torch.library.opcheck(op, args, raise_exception=True)


@dataclass
class Step:
    """Queries, a paged cache and one row grouping: the inputs shared by the logits ops."""

    q: torch.Tensor
    q_scale: torch.Tensor
    kv_cache: torch.Tensor
    weights: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    row_ends: torch.Tensor
    query_start_loc: torch.Tensor | None
    next_n: int | None

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    def query_and_cache(self) -> tuple[torch.Tensor, ...]:
        """The first six arguments of both logits ops, in their order."""
        return (
            self.q,
            self.q_scale,
            self.kv_cache,
            self.weights,
            self.context_lens,
            self.block_table,
        )


def make_step(grouping: str) -> Step:
    """Three seqs of 45, 9 and 30 keys on shuffled pages, grouped by `grouping`.

    "qsl": 2, 0 and 3 rows by query_start_loc; "next_n": 2 rows each; "flat": 1 row each.
    Row ends run from 0 (no key) to past the context.
    """
    gen = torch.Generator().manual_seed(29)
    contexts = [45, 9, 30]
    entries = CONFIG.page_entries
    pages_per_seq = [cdiv(c, entries) for c in contexts]
    num_pages = sum(pages_per_seq) + 1
    kv_cache = random_kv_cache(CONFIG, num_pages, "cpu", gen)
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    block_table = torch.zeros(len(contexts), max(pages_per_seq), dtype=torch.int32)
    used = 0
    for s, count in enumerate(pages_per_seq):
        block_table[s, :count] = order[used : used + count]
        used += count
    query_start_loc: torch.Tensor | None = None
    next_n: int | None = None
    if grouping == "qsl":
        query_start_loc = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
        row_ends = [44, 45, 0, 30, 100]
    elif grouping == "next_n":
        next_n = 2
        row_ends = [44, 45, 8, 9, 0, 30]
    else:
        row_ends = [45, 9, 17]
    layer = random_layer_input(CONFIG, len(row_ends), "cpu", gen)
    return Step(
        q=layer.q,
        q_scale=layer.q_scale,
        kv_cache=kv_cache,
        weights=layer.weights,
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        block_table=block_table,
        row_ends=torch.tensor(row_ends, dtype=torch.int32),
        query_start_loc=query_start_loc,
        next_n=next_n,
    )


def pool(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate positions int32 `[rows, POOL_BLOCKS]` (-1 padded) and live columns."""
    positions = torch.tensor([[0, 16, 32], [8, -1, -1], [0, 8, 24]], dtype=torch.int32)
    positions = positions.repeat(cdiv(step.rows, 3), 1)[: step.rows].contiguous()
    live_cols = torch.full((step.rows,), 2 * SIZE + 3, dtype=torch.int32)
    return positions, live_cols


@pytest.mark.parametrize("grouping", ["qsl", "next_n", "flat"])
@pytest.mark.parametrize("with_block_scores", [False, True], ids=["logits", "block_scores"])
def test_paged_mqa_logits(grouping: str, with_block_scores: bool) -> None:
    step = make_step(grouping)
    out = torch.zeros(step.rows, WIDTH)
    block_scores = torch.zeros(step.rows, cdiv(WIDTH, SIZE) + 1) if with_block_scores else None
    schedule = None
    if grouping == "next_n":
        # A decode schedule rides along (it never changes the answer).
        schedule = allocate_schedule(3, WIDTH, "cpu", split_keys=SPLIT_KEYS)
        torch.ops.graphidx.build_decode_schedule(step.row_ends, schedule, 2, SPLIT_KEYS, 0, BACKEND)
    opcheck(
        torch.ops.graphidx.paged_mqa_logits,
        (
            *step.query_and_cache(),
            step.row_ends,
            out,
            step.query_start_loc,
            step.next_n,
            schedule,
            block_scores,
            SIZE if with_block_scores else 0,
            with_block_scores,  # clean
            CONFIG.page_entries,
            "fp8",  # precision: the reference computes both alike
            BACKEND,
        ),
    )


@pytest.mark.parametrize("grouping", ["qsl", "next_n"])
def test_gather_mqa_logits(grouping: str) -> None:
    step = make_step(grouping)
    positions, live_cols = pool(step)
    out = torch.zeros(step.rows, POOL_BLOCKS * SIZE)
    opcheck(
        torch.ops.graphidx.gather_mqa_logits,
        (
            *step.query_and_cache(),
            positions,
            live_cols,
            out,
            SIZE,
            step.query_start_loc,
            step.next_n,
            True,  # clean
            CONFIG.page_entries,
            "fp8",  # precision: the reference computes both alike
            BACKEND,
        ),
    )


def test_remap_compact_topk() -> None:
    positions = torch.tensor([[0, 24, 80, -1], [16, -1, -1, -1]], dtype=torch.int32)
    compact = torch.tensor([[0, 7, 8, 23, -1, 17], [3, -1, -1, 7, 0, -1]], dtype=torch.int32)
    out = torch.zeros_like(compact)
    opcheck(torch.ops.graphidx.remap_compact_topk, (compact, positions, SIZE, out, BACKEND))


def test_topk_per_row() -> None:
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(29))
    logits[1, 2] = float("-inf")
    lengths = torch.tensor([32, 3, 0, 17], dtype=torch.int32)
    out = torch.zeros(4, 5, dtype=torch.int32)
    opcheck(torch.ops.graphidx.topk_per_row, (logits, lengths, 5, out, BACKEND))


def test_resolve_candidate_pool() -> None:
    block_ids = torch.tensor(
        [[3, -1, 0, 1], [-1, 2, 0, 9], [7, 6, 5, 4], [-1, -1, -1, -1]], dtype=torch.int32
    )
    row_ends = torch.tensor([0, 17, 63, 40], dtype=torch.int32)
    positions = torch.zeros(4, 4, dtype=torch.int32)
    live_cols = torch.zeros(4, dtype=torch.int32)
    opcheck(
        torch.ops.graphidx.resolve_candidate_pool,
        (block_ids, row_ends, SIZE, positions, live_cols, BACKEND),
    )


def test_apply_candidate_mask() -> None:
    logits = torch.randn(3, 45, generator=torch.Generator().manual_seed(29))
    positions = torch.tensor([[0, 16, -1], [40, -1, -1], [3, -1, 44]], dtype=torch.int32)
    opcheck(torch.ops.graphidx.apply_candidate_mask, (logits, positions, SIZE, BACKEND))


@pytest.mark.parametrize("next_n", [1, 2])
def test_build_decode_schedule(next_n: int) -> None:
    row_lens = torch.tensor([0, 300, 1000, 5, 600, 257], dtype=torch.int32)
    schedule = allocate_schedule(6 // next_n, 1000, "cpu", split_keys=SPLIT_KEYS, target_items=8)
    opcheck(
        torch.ops.graphidx.build_decode_schedule,
        (row_lens, schedule, next_n, SPLIT_KEYS, 8, BACKEND),  # 8: target items
    )


@pytest.mark.parametrize(
    ("next_n", "size", "group_rows", "with_schedule"),
    [(1, 0, 1, False), (2, SIZE, 2, True), (2, 0, 1, True)],
)
def test_derive_uniform_decode(
    next_n: int, size: int, group_rows: int, with_schedule: bool
) -> None:
    reqs = 4
    seq_lens = torch.tensor([0, 1, 700, 2**30], dtype=torch.int32)  # the last is padding
    num_live = torch.tensor([3], dtype=torch.int32)
    context_lens = torch.zeros(reqs, dtype=torch.int32)
    row_lens = torch.zeros(reqs * next_n, dtype=torch.int32)
    block_ends = torch.zeros(reqs * next_n, dtype=torch.int32) if size else None
    schedule = (
        allocate_schedule(reqs * next_n, 700, "cpu", split_keys=SPLIT_KEYS)
        if with_schedule
        else None
    )
    opcheck(
        torch.ops.graphidx.derive_uniform_decode,
        (
            seq_lens,
            num_live,
            context_lens,
            row_lens,
            block_ends,
            schedule,
            next_n,
            2,  # compress_ratio
            size,
            group_rows,
            SPLIT_KEYS,
            0,  # target_items
            BACKEND,
        ),
    )
