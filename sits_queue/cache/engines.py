"""Engine backends behind one contract (:mod:`sits_queue.cache.contract`), and
:func:`engine_from_path`, which picks one by file type.

* :class:`TorchEngine`: an ``nn.Module`` (Hugging Face models included);
* :class:`ExportedEngine`: a ``torch.export`` program (.pt2);
* :class:`AotiEngine`: an AOTInductor package (.pt2), built by :func:`compile_aoti`;
* :class:`OnnxEngine`: an ONNX Runtime session, from :func:`export_onnx`;
* :class:`TensorRTEngine`: a TensorRT plan, from :func:`build_trt_plan` (``trt.py``).

Every engine starts in the host tier, its weights or artefact read from disk once into
host memory; promotion builds the device side from that copy and never reads the disk.
torch, onnxruntime and tensorrt are imported inside functions only (STYLE habit 6).
"""

from __future__ import annotations

import io
import json
import logging
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sits_queue.cache import hfprogress, kvwarm
from sits_queue.cache.contract import (
    Backend,
    Engine,
    EngineError,
    EngineFormatError,
    EngineNotResident,
    EngineReleased,
    Inputs,
    bind_inputs,
    device_index,
    input_spec,
    is_cuda,
    map_tensors,
    move,
    synthesize,
)
from sits_queue.cache.trt import TRT_WORKSPACE_BYTES, TensorRTEngine, build_trt_plan

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "AOTI_SPEC_KEY",
    "TRT_WORKSPACE_BYTES",
    "AotiEngine",
    "Backend",
    "Engine",
    "EngineError",
    "EngineFormatError",
    "EngineNotResident",
    "EngineReleased",
    "ExportedEngine",
    "Inputs",
    "OnnxEngine",
    "TensorRTEngine",
    "TorchEngine",
    "build_trt_plan",
    "compile_aoti",
    "engine_from_path",
    "export_onnx",
]

#: Key under which :func:`compile_aoti` stores the sample input spec in the package metadata.
AOTI_SPEC_KEY = "sits.sample_inputs"
#: A prompt long enough to exercise attention and the KV cache, short enough to cost little.
HF_WARMUP_PROMPT = "Warm-up: a short representative prompt for the engine cache."
#: ``onnx.TensorProto.BFLOAT16``: the element type of a bfloat16 input's ``OrtValue``.
ONNX_BFLOAT16 = 16
_ONNX_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16",
                "tensor(double)": "float64", "tensor(int64)": "int64",
                "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(uint8)": "uint8",
                "tensor(int8)": "int8", "tensor(bfloat16)": "bfloat16"}

# -- torch: a module, an exported program, an AOTInductor package -------------------------------

def _tensor_bytes(tensors: Any) -> int:
    """Bytes of distinct tensors (tied weights, e.g. GPT-2's lm_head, count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy: host-to-device copies from it run at full PCIe speed."""
    import torch

    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t)
    return host


def _floats_as(obj: Any, dtype: Any) -> Any:
    """``obj`` with every floating tensor in it as ``dtype``; token ids and masks
    (integers, booleans) as they are."""
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)


