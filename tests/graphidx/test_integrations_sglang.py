"""graphidx.integrations.sglang: the CUDA-graph metadata hooks over a runner's step buffers,
top-k positions -> KV slot ids, and a runner step from SGLang-shaped objects equal to the
plain StepBatch path."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from capture import CaptureSizes
from graphidx.batch import StepBatch
from graphidx.config import IndexerConfig
from graphidx.integrations.sglang import (
    SEQ_LEN_FILL_VALUE,
    SGLangIndexerHooks,
    topk_positions_to_kv_slots,
)
from graphidx.runner import IndexerGraphRunner, IndexerStack
from graphidx.testing import random_kv_cache, random_layer_input, tape_runner

NUM_PAGES = 64
POOL_ROWS = 12
STACK = IndexerStack(candidate_source=True, consumers=1)
VERIFY = SimpleNamespace(is_target_verify=lambda: True)  # ForwardMode.TARGET_VERIFY
DECODE = SimpleNamespace(is_target_verify=lambda: False)  # ForwardMode.DECODE


def _runner(config: IndexerConfig, seed: int = 0) -> IndexerGraphRunner:
    gen = torch.Generator().manual_seed(seed)
    caches = [random_kv_cache(config, NUM_PAGES, "cpu", gen) for _ in range(STACK.num_layers)]
    sizes = CaptureSizes(max_size=8 * config.next_n, uniform_query_len=config.next_n)
    return tape_runner(config, STACK, caches, capture_sizes=sizes)


def _pool(config: IndexerConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's req_to_token (`[pool rows, max_model_len]` token slots) over random distinct
    pages per pool row, and those pages (`[pool rows, max_blocks]`); row 0 is the reserved
    padding row (slot 0, page 0)."""
    rng = np.random.default_rng(seed)
    ps, cols = config.block_size, config.max_blocks_per_seq
    pages = np.zeros((POOL_ROWS, cols), dtype=np.int32)
    for r in range(1, POOL_ROWS):
        pages[r] = rng.choice(np.arange(1, NUM_PAGES), size=cols, replace=False)
    positions = np.arange(config.max_model_len)
    slots = pages[:, positions // ps] * ps + positions % ps
    return torch.from_numpy(slots.astype(np.int32)), torch.from_numpy(pages)


def _model_runner(req_to_token: torch.Tensor, page_size: int) -> SimpleNamespace:
    """The attributes of SGLang's ModelRunner the hooks read."""
    return SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), page_size=page_size
    )


CONFIG = IndexerConfig.cpu_demo(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=2048)


@pytest.fixture(scope="module")
def setup() -> tuple[IndexerGraphRunner, SGLangIndexerHooks, torch.Tensor]:
    runner = _runner(CONFIG)
    req_to_token, pages = _pool(CONFIG)
    hooks = SGLangIndexerHooks.from_model_runner(runner, _model_runner(req_to_token, 64))
    return runner, hooks, pages


# Hooks mapping ---------------------------------------------------------------------------


