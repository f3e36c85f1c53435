"""Graph keys and the padding policy: `StepShape` and the `CaptureSizes` ladder.

A captured graph is valid only for the shape it was captured at, so a step is padded up to
one of a few captured token counts and replays that graph. `StepShape` is the key: the padded
token count, the padded request count and, for a uniform decode step (every request has the
same number of query rows, `next_n` with speculative decode), that query length.
`CaptureSizes.pad` picks the key for a step, or None above the largest captured size, where
the caller runs eagerly (and records that with `GraphCache.record_eager`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

DEFAULT_MAX_SIZE = 512


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class StepShape:
    """The key of one captured graph.

    `num_tokens`: padded token (query row) count, >= 1. `num_reqs`: padded request count,
    1 <= num_reqs <= num_tokens. `uniform_query_len`: the query rows per request of a uniform
    decode step (then num_tokens == num_reqs * uniform_query_len), or None for other steps.
    Ordered by (num_tokens, num_reqs, uniform_query_len) with None before any length, so
    shapes of mixed kinds sort without error.
    """

    num_tokens: int
    num_reqs: int
    uniform_query_len: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.num_tokens) or self.num_tokens < 1:
            raise ValueError(f"num_tokens={self.num_tokens!r} must be an int >= 1")
        if not _is_int(self.num_reqs) or not 1 <= self.num_reqs <= self.num_tokens:
            raise ValueError(
                f"num_reqs={self.num_reqs!r} must be an int in [1, num_tokens={self.num_tokens}]"
            )
        q = self.uniform_query_len
        if q is not None:
            if not _is_int(q) or q < 1:
                raise ValueError(f"uniform_query_len={q!r} must be None or an int >= 1")
            if self.num_tokens != self.num_reqs * q:
                raise ValueError(
                    f"uniform_query_len={q} needs num_tokens == num_reqs * uniform_query_len, "
                    f"got num_tokens={self.num_tokens}, num_reqs={self.num_reqs}"
                )

    def sort_key(self) -> tuple[int, int, int]:
        """(num_tokens, num_reqs, uniform_query_len or 0): the order of shapes."""
        return (self.num_tokens, self.num_reqs, self.uniform_query_len or 0)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, StepShape):
            return NotImplemented
        return self.sort_key() < other.sort_key()

    def __le__(self, other: object) -> bool:
        if not isinstance(other, StepShape):
            return NotImplemented
        return self.sort_key() <= other.sort_key()

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, StepShape):
            return NotImplemented
        return self.sort_key() > other.sort_key()

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, StepShape):
            return NotImplemented
        return self.sort_key() >= other.sort_key()

    @property
    def label(self) -> str:
        """A short text form for logs and JSON, e.g. "tokens=8,reqs=4,q=2"."""
        q = "-" if self.uniform_query_len is None else str(self.uniform_query_len)
        return f"tokens={self.num_tokens},reqs={self.num_reqs},q={q}"


def default_ladder(max_size: int) -> list[int]:
    """1, 2, 4, then steps of 8 up to 256, then steps of 16, up to and including max_size."""
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, max_size + 1, 16)]
    ladder = [size for size in ladder if size <= max_size]
    if ladder[-1] != max_size:
        ladder.append(max_size)
    return ladder


class CaptureSizes:
    """The ascending ladder of captured token counts, all multiples of `uniform_query_len`.

    `sizes`: explicit token counts (positive ints, each <= max_size), or None for
    `default_ladder(max_size)`. Every size is rounded UP to a multiple of `uniform_query_len`
    (next_n), except that a size that would round above `max_size` becomes the largest
    multiple of `uniform_query_len` <= max_size; then duplicates are dropped. So every size
    is a multiple of `uniform_query_len` and `largest <= max_size`.
    """

    def __init__(
        self,
        sizes: Sequence[int] | None = None,
        *,
        max_size: int = DEFAULT_MAX_SIZE,
        uniform_query_len: int = 1,
    ) -> None:
        if not _is_int(max_size) or max_size < 1:
            raise ValueError(f"max_size={max_size!r} must be an int >= 1")
        if not _is_int(uniform_query_len) or uniform_query_len < 1:
            raise ValueError(f"uniform_query_len={uniform_query_len!r} must be an int >= 1")
        if sizes is None:
            raw = default_ladder(max_size)
        else:
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
                raise ValueError(f"sizes={sizes!r} must be a sequence of ints")
            raw = list(sizes)
            if not raw:
                raise ValueError("sizes=[] must hold at least one size")
            for size in raw:
                if not _is_int(size) or size < 1:
                    raise ValueError(f"sizes holds {size!r}; every size must be an int >= 1")
                if size > max_size:
                    raise ValueError(
                        f"sizes holds {size} > max_size={max_size}; raise max_size to capture it"
                    )
        if max_size < uniform_query_len:
            raise ValueError(
                f"max_size={max_size} is below uniform_query_len={uniform_query_len}: no "
                "uniform step fits"
            )
        self._uniform_query_len = uniform_query_len
        self._max_size = max_size
        # Round up to whole requests, but never past max_size: the buffers behind the graphs
        # are sized for max_size tokens.
        top = max_size - max_size % uniform_query_len
        self._sizes = tuple(sorted({min(_round_up(size, uniform_query_len), top) for size in raw}))

    @property
    def sizes(self) -> tuple[int, ...]:
        """The captured token counts, ascending."""
        return self._sizes

    @property
    def largest(self) -> int:
        """The largest captured token count; steps above it run eagerly."""
        return self._sizes[-1]

    @property
    def uniform_query_len(self) -> int:
        """Query rows per request of the uniform decode steps these sizes serve (next_n)."""
        return self._uniform_query_len

    @property
    def max_size(self) -> int:
        """The cap: no size exceeds it."""
        return self._max_size

    def __iter__(self) -> Iterator[int]:
        return iter(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)

    def __repr__(self) -> str:
        return f"CaptureSizes({list(self._sizes)}, uniform_query_len={self._uniform_query_len})"

    def shape_of(self, size: int) -> StepShape:
        """The uniform-decode StepShape of one captured size."""
        if size not in self._sizes:
            raise ValueError(f"size={size!r} is not one of the capture sizes {self._sizes}")
        q = self._uniform_query_len
        return StepShape(size, size // q, q)

    def shapes(self) -> list[StepShape]:
        """The StepShape of every size, ascending."""
        return [self.shape_of(size) for size in self._sizes]

    def pad(self, num_tokens: int, num_reqs: int | None = None) -> StepShape | None:
        """The graph key for a step of `num_tokens` tokens (and `num_reqs` requests).

        Returns the smallest size that holds the tokens and, when `num_reqs` is given, one
        `uniform_query_len` slot per request (size >= num_reqs * uniform_query_len), as
        StepShape(size, size // uniform_query_len, uniform_query_len); None when no size is
        large enough (the caller runs eagerly). ValueError for negative counts or
        num_reqs > num_tokens.
        """
        if not _is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens!r} must be an int >= 0")
        needed = num_tokens
        if num_reqs is not None:
            if not _is_int(num_reqs) or not 0 <= num_reqs <= num_tokens:
                raise ValueError(
                    f"num_reqs={num_reqs!r} must be an int in [0, num_tokens={num_tokens}]"
                )
            needed = max(needed, num_reqs * self._uniform_query_len)
        index = bisect.bisect_left(self._sizes, needed)
        if index == len(self._sizes):
            return None
        return self.shape_of(self._sizes[index])


__all__ = ["DEFAULT_MAX_SIZE", "CaptureSizes", "StepShape", "default_ladder"]