class TorchEngine(Engine):
    """An ``nn.Module`` (a Hugging Face model included); moves weights with ``.to()``."""

    backend = "torch"

    def __init__(self, key: str, module: torch.nn.Module, sample_inputs: Inputs | None,
                 artifacts: Mapping[str, Any] | None = None,
                 size_bytes: int | None = None,
                 input_dtype: torch.dtype | None = None) -> None:
        super().__init__(key, sample_inputs, artifacts)
        self._module: torch.nn.Module | None = module.eval()
        #: The floating dtype its inputs are cast to (a module served at fp16/bf16,
        #: ``cache/precision.py``): callers, and the warm-up sample, keep passing fp32.
        self.input_dtype = input_dtype
        #: Bytes of KV memory the last warm-up reserved in the CUDA allocator (0 off CUDA).
        self.kv_reserved_bytes = 0
        # Given when parameters and buffers miss some weights (quantised packed params).
        self._size = size_bytes if size_bytes is not None else \
            _tensor_bytes([*module.parameters(), *module.buffers()])

    @property
    def module(self) -> torch.nn.Module:
        """The module, e.g. for ``module.generate`` on a causal LM."""
        self._live()
        assert self._module is not None
        return self._module

    def size_bytes(self) -> int:
        return self._size

    def holds(self) -> object:
        # A loader that keeps its model in a global wraps the same module each call.
        return self if self._module is None else self._module

    def _promote(self, device: str) -> None:
        # non_blocking pays off from pinned host memory (see _demote); to_device syncs.
        self.module.to(device, non_blocking=True)

    def _demote(self) -> None:
        import torch

        if torch.cuda.is_available():
            # Demote straight into pinned pages so the next promotion is one fast copy;
            # _apply is what .to() uses, with our copy function in its place.
            module: Any = self.module
            module._apply(_pinned)
        else:
            self.module.to("cpu")

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import torch

        if self.input_dtype is not None:
            args, kwargs = _floats_as(args, self.input_dtype), _floats_as(kwargs,
                                                                          self.input_dtype)
        with torch.inference_mode():
            return self.module(*args, **kwargs)

    def _warm(self, device: str, sample: Inputs) -> None:
        """The warm-up inference; for a model that generates (a causal LM, or a seq2seq
        model's decoder) the KV-cache warm-up too (§4.1): a few decode steps through the
        cache after the prefill and, on CUDA, the KV memory of a long generation
        reserved in the allocator (``kvwarm.py``)."""
        module = self.module
        if not (kvwarm.can_generate(module) and isinstance(sample, Mapping)
                and "input_ids" in sample):
            super()._warm(device, sample)
            return
        on_device = {k: v.to(device) for k, v in sample.items()}
        if kvwarm.encoder_decoder(module):
            kvwarm.warm_decode_seq2seq(module, on_device)
        else:
            kvwarm.warm_decode(module, on_device)
        self.kv_reserved_bytes = kvwarm.reserve(
            device, kvwarm.kv_bytes_per_token(module) * kvwarm.reserve_tokens(module))

    def _release(self) -> None:
        self._module = None


class ExportedEngine(Engine):
    """A ``torch.export`` program (``torch.export.save`` .pt2); host tier keeps the program.

    Without a sample input of its own it warms up on the program's example inputs,
    positional and keyword parts both (a program checks its call against the one it
    was exported with).
    """

    backend = "torch_export"

    def __init__(self, key: str, program: torch.export.ExportedProgram,
                 sample_inputs: Inputs | None = None,
                 artifacts: Mapping[str, Any] | None = None) -> None:
        #: The keyword part of the example inputs, passed with a positional sample.
        self._sample_kwargs: dict[str, Any] = {}
        if sample_inputs is None and program.example_inputs is not None:
            args, kwargs = program.example_inputs
            if kwargs and not args:
                sample_inputs = dict(kwargs)
            else:
                sample_inputs, self._sample_kwargs = tuple(args), dict(kwargs or {})
        super().__init__(key, sample_inputs, artifacts)
        self._program: torch.export.ExportedProgram | None = program
        self._module: Callable[..., Any] | None = None
        self._size = _tensor_bytes([*program.state_dict.values(),
                                    *(c for c in program.constants.values()
                                      if hasattr(c, "element_size"))])

    @classmethod
    def load(cls, key: str, path: str | Path,
             artifacts: Mapping[str, Any] | None = None) -> ExportedEngine:
        import torch

        return cls(key, torch.export.load(str(path)), artifacts=artifacts)

    def size_bytes(self) -> int:
        return self._size

    def _promote(self, device: str) -> None:
        import torch
        from torch.export.passes import move_to_device_pass

        assert self._program is not None
        # The pass also rewrites device constants baked into the graph, which .to() misses.
        # It moves the program it is given, in place: given the host copy itself, the
        # weights would stay on the device after a demotion (which drops only _module),
        # while the pool counts them freed. A copy goes; the host program stays put. The
        # copy is a save and load, not a deepcopy: that renames an input named like a
        # builtin (``input``, the argument of every stock torch.nn layer) in the graph
        # but not in the signature, and the pass refused every such program.
        buffer = io.BytesIO()
        torch.export.save(self._program, buffer)
        buffer.seek(0)
        self._module = move_to_device_pass(torch.export.load(buffer), device).module()

    def _demote(self) -> None:
        self._module = None

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import torch

        assert self._module is not None
        with torch.inference_mode():
            return self._module(*args, **kwargs)

    def _warm(self, device: str, sample: Inputs) -> None:
        if self._sample_kwargs and isinstance(sample, tuple):
            self._run(move(sample, device), move(self._sample_kwargs, device))
        else:
            super()._warm(device, sample)

    def _release(self) -> None:
        self._program = self._module = None
        self._sample_kwargs = {}


