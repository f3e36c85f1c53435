"""Candidate-consumer prefill launches (docs/contract.md section 3.3, `plan_gather_launches`).

A consumer's logits are `rows x num_candidate_cols` whatever the context, so the dense split
(which cuts by context width) would launch it far too often. Here a request's rows are joined
back across the gathering chunks that cut them, then cut again by `max_rows` alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from graphidx.metadata import GatherLaunch, PrefillChunk, PrefillPlan
from graphidx.plan._host import adjacent_views, check_positive_int, spanning_view


@dataclass
class _Run:
    """Consecutive rows `[token_start, token_end)` of one request, as chunk pieces."""

    request: int
    token_start: int
    token_end: int
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)  # chunk, lo, hi, req


def plan_gather_launches(
    chunks: Sequence[PrefillChunk],
    plans: Sequence[PrefillPlan],
    max_rows: int,
    *,
    row_ends_out: torch.Tensor | None = None,
) -> list[GatherLaunch]:
    """Launches of at most `max_rows` rows over the rows of the gathering chunks.

    `chunks` and `plans` pair up in step order. Over the chunks whose plan has `use_gather`,
    each request's rows are joined into runs (a run continues when the next piece is the same
    request and starts where the last one ended; a non-gathering chunk breaks every run), and
    each run is cut into launches of at most `max_rows` rows. A launch carries its absolute
    rows, the request's block-table row (`[1, max_blocks]` view), its compressed context
    `context_len` (`[1]` view), its rows' `row_ends` (`[rows]`) and `pool`, the launch's
    index. A piece's step request is `plan.first_request` plus its block-table index less that
    of `plan.requests[0]` (the request holding the chunk's `token_start`).

    `row_ends` is a view of the plans' `row_ends` when the launch lies in one chunk or the
    chunks' row ends are adjacent in one storage (the builder's case); otherwise the pieces are
    copied into `row_ends_out[token_start:token_end]` (a persistent int32 buffer indexed by
    step row) or, without it, into a fresh tensor.
    """
    check_positive_int("max_rows", max_rows)
    if len(chunks) != len(plans):
        raise ValueError(f"{len(chunks)} chunks but {len(plans)} plans")

    runs: list[_Run] = []
    last: _Run | None = None
    for index, (chunk, plan) in enumerate(zip(chunks, plans, strict=True)):
        if not plan.use_gather:
            last = None
            continue
        # `requests` index the chunk's block table; its first entry is the request holding
        # `token_start`, which is `first_request`.
        base = plan.first_request - plan.requests[0][2] if plan.requests else 0
        for lo, hi, req in plan.requests:
            request = base + req
            start, end = chunk.token_start + lo, chunk.token_start + hi
            if last is None or last.request != request or last.token_end != start:
                last = _Run(request, start, start)
                runs.append(last)
            last.token_end = end
            last.pieces.append((index, start, end, req))

    launches: list[GatherLaunch] = []
    for run in runs:
        first_index, _, _, req = run.pieces[0]
        block_table = chunks[first_index].block_table[req : req + 1]
        context_len = plans[first_index].context_lens[req : req + 1]
        piece_ends = [
            plans[index].row_ends[lo - chunks[index].token_start : hi - chunks[index].token_start]
            for index, lo, hi, _ in run.pieces
        ]
        run_rows = run.token_end - run.token_start
        run_ends = None  # one view over the whole run, when the pieces allow it
        if len(piece_ends) == 1:
            run_ends = piece_ends[0]
        elif adjacent_views(piece_ends):
            run_ends = spanning_view(piece_ends[0], run_rows)
        for start in range(run.token_start, run.token_end, max_rows):
            end = min(start + max_rows, run.token_end)
            if run_ends is not None:
                row_ends = (
                    run_ends
                    if end - start == run_rows
                    else run_ends[start - run.token_start : end - run.token_start]
                )
            else:
                parts = [
                    ends[max(lo, start) - lo : min(hi, end) - lo]
                    for (_, lo, hi, _), ends in zip(run.pieces, piece_ends, strict=True)
                    if hi > start and lo < end
                ]
                row_ends = _joined(parts, row_ends_out, start, end)
            launches.append(
                GatherLaunch(
                    token_start=start,
                    token_end=end,
                    block_table=block_table,
                    context_len=context_len,
                    row_ends=row_ends,
                    pool=len(launches),
                )
            )
    return launches


def _joined(
    parts: list[torch.Tensor], row_ends_out: torch.Tensor | None, start: int, end: int
) -> torch.Tensor:
    """The concatenation of non-adjacent `parts`: one part itself, else a copy."""
    if len(parts) == 1:
        return parts[0]
    if row_ends_out is None:
        return torch.cat(parts)
    out = row_ends_out[start:end]
    torch.cat(parts, out=out)
    return out
