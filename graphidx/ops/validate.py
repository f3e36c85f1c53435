"""Argument checks shared by the public op wrappers (docs/contract.md sections 5 and 9).

Every check here reads only tensor metadata (dtype, device, shape, strides) and host ints, so
the wrappers can run them inside a captured step without a host sync. The one exception is
`check_block_table`, which reads device values; it is opt-in and documented as a host sync.

Each failure raises `ValueError` naming the argument and the offending value.
"""

from __future__ import annotations

import torch

from graphidx.config import cdiv
from graphidx.mxfp4 import CacheLayout, cache_layout, check_kv_cache

# e2m1 codes per value byte and elements per e8m0 scale (docs/contract.md section 4).
ELEMENTS_PER_BYTE = 2
ELEMENTS_PER_SCALE = 32


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return f"{value!r} ({type(value).__name__})"


def check_tensor(
    name: str,
    tensor: object,
    *,
    dtype: torch.dtype,
    rank: int | None,
    device: torch.device | None = None,
    shape: tuple[int | None, ...] | None = None,
) -> torch.Tensor:
    """Check dtype, rank (None = any), device, the known dims of `shape` (None = any) and
    that the last dim is contiguous (stride 1 when it has more than one element)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {_describe(tensor)}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if rank is not None and tensor.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D, got shape {tuple(tensor.shape)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} (the device of q)")
    if shape is not None and not _shape_matches(tensor.shape, shape):
        _raise_shape(name, tensor.shape, shape)
    if tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dim, got strides {tensor.stride()}"
        )
    return tensor


def check_kind(
    name: str, value: object, *, rank: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A `rank`-D `dtype` tensor on `device`; any mismatch raises one ValueError,
    `{name} must be a {rank}-D {dtype} tensor on {device}, got {its dtype, shape, device}`."""
    if (
        isinstance(value, torch.Tensor)
        and value.dim() == rank
        and value.dtype == dtype
        and value.device == device
    ):
        return value
    if isinstance(value, torch.Tensor):
        got = f"{value.dtype} {tuple(value.shape)} on {value.device}"
    else:
        got = type(value).__name__
    kind = str(dtype).removeprefix("torch.")
    raise ValueError(f"{name} must be a {rank}-D {kind} tensor on {device}, got {got}")


def _shape_matches(got: torch.Size, want: tuple[int | None, ...]) -> bool:
    """Every known dim of `want` equals `got`'s (and the ranks agree): the hot path of every
    op wrapper, kept to one plain loop."""
    if len(got) != len(want):
        return False
    for size, expected in zip(got, want, strict=True):
        if expected is not None and size != expected:
            return False
    return True


def _raise_shape(name: str, got: torch.Size, want: tuple[int | None, ...]) -> None:
    expected = tuple("*" if w is None else w for w in want)
    for axis, (size, dim) in enumerate(zip(got, want, strict=False)):
        if dim is not None and size != dim:
            raise ValueError(
                f"{name} must have shape {expected}, got {tuple(got)} "
                f"(dim {axis} is {size}, expected {dim})"
            )
    raise ValueError(f"{name} must have shape {expected}, got {tuple(got)}")


def check_int32(
    name: str, tensor: object, shape: tuple[int | None, ...], device: torch.device | None = None
) -> torch.Tensor:
    """An int32 index tensor of rank len(shape) with the known dims of `shape` (None = any),
    on `device` when given (the checks of `check_tensor`)."""
    return check_tensor(
        name, tensor, dtype=torch.int32, rank=len(shape), device=device, shape=shape
    )


def check_rows(name: str, tensor: object, rows: int, device: torch.device) -> torch.Tensor:
    """An int32 `[rows]` tensor on `device`."""
    return check_int32(name, tensor, (rows,), device)


