"""Context parallel: one indexer over a K cache sharded across ranks (docs/contract.md section 10).

The contract. `W = world_size` ranks share one indexer's K cache. Positions are indexer
positions (compressed entries, the columns of a logits row). Rank `r` holds the positions `p`
with `(p // S) % W == r`, `S = interleave`: runs of `S` positions dealt round-robin over the
ranks. On its rank, position `p` has the *local index* `(p // (S * W)) * S + p % S`, so a
rank's positions form the dense range `[0, n_local)` of an ordinary paged cache with the
config's page_entries and layout; the map is increasing, so local order is global order.
`S` must be a multiple of the candidate block size `C` (a candidate block lives on one rank,
at a local index that is a multiple of `C`, so it stays within one page and one tile as it
does on one rank). `ContextParallel.check(config)` refuses configurations that break this.

Each rank scores only its positions: its row ends and context lengths are
`local_lengths(ctx, global_ones)`, computed on the device. It keeps a local top-k of (score,
global position) pairs (`local_topk`, k = the global k: a rank may hold all k winners), the
ranks exchange them (`exchange_topk`, one all-gather through `torch.distributed`) and every
rank merges them (`merge_topk`) into the same global top-k. Selection everywhere follows one
total order: the larger score first, ties to the smaller global position; -inf scores and -1
positions are never picked. Under that order the merge equals the single-rank top-k exactly
(every global winner on rank r is among rank r's local winners) and is identical on every
rank. NaN scores are not valid input (as in section 5.2).

Everything on tensors is torch ops with no host sync (graph-capturable); sizes come from
shapes and the host-side `ContextParallel`. Positions must stay below 2**31.
`IndexerConfig`'s dcp fields describe the sharding (`ContextParallel.from_config`). The
metadata builder computes each rank's row ends and context lengths; every layer takes a
`ContextParallelGroup` (this rank's view and its process group) and runs `sharded_topk` in
place of its single-rank top-k. Two-level stacks: candidate blocks are sharded like positions
(`ContextParallel.blocks`); the source's block scores are the single-rank ones once
`unpin_foreign_newest_block` gives a rank's pinned block its real score unless the rank holds
the row's newest key, and its candidate top-k is `sharded_topk` over blocks (global block
ids, the same pool on every rank); a consumer scores its rank's part of the pool and merges
compact columns by their global positions (`sharded_topk_at`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from graphidx.config import IndexerConfig
from graphidx.mxfp4 import CacheLayout, cache_layout
from graphidx.ops.backend import run_op
from graphidx.ops.validate import check_int, check_tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ContextParallel",
    "ContextParallelGroup",
    "exchange_topk",
    "global_positions",
    "local_lengths",
    "local_positions",
    "local_topk",
    "local_topk_at",
    "merge_topk",
    "sharded_topk",
    "sharded_topk_at",
    "unpin_foreign_newest_block",
]

_INT_DTYPES = (torch.int32, torch.int64)
_TWO_32 = 2**32
# Below every real selection key: the key of an entry that must never be picked.
_NONE_KEY = torch.iinfo(torch.int64).min


def _positive_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class ContextParallel:
    """One rank's view of a context-parallel indexer: `world_size` ranks (W), this `rank`
    (0 <= rank < W) and the `interleave` S (positions per run dealt to one rank)."""

    world_size: int = 1
    rank: int = 0
    interleave: int = 1

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size, 1)
        _positive_int("interleave", self.interleave, 1)
        if not isinstance(self.rank, int) or isinstance(self.rank, bool):
            raise ValueError(f"rank must be an int, got {self.rank!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must satisfy 0 <= rank < world_size = {self.world_size}, got {self.rank}"
            )

    @classmethod
    def from_config(cls, config: IndexerConfig) -> ContextParallel:
        """This rank's view from the config's dcp fields, checked against the config
        (`check`)."""
        cp = cls(config.dcp_world_size, config.dcp_rank, config.dcp_interleave_size)
        cp.check(config)
        return cp

    @property
    def span(self) -> int:
        """Positions in one round of runs over all ranks: S * W."""
        return self.interleave * self.world_size

    def blocks(self, candidate_block_size: int) -> ContextParallel:
        """The same sharding over candidate blocks: block `b` (positions `[b C, (b + 1) C)`)
        lives on rank `(b // (S / C)) % W`, at the local block index its positions' local
        indices divide to. Needs S to be a multiple of C."""
        c = _positive_int("candidate_block_size", candidate_block_size, 1)
        if self.interleave % c:
            raise ValueError(
                f"interleave = {self.interleave} must be a multiple of candidate_block_size = "
                f"{c} (a candidate block must live on one rank)"
            )
        return ContextParallel(self.world_size, self.rank, self.interleave // c)

    def local_count(self, n: int) -> int:
        """Host ints: how many of the positions [0, n) this rank holds (static sizes, such as
        the local logits width `local_count(config.logits_width)`; rank 0 holds the most)."""
        n = max(0, n)
        full, rem = divmod(n, self.span)
        return full * self.interleave + min(
            max(rem - self.rank * self.interleave, 0), self.interleave
        )

    def check(self, config: IndexerConfig) -> CacheLayout:
        """Refuse a config this sharding cannot serve; returns the (rank-local) cache layout.

        The interleave must be a multiple of candidate_block_size (a candidate block on one
        rank), and the rank-local cache, an ordinary paged cache of page_entries entries per
        page, must be tileable: `cache_layout` accepts page_entries, and under sparse logits
        a candidate block fits one tile (C divides n_per_tile).
        """
        if not isinstance(config, IndexerConfig):
            raise ValueError(f"config must be an IndexerConfig, got {type(config).__name__}")
        c, s = config.candidate_block_size, self.interleave
        if c and s % c:
            raise ValueError(
                f"interleave = {s} must be a multiple of candidate_block_size = {c} "
                "(a candidate block must live on one rank)"
            )
        try:
            layout = cache_layout(config.num_heads, config.head_dim, config.page_entries)
        except ValueError as err:
            raise ValueError(
                f"page_entries = {config.page_entries} (block_size {config.block_size} // "
                f"compress_ratio {config.compress_ratio}): the rank-local cache cannot be "
                f"tiled: {err}"
            ) from err
        if config.sparse_logits and layout.n_per_tile % c:
            raise ValueError(
                f"candidate_block_size = {c} must divide the cache layout's n_per_tile = "
                f"{layout.n_per_tile} (one candidate block within one tile of the rank-local "
                "cache)"
            )
        return layout


def _check_ctx(ctx: object) -> ContextParallel:
    if not isinstance(ctx, ContextParallel):
        raise ValueError(f"ctx must be a ContextParallel, got {type(ctx).__name__}")
    return ctx


def _check_int_tensor(name: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _INT_DTYPES:
        got = f"{tensor.dtype} tensor" if isinstance(tensor, torch.Tensor) else repr(tensor)
        raise ValueError(f"{name} must be an int32 or int64 tensor, got {got}")
    return tensor


def local_positions(ctx: ContextParallel, positions: torch.Tensor) -> torch.Tensor:
    """Local index of each global position on `ctx.rank`; -1 where the position is negative
    or held by another rank. Same shape, dtype and device as `positions`."""
    _check_ctx(ctx)
    _check_int_tensor("positions", positions)
    s, w, r = ctx.interleave, ctx.world_size, ctx.rank
    p = positions.to(torch.int64)
    owned = (p >= 0) & (torch.remainder(torch.div(p, s, rounding_mode="floor"), w) == r)
    local = torch.div(p, s * w, rounding_mode="floor") * s + torch.remainder(p, s)
    return torch.where(owned, local, -1).to(positions.dtype)


def global_positions(ctx: ContextParallel, local: torch.Tensor) -> torch.Tensor:
    """Global position of each local index of `ctx.rank`; -1 where the index is negative.
    Same shape, dtype and device as `local`. Inverse of `local_positions` on owned ones."""
    _check_ctx(ctx)
    _check_int_tensor("local", local)
    s, w, r = ctx.interleave, ctx.world_size, ctx.rank
    q = local.to(torch.int64)
    glob = torch.div(q, s, rounding_mode="floor") * (s * w) + r * s + torch.remainder(q, s)
    return torch.where(q >= 0, glob, -1).to(local.dtype)


def local_lengths(ctx: ContextParallel, lengths: torch.Tensor) -> torch.Tensor:
    """How many of the positions [0, L) `ctx.rank` holds, for each L of `lengths` (negative
    counts as 0). The rank's row ends and context lengths from the global ones, on the
    device. Same shape, dtype and device as `lengths`."""
    _check_ctx(ctx)
    _check_int_tensor("lengths", lengths)
    s, span, r = ctx.interleave, ctx.span, ctx.rank
    n = lengths.to(torch.int64).clamp(min=0)
    full = torch.div(n, span, rounding_mode="floor")
    rem = n - full * span
    return (full * s + (rem - r * s).clamp(0, s)).to(lengths.dtype)


def _selection_keys(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One int64 key per (score, position) whose order is the selection order: larger score
    first, then smaller position; an entry that is never picked gets `_NONE_KEY`."""
    # +0.0 turns -0.0 into +0.0, so that the two zeros tie as they do for torch.topk.
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)
    # Negative floats: flipping all but the sign bit makes the int order the float order.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    pos = positions.to(torch.int64)
    key = ordered * _TWO_32 + (_TWO_32 - 1 - pos)
    valid = (pos >= 0) & (scores != float("-inf"))
    return torch.where(valid, key, _NONE_KEY)


