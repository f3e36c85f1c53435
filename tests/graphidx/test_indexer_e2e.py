"""End to end on the CPU: StepBatch -> builder -> K writer -> indexer layers (issue 3).

For every real row, the dense layer's top-k and the candidate source's blocks must be the
same sets as brute-force float64 scoring of the dequantized Q and K, and each consumer's top-k
the same set as brute force restricted to the source's candidate blocks. Ties are tolerated by
comparing the picked VALUES (float64 scores of the picked positions, sorted) with the float64
top values. Padding rows and rows without a visible key stay -1.

Scenarios cover decode with next_n 1..4 (native and flattened, padded, ragged), prefill cut
into chunks by a small max_logits_bytes, gather and dense consumers on both decode and prefill
rows (the pool is kept small so both gates trigger), and R in {1, 2, 4}.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from graphidx.batch import StepBatch
from graphidx.builder import CandidateIndexerMetadataBuilder
from graphidx.config import IndexerConfig, cdiv
from graphidx.indexer import candidate_consumer, dense_indexer
from graphidx.metadata import IndexerMetadata
from graphidx.mxfp4 import cache_layout, dequantize_mxfp4, quantize_mxfp4
from graphidx.mxfp4.writer import compressed_slot_mapping, write_k_cache
from graphidx.workspace import ROW_ALIGN, IndexerWorkspace, aligned

SENTINEL = -777
BACKEND = "reference"


@dataclass
class Layer:
    """One indexer layer's inputs and their float64 models."""

    q: torch.Tensor
    q_scale: torch.Tensor
    weights: torch.Tensor
    kv_cache: torch.Tensor
    q64: torch.Tensor  # [num_tokens, H, D]
    w64: torch.Tensor  # [num_tokens, H]
    keys64: list[torch.Tensor]  # per request: [context, D]


@dataclass
class Step:
    config: IndexerConfig
    metadata: IndexerMetadata
    row_request: list[int]  # per real row
    row_ends: list[int]  # per real row
    num_tokens: int