def check_int(name: str, value: object, *, minimum: int) -> int:
    """A Python int (not bool) >= minimum."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {_describe(value)}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {_describe(value)}")
    return value


def check_mxfp4_query(
    q: object, q_scale: object, weights: object
) -> tuple[int, int, int, torch.device]:
    """Check MXFP4 Q and its head weights; returns `(rows, num_heads, head_dim, device)`.

    q uint8 `[rows, H, D/2]`, q_scale uint8 `[rows, H, D/32]`, weights float32 `[rows, H]`,
    all on q's device, with D a positive multiple of 32.
    """
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q must be a tensor, got {_describe(q)}")
    check_tensor("q", q, dtype=torch.uint8, rank=3)
    rows, num_heads, value_bytes = q.shape
    head_dim = value_bytes * ELEMENTS_PER_BYTE
    if head_dim == 0 or head_dim % ELEMENTS_PER_SCALE:
        raise ValueError(
            f"q's last dim ({value_bytes} bytes, head_dim {head_dim}) must make head_dim a "
            f"positive multiple of {ELEMENTS_PER_SCALE}"
        )
    if num_heads == 0:
        raise ValueError(f"q must have at least one head, got shape {tuple(q.shape)}")
    check_tensor(
        "q_scale",
        q_scale,
        dtype=torch.uint8,
        rank=3,
        device=q.device,
        shape=(rows, num_heads, head_dim // ELEMENTS_PER_SCALE),
    )
    check_tensor(
        "weights", weights, dtype=torch.float32, rank=2, device=q.device, shape=(rows, num_heads)
    )
    return rows, num_heads, head_dim, q.device


def resolve_cache_layout(
    kv_cache: object,
    num_heads: int,
    head_dim: int,
    page_entries: int | None,
    device: torch.device,
) -> CacheLayout:
    """The cache layout for these heads; `page_entries=None` means page_stride // entry_bytes.

    kv_cache must be uint8 `[num_pages >= 1, page_stride]` on `device`, last dim contiguous,
    page_stride at least the layout's page_bytes.
    """
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, rank=2, device=device)
    assert isinstance(kv_cache, torch.Tensor)
    if kv_cache.shape[0] == 0:
        raise ValueError(f"kv_cache has no pages, got shape {tuple(kv_cache.shape)}")
    entry_bytes = head_dim // ELEMENTS_PER_BYTE + head_dim // ELEMENTS_PER_SCALE
    if page_entries is None:
        page_entries = kv_cache.shape[1] // entry_bytes
        if page_entries == 0:
            raise ValueError(
                f"kv_cache page stride {kv_cache.shape[1]} holds no entry of {entry_bytes} bytes"
            )
    check_int("page_entries", page_entries, minimum=1)
    try:
        layout = cache_layout(num_heads, head_dim, page_entries)
    except ValueError as err:
        raise ValueError(
            f"page_entries {page_entries} cannot be tiled for {num_heads} heads of "
            f"{head_dim}: {err}"
        ) from err
    check_kv_cache(kv_cache, layout)
    return layout


def check_row_grouping(
    rows: int,
    context_lens: object,
    block_table: object,
    query_start_loc: object,
    next_n: object,
    device: torch.device,
) -> int:
    """Check the row grouping of docs/contract.md section 5 and return the number of sequences.

    query_start_loc int32 `[num_seqs + 1]`; next_n an int >= 1 dividing rows; neither means
    one row per seq. context_lens int32 `[num_seqs]`, block_table int32
    `[num_seqs, max_blocks]`. Giving both query_start_loc and next_n is an error.
    """
    if query_start_loc is not None and next_n is not None:
        raise ValueError(
            f"query_start_loc and next_n are exclusive row groupings; got both (next_n={next_n!r})"
        )
    if query_start_loc is not None:
        check_int32("query_start_loc", query_start_loc, (None,), device)
        assert isinstance(query_start_loc, torch.Tensor)
        if query_start_loc.shape[0] == 0:
            raise ValueError("query_start_loc must have num_seqs + 1 >= 1 entries, got 0")
        num_seqs = query_start_loc.shape[0] - 1
    elif next_n is not None:
        check_int("next_n", next_n, minimum=1)
        assert isinstance(next_n, int)
        if rows % next_n:
            raise ValueError(f"next_n={next_n} does not divide the {rows} query rows")
        num_seqs = rows // next_n
    else:
        num_seqs = rows
    check_rows("context_lens", context_lens, num_seqs, device)
    check_int32("block_table", block_table, (num_seqs, None), device)
    return num_seqs


def check_paged_query(
    q: object,
    q_scale: object,
    kv_cache: object,
    weights: object,
    context_lens: object,
    block_table: object,
    query_start_loc: object,
    next_n: object,
    page_entries: int | None,
) -> tuple[int, CacheLayout, torch.device]:
    """The operands every paged logits op reads, checked in this order: the MXFP4 query
    (`check_mxfp4_query`), the paged cache it reads (`resolve_cache_layout`) and the row
    grouping into seqs (`check_row_grouping`); returns `(rows, layout, q's device)`."""
    rows, num_heads, head_dim, device = check_mxfp4_query(q, q_scale, weights)
    layout = resolve_cache_layout(kv_cache, num_heads, head_dim, page_entries, device)
    check_row_grouping(rows, context_lens, block_table, query_start_loc, next_n, device)
    return rows, layout, device


def check_block_table(
    block_table: torch.Tensor,
    num_pages: int,
    *,
    context_lens: torch.Tensor | None = None,
    page_entries: int | None = None,
) -> None:
    """Opt-in range check of page ids: HOST SYNC (reads the block table back).

    Without `context_lens`, every entry of block_table int32 `[num_seqs, max_blocks]` must
    lie in `[0, num_pages)`. With `context_lens` int32 `[num_seqs]` and `page_entries`, only
    the columns a seq reads (`ceil(context_len / page_entries)`) are checked, and those
    columns must exist. The ops themselves never range-check or clamp page ids (that would be
    a host sync per launch); callers validate block tables once, where they come in (tests,
    StepBatch construction), with this helper. Raises ValueError naming the seq and column.
    """
    check_int("num_pages", num_pages, minimum=1)
    check_int32("block_table", block_table, (None, None))
    num_seqs, max_blocks = block_table.shape
    if context_lens is None:
        needed = torch.full((num_seqs,), max_blocks, dtype=torch.int64)
    else:
        if page_entries is None:
            raise ValueError("check_block_table: context_lens given without page_entries")
        check_int("page_entries", page_entries, minimum=1)
        check_int32("context_lens", context_lens, (num_seqs,))
        lens = context_lens.detach().to("cpu", torch.int64)
        if bool((lens < 0).any()):
            seq = int(torch.nonzero(lens < 0)[0, 0])
            raise ValueError(f"context_lens[{seq}] = {int(lens[seq])} is negative")
        needed = (lens + page_entries - 1) // page_entries
        if num_seqs and int(needed.max()) > max_blocks:
            seq = int(torch.argmax(needed))
            raise ValueError(
                f"block_table has {max_blocks} columns but seq {seq} (context_len "
                f"{int(lens[seq])}) needs {int(needed[seq])} pages of {page_entries} entries"
            )
    table = block_table.detach().to("cpu", torch.int64)
    used = torch.arange(max_blocks).unsqueeze(0) < needed.unsqueeze(1)
    bad = used & ((table < 0) | (table >= num_pages))
    if bool(bad.any()):
        seq, col = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"block_table[{seq}, {col}] = {int(table[seq, col])} points outside the cache "
            f"of {num_pages} pages"
        )


def check_block_scores(
    block_scores: object,
    candidate_block_size: object,
    rows: int,
    width: int,
    device: torch.device,
) -> None:
    """block_scores float32 `[rows, NB]` with NB >= ceil(width / C), C >= 1."""
    check_int("candidate_block_size", candidate_block_size, minimum=1)
    assert isinstance(candidate_block_size, int)
    check_tensor(
        "block_scores", block_scores, dtype=torch.float32, rank=2, device=device, shape=(rows, None)
    )
    assert isinstance(block_scores, torch.Tensor)
    need = cdiv(width, candidate_block_size)
    if block_scores.shape[1] < need:
        raise ValueError(
            f"block_scores has {block_scores.shape[1]} columns, fewer than "
            f"ceil({width} / {candidate_block_size}) = {need}"
        )