def _select(keys: torch.Tensor, k: int, out: torch.Tensor, out_scores: torch.Tensor | None) -> None:
    """The k largest keys of each row of `keys` `[rows, n]`, in order, decoded into `out`
    (positions, -1 padded) and `out_scores` (-inf padded)."""
    picked = min(k, keys.shape[1])
    if picked > 0:
        top = torch.topk(keys, picked, dim=1, largest=True, sorted=True).values
        none = top == _NONE_KEY
        pos = (_TWO_32 - 1) - torch.remainder(top, _TWO_32)
        out[:, :picked] = torch.where(none, -1, pos).to(torch.int32)
        if out_scores is not None:
            ordered = torch.div(top, _TWO_32, rounding_mode="floor")
            bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(torch.int32)
            values = bits.view(torch.float32)
            out_scores[:, :picked] = torch.where(none, float("-inf"), values)
    out[:, picked:] = -1
    if out_scores is not None:
        out_scores[:, picked:] = float("-inf")


def _check_outputs(
    rows: int, k: int, out: object, out_scores: object, device: torch.device
) -> None:
    check_int("k", k, minimum=1)
    check_tensor("out", out, dtype=torch.int32, rank=2, device=device, shape=(rows, k))
    if out_scores is not None:
        check_tensor(
            "out_scores", out_scores, dtype=torch.float32, rank=2, device=device, shape=(rows, k)
        )


