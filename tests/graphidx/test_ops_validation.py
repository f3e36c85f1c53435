"""Bad arguments raise ValueError naming the argument, before any output changes
(docs/contract.md section 9)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from graphidx import ops
from graphidx.mxfp4 import cache_layout, quantize_mxfp4

NAN = float("nan")
SENTINEL = -777
HEADS, HEAD_DIM, PAGE_ENTRIES, ROWS, WIDTH, SIZE = 2, 64, 32, 4, 40, 8

Args = dict[str, Any]


def _logits_args(gen: torch.Generator) -> Args:
    """Valid paged_mqa_logits arguments: 2 seqs of 2 rows (next_n grouping)."""
    layout = cache_layout(HEADS, HEAD_DIM, PAGE_ENTRIES)
    q, q_scale = quantize_mxfp4(torch.randn(ROWS, HEADS, HEAD_DIM, generator=gen))
    kv_cache = torch.randint(0, 127, (3, layout.page_bytes), generator=gen).to(torch.uint8)
    return {
        "q": q,
        "q_scale": q_scale,
        "kv_cache": kv_cache,
        "weights": torch.randn(ROWS, HEADS, generator=gen),
        "context_lens": torch.tensor([30, 40], dtype=torch.int32),
        "block_table": torch.tensor([[0, 2], [1, 2]], dtype=torch.int32),
        "row_ends": torch.tensor([29, 30, 39, 40], dtype=torch.int32),
        "out": torch.full((ROWS, WIDTH), NAN),
        "next_n": 2,
        "block_scores": torch.full((ROWS, 5), NAN),
        "candidate_block_size": SIZE,
        "page_entries": PAGE_ENTRIES,
        "backend": "reference",
    }


def _gather_args(gen: torch.Generator) -> Args:
    args = _logits_args(gen)
    for name in ("row_ends", "block_scores"):
        del args[name]
    args["positions"] = torch.tensor([[0, 8], [16, -1], [0, 24], [32, -1]], dtype=torch.int32)
    args["live_cols"] = torch.tensor([16, 8, 16, 8], dtype=torch.int32)
    args["out"] = torch.full((ROWS, 2 * SIZE), NAN)
    return args


def _positional(args: Args, names: tuple[str, ...]) -> tuple[list[Any], Args]:
    rest = dict(args)
    return [rest.pop(n) for n in names], rest


# Both ops' leading positional arguments, then each op's own.
OPERANDS = ("q", "q_scale", "kv_cache", "weights", "context_lens", "block_table")
LOGITS_POSITIONAL = (*OPERANDS, "row_ends", "out")
GATHER_POSITIONAL = (*OPERANDS, "positions", "live_cols", "out")


def _run_logits(args: Args) -> None:
    positional, keywords = _positional(args, LOGITS_POSITIONAL)
    ops.paged_mqa_logits(*positional, **keywords)


def _run_gather(args: Args) -> None:
    positional, keywords = _positional(args, GATHER_POSITIONAL)
    ops.gather_mqa_logits(*positional, **keywords)


def _set(name: str, value: Callable[[Args], Any]) -> Callable[[Args], None]:
    def change(args: Args) -> None:
        args[name] = value(args)

    return change


def _drop_q_dims(args: Args) -> None:
    # head_dim 48: q's last dim 24 bytes, not a multiple of 32 elements.
    args["q"] = args["q"][..., :24].contiguous()
    args["q_scale"] = args["q_scale"][..., :1].contiguous()


SHARED_CASES: list[tuple[str, Callable[[Args], None], str]] = [
    ("q dtype", _set("q", lambda a: a["q"].to(torch.int32)), "q must be torch.uint8"),
    ("q rank", _set("q", lambda a: a["q"].reshape(ROWS, -1)), "q must be 3-D"),
    ("head_dim", _drop_q_dims, "head_dim 48"),
    ("q_scale shape", _set("q_scale", lambda a: a["q_scale"][:, :1]), "q_scale must have shape"),
    ("q_scale dtype", _set("q_scale", lambda a: a["q_scale"].float()), "q_scale must be"),
    ("weights dtype", _set("weights", lambda a: a["weights"].half()), "weights must be"),
    ("weights rows", _set("weights", lambda a: a["weights"][:3]), "weights must have shape"),
    ("weights heads", _set("weights", lambda a: a["weights"][:, :1]), "weights must have"),
    (
        "weights strided",
        _set("weights", lambda a: torch.randn(HEADS, ROWS).T),
        "weights must be contiguous",
    ),
    ("kv dtype", _set("kv_cache", lambda a: a["kv_cache"].to(torch.int8)), "kv_cache must be"),
    ("kv rank", _set("kv_cache", lambda a: a["kv_cache"].reshape(-1)), "kv_cache must be 2-D"),
    ("kv short page", _set("kv_cache", lambda a: a["kv_cache"][:, :100]), "kv_cache page"),
    ("kv no pages", _set("kv_cache", lambda a: a["kv_cache"][:0]), "kv_cache has no pages"),
    ("page_entries tile", _set("page_entries", lambda a: 48), "page_entries 48"),
    ("page_entries type", _set("page_entries", lambda a: 32.0), "page_entries must be"),
    (
        "context_lens dtype",
        _set("context_lens", lambda a: a["context_lens"].long()),
        "context_lens must be torch.int32",
    ),
    (
        "context_lens count",
        _set("context_lens", lambda a: a["context_lens"][:1]),
        "context_lens must have shape",
    ),
    (
        "block_table rows",
        _set("block_table", lambda a: a["block_table"][:1]),
        "block_table must have shape",
    ),
    ("block_table rank", _set("block_table", lambda a: a["block_table"][0]), "block_table must"),
    ("next_n divides", _set("next_n", lambda a: 3), "next_n=3 does not divide"),
    ("next_n zero", _set("next_n", lambda a: 0), "next_n must be"),
    (
        "both groupings",
        _set("query_start_loc", lambda a: torch.tensor([0, 2, 4], dtype=torch.int32)),
        "query_start_loc and next_n",
    ),
    ("out dtype", _set("out", lambda a: a["out"].double()), "out must be torch.float32"),
    ("out rows", _set("out", lambda a: a["out"][:3]), "out must have shape"),
    ("out strided", _set("out", lambda a: a["out"][:, ::2]), "out must be contiguous"),
    ("clean type", _set("clean", lambda a: 1), "clean must be a bool"),
    ("backend", _set("backend", lambda a: "cuda"), "backend must be one of"),
]

LOGITS_CASES = [
    *SHARED_CASES,
    ("row_ends dtype", _set("row_ends", lambda a: a["row_ends"].long()), "row_ends must be"),
    ("row_ends rows", _set("row_ends", lambda a: a["row_ends"][:3]), "row_ends must have"),
    (
        "block_scores width",
        _set("block_scores", lambda a: a["block_scores"][:, :4]),
        "block_scores has 4 columns",
    ),
    (
        "block_scores without C",
        _set("candidate_block_size", lambda a: 0),
        "candidate_block_size must be an int >= 1",
    ),
    ("schedule dtype", _set("schedule", lambda a: torch.zeros(8)), "schedule must be"),
    (
        "qsl dtype",
        lambda a: (a.pop("next_n"), a.update(query_start_loc=torch.tensor([0, 2, 4]))),
        "query_start_loc must be torch.int32",
    ),
    (
        "qsl seqs",
        lambda a: (
            a.pop("next_n"),
            a.update(query_start_loc=torch.tensor([0, 1, 2, 4], dtype=torch.int32)),
        ),
        "context_lens must have shape",
    ),
    (
        "flattened rows",
        lambda a: a.pop("next_n"),
        "context_lens must have shape",
    ),
]


GATHER_CASES = [
    *SHARED_CASES,
    ("positions dtype", _set("positions", lambda a: a["positions"].long()), "positions must"),
    ("positions rows", _set("positions", lambda a: a["positions"][:3]), "positions must have"),
    ("live_cols rows", _set("live_cols", lambda a: a["live_cols"][:3]), "live_cols must have"),
    ("out narrower than pool", _set("out", lambda a: a["out"][:, :15]), "out has 15 columns"),
    ("C zero", _set("candidate_block_size", lambda a: 0), "candidate_block_size must be"),
    ("C bool", _set("candidate_block_size", lambda a: True), "candidate_block_size must be"),
]

# Per op: its valid arguments, the call, and the outputs that must stay untouched.
OPS: dict[
    str, tuple[Callable[[torch.Generator], Args], Callable[[Args], None], tuple[str, ...]]
] = {
    "paged_mqa_logits": (_logits_args, _run_logits, ("out", "block_scores")),
    "gather_mqa_logits": (_gather_args, _run_gather, ("out",)),
}
REJECT_CASES = [("paged_mqa_logits", *c) for c in LOGITS_CASES] + [
    ("gather_mqa_logits", *c) for c in GATHER_CASES
]


@pytest.mark.parametrize(
    ("op", "case", "change", "message"), REJECT_CASES, ids=[f"{c[0]}: {c[1]}" for c in REJECT_CASES]
)
def test_logits_ops_reject(
    gen: torch.Generator, op: str, case: str, change: Callable[[Args], None], message: str
) -> None:
    make_args, run, outputs = OPS[op]
    args = make_args(gen)
    run(dict(args))  # the unchanged arguments are valid
    poisoned = [args[name].fill_(NAN) for name in outputs]
    change(args)
    with pytest.raises(ValueError, match=message):
        run(args)
    assert all(torch.all(torch.isnan(t)) for t in poisoned), case


def test_topk_per_row_rejects(gen: torch.Generator) -> None:
    logits = torch.randn(3, 10, generator=gen)
    lengths = torch.tensor([10, 3, 0], dtype=torch.int32)
    out = torch.full((3, 4), SENTINEL, dtype=torch.int32)
    cases: list[tuple[tuple[Any, ...], str]] = [
        ((logits.double(), lengths, 4, out), "logits must be torch.float32"),
        ((logits[0], lengths, 4, out), "logits must be 2-D"),
        ((logits[:, ::2], lengths, 4, out), "logits must be contiguous"),
        ((logits, lengths.long(), 4, out), "lengths must be torch.int32"),
        ((logits, lengths[:2], 4, out), "lengths must have shape"),
        ((logits, lengths, 5, out), "k=5 must equal out.shape"),
        ((logits, lengths, 0, out[:, :0]), "k must be an int >= 1"),
        ((logits, lengths, 4, out.long()), "out must be torch.int32"),
        ((logits, lengths, 4, out[:2]), "out must have shape"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            ops.topk_per_row(*call, backend="reference")
        assert torch.all(out == SENTINEL)
    with pytest.raises(ValueError, match="backend"):
        ops.topk_per_row(logits, lengths, 4, out, backend="cuda")
    assert torch.all(out == SENTINEL)


def test_pool_mask_remap_reject() -> None:
    ids = torch.tensor([[0, 1], [-1, 2]], dtype=torch.int32)
    ends = torch.tensor([16, 24], dtype=torch.int32)
    positions = torch.full((2, 2), SENTINEL, dtype=torch.int32)
    live = torch.full((2,), SENTINEL, dtype=torch.int32)
    pool_cases: list[tuple[tuple[Any, ...], str]] = [
        ((ids.long(), ends, SIZE, positions, live), "block_ids must be torch.int32"),
        ((ids, ends[:1], SIZE, positions, live), "row_ends must have shape"),
        ((ids, ends, 0, positions, live), "candidate_block_size must be"),
        ((ids, ends, SIZE, positions[:, :1], live), "positions must have shape"),
        ((ids, ends, SIZE, positions, live.long()), "live_cols must be torch.int32"),
    ]
    for call, message in pool_cases:
        with pytest.raises(ValueError, match=message):
            ops.resolve_candidate_pool(*call, backend="reference")
        assert torch.all(positions == SENTINEL) and torch.all(live == SENTINEL)

    logits = torch.full((2, 20), NAN)
    first = torch.tensor([[0, 8], [-1, -1]], dtype=torch.int32)
    for call, message in [
        ((logits.double(), first, SIZE), "logits must be torch.float32"),
        ((logits, first[:1], SIZE), "positions must have shape"),
        ((logits, first, -1), "candidate_block_size must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            ops.apply_candidate_mask(*call, backend="reference")
        assert torch.all(torch.isnan(logits))

    compact = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    out = torch.full((2, 2), SENTINEL, dtype=torch.int32)
    for call, message in [
        ((compact.long(), first, SIZE, out), "compact_topk must be torch.int32"),
        ((compact, first[:1], SIZE, out), "positions must have shape"),
        ((compact, first, 0, out), "candidate_block_size must be"),
        ((compact, first, SIZE, out[:, :1]), "out must have shape"),
    ]:
        with pytest.raises(ValueError, match=message):
            ops.remap_compact_topk(*call, backend="reference")
        assert torch.all(out == SENTINEL)


def test_reference_rejects_qsl_not_covering_rows(gen: torch.Generator) -> None:
    args = _logits_args(gen)
    del args["next_n"]
    args["query_start_loc"] = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc must run from 0 to the 4"):
        _run_logits(args)
    assert torch.all(torch.isnan(args["out"]))


def test_reference_rejects_missing_block_table_columns(gen: torch.Generator) -> None:
    args = _logits_args(gen)
    args["block_table"] = args["block_table"][:, :1]  # seq 1 needs 2 pages for 40 keys
    with pytest.raises(ValueError, match="block_table has 1 columns but seq 1"):
        _run_logits(args)
    assert torch.all(torch.isnan(args["out"]))
