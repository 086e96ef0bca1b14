"""The TensorRT backend: an ONNX export built into a plan, run against the torch module.

Needs an NVIDIA GPU (the ``gpu`` marker: skipped by tests/conftest.py where NVML sees
none) and the ``tensorrt`` package (skipped, with the reason shown, where it is missing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
pytest.importorskip("tensorrt", reason="TensorRT is not installed: `pip install tensorrt` "
                                       "on a host with an NVIDIA GPU and driver")
# The plan is built from torch.onnx.export(dynamo=True), which needs both.
pytest.importorskip("onnx", reason="onnx is not installed (the inference extra has it)")
pytest.importorskip("onnxscript", reason="onnxscript is not installed (the inference extra "
                                         "has it)")
import torch

from sits_queue.cache.contract import EngineError, EngineFormatError
from sits_queue.cache.engines import (
    TensorRTEngine,
    build_trt_plan,
    engine_from_path,
    export_onnx,
)
from sits_queue.cache.pool import EngineCache
from tests.integration.test_engines import Scorer, scorer_inputs

pytestmark = pytest.mark.gpu
DEVICE = "cuda:0"


def inputs(seed: int) -> tuple[Any, Any]:
    """The contract tests' inputs (tests/integration/test_engines.py), on the GPU."""
    ids, scale = scorer_inputs(seed)
    return ids.to(DEVICE), scale.to(DEVICE)


@pytest.fixture(scope="module")
def scorer() -> Scorer:
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device (CPU-only torch build?)")
    torch.manual_seed(0)
    model = Scorer()
    model.eval()
    return model.to(DEVICE)


@pytest.fixture(scope="module")
def onnx_bytes(scorer: Scorer, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = export_onnx(scorer, inputs(0), tmp_path_factory.mktemp("trt") / "scorer.onnx")
    return path.read_bytes()


@pytest.mark.parametrize(("fp16", "atol"), [(False, 1e-4), (True, 3e-2)])
def test_plan_matches_torch(scorer: Scorer, onnx_bytes: bytes, fp16: bool,
                            atol: float) -> None:
    import tensorrt as trt

    if fp16 and not hasattr(trt.BuilderFlag, "FP16"):  # TensorRT >= 11: strong typing
        with pytest.raises(EngineFormatError, match="strongly typed networks only"):
            build_trt_plan(onnx_bytes, fp16=True)
        return
    engine = TensorRTEngine("scorer", build_trt_plan(onnx_bytes, fp16=fp16))
    assert engine.tier == "host" and engine.size_bytes() > 0
    assert engine.to_device(DEVICE) > 0
    assert engine.warmup() > 0
    with torch.inference_mode():
        for seed in (1, 2):
            got = engine(*inputs(seed))
            torch.testing.assert_close(got.float(), scorer(*inputs(seed)), atol=atol, rtol=0)


def test_round_trip_and_release_through_the_cache(scorer: Scorer, onnx_bytes: bytes,
                                                  tmp_path: Path) -> None:
    plan_path = tmp_path / "scorer.plan"
    plan_path.write_bytes(build_trt_plan(onnx_bytes, fp16=False))
    # What one engine takes on the device: its plan, and its context's activation memory
    probe = TensorRTEngine.load("probe", plan_path)
    assert probe.size_bytes() == plan_path.stat().st_size
    probe.to_device(DEVICE)
    full = probe.size_bytes()
    assert full >= plan_path.stat().st_size
    probe.release()
    first = engine_from_path("scorer", plan_path, DEVICE)
    assert isinstance(first, TensorRTEngine)
    cache = EngineCache(DEVICE, full, 10 * full)
    engine, cold = cache.get("scorer", lambda: first)
    assert cold.source == "disk" and cold.promote_ms > 0 and cold.warmup_ms > 0
    assert cache.state.device_used == full  # counted at all of it once deserialised
    before = engine(*inputs(3))
    # A second engine takes the device pool: the first is demoted to its plan bytes
    cache.get("other", lambda: engine_from_path("other", plan_path, DEVICE))
    assert cache.warm() == {"other": "device", "scorer": "host"}
    again, cold = cache.get("scorer", lambda: pytest.fail("promotion must not reload"))
    assert again is engine and cold.source == "host" and cold.load_ms == 0
    torch.testing.assert_close(engine(*inputs(3)), before, atol=0, rtol=0)
    cache.clear()
    assert engine.released


def test_inputs_bind_by_name_views_are_aligned_and_the_default_stream_is_ordered(
        scorer: Scorer, onnx_bytes: bytes) -> None:
    import tensorrt as trt

    engine = TensorRTEngine("scorer", build_trt_plan(onnx_bytes, fp16=False))
    engine.to_device(DEVICE)
    ids, scale = inputs(4)
    want = scorer(ids, scale)
    names = [name for name, _ in engine._io(trt.TensorIOMode.INPUT)]
    with torch.inference_mode():
        # by name, and from views that start off TensorRT's 256-byte alignment
        wide_ids, wide_scale = torch.cat([ids[:1], ids]), torch.cat([scale[:1], scale])
        got = engine(**{names[0]: wide_ids[1:], names[1]: wide_scale[1:]})
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        # on the legacy default stream (run on a side stream, ordered both ways) and on
        # a stream of the caller's own
        with torch.cuda.stream(torch.cuda.default_stream(DEVICE)):
            torch.testing.assert_close(engine(ids, scale) * 1, want, atol=1e-4, rtol=0)
        side = torch.cuda.Stream(DEVICE)
        with torch.cuda.stream(side):
            out = engine(ids, scale) * 1
        side.synchronize()
        torch.testing.assert_close(out, want, atol=1e-4, rtol=0)
        # an input left out is refused by name (it ran on the last call's freed buffer)
        with pytest.raises(EngineError, match=rf"inputs \['{names[1]}'\] not given"):
            engine(ids)