def _aoti_metadata(package: bytes) -> dict[str, str]:
    """The metadata AOTInductor writes beside its wrapper, read without loading the library."""
    with zipfile.ZipFile(io.BytesIO(package)) as archive:
        for name in archive.namelist():
            if "/aotinductor/" in f"/{name}" and name.endswith("wrapper_metadata.json"):
                return cast(dict[str, str], json.loads(archive.read(name)))
    raise EngineFormatError("not an AOTInductor package: no aotinductor wrapper metadata")


class AotiEngine(Engine):
    """An AOTInductor package (.pt2). The weights are compiled into the package's library,
    so the host tier keeps the package bytes and a promotion loads it from memory.
    """

    backend = "aoti"
    rewarm_on_promote = True

    def __init__(self, key: str, package: bytes, sample_inputs: Inputs | None = None,
                 artifacts: Mapping[str, Any] | None = None) -> None:
        meta = _aoti_metadata(package)
        if sample_inputs is None and AOTI_SPEC_KEY in meta:
            spec = [(list(s), str(d)) for s, d in json.loads(meta[AOTI_SPEC_KEY])]
            sample_inputs = synthesize(spec)
        super().__init__(key, sample_inputs, artifacts)
        #: The device kind the package was compiled for: "cpu" or "cuda".
        self.compiled_for = meta.get("AOTI_DEVICE_KEY", "cpu")
        self._package = package
        self._runner: Callable[..., Any] | None = None

    @classmethod
    def load(cls, key: str, path: str | Path,
             artifacts: Mapping[str, Any] | None = None) -> AotiEngine:
        return cls(key, Path(path).read_bytes(), artifacts=artifacts)

    def size_bytes(self) -> int:
        # The weights are inside the package; its length is their size plus a little code.
        return len(self._package)

    def _promote(self, device: str) -> None:
        import torch

        if device.partition(":")[0] != self.compiled_for:
            raise EngineFormatError(f"AOTInductor package {self.key!r} was compiled for "
                                    f"{self.compiled_for}; it cannot run on {device}")
        # Loading extracts the library to a temporary directory to dlopen it: that is
        # unavoidable for compiled code, but the weights come from host memory.
        self._runner = torch._inductor.aoti_load_package(
            io.BytesIO(self._package), device_index=device_index(device))

    def _demote(self) -> None:
        self._runner = None

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self._runner is not None
        return self._runner(*args, **kwargs)

    def _release(self) -> None:
        self._runner = None
        self._package = b""


def compile_aoti(module: torch.nn.Module, sample_inputs: Sequence[Any],
                 path: str | Path) -> Path:
    """Compile ``module`` with AOTInductor into a package at ``path`` (needs a C++ compiler).

    The package targets the device ``module`` and ``sample_inputs`` are on. Their shapes
    are recorded in the package metadata so a loaded engine can warm itself up.
    """
    import torch

    args = tuple(sample_inputs)
    program = torch.export.export(module.eval(), args)
    meta = {AOTI_SPEC_KEY: json.dumps(input_spec(args))}
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(path), inductor_configs={"aot_inductor.metadata": meta})
    return Path(path)


# -- ONNX Runtime ---------------------------------------------------------------------------------

