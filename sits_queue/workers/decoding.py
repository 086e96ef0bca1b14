"""Step-by-step decoding for the built-in generation (``inference.generate`` and the
batched generation in ``batchgen``): the decode loop through the KV cache, its
yield points and soft-limit checks, seeded sampling that draws alike alone or in a
batch, the stop tokens, a resumed run's progress, and the memory a run will need.
torch is imported inside the functions only."""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded

from sits_queue.cache.kvwarm import cache_kwarg, cache_of, kv_bytes_per_token
from sits_queue.workers import firsttoken, kvreuse, runtime

logger = logging.getLogger(__name__)

#: Activations live per layer alongside the KV cache; a few hidden-size vectors per token
#: per layer is what a forward pass keeps at once (the estimate used without CUDA).
_ACTIVATION_VECTORS = 4


def kv_cache_bytes(module: Any, tokens: int) -> int:
    """Upper estimate of the KV cache plus live activations for ``tokens`` positions."""
    config = getattr(module, "config", None)
    layers = int(getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 1) or 1)
    hidden = int(getattr(config, "hidden_size", None) or getattr(config, "n_embd", 1) or 1)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    dtype_bytes = next((p.element_size() for p in module.parameters()), 4)
    per_token = kv_bytes_per_token(module) + _ACTIVATION_VECTORS * layers * hidden * dtype_bytes
    return per_token * tokens + vocab * 4 * 2  # logits of the last position, twice


def stop_tokens(module: Any, tokenizer: Any) -> frozenset[int]:
    """The ids a generation ends at, as transformers' ``generate`` takes them: the model's
    ``generation_config.eos_token_id`` (an id or a list: chat models list their end of a
    turn there, and ran on past it to ``max_new_tokens``) and the tokenizer's."""
    config = getattr(module, "generation_config", None)
    declared = getattr(config, "eos_token_id", None)
    ids = declared if isinstance(declared, list | tuple) else [declared]
    ids = [*ids, getattr(tokenizer, "eos_token_id", None)]
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def generated(tokenizer: Any, new: list[int], eos: frozenset[int], *, prompt_tokens: int,
              cached_tokens: int, runs: int) -> dict[str, Any]:
    """A generation's result, the same fields for a lone call and for a batch's row
    (which adds ``shared_tokens``); ``eos`` empty when it was not to stop there."""
    return {"text": tokenizer.decode(new, skip_special_tokens=True), "tokens": len(new),
            "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "stopped": "eos" if new and new[-1] in eos else "length",
            "runs": runs}


def resumed(checkpoint: Any, max_new_tokens: int, vocab_size: int) -> dict[str, Any]:
    """The progress a generation saved at its last yield, or a fresh start. A checkpoint
    that is not one of ours (hand-edited, another version) is ignored, with a warning."""
    if checkpoint is None:
        return {"new": [], "runs": 1}
    new: Any = checkpoint.get("new") if isinstance(checkpoint, dict) else None
    runs: Any = checkpoint.get("runs") if isinstance(checkpoint, dict) else None
    if (isinstance(new, list) and len(new) < max_new_tokens
            and all(_is_token(t, vocab_size) for t in new)
            and isinstance(runs, int) and not isinstance(runs, bool) and runs >= 1):
        return {"new": list(new), "runs": runs + 1,
                "first_token_ms": checkpoint.get("first_token_ms")}
    logger.warning("generation checkpoint not understood, starting over: %.200r", checkpoint)
    return {"new": [], "runs": 1}


def _is_token(value: Any, vocab_size: int) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= 0
            and (vocab_size <= 0 or value < vocab_size))


