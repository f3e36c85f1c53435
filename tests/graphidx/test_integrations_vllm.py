"""graphidx.integrations.vllm: CommonAttentionMetadata -> StepBatch, vLLM configs ->
IndexerConfig, and a runner step from vLLM-shaped objects equal to the plain StepBatch path."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from graphidx.batch import StepBatch
from graphidx.config import MIB, IndexerConfig
from graphidx.integrations.vllm import (
    CUDAGRAPH_SUPPORT,
    indexer_config_from_vllm,
    step_batch_from_vllm,
)
from graphidx.runner import IndexerStack
from graphidx.testing import random_kv_cache, random_layer_input, tape_runner

CONFIG = IndexerConfig.cpu_demo()  # next_n = 2, R = 1, pages of 64 tokens
NUM_PAGES = 64


def _metadata(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    table: torch.Tensor | None = None,
    num_actual_tokens: int | None = None,
    **changes: Any,
) -> SimpleNamespace:
    """A vLLM v0.11 `CommonAttentionMetadata`, as a namespace with exactly its fields."""
    qsl = torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    if table is None:
        table = torch.zeros(len(query_lens), CONFIG.max_blocks_per_seq, dtype=torch.int32)
        for r, s in enumerate(seq_lens):
            n = -(-s // CONFIG.block_size)
            table[r, :n] = torch.arange(n) + 3 * r
    tokens = int(qsl[-1]) if num_actual_tokens is None else num_actual_tokens
    fields: dict[str, Any] = dict(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl,
        seq_lens=seq.clone(),
        seq_lens_cpu=seq,
        num_computed_tokens_cpu=seq - (qsl[1:] - qsl[:-1]),
        num_reqs=len(query_lens),
        num_actual_tokens=tokens,
        max_query_len=max([0, *query_lens]),
        max_seq_len=max([0, *seq_lens]),
        block_table_tensor=table,
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        causal=True,
    )
    fields.update(changes)
    return SimpleNamespace(**fields)


# StepBatch mapping -----------------------------------------------------------------------


def test_mapping_reads_every_field() -> None:
    md = _metadata([2, 2, 1], [70, 9, 300])
    batch = step_batch_from_vllm(md, CONFIG, num_pages=NUM_PAGES)
    assert batch.num_reqs == batch.num_real_reqs == 3
    assert batch.num_tokens == 5
    assert batch.query_start_loc_cpu.tolist() == [0, 2, 4, 5]
    assert batch.seq_lens_upper_bound.tolist() == [70, 9, 300]
    # Device tensors are vLLM's own (views, no copy).
    assert batch.seq_lens.data_ptr() == md.seq_lens.data_ptr()
    assert batch.query_start_loc.data_ptr() == md.query_start_loc.data_ptr()
    assert batch.block_table.data_ptr() == md.block_table_tensor.data_ptr()
    assert batch.num_pages == NUM_PAGES
    assert CUDAGRAPH_SUPPORT == "UNIFORM_BATCH"


@pytest.mark.parametrize(
    ("padding", "num_actual_tokens"),
    [
        ((0, 0), 4),  # zero rows, seq_len 0, block row 0 (vLLM's usual form)
        ((2, 0), 4),  # query_start_loc = arange(., next_n), seq_len 0
    ],
    ids=["zero", "arange"],
)
def test_padding_requests_are_found_from_zero_host_lengths(
    padding: tuple[int, int], num_actual_tokens: int
) -> None:
    q, s = padding
    md = _metadata([2, 2, q, q], [70, 9, s, s], num_actual_tokens=num_actual_tokens)
    batch = step_batch_from_vllm(md, CONFIG, num_pages=NUM_PAGES)
    assert batch.num_reqs == 4 and batch.num_real_reqs == 2
    assert batch.num_real_tokens == 4
    # The arange form's padding rows lie past num_actual_tokens: num_tokens covers them.
    assert batch.num_tokens == 4 + 2 * q
    # An explicit num_real_reqs wins: a request declared real is validated as real, and the
    # arange form is a real request's error (seq_len < query_len).
    if q:
        with pytest.raises(ValueError, match=r"seq_lens\[2\] = 0 is shorter than request 2"):
            step_batch_from_vllm(md, CONFIG, num_real_reqs=3)
    else:
        assert step_batch_from_vllm(md, CONFIG, num_real_reqs=4).num_real_reqs == 4


def test_tensors_longer_than_num_reqs_are_sliced_and_wide_tables_cut() -> None:
    md = _metadata([2, 2, 0, 0], [70, 9, 0, 0])
    wide = torch.zeros(4, CONFIG.max_blocks_per_seq + 5, dtype=torch.int32)
    wide[:, : CONFIG.max_blocks_per_seq] = md.block_table_tensor
    md.block_table_tensor = wide
    md.num_reqs = 2  # persistent buffers longer than the step
    batch = step_batch_from_vllm(md, CONFIG, num_pages=NUM_PAGES)
    assert batch.num_reqs == 2 and batch.block_table.shape == (2, CONFIG.max_blocks_per_seq)


def test_newer_versions_host_lengths() -> None:
    """Later vLLM: `seq_lens_cpu` is a syncing property, the host copy in `_seq_lens_cpu`."""

    class Metadata(SimpleNamespace):
        @property
        def seq_lens_cpu(self) -> torch.Tensor:
            raise AssertionError("the adapter must not call the syncing property")

    fields = vars(_metadata([2, 1], [70, 9]))
    host = fields.pop("seq_lens_cpu")
    md = Metadata(**fields, _seq_lens_cpu=host)
    assert step_batch_from_vllm(md, CONFIG).seq_lens_upper_bound.tolist() == [70, 9]
    md._seq_lens_cpu = None
    with pytest.raises(ValueError, match=r"common_attn_metadata.seq_lens_cpu is missing"):
        step_batch_from_vllm(md, CONFIG)
    loose = step_batch_from_vllm(md, CONFIG, seq_lens_upper_bound=md.max_seq_len)
    assert loose.seq_lens_upper_bound.tolist() == [70, 70]
    del fields["seq_lens"]
    with pytest.raises(ValueError, match=r"common_attn_metadata.seq_lens is missing"):
        step_batch_from_vllm(Metadata(**fields), CONFIG, seq_lens_upper_bound=[70, 9])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_reqs": None}, r"common_attn_metadata.num_reqs must be an int >= 0, got None"),
        ({"num_reqs": 3}, r"common_attn_metadata.query_start_loc_cpu has 3 rows, fewer than"),
        ({"num_reqs": 40}, r"common_attn_metadata.num_reqs = 40 exceeds config.max_num_seqs"),
        ({"query_start_loc": [0, 2, 3]}, r"common_attn_metadata.query_start_loc must be a"),
        (
            {"query_start_loc": torch.tensor([0, 2, 3])},
            r"common_attn_metadata.query_start_loc must be int32",
        ),
        (
            {"query_start_loc_cpu": torch.tensor([0.0, 2.0, 3.0])},
            r"common_attn_metadata.query_start_loc_cpu must hold integers",
        ),
        (
            {"query_start_loc_cpu": torch.tensor([0, 2, 3], device="meta")},
            r"common_attn_metadata.query_start_loc_cpu must be a host \(CPU\) tensor",
        ),
        ({"seq_lens": torch.tensor([70], dtype=torch.int32)}, r"seq_lens has 1 rows"),
        (
            {"block_table_tensor": torch.zeros(2, dtype=torch.int32)},
            r"common_attn_metadata.block_table_tensor must be 2-D",
        ),
        ({"num_actual_tokens": -1}, r"common_attn_metadata.num_actual_tokens must be an int"),
        ({"max_query_len": 1}, r"common_attn_metadata.max_query_len = 1 is below request 0"),
        ({"max_query_len": True}, r"common_attn_metadata.max_query_len must be an int"),
        (
            {"seq_lens_cpu": torch.tensor([70], dtype=torch.int32)},
            r"common_attn_metadata.seq_lens_cpu has 1 rows",
        ),
        # A value rule of the batch itself names the StepBatch field and request.
        (
            {"seq_lens": torch.tensor([1, 9], dtype=torch.int32)},
            r"seq_lens\[0\] = 1 is shorter than request 0's query length 2",
        ),
    ],
)
def test_bad_fields_are_named(change: dict[str, Any], message: str) -> None:
    md = _metadata([2, 1], [70, 9])
    for name, value in change.items():
        setattr(md, name, value)
    with pytest.raises(ValueError, match=message):
        step_batch_from_vllm(md, CONFIG, num_pages=NUM_PAGES)


@pytest.mark.parametrize(
    "name",
    [
        "query_start_loc",
        "query_start_loc_cpu",
        "num_reqs",
        "num_actual_tokens",
        "block_table_tensor",
        "max_query_len",
    ],
)
def test_missing_fields_are_named(name: str) -> None:
    md = _metadata([2, 1], [70, 9])
    delattr(md, name)
    with pytest.raises(ValueError, match=rf"common_attn_metadata.{name} is missing"):
        step_batch_from_vllm(md, CONFIG)


def test_refuses_other_configs() -> None:
    with pytest.raises(ValueError, match="config must be an IndexerConfig"):
        step_batch_from_vllm(_metadata([1], [5]), {"num_heads": 8})  # type: ignore[arg-type]


# IndexerConfig mapping -------------------------------------------------------------------


def _vllm_configs(**hf_changes: Any) -> tuple[SimpleNamespace, ...]:
    hf: dict[str, Any] = dict(
        index_n_heads=8,
        index_head_dim=64,
        index_topk=64,
        candidate_block_size=8,
        candidate_topk_blocks=16,
        max_position_embeddings=163840,
        num_nextn_predict_layers=1,
    )
    hf.update(hf_changes)
    model = SimpleNamespace(hf_config=SimpleNamespace(**hf), max_model_len=4096)
    spec = SimpleNamespace(num_speculative_tokens=1, enable_adaptive_verification=False)
    cache = SimpleNamespace(block_size=64)
    sched = SimpleNamespace(max_num_seqs=32, max_num_batched_tokens=1024)
    return model, spec, cache, sched


def test_indexer_config_matches_the_cpu_demo_preset() -> None:
    config = indexer_config_from_vllm(*_vllm_configs(), max_logits_bytes=4 * MIB)
    assert config == IndexerConfig.cpu_demo()


def test_indexer_config_options() -> None:
    model, spec, cache, _ = _vllm_configs(compress_ratios=[0, 4, 4])
    spec.enable_adaptive_verification = True
    config = indexer_config_from_vllm(model, spec, SimpleNamespace(block_size=256), layer=1)
    assert config.compress_ratio == 4 and config.block_size == 256
    assert config.adaptive_verification and config.next_n == 2
    # No speculative config: no speculative tokens, whatever the checkpoint's MTP layers.
    assert indexer_config_from_vllm(model.hf_config, layer=2).num_speculative_tokens == 0
    # An HF config alone: max_model_len from max_position_embeddings.
    assert indexer_config_from_vllm(model.hf_config, layer=2).max_model_len == 163840
    del spec.enable_adaptive_verification
    assert not indexer_config_from_vllm(model, spec, cache, layer=1).adaptive_verification


@pytest.mark.parametrize(
    ("where", "name", "value", "message"),
    [
        ("hf", "index_n_heads", None, r"model_config.hf_config.index_n_heads is missing"),
        ("hf", "index_topk", 0, r"model_config.hf_config.index_topk must be an int >= 1"),
        ("hf", "index_head_dim", "128", r"model_config.hf_config.index_head_dim must be an int"),
        ("hf", "candidate_topk_blocks", -1, r"hf_config.candidate_topk_blocks must be an int >= 0"),
        ("hf", "compress_ratios", [1, "x"], r"hf_config.compress_ratios\[1\] must be an int"),
        ("model", "max_model_len", 0, r"model_config.max_model_len must be an int >= 1"),
        ("spec", "num_speculative_tokens", None, r"speculative_config.num_speculative_tokens"),
        ("spec", "enable_adaptive_verification", 1, r"enable_adaptive_verification must be a bool"),
        ("cache", "block_size", 0, r"cache_config.block_size must be an int >= 1"),
        ("sched", "max_num_seqs", 0, r"scheduler_config.max_num_seqs must be an int >= 1"),
        # A rule of IndexerConfig itself: its own field names.
        ("cache", "block_size", 100, r"IndexerConfig from vLLM configs: .*block_size 100"),
    ],
)
def test_bad_config_fields_are_named(where: str, name: str, value: Any, message: str) -> None:
    model, spec, cache, sched = _vllm_configs()
    target = {"hf": model.hf_config, "model": model, "spec": spec, "cache": cache, "sched": sched}[
        where
    ]
    setattr(target, name, value)
    with pytest.raises(ValueError, match=message):
        indexer_config_from_vllm(model, spec, cache, sched)


def test_missing_config_fields_are_named() -> None:
    model, spec, cache, _ = _vllm_configs()
    del spec.num_speculative_tokens
    with pytest.raises(ValueError, match=r"speculative_config.num_speculative_tokens is missing"):
        indexer_config_from_vllm(model, spec)
    del cache.block_size
    with pytest.raises(ValueError, match=r"cache_config.block_size is missing"):
        indexer_config_from_vllm(model, None, cache)


# End to end ------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["none", "zero", "arange"])
def test_runner_step_from_vllm_metadata_equals_the_plain_batch(padding: str) -> None:
    model, spec, cache, sched = _vllm_configs()
    config = indexer_config_from_vllm(model, spec, cache, sched, max_logits_bytes=4 * MIB)
    assert config == IndexerConfig.cpu_demo()
    stack = IndexerStack(candidate_source=True, consumers=2)
    gen = torch.Generator().manual_seed(11)
    caches = [random_kv_cache(config, NUM_PAGES, "cpu", gen) for _ in range(stack.num_layers)]
    runner = tape_runner(config, stack, caches)
    rng = np.random.default_rng(3)
    real_seq = [int(s) for s in rng.integers(2, 1500, size=5)]
    real_query = [config.next_n] * 5
    table = torch.zeros(8, config.max_blocks_per_seq, dtype=torch.int32)
    for r, s in enumerate(real_seq):
        n = -(-s // config.block_size)
        table[r, :n] = torch.from_numpy(rng.choice(NUM_PAGES, size=n, replace=False))
    pad_q = {"none": None, "zero": 0, "arange": config.next_n}[padding]
    query, seq = list(real_query), list(real_seq)
    if pad_q is not None:
        query += [pad_q] * 3
        seq += [0] * 3
        table[5:] = 7  # stale rows: never read
    md = _metadata(query, seq, table=table[: len(query)], num_actual_tokens=sum(real_query))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecated attribute is touched
        batch = step_batch_from_vllm(md, config, num_pages=runner.num_pages)
    assert batch.num_real_reqs == 5
    inputs = tuple(
        random_layer_input(config, batch.num_tokens, "cpu", gen) for _ in range(stack.num_layers)
    )
    got = runner.step(batch, inputs).topk.clone()
    plain = StepBatch.from_lists(
        config, real_query, real_seq, table[:5], num_pages=runner.num_pages
    )
    want = runner.step(plain, inputs, pad=False).topk.clone()
    assert got.shape == want.shape == (stack.num_layers, 10, config.topk_tokens)
    assert torch.equal(torch.sort(got, -1).values, torch.sort(want, -1).values)
    assert bool((want >= 0).any())
