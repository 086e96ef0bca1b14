"""Engine backends against one contract (STYLE habit 8), tiny real models, the real cache.

Every backend that runs on this machine gets the same :class:`TestEngineContract`: same
outputs as the torch module it came from, tiers round-trip, warm-up, release. The
AOTInductor backend compiles C++ (tens of seconds), so it is marked ``slow``; TensorRT
lives in ``tests/gpu``. No GPU, no network: every model is built here.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
import torch

from sits_queue.cache.contract import Engine, EngineError, EngineNotResident, EngineReleased
from sits_queue.cache.engines import (
    AotiEngine,
    EngineFormatError,
    ExportedEngine,
    OnnxEngine,
    TorchEngine,
    compile_aoti,
    engine_from_path,
    export_onnx,
)
from sits_queue.cache.pool import EngineCache
from sits_queue.models.tiny import (
    MARKER,
    build_tiny_causal_lm,
    build_tiny_encoder,
    build_tiny_zoo,
)

DEVICE = "cpu"
#: fp32 on one CPU, same kernels or not: differences stay at rounding level.
ATOL = 1e-5


class Scorer(torch.nn.Module):
    """Token ids and a float input in, one tensor out: exercises int and float I/O."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.lin = torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, ids: Any, scale: Any) -> Any:
        hidden = self.emb(ids).mean(dim=1)
        return self.norm(torch.nn.functional.gelu(self.lin(hidden))) * scale


def scorer_inputs(seed: int) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 8), generator=gen), torch.rand(2, 1, generator=gen)


@pytest.fixture(scope="module")
def scorer() -> Scorer:
    torch.manual_seed(0)
    model = Scorer()
    model.eval()
    return model


@pytest.fixture(scope="module")
def artefacts(scorer: Scorer, tmp_path_factory: pytest.TempPathFactory
              ) -> Callable[[str], Path]:
    """Backend name -> its artefact on disk, built on first use (AOTI only when asked)."""
    root = tmp_path_factory.mktemp("artefacts")
    built: dict[str, Path] = {}

    def get(backend: str) -> Path:
        if backend not in built:
            sample = scorer_inputs(0)
            if backend == "torch_export":
                built[backend] = root / "scorer.pt2"
                torch.export.save(torch.export.export(scorer, sample), built[backend])
            elif backend == "onnxruntime":
                built[backend] = export_onnx(scorer, sample, root / "scorer.onnx")
            elif backend == "aoti":
                built[backend] = compile_aoti(scorer, sample, root / "scorer-aoti.pt2")
        return built[backend]

    return get


BACKENDS = ["torch", "torch_export", "onnxruntime", pytest.param("aoti", marks=pytest.mark.slow)]


class TestEngineContract:
    """The contract every backend keeps; ``engine`` is a fresh one in the host tier."""

    @pytest.fixture(params=BACKENDS)
    def engine(self, request: pytest.FixtureRequest, scorer: Scorer,
               artefacts: Callable[[str], Path]) -> Engine:
        backend: str = request.param
        if backend == "torch":
            clone = Scorer().eval()
            clone.load_state_dict(scorer.state_dict())
            return TorchEngine("scorer", clone, scorer_inputs(0))
        built = engine_from_path("scorer", artefacts(backend), DEVICE)
        assert built.backend == backend
        return built

    def test_starts_in_the_host_tier_and_refuses_to_run_there(self, engine: Engine) -> None:
        assert engine.tier == "host" and engine.device is None and not engine.released
        with pytest.raises(EngineNotResident, match="to_device"):
            engine(*scorer_inputs(1))

    def test_size_is_positive(self, engine: Engine) -> None:
        # Embedding 64x16 + Linear 16x8 + LayerNorm: 1,176 fp32 values.
        assert engine.size_bytes() >= 1176 * 4

    def test_same_outputs_as_the_torch_module(self, engine: Engine, scorer: Scorer) -> None:
        engine.to_device(DEVICE)
        for seed in (1, 2):
            inputs = scorer_inputs(seed)
            torch.testing.assert_close(engine(*inputs), scorer(*inputs), atol=ATOL, rtol=0)

    def test_tier_round_trip_keeps_outputs(self, engine: Engine) -> None:
        promote_ms = engine.to_device(DEVICE)
        inputs = scorer_inputs(3)
        before = engine(*inputs)
        demote_ms = engine.to_host()
        assert engine.tier == "host" and promote_ms >= 0 and demote_ms >= 0
        with pytest.raises(EngineNotResident):
            engine(*inputs)
        engine.to_device(DEVICE)
        assert (engine.tier, engine.device) == ("device", DEVICE)
        torch.testing.assert_close(engine(*inputs), before, atol=0, rtol=0)

    def test_warmup_takes_time_on_the_device_only(self, engine: Engine) -> None:
        with pytest.raises(EngineNotResident):
            engine.warmup()
        engine.to_device(DEVICE)
        assert engine.warmup() > 0

    def test_release_frees_and_forbids_use(self, engine: Engine) -> None:
        engine.to_device(DEVICE)
        engine.warmup()
        payload = _payload(engine)
        engine.release()
        engine.release()  # idempotent
        assert engine.released and engine.device is None
        for use in (lambda: engine(*scorer_inputs(1)), lambda: engine.to_device(DEVICE),
                    engine.to_host, engine.warmup):
            with pytest.raises(EngineReleased):
                use()
        if payload is not None:
            gc.collect()
            assert payload() is None, "the engine's weights are still referenced"


