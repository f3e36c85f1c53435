"""The tape backend behaves like a device graph (frozen host values, re-read tensor contents,
refused host syncs, moved tensors detected, private memory refreshed), on the CPU."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch

from capture import CaptureError, GraphCache, StepShape, is_capturing
from capture.backends.tape import Tape, TapeBackend

SHAPE = StepShape(8, 8, 1)
NAN = float("nan")


def tape_of(cache: GraphCache, shape: StepShape = SHAPE) -> Tape:
    graph = cache.graph(shape)
    assert isinstance(graph, Tape)
    return graph


def assert_matches(actual: torch.Tensor, expected64: torch.Tensor) -> None:
    """float32 results against float64 math, at float32 tolerances."""
    assert expected64.dtype == torch.float64
    torch.testing.assert_close(actual.double(), expected64, rtol=2e-6, atol=2e-6)


def refill(tensor: torch.Tensor, gen: torch.Generator) -> None:
    """New random values in place (a step writing its inputs into a persistent buffer)."""
    tensor.copy_(torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype))


def test_inplace_update_of_static_input_is_seen(gen: torch.Generator) -> None:
    x = torch.randn(6, 4, generator=gen)
    weight = torch.randn(4, 3, generator=gen)
    out = torch.empty(6, 3)

    def step() -> None:
        torch.matmul(x, weight, out=out)
        out.tanh_()

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    for _ in range(3):
        refill(x, gen)
        out.fill_(NAN)
        cache.replay(SHAPE)
        assert_matches(out, torch.tanh(x.double() @ weight.double()))
    assert cache.stats().graphs[SHAPE].replays == 3


def test_private_chain_is_rewritten_on_replay(gen: torch.Generator) -> None:
    a = torch.randn(5, generator=gen)
    out = torch.empty(5)

    def step() -> None:
        b = a * 2  # private: created during capture
        out.copy_(b + 1)

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    tape = tape_of(cache)
    assert tape.op_names() == ["aten.mul.Tensor", "aten.add.Tensor", "aten.copy_.default"]
    assert tape.num_ops == 3
    assert tape.num_bytes == 2 * 5 * 4  # b and b + 1
    refill(a, gen)
    out.fill_(NAN)
    cache.replay(SHAPE)
    assert_matches(out, a.double() * 2 + 1)


def test_views_of_private_tensors_stay_views(gen: torch.Generator) -> None:
    a = torch.randn(12, generator=gen)
    window = torch.empty(4)
    transposed = torch.empty(4, 3)
    pieces = torch.empty(3)
    whole = torch.empty(12)

    def step() -> None:
        b = a * 2
        v = b[2:6]  # slice of a private tensor
        window.copy_(v * 3)
        transposed.copy_(b.view(3, 4).t() + 1)
        first, second, _ = b.split(4)  # a list of views
        pieces.copy_(first[:3] - second[1:])
        b[:2].add_(10)  # in-place through a view mutates the private base
        whole.copy_(b)

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    names = tape_of(cache).op_names()
    assert "aten.split.Tensor" in names and "aten.t.default" in names
    for _ in range(2):
        refill(a, gen)
        for out in (window, transposed, pieces, whole):
            out.fill_(NAN)
        cache.replay(SHAPE)
        b = a.double() * 2
        assert_matches(window, b[2:6] * 3)
        assert_matches(transposed, b.view(3, 4).t() + 1)
        assert_matches(pieces, b[:3] - b[5:8])
        b[:2] += 10
        assert_matches(whole, b)


def test_views_of_static_inputs(gen: torch.Generator) -> None:
    a = torch.randn(4, 6, generator=gen)
    out = torch.empty(6, 2)

    def step() -> None:
        out.copy_(a[1:3].transpose(0, 1).contiguous() * 0.5)

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    refill(a, gen)
    out.fill_(NAN)
    cache.replay(SHAPE)
    assert_matches(out, a.double()[1:3].t() * 0.5)


def test_multi_output_ops_and_empty_out(gen: torch.Generator) -> None:
    a = torch.randn(4, 9, generator=gen)
    top_values = torch.empty(4, 3)
    top_indices = torch.empty(4, 3, dtype=torch.int64)
    row_max = torch.empty(4)
    summed = torch.empty(4, 9)

    def step() -> None:
        values, indices = torch.topk(a, 3, dim=1)
        top_values.copy_(values)
        top_indices.copy_(indices)
        row_max.copy_(a.max(dim=1).values)
        scratch = torch.empty(0)  # resized once by the out= op below; kept, not re-run
        torch.add(a, a, out=scratch)
        summed.copy_(scratch)

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    refill(a, gen)
    for out in (top_values, row_max, summed):
        out.fill_(NAN)
    top_indices.fill_(-7)
    cache.replay(SHAPE)
    expected_values, expected_indices = torch.topk(a.double(), 3, dim=1)
    assert_matches(top_values, expected_values)
    assert torch.equal(top_indices, expected_indices)
    assert_matches(row_max, a.double().amax(dim=1))
    assert_matches(summed, 2 * a.double())


def test_small_pipeline_matches_float64(gen: torch.Generator) -> None:
    """matmul, softmax, topk, gather and scatter_add_ through private intermediates."""
    rows, dim, cols, k = 6, 8, 10, 3
    q = torch.randn(rows, dim, generator=gen)
    keys = torch.randn(cols, dim, generator=gen)
    bucket_of_col = torch.randint(0, 4, (cols,), generator=gen)
    picked = torch.empty(rows, k)
    buckets = torch.empty(rows, 4)

    def step() -> None:
        probs = torch.softmax(q @ keys.t(), dim=-1)
        _, idx = probs.topk(k, dim=-1)
        picked.copy_(torch.gather(probs, 1, idx))
        buckets.zero_()
        buckets.scatter_add_(1, bucket_of_col.expand(rows, cols), probs)

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    for _ in range(3):
        refill(q, gen)
        refill(keys, gen)
        picked.fill_(NAN)
        buckets.fill_(NAN)
        cache.replay(SHAPE)
        probs = torch.softmax(q.double() @ keys.double().t(), dim=-1)
        assert_matches(picked, probs.topk(k, dim=-1).values)
        expected = torch.zeros(rows, 4, dtype=torch.float64)
        expected.scatter_add_(1, bucket_of_col.expand(rows, cols), probs)
        assert_matches(buckets, expected)


@torch.library.custom_op("capture_test::host_kernel", mutates_args=("out",))
def host_kernel(x: torch.Tensor, out: torch.Tensor) -> None:
    """A CPU "kernel" that reads its input through numpy, like Triton's interpreter does."""
    out.copy_(torch.from_numpy(x.numpy() * 2 + float(x.sum().item()) * 0))


