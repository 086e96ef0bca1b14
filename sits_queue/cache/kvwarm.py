"""The KV-cache warm-up of a causal LM (MISSION §4.1's third cold-start phase).

The source splits a cold start into CUDA context creation, engine load and "KV-cache
warm-up (45-90 ms)", and its remedies include a warm-up inference and preallocated KV
buffers. A prefill-only warm-up leaves the decode path cold: a decode step is another
kernel shape (one query position against a cache) and the cache itself is new memory,
so the first real generation would pay for both. :func:`warm_decode` runs the prefill
and then :data:`DECODE_STEPS` decode steps through the KV cache; on a CUDA device,
:func:`reserve` then has the caching allocator hold the KV memory of a
:data:`RESERVE_TOKENS`-token generation (allocated once and freed into PyTorch's cache,
which keeps the segment), so the first generations take their KV from there instead of
``cudaMalloc``. A reserved block is only cached, not held: under the class's memory
fraction, the allocator frees cached blocks before it fails an allocation.

An encoder-decoder (seq2seq: BART, T5) model gets the same warm-up through its decoder:
:func:`warm_decode_seq2seq` runs the encoder once, prefills the decoder's start and
decodes :data:`DECODE_STEPS` steps against the decoder's KV cache (self-attention grown
per step, cross-attention computed once). The causal path would drop its decoder inputs:
T5 refuses the call, BART decodes its own encoder input.

Used by :class:`~sits_queue.cache.engines.TorchEngine` for modules that generate
(Hugging Face ``can_generate()``); the decode loop of ``sits.generate`` uses the same
cache argument helpers.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

#: Decode steps after the warm-up prefill: the first compiles / selects the decode
#: kernels and grows the cache, the second runs them warm.
DECODE_STEPS = 2
#: KV positions reserved on a CUDA device at warm-up (batch 1), at most the model's own
#: maximum: a long generation's worth without holding a 128k-context model's whole span.
RESERVE_TOKENS = 2048


def can_generate(module: Any) -> bool:
    """A Hugging Face model with a generation head (causal or seq2seq), not an encoder."""
    can = getattr(module, "can_generate", None)
    try:
        return bool(can()) if callable(can) else False
    except Exception:  # a custom module with its own notion of can_generate
        return False


def encoder_decoder(module: Any) -> bool:
    """An encoder-decoder (seq2seq) model, by its config: BART, T5, Marian..."""
    return getattr(getattr(module, "config", None), "is_encoder_decoder", False) is True


def generates(module: Any) -> bool:
    """A causal LM: a Hugging Face model that generates text from its own input ids
    (neither an encoder nor a seq2seq model, whose decoder has inputs of its own)."""
    return can_generate(module) and not encoder_decoder(module)


def decoder_start(module: Any) -> int:
    """The token a seq2seq decoder starts from (its generation config's, else its
    config's, else padding, else 0)."""
    for source in (getattr(module, "generation_config", None),
                   getattr(module, "config", None)):
        for name in ("decoder_start_token_id", "pad_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    return 0


def cache_kwarg(module: Any) -> str:
    """The name the forward takes the KV cache by: transformers 5 renamed
    ``past_key_values`` to ``cache`` (the old name warns)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters \
        else "past_key_values"


def cache_of(output: Any) -> Any:
    """The KV cache a forward returned, under either name."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


def max_positions(module: Any, tokenizer: Any = None) -> int | None:
    """The model's maximum sequence length, from its config (or tokenizer), if it has one."""
    config = getattr(module, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    # Tokenizers without a limit report ~1e30; only a plausible number is a limit.
    return value if isinstance(value, int) and 0 < value < 10**7 else None


def _first_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def kv_bytes_per_token(module: Any) -> int:
    """Bytes of keys and values one position adds across all layers (grouped-query
    attention counted by its key/value heads). For a seq2seq model: its decoder's
    layers, each with a self- and a cross-attention cache (a source position adds to
    the second what a decoded one adds to the first)."""
    config = getattr(module, "config", None)
    seq2seq = encoder_decoder(module)
    layers = (seq2seq and _first_int(config, "decoder_layers", "num_decoder_layers")) or \
        _first_int(config, "num_hidden_layers", "n_layer") or 1
    hidden = _first_int(config, "hidden_size", "n_embd", "d_model") or 1
    heads = (seq2seq and _first_int(config, "decoder_attention_heads")) or \
        _first_int(config, "num_attention_heads", "n_head") or 1
    kv_heads = _first_int(config, "num_key_value_heads") or heads
    head_dim = _first_int(config, "head_dim") or hidden // heads or 1
    dtype_bytes = next((p.element_size() for p in module.parameters()), 4)
    return 2 * (2 if seq2seq else 1) * layers * kv_heads * head_dim * dtype_bytes


def _decode_inputs(module: Any, inputs: Mapping[str, Any], steps: int
                   ) -> tuple[str, Any, Any]:
    """A warm-up's cache keyword, input ids and attention mask (all ones when none)."""
    import torch

    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    return cache_kwarg(module), ids, torch.ones_like(ids) if mask is None else mask


def warm_decode(module: Any, inputs: Mapping[str, Any], steps: int = DECODE_STEPS) -> int:
    """Prefill ``inputs`` (already on the module's device) and decode ``steps`` greedy
    tokens through the KV cache; returns the positions the cache ended with."""
    import torch

    kwarg, ids, mask = _decode_inputs(module, inputs, steps)
    with torch.inference_mode():
        out = module(input_ids=ids, attention_mask=mask, use_cache=True)
        past = cache_of(out)
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(dim=-1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = module(input_ids=token, attention_mask=mask, use_cache=True, **{kwarg: past})
            past = cache_of(out)
    return int(mask.shape[1])


def warm_decode_seq2seq(module: Any, inputs: Mapping[str, Any],
                        steps: int = DECODE_STEPS) -> int:
    """Encode ``inputs`` (already on the module's device) once, prefill the decoder with
    their ``decoder_input_ids`` (else the decoder's start token) and decode ``steps``
    greedy tokens through the decoder's KV cache; returns the decoder positions the
    cache ended with."""
    import torch

    kwarg, ids, mask = _decode_inputs(module, inputs, steps)
    decoder_ids = inputs.get("decoder_input_ids")
    if decoder_ids is None:
        decoder_ids = torch.full((ids.shape[0], 1), decoder_start(module), dtype=ids.dtype,
                                 device=ids.device)
    positions = int(decoder_ids.shape[1])
    with torch.inference_mode():
        encoded = module.get_encoder()(input_ids=ids, attention_mask=mask)
        out = module(encoder_outputs=encoded, attention_mask=mask,
                     decoder_input_ids=decoder_ids, use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(dim=-1)
            out = module(encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=token,
                         use_cache=True, **{kwarg: cache_of(out)})
            positions += 1
    return positions


def reserve_tokens(module: Any) -> int:
    """Positions to reserve: :data:`RESERVE_TOKENS`, or the model's maximum if lower."""
    limit = max_positions(module)
    return min(RESERVE_TOKENS, limit) if limit else RESERVE_TOKENS


def reserve(device: str, nbytes: int) -> int:
    """Have the CUDA caching allocator hold ``nbytes`` on ``device`` for later tensors;
    returns the bytes reserved (0 off CUDA, or when the device has no room: a reservation
    is an optimisation, never a reason to fail a load)."""
    import torch

    if nbytes <= 0 or not device.startswith("cuda"):
        return 0
    try:
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        return 0
    del block  # freed into the allocator's cache, which keeps the segment
    return nbytes