def _payload(engine: Engine) -> weakref.ref[Any] | None:
    """A weak reference to what holds the engine's memory, where Python can see it."""
    if isinstance(engine, TorchEngine):
        return weakref.ref(engine.module)
    if isinstance(engine, OnnxEngine):
        return weakref.ref(engine.session)
    return None


def test_exported_program_keeps_its_sample_inputs(artefacts: Callable[[str], Path]) -> None:
    engine = ExportedEngine.load("scorer", artefacts("torch_export"))
    engine.to_device(DEVICE)
    assert engine.warmup() > 0


class ScaledByKeyword(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: Any, scale: Any = None) -> Any:
        return self.lin(x) * scale


def test_a_program_exported_with_keyword_inputs_warms_up_with_them(tmp_path: Path) -> None:
    # Given a program exported with a positional and a keyword example input
    module = ScaledByKeyword().eval()
    x, scale = torch.randn(2, 4), torch.full((2, 4), 2.0)
    path = tmp_path / "scaled.pt2"
    torch.export.save(torch.export.export(module, (x,), {"scale": scale}), path)
    # When the cache loads it (the warm-up ran it without its keyword input: "Ran into a
    # kwarg keyword mismatch", every load failed)
    cache = EngineCache(DEVICE, 1 << 30, 1 << 30, context=lambda: 0.0)
    engine, cold = cache.get("scaled", lambda: engine_from_path("scaled", path, DEVICE))
    # Then it warmed up on both, and runs as the module does
    assert cold.source == "disk" and cold.warmup_ms > 0
    torch.testing.assert_close(engine(x, scale=scale), module(x, scale=scale), atol=ATOL,
                               rtol=0)


@pytest.mark.parametrize("layer", [torch.nn.Linear(16, 4),
                                   torch.nn.Sequential(torch.nn.Linear(16, 4))])
def test_a_program_of_stock_layers_is_promoted_and_runs(
        layer: torch.nn.Module, tmp_path: Path) -> None:
    """(their forward's argument is named ``input``, like the builtin: the deepcopy made
    for the device renamed it in the graph, and the move refused every such program)"""
    x = torch.randn(3, 16)
    path = tmp_path / "stock.pt2"
    torch.export.save(torch.export.export(layer.eval(), (x,)), path)
    cache = EngineCache(DEVICE, 1 << 30, 1 << 30, context=lambda: 0.0)
    engine, cold = cache.get("stock", lambda: engine_from_path("stock", path, DEVICE))
    assert cold.source == "disk"
    torch.testing.assert_close(engine(x), layer(x), atol=ATOL, rtol=0)
    # and again after a demotion, from its host copy
    again = ExportedEngine.load("stock", path)
    again.to_device(DEVICE)
    again.to_host()
    again.to_device(DEVICE)
    torch.testing.assert_close(again(x), layer(x), atol=ATOL, rtol=0)


def test_an_exported_program_keeps_its_host_copy_on_the_host(
        artefacts: Callable[[str], Path]) -> None:
    # "meta" stands in for a GPU here: promotion moves a copy there, demotion drops it,
    # and the host tier still has its weights on the host (the next promotion copies them)
    engine = ExportedEngine.load("scorer", artefacts("torch_export"))
    program = engine._program
    assert program is not None
    engine.to_device("meta")
    assert {t.device.type for t in program.state_dict.values()} == {"cpu"}
    engine.to_host()
    engine.to_device(DEVICE)
    assert engine.warmup() > 0


