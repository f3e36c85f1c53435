"""StepBatch: construction, the convenience constructor, and every validation rule
(docs/contract.md section 3.1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from graphidx.batch import StepBatch, padding_form
from graphidx.config import IndexerConfig

CONFIG = IndexerConfig(
    num_heads=32,
    compress_ratio=2,
    block_size=64,  # 32 entries per page
    max_model_len=4096,
    num_speculative_tokens=1,
    max_num_seqs=8,
    max_num_batched_tokens=256,
)


def _parts(**overrides: Any) -> dict[str, Any]:
    """A valid batch's constructor arguments: decodes [2, 1], prefill 40, padding request."""
    query_lens = [2, 1, 40, 0]
    seq_lens = [130, 64, 1000, 0]
    base = StepBatch.from_lists(CONFIG, query_lens, seq_lens, num_pages=64)
    parts: dict[str, Any] = dict(
        query_start_loc_cpu=base.query_start_loc_cpu.clone(),
        seq_lens_upper_bound=base.seq_lens_upper_bound.clone(),
        query_start_loc=base.query_start_loc.clone(),
        seq_lens=base.seq_lens.clone(),
        block_table=base.block_table.clone(),
        config=CONFIG,
        num_tokens=48,
        num_pages=64,
    )
    parts.update(overrides)
    return parts


def _make(parts: dict[str, Any], validate: bool = True) -> StepBatch:
    p = dict(parts)
    return StepBatch(
        p.pop("query_start_loc_cpu"),
        p.pop("seq_lens_upper_bound"),
        p.pop("query_start_loc"),
        p.pop("seq_lens"),
        p.pop("block_table"),
        validate=validate,
        **p,
    )


def test_from_lists_allocates_consecutive_pages_and_defaults() -> None:
    # Contexts 65, 32, 500, 0 entries -> pages 3, 1, 16, 0.
    batch = StepBatch.from_lists(CONFIG, [2, 1, 40, 0], [130, 64, 1000, 0])
    assert batch.num_reqs == 4
    assert batch.num_tokens == 43
    assert batch.device == torch.device("cpu")
    assert batch.query_start_loc_cpu.tolist() == [0, 2, 3, 43, 43]
    assert batch.query_lens_cpu.tolist() == [2, 1, 40, 0]
    assert batch.query_lens_cpu.dtype == torch.int32
    assert batch.seq_lens_upper_bound.tolist() == [130, 64, 1000, 0]
    table = batch.block_table
    assert table.dtype == torch.int32 and table.shape == (4, 16)
    assert table[0].tolist() == [0, 1, 2] + [0] * 13
    assert table[1].tolist() == [3] + [0] * 15
    assert table[2].tolist() == list(range(4, 20))
    assert table[3].tolist() == [0] * 16
    for name in ("query_start_loc", "seq_lens", "block_table"):
        assert getattr(batch, name).dtype == torch.int32


def test_from_lists_passes_options_through() -> None:
    table = torch.arange(40, dtype=torch.int32).reshape(2, 20)
    batch = StepBatch.from_lists(
        CONFIG,
        [1, 2],
        [10, 600],
        table,
        num_tokens=8,
        num_pages=40,
        seq_lens_upper_bound=[12, 601],
    )
    assert batch.num_tokens == 8
    assert batch.num_pages == 40
    assert batch.seq_lens_upper_bound.tolist() == [12, 601]
    assert torch.equal(batch.block_table, table)


def test_from_lists_rejects_mismatched_lists() -> None:
    with pytest.raises(ValueError, match="query_lens has 2 requests but seq_lens has 3"):
        StepBatch.from_lists(CONFIG, [1, 1], [3, 4, 5])


def test_empty_batch() -> None:
    batch = StepBatch.from_lists(CONFIG, [], [], num_tokens=4)
    assert batch.num_reqs == 0 and batch.num_tokens == 4
    assert batch.block_table.shape == (0, 1)


def test_batch_is_frozen() -> None:
    batch = _make(_parts())
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.num_tokens = 3  # type: ignore[misc]


def test_validate_false_skips_every_check() -> None:
    parts = _parts(seq_lens=torch.tensor([-5, 1, 2, 3], dtype=torch.int32), num_tokens=None)
    batch = _make(parts, validate=False)
    assert batch.num_tokens == 43
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = -5 is negative"):
        _make(parts)