def seeded(generator: Any, seed: int, position: int) -> Any:
    """The sampler for one position: the same whichever run reaches it. Seeded by a hash
    of both: torch's CPU generator keeps the low 32 bits of its seed only, so an
    arithmetic mix drew alike for seeds 2**32 apart (and past 64 bits, for 2**80 and
    -2**80); ``seed`` is a 64-bit signed integer (``inputs.check_prompt``)."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little", signed=True)
                             + position.to_bytes(8, "little"), digest_size=8).digest()
    return generator.manual_seed(int.from_bytes(digest, "little"))


def sampled(logits: Any, temperature: float, seed: int, position: int, generator: Any
            ) -> int:
    """The token drawn from one row's ``logits`` (shape ``(1, vocab)``) at
    ``temperature``: the same draw wherever that row decodes, alone or in a batch."""
    import torch

    # In float64, shifted by the row's max before scaling: at a tiny temperature float32
    # logits / temperature overflow to inf (and the temperature itself rounds to 0), so
    # softmax gave NaN and multinomial raised for the whole batch; this way the others go
    # to -inf and the draw tends to greedy, as the temperature does.
    wide = logits.double()
    probs = torch.softmax((wide - wide.max(dim=-1, keepdim=True).values) / temperature,
                          dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=seeded(generator, seed, position)))


def decode_steps(module: Any, input_ids: Any, max_new_tokens: int, eos: frozenset[int],
                 temperature: float, seed: int, progress: dict[str, Any],
                 active: runtime.ActiveTask | None, prefix: kvreuse.PromptPrefix, *,
                 model: str) -> None:
    """The decode loop of one prompt; appends token ids to ``progress["new"]`` so a
    caller sees how far it got on a timeout, and so a yield keeps them for the next run
    (``active``'s yielder; None never yields). The prefill starts after the cached
    prefix, if any. A soft time limit hit between steps says, for ``model``, how many of
    the new tokens it got."""
    try:
        _decode(module, input_ids, max_new_tokens, eos, temperature, seed, progress, active,
                prefix)
    except SoftTimeLimitExceeded:
        raise SoftTimeLimitExceeded(
            f"soft time limit hit while generating with model {model!r}: stopped after "
            f"{len(progress['new'])} of {max_new_tokens} new tokens") from None


def _decode(module: Any, input_ids: Any, max_new_tokens: int, eos: frozenset[int],
            temperature: float, seed: int, progress: dict[str, Any],
            active: runtime.ActiveTask | None, prefix: kvreuse.PromptPrefix) -> None:
    import torch

    new: list[int] = progress["new"]
    kwarg = cache_kwarg(module)
    generator = torch.Generator(device="cpu")
    ids: Any = input_ids[:, prefix.tokens:]
    past: Any = prefix.start
    prefilled = False
    out: Any = None
    logits: Any = None
    mask: Any = torch.ones_like(input_ids)
    step_s = 0.0  # recent seconds per step: the work left, for yield_point
    try:
        with torch.inference_mode():
            while len(new) < max_new_tokens:
                began = time.perf_counter()
                if active is not None:
                    active.check_time(len(new), max_new_tokens)
                out = module(input_ids=ids, attention_mask=mask, use_cache=True,
                             **{kwarg: past})
                past = cache_of(out)
                if not prefilled:
                    prefix.after_prefill(past)
                    prefilled = True
                logits = out.logits[:, -1, :].float()
                if temperature > 0:
                    token = sampled(logits, temperature, seed, len(new), generator)
                else:
                    token = int(torch.argmax(logits, dim=-1))
                new.append(token)
                if "first_token_ms" not in progress \
                        and (first := firsttoken.mark()) is not None:
                    progress["first_token_ms"] = first  # kept across a yield
                if token in eos:
                    return
                ids = torch.tensor([[token]], device=input_ids.device)
                mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
                if active is not None and len(new) < max_new_tokens:
                    took = time.perf_counter() - began
                    step_s = took if step_s == 0.0 else 0.8 * step_s + 0.2 * took
                    active.yield_point(progress, step_s * (max_new_tokens - len(new)))
    finally:
        # A traceback keeps this frame alive: drop the KV cache now, not with the frame.
        past = out = ids = mask = logits = prefix.start = None
