"""Host cost of `build()` (pytest-benchmark; never part of CI pass/fail).

Run: `python -m pytest benchmarks/test_build.py --benchmark-enable -q`. Everything is on CPU
tensors with one torch thread, so the figures are the builder's host cost per step (on a GPU
the device ops are asynchronous launches instead). Target (issue 2): a 256-request,
next_n = 2 decode build under 150 us on one core.
"""

from __future__ import annotations

import pytest
import torch

from graphidx.batch import StepBatch
from graphidx.builder import CandidateIndexerMetadataBuilder, IndexerMetadataBuilder
from graphidx.config import IndexerConfig

# DeepSeek-V3.2's indexer with a 4096-token context window, so the block table is 64 columns.
DECODE = IndexerConfig.deepseek_v32(
    max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=2048
)
# The same model at its full 163840-token window: block-table rows of 2560 columns.
DECODE_FULL_WIDTH = IndexerConfig.deepseek_v32(max_num_seqs=512, max_num_batched_tokens=2048)
# A V4.1-shaped two-level indexer (C = 8, 64-block pool = 512 columns), 16K window.
CANDIDATE = IndexerConfig.deepseek_v41_flash(
    max_model_len=16384,
    candidate_topk_blocks=64,
    max_num_seqs=128,
    max_num_batched_tokens=4096,
    max_logits_bytes=32 * 2048 * 4,  # one 32-row request at width 2048 per chunk
)


@pytest.fixture(autouse=True)
def _one_thread():  # type: ignore[no-untyped-def]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _decode_batch(config: IndexerConfig, num_reqs: int, next_n: int) -> StepBatch:
    g = torch.Generator().manual_seed(num_reqs * 10 + next_n)
    seq_lens = torch.randint(next_n, config.max_model_len + 1, (num_reqs,), generator=g).tolist()
    table = torch.randint(
        0, 10**5, (num_reqs, config.max_blocks_per_seq), generator=g, dtype=torch.int32
    )
    return StepBatch.from_lists(
        config.replace(num_speculative_tokens=next_n - 1), [next_n] * num_reqs, seq_lens, table
    )


@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("num_reqs", [1, 16, 64, 256, 512])
@pytest.mark.parametrize("kind", ["dense", "candidate"])
def test_decode_build(benchmark, kind: str, num_reqs: int, next_n: int) -> None:  # type: ignore[no-untyped-def]
    base = DECODE if kind == "dense" else CANDIDATE.replace(max_model_len=4096, max_num_seqs=512)
    batch = _decode_batch(base, num_reqs, next_n)
    config = batch.config
    builder_type = IndexerMetadataBuilder if kind == "dense" else CandidateIndexerMetadataBuilder
    builder = builder_type(config, "cpu")
    meta = benchmark(builder.build, batch)
    assert meta.num_decodes == num_reqs and meta.num_prefills == 0
    assert (meta.decode.native is not None) == (next_n > 1)  # type: ignore[union-attr]


def test_decode_build_full_width_block_table(benchmark) -> None:  # type: ignore[no-untyped-def]
    """256 x next_n 2 with the full 2560-column block table: the row copy dominates."""
    batch = _decode_batch(DECODE_FULL_WIDTH, 256, 2)
    builder = IndexerMetadataBuilder(batch.config, "cpu")
    benchmark(builder.build, batch)


@pytest.mark.parametrize("num_chunks", [1, 4, 16, 64])
@pytest.mark.parametrize("layout", ["requests", "one_request", "mixed"])
def test_prefill_build(benchmark, layout: str, num_chunks: int) -> None:  # type: ignore[no-untyped-def]
    """`num_chunks` chunks of 32 rows at width 2048 (exactly the budget): one per request,
    one request cut into `num_chunks`, or one per request after 64 decode requests."""
    g = torch.Generator().manual_seed(num_chunks)
    if layout == "one_request":
        query_lens, seq_lens = [32 * num_chunks], [2048]
    else:
        query_lens, seq_lens = [32] * num_chunks, [2048] * num_chunks
    if layout == "mixed":
        query_lens = [2] * 64 + query_lens
        seq_lens = torch.randint(2, 16385, (64,), generator=g).tolist() + seq_lens
    table = torch.randint(
        0, 10**5, (len(query_lens), CANDIDATE.max_blocks_per_seq), generator=g, dtype=torch.int32
    )
    batch = StepBatch.from_lists(CANDIDATE, query_lens, seq_lens, table)
    builder = CandidateIndexerMetadataBuilder(CANDIDATE, "cpu")
    meta = benchmark(builder.build, batch)
    assert len(meta.chunks) == num_chunks
    assert meta.gather_launches
