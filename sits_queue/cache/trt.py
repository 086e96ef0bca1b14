"""The TensorRT backend: a serialized plan in the host tier, the deserialised engine and
one execution context on the device (``engines.py`` holds the others and re-exports this).

Written against TensorRT's Python API (8.6-10.x); it runs only where TensorRT and an
NVIDIA GPU exist (``tests/gpu/test_tensorrt.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sits_queue.cache.contract import (
    Engine,
    EngineError,
    EngineFormatError,
    Inputs,
    InputSpec,
    is_cuda,
    synthesize,
)

if TYPE_CHECKING:
    import torch

#: TensorRT builder scratch space; 1 GiB covers small and medium models without tuning.
TRT_WORKSPACE_BYTES = 1 << 30


@functools.cache
def _trt_logger() -> Any:
    """One logger per process: TensorRT objects keep a pointer to it, so it must outlive them."""
    import tensorrt as trt

    return trt.Logger(trt.Logger.WARNING)


def _trt_to_torch(dtype: Any) -> torch.dtype:
    import tensorrt as trt
    import torch

    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32,
             trt.int8: torch.int8, trt.bool: torch.bool, trt.uint8: torch.uint8}
    for name in ("bfloat16", "int64"):  # TensorRT >= 9 only
        if hasattr(trt, name):
            table[getattr(trt, name)] = getattr(torch, name)
    return table[dtype]


class TensorRTEngine(Engine):
    """A serialized TensorRT plan. Host tier: the plan bytes. Device tier: the deserialised
    engine and one execution context. Runs with torch CUDA tensors as the I/O buffers on
    torch's current stream, so it orders with the surrounding torch work without syncs.
    """

    backend = "tensorrt"
    torch_allocated = False
    rewarm_on_promote = True

    def __init__(self, key: str, plan: bytes, sample_inputs: Inputs | None = None,
                 artifacts: Mapping[str, Any] | None = None) -> None:
        super().__init__(key, sample_inputs, artifacts)
        self._plan = plan
        self._runtime: Any = None
        self._engine: Any = None
        self._context: Any = None

    @classmethod
    def load(cls, key: str, path: str | Path,
             artifacts: Mapping[str, Any] | None = None) -> TensorRTEngine:
        return cls(key, Path(path).read_bytes(), artifacts=artifacts)

    def size_bytes(self) -> int:
        # The plan holds the weights; activation memory comes per context on top of it
        # (``engine.device_memory_size_v2`` once deserialised) and is not counted here.
        return len(self._plan)

    def _promote(self, device: str) -> None:
        import tensorrt as trt
        import torch

        if not is_cuda(device):
            raise EngineFormatError(f"TensorRT engine {self.key!r} needs a CUDA device, "
                                    f"not {device}")
        with torch.cuda.device(device):
            self._runtime = trt.Runtime(_trt_logger())
            self._engine = self._runtime.deserialize_cuda_engine(self._plan)
            if self._engine is None:
                raise EngineFormatError(f"TensorRT could not deserialise {self.key!r} "
                                        "(built by another TensorRT version or GPU?)")
            self._context = self._engine.create_execution_context()

    def _demote(self) -> None:
        # Context before engine before runtime: each depends on the next.
        self._context = None
        self._engine = None
        self._runtime = None

    def _io(self, mode: Any) -> list[str]:
        names = (self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors))
        return [n for n in names if self._engine.get_tensor_mode(n) == mode]

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import tensorrt as trt
        import torch

        device = self._device or "cuda"
        feed = dict(zip(self._io(trt.TensorIOMode.INPUT), args, strict=False)) | kwargs
        # Held until enqueued; after that torch's allocator reuses their blocks only in
        # this stream's order, so later work cannot overwrite them before TensorRT reads.
        keep = []
        for name, value in feed.items():
            t = torch.as_tensor(value).to(device, _trt_to_torch(
                self._engine.get_tensor_dtype(name))).contiguous()
            if not self._context.set_input_shape(name, tuple(t.shape)):  # False: refused
                raise EngineError(f"{self.key!r}: input {name} of shape {tuple(t.shape)} is "
                                  "outside the engine's optimization profile")
            self._context.set_tensor_address(name, t.data_ptr())
            keep.append(t)
        outs = []
        for name in self._io(trt.TensorIOMode.OUTPUT):
            shape = tuple(self._context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise EngineError(f"{self.key!r}: output {name} has a data-dependent shape; "
                                  "this runner needs shapes known from the inputs")
            out = torch.empty(shape, dtype=_trt_to_torch(self._engine.get_tensor_dtype(name)),
                              device=device)
            self._context.set_tensor_address(name, out.data_ptr())
            outs.append(out)
        stream = torch.cuda.current_stream(device)
        if not self._context.execute_async_v3(stream.cuda_stream):
            raise EngineError(f"TensorRT execution of {self.key!r} failed")
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _warmup_inputs(self, device: str) -> Inputs:
        import tensorrt as trt

        if self._sample is not None:
            return self._sample
        spec: InputSpec = []
        for name in self._io(trt.TensorIOMode.INPUT):
            shape = list(self._engine.get_tensor_shape(name))
            if any(d < 0 for d in shape):  # dynamic: the optimisation profile's "opt" shape
                shape = list(self._engine.get_tensor_profile_shape(name, 0)[1])
            dtype = _trt_to_torch(self._engine.get_tensor_dtype(name))
            spec.append((shape, str(dtype).removeprefix("torch.")))
        return synthesize(spec, device)

    def _release(self) -> None:
        self._demote()
        self._plan = b""


def build_trt_plan(onnx_bytes: bytes, fp16: bool = True,
                   profile_shapes: Mapping[str, tuple[Sequence[int], Sequence[int],
                                                      Sequence[int]]] | None = None,
                   workspace_bytes: int = TRT_WORKSPACE_BYTES) -> bytes:
    """Build a serialized TensorRT plan from an ONNX model (on the current CUDA device),
    fp16 where TensorRT finds it faster, else strict fp32 (no TF32).

    ``profile_shapes`` gives ``(min, opt, max)`` per dynamic input; static inputs need none.
    """
    import tensorrt as trt

    logger = _trt_logger()
    builder = trt.Builder(logger)
    # TensorRT 10 networks are always explicit-batch; earlier versions need the flag.
    major = int(trt.__version__.split(".")[0])
    flags = 0 if major >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_bytes):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineFormatError(f"TensorRT could not parse the ONNX model: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    else:
        # fp32 means fp32: TensorRT allows TF32 (10-bit mantissas) in fp32 matmuls by
        # default, off by ~1e-3 from the model it was built from.
        config.clear_flag(trt.BuilderFlag.TF32)
    dynamic = [network.get_input(i) for i in range(network.num_inputs)
               if any(d < 0 for d in network.get_input(i).shape)]
    if dynamic:
        profile = builder.create_optimization_profile()
        for tensor in dynamic:
            if not profile_shapes or tensor.name not in profile_shapes:
                raise EngineFormatError(f"input {tensor.name} has dynamic shape "
                                        f"{tuple(tensor.shape)}: pass profile_shapes for it")
            profile.set_shape(tensor.name, *profile_shapes[tensor.name])
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineFormatError("TensorRT failed to build the engine (see its log above)")
    return bytes(plan)