def local_topk(
    ctx: ContextParallel,
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    out_scores: torch.Tensor | None = None,
) -> None:
    """A rank's local top-k in the selection order, as global positions.

    logits float32 `[rows, width]` over the rank's local indices; lengths int32 `[rows]`
    local row ends (`local_lengths` of the global ones; clamped to [0, width]). Writes `out`
    int32 `[rows, k]`: the global positions of the k best of `logits[r, :length]`, best
    first, -1 padded; and `out_scores` float32 `[rows, k]` (optional): their scores, -inf
    padded. Local column order is global order, so ties go to the smaller global position.
    """
    _check_ctx(ctx)
    check_tensor("logits", logits, dtype=torch.float32, rank=2)
    rows, width = logits.shape
    device = logits.device
    check_tensor("lengths", lengths, dtype=torch.int32, rank=1, device=device, shape=(rows,))
    _check_outputs(rows, k, out, out_scores, device)
    if rows == 0:
        return
    cols = torch.arange(width, device=device, dtype=torch.int64)
    glob = global_positions(ctx, cols).unsqueeze(0)
    visible = cols.unsqueeze(0) < lengths.to(torch.int64).unsqueeze(1)
    keys = torch.where(visible, _selection_keys(logits, glob), _NONE_KEY)
    _select(keys, k, out, out_scores)


def local_topk_at(
    logits: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    out_scores: torch.Tensor | None = None,
) -> None:
    """`local_topk` over columns whose global positions are given: positions int32
    `[rows, width]` (-1: a column never picked), logits float32 `[rows, width]`, lengths
    int32 `[rows]` (columns past a row's length are never picked). Writes `out` (and
    `out_scores`) as `local_topk` does, in the selection order of (score, position)."""
    check_tensor("logits", logits, dtype=torch.float32, rank=2)
    rows, width = logits.shape
    device = logits.device
    check_tensor(
        "positions", positions, dtype=torch.int32, rank=2, device=device, shape=(rows, width)
    )
    check_tensor("lengths", lengths, dtype=torch.int32, rank=1, device=device, shape=(rows,))
    _check_outputs(rows, k, out, out_scores, device)
    if rows == 0:
        return
    cols = torch.arange(width, device=device, dtype=torch.int64).unsqueeze(0)
    visible = cols < lengths.to(torch.int64).unsqueeze(1)
    keys = torch.where(visible, _selection_keys(logits, positions), _NONE_KEY)
    _select(keys, k, out, out_scores)