def test_replay_hook_writes_the_step_into_the_runner_buffers(setup: Any) -> None:
    runner, hooks, pages = setup
    assert hooks.get_cuda_graph_seq_len_fill_value() == SEQ_LEN_FILL_VALUE == 1
    pool_rows = torch.tensor([3, 5, 1, 9, 4, 4], dtype=torch.int64)  # stale rows past 3
    seq = torch.tensor([100, 7, 1500, 1, 1, 1], dtype=torch.int32)  # SGLang: fill value 1
    batch = hooks.init_forward_metadata_replay_cuda_graph(
        5,
        pool_rows,
        seq,
        1610,
        None,
        VERIFY,
        SimpleNamespace(draft_token_num=2),
        seq.clone(),
        num_real_reqs=3,
    )
    assert batch is hooks.batch
    assert batch.num_reqs == 5 and batch.num_real_reqs == 3 and batch.num_tokens == 10
    assert batch.query_start_loc_cpu.tolist() == [0, 2, 4, 6, 8, 10]
    assert batch.query_start_loc.tolist() == [0, 2, 4, 6, 8, 10]
    # Target verify: the draft rows join the lengths; padding has next_n rows, seq_len 0.
    assert batch.seq_lens.tolist() == [102, 9, 1502, 0, 0]
    assert batch.seq_lens_upper_bound.tolist() == [102, 9, 1502, 0, 0]
    used = -(-1502 // 64)
    assert torch.equal(batch.block_table[2, :used], pages[1, :used])
    assert torch.equal(batch.block_table[0, :2], pages[3, :2])
    assert not batch.block_table[3:].any()  # padding on page 0
    # The batch views the runner's persistent buffers: the runner copies nothing.
    assert batch.seq_lens.data_ptr() == runner.buffers["seq_lens"].data_ptr()
    assert batch.block_table.data_ptr() == runner.buffers["block_table"].data_ptr()
    assert batch.block_table.stride() == runner.buffers["block_table"].stride()


def test_decode_padding_keeps_the_fill_value() -> None:
    config = CONFIG.replace(num_speculative_tokens=0)
    runner = _runner(config, seed=1)
    req_to_token, _ = _pool(config, seed=1)
    hooks = SGLangIndexerHooks(runner, req_to_token)
    seq = torch.tensor([33, 2, 5, 5], dtype=torch.int32)
    batch = hooks.init_forward_metadata_replay_cuda_graph(
        4, torch.tensor([2, 3, 7, 8]), seq, 45, None, DECODE, None, None, num_real_reqs=2
    )
    assert batch.query_lens_cpu.tolist() == [1, 1, 1, 1]
    assert batch.seq_lens.tolist() == [33, 2, 1, 1]  # SGLang's fill value on page 0
    assert batch.seq_lens_upper_bound.tolist() == [config.max_model_len] * 2 + [1, 1]
    assert not batch.block_table[2:].any()
    # forward_mode None is a plain decode step too.
    assert (
        hooks.init_forward_metadata_replay_cuda_graph(2, torch.tensor([2, 3]), seq).num_tokens == 2
    )


def test_capture_hook_builds_an_all_real_dummy_step(setup: Any) -> None:
    _, hooks, _ = setup
    fill = torch.full((8,), SEQ_LEN_FILL_VALUE, dtype=torch.int32)
    batch = hooks.init_forward_metadata_capture_cuda_graph(
        4, 8, torch.zeros(8, dtype=torch.int64), fill, None, VERIFY, None
    )
    assert batch.num_reqs == batch.num_real_reqs == 4
    assert batch.seq_lens.tolist() == [3] * 4  # fill value + next_n draft rows
    with pytest.raises(ValueError, match=r"num_tokens = 7 but bs = 4 requests of 2 rows make 8"):
        hooks.init_forward_metadata_capture_cuda_graph(
            4, 7, torch.zeros(8, dtype=torch.int64), fill, None, VERIFY, None
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bs": 0}, r"bs must be an int >= 1, got 0"),
        ({"bs": 9}, r"bs = 9 exceeds config.max_num_seqs = 8"),
        ({"encoder_lens": torch.ones(2)}, r"encoder_lens must be None"),
        ({"num_real_reqs": 3}, r"num_real_reqs = 3 exceeds bs = 2"),
        ({"seq_lens": torch.ones(1, dtype=torch.int32)}, r"seq_lens has 1 entries, fewer"),
        ({"req_pool_indices": [1, 2]}, r"req_pool_indices must be a 1-D tensor"),
        ({"req_pool_indices": torch.ones(2)}, r"req_pool_indices must hold integers"),
        ({"forward_mode": SimpleNamespace()}, r"forward_mode.is_target_verify is missing"),
        ({"spec_info": SimpleNamespace(draft_token_num=0)}, r"spec_info.draft_token_num must"),
        (
            {"seq_lens_cpu": torch.ones(2, dtype=torch.int32, device="meta")},
            r"seq_lens_cpu must be a host",
        ),
        # A value rule of the batch names the StepBatch field (a real request past the pool).
        ({"seq_lens": torch.tensor([2047, 5], dtype=torch.int32)}, r"seq_lens\[0\] = 2049"),
    ],
)
def test_bad_hook_arguments_are_named(setup: Any, kwargs: dict[str, Any], message: str) -> None:
    _, hooks, _ = setup
    args: dict[str, Any] = dict(
        bs=2,
        req_pool_indices=torch.tensor([1, 2]),
        seq_lens=torch.tensor([50, 60], dtype=torch.int32),
        seq_lens_sum=110,
        encoder_lens=None,
        forward_mode=VERIFY,
        spec_info=None,
        seq_lens_cpu=None,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        hooks.init_forward_metadata_replay_cuda_graph(**args)


def test_model_runner_fields_are_named(setup: Any) -> None:
    runner, _, _ = setup
    req_to_token, _ = _pool(CONFIG)
    with pytest.raises(ValueError, match=r"model_runner.req_to_token_pool is missing"):
        SGLangIndexerHooks.from_model_runner(runner, SimpleNamespace(page_size=64))
    with pytest.raises(ValueError, match=r"model_runner.req_to_token_pool.req_to_token is miss"):
        SGLangIndexerHooks.from_model_runner(
            runner, SimpleNamespace(req_to_token_pool=SimpleNamespace(), page_size=64)
        )
    no_page = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    with pytest.raises(ValueError, match=r"model_runner.page_size is missing"):
        SGLangIndexerHooks.from_model_runner(runner, no_page)
    with pytest.raises(ValueError, match=r"page_size = 16 but the runner's config.block_size"):
        SGLangIndexerHooks.from_model_runner(runner, _model_runner(req_to_token, 16))
    with pytest.raises(ValueError, match=r"req_to_token must be a 2-D int32 tensor"):
        SGLangIndexerHooks(runner, req_to_token.long())
    with pytest.raises(ValueError, match=r"runner must be an IndexerGraphRunner"):
        SGLangIndexerHooks(object(), req_to_token)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"kv_slots needs a step"):
        SGLangIndexerHooks(runner, req_to_token).kv_slots(torch.zeros(1, 1, dtype=torch.int32))