def test_an_onnx_model_with_inputs_it_cannot_synthesise_loads_without_warm_up() -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)], "int16-in",
        [helper.make_tensor_value_info("x", TensorProto.INT16, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    engine = OnnxEngine("int16", model.SerializeToString())
    onnx.checker.check_model(model)
    engine.to_device(DEVICE)
    assert engine.warmup() == 0.0  # (a KeyError on tensor(int16) failed the load)
    assert engine(torch.tensor([3, 4], dtype=torch.int16)).tolist() == [3.0, 4.0]


def _onnx_model(nodes: list[Any], inputs: list[Any], outputs: list[Any]) -> bytes:
    import onnx
    from onnx import helper

    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs), opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def test_an_onnx_model_with_a_bfloat16_input_warms_up_and_runs() -> None:
    """(numpy has no bfloat16: the warm-up's synthesised input failed the load)"""
    from onnx import TensorProto, helper

    engine = OnnxEngine("bf16", _onnx_model(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])]))
    engine.to_device(DEVICE)
    assert engine.warmup() > 0
    x = torch.tensor([[1.5, -2.0, 0.25]], dtype=torch.bfloat16)
    assert engine(x).tolist() == [[1.5, -2.0, 0.25]]


def test_an_onnx_model_with_a_bfloat16_output_is_refused_naming_it() -> None:
    from onnx import TensorProto, helper

    engine = OnnxEngine("bf16-out", _onnx_model(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.BFLOAT16)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [1, 3])]))
    with pytest.raises(EngineFormatError, match=r"outputs \['y'\] are bfloat16.*cast them"):
        engine.to_device(DEVICE)
    assert engine.tier == "host"


def test_an_onnx_classifier_s_map_output_comes_back_as_onnxruntime_gives_it() -> None:
    """(every output went through torch.from_numpy: a ZipMap output, a skl2onnx
    classifier's by default, failed the load)"""
    from onnx import TensorProto, helper

    engine = OnnxEngine("clf", _onnx_model(
        [helper.make_node("Identity", ["X"], ["scores"]),
         helper.make_node("ZipMap", ["X"], ["probs"], domain="ai.onnx.ml",
                          classlabels_int64s=[0, 1, 2])],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 3]),
         helper.make_value_info("probs", helper.make_sequence_type_proto(
             helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(
                 TensorProto.FLOAT, []))))]))
    cache = EngineCache(DEVICE, 10**6, 10**6)
    engine, _ = cache.get("clf", lambda: engine)
    scores, probs = engine(torch.tensor([[0.25, 0.5, 0.25]]))
    assert isinstance(scores, torch.Tensor) and scores.tolist() == [[0.25, 0.5, 0.25]]
    assert probs == [{0: 0.25, 1: 0.5, 2: 0.25}]


@pytest.mark.parametrize(("args", "kwargs", "said"), [
    # a third positional argument was dropped without a word
    ((1.0, 2.0, 3.0), {}, r"'add' takes 2 inputs \['x', 'y'\], got 3 positional"),
    # y by position and by name: the keyword won without a word
    ((1.0, 2.0), {"y": 3.0}, r"inputs \['y'\] given by position and by name"),
    ((1.0,), {}, r"inputs \['y'\] not given"),
])
def test_an_onnx_call_that_does_not_give_every_input_once_is_refused(
        args: tuple[float, ...], kwargs: dict[str, float], said: str) -> None:
    from onnx import TensorProto, helper

    engine = OnnxEngine("add", _onnx_model(
        [helper.make_node("Add", ["x", "y"], ["z"])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("x", "y")],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])]))
    engine.to_device(DEVICE)
    as_tensor = [torch.tensor([v]) for v in args]
    with pytest.raises(EngineError, match=said):
        engine(*as_tensor, **{k: torch.tensor([v]) for k, v in kwargs.items()})
    assert engine(torch.tensor([1.0]), y=torch.tensor([2.0])).tolist() == [3.0]


@pytest.mark.slow
def test_aoti_package_for_cpu_is_refused_on_cuda(artefacts: Callable[[str], Path]) -> None:
    with pytest.raises(EngineFormatError, match="compiled for cpu"):
        engine_from_path("scorer", artefacts("aoti"), "cuda:0")
    engine = AotiEngine.load("scorer", artefacts("aoti"))
    assert engine.compiled_for == "cpu"


# -- choosing the backend ---------------------------------------------------------------------

