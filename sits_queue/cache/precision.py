"""Serving a model at a precision (MISSION §3.2): FP16/BF16 casts, INT8 by dynamic
quantisation, and the gate that keeps INT8 only where it barely changes the model.

A task may ask for ``precision="fp32"|"fp16"|"bf16"|"int8"`` (the SITS option). The
worker's cache holds each precision of a model as its own engine (``<model>@<precision>``),
made from the model as loaded:

* fp16 / bf16: a copy of the module cast to that type;
* int8: a copy whose linear layers (and GPT-2's ``Conv1D``, read as the equivalent
  linear map) are :class:`Int8Linear`: int8 weights with one scale per output channel,
  activations quantised to int8 on the fly with one scale **per token**, products summed
  exactly in int32 (``torch._int_mm``). Per token, not per tensor as
  ``torch.ao.quantization.quantize_dynamic`` does: a token's output then depends on its
  own activations only, so a prompt decodes the same alone, in a padded batch, or after
  a reused KV prefix (a per-tensor scale is set by the largest activation of the whole
  batch, padding included, and flipped greedy tokens). Kept only if the **quantisation
  gate** passes: over calibration inputs (the engine's warm-up
  sample and :data:`CALIBRATION_TEXTS` through its tokenizer), the mean KL divergence
  between the softmax of the original's and the quantised model's output activations
  (logits, else the last hidden state) must stay under ``int8_max_kl`` (0.05, the
  source's figure). A model with one output per row (a scorer or regressor: shape
  ``(B, 1)``, ``(B,)`` or a scalar) has no distribution to compare (softmax over one
  value is 1, KL 0 whatever the error): its outputs' relative mean squared error
  (:func:`relative_mse`) must stay under :data:`DEFAULT_MAX_REL_MSE` instead. Otherwise
  the model is served at full precision and the result says why, with what it measured.

On a GPU an int8 request is served at fp16 (the reason says so): ``torch._int_mm`` has
CUDA kernels, but with shape rules (more than 16 rows, sizes in multiples of 8) this
module has not been checked against on a GPU yet; a real int8 GPU engine is a TensorRT plan built
with int8 calibration, registered as its own model. Only torch modules can be cast or
quantised here; an exported, ONNX or TensorRT engine is served as it was built.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sits_queue.broker.affinity import engine_key
from sits_queue.cache import kvwarm
from sits_queue.cache.contract import move
from sits_queue.errors import ModelLoadError
from sits_queue.options import PRECISIONS

#: §3.2: INT8 only when the KL divergence of activations stays below this.
DEFAULT_MAX_KL = 0.05
#: The gate for single-value outputs (no distribution for a KL): INT8 only when the
#: relative MSE of the outputs stays below this, a relative RMS error of about 3%.
DEFAULT_MAX_REL_MSE = 1e-3
#: Varied text for the gate's calibration pass (the engine's warm-up sample comes too).
CALIBRATION_TEXTS = (
    "The quarterly report shows revenue up four percent on the previous year.",
    "Translate to French: the train leaves at seven in the morning.",
    "def add(a, b):\n    return a + b",
    "Patient presents with mild fever and a persistent cough for three days.",
    "Summarise: the committee approved the budget after a long debate.",
    "Q: What is the capital of Australia? A:",
    "Error 503: the upstream service did not answer within 30 seconds.",
    "She walked to the window, looked at the rain, and decided to stay home.",
)


@dataclass(frozen=True)
class Served:
    """What a precision request got: the precision served, what the int8 gate measured
    (the KL, or for single-value outputs the relative MSE), why."""

    requested: str
    served: str
    kl: float | None = None
    reason: str | None = None
    rel_mse: float | None = None

    def meta(self) -> dict[str, Any]:
        return {"requested": self.requested, "served": self.served,
                "kl": None if self.kl is None else round(self.kl, 6),
                # (significant digits: a relative MSE of 1e-7 must not read as 0)
                "rel_mse": None if self.rel_mse is None else float(f"{self.rel_mse:.6g}"),
                "reason": self.reason}


#: In a converted engine's artifacts: True when no conversion took place (fp32 asked of
#: an fp32 checkpoint, an int8 the gate refused): it is the model as loaded.
AS_LOADED = "as_loaded"


@dataclass
class Serving:
    """Which warm-cache entry serves a precision request, in one pool child. A request
    served as another one is shares that one's entry rather than a copy of its weights:
    int8 on a GPU (served at fp16) gets ``<model>@fp16``; fp32 of an fp32 checkpoint,
    or an int8 the gate refused, the model as loaded, once a conversion has shown it."""

    #: Requested key -> (the precision whose entry serves it, what to report).
    aliases: dict[str, tuple[str | None, dict[str, Any]]] = field(default_factory=dict)

    def plan(self, model: str, precision: str | None, device: str
             ) -> tuple[str | None, dict[str, Any] | None]:
        """(the precision whose entry to get, the precision result to report instead of
        that engine's own; None: its own)."""
        if precision is None:
            return None, None
        known = self.aliases.get(cache_key(model, precision))
        if known is not None:
            return known
        target, reason = first_choice(precision, device)
        if target != precision:
            return target, Served(precision, target, reason=reason).meta()
        return precision, None

    def learn(self, model: str, precision: str | None, engine: Any) -> str | None:
        """After getting ``model`` at ``precision``: when its engine turned out to be the
        model as loaded, later requests share that entry; the key to move it to."""
        if precision is None or not engine.artifacts.get(AS_LOADED):
            return None
        self.aliases[cache_key(model, precision)] = (None, engine.artifacts["precision"])
        return cache_key(model, None)

    def served_keys(self, warm: Iterable[str], device: str) -> dict[str, str]:
        """Requested engine key -> the warm entry that serves it (``warm``: the cache's
        keys), for this child's advert: a task asking for ``gpt@fp32`` (an fp32
        checkpoint's, learnt) or ``gpt@int8`` (on a GPU: served at fp16) runs warm on
        ``gpt`` / ``gpt@fp16``, and affinity matched it against its own key, never held."""
        held = set(warm)
        out: dict[str, str] = {}
        for requested, (precision, _) in self.aliases.items():
            served = cache_key(requested.partition("@")[0], precision)
            if served in held:
                out[requested] = served
        for key in held:
            model, _, precision = key.partition("@")
            for asked in PRECISIONS:
                if precision and asked != precision and first_choice(asked, device)[0] == \
                        precision:
                    out.setdefault(cache_key(model, asked), key)
        return out


def cache_key(model: str, precision: str | None) -> str:
    """The warm cache's key for ``model`` at ``precision`` (None: as loaded); affinity
    matches tasks to it by the same rule."""
    return engine_key(model, precision)


def first_choice(requested: str, device: str) -> tuple[str, str | None]:
    """The precision to build for a request on ``device`` and, if not the one asked
    for, why (pure)."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {requested!r}")
    if requested == "int8" and device.startswith("cuda"):
        return "fp16", ("int8 layers are served on the CPU only; served at fp16 (build "
                        "an int8 TensorRT plan for int8 on a GPU)")
    return requested, None


def gate(kl: float, max_kl: float) -> str | None:
    """None if INT8 may serve with this KL, else why not (pure)."""
    if kl < max_kl:
        return None
    return (f"int8 refused by the quantisation gate: KL divergence of activations "
            f"{kl:.4f} >= {max_kl:g}; served at full precision")


def gate_rel_mse(rel_mse: float, max_rel_mse: float) -> str | None:
    """None if INT8 may serve a single-value output with this relative MSE, else why not
    (pure; NaN refuses)."""
    if rel_mse < max_rel_mse:
        return None
    return (f"int8 refused by the quantisation gate: relative MSE of the outputs "
            f"{rel_mse:.4g} >= {max_rel_mse:g} (one value per row: judged by its error, "
            f"not a KL); served at full precision")


# -- the torch edge ------------------------------------------------------------------------

def kl_divergence(reference: Any, candidate: Any) -> float:
    """Mean over rows of KL(softmax(reference) || softmax(candidate)), last dimension
    (a 1-D tensor is one row, a scalar a row of one). A class the reference gives no
    probability (a logit of -inf: masked) adds nothing, as 0 log 0 = 0; one that only the
    candidate drops makes it inf, as does a candidate that is NaN: either way it is no
    stand-in for the reference."""
    import torch

    width = reference.shape[-1] if reference.dim() else 1
    if reference.numel() == 0 or width == 0:
        return 0.0
    p = torch.log_softmax(reference.double().reshape(-1, width), dim=-1)
    q = torch.log_softmax(candidate.double().reshape(-1, width), dim=-1)
    # (p - q is -inf - -inf = NaN where both mask a class: the whole KL was NaN, and the
    # gate's refusal said "KL divergence nan")
    terms = torch.where(p > -math.inf, p.exp() * (p - q), torch.zeros_like(p))
    kl = float(terms.sum(dim=-1).mean())
    return math.inf if math.isnan(kl) else kl


def single_valued(output: Any) -> bool:
    """One value per row (``(..., 1)``, ``(B,)``, a scalar): nothing for a softmax."""
    return bool(output.dim() < 2 or output.shape[-1] == 1)


def relative_mse(reference: Any, candidate: Any) -> float:
    """``mean((candidate - reference)^2) / mean(reference^2)`` over every value: 0 for
    none, inf for any error against an all-zero reference."""
    ref, got = reference.double().flatten(), candidate.double().flatten()
    if ref.numel() == 0:
        return 0.0
    error, scale = float(((got - ref) ** 2).mean()), float((ref ** 2).mean())
    if scale > 0:
        return error / scale
    return 0.0 if error == 0 else math.inf


def module_dtype(module: Any) -> Any:
    """The floating dtype of ``module``'s first floating parameter (None: it has none)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def _activations(module: Any, inputs: Any) -> Any:
    import torch

    with torch.inference_mode():
        # an nn.Module's sample is positional (a tuple); a Hugging Face one's by name
        out = module(**inputs) if isinstance(inputs, dict) else module(*inputs)
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if value is not None:
            return value.float()
    first = _first_tensor(out)
    if first is None:  # nothing to measure the conversion by: not served at int8
        raise NothingToCalibrate("its output holds no tensor to measure the int8 error on")
    return first.float()


def _first_tensor(out: Any) -> Any:
    """The first tensor in an output: itself, or the first in a tuple, list or dict (a
    model returning {"scores": ..., ...}), in order; None if there is none."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    items = out.values() if isinstance(out, Mapping) else \
        out if isinstance(out, (tuple, list)) else ()
    return next((t for t in map(_first_tensor, items) if t is not None), None)


class NothingToCalibrate(ModelLoadError):
    """The model has no input to measure a conversion's error on."""


def calibration_inputs(engine: Any) -> list[Any]:
    """The gate's inputs (keyword dicts or positional tuples): the warm-up sample, and
    each calibration text when the engine has a tokenizer."""
    inputs: list[Any] = []
    sample = engine.sample_inputs
    if isinstance(sample, dict):
        inputs.append(dict(sample))
    elif isinstance(sample, (tuple, list)) and sample:
        inputs.append(tuple(sample))
    tokenizer = engine.artifacts.get("tokenizer")
    if tokenizer is not None:
        inputs += [dict(tokenizer(text, return_tensors="pt")) for text in CALIBRATION_TEXTS]
    if not inputs:
        raise NothingToCalibrate(f"model {engine.key!r} has no sample inputs (app.model(..., "
                                 "sample_inputs=...)) or tokenizer to measure int8 on")
    if kvwarm.encoder_decoder(engine.module):
        inputs = [_with_decoder_start(engine.module, x) for x in inputs]
    return inputs


def _with_decoder_start(module: Any, inputs: Any) -> Any:
    """A seq2seq model's keyword inputs with its decoder's start token where they have
    no decoder inputs (a text through the tokenizer): T5's forward refuses them without."""
    import torch

    if not isinstance(inputs, dict) or "input_ids" not in inputs or any(
            k.startswith("decoder_") for k in inputs):
        return inputs
    start = torch.full((inputs["input_ids"].shape[0], 1), kvwarm.decoder_start(module),
                       dtype=torch.long)
    return {**inputs, "decoder_input_ids": start}


def quantize_int8(module: Any) -> Any:
    """An int8 copy of ``module`` (CPU): its linear layers as
    :class:`~sits_queue.cache.int8.Int8Linear`."""
    from sits_queue.cache.int8 import int8_layers

    return int8_layers(copy.deepcopy(module).cpu()).eval()


def module_bytes(module: Any) -> int:
    """Bytes of a module's distinct tensors, int8 weights and their scales included (they
    are buffers in its state dict, not parameters)."""
    import torch

    seen: dict[int, int] = {}

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            seen[id(value)] = value.numel() * value.element_size()
        elif isinstance(value, (tuple, list)):
            for item in value:
                add(item)

    for value in module.state_dict(keep_vars=True).values():
        add(value)
    return sum(seen.values())


class CandidateFailed(ModelLoadError):
    """The converted module raised on a calibration input the original ran."""


def _output_pairs(reference: Any, candidate: Any) -> list[tuple[Any, Any]]:
    """(reference, candidate) output activations for each of ``reference``'s calibration
    inputs; the candidate module runs on whichever device it is (the inputs follow it),
    its outputs come back to the CPU. :class:`CandidateFailed` if the candidate raises
    where the reference did not."""
    from celery.exceptions import SoftTimeLimitExceeded

    first = next(iter(candidate.parameters()), None)
    device = first.device if first is not None else "cpu"
    inputs = calibration_inputs(reference)
    outputs = [_activations(reference.module, x) for x in inputs]
    try:
        return [(out, _activations(candidate, move(x, device)).cpu())
                for out, x in zip(outputs, inputs, strict=True)]
    except (SoftTimeLimitExceeded, MemoryError):
        raise  # the task's time or the host's memory ran out: not the conversion's fault
    except Exception as exc:
        raise CandidateFailed(f"{type(exc).__name__}: {exc}") from exc


def mean_kl(reference: Any, candidate: Any) -> float:
    """Mean KL over ``reference``'s calibration inputs between its module's output
    activations and the ``candidate`` module's (see :func:`_output_pairs`)."""
    kls = [kl_divergence(ref, got) for ref, got in _output_pairs(reference, candidate)]
    return sum(kls) / len(kls)


def int8_error(reference: Any, candidate: Any) -> tuple[str, float]:
    """The gate's measure of ``candidate`` against ``reference`` over the calibration
    inputs: ``("kl", mean KL)``, or for single-value outputs ``("rel_mse", relative MSE
    of all their values together)``."""
    import torch

    pairs = _output_pairs(reference, candidate)
    if any(single_valued(ref) for ref, _ in pairs):
        return "rel_mse", relative_mse(torch.cat([ref.flatten() for ref, _ in pairs]),
                                       torch.cat([got.flatten() for _, got in pairs]))
    return "kl", sum(kl_divergence(ref, got) for ref, got in pairs) / len(pairs)


def _gate_int8(engine: Any, quantized: Any, measured: dict[str, float], max_kl: float,
               max_rel_mse: float) -> str | None:
    """The int8 gate on ``quantized`` (what it measured goes to ``measured``): None when
    it may serve, else why not."""
    try:
        measure, error = int8_error(engine, quantized)
    except CandidateFailed as exc:  # (model code that reads its layers' float weights)
        return (f"int8 refused by the quantisation gate: the int8 model failed on its "
                f"calibration inputs ({exc}); served at full precision")
    except NothingToCalibrate as exc:  # an int8 error nobody measured is not served
        return f"int8 refused: {exc}; served at full precision"
    measured[measure] = error
    return gate(error, max_kl) if measure == "kl" else gate_rel_mse(error, max_rel_mse)


def convert(engine: Any, requested: str, device: str, max_kl: float = DEFAULT_MAX_KL,
            max_rel_mse: float = DEFAULT_MAX_REL_MSE) -> Any:
    """``engine`` (as loaded, in the host tier) served at ``requested``: a new engine
    keyed ``<model>@<requested>`` whose ``artifacts["precision"]`` says what it got."""
    import torch

    from sits_queue.cache.engines import TorchEngine

    model = engine.key
    if not isinstance(engine, TorchEngine):
        raise ModelLoadError(f"model {model!r} is a {engine.backend} engine; a precision "
                             "can only be chosen for torch models (build the engine at the "
                             "precision you want and register it as its own model)")
    target, reason = first_choice(requested, device)
    measured: dict[str, float] = {}
    module: Any = engine.module
    if target == "int8":
        from sits_queue.cache.int8 import Int8Linear

        quantized = quantize_int8(module)
        if not any(isinstance(m, Int8Linear) for m in quantized.modules()):
            refused: str | None = ("int8 refused: the model has no linear layers to "
                                   "quantise (only nn.Linear and Conv1D are); served at "
                                   "full precision")
        else:
            refused = _gate_int8(engine, quantized, measured, max_kl, max_rel_mse)
        if refused is None:
            module = quantized
        else:
            target, reason = "fp32", refused
    if target in ("fp16", "bf16"):
        dtype = torch.float16 if target == "fp16" else torch.bfloat16
        module = copy.deepcopy(module).to(dtype)
    elif target == "fp32" and any(t.is_floating_point() and t.dtype != torch.float32
                                  for t in (*module.parameters(), *module.buffers())):
        # A checkpoint saved in fp16/bf16 loads as such: fp32 asked (or an int8 refused)
        # is served in fp32, as the result says, not at the checkpoint's precision.
        module = copy.deepcopy(module).to(torch.float32)
    served = Served(requested, target, measured.get("kl"), reason, measured.get("rel_mse"))
    sample = engine.sample_inputs
    converted = TorchEngine(cache_key(model, requested), module, sample,
                            {**engine.artifacts, "precision": served.meta(),
                             AS_LOADED: module is engine.module},
                            size_bytes=module_bytes(module) if target == "int8" else None,
                            input_dtype=module_dtype(module) if target in ("fp16", "bf16")
                            else None)
    engine.release()
    return converted