class OnnxEngine(Engine):
    """An ONNX model run by ONNX Runtime; the host tier keeps the model bytes and a
    promotion builds a session from them (no disk). Takes and returns torch tensors.
    """

    backend = "onnxruntime"
    torch_allocated = False
    rewarm_on_promote = True

    def __init__(self, key: str, model_bytes: bytes, sample_inputs: Inputs | None = None,
                 artifacts: Mapping[str, Any] | None = None) -> None:
        super().__init__(key, sample_inputs, artifacts)
        self._bytes = model_bytes
        self._session: Any = None

    @classmethod
    def load(cls, key: str, path: str | Path,
             artifacts: Mapping[str, Any] | None = None) -> OnnxEngine:
        return cls(key, Path(path).read_bytes(), artifacts=artifacts)

    @property
    def session(self) -> Any:
        """The ``onnxruntime.InferenceSession``; None in the host tier."""
        return self._session

    @property
    def providers(self) -> list[str]:
        return list(self._session.get_providers()) if self._session is not None else []

    def size_bytes(self) -> int:
        # Initialisers (the weights) are nearly all of an ONNX model's bytes.
        return len(self._bytes)

    def _promote(self, device: str) -> None:
        import onnxruntime as ort

        providers: list[str | tuple[str, dict[str, Any]]] = ["CPUExecutionProvider"]
        if is_cuda(device) and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, ("CUDAExecutionProvider",
                                 {"device_id": max(0, device_index(device))}))
        session = ort.InferenceSession(self._bytes, providers=providers)
        bf16 = [o.name for o in session.get_outputs() if o.type == "tensor(bfloat16)"]
        if bf16:
            raise EngineFormatError(
                f"ONNX engine {self.key!r}: outputs {bf16} are bfloat16, which onnxruntime "
                "cannot hand back to Python (numpy has no bfloat16); cast them to float16 "
                "or float32 in the graph")
        self._session = session
        if is_cuda(device) and "CUDAExecutionProvider" not in self._session.get_providers():
            # (no CUDA build of onnxruntime, or its provider failed to load: cuDNN missing)
            logger.warning("ONNX engine %r asked for %s runs on the CPU: onnxruntime's CUDA "
                           "provider is not available here", self.key, device)

    def _demote(self) -> None:
        self._session = None

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        feed = bind_inputs(self.key, [i.name for i in self._session.get_inputs()], args,
                           kwargs, backend="ONNX")
        device = self._device or "cpu"
        outs = [_from_onnx(o, device) for o in self._session.run(
            None, {name: _to_onnx(value) for name, value in feed.items()})]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _warmup_inputs(self, device: str) -> Inputs | None:
        if self._sample is not None:
            return self._sample
        inputs = self._session.get_inputs()
        if any(i.type not in _ONNX_DTYPES for i in inputs):
            return None  # (strings, int16, float8...): no warm-up rather than a failed load
        # Symbolic dimensions (batch, sequence) become 1: the smallest valid call.
        spec = [([d if isinstance(d, int) and d > 0 else 1 for d in i.shape],
                 _ONNX_DTYPES[i.type]) for i in inputs]
        return synthesize(spec, device)

    def _release(self) -> None:
        self._session = None
        self._bytes = b""


def _to_onnx(value: Any) -> Any:
    """One input as onnxruntime takes it: a numpy array, or for a bfloat16 tensor (numpy
    has none) its bits as an ``OrtValue`` typed bfloat16."""
    import numpy as np
    import torch

    if not isinstance(value, torch.Tensor):
        return np.asarray(value)
    tensor = value.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            tensor.contiguous().view(torch.int16).numpy(), onnx_element_type=ONNX_BFLOAT16)
    return tensor.numpy()


def _from_onnx(out: Any, device: str) -> Any:
    """One output as a torch tensor on ``device`` when it is numeric; sequences, maps
    (a classifier's ZipMap) and strings as onnxruntime gives them."""
    import numpy as np
    import torch

    if isinstance(out, np.ndarray) and out.dtype.kind in "biufc":
        return torch.from_numpy(out).to(device)
    return out


def export_onnx(module: torch.nn.Module, sample_inputs: Sequence[Any], path: str | Path,
                dynamic_shapes: Any = None) -> Path:
    """Export ``module`` to ONNX at ``path`` (weights inside the file, so bytes suffice)."""
    import torch

    torch.onnx.export(module.eval(), tuple(sample_inputs), str(path), dynamo=True,
                      external_data=False, dynamic_shapes=dynamic_shapes, verbose=False)
    return Path(path)