def test_custom_op_body_is_opaque_to_the_guards(gen: torch.Generator) -> None:
    x = torch.randn(5, generator=gen)
    out = torch.empty(5)
    cache = GraphCache("tape")
    cache.capture(SHAPE, lambda: host_kernel(x, out))
    assert tape_of(cache).op_names() == ["capture_test.host_kernel.default"]
    refill(x, gen)
    out.fill_(NAN)
    cache.replay(SHAPE)
    assert_matches(out, 2 * x.double())
    # The same host reads outside a custom op are refused.
    with pytest.raises(CaptureError, match="numpy"):
        cache.capture(StepShape(4, 4, 1), lambda: out.copy_(torch.from_numpy(x.numpy())))


def test_custom_op_is_one_entry(gen: torch.Generator, scale_into: Callable[..., None]) -> None:
    x = torch.randn(7, generator=gen)
    out = torch.empty(7)
    final = torch.empty(7)

    def step() -> None:
        scale_into(x, out)
        final.copy_(out)

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    assert tape_of(cache).op_names() == ["capture_test.scale_into.default", "aten.copy_.default"]
    refill(x, gen)
    out.fill_(NAN)
    final.fill_(NAN)
    cache.replay(SHAPE)
    assert_matches(final, 2 * x.double() + 1)