def test_engine_from_path_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        engine_from_path("x", tmp_path / "missing.onnx", DEVICE)
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"\0" * 16)
    with pytest.raises(EngineFormatError, match="needs a CUDA device"):
        engine_from_path("x", plan, DEVICE)
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(EngineFormatError, match=r"unknown engine format '\.bin'"):
        engine_from_path("x", tmp_path / "weights.bin", DEVICE)
    with pytest.raises(EngineFormatError, match=r"without config\.json"):
        engine_from_path("x", tmp_path, DEVICE)
    (tmp_path / "bad.pt2").write_bytes(b"not a zip")
    with pytest.raises(EngineFormatError, match=r"not a \.pt2 archive"):
        engine_from_path("x", tmp_path / "bad.pt2", DEVICE)


# -- Hugging Face models built here -----------------------------------------------------------

@pytest.fixture(scope="module")
def lm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "tiny-lm", seed=0)


def test_causal_lm_generates_with_its_kv_cache(lm_path: Path) -> None:
    engine = engine_from_path("lm", lm_path, DEVICE)
    assert isinstance(engine, TorchEngine)
    assert engine.artifacts["task"] == "text-generation"
    engine.to_device(DEVICE)
    assert engine.warmup() > 0
    tokenizer = engine.artifacts["tokenizer"]
    prompt = tokenizer("The worker loads the prompt", return_tensors="pt")
    model: Any = engine.module  # a GPT2LMHeadModel; nn.Module's type lacks generate()
    out = model.generate(**prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         use_cache=True, return_dict_in_generate=True)
    assert out.sequences.shape == (1, prompt["input_ids"].shape[1] + 6)
    assert out.past_key_values is not None  # decoding kept and reused a KV cache
    assert isinstance(tokenizer.decode(out.sequences[0]), str)


def test_encoder_gives_embeddings(tmp_path: Path) -> None:
    engine = engine_from_path("enc", build_tiny_encoder(tmp_path / "enc"), DEVICE)
    assert engine.artifacts["task"] == "feature-extraction"
    engine.to_device(DEVICE)
    batch = engine.artifacts["tokenizer"](["a model", "the cache warms engines"],
                                          padding=True, return_tensors="pt")
    hidden = engine(**batch).last_hidden_state
    assert hidden.shape[:2] == batch["input_ids"].shape and hidden.shape[2] == 64


def test_builds_are_deterministic_and_idempotent(tmp_path: Path, lm_path: Path) -> None:
    again = build_tiny_causal_lm(lm_path, seed=0)
    assert again == lm_path
    marker_mtime = (lm_path / MARKER).stat().st_mtime_ns
    build_tiny_causal_lm(lm_path, seed=0)
    assert (lm_path / MARKER).stat().st_mtime_ns == marker_mtime  # reused, not rebuilt
    twin = build_tiny_causal_lm(tmp_path / "twin", seed=0)
    assert (twin / "model.safetensors").read_bytes() == \
        (lm_path / "model.safetensors").read_bytes()
    other = build_tiny_causal_lm(lm_path, seed=1)  # another spec: rebuilt in place
    assert (other / "model.safetensors").read_bytes() != \
        (twin / "model.safetensors").read_bytes()


def test_zoo_sizes_grow_and_the_cache_holds_them_in_two_tiers(tmp_path: Path) -> None:
    paths = build_tiny_zoo(tmp_path / "zoo", n_models=3, seed=0)
    sizes = [(p / "model.safetensors").stat().st_size for p in paths]
    assert sizes == sorted(sizes) and sizes[0] >= 1_000_000 and sizes[-1] <= 8_500_000

    # Given a device pool that holds only the largest model, and a host pool for the rest
    loads: dict[str, int] = {}

    def loader(path: Path) -> Callable[[], Engine]:
        def load() -> Engine:
            loads[path.name] = loads.get(path.name, 0) + 1
            return engine_from_path(path.name, path, DEVICE)
        return load

    cache = EngineCache(DEVICE, sizes[-1] + 1024, sum(sizes), context=lambda: 0.0)
    small, big = paths[0], paths[-1]
    # When two models alternate
    cache.get(small.name, loader(small))
    cache.get(big.name, loader(big))
    engine, cold = cache.get(small.name, loader(small))
    # Then the second visit is a promotion from host memory, not a load from disk
    assert cold.source == "host" and cold.load_ms == 0 and loads == {small.name: 1,
                                                                      big.name: 1}
    assert cache.warm() == {small.name: "device", big.name: "host"}
    prompt = engine.artifacts["tokenizer"]("warm", return_tensors="pt")
    assert engine(**prompt).logits.shape[-1] == engine.artifacts["config"].vocab_size
