"""The TensorRT backend's checks that need neither TensorRT nor a GPU: how a call's
arguments bind to an engine's inputs, and buffer alignment (``cache/trt.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sits_queue.cache.contract import EngineError, bind_inputs
from sits_queue.cache.trt import TRT_ALIGNMENT, aligned, context_memory_bytes

# As TensorRT lists them: not forward's arguments (it drops inputs the network ignores)
NAMES = ("desc0", "desc1")


def test_positional_then_keyword_arguments_bind_by_the_engines_order() -> None:
    assert bind_inputs("m", NAMES, ("a",), {"desc1": "b"}) == {"desc0": "a", "desc1": "b"}
    assert bind_inputs("m", NAMES, (), {"desc1": "b", "desc0": "a"}) == {
        "desc0": "a", "desc1": "b"}


@pytest.mark.parametrize(("args", "kwargs", "said"), [
    # an input left out kept the previous call's buffer address: a freed block read
    (("a",), {}, r"'m': inputs \['desc1'\] not given \(its inputs: \['desc0', 'desc1'\]\)"),
    # a third argument was dropped without a word
    (("a", "b", "c"), {}, r"'m' takes 2 inputs \['desc0', 'desc1'\], got 3 positional"),
    # an unknown name was blamed on the optimisation profile
    (("a", "b"), {"kpts0": "c"}, r"no inputs named \['kpts0'\]"),
    (("a",), {"desc0": "c", "desc1": "b"}, r"inputs \['desc0'\] given by position and "
                                           r"by name"),
])
def test_a_call_that_does_not_give_every_input_once_is_refused_by_name(
        args: tuple[Any, ...], kwargs: dict[str, Any], said: str) -> None:
    with pytest.raises(EngineError, match=said):
        bind_inputs("m", NAMES, args, kwargs)


def test_a_view_off_the_alignment_is_copied_and_an_aligned_one_is_not() -> None:
    torch = pytest.importorskip("torch")
    block = aligned(torch.arange(1025, dtype=torch.float32)[1:])
    assert block.data_ptr() % TRT_ALIGNMENT == 0
    assert aligned(block).data_ptr() == block.data_ptr()  # no copy
    # x[1:] is contiguous, 4 bytes into its block: TensorRT requires 256-byte alignment
    view = block[1:]
    assert view.is_contiguous() and view.data_ptr() % TRT_ALIGNMENT
    fixed = aligned(view)
    assert fixed.data_ptr() % TRT_ALIGNMENT == 0 and torch.equal(fixed, view)
    # a transposed view becomes contiguous (it always did), and aligned; any dtype
    assert aligned(torch.ones(9, dtype=torch.int8)[3:]).data_ptr() % TRT_ALIGNMENT == 0
    grid = block[:1024].reshape(32, 32).t()
    assert aligned(grid).is_contiguous() and torch.equal(aligned(grid), grid)


@pytest.mark.parametrize(("engine", "expected"), [
    (SimpleNamespace(device_memory_size_v2=4096, device_memory_size=1024), 4096),  # 10.x
    (SimpleNamespace(device_memory_size_v2=2048), 2048),  # 11.x: only the v2 is left
    (SimpleNamespace(device_memory_size=1024), 1024),  # 8.6
    (SimpleNamespace(), 0),
])
def test_a_contexts_activation_memory_is_read_as_each_tensorrt_names_it(
        engine: Any, expected: int) -> None:
    assert context_memory_bytes(engine) == expected