SYNC_CASES: dict[str, tuple[Callable[[torch.Tensor], object], str, int]] = {
    # name: (what the step does with a float tensor x, expected text, warm-up runs)
    "item": (lambda x: x[0].item(), "item", 1),
    "tolist": (lambda x: x.tolist(), "tolist", 1),
    "numpy": (lambda x: x.numpy(), "numpy", 1),
    "bool": (lambda x: bool(x[0] > 0), "bool", 1),
    "int": (lambda x: int(x[0]), "int", 1),
    "if-tensor": (lambda x: 1 if (x > 0).any() else 0, "bool", 1),
    "repr": (lambda x: repr(x), "repr", 1),
    "nonzero": (lambda x: torch.nonzero(x > 0), "aten.nonzero", 1),
    "where-1arg": (lambda x: torch.where(x > 0), "aten.nonzero", 1),
    "mask-index": (lambda x: x[x > 0], "aten.index.Tensor", 1),
    "mask-assign": (lambda x: x.__setitem__(x > 10, 0.0), "aten.index_put_", 1),
    "masked_select": (lambda x: torch.masked_select(x, x > 0), "aten.masked_select", 1),
    "unique": (lambda x: torch.unique(x), "unique", 1),
    "repeat_interleave": (
        lambda x: torch.repeat_interleave(x, (x > 0).long()),
        "aten.repeat_interleave",
        1,
    ),
    "equal": (lambda x: torch.equal(x, x), "aten.equal", 1),
    "allclose": (lambda x: torch.allclose(x, x), "aten.allclose", 1),
    "bincount": (lambda x: torch.bincount((x > 0).long()), "aten.bincount", 1),
    "cpu()": (lambda x: torch.empty(3, device="meta").cpu(), "aten._to_copy", 0),
    'to("cpu")': (lambda x: torch.empty(3, device="meta").to("cpu"), "aten._to_copy", 0),
    "copy_-to-host": (lambda x: x[:3].copy_(torch.empty(3, device="meta")), "aten.copy_", 0),
}


@pytest.mark.parametrize("case", sorted(SYNC_CASES))
def test_host_syncs_are_refused(case: str, gen: torch.Generator) -> None:
    action, needle, warmup = SYNC_CASES[case]
    x = torch.randn(8, generator=gen)
    out = torch.empty(8)
    good = StepShape(4, 4, 1)

    def step() -> None:
        out.copy_(x * 2)
        action(x)

    cache = GraphCache("tape")
    cache.capture(good, lambda: out.copy_(x + 1))
    before = cache.stats()
    with pytest.raises(CaptureError, match=needle) as info:
        cache.capture(SHAPE, step, warmup=warmup)
    assert "graph capture" in str(info.value)
    assert SHAPE not in cache
    assert cache.shapes() == [good]
    after = cache.stats()
    assert after.graphs == before.graphs
    assert after.failed_captures == before.failed_captures + 1
    assert not is_capturing()


def test_repeat_interleave_with_output_size_is_allowed(gen: torch.Generator) -> None:
    x = torch.randn(4, generator=gen)
    repeats = torch.tensor([1, 2, 0, 3])
    out = torch.empty(6)

    def step() -> None:
        out.copy_(torch.repeat_interleave(x, repeats, output_size=6))

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    refill(x, gen)
    out.fill_(NAN)
    cache.replay(SHAPE)
    torch.testing.assert_close(out, torch.repeat_interleave(x, repeats))


def test_failed_capture_frees_what_it_took(gen: torch.Generator) -> None:
    x = torch.randn(64, generator=gen)
    made: list[weakref.ref[torch.Tensor]] = []

    def step() -> None:
        private = x * 3
        made.append(weakref.ref(private))
        private.sum().item()

    cache = GraphCache("tape")
    try:
        cache.capture(SHAPE, step, warmup=0)
    except CaptureError:
        pass
    else:  # pragma: no cover - the capture must fail
        pytest.fail("capture with .item() did not raise")
    gc.collect()
    assert len(made) == 1 and made[0]() is None
    assert len(cache) == 0


@pytest.mark.parametrize("how", ["set_", "resize_", "data"])
def test_tensor_reallocated_after_capture_is_detected(how: str, gen: torch.Generator) -> None:
    x = torch.randn(6, generator=gen)
    weight = torch.randn(6, generator=gen)
    out = torch.empty(6)

    def step() -> None:
        torch.mul(x, weight, out=out)

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    cache.replay(SHAPE)
    if how == "set_":
        weight.set_(torch.randn(6, generator=gen))
    elif how == "resize_":
        weight.resize_(4096)
    else:
        weight.data = torch.randn(6, generator=gen)
    with pytest.raises(CaptureError, match=r"argument `other` of aten\.mul\.out \(op #0\) moved"):
        cache.replay(SHAPE)
    assert cache.stats().graphs[SHAPE].replays == 1