def _set(name: str, index: tuple[int, ...] | int, value: int) -> Callable[[dict], None]:
    def mutate(parts: dict) -> None:
        tensor = parts[name]
        tensor[index] = value

    return mutate


def _replace(**changes: Any) -> Callable[[dict], None]:
    def mutate(parts: dict) -> None:
        parts.update(changes)

    return mutate


def _to(name: str, target: torch.dtype | str) -> Callable[[dict], None]:
    def mutate(parts: dict) -> None:
        parts[name] = parts[name].to(target)

    return mutate


def _first_rows(name: str, rows: int) -> Callable[[dict], None]:
    def mutate(parts: dict) -> None:
        parts[name] = parts[name][:rows]

    return mutate


def _both_qsl(index: int, value: int) -> Callable[[dict], None]:
    def mutate(parts: dict) -> None:
        parts["query_start_loc_cpu"][index] = value
        parts["query_start_loc"][index] = value

    return mutate


I64 = torch.int64
BAD_CASES: list[tuple[str, Callable[[dict], None], str]] = [
    ("dtype", _to("seq_lens", I64), r"seq_lens must be int32, got torch.int64"),
    ("host dtype", _to("query_start_loc_cpu", I64), r"query_start_loc_cpu must be int32"),
    (
        "not a tensor",
        _replace(block_table=[[0, 1]]),
        r"block_table must be a torch.Tensor, got list",
    ),
    (
        "host on device",
        _to("seq_lens_upper_bound", "meta"),
        r"seq_lens_upper_bound is a host tensor and must be on the CPU, got device meta",
    ),
    (
        "devices differ",
        _to("block_table", "meta"),
        r"block_table is on meta but query_start_loc is on cpu",
    ),
    (
        "qsl shape",
        lambda p: p.update(query_start_loc_cpu=p["query_start_loc_cpu"].reshape(1, 5)),
        r"query_start_loc_cpu must have shape \[num_reqs \+ 1\], got \(1, 5\)",
    ),
    (
        "seq_lens shape",
        _first_rows("seq_lens", 3),
        r"seq_lens must have shape \[4\] \(num_reqs = 4\), got \(3,\)",
    ),
    (
        "upper bound shape",
        _first_rows("seq_lens_upper_bound", 2),
        r"seq_lens_upper_bound must have shape \[4\]",
    ),
    (
        "device qsl shape",
        _first_rows("query_start_loc", 4),
        r"query_start_loc must have shape \[5\]",
    ),
    (
        "block table rows",
        _first_rows("block_table", 3),
        r"block_table must have shape \[num_reqs = 4, max_blocks\], got \(3, 16\)",
    ),
    (
        "too many requests",
        _replace(config=CONFIG.replace(max_num_seqs=3)),
        r"num_reqs = 4 exceeds config.max_num_seqs = 3",
    ),
    ("num_tokens type", _replace(num_tokens=4.0), r"num_tokens must be an int or None, got 4.0"),
    ("num_pages", _replace(num_pages=0), r"num_pages must be a positive int or None, got 0"),
    ("qsl start", _both_qsl(0, 1), r"query_start_loc_cpu\[0\] must be 0, got 1"),
    (
        "qsl decreasing",
        _both_qsl(2, 1),
        r"non-decreasing: request 1 has query_start_loc_cpu\[1\] = 2 > "
        r"query_start_loc_cpu\[2\] = 1",
    ),
    ("num_tokens low", _replace(num_tokens=42), r"num_tokens = 42 is below query_start_loc_cpu"),
    (
        "num_tokens high",
        _replace(num_tokens=257),
        r"num_tokens = 257 exceeds config.max_num_batched_tokens = 256",
    ),
    (
        "device qsl differs",
        _set("query_start_loc", 2, 4),
        r"query_start_loc\[2\] = 4 differs from query_start_loc_cpu\[2\] = 3",
    ),
    ("negative seq_len", _set("seq_lens", 3, -2), r"seq_lens\[3\] = -2 is negative \(request 3\)"),
    (
        "seq_len below query",
        _set("seq_lens", 2, 39),
        r"seq_lens\[2\] = 39 is shorter than request 2's query length 40",
    ),
    (
        "seq_len above max_model_len",
        _set("seq_lens", 1, 4097),
        r"seq_lens\[1\] = 4097 exceeds config.max_model_len = 4096 \(request 1\)",
    ),
    (
        "upper bound low",
        _set("seq_lens_upper_bound", 2, 999),
        r"seq_lens_upper_bound\[2\] = 999 is below seq_lens\[2\] = 1000 \(request 2\)",
    ),
    (
        "upper bound above max_model_len",
        _set("seq_lens_upper_bound", 0, 5000),
        r"seq_lens_upper_bound\[0\] = 5000 exceeds config.max_model_len",
    ),
    (
        "too few block-table columns",
        lambda p: p.update(block_table=p["block_table"][:, :15].contiguous()),
        r"block_table has 15 columns but request 2 \(seq_lens\[2\] = 1000\) uses 16 pages",
    ),
    (
        "page id too large",
        _set("block_table", (2, 15), 64),
        r"block_table\[2, 15\] = 64 is outside \[0, num_pages = 64\) \(request 2 uses 16 pages\)",
    ),
    (
        "page id negative",
        _set("block_table", (0, 2), -1),
        r"block_table\[0, 2\] = -1 is outside \[0, num_pages = 64\)",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "message"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES]
)
def test_validation_rule(mutate: Callable[[dict], None], message: str) -> None:
    parts = _parts()
    _make(parts)  # the unmodified batch is valid
    mutate(parts)
    with pytest.raises(ValueError, match=message):
        _make(parts)