# -- choosing a backend by file type ------------------------------------------------------------

def _hf_class(transformers: Any, config: Any) -> tuple[Any, str]:
    """The class a Hugging Face checkpoint loads with, and the task it serves: a causal LM
    with its head, an encoder-decoder (BART, T5...) as the generation model it was saved
    as (``AutoModel`` would drop its head: a bare ``BartModel``, a ``T5Model`` that cannot
    even run on input ids alone), anything else as its bare model (an encoder)."""
    archs = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    if getattr(config, "is_encoder_decoder", False) is True:
        # The class it was saved as, where transformers has it (speech and vision
        # encoder-decoders included), else the seq2seq LM Auto class.
        saved = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)),
                     None)
        return saved or transformers.AutoModelForSeq2SeqLM, "text2text-generation"
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return transformers.AutoModelForCausalLM, "text-generation"
    return transformers.AutoModel, "feature-extraction"


def _load_hf(key: str, path: Path) -> TorchEngine:
    """A Hugging Face model directory: Auto classes, tokenizer in ``artifacts``."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model_class, task = _hf_class(transformers, config)
    with hfprogress.quiet():
        model = model_class.from_pretrained(path)
    if task == "text2text-generation" and not kvwarm.can_generate(model):
        task = "feature-extraction"  # saved without its head (a bare BartModel): as it is
    artifacts: dict[str, Any] = {"config": config, "task": task}
    sample: dict[str, Any] | None
    if any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        artifacts["tokenizer"] = tokenizer
        sample = dict(tokenizer(HF_WARMUP_PROMPT, return_tensors="pt"))
    else:
        sample = {"input_ids": torch.zeros((1, 8), dtype=torch.long)}
    if kvwarm.encoder_decoder(model):
        if getattr(model, "main_input_name", "input_ids") != "input_ids":
            sample = None  # (speech, images): no token ids to warm up on, no warm-up
        else:  # its forward needs the decoder's inputs too: the decoder's start token
            sample["decoder_input_ids"] = torch.tensor([[kvwarm.decoder_start(model)]])
    return TorchEngine(key, model, sample, artifacts)


def _is_aoti_archive(path: Path) -> bool:
    with zipfile.ZipFile(path) as archive:
        return any("/aotinductor/" in f"/{n}" for n in archive.namelist())


#: The engine files :func:`engine_from_path` reads, by suffix (besides model directories).
ENGINE_FILES = (".onnx", ".pt2", ".plan", ".engine")


def engine_from_path(key: str, path: str | Path, device: str) -> Engine:
    """Build the engine stored at ``path``, in the host tier, for running on ``device``.

    A directory with ``config.json``: a Hugging Face model (``TorchEngine``). ``.pt2``: an
    AOTInductor package or a ``torch.export`` program, told apart by their contents.
    ``.onnx``: ONNX Runtime. ``.plan``/``.engine``: TensorRT. Formats ``device`` cannot
    run are refused here, before anything is read.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no engine at {path}")
    suffix = path.suffix.lower()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EngineFormatError(f"{path} is a directory without config.json")
        return _load_hf(key, path)
    if suffix == ".pt2":
        if not zipfile.is_zipfile(path):
            raise EngineFormatError(f"{path} is not a .pt2 archive")
        if _is_aoti_archive(path):
            engine = AotiEngine.load(key, path)
            if device.partition(":")[0] != engine.compiled_for:
                raise EngineFormatError(f"{path} was compiled for {engine.compiled_for}, "
                                        f"not {device}")
            return engine
        return ExportedEngine.load(key, path)
    if suffix == ".onnx":
        return OnnxEngine.load(key, path)
    if suffix in (".plan", ".engine"):
        if not is_cuda(device):
            raise EngineFormatError(f"{path} is a TensorRT plan; it needs a CUDA device, "
                                    f"not {device}")
        return TensorRTEngine.load(key, path)
    raise EngineFormatError(f"{path}: unknown engine format {suffix or '(no suffix)'!r}; "
                            f"expected a model directory, {', '.join(ENGINE_FILES)}")
