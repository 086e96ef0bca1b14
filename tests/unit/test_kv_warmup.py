"""The KV-cache warm-up (§4.1, ``cache/kvwarm.py``) on tiny real models, in-process:
what a causal LM's warm-up runs, what an encoder's does, the KV arithmetic."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sits_queue.cache import kvwarm
from sits_queue.cache.engines import engine_from_path
from sits_queue.models import tiny


@pytest.fixture(scope="module")
def lm_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tiny.build_tiny_causal_lm(tmp_path_factory.mktemp("lm") / "lm", seed=0,
                                     n_positions=64)
    return engine_from_path("lm", path, "cpu")


@pytest.fixture(scope="module")
def encoder_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return engine_from_path("enc", tiny.build_tiny_encoder(
        tmp_path_factory.mktemp("enc") / "enc", seed=0), "cpu")


def forwards(engine: Any) -> list[tuple[int, bool]]:
    """Each forward's query length and whether it was given a KV cache, while warming."""
    seen: list[tuple[int, bool]] = []

    def hook(_module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        past = kwargs.get("past_key_values", kwargs.get("cache"))
        seen.append((int(ids.shape[1]), past is not None))

    handle = engine.module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        engine.to_device("cpu")
        assert engine.warmup() > 0
    finally:
        handle.remove()
    return seen


def test_a_causal_lm_warms_its_decode_path_through_the_kv_cache(lm_engine: Any) -> None:
    seen = forwards(lm_engine)
    prompt = seen[0][0]
    # The prefill of the warm-up prompt, then decode steps of one position each, each
    # against the cache the step before grew
    assert prompt > 1 and seen == [(prompt, False)] + [(1, True)] * kvwarm.DECODE_STEPS
    assert lm_engine.kv_reserved_bytes == 0  # nothing to reserve off CUDA


def test_an_encoder_warms_up_with_one_inference(encoder_engine: Any) -> None:
    seen = forwards(encoder_engine)
    assert len(seen) == 1 and seen[0][1] is False


def test_warm_decode_grows_the_cache_by_its_steps(lm_engine: Any) -> None:
    import torch

    lm_engine.to_device("cpu")
    ids = torch.tensor([[5, 6, 7]])
    assert kvwarm.warm_decode(lm_engine.module, {"input_ids": ids}, steps=4) == 3 + 4
    with pytest.raises(ValueError, match="steps must be >= 0"):
        kvwarm.warm_decode(lm_engine.module, {"input_ids": ids}, steps=-1)


def test_what_generates(lm_engine: Any, encoder_engine: Any) -> None:
    import torch

    assert kvwarm.generates(lm_engine.module)
    assert not kvwarm.generates(encoder_engine.module)
    assert not kvwarm.generates(torch.nn.Linear(2, 2))

    def broken() -> bool:
        raise RuntimeError("custom")

    assert not kvwarm.generates(SimpleNamespace(can_generate=broken))


def test_kv_bytes_per_token_count_keys_and_values_of_every_layer(lm_engine: Any) -> None:
    config = lm_engine.module.config
    assert kvwarm.kv_bytes_per_token(lm_engine.module) == \
        2 * config.n_layer * config.n_embd * 4  # fp32
    # Grouped-query attention: keys and values for the key/value heads only
    gqa = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=32, hidden_size=4096,
                                                 num_attention_heads=32,
                                                 num_key_value_heads=8),
                          parameters=lambda: iter([SimpleNamespace(element_size=lambda: 2)]))
    assert kvwarm.kv_bytes_per_token(gqa) == 2 * 32 * 8 * 128 * 2  # 128 KiB per token


def test_the_reservation_is_capped_by_the_model_and_only_on_cuda(lm_engine: Any) -> None:
    assert kvwarm.reserve_tokens(lm_engine.module) == 64  # its n_positions
    assert kvwarm.reserve_tokens(SimpleNamespace(config=None)) == kvwarm.RESERVE_TOKENS
    assert kvwarm.reserve("cpu", 10**6) == 0
    assert kvwarm.reserve("cuda:0", 0) == 0
