"""The dataclasses the metadata builder returns (docs/contract.md section 3).

Tensors named here are device tensors unless the field says host. Views into the builder's
persistent buffers are only valid until the next `build()`; a captured graph reads the
buffers themselves, so their addresses never change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill launch: rows `[token_start, token_end)` of the step.

    `block_table` holds the chunk's requests' rows (`[num_reqs, max_blocks]`, a view);
    `cu_seqlen_ks` / `cu_seqlen_ke` are per row (`[token_end - token_start]`, int32): start and
    exclusive end of the row's visible keys in the concatenation of the chunk's requests'
    compressed contexts, so `ke - ks` is the row end. These are the seed's fields, and all a
    chunk needs: its first request (block-table row 0) is the request holding row
    `token_start` in the step's `query_start_loc`, and its requests are that one and the next
    `num_reqs - 1`. `request_start`, optional, names the step index of that first request;
    planning checks it against `token_start` and never reads anything else from it.
    """

    token_start: int
    token_end: int
    num_reqs: int
    block_table: torch.Tensor
    cu_seqlen_ks: torch.Tensor
    cu_seqlen_ke: torch.Tensor
    request_start: int | None = None

    @property
    def num_rows(self) -> int:
        return self.token_end - self.token_start


@dataclass(frozen=True)
class PrefillPlan:
    """How one chunk is launched (docs/contract.md section 3.3, `plan_prefill_chunks`).

    `requests`: `(first row, end row, request)` per request with rows in the chunk, rows
    counted from the chunk's `token_start`, `request` indexing the chunk's block table.
    `query_start_loc`: int32 `[num_reqs + 1]`, the chunk-local row offsets.
    `width`: widest upper-bound compressed context among the chunk's requests (host int).
    `row_ends`: int32 `[rows]`; `block_ends`: `ceil(row_ends / C)` or None without candidate
    blocks; `context_lens`: int32 `[num_reqs]`, the requests' compressed contexts (a view).
    """

    first_request: int
    requests: tuple[tuple[int, int, int], ...]
    query_start_loc: torch.Tensor
    width: int
    row_ends: torch.Tensor
    block_ends: torch.Tensor | None
    context_lens: torch.Tensor
    use_gather: bool


@dataclass(frozen=True)
class GatherLaunch:
    """One candidate-consumer prefill launch over rows `[token_start, token_end)`.

    All rows belong to one request: `block_table` is its row (`[1, max_blocks]`),
    `context_len` its compressed context (`[1]`, the seed's name), `row_ends` its rows' ends
    (`[rows]`).
    `pool` names the pool slot that the first consumer layer fills and later layers reuse.
    """

    token_start: int
    token_end: int
    block_table: torch.Tensor
    context_len: torch.Tensor
    row_ends: torch.Tensor
    pool: int

    @property
    def num_rows(self) -> int:
        return self.token_end - self.token_start


@dataclass(frozen=True)
class NativeDecode:
    """Decode launched as `next_n`-row sequences: one K walk serves a request's rows.

    `context_lens`: `[num_reqs]`; `block_table`: `[num_reqs, max_blocks]`, a strided view of
    the row block table (every `next_n`-th row), never a copy.
    """

    next_n: int
    context_lens: torch.Tensor
    block_table: torch.Tensor


@dataclass(frozen=True)
class RequestRows:
    """Decode rows grouped into their requests by device row offsets: one K walk serves a
    request's rows whatever their number (a captured step under adaptive verification,
    where the device query lengths, not the host's uniform placeholder, fix the rows).

    `query_start_loc`: int32 `[num_reqs + 1]`, from 0 to the step's rows (padding requests
    own the rows past the real ones, with no context); `context_lens` and `block_table`:
    per request, `[num_reqs]` and `[num_reqs, max_blocks]`.
    """

    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor


@dataclass(frozen=True)
class DecodeMetadata:
    """The flattened decode rows (docs/contract.md section 3.2), all views of persistent buffers.

    `row_lens`: int32 `[rows]`, each row's end (0 for padding rows); `block_table`: int32
    `[rows, max_blocks]`, the row's request's block-table row (zeros for padding rows);
    `block_ends`: `ceil(row_lens / C)` when candidate blocks are on; `native`: see
    `NativeDecode`; `schedule`: the device-built work schedule, or None for the static grid;
    `width`: the decode logits columns the layers score — None means the config's full
    `logits_width`, which is what a FULL graph must use (it is replayed for any context); an
    eager builder narrows it to the step's widest row end so that the kernels' grids and the
    top-k shrink with the step. Under context parallel (docs/contract.md section 10) widths
    are the rank's share and a FULL graph's is `local_count(logits_width)`, an int. Row ends,
    context lengths and block ends are then rank-local too. `request_rows`: set when the rows
    are grouped by device row offsets (see `RequestRows`); then `native` is None and there
    is no schedule.
    """

    row_lens: torch.Tensor
    block_table: torch.Tensor
    block_ends: torch.Tensor | None = None
    native: NativeDecode | None = None
    schedule: torch.Tensor | None = None
    width: int | None = None
    request_rows: RequestRows | None = None

    @property
    def num_rows(self) -> int:
        return int(self.row_lens.shape[0])


@dataclass(frozen=True)
class IndexerMetadata:
    """Everything one step's indexer layers need, as built by `IndexerMetadataBuilder`.

    Rows `[0, num_decode_tokens)` are decode rows (padding rows of a pure decode step
    included); rows `[num_decode_tokens, num_decode_tokens + num_prefill_tokens)` are prefill
    rows; `num_tokens` counts every row, graph padding included. `context_lens` is
    `seq_lens // R` for every request (persistent buffer view). `global_row_ends`: under
    context parallel (docs/contract.md section 10), int32 `[num_tokens]`, each row's global
    end (the other row ends are rank-local; rows no launch reads hold stale values); None
    on one rank.
    """

    num_reqs: int
    num_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    context_lens: torch.Tensor
    decode: DecodeMetadata | None = None
    chunks: tuple[PrefillChunk, ...] = ()
    plans: tuple[PrefillPlan, ...] = ()
    decode_use_gather: bool = False
    gather_launches: tuple[GatherLaunch, ...] = field(default_factory=tuple)
    global_row_ends: torch.Tensor | None = None