def _config(ratio: int, next_n: int, **overrides: object) -> IndexerConfig:
    base: dict[str, object] = dict(
        num_heads=4,
        compress_ratio=ratio,
        block_size=64 * ratio,
        num_speculative_tokens=next_n - 1,
        topk_tokens=24,
        candidate_topk_blocks=8,  # a pool of 64 columns: both gather gates trigger
        max_logits_bytes=24 * 1024,  # prefill chunks get cut
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    base.update(overrides)
    return IndexerConfig.cpu_demo(**base)  # type: ignore[arg-type]


def _make_step(
    gen: torch.Generator,
    config: IndexerConfig,
    query_lens: list[int],
    seq_lens: list[int],
    num_tokens: int | None,
) -> tuple[Step, torch.Tensor, int]:
    ratio, entries = config.compress_ratio, config.page_entries
    pages = [cdiv(s // ratio, entries) for s in seq_lens]
    num_pages = sum(pages) + 2
    order = torch.randperm(num_pages, generator=gen).int()
    table = torch.zeros((len(seq_lens), max(1, *pages) + 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[used : used + n]
        used += n
    batch = StepBatch.from_lists(
        config, query_lens, seq_lens, table, num_tokens=num_tokens, num_pages=num_pages
    )
    builder = CandidateIndexerMetadataBuilder(config, "cpu", num_pages=num_pages)
    metadata = builder.build(batch)
    row_request: list[int] = []
    row_ends: list[int] = []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for j in range(q_len):
            row_request.append(i)
            row_ends.append((s_len - q_len + j + 1) // ratio)
    step = Step(config, metadata, row_request, row_ends, batch.num_tokens)
    return step, table, num_pages


def _make_layer(
    gen: torch.Generator,
    config: IndexerConfig,
    seq_lens: list[int],
    table: torch.Tensor,
    num_pages: int,
    num_tokens: int,
) -> Layer:
    layout = cache_layout(config.num_heads, config.head_dim, config.page_entries)
    # Unwritten bytes are 0xFF: a 0xFF scale decodes to NaN, so any stray read shows.
    storage = torch.full((num_pages, layout.page_bytes + 16), 0xFF, dtype=torch.uint8)
    kv_cache = storage[:, : layout.page_bytes + 4]
    keys = [
        torch.randn(s, config.head_dim, generator=gen)
        * 10.0 ** torch.randint(-1, 2, (s, 1), generator=gen).float()
        for s in seq_lens
    ]
    all_keys = torch.cat(keys)
    positions = torch.cat([torch.arange(s) for s in seq_lens])
    requests = torch.cat([torch.full((s,), i) for i, s in enumerate(seq_lens)])
    slots = compressed_slot_mapping(
        positions, requests, table, config.compress_ratio, config.page_entries
    )
    write_k_cache(all_keys, slots, kv_cache, layout)
    keys64 = []
    for k in keys:
        compressed = k[config.compress_ratio - 1 :: config.compress_ratio]
        keys64.append(dequantize_mxfp4(*quantize_mxfp4(compressed)).double())
    raw_q = torch.randn(num_tokens, config.num_heads, config.head_dim, generator=gen) * 2.0
    q, q_scale = quantize_mxfp4(raw_q)
    weights = torch.randn(num_tokens, config.num_heads, generator=gen)
    return Layer(
        q,
        q_scale,
        weights,
        kv_cache,
        dequantize_mxfp4(q, q_scale).double(),
        weights.double(),
        keys64,
    )


def _scores64(layer: Layer, row: int, keys: torch.Tensor) -> torch.Tensor:
    return layer.w64[row] @ torch.relu(layer.q64[row] @ keys.T)


def _check_picks(picks: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, k: int) -> None:
    """picks int32 [k]; scores float64 [end]; allowed bool [end]: the candidate columns."""
    want = torch.sort(scores[allowed], descending=True).values[:k]
    valid = picks[picks >= 0].long()
    assert valid.shape[0] == want.shape[0], (picks, want.shape[0])
    assert int((picks == -1).sum()) == k - want.shape[0]
    assert torch.unique(valid).shape[0] == valid.shape[0], "duplicate pick"
    assert torch.all(valid < scores.shape[0]), "pick past the row end"
    assert torch.all(allowed[valid]), "pick outside the candidate pool"
    got = torch.sort(scores[valid], descending=True).values
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(scale, 1.0))


def _block_scores64(scores: torch.Tensor, size: int) -> torch.Tensor:
    end = scores.shape[0]
    blocks = torch.tensor(
        [float(scores[b * size : (b + 1) * size].max()) for b in range(cdiv(end, size))],
        dtype=torch.float64,
    )
    if end:
        blocks[-1] = float("inf")  # the newest key's block is pinned
    return blocks


def _run_and_check(
    gen: torch.Generator,
    config: IndexerConfig,
    query_lens: list[int],
    seq_lens: list[int],
    num_tokens: int | None = None,
) -> IndexerMetadata:
    step, table, num_pages = _make_step(gen, config, query_lens, seq_lens, num_tokens)
    layers = [
        _make_layer(gen, config, seq_lens, table, num_pages, step.num_tokens) for _ in range(3)
    ]
    workspace = IndexerWorkspace(config, "cpu")
    k, size = config.topk_tokens, config.candidate_block_size
    outs = [torch.full((step.num_tokens + 3, k), SENTINEL, dtype=torch.int32) for _ in layers]
    meta = step.metadata

    src = layers[0]
    dense_indexer(
        meta, src.q, src.q_scale, src.weights, src.kv_cache, outs[0], workspace,
        config=config, candidate_source=True, backend=BACKEND,
    )  # fmt: skip
    assert workspace.candidate_ids is not None
    candidates = workspace.candidate_ids[: step.num_tokens].clone()
    for i, layer in enumerate(layers[1:], start=1):
        candidate_consumer(
            meta, layer.q, layer.q_scale, layer.weights, layer.kv_cache, outs[i], workspace,
            config=config, resolve_pool=(i == 1), backend=BACKEND,
        )  # fmt: skip

    real_rows = len(step.row_ends)
    for row in range(real_rows):
        request, end = step.row_request[row], step.row_ends[row]
        everything = torch.ones(end, dtype=torch.bool)
        src_scores = _scores64(src, row, src.keys64[request][:end])
        _check_picks(outs[0][row], src_scores, everything, k)

        # The source's candidate blocks: the top-KB block scores (pin included).
        block_scores = _block_scores64(src_scores, size)
        ids = candidates[row]
        _check_picks(ids, block_scores, torch.ones_like(block_scores, dtype=torch.bool),
                     config.candidate_topk_blocks)  # fmt: skip
        in_pool = torch.zeros(end, dtype=torch.bool)
        for block in ids[ids >= 0].tolist():
            in_pool[block * size : (block + 1) * size] = True
        for i, layer in enumerate(layers[1:], start=1):
            scores = _scores64(layer, row, layer.keys64[request][:end])
            _check_picks(outs[i][row], scores, in_pool, k)
    for out in outs:
        assert torch.all(out[real_rows : step.num_tokens] == -1), "padding row written"
        assert torch.all(out[step.num_tokens :] == SENTINEL), "row past num_tokens written"
    return meta


def test_native_decode_padded_gathers(gen: torch.Generator) -> None:
    """R = 1, next_n = 2, uniform decode plus zero-length padding requests: native grouping,
    long contexts so decode rows gather."""
    config = _config(1, 2)
    meta = _run_and_check(gen, config, [2, 2, 2, 0, 0], [700, 130, 1500, 0, 0], num_tokens=10)
    assert meta.decode is not None and meta.decode.native is not None
    assert meta.decode_use_gather and not meta.chunks


def test_native_decode_dense_consumer(gen: torch.Generator) -> None:
    """R = 2, next_n = 4, short contexts: native grouping, dense + mask consumers."""
    config = _config(2, 4)
    meta = _run_and_check(gen, config, [4, 4, 4], [180, 90, 300])
    assert meta.decode is not None and meta.decode.native is not None
    assert not meta.decode_use_gather


def test_ragged_decode_with_chunked_prefill(gen: torch.Generator) -> None:
    """R = 2, next_n = 3: ragged decode (flattened rows) and prefills cut into chunks, some
    gathering and some dense, graph padding rows past the real ones."""
    config = _config(2, 3)
    meta = _run_and_check(
        gen, config, [1, 3, 2, 120, 40, 7], [900, 61, 400, 1100, 160, 40], num_tokens=180
    )
    assert meta.decode is not None and meta.decode.native is None
    assert meta.decode_use_gather
    assert len(meta.chunks) > 3
    gathers = {plan.use_gather for plan in meta.plans}
    assert gathers == {True, False}
    assert meta.gather_launches


def test_ratio4_prefill_from_scratch(gen: torch.Generator) -> None:
    """R = 4, next_n = 1: decode rows (flattened), a prefill starting at position 0 (its
    first rows see no key and stay -1), short dense decode, chunked prefill."""
    config = _config(4, 1)
    meta = _run_and_check(gen, config, [1, 1, 90, 30], [300, 50, 90, 1030])
    assert meta.decode is not None and not meta.decode_use_gather
    assert len(meta.chunks) > 1


def test_single_row_decode_gathers_and_prefill_dense(gen: torch.Generator) -> None:
    """R = 1, next_n = 1, long decode contexts gather; a short prefill stays dense."""
    config = _config(1, 1)
    meta = _run_and_check(gen, config, [1, 1, 1, 12], [2000, 450, 3000, 60])
    assert meta.decode_use_gather
    assert all(not plan.use_gather for plan in meta.plans)


def test_workspace_sizes() -> None:
    config = _config(1, 2)
    workspace = IndexerWorkspace(config, "cpu")
    decode_rows = min(config.max_num_batched_tokens, config.max_num_seqs * config.next_n)
    assert workspace.decode_logits.numel() == decode_rows * aligned(config.logits_width)
    assert workspace.prefill_logits.numel() * 4 == max(
        config.max_logits_bytes, 4 * config.logits_width
    ) + 4 * config.max_num_batched_tokens * (ROW_ALIGN - 1)
    # Every view's rows are ROW_ALIGN-aligned, whatever its width.
    for width in (1, 15, 17, 100):
        for view in (
            workspace.decode_logits_view(3, width),
            workspace.prefill_logits_view(5, width),
            workspace.block_scores_view(4, width),
        ):
            assert view.stride(0) % ROW_ALIGN == 0 and view.stride(1) == 1
    assert workspace.candidate_ids is not None
    assert workspace.candidate_ids.shape == (
        config.max_num_batched_tokens,
        config.candidate_topk_blocks,
    )
    assert workspace.compact_logits is not None
    assert workspace.compact_logits.shape[1] == config.num_candidate_cols
    assert workspace.total_bytes() == sum(
        t.numel() * t.element_size() for t in workspace.buffers().values()
    )
    with pytest.raises(ValueError, match="decode rows"):
        workspace.decode_logits_view(decode_rows + 1)
    with pytest.raises(ValueError, match="prefill chunk"):
        workspace.prefill_logits_view(workspace.prefill_elements, 2)


def test_layer_rejects_bad_inputs(gen: torch.Generator) -> None:
    config = _config(1, 2)
    step, table, num_pages = _make_step(gen, config, [2, 2], [100, 200], None)
    layer = _make_layer(gen, config, [100, 200], table, num_pages, step.num_tokens)
    workspace = IndexerWorkspace(config, "cpu")
    out = torch.full((step.num_tokens, config.topk_tokens), SENTINEL, dtype=torch.int32)
    args = (step.metadata, layer.q, layer.q_scale, layer.weights, layer.kv_cache)
    with pytest.raises(ValueError, match="topk_indices must have shape"):
        dense_indexer(*args, out[:, :5], workspace, config=config, backend=BACKEND)
    with pytest.raises(ValueError, match="different config"):
        other = IndexerWorkspace(config.replace(topk_tokens=8), "cpu")
        dense_indexer(*args, out, other, config=config, backend=BACKEND)
    with pytest.raises(ValueError, match="q has 2 rows"):
        dense_indexer(
            step.metadata, layer.q[:2], layer.q_scale[:2], layer.weights[:2], layer.kv_cache,
            out, workspace, config=config, backend=BACKEND,
        )  # fmt: skip
    plain = config.replace(candidate_block_size=0, candidate_topk_blocks=0, sparse_logits=False)
    with pytest.raises(ValueError, match="sparse_logits"):
        candidate_consumer(
            *args, out, IndexerWorkspace(plain, "cpu"), config=plain, resolve_pool=True,
            backend=BACKEND,
        )  # fmt: skip
    assert torch.all(out == SENTINEL)


def test_layers_run_in_the_configured_precision(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`IndexerConfig.precision` reaches every logits launch of the layers (dense, gather and
    the dense fallback), and the fp8 mode's picks pass the same float64 checks."""
    import graphidx.ops.gather as gather_op
    import graphidx.ops.logits as logits_op

    asked: list[tuple[str, str | None]] = []
    for module, name in ((logits_op, "dense"), (gather_op, "gather")):
        original = module.resolve_logits_backend

        def spy(backend, precision, device, _original=original, _name=name):  # type: ignore[no-untyped-def]
            asked.append((_name, precision))
            return _original(backend, precision, device)

        monkeypatch.setattr(module, "resolve_logits_backend", spy)
    config = _config(1, 2, precision="fp8")
    meta = _run_and_check(gen, config, [2, 2, 2, 0, 0], [700, 130, 1500, 0, 0], num_tokens=10)
    assert meta.decode_use_gather
    assert {name for name, _ in asked} == {"dense", "gather"}
    assert {precision for _, precision in asked} == {"fp8"}


def test_rows_no_launch_writes_get_minus_one() -> None:
    """The layers' fill covers exactly the rows of [0, num_tokens) outside every launch."""
    from graphidx.indexer import _fill_unwritten_rows

    out = torch.full((12, 3), 7, dtype=torch.int32)
    _fill_unwritten_rows(out, 10, [(0, 2), (5, 7), (4, 5), (0, 0)])
    filled = [r for r in range(12) if bool((out[r] == -1).all())]
    assert filled == [2, 3, 7, 8, 9]
    assert bool((out[[0, 1, 4, 5, 6, 10, 11]] == 7).all())
    untouched = torch.full((4, 3), 7, dtype=torch.int32)
    _fill_unwritten_rows(untouched, 4, [(0, 4)])  # a uniform decode step: nothing to fill
    assert bool((untouched == 7).all())