# Positions -> KV slots -------------------------------------------------------------------


def test_topk_positions_to_kv_slots() -> None:
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)  # rows 0-1: request 0, row 2: request 1
    table = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32)
    topk = torch.tensor([[0, 3, -1], [4, 5, 1], [2, -1, -1], [1, 2, 3]], dtype=torch.int32)
    slots = topk_positions_to_kv_slots(topk, qsl, block_table=table, page_entries=4)
    assert slots.dtype == torch.int32
    assert slots.tolist() == [
        [20, 23, -1],
        [8, 9, 21],  # position 4 -> page 2 slot 0; position 1 -> page 5 slot 1
        [30, -1, -1],
        [-1, -1, -1],  # past the last request's rows
    ]
    req_to_token = torch.arange(40, dtype=torch.int32).reshape(4, 10) + 100
    pool = torch.tensor([3, 1])
    via_pool = topk_positions_to_kv_slots(
        topk, qsl, req_to_token=req_to_token, req_pool_indices=pool
    )
    assert via_pool.tolist() == [[130, 133, -1], [134, 135, 131], [112, -1, -1], [-1] * 3]
    out = torch.empty(4, 3, dtype=torch.int32)
    assert topk_positions_to_kv_slots(topk, qsl, block_table=table, page_entries=4, out=out) is out
    assert torch.equal(out, slots)
    empty = topk_positions_to_kv_slots(topk, qsl[:1], block_table=table, page_entries=4)
    assert (empty == -1).all()
    with pytest.raises(ValueError, match=r"exactly one of block_table"):
        topk_positions_to_kv_slots(topk, qsl)
    with pytest.raises(ValueError, match=r"page_entries must be an int >= 1"):
        topk_positions_to_kv_slots(topk, qsl, block_table=table)
    with pytest.raises(ValueError, match=r"req_to_token needs req_pool_indices"):
        topk_positions_to_kv_slots(topk, qsl, req_to_token=req_to_token)


# End to end ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["verify", "decode"])
def test_runner_step_from_sglang_hooks_equals_the_plain_batch(mode: str) -> None:
    config = CONFIG if mode == "verify" else CONFIG.replace(num_speculative_tokens=0)
    q = config.next_n
    runner = _runner(config, seed=2)
    req_to_token, pages = _pool(config, seed=2)
    hooks = SGLangIndexerHooks.from_model_runner(runner, _model_runner(req_to_token, 64))
    rng = np.random.default_rng(5)
    real, bs = 5, 8
    pool_rows = torch.tensor([*rng.choice(np.arange(1, POOL_ROWS), real, replace=False), 0, 0, 6])
    # SGLang's lengths: verify excludes the draft rows, decode includes the step's token.
    seq = torch.tensor(
        [*rng.integers(2, 1500, real), *[SEQ_LEN_FILL_VALUE] * (bs - real)], dtype=torch.int32
    )
    batch = hooks.init_forward_metadata_replay_cuda_graph(
        bs,
        pool_rows,
        seq,
        int(seq.sum()),
        None,
        VERIFY if mode == "verify" else DECODE,
        SimpleNamespace(draft_token_num=q) if mode == "verify" else None,
        seq.clone(),
        num_real_reqs=real,
    )
    gen = torch.Generator().manual_seed(9)
    views = runner.input_views(batch.num_tokens)
    for view in views:
        given = random_layer_input(config, batch.num_tokens, "cpu", gen)
        for name in ("q", "q_scale", "weights"):
            getattr(view, name).copy_(getattr(given, name))
    got = runner.step(batch, views).topk.clone()
    slots = torch.stack([hooks.kv_slots(layer) for layer in got])

    full = (seq[:real] + (q if mode == "verify" else 0)).tolist()
    plain = StepBatch.from_lists(
        config, [q] * real, full, pages[pool_rows[:real]], num_pages=runner.num_pages
    )
    want = runner.step(plain, views, pad=False).topk.clone()
    assert got.shape == want.shape == (STACK.num_layers, real * q, config.topk_tokens)
    assert torch.equal(torch.sort(got, -1).values, torch.sort(want, -1).values)
    # Slot ids: each pick's token KV index through req_to_token; -1 stays -1.
    rows = torch.arange(real * q) // q
    expect = torch.where(
        want >= 0, req_to_token[pool_rows[rows][None, :, None], want.clamp(min=0).long()], -1
    )
    assert torch.equal(torch.sort(slots, -1).values, torch.sort(expect.to(torch.int32), -1).values)
    assert bool((want >= 0).any())