def merge_topk(
    scores: torch.Tensor,
    positions: torch.Tensor,
    k: int,
    out: torch.Tensor,
    out_scores: torch.Tensor | None = None,
) -> None:
    """Merge the W ranks' local top-k candidates into the global top-k, on every rank alike.

    scores float32 `[W, rows, kl]` (-inf = none) and positions int32 `[W, rows, kl]` (global,
    -1 = none; a position appears at most once per row); `exchange_topk` returns them.
    Writes `out` int32 `[rows, k]`: per row the k best candidates in the selection order
    (larger score first, ties to the smaller position), best first, -1 padded; and
    `out_scores` float32 `[rows, k]` (optional): their scores, -inf padded (-0.0 ties with
    and comes back as +0.0).
    """
    check_tensor("scores", scores, dtype=torch.float32, rank=3)
    w, rows, kl = scores.shape
    device = scores.device
    check_tensor(
        "positions", positions, dtype=torch.int32, rank=3, device=device, shape=(w, rows, kl)
    )
    _check_outputs(rows, k, out, out_scores, device)
    if rows == 0:
        return
    keys = _selection_keys(scores, positions).permute(1, 0, 2).reshape(rows, w * kl)
    _select(keys, k, out, out_scores)


def _group_size(group: ProcessGroup | None) -> int:
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size(group))


def _all_gather(out: torch.Tensor, inp: torch.Tensor, w: int, group: ProcessGroup | None) -> None:
    """All-gather `inp` `[rows, n]` of the `w` ranks into `out` `[w * rows, n]`, by rank."""
    dist = torch.distributed
    single = getattr(dist, "all_gather_single", None) or getattr(
        dist, "all_gather_into_tensor", None
    )
    if single is not None:
        try:
            single(out, inp, group=group)
            return
        except RuntimeError:
            # Older gloo builds lack the single-tensor all-gather (and refuse it on every rank
            # before communicating); gloo runs are never captured, so falling back is safe.
            if dist.get_backend(group) != "gloo":
                raise
    dist.all_gather(list(out.view(w, *inp.shape).unbind(0)), inp, group=group)


# The all-gather runs as one custom op (so a capture records it as one entry whose body,
# the collective and its wait, runs again at replay). An op's schema cannot carry a process
# group, so the op names it by a key: "" for the default group, else the group's name.
_GROUPS: dict[str, ProcessGroup | None] = {"": None}


def _group_key(group: ProcessGroup | None) -> str:
    """The key the exchange op resolves `group` by (the group registered under it)."""
    if group is None:
        return ""
    key = str(group.group_name)
    _GROUPS[key] = group
    return key


def _all_gather_body(out: torch.Tensor, inp: torch.Tensor, group_key: str) -> None:
    group = _GROUPS[group_key]
    _all_gather(out, inp, _group_size(group), group)


_all_gather_op = torch.library.custom_op(
    "graphidx::dcp_all_gather", _all_gather_body, mutates_args=("out",)
)


