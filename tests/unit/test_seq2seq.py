"""Encoder-decoder (seq2seq) checkpoints, tiny and built here: loaded with their
generation head, warmed up through their decoder's KV cache, refused by name by the
built-in causal decode loop (``sits.generate``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sits_queue.cache import kvwarm
from sits_queue.cache.engines import TorchEngine, engine_from_path
from sits_queue.cache.pool import EngineCache
from sits_queue.errors import ModelLoadError
from sits_queue.models import tiny
from sits_queue.workers import batched, batchgen, inference

ARCHS = ["bart", "t5"]
PROMPT = "The worker loads the prompt"


def seq2seq_config(arch: str, tokenizer: Any) -> Any:
    """A tiny BART or T5 config over the project's tokenizer, with each family's own
    decoder start (BART: end of sequence; T5: padding)."""
    import transformers

    ids = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    if arch == "bart":
        return transformers.BartConfig(
            d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
            max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
            decoder_start_token_id=tokenizer.eos_token_id, **ids)
    return transformers.T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                 num_decoder_layers=2, num_heads=2,
                                 decoder_start_token_id=tokenizer.pad_token_id, **ids)


def build(root: Path, arch: str, with_tokenizer: bool = True) -> Path:
    """A ``*ForConditionalGeneration`` checkpoint saved as a Hugging Face directory."""
    import torch
    import transformers

    tokenizer_dir = tiny.build_tokenizer(root / "tokenizer", model_max_length=64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    path = root / arch
    torch.manual_seed(0)
    model_cls: Any = (transformers.BartForConditionalGeneration if arch == "bart"
                      else transformers.T5ForConditionalGeneration)
    model_cls(seq2seq_config(arch, tokenizer)).save_pretrained(path)
    if with_tokenizer:
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    root = tmp_path_factory.mktemp("seq2seq")
    built: dict[tuple[str, bool], Path] = {}

    def get(arch: str, with_tokenizer: bool = True) -> Path:
        if (arch, with_tokenizer) not in built:
            sub = root / ("tok" if with_tokenizer else "bare")
            built[arch, with_tokenizer] = build(sub, arch, with_tokenizer)
        return built[arch, with_tokenizer]

    return get


def cached(key: str, path: Path) -> tuple[Any, Any]:
    """The engine through the real cache: loaded, promoted, warmed up."""
    cache = EngineCache("cpu", 1 << 30, 1 << 30, context=lambda: 0.0)
    return cache.get(key, lambda: engine_from_path(key, path, "cpu"))


# -- loading: the generation head is kept ------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_a_seq2seq_checkpoint_loads_with_its_generation_head(
        checkpoints: Callable[..., Path], arch: str) -> None:
    # Given a summariser-style checkpoint registered by its directory (README's example)
    # When the worker loads it (warm-up included)
    engine, cold = cached("summarizer", checkpoints(arch))
    # Then it is served as saved, head and all (BART came back as a bare BartModel, T5
    # failed every load), and it generates
    assert type(engine.module).__name__.endswith("ForConditionalGeneration")
    assert engine.artifacts["task"] == "text2text-generation"
    assert cold.source == "disk" and cold.warmup_ms > 0
    prompt = engine.artifacts["tokenizer"](PROMPT, return_tensors="pt")
    out = engine.module.generate(**prompt, max_new_tokens=4, min_new_tokens=4,
                                 do_sample=False)
    assert out.shape == (1, 1 + 4)  # the decoder start, then four new tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_a_seq2seq_checkpoint_without_a_tokenizer_warms_up_on_token_ids(
        checkpoints: Callable[..., Path], arch: str) -> None:
    engine, cold = cached("s2s", checkpoints(arch, with_tokenizer=False))
    assert "tokenizer" not in engine.artifacts and cold.warmup_ms > 0
    assert set(engine.sample_inputs) == {"input_ids", "decoder_input_ids"}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_seq2seq_checkpoint_saved_without_its_head_loads_as_it_was_saved(
        tmp_path: Path, arch: str) -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        tiny.build_tokenizer(tmp_path / "tokenizer", model_max_length=64))
    bare_cls: Any = transformers.BartModel if arch == "bart" else transformers.T5Model
    bare_cls(seq2seq_config(arch, tokenizer)).save_pretrained(tmp_path / arch)
    tokenizer.save_pretrained(tmp_path / arch)
    # (T5Model's warm-up had no decoder inputs: every load failed)
    engine, cold = cached("bare", tmp_path / arch)
    assert type(engine.module) is bare_cls and cold.warmup_ms > 0
    assert engine.artifacts["task"] == "feature-extraction"


# -- warming up: encoder once, then the decoder through its KV cache ---------------------------

def decoder_steps(module: Any, warm: Callable[[], None]) -> tuple[int, list[tuple[int, bool]]]:
    """Encoder runs, and each decoder forward's query length and whether it was given a
    KV cache, while ``warm`` runs."""
    encoder_runs: list[int] = []
    steps: list[tuple[int, bool]] = []

    def on_decoder(_module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        past = kwargs.get("past_key_values", kwargs.get("cache"))
        steps.append((int(ids.shape[1]), past is not None and past.get_seq_length() > 0))

    handles = [module.get_encoder().register_forward_pre_hook(
                   lambda *_: encoder_runs.append(1)),
               module.get_decoder().register_forward_pre_hook(on_decoder, with_kwargs=True)]
    try:
        warm()
    finally:
        for handle in handles:
            handle.remove()
    return len(encoder_runs), steps


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("with_decoder_ids", [True, False])
def test_a_seq2seq_model_warms_its_decoder_through_the_kv_cache(
        checkpoints: Callable[..., Path], arch: str, with_decoder_ids: bool) -> None:
    import torch
    import transformers

    # Given a seq2seq module built by hand, its sample with or without decoder inputs
    module = transformers.AutoModelForSeq2SeqLM.from_pretrained(checkpoints(arch))
    sample = {"input_ids": torch.tensor([[5, 6, 7, 8]])}
    if with_decoder_ids:
        sample["decoder_input_ids"] = torch.tensor([[module.config.decoder_start_token_id]])
    engine = TorchEngine("s2s", module, sample)
    engine.to_device("cpu")
    # When it warms up (the causal-LM warm-up dropped decoder_input_ids: T5 refused, BART
    # decoded its own encoder input)
    encoder_runs, steps = decoder_steps(module, lambda: engine.warmup())
    # Then the encoder runs once, and the decoder prefills its start and then decodes
    # one position per step against the cache the step before grew
    assert encoder_runs == 1
    assert steps == [(1, False)] + [(1, True)] * kvwarm.DECODE_STEPS
    assert kvwarm.encoder_decoder(module) and not kvwarm.generates(module)


def test_warm_decode_seq2seq_grows_the_decoder_cache_by_its_steps(
        checkpoints: Callable[..., Path]) -> None:
    import torch
    import transformers

    module = transformers.AutoModelForSeq2SeqLM.from_pretrained(checkpoints("t5"))
    ids = {"input_ids": torch.tensor([[5, 6, 7]]), "decoder_input_ids": torch.tensor([[0]])}
    assert kvwarm.warm_decode_seq2seq(module, ids, steps=3) == 1 + 3
    with pytest.raises(ValueError, match="steps must be >= 0"):
        kvwarm.warm_decode_seq2seq(module, ids, steps=-1)


def test_decoder_kv_bytes_count_self_and_cross_attention(checkpoints: Callable[..., Path]
                                                         ) -> None:
    import transformers

    module = transformers.AutoModelForSeq2SeqLM.from_pretrained(checkpoints("bart"))
    config = module.config
    # keys and values, for the decoder's self- and cross-attention, of each decoder layer
    assert kvwarm.kv_bytes_per_token(module) == 2 * 2 * config.decoder_layers * 16 * 4
    t5 = transformers.AutoModelForSeq2SeqLM.from_pretrained(checkpoints("t5"))
    assert kvwarm.kv_bytes_per_token(t5) == 2 * 2 * t5.config.num_decoder_layers * 2 * 8 * 4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("wanted", ["fp16", "int8"])
def test_a_seq2seq_model_is_served_at_a_precision(checkpoints: Callable[..., Path],
                                                   arch: str, wanted: str) -> None:
    import torch

    from sits_queue.cache import precision

    # (T5's feed-forward reads its output layer's .weight to pick a dtype: int8 raised
    # AttributeError on the int8 layers, and the task failed)
    served = precision.convert(engine_from_path("s2s", checkpoints(arch), "cpu"), wanted,
                               "cpu")
    assert served.artifacts["precision"]["served"] == wanted
    served.to_device("cpu")
    assert served.warmup() > 0
    prompt = served.artifacts["tokenizer"](PROMPT, return_tensors="pt")
    out = served.module.generate(**prompt, max_new_tokens=3, min_new_tokens=3,
                                 do_sample=False)
    assert out.shape == (1, 1 + 3) and out.dtype == torch.long


# -- the built-in generation refuses it by name -----------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_the_built_in_generation_refuses_a_seq2seq_model_by_name(
        checkpoints: Callable[..., Path], arch: str) -> None:
    import transformers

    # Given a seq2seq model with its tokenizer (built by hand: independent of the loader)
    path = checkpoints(arch)
    engine = TorchEngine("summarizer", transformers.AutoModelForSeq2SeqLM.from_pretrained(path),
                         None, {"tokenizer": transformers.AutoTokenizer.from_pretrained(path)})
    engine.to_device("cpu")
    # When sits.generate / sits.generate_batched get it, they refuse it, saying why (T5
    # raised "You must specify exactly one of input_ids or inputs_embeds" mid-decode;
    # BART decoded garbage: its decoder was fed the prompt shifted, step by step)
    match = r"'summarizer' .*ForConditionalGeneration.* is an encoder-decoder"
    with pytest.raises(ModelLoadError, match=match):
        inference.generate(engine, PROMPT, max_new_tokens=3)
    with pytest.raises(ModelLoadError, match=match):
        batchgen.generate_calls(engine, [batched.Call("a", (PROMPT, 3), {})])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_built_in_embedding_pools_a_seq2seq_models_encoder(
        checkpoints: Callable[..., Path], arch: str) -> None:
    """(T5 failed "You must specify exactly one of input_ids or inputs_embeds"; BART
    pooled its decoder's states of the shifted text)"""
    import torch
    import transformers

    path = checkpoints(arch)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    engine = TorchEngine("s2s", model, None, {"tokenizer": tokenizer})
    engine.to_device("cpu")
    got = inference.embed(engine, [PROMPT, "a second text"], normalize=False)
    # The encoder's states, mean-pooled over each text's tokens, computed here by hand
    enc = tokenizer([PROMPT], return_tensors="pt")
    with torch.inference_mode():
        states = model.get_encoder()(**enc).last_hidden_state
    expected = states.mean(dim=1)[0]
    vector = torch.tensor(got[0])
    assert torch.allclose(vector, expected, atol=1e-5)