def test_unused_block_table_entries_are_not_checked() -> None:
    parts = _parts()
    parts["block_table"][1, 1:] = -7  # request 1 uses only its first page
    parts["block_table"][3, :] = 999  # request 3 has no context
    batch = _make(parts)
    assert batch.block_table[1, 1] == -7


def test_page_ids_unchecked_without_num_pages() -> None:
    parts = _parts(num_pages=None)
    parts["block_table"][2, 3] = 10**6
    assert _make(parts).num_pages is None


def test_graph_padding_rows_allowed() -> None:
    batch = _make(_parts(num_tokens=256))
    assert batch.num_tokens == 256


def test_repr_is_short() -> None:
    text = repr(_make(_parts()))
    assert "num_reqs=4" in text and "num_tokens=48" in text and "(4, 16)" in text


# Padding requests (docs/contract.md section 3.2a) ----------------------------------------

# CONFIG: next_n = 2, R = 2 (a seq_len-1 request sees no entry); R1 at R = 1 sees one.
R1 = CONFIG.replace(compress_ratio=1, block_size=32)
REAL_QUERY, REAL_SEQ = [2, 2, 1], [130, 64, 9]


def _with_padding(
    config: IndexerConfig,
    padding: list[tuple[int, int]],
    *,
    stale: int | None = None,
    real: tuple[list[int], list[int]] = (REAL_QUERY, REAL_SEQ),
    **kw: Any,
) -> StepBatch:
    """Real requests then padding requests `(query_len, seq_len)`; with `stale`, every
    zero-context padding block row holds that page id (a runtime's leftover row)."""
    query_lens = [*real[0], *(q for q, _ in padding)]
    seq_lens = [*real[1], *(s for _, s in padding)]
    n = len(real[0])
    base = StepBatch.from_lists(config, query_lens, seq_lens, num_pages=64, num_real_reqs=n)
    table = base.block_table.clone()
    if stale is not None:
        for r, (_, seq) in enumerate(padding, start=n):
            if seq == 0:
                table[r] = stale
    kw.setdefault("num_real_reqs", n)
    kw.setdefault("num_pages", 64)
    return StepBatch.from_lists(config, query_lens, seq_lens, table, **kw)


@pytest.mark.parametrize("config", [CONFIG, R1], ids=["R2", "R1"])
@pytest.mark.parametrize(
    ("form", "padding"),
    [
        ("zero", (0, 0)),  # vLLM: no rows, no context, block row 0
        ("arange", (2, 0)),  # vLLM: query_start_loc = arange(., next_n), seq_len 0
        ("fill1", (1, 1)),  # SGLang: one row, seq_len 1, reserved page 0
    ],
)
def test_each_padding_form_is_accepted(
    config: IndexerConfig, form: str, padding: tuple[int, int]
) -> None:
    assert padding_form(*padding, next_n=config.next_n) == form
    batch = _with_padding(config, [padding] * 3)
    assert batch.num_reqs == 6 and batch.num_real_reqs == 3 and batch.num_padding_reqs == 3
    assert batch.num_real_tokens == 5
    assert batch.num_tokens == 5 + 3 * padding[0]
    real = batch.without_padding()
    assert real.num_reqs == real.num_real_reqs == 3 and real.num_tokens == 5
    assert real.query_start_loc_cpu.tolist() == [0, 2, 4, 5]
    assert torch.equal(real.block_table, batch.block_table[:3])
    assert "num_real_reqs=3" in repr(batch)


