"""Precision affinity (MISSION §3.2): the option, matching precisions to devices, the
INT8 quantisation gate, and serving a real (tiny, local) model at each precision."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from sits_queue.broker.affinity import (
    AffinityPolicy,
    Candidate,
    Warm,
    choose,
    lua_args,
    precision_profile,
    precision_weights,
)
from sits_queue.broker.keys import priority_level
from sits_queue.broker.meta import WaitingMeta
from sits_queue.cache import precision
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidTaskOptions, ModelLoadError
from sits_queue.options import batch_key, from_header, resolve
from sits_queue.workers.devices import KNOWN_GPUS
from sits_queue.workers.fleet import device_peaks

CONFIG = SitsConfig()


def peaks(name: str) -> dict[str, float]:
    return {p: v / 1e12 for p, v in KNOWN_GPUS[name].peak_flops.items()}


# -- the option ----------------------------------------------------------------------------

def test_precision_is_a_validated_option_that_reaches_the_broker_record() -> None:
    opts = resolve(CONFIG, {"model": "enc"}, {"precision": "int8"})
    assert opts.precision == "int8"
    assert from_header(CONFIG, opts.to_header()) == opts
    assert WaitingMeta.from_json(WaitingMeta(opts, 1.0, "t").to_json()).options == opts
    # batches never mix precisions: they run on one engine
    assert batch_key("t", opts) == "t|enc|medium|int8"
    assert batch_key("t", resolve(CONFIG, {"model": "enc"}, {})) == "t|enc|medium"


@pytest.mark.parametrize("bad", ["int4", "FP16", "", 8])
def test_an_unknown_precision_is_refused_by_name(bad: Any) -> None:
    with pytest.raises(InvalidTaskOptions, match="precision must be one of"):
        resolve(CONFIG, {}, {"precision": bad})


# -- matching precisions to devices --------------------------------------------------------

def test_profiles_are_shares_of_the_devices_best_precision() -> None:
    assert precision_profile(peaks("T4")) == pytest.approx(
        {"fp32": 8.1 / 130, "fp16": 0.5, "int8": 1.0})
    assert precision_profile({}) == {}  # a CPU: no figures, no preferences


def test_a_mixed_fleet_sends_int8_to_the_t4_and_fp16_to_the_v100() -> None:
    fleet = [peaks("T4"), peaks("V100"), peaks("V100")]
    t4 = precision_weights(peaks("T4"), fleet, 0.5)
    v100 = precision_weights(peaks("V100"), fleet, 0.5)
    assert set(t4) == {"int8"} and t4["int8"] == 0.5  # 1.0 vs a fleet mean of 1/3: capped
    # The V100 is relatively stronger at fp16 (1.0 vs a mean of 0.83) and fp32, never int8
    assert set(v100) == {"fp16", "fp32"}
    assert v100["fp16"] == pytest.approx(0.5 * (1 / ((0.5 + 1 + 1) / 3) - 1))


@pytest.mark.parametrize("fleet", [["H200", "H200"], ["A100"], []])
def test_a_fleet_of_one_kind_matches_nothing(fleet: list[str]) -> None:
    own = peaks(fleet[0]) if fleet else peaks("A100")
    assert precision_weights(own, [peaks(n) for n in fleet], 0.5) == {}


def test_a_worker_without_figures_in_the_fleet_matches_nothing() -> None:
    """(a CPU or plain-tasks worker counted as all zeros: every GPU of a fleet of one
    kind got weights for every precision, and took any task naming one ahead of the
    head)"""
    assert precision_weights(peaks("A100"), [peaks("A100"), peaks("A100"), {}], 0.5) == {}
    assert precision_weights(peaks("T4"), [peaks("T4"), {}, peaks("V100")], 0.5) == \
        precision_weights(peaks("T4"), [peaks("T4"), peaks("V100")], 0.5)


def test_weights_scale_with_the_setting_and_zero_turns_them_off() -> None:
    fleet = [peaks("T4"), peaks("V100")]
    assert precision_weights(peaks("T4"), fleet, 0.0) == {}
    assert precision_weights(peaks("T4"), fleet, 2.0) == {"int8": 2.0}


def test_advertised_devices_give_each_workers_best_peaks() -> None:
    record = {"devices": [{"peak_tflops": {"fp16": 65.0, "int8": 130.0}},
                          {"peak_tflops": {"fp16": 125.0, "bogus": "x"}}, "junk"]}
    assert device_peaks(record) == {"fp16": 125.0, "int8": 130.0}
    assert device_peaks({}) == {} and device_peaks({"devices": "nope"}) == {}


def cand(name: str, model: str | None, q: str | None = None, prio: float = 100.0) -> Candidate:
    return Candidate(name, priority_level(prio), model, precision=q)


def test_a_task_is_warm_where_its_model_is_held_at_its_precision() -> None:
    warm = Warm({"enc@int8": 1.0, "enc": 0.5})
    assert warm.weight("enc", None, "int8") == 1.0
    assert warm.weight("enc", None, None) == 0.5
    assert warm.weight("enc", None, "fp16") == 0.0
    tasks = [cand("a", "enc", "fp16"), cand("b", "enc"), cand("c", "enc", "int8")]
    assert choose(tasks, warm, AffinityPolicy(), 0.0) == 2


def test_a_precision_weight_alone_pulls_the_matching_task() -> None:
    warm = Warm(precisions={"int8": 0.5})
    tasks = [cand("a", "m", "fp16"), cand("b", "m", "int8")]
    assert choose(tasks, warm, AffinityPolicy(), 0.0) == 1
    assert lua_args(AffinityPolicy(), warm)[-2:] == ["q:int8", "0.5"]


# -- the gate and the conversions ----------------------------------------------------------

def test_first_choice_keeps_int8_off_cuda_and_says_why() -> None:
    assert precision.first_choice("int8", "cpu") == ("int8", None)
    target, why = precision.first_choice("int8", "cuda:0")
    assert target == "fp16" and why is not None and "TensorRT" in why
    assert precision.first_choice("bf16", "cuda:0") == ("bf16", None)
    with pytest.raises(ValueError, match="precision must be one of"):
        precision.first_choice("int4", "cpu")


def test_a_request_served_as_another_shares_its_entry() -> None:
    """(int8 on a GPU, served at fp16, was converted and kept beside the fp16 entry; fp32
    of an fp32 checkpoint beside the model as loaded)"""
    from types import SimpleNamespace

    serving = precision.Serving()
    assert serving.plan("m", None, "cuda:0") == (None, None)
    assert serving.plan("m", "fp16", "cuda:0") == ("fp16", None)
    asked, meta = serving.plan("m", "int8", "cuda:0")
    assert asked == "fp16" and meta is not None
    assert (meta["requested"], meta["served"]) == ("int8", "fp16")
    assert "int8 layers are served on the CPU only" in meta["reason"]
    assert serving.plan("m", "int8", "cpu") == ("int8", None)
    # an engine a conversion did not change: later requests get the model as loaded
    same = SimpleNamespace(artifacts={"precision": {"served": "fp32"}, precision.AS_LOADED: True})
    changed = SimpleNamespace(artifacts={"precision": {"served": "fp16"},
                                         precision.AS_LOADED: False})
    assert serving.learn("m", "fp16", changed) is None
    assert serving.learn("m", "fp32", same) == "m"
    assert serving.plan("m", "fp32", "cpu") == (None, {"served": "fp32"})
    assert serving.plan("m", "fp16", "cpu") == ("fp16", None)


def test_the_gate_passes_below_the_limit_only() -> None:
    assert precision.gate(0.049, 0.05) is None
    refused = precision.gate(0.05, 0.05)
    assert refused is not None and "0.0500 >= 0.05" in refused


def test_kl_divergence_matches_the_definition() -> None:
    import torch

    p, q = torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([[2.0, 1.0, 0.0]])
    pp, qq = torch.softmax(p, -1).double(), torch.softmax(q, -1).double()
    want = float((pp * (pp / qq).log()).sum())
    assert precision.kl_divergence(p, q) == pytest.approx(want)
    assert precision.kl_divergence(p, p) == pytest.approx(0.0, abs=1e-12)
    assert precision.kl_divergence(p, q) > 0 and math.isfinite(precision.kl_divergence(p, q))


def test_kl_divergence_of_masked_classes_empty_outputs_and_nan() -> None:
    import torch

    inf = math.inf
    masked = torch.tensor([[0.0, 1.0, -inf], [2.0, -inf, -inf]])
    # a class both mask adds nothing (it made the whole KL NaN, and int8 was refused)
    assert precision.kl_divergence(masked, masked) == pytest.approx(0.0, abs=1e-12)
    close = masked + torch.tensor([[0.01, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert 0 < precision.kl_divergence(masked, close) < 1e-4
    # a class only the candidate drops, or a candidate of NaN: no stand-in
    assert precision.kl_divergence(torch.tensor([[0.0, 1.0]]),
                                   torch.tensor([[0.0, -inf]])) == inf
    assert precision.kl_divergence(torch.tensor([[0.0, 1.0]]),
                                   torch.tensor([[0.0, math.nan]])) == inf
    # outputs with no values (a batch of none, or rows of width 0): nothing differs
    assert precision.kl_divergence(torch.zeros(0, 4), torch.zeros(0, 4)) == 0.0
    assert precision.kl_divergence(torch.zeros(3, 0), torch.zeros(3, 0)) == 0.0


def test_relative_mse_matches_the_definition() -> None:
    import torch

    ref, got = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([1.5, -2.0, 2.0])
    assert precision.relative_mse(ref, got) == pytest.approx((0.25 + 0 + 1) / (1 + 4 + 9))
    assert precision.relative_mse(ref, ref) == 0.0
    zeros = torch.zeros(3)
    assert precision.relative_mse(zeros, zeros) == 0.0
    assert precision.relative_mse(zeros, ref) == math.inf  # any error against nothing
    assert precision.relative_mse(torch.zeros(0), torch.zeros(0)) == 0.0


def test_the_regression_gate_passes_below_its_limit_only() -> None:
    assert precision.gate_rel_mse(0.0009, 0.001) is None
    refused = precision.gate_rel_mse(0.001, 0.001)
    assert refused is not None and "relative MSE" in refused and ">= 0.001" in refused
    assert precision.gate_rel_mse(math.nan, 0.001) is not None


def shaped(scores: Any, shape: str) -> Any:
    """``scores`` (B, 1) in the shape a single-output model returns them."""
    return {"(B, 1)": scores, "(B,)": scores.squeeze(-1), "()": scores.sum()}[shape]


def fragile_scorer(shape: str) -> Any:
    """A score that is a tiny difference of two large activations: per-token int8
    activations wipe it out (errors of hundreds of percent)."""
    import torch

    class Fragile(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = torch.nn.Linear(16, 2, bias=False)
            with torch.no_grad():
                self.l1.weight[0] = torch.randn(16) * 100
                self.l1.weight[1] = self.l1.weight[0] + torch.randn(16) * 0.01

        def forward(self, x: Any) -> Any:
            h = self.l1(x)
            return shaped((h[:, :1] - h[:, 1:2]) * 100, shape)

    return Fragile()


def robust_scorer(shape: str) -> Any:
    """A small MLP scorer, which int8 barely moves."""
    import torch

    class Robust(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                           torch.nn.Linear(64, 1))

        def forward(self, x: Any) -> Any:
            return shaped(self.mlp(x), shape)

    return Robust()


def scorer_engine(module: Any, x: Any) -> Any:
    from sits_queue.cache.engines import TorchEngine

    return TorchEngine("scorer", module, (x,))


SCORE_SHAPES = ["(B, 1)", "(B,)", "()"]


@pytest.mark.parametrize("shape", SCORE_SHAPES)
def test_a_single_output_model_that_int8_breaks_is_refused_by_its_relative_error(
        shape: str) -> None:
    """(softmax over one value is 1 whatever it is: KL 0, and int8 passed with scores
    off by 10x; a (B,) or () output made the gate raise IndexError: the task failed)"""
    import torch

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    served = precision.convert(scorer_engine(fragile_scorer(shape), x), "int8", "cpu")
    meta = served.artifacts["precision"]
    assert meta["served"] == "fp32" and meta["kl"] is None
    assert meta["rel_mse"] > precision.DEFAULT_MAX_REL_MSE
    assert "relative MSE" in meta["reason"] and "full precision" in meta["reason"]
    assert not any(quantized(m) for m in served.module.modules())


@pytest.mark.parametrize("shape", SCORE_SHAPES)
def test_a_single_output_model_int8_keeps_close_is_served_at_int8(shape: str) -> None:
    import torch

    torch.manual_seed(0)
    module, x = robust_scorer(shape), torch.randn(8, 16)
    expected = module(x).detach()
    served = precision.convert(scorer_engine(module, x), "int8", "cpu")
    meta = served.artifacts["precision"]
    assert meta["served"] == "int8" and meta["reason"] is None and meta["kl"] is None
    assert 0 < meta["rel_mse"] < precision.DEFAULT_MAX_REL_MSE
    served.to_device("cpu")
    got = served(x)
    assert got.shape == expected.shape
    assert precision.relative_mse(expected, got) == pytest.approx(meta["rel_mse"])


def test_a_model_that_is_one_linear_layer_is_quantised_and_one_with_none_refused() -> None:
    """(a bare nn.Linear was walked for children only: nothing quantised, yet the result
    said int8; a model with no linear layer said int8 too)"""
    import torch

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    bare = precision.convert(scorer_engine(torch.nn.Linear(16, 32), x), "int8", "cpu")
    assert bare.artifacts["precision"]["served"] == "int8"
    assert quantized(bare.module)
    convs = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3), torch.nn.ReLU())
    none = precision.convert(scorer_engine(convs, torch.randn(2, 4, 16)), "int8", "cpu")
    meta = none.artifacts["precision"]
    assert meta["served"] == "fp32" and "no linear layers" in meta["reason"]


def test_a_model_returning_a_dict_is_gated_on_its_first_tensor() -> None:
    """(the gate knew tensors, tuples and logits only: int8 on a model returning a dict
    failed the load instead of being measured)"""
    import torch

    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.cls = torch.nn.Linear(16, 32), torch.nn.Linear(32, 5)

        def forward(self, x: Any) -> dict[str, Any]:
            return {"class_logits": self.cls(torch.relu(self.body(x))), "note": "meta"}

    torch.manual_seed(0)
    served = precision.convert(scorer_engine(TwoHeads(), torch.randn(8, 16)), "int8", "cpu")
    meta = served.artifacts["precision"]
    assert meta["served"] == "int8" and meta["kl"] is not None
    assert quantized(served.module.cls)

    class Labels(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(16, 2)

        def forward(self, x: Any) -> dict[str, Any]:
            return {"labels": ["yes" if v > 0 else "no" for v in self.head(x)[:, 0]]}

    # and one whose output holds no tensor at all is served at full precision, saying so
    meta = precision.convert(scorer_engine(Labels(), torch.randn(4, 16)), "int8",
                             "cpu").artifacts["precision"]
    assert meta["served"] == "fp32" and "holds no tensor" in meta["reason"]


def test_a_model_the_int8_layers_break_is_served_at_full_precision() -> None:
    """(the gate's calibration run raised from the int8 copy, and the task failed)"""
    import torch

    class ReadsWeight(torch.nn.Module):
        """Uses its layer's weight directly, as tied heads do: int8 weights break it."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x: Any) -> Any:
            return self.lin(x) + x @ self.lin.weight.t()

    torch.manual_seed(0)
    x = torch.randn(2, 8)
    served = precision.convert(scorer_engine(ReadsWeight(), x), "int8", "cpu")
    meta = served.artifacts["precision"]
    assert meta["served"] == "fp32" and meta["kl"] is None and meta["rel_mse"] is None
    assert meta["reason"].startswith("int8 refused by the quantisation gate: the int8 "
                                     "model failed on its calibration inputs (RuntimeError")
    assert "served at full precision" in meta["reason"]
    served.to_device("cpu")
    assert served(x).shape == (2, 4)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sits_queue.models.tiny import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("lm") / "lm", seed=3)


def quantized(module: Any) -> bool:
    from sits_queue.cache.int8 import Int8Linear

    return isinstance(module, Int8Linear)


def lm(path: Path) -> Any:
    from sits_queue.cache.engines import engine_from_path

    return engine_from_path("lm", path, "cpu")


def test_int8_quantises_every_linear_gpt2s_conv1d_included(lm_dir: Path) -> None:
    import torch

    engine = lm(lm_dir)
    size = engine.size_bytes()
    served = precision.convert(engine, "int8", "cpu")
    layers = list(served.module.modules())
    assert not any(type(m).__name__ == "Conv1D" or type(m) is torch.nn.Linear for m in layers)
    assert sum(quantized(m) for m in layers) == 2 * 4 + 1  # 4 per block (2 blocks), lm_head
    meta = served.artifacts["precision"]
    assert meta["served"] == "int8" and 0 <= meta["kl"] < 0.05 and meta["reason"] is None
    assert served.key == "lm@int8" and served.size_bytes() < size  # int8 weights
    assert engine.released  # the full-precision copy is not kept
    served.to_device("cpu")
    out = served(**served.artifacts["tokenizer"]("hello there", return_tensors="pt"))
    assert torch.isfinite(out.logits).all()


def test_a_strict_gate_serves_full_precision_and_reports_the_kl(lm_dir: Path) -> None:
    served = precision.convert(lm(lm_dir), "int8", "cpu", max_kl=1e-12)
    meta = served.artifacts["precision"]
    assert meta["served"] == "fp32" and meta["kl"] > 0
    assert "quantisation gate" in meta["reason"]
    assert not any(quantized(m) for m in served.module.modules())


@pytest.mark.parametrize(("wanted", "dtype"), [("fp16", "float16"), ("bf16", "bfloat16")])
def test_casts_halve_the_weights(lm_dir: Path, wanted: str, dtype: str) -> None:
    engine = lm(lm_dir)
    size = engine.size_bytes()
    served = precision.convert(engine, wanted, "cpu")
    assert str(next(served.module.parameters()).dtype) == f"torch.{dtype}"
    assert served.size_bytes() == size // 2
    assert served.artifacts["precision"] == {"requested": wanted, "served": wanted,
                                             "kl": None, "rel_mse": None, "reason": None}


@pytest.mark.parametrize(("wanted", "max_kl"), [("fp32", 0.05), ("int8", 1e-12)])
def test_full_precision_is_served_in_fp32_from_a_half_checkpoint(
        lm_dir: Path, wanted: str, max_kl: float) -> None:
    """A checkpoint saved in fp16 loads in fp16: fp32 asked, or an int8 the gate
    refused, was served at fp16 while the result said fp32."""
    import torch

    engine = lm(lm_dir)
    engine.module.half()  # as from_pretrained loads an fp16 checkpoint
    served = precision.convert(engine, wanted, "cpu", max_kl=max_kl)
    assert served.artifacts["precision"]["served"] == "fp32"
    assert {p.dtype for p in served.module.parameters()} == {torch.float32}
    served.to_device("cpu")
    out = served(**served.artifacts["tokenizer"]("hello there", return_tensors="pt"))
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()


def test_only_torch_engines_take_a_precision(tmp_path: Path) -> None:
    import torch

    from sits_queue.cache.engines import OnnxEngine, export_onnx

    module = torch.nn.Linear(4, 2)
    path = export_onnx(module, (torch.zeros(1, 4),), tmp_path / "m.onnx")
    with pytest.raises(ModelLoadError, match="onnxruntime engine; a precision can only be"):
        precision.convert(OnnxEngine.load("m", path), "int8", "cpu")


# -- int8 is row-invariant: a prompt decodes the same alone, batched, or after reused KV -----

def test_an_int8_layer_gives_each_row_what_it_gives_that_row_alone() -> None:
    """Per-token activation scales and exact int32 sums: a row's output does not depend
    on the other rows (a per-tensor scale, as torch.ao's dynamic quantisation uses, is set
    by the batch's largest activation, here the loud row's)."""
    import torch

    from sits_queue.cache.int8 import Int8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 24)
    layer = Int8Linear(linear.weight, linear.bias)
    quiet, loud, padding = torch.randn(1, 48) * 0.01, torch.randn(1, 48) * 50, torch.zeros(1, 48)
    batch = torch.cat([quiet, loud, padding, quiet])
    out = layer(batch)
    for row in range(4):
        assert torch.equal(out[row], layer(batch[row:row + 1])[0]), row
    assert torch.equal(out[2], layer(padding)[0]) and torch.isfinite(out).all()
    # still the linear map, to int8's accuracy
    want = linear(batch).detach()
    for row in range(4):
        assert (out[row] - want[row]).abs().max() <= 0.02 * want[row].abs().max() + 1e-6


def test_an_int8_layer_keeps_the_input_shape_and_dtype() -> None:
    import torch

    from sits_queue.cache.int8 import Int8Linear, int8_matmul

    layer = Int8Linear(torch.randn(5, 7), None)
    assert layer(torch.randn(2, 3, 7)).shape == (2, 3, 5)
    assert layer(torch.randn(0, 7)).shape == (0, 5)
    assert layer(torch.randn(4, 7, dtype=torch.float64)).dtype == torch.float64
    a = torch.randint(-127, 128, (3, 7), dtype=torch.int8)
    b = torch.randint(-127, 128, (7, 5), dtype=torch.int8)
    assert torch.equal(int8_matmul(a, b), (a.long() @ b.long()).int())


def test_an_int8_model_decodes_each_prompt_in_a_batch_as_alone(lm_dir: Path) -> None:
    import torch

    from sits_queue.workers import inference
    from sits_queue.workers.batched import Call
    from sits_queue.workers.batchgen import generate_calls

    served = precision.convert(lm(lm_dir), "int8", "cpu")
    served.to_device("cpu")
    assert served.artifacts["precision"]["served"] == "int8"
    tokenizer = served.artifacts["tokenizer"]
    short, long = "the cache warms", "a queue of work that runs long and longer every day"
    # the short prompt's last logits, alone and left-padded beside a longer one
    with torch.inference_mode():
        one = served(**tokenizer(short, return_tensors="pt")).logits[0, -1]
        tokenizer.padding_side = "left"
        both = tokenizer([short, long], return_tensors="pt", padding=True)
        positions = (both["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        padded = served(**both, position_ids=positions).logits[0, -1]
    assert (padded - one).abs().max() < 1e-4  # per-tensor int8: ~1e-2
    prompts = [short, long, "ok", "Every task loads the prompt quickly.", "the beat"]
    calls = [Call(str(i), (p,), {"max_new_tokens": 8 + i, "stop_at_eos": False})
             for i, p in enumerate(prompts)]
    with rt_active(served):
        got = generate_calls(served, calls)
    for i, (prompt, out) in enumerate(zip(prompts, got, strict=True)):
        assert out["text"] == inference.generate(served, prompt, max_new_tokens=8 + i,
                                                 stop_at_eos=False)["text"], prompt


def test_an_int8_model_decodes_the_same_after_a_reused_kv_prefix(lm_dir: Path) -> None:
    import torch

    from sits_queue.cache import kvwarm
    from sits_queue.cache.prefix import PrefixStore
    from sits_queue.workers import inference

    served = precision.convert(lm(lm_dir), "int8", "cpu")
    served.to_device("cpu")
    base = "the worker loads the prompt a batch of tokens warm engines kv cache " * 2
    # the last logits after a prefix's KV and the rest, against one full prefill
    ids = served.artifacts["tokenizer"](base + "evicts", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        start = served(input_ids=ids[:, :-4], use_cache=True)
        rest = served(input_ids=ids[:, -4:],
                      **{kvwarm.cache_kwarg(served.module): kvwarm.cache_of(start)})
        full_logits = served(input_ids=ids).logits
    assert (rest.logits[0, -1] - full_logits[0, -1]).abs().max() < 1e-4  # per-tensor: ~1e-2
    store = PrefixStore(2**26)
    with rt_active(served, store):
        inference.generate(served, base + "quickly under load", max_new_tokens=1,
                           stop_at_eos=False)
        got = inference.generate(served, base + "evicts", max_new_tokens=16,
                                 stop_at_eos=False)
    assert got["cached_tokens"] > 0
    full = inference.generate(served, base + "evicts", max_new_tokens=16, stop_at_eos=False)
    assert got["text"] == full["text"]


def rt_active(engine: Any, store: Any = None) -> Any:
    from sits_queue.workers import runtime as rt

    return rt.activated(rt.ActiveTask(engine.key, CONFIG.quota("high"), engine.size_bytes(),
                                      "cpu", prefixes=store))


@pytest.mark.parametrize("wanted", ["fp16", "bf16", "int8"])
def test_a_plain_module_with_positional_samples_is_served_at_a_precision(wanted: str) -> None:
    """(its fp32 warm-up sample reached the cast module, "mat1 and mat2 must have the same
    dtype", and the int8 gate said the model had no sample inputs)"""
    import torch

    from sits_queue.cache.engines import TorchEngine

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                 torch.nn.Linear(16, 4))
    x = torch.randn(2, 8)
    expected = module(x).detach()
    served = precision.convert(TorchEngine("mlp", module, (x,)), wanted, "cpu")
    served.to_device("cpu")  # the warm-up runs the sample through it
    assert served.artifacts["precision"]["served"] == wanted
    got = served(x)  # callers keep passing fp32
    assert torch.allclose(got.float(), expected, atol=0.05)


def test_int8_of_a_model_with_nothing_to_measure_it_on_is_served_at_full_precision() -> None:
    import torch

    from sits_queue.cache.engines import TorchEngine

    # Given a module registered without sample inputs, and no tokenizer
    module = torch.nn.Sequential(torch.nn.Linear(8, 4))
    served = precision.convert(TorchEngine("mlp", module, None), "int8", "cpu")
    # Then int8 is refused, saying why and how to give the gate an input, and the model
    # is served at full precision (the task failed with ModelLoadError, though the
    # README promises full precision whenever int8 is not served)
    said = served.artifacts["precision"]
    assert said["served"] == "fp32" and said["kl"] is None
    assert "no sample inputs (app.model(..., sample_inputs=...)) or tokenizer" in \
        said["reason"] and said["reason"].endswith("served at full precision")
    served.to_device("cpu")
    x = torch.randn(2, 8)
    assert torch.equal(served(x), module(x))


def test_a_child_says_which_entry_serves_a_request_made_under_another_key() -> None:
    from sits_queue.cache.precision import Serving

    serving = Serving()
    serving.aliases["gpt@fp32"] = (None, {"precision": "fp32"})  # learnt: as loaded
    serving.aliases["gone@fp32"] = (None, {})  # its entry left the cache since
    on_gpu = serving.served_keys(["gpt", "lm@fp16", "lm@bf16"], "cuda:0")
    assert on_gpu == {"gpt@fp32": "gpt", "lm@int8": "lm@fp16"}
    # on a CPU int8 is int8's own
    assert serving.served_keys(["lm@fp16"], "cpu") == {}