def test_input_resized_during_capture_is_refused(gen: torch.Generator) -> None:
    a = torch.randn(5, generator=gen)
    out = torch.empty(0)  # a persistent output not yet at its final size

    def step() -> None:
        torch.add(a, 1, out=out)

    cache = GraphCache("tape")
    with pytest.raises(CaptureError, match="reallocated or resized during capture"):
        cache.capture(SHAPE, step, warmup=0)
    assert SHAPE not in cache
    cache.capture(SHAPE, step, warmup=1)  # warm-up allocates it first: now fine
    refill(a, gen)
    out.fill_(NAN)
    cache.replay(SHAPE)
    torch.testing.assert_close(out, a + 1)


def test_capture_only_through_graph_cache() -> None:
    with pytest.raises(CaptureError, match=r"only through GraphCache\.capture"):
        TapeBackend().capture(lambda: None, None)


def test_capture_phase_flags_and_nesting(gen: torch.Generator) -> None:
    x = torch.randn(3, generator=gen)
    out = torch.empty(3)
    flags: list[bool] = []
    cache = GraphCache("tape")
    cache.capture(StepShape(1, 1, 1), lambda: out.copy_(x))

    def step() -> None:
        flags.append(is_capturing())
        out.copy_(x)

    cache.capture(SHAPE, step, warmup=2)
    assert flags == [False, False, True]
    assert not is_capturing()

    with pytest.raises(CaptureError, match="nested capture"):
        cache.capture(StepShape(2, 2, 1), lambda: cache.capture(StepShape(4, 4, 1), step))
    with pytest.raises(CaptureError, match="inside a capture phase"):
        cache.capture(StepShape(2, 2, 1), lambda: cache.replay(SHAPE), warmup=0)
    assert cache.shapes() == [StepShape(1, 1, 1), SHAPE]


def test_inference_mode_capture_and_replay(gen: torch.Generator) -> None:
    x = torch.randn(4, generator=gen)
    out = torch.empty(4)

    def step() -> None:
        out.copy_(torch.exp(x) - 1)

    cache = GraphCache("tape")
    with torch.inference_mode():
        cache.capture(SHAPE, step)
    refill(x, gen)
    out.fill_(NAN)
    with torch.inference_mode():
        cache.replay(SHAPE)
    assert_matches(out, torch.expm1(x.double()))


def test_python_float_and_list_arguments_are_snapshots(gen: torch.Generator) -> None:
    x = torch.randn(2, 6, generator=gen)
    out = torch.empty(3, 4)
    shape = [3, 4]
    host = {"bias": 0.25}

    def step() -> None:
        out.copy_(x.reshape(shape) + host["bias"])

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    shape[0], shape[1] = 4, 3  # mutating the caller's list changes nothing
    host["bias"] = 100.0
    refill(x, gen)
    out.fill_(NAN)
    cache.replay(SHAPE)
    assert_matches(out, x.double().reshape(3, 4) + 0.25)


def test_view_check_catches_a_tampered_view(gen: torch.Generator) -> None:
    """White-box: the recorded view must still alias what the re-run view op returns."""
    a = torch.randn(6, generator=gen)
    out = torch.empty(2)

    def step() -> None:
        out.copy_((a * 2)[1:3])

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    tape = tape_of(cache)
    (slice_entry,) = [e for e in tape.entries if e.name == "aten.slice.Tensor"]
    slice_entry.outputs[0].set_(torch.empty(2))
    with pytest.raises(CaptureError, match=r"view op aten\.slice\.Tensor \(op #1\)"):
        cache.replay(SHAPE)


def test_tape_on_meta_tensors() -> None:
    """The tape is device-agnostic: it records and replays ops on any device."""
    x = torch.empty(4, 4, device="meta")
    out = torch.empty(4, device="meta")

    def step() -> None:
        out.copy_((x @ x).sum(dim=1))

    cache = GraphCache("tape")
    cache.capture(SHAPE, step)
    cache.replay(SHAPE)
    assert tape_of(cache).num_bytes == 4 * 4 * 4 + 4 * 4
