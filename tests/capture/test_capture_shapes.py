"""StepShape (the graph key) and the CaptureSizes ladder / padding policy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture import CaptureSizes, StepShape
from capture.shapes import default_ladder

EXPECTED_DEFAULT = (
    1,
    2,
    4,
    *range(8, 257, 8),
    *range(272, 513, 16),
)


def test_default_ladder_values() -> None:
    sizes = CaptureSizes()
    assert sizes.sizes == EXPECTED_DEFAULT
    assert sizes.largest == 512
    assert len(sizes) == len(EXPECTED_DEFAULT) == 3 + 32 + 16
    assert list(sizes) == list(EXPECTED_DEFAULT)


def test_default_ladder_ends_at_max_size() -> None:
    assert CaptureSizes(max_size=20).sizes == (1, 2, 4, 8, 16, 20)
    assert CaptureSizes(max_size=300).sizes[-4:] == (256, 272, 288, 300)
    assert CaptureSizes(max_size=3).sizes == (1, 2, 3)
    assert default_ladder(1) == [1]


def test_ladder_rounds_up_to_next_n_and_dedups() -> None:
    two = CaptureSizes(uniform_query_len=2)
    # 1 and 2 both become 2; every other default size is already even.
    assert two.sizes == tuple(sorted({2, *EXPECTED_DEFAULT[1:]}))
    assert two.sizes[:4] == (2, 4, 8, 16)
    three = CaptureSizes(max_size=64, uniform_query_len=3)
    # 64 would round up to 66 > max_size: it becomes 63, the largest multiple below.
    assert three.sizes == (3, 6, 9, 18, 24, 33, 42, 48, 57, 63)
    assert all(size % 3 == 0 for size in three)
    assert CaptureSizes([1, 7], max_size=7, uniform_query_len=2).sizes == (2, 6)
    assert CaptureSizes(max_size=2, uniform_query_len=2).sizes == (2,)


def test_explicit_sizes_sorted_rounded_deduped() -> None:
    assert CaptureSizes([8, 1, 3, 8]).sizes == (1, 3, 8)
    assert CaptureSizes([5, 1, 3, 4], uniform_query_len=2).sizes == (2, 4, 6)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"sizes": []}, "sizes"),
        ({"sizes": [0, 4]}, "every size"),
        ({"sizes": [-2]}, "every size"),
        ({"sizes": [2.0]}, "every size"),
        ({"sizes": [True]}, "every size"),
        ({"sizes": "124"}, "sizes"),
        ({"sizes": [1024]}, "max_size=512"),
        ({"max_size": 0}, "max_size"),
        ({"uniform_query_len": 0}, "uniform_query_len"),
        ({"uniform_query_len": 1.5}, "uniform_query_len"),
        ({"max_size": 3, "uniform_query_len": 4}, "no uniform step fits"),
    ],
)
def test_sizes_validation(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        CaptureSizes(**kwargs)


@pytest.mark.parametrize(
    ("num_tokens", "size"),
    [(0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (256, 256), (257, 272), (512, 512)],
)
def test_pad_boundaries(num_tokens: int, size: int) -> None:
    assert CaptureSizes().pad(num_tokens) == StepShape(size, size, 1)


def test_pad_above_largest_is_none() -> None:
    assert CaptureSizes().pad(513) is None
    assert CaptureSizes([4, 8]).pad(9) is None


def test_pad_uniform_query_len() -> None:
    sizes = CaptureSizes(uniform_query_len=2)
    assert sizes.pad(1) == StepShape(2, 1, 2)
    assert sizes.pad(6) == StepShape(8, 4, 2)
    assert sizes.pad(6, num_reqs=3) == StepShape(8, 4, 2)
    # Three requests need three 2-row slots even though their tokens fit in 4.
    assert sizes.pad(3, num_reqs=3) == StepShape(8, 4, 2)
    assert sizes.pad(512, num_reqs=256) == StepShape(512, 256, 2)
    assert sizes.pad(511, num_reqs=257) is None


@pytest.mark.parametrize(
    ("args", "needle"),
    [((-1,), "num_tokens"), ((2.0,), "num_tokens"), ((4, 5), "num_reqs"), ((4, -1), "num_reqs")],
)
def test_pad_validation(args: tuple, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        CaptureSizes().pad(*args)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    max_size=st.integers(300, 310),
    next_n=st.integers(1, 4),
    num_tokens=st.integers(0, 320),
)
def test_pad_is_smallest_fitting_size(
    sizes: list[int], max_size: int, next_n: int, num_tokens: int
) -> None:
    ladder = CaptureSizes(sizes, max_size=max_size, uniform_query_len=next_n)
    assert ladder.largest <= max_size
    shape = ladder.pad(num_tokens)
    fitting = [s for s in ladder.sizes if s >= num_tokens]
    if not fitting:
        assert shape is None
    else:
        assert shape == StepShape(min(fitting), min(fitting) // next_n, next_n)
    assert all(s % next_n == 0 for s in ladder.sizes)
    assert list(ladder.sizes) == sorted(set(ladder.sizes))


def test_shapes_of_ladder() -> None:
    sizes = CaptureSizes([2, 4], uniform_query_len=2)
    assert sizes.shapes() == [StepShape(2, 1, 2), StepShape(4, 2, 2)]
    with pytest.raises(ValueError, match="size=3"):
        sizes.shape_of(3)


def test_step_shape_is_a_hashable_ordered_key() -> None:
    uniform = StepShape(8, 8, 1)
    mixed = StepShape(8, 8, None)
    graphs = {uniform: "a", mixed: "b", StepShape(8, 8, 1): "c"}
    assert len(graphs) == 2 and graphs[uniform] == "c"
    # Mixed kinds sort without a TypeError; None sorts before any query length.
    assert sorted([StepShape(16, 8, 2), uniform, mixed, StepShape(4, 2, None)]) == [
        StepShape(4, 2, None),
        mixed,
        uniform,
        StepShape(16, 8, 2),
    ]
    assert max([uniform, mixed]) == uniform
    assert uniform.label == "tokens=8,reqs=8,q=1"
    assert mixed.label == "tokens=8,reqs=8,q=-"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((0, 1, None), "num_tokens"),
        ((4, 0, None), "num_reqs"),
        ((4, 5, None), "num_reqs"),
        ((True, 1, None), "num_tokens"),
        ((4, 2, 0), "uniform_query_len"),
        ((6, 2, 2), "num_reqs \\* uniform_query_len"),
    ],
)
def test_step_shape_validation(args: tuple, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        StepShape(*args)
