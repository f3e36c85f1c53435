"""IndexerWorkspace: every scratch buffer the indexer layers need, allocated once.

The layers (graphidx.indexer) take views of these buffers and allocate no buffer of their own
in the decode path, so a captured graph reads and writes the same addresses on every replay.
(The Triton top-k and candidate-mask launchers still take small per-call scratch from torch's
caching allocator — from the graph's private pool under capture.) One workspace
serves every indexer layer of a model: the layers of a step run one after another, and the
candidate pool (ids from the source layer, positions and live counts resolved by the first
consumer) is the only state carried from one layer to the next within a step.

Sizes, from the config (T = max_num_batched_tokens, W = logits_width, C =
candidate_block_size, KB = candidate_topk_blocks, Wc = num_candidate_cols):
- decode logits float32 `[decode_rows, W]`, decode_rows = min(T, max_num_seqs * next_n);
- prefill logits: a flat float32 buffer of max(max_logits_bytes, 4 * W) bytes, viewed as
  `[rows, width]` per chunk (the builder's split keeps rows * width inside it: a slice of
  more than one row fits max_logits_bytes, a single row is at most W wide);
- with candidate blocks (C > 0): block scores, flat float32 of
  max(decode_rows * ceil(W / C), ceil((prefill elements + T * (C - 1)) / C)) elements, viewed
  `[rows, ceil(width / C)]` (rows * ceil(width / C) <= (rows * width + rows * (C - 1)) / C);
  candidate block ids int32 `[T, KB]` (the source's picks, per step row); pool positions
  int32 `[T, KB]` and live_cols int32 `[T]`;
- with sparse logits (Wc > 0): compact logits float32 `[compact_rows, Wc]` and compact top-k
  int32 `[compact_rows, topk_tokens]`, compact_rows = max(decode_rows, consumer_rows),
  consumer_rows = min(T, max(1, min(max_logits_bytes, 2**31 - 1) // (4 * Wc))) (the
  consumers' prefill rows per launch, docs/contract.md section 3.5).
"""

from __future__ import annotations

import torch

from capture import StaticBuffers
from graphidx.config import IndexerConfig, cdiv

FLOAT32_BYTES = 4

ROW_ALIGN = 16
"""Row strides of the logits and block-score views are multiples of this many elements
(64 bytes): widths change every prefill step, and a Triton kernel is compiled again for each
new divisibility of a stride argument, so aligned strides keep one variant (and 16-byte
vector access) whatever the width."""


def aligned(width: int) -> int:
    """The row stride of a `width`-column view: `width` rounded up to ROW_ALIGN."""
    return cdiv(width, ROW_ALIGN) * ROW_ALIGN


