"""The TensorRT backend: a serialized plan in the host tier, the deserialised engine and
one execution context on the device (``engines.py`` holds the others and re-exports this).

Written against TensorRT's Python API (8.6-11.x); it runs only where TensorRT and an
NVIDIA GPU exist (``tests/gpu/test_tensorrt.py``). What can be checked without them (how
a call's arguments bind to the engine's inputs, buffer alignment) is in pure functions
here, tested anywhere.
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
    bind_inputs,
    is_cuda,
    synthesize,
)

if TYPE_CHECKING:
    import torch

#: TensorRT builder scratch space; 1 GiB covers small and medium models without tuning.
TRT_WORKSPACE_BYTES = 1 << 30
#: ``setTensorAddress``: "The pointer must have at least 256-byte alignment."
TRT_ALIGNMENT = 256


@functools.cache
def _trt_logger() -> Any:
    """One logger per process: TensorRT objects keep a pointer to it, so it must outlive them."""
    import tensorrt as trt

    return trt.Logger(trt.Logger.WARNING)


@functools.cache
def _dtype_table() -> dict[Any, torch.dtype]:
    """TensorRT's data types to torch's, as far as this TensorRT and torch have them
    (built once: every run looks up each of its tensors)."""
    import tensorrt as trt
    import torch

    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32,
             trt.int8: torch.int8, trt.bool: torch.bool, trt.uint8: torch.uint8}
    # TensorRT >= 9 (bfloat16, int64) and >= 8.6 on Hopper (fp8, as e4m3)
    for trt_name, torch_name in (("bfloat16", "bfloat16"), ("int64", "int64"),
                                 ("fp8", "float8_e4m3fn")):
        if hasattr(trt, trt_name) and hasattr(torch, torch_name):
            table[getattr(trt, trt_name)] = getattr(torch, torch_name)
    return table


def _trt_to_torch(dtype: Any, key: str, tensor: str) -> torch.dtype:
    """The torch dtype of TensorRT ``dtype`` (engine ``key``'s ``tensor``), or an error
    naming both (int4, fp4: no torch dtype holds them as TensorRT lays them out)."""
    table = _dtype_table()
    if dtype not in table:
        raise EngineFormatError(f"TensorRT engine {key!r}: tensor {tensor} is of type "
                                f"{dtype}, which has no torch dtype to hold it")
    return table[dtype]


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` contiguous at an address TensorRT accepts: a view into a larger block
    (``x[1:]``) is contiguous yet may start off the alignment, so it is copied."""
    import torch

    tensor = tensor.contiguous()
    if tensor.data_ptr() % TRT_ALIGNMENT == 0:
        return tensor
    # Copied into a block with room to start on the alignment (CUDA's caching allocator
    # aligns its blocks to 512 bytes, but not every allocator does).
    size = tensor.element_size()  # 1, 2, 4 or 8: divides the alignment
    block = torch.empty(tensor.numel() + TRT_ALIGNMENT // size, dtype=tensor.dtype,
                        device=tensor.device)
    start = (-block.data_ptr() % TRT_ALIGNMENT) // size
    out = block[start:start + tensor.numel()].view(tensor.shape)
    out.copy_(tensor)
    return out


class TensorRTEngine(Engine):
    """A serialized TensorRT plan. Host tier: the plan bytes. Device tier: the deserialised
    engine and one execution context. Runs with torch CUDA tensors as the I/O buffers on
    torch's current stream, so it orders with the surrounding torch work without syncs
    (on a side stream when that is the legacy default stream, where TensorRT would
    synchronise the device around each run).
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
        self._stream: Any = None
        #: The engine's inputs and outputs, (name, torch dtype) in order: read once at
        #: promotion, not walked through TensorRT's bindings on every call.
        self._inputs: list[tuple[str, torch.dtype]] = []
        self._outputs: list[tuple[str, torch.dtype]] = []
        #: The execution context's activation memory, known from the first promotion.
        self._context_bytes = 0

    @classmethod
    def load(cls, key: str, path: str | Path,
             artifacts: Mapping[str, Any] | None = None) -> TensorRTEngine:
        return cls(key, Path(path).read_bytes(), artifacts=artifacts)

    def size_bytes(self) -> int:
        # The plan holds the weights; the execution context allocates its activation
        # memory on top, which only the deserialised engine tells: counted from the first
        # promotion on (the cache reads this again after promoting, and makes room), and
        # kept while demoted, so each later promotion makes room for both at once.
        return len(self._plan) + self._context_bytes

    def _promote(self, device: str) -> None:
        import tensorrt as trt
        import torch

        if not is_cuda(device):
            raise EngineFormatError(f"TensorRT engine {self.key!r} needs a CUDA device, "
                                    f"not {device}")
        try:
            with torch.cuda.device(device):
                self._runtime = trt.Runtime(_trt_logger())
                self._engine = self._runtime.deserialize_cuda_engine(self._plan)
                if self._engine is None:
                    raise EngineFormatError(f"TensorRT could not deserialise {self.key!r} "
                                            "(built by another TensorRT version or GPU?)")
                self._check_io(trt)
                self._inputs = self._io(trt.TensorIOMode.INPUT)
                self._outputs = self._io(trt.TensorIOMode.OUTPUT)
                self._context = self._engine.create_execution_context()
                if self._context is None:  # None, not an exception, when it fails
                    raise EngineError(f"TensorRT could not create an execution context for "
                                      f"{self.key!r} (out of device memory for its "
                                      "activations?)")
                self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                self._context_bytes = context_memory_bytes(self._engine)
        except BaseException:
            self._demote()  # nothing half-built is kept
            raise

    def _check_io(self, trt: Any) -> None:
        """Refuse I/O this runner would misread: shape tensors and host-side inputs need
        host buffers, and non-linear formats are not the dense layout torch holds."""
        for name in (self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)):
            host = (getattr(self._engine, "is_shape_inference_io", lambda _: False)(name)
                    or self._engine.get_tensor_location(name) == trt.TensorLocation.HOST)
            linear = self._engine.get_tensor_format(name) == trt.TensorFormat.LINEAR
            if host or not linear:
                raise EngineFormatError(
                    f"TensorRT engine {self.key!r}: tensor {name} is "
                    + ("a shape tensor or host-side input" if host else
                       f"in format {self._engine.get_tensor_format(name)}")
                    + "; this runner feeds dense device buffers only")
            _trt_to_torch(self._engine.get_tensor_dtype(name), self.key, name)

    def _demote(self) -> None:
        # Context before engine before runtime: each depends on the next.
        self._context = None
        self._engine = None
        self._runtime = None
        self._stream = None
        self._inputs, self._outputs = [], []

    def _io(self, mode: Any) -> list[tuple[str, torch.dtype]]:
        names = (self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors))
        return [(n, _trt_to_torch(self._engine.get_tensor_dtype(n), self.key, n))
                for n in names if self._engine.get_tensor_mode(n) == mode]

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import torch

        device = self._device or "cuda"
        dtypes = dict(self._inputs)
        feed = bind_inputs(self.key, list(dtypes), args, kwargs)
        with torch.cuda.device(device):
            # Held until enqueued; after that torch's allocator reuses their blocks only
            # in the stream's order, so later work cannot overwrite them before TensorRT
            # reads them.
            keep = []
            for name, value in feed.items():
                t = aligned(torch.as_tensor(value).to(device, dtypes[name]))
                if not self._context.set_input_shape(name, tuple(t.shape)):  # refused
                    raise EngineError(f"{self.key!r}: input {name} of shape {tuple(t.shape)} "
                                      "is outside the engine's optimization profile")
                self._address(name, t)
                keep.append(t)
            unset = self._context.infer_shapes()
            if unset:
                raise EngineError(f"{self.key!r}: inputs {list(unset)} are not specified "
                                  "enough to infer the outputs' shapes")
            outs = []
            for name, dtype in self._outputs:
                shape = tuple(self._context.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise EngineError(f"{self.key!r}: output {name} has a data-dependent "
                                      "shape; this runner needs shapes known from the inputs")
                out = torch.empty(shape, dtype=dtype, device=device)
                self._address(name, out)
                outs.append(out)
            self._execute(torch.cuda.current_stream(device), [*keep, *outs])
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _address(self, name: str, tensor: torch.Tensor) -> None:
        if self._context.set_tensor_address(name, tensor.data_ptr()) is False:
            raise EngineError(f"{self.key!r}: TensorRT refused the buffer of {name} "
                              f"({tuple(tensor.shape)} {tensor.dtype})")

    def _execute(self, caller: Any, buffers: list[torch.Tensor]) -> None:
        """Enqueue on the caller's stream; from the legacy default stream, on a side
        stream ordered after it and before whatever the caller does next."""
        import torch

        stream = caller
        if caller == torch.cuda.default_stream(caller.device):
            stream = self._stream
            stream.wait_stream(caller)
        if not self._context.execute_async_v3(stream.cuda_stream):
            raise EngineError(f"TensorRT execution of {self.key!r} failed (see its log)")
        if stream is not caller:
            caller.wait_stream(stream)
            for t in buffers:  # used on the side stream: not reused before it is done
                t.record_stream(stream)

    def _warmup_inputs(self, device: str) -> Inputs:
        if self._sample is not None:
            return self._sample
        spec: InputSpec = []
        for name, dtype in self._inputs:
            shape = list(self._engine.get_tensor_shape(name))
            if any(d < 0 for d in shape):  # dynamic: the optimisation profile's "opt" shape
                shape = list(self._engine.get_tensor_profile_shape(name, 0)[1])
            spec.append((shape, str(dtype).removeprefix("torch.")))
        return synthesize(spec, device)

    def _release(self) -> None:
        self._demote()
        self._plan = b""
        self._context_bytes = 0


def context_memory_bytes(engine: Any) -> int:
    """Device memory an execution context of ``engine`` allocates for its activations
    (the most over its optimisation profiles): ``device_memory_size_v2`` from TensorRT 10,
    ``device_memory_size`` before it."""
    size = getattr(engine, "device_memory_size_v2", None)
    if size is None:
        size = getattr(engine, "device_memory_size", 0)
    return max(0, int(size or 0))


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
        fp16_flag = getattr(trt.BuilderFlag, "FP16", None)
        if fp16_flag is None:  # removed in TensorRT 11 with weak typing
            raise EngineFormatError(
                f"TensorRT {trt.__version__} builds strongly typed networks only: convert "
                "the ONNX model to fp16 first (e.g. ModelOpt AutoCast), then build with "
                "fp16=False")
        config.set_flag(fp16_flag)
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