def test_forms_mix_and_stale_block_rows_of_empty_padding_are_ignored() -> None:
    batch = _with_padding(R1, [(0, 0), (2, 0), (1, 1), (0, 0)], stale=10**6)
    assert batch.num_padding_reqs == 4
    assert batch.block_table[3:, 0].tolist() == [10**6, 10**6, 0, 10**6]


def test_without_num_real_reqs_every_request_is_real() -> None:
    batch = StepBatch.from_lists(CONFIG, [2, 0], [5, 0])
    assert batch.num_real_reqs == 2 and batch.num_padding_reqs == 0
    assert batch.without_padding() is batch
    # The arange form is a real request's error unless declared padding.
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 0 is shorter than request 1's"):
        StepBatch.from_lists(CONFIG, [2, 2], [5, 0])
    assert StepBatch.from_lists(CONFIG, [2, 2], [5, 0], num_real_reqs=1).num_real_reqs == 1


def test_real_requests_stay_strict() -> None:
    for query_lens, seq_lens, message in [
        ([2, 2], [1, 0], r"seq_lens\[0\] = 1 is shorter than request 0's query length 2"),
        ([2, 0], [-1, 0], r"seq_lens\[0\] = -1 is negative"),
        ([2, 0], [5000, 0], r"seq_lens\[0\] = 5000 exceeds config.max_model_len"),
    ]:
        with pytest.raises(ValueError, match=message):
            StepBatch.from_lists(
                CONFIG,
                query_lens,
                seq_lens,
                torch.zeros(2, 100, dtype=torch.int32),
                num_real_reqs=1,
            )


@pytest.mark.parametrize(
    ("padding", "message"),
    [
        ((0, 1), r"seq_lens\[3\] = 1 with query length 0: padding request 3"),
        ((1, 0), r"seq_lens\[3\] = 0 with query length 1: padding request 3"),
        ((2, 1), r"seq_lens\[3\] = 1 with query length 2: padding request 3"),
        ((1, 2), r"seq_lens\[3\] = 2 with query length 1: padding request 3"),
        ((2, 7), r"seq_lens\[3\] = 7 with query length 2: padding request 3"),
    ],
)
def test_padding_outside_every_form_is_refused(padding: tuple[int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _with_padding(CONFIG, [padding])


def test_padding_with_rows_may_not_follow_a_prefill() -> None:
    real = ([2, 40], [130, 1000])
    assert _with_padding(CONFIG, [(0, 0), (0, 0)], real=real).num_padding_reqs == 2
    for padding in [(2, 0), (1, 1)]:
        with pytest.raises(
            ValueError, match=r"query_start_loc_cpu: padding request 3 .* follows prefill request 1"
        ):
            _with_padding(CONFIG, [(0, 0), padding], real=real)


def test_fill1_padding_must_sit_on_page_0() -> None:
    batch = _with_padding(R1, [(1, 1)])
    table = batch.block_table.clone()
    table[3, 0] = 7
    with pytest.raises(ValueError, match=r"block_table\[3, 0\] = 7: padding request 3"):
        StepBatch.from_lists(R1, [2, 2, 1, 1], [130, 64, 9, 1], table, num_real_reqs=3)
    # At R = 2 the request sees no entry, so its page is never read and not checked.
    table = _with_padding(CONFIG, [(1, 1)]).block_table.clone()
    table[3, 0] = 7
    at_r2 = StepBatch.from_lists(CONFIG, [2, 2, 1, 1], [130, 64, 9, 1], table, num_real_reqs=3)
    assert at_r2.block_table[3, 0] == 7


@pytest.mark.parametrize("value", [-1, 4, 1.0, True])
def test_num_real_reqs_must_be_in_range(value: object) -> None:
    with pytest.raises(ValueError, match=r"num_real_reqs must be an int in \[0, num_reqs = 3\]"):
        StepBatch.from_lists(CONFIG, [2, 2, 0], [5, 5, 0], num_real_reqs=value)  # type: ignore[arg-type]


def test_padding_upper_bounds_are_checked_like_any_request() -> None:
    with pytest.raises(ValueError, match=r"seq_lens_upper_bound\[3\] = 5000 exceeds"):
        _with_padding(CONFIG, [(0, 0)], seq_lens_upper_bound=[*REAL_SEQ, 5000])