def _rows(flat: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """`[rows, width]` over a flat buffer, rows `aligned(width)` elements apart."""
    stride = aligned(width)
    return flat[: rows * stride].view(rows, stride)[:, :width]


def consumer_rows_per_launch(config: IndexerConfig) -> int:
    """Rows of one candidate-consumer prefill launch (`config.consumer_rows_per_launch`),
    capped at the step's token budget: the compact buffers never need more."""
    return min(config.max_num_batched_tokens, config.consumer_rows_per_launch)


class IndexerWorkspace:
    """The layers' persistent scratch buffers for one model config on one device.

    Attributes (device tensors, see the module docstring for sizes): `decode_logits`,
    `prefill_logits` (flat), and, when the config has candidate blocks, `block_scores`
    (flat), `candidate_ids`, `pool_positions`, `live_cols`; with sparse logits
    `compact_logits` and `compact_topk`. Absent buffers are None.
    """

    def __init__(
        self,
        config: IndexerConfig,
        device: torch.device | str,
        *,
        buffers: StaticBuffers | None = None,
    ) -> None:
        """`buffers`: the `StaticBuffers` that owns the scratch (names prefixed
        "workspace."), so one owner holds everything a graph reads; None: the workspace's own."""
        if not isinstance(config, IndexerConfig):
            raise ValueError(f"config must be an IndexerConfig, got {type(config).__name__}")
        self.config = config
        self.device = torch.device(device)
        if buffers is not None and buffers.device != self.device:
            raise ValueError(f"buffers live on {buffers.device}, the workspace on {self.device}")
        static = buffers if buffers is not None else StaticBuffers(self.device)
        tokens = config.max_num_batched_tokens
        width = config.logits_width
        self.decode_rows = min(tokens, config.max_num_seqs * config.next_n)
        # Row alignment adds at most ROW_ALIGN - 1 elements per row to a view.
        self.prefill_elements = max(config.max_logits_bytes, FLOAT32_BYTES * width) // (
            FLOAT32_BYTES
        ) + tokens * (ROW_ALIGN - 1)

        def buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return static.add(f"workspace.{name}", shape, dtype, fill=None)

        self.decode_logits = buffer(
            "decode_logits", (self.decode_rows * aligned(width),), torch.float32
        )
        self.prefill_logits = buffer("prefill_logits", (self.prefill_elements,), torch.float32)

        self.block_scores: torch.Tensor | None = None
        self.candidate_ids: torch.Tensor | None = None
        self.pool_positions: torch.Tensor | None = None
        self.live_cols: torch.Tensor | None = None
        if config.has_candidates:
            size = config.candidate_block_size
            pool_blocks = config.candidate_topk_blocks
            block_elements = max(
                self.decode_rows * aligned(cdiv(width, size)),
                cdiv(self.prefill_elements + tokens * (size - 1), size) + tokens * ROW_ALIGN,
            )
            self.block_scores = buffer("block_scores", (block_elements,), torch.float32)
            self.candidate_ids = buffer("candidate_ids", (tokens, pool_blocks), torch.int32)
            self.pool_positions = buffer("pool_positions", (tokens, pool_blocks), torch.int32)
            self.live_cols = buffer("live_cols", (tokens,), torch.int32)

        self.consumer_rows = consumer_rows_per_launch(config)
        self.compact_rows = 0
        self.compact_logits: torch.Tensor | None = None
        self.compact_topk: torch.Tensor | None = None
        if self.consumer_rows:
            self.compact_rows = max(self.decode_rows, self.consumer_rows)
            self.compact_logits = buffer(
                "compact_logits", (self.compact_rows, config.num_candidate_cols), torch.float32
            )
            self.compact_topk = buffer(
                "compact_topk", (self.compact_rows, config.topk_tokens), torch.int32
            )

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every allocated buffer by name."""
        names = (
            "decode_logits",
            "prefill_logits",
            "block_scores",
            "candidate_ids",
            "pool_positions",
            "live_cols",
            "compact_logits",
            "compact_topk",
        )
        found = {name: getattr(self, name) for name in names}
        return {name: tensor for name, tensor in found.items() if tensor is not None}

    def total_bytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(t.numel() * t.element_size() for t in self.buffers().values())

    # Views. Each raises ValueError when the request exceeds what the config sized for.
    def decode_logits_view(self, rows: int, width: int | None = None) -> torch.Tensor:
        """float32 `[rows, width]`, rows `aligned(width)` apart (`width` None means
        `logits_width`)."""
        self._check_rows("decode rows", rows, self.decode_rows)
        full = self.config.logits_width
        width = full if width is None else width
        if not 0 < width <= full:
            raise ValueError(f"decode width = {width} must be in [1, logits_width = {full}]")
        return _rows(self.decode_logits, rows, width)

    def prefill_logits_view(self, rows: int, width: int) -> torch.Tensor:
        """float32 `[rows, width]` over the flat prefill buffer, rows `aligned(width)` apart."""
        if rows * aligned(width) > self.prefill_elements:
            raise ValueError(
                f"prefill chunk of {rows} rows x {width} columns exceeds the workspace's "
                f"{self.prefill_elements} logits (max_logits_bytes "
                f"{self.config.max_logits_bytes}): the chunk was not split for this config"
            )
        return _rows(self.prefill_logits, rows, width)

    def block_scores_view(self, rows: int, width: int) -> torch.Tensor:
        """float32 `[rows, ceil(width / C)]` over the flat block-score buffer, rows aligned."""
        scores = self._need("block_scores", self.block_scores)
        blocks = cdiv(width, self.config.candidate_block_size)
        if rows * aligned(blocks) > scores.shape[0]:
            raise ValueError(
                f"{rows} rows x {blocks} blocks exceed the workspace's {scores.shape[0]} "
                "block scores"
            )
        return _rows(scores, rows, blocks)

    def compact_views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(compact logits float32 [rows, Wc], compact top-k int32 [rows, topk_tokens])`."""
        logits = self._need("compact_logits", self.compact_logits)
        topk = self._need("compact_topk", self.compact_topk)
        self._check_rows("compact rows", rows, self.compact_rows)
        return logits[:rows], topk[:rows]

    def pool(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(candidate_ids, pool_positions, live_cols)` of step rows `[start, end)`."""
        ids = self._need("candidate_ids", self.candidate_ids)
        positions = self._need("pool_positions", self.pool_positions)
        live = self._need("live_cols", self.live_cols)
        self._check_rows("step rows", end, ids.shape[0])
        return ids[start:end], positions[start:end], live[start:end]

    def _need(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor:
        if tensor is None:
            raise ValueError(
                f"the workspace has no {name}: config has candidate_block_size = "
                f"{self.config.candidate_block_size}, sparse_logits = "
                f"{self.config.sparse_logits}"
            )
        return tensor

    @staticmethod
    def _check_rows(what: str, rows: int, capacity: int) -> None:
        if rows > capacity:
            raise ValueError(f"{what} = {rows} exceed the workspace's {capacity}")