def exchange_topk(
    local_scores: torch.Tensor,
    local_positions: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    ctx: ContextParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather every rank's local top-k: `[rows, k]` float32 scores and int32 global
    positions in, `[W, rows, k]` scores and positions out (indexed by rank in `group`).

    One collective (the two tensors travel packed as int32) through `torch.distributed` on
    `group` (None = the default group): NCCL/RCCL on GPUs, gloo on CPUs, as one custom op
    (`graphidx::dcp_all_gather`) that a capture records as one entry, the collective and
    its wait inside. With W = 1 (one rank, or torch.distributed not initialized) it returns
    views of the inputs and does not communicate. `ctx`, when given, must match the group's
    size and this rank's place in it.
    """
    check_tensor("local_scores", local_scores, dtype=torch.float32, rank=2)
    rows, k = local_scores.shape
    device = local_scores.device
    check_tensor(
        "local_positions",
        local_positions,
        dtype=torch.int32,
        rank=2,
        device=device,
        shape=(rows, k),
    )
    w = _group_size(group)
    if ctx is not None:
        _check_ctx(ctx)
        rank = torch.distributed.get_rank(group) if w > 1 else 0
        if (ctx.world_size, ctx.rank) != (w, rank):
            raise ValueError(
                f"ctx has world_size {ctx.world_size} and rank {ctx.rank}, but the group has "
                f"{w} ranks and this process is rank {rank}"
            )
    if w == 1:
        return local_scores.unsqueeze(0), local_positions.unsqueeze(0)
    if rows == 0:
        # Every rank of a step has the same shapes, so every rank skips alike.
        return local_scores.new_empty((w, 0, k)), local_positions.new_empty((w, 0, k))
    packed = torch.cat([local_scores.view(torch.int32), local_positions], dim=1)
    gathered = torch.empty((w * rows, 2 * k), dtype=torch.int32, device=device)
    run_op(
        torch.ops.graphidx.dcp_all_gather, _all_gather_body, gathered, packed.contiguous(),
        _group_key(group),
    )  # fmt: skip
    both = gathered.view(w, rows, 2 * k)
    return both[:, :, :k].view(torch.float32), both[:, :, k:]


def _group_rank(group: ProcessGroup | None) -> int:
    return int(torch.distributed.get_rank(group))


@dataclass(frozen=True)
class ContextParallelGroup:
    """What a layer needs to exchange its top-k across the ranks: this rank's `ctx` and the
    `torch.distributed` process group of its `ctx.world_size` ranks (None: the default group).

    Checked once at construction (so no step pays for it): with world_size > 1
    torch.distributed must be initialized, the group must have world_size ranks and this
    process must be rank `ctx.rank` in it. With world_size 1 nothing is communicated.
    """

    ctx: ContextParallel
    group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        _check_ctx(self.ctx)
        if self.ctx.world_size == 1:
            return
        dist = torch.distributed
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                f"ctx.world_size = {self.ctx.world_size} needs an initialized torch.distributed "
                "process group (torch.distributed.init_process_group)"
            )
        w, rank = _group_size(self.group), _group_rank(self.group)
        if (w, rank) != (self.ctx.world_size, self.ctx.rank):
            raise ValueError(
                f"ctx has world_size {self.ctx.world_size} and rank {self.ctx.rank}, but the "
                f"group has {w} ranks and this process is rank {rank}"
            )

    def check(self, config: IndexerConfig) -> None:
        """Refuse a group whose sharding is not the config's (`ContextParallel.from_config`)."""
        want = ContextParallel.from_config(config)
        if self.ctx != want:
            raise ValueError(
                f"dcp has {self.ctx}, but the config's dcp fields give {want} "
                f"(dcp_world_size = {config.dcp_world_size}, dcp_rank = {config.dcp_rank}, "
                f"interleave {config.dcp_interleave_size})"
            )


def exchange_group(
    config: IndexerConfig, dcp: object, where: str = ""
) -> ContextParallelGroup | None:
    """The group a config's layers exchange through: None on one rank (the single-rank path;
    a `dcp` given there must have world size 1), else `dcp`, which must be this rank's
    `ContextParallelGroup` with the config's sharding (`ContextParallelGroup.check`).
    ValueError otherwise, its message led by `where` ("where: ") when given."""
    lead = f"{where}: " if where else ""
    if dcp is not None and not isinstance(dcp, ContextParallelGroup):
        raise ValueError(
            f"{lead}dcp must be a ContextParallelGroup or None, got {type(dcp).__name__}"
        )
    if config.dcp_world_size == 1:
        if dcp is not None and dcp.ctx.world_size != 1:
            raise ValueError(
                f"{lead}dcp has world_size {dcp.ctx.world_size} but config.dcp_world_size is 1"
            )
        return None
    if dcp is None:
        raise ValueError(
            f"{lead}config.dcp_world_size = {config.dcp_world_size}: dcp must be a "
            "ContextParallelGroup (this rank and its process group), got None"
        )
    dcp.check(config)
    return dcp


def _check_group(dcp: object) -> ContextParallelGroup:
    if not isinstance(dcp, ContextParallelGroup):
        raise ValueError(f"dcp must be a ContextParallelGroup, got {type(dcp).__name__}")
    return dcp


def _check_sharded(dcp: object, logits: object, k: int, out: object) -> ContextParallelGroup:
    """What both sharded top-ks check before the exchange: the group, logits float32
    `[rows, width]` and `out` int32 `[rows, k]`; returns the group."""
    group = _check_group(dcp)
    check_tensor("logits", logits, dtype=torch.float32, rank=2)
    assert isinstance(logits, torch.Tensor)
    _check_outputs(logits.shape[0], k, out, None, logits.device)
    return group


def _exchange_and_merge(
    group: ContextParallelGroup,
    local: Callable[[torch.Tensor, torch.Tensor], None],
    k: int,
    out: torch.Tensor,
) -> None:
    """`local(positions, scores)` writes this rank's `[rows, k]` candidates (rows those of
    `out`); they are exchanged across `group.group` and merged into `out`."""
    rows, device = out.shape[0], out.device
    positions = torch.empty((rows, k), dtype=torch.int32, device=device)
    scores = torch.empty((rows, k), dtype=torch.float32, device=device)
    local(positions, scores)
    all_scores, all_positions = exchange_topk(scores, positions, group.group)
    merge_topk(all_scores, all_positions, k, out)


def sharded_topk(
    dcp: ContextParallelGroup,
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    *,
    ctx: ContextParallel | None = None,
) -> None:
    """The global top-k of each row from every rank's local logits, on every rank alike.

    logits float32 `[rows, width]` over this rank's local indices, lengths int32 `[rows]`
    its local row ends (as `local_topk`). Writes `out` int32 `[rows, k]`: the global
    positions of the row's k best (larger score first, ties to the smaller position), -1
    padded, identical on every rank of `dcp.group` and equal to the single-rank top-k in that
    order. `ctx`: the map of the columns to global indices (None: `dcp.ctx`, positions; the
    candidate blocks' top-k passes `dcp.ctx.blocks(C)`). Every rank must call it with the
    same rows and k (one all-gather).
    """
    group = _check_sharded(dcp, logits, k, out)
    view = group.ctx if ctx is None else _check_ctx(ctx)
    _exchange_and_merge(group, partial(local_topk, view, logits, lengths, k), k, out)


def sharded_topk_at(
    dcp: ContextParallelGroup,
    logits: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
) -> None:
    """`sharded_topk` over columns whose global positions are given (`local_topk_at`):
    a consumer's compact logits over its part of the candidate pool. Writes `out` int32
    `[rows, k]`, identical on every rank."""
    group = _check_sharded(dcp, logits, k, out)
    _exchange_and_merge(group, partial(local_topk_at, logits, positions, lengths, k), k, out)


def unpin_foreign_newest_block(
    ctx: ContextParallel,
    logits: torch.Tensor,
    block_scores: torch.Tensor,
    local_ends: torch.Tensor,
    global_ends: torch.Tensor,
    candidate_block_size: int,
) -> None:
    """Give back its real score to a pinned block that does not hold the row's newest key.

    The logits op pins (+inf) the block of each row's newest *local* key so that the block
    top-k keeps it; on one rank that is the row's newest key, under context parallel only on
    the rank holding global position `global_end - 1`. On every other rank with a local key
    this writes the block's max over its visible logits (`[b C, min((b + 1) C, n))`, n the
    local end clamped to the logits width) in place of the pin, so that the ranks' block
    scores are the single-rank ones. logits float32 `[rows, width]`, block_scores float32
    `[rows, >= ceil(width / C)]` (in place), local_ends and global_ends int32 `[rows]`.
    """
    _check_ctx(ctx)
    c = _positive_int("candidate_block_size", candidate_block_size, 1)
    check_tensor("logits", logits, dtype=torch.float32, rank=2)
    rows, width = logits.shape
    device = logits.device
    check_tensor("block_scores", block_scores, dtype=torch.float32, rank=2, device=device)
    for name, tensor in (("local_ends", local_ends), ("global_ends", global_ends)):
        check_tensor(name, tensor, dtype=torch.int32, rank=1, device=device, shape=(rows,))
    if rows == 0 or width == 0:
        return
    n = local_ends.to(torch.int64).clamp(0, width)
    newest = global_ends.to(torch.int64) - 1
    owner = (newest >= 0) & (local_positions(ctx, newest) >= 0)
    block = ((n - 1).clamp(min=0) // c).unsqueeze(1)
    cols = block * c + torch.arange(c, device=device)
    values = logits.gather(1, cols.clamp(max=width - 1))
    real = torch.where(cols < n.unsqueeze(1), values, float("-inf")).amax(dim=1, keepdim=True)
    current = block_scores.gather(1, block)
    keep = (owner | (n == 0)).unsqueeze(1)
    block_scores.scatter_(1, block, torch.where(keep, current, real))
