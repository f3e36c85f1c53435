"""StaticBuffers: allocation once at max size, views, errors, addresses, freeze."""

from __future__ import annotations

import pytest
import torch

from capture import StaticBuffers


def test_add_view_and_addresses(gen: torch.Generator) -> None:
    buffers = StaticBuffers("cpu")
    row_ends = buffers.add("row_ends", (16,), torch.int32, fill=-1)
    logits = buffers.add("logits", (8, 32), torch.float32, fill=None)
    assert buffers.names() == ["row_ends", "logits"]
    assert buffers["row_ends"] is row_ends
    assert "logits" in buffers and "nope" not in buffers and len(buffers) == 2
    assert torch.equal(row_ends, torch.full((16,), -1, dtype=torch.int32))
    assert buffers.total_bytes() == 16 * 4 + 8 * 32 * 4

    values = torch.randn(5, 32, generator=gen)
    view = buffers.view("logits", 5)
    view.copy_(values)
    assert view.shape == (5, 32)
    assert view.data_ptr() == logits.data_ptr()
    assert torch.equal(logits[:5], values)
    assert buffers.view("logits", 0).shape == (0, 32)
    assert buffers.view("logits", 8).shape == (8, 32)

    assert buffers.addresses() == {
        "row_ends": row_ends.data_ptr(),
        "logits": logits.data_ptr(),
    }
    logits.set_(torch.empty(8, 32))
    assert buffers.addresses()["logits"] == logits.data_ptr() != view.data_ptr()


def test_view_length_errors() -> None:
    buffers = StaticBuffers(torch.device("cpu"))
    buffers.add("slots", (4, 2), torch.int64)
    with pytest.raises(ValueError, match=r"length=5 for buffer 'slots'.*\[0, 4\]"):
        buffers.view("slots", 5)
    with pytest.raises(ValueError, match="length=-1"):
        buffers.view("slots", -1)
    with pytest.raises(KeyError, match="no buffer named 'slot'"):
        buffers.view("slot", 1)
    with pytest.raises(KeyError, match="slots"):
        buffers["missing"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("", (4,), torch.float32), "name"),
        (("dup", (4,), torch.float32), "already a buffer"),
        (("x", (), torch.float32), "non-empty sequence"),
        (("x", (4, -1), torch.float32), "ints >= 0"),
        (("x", (4.0,), torch.float32), "ints >= 0"),
        (("x", "4", torch.float32), "non-empty sequence"),
        (("x", (4,), "float32"), "dtype"),
    ],
)
def test_add_errors(args: tuple, needle: str) -> None:
    buffers = StaticBuffers("cpu")
    buffers.add("dup", (2,), torch.float32)
    with pytest.raises(ValueError, match=needle):
        buffers.add(*args)
    assert buffers.names() == ["dup"]


def test_freeze_forbids_add() -> None:
    buffers = StaticBuffers("cpu")
    buffers.add("a", (3,), torch.float16, fill=1.5)
    buffers.freeze()
    assert buffers.frozen
    with pytest.raises(ValueError, match="frozen"):
        buffers.add("b", (3,), torch.float16)
    assert buffers.names() == ["a"]
    assert torch.equal(buffers["a"], torch.full((3,), 1.5, dtype=torch.float16))
