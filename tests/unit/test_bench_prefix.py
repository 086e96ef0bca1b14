"""The KV-prefix benchmark's pure parts: templates, the stream, its statistics."""

from __future__ import annotations

from typing import Any

import pytest

from sits_queue.bench import prefix
from sits_queue.bench.prefix import Shape
from sits_queue.config import SitsConfig
from sits_queue.options import resolve

SHAPE = Shape(workers=2, templates=4, n_requests=50, template_chars=400, seed=3)


def test_templates_start_differently_so_each_has_its_own_prefix_key() -> None:
    texts = prefix.templates(SHAPE)
    assert len(texts) == 4 and all(len(t) == 400 for t in texts)
    keys = {resolve(SitsConfig(), {"model": "m"}, {}, (t + " input",)).prefix_key
            for t in texts}
    assert len(keys) == 4 and None not in keys
    assert prefix.templates(SHAPE) == texts  # seeded


def test_the_stream_is_seeded_and_every_prompt_is_a_template_plus_its_own_input() -> None:
    texts = prefix.templates(SHAPE)
    stream = prefix.make_stream(SHAPE, texts)
    assert stream == prefix.make_stream(SHAPE, texts) and len(stream) == 50
    assert all(any(r.prompt.startswith(t) for t in texts) for r in stream)
    assert len({r.prompt for r in stream}) == 50
    assert len({next(t for t in texts if r.prompt.startswith(t)) for r in stream}) > 1


def test_shape_validation() -> None:
    with pytest.raises(ValueError, match="templates"):
        Shape(workers=2, templates=2, n_requests=5)


def rec(host: str, prompt: int, cached: int, start: float) -> dict[str, Any]:
    return {"sub": 0.0, "start": start, "fin": start + 0.01, "host": host,
            "prompt_tokens": prompt, "cached_tokens": cached}


def test_summarise_and_ratios() -> None:
    records = [rec("w1", 100, 0, 0.1), rec("w1", 100, 80, 0.2), rec("w2", 100, 96, 0.3),
               {"sub": 0.0, "error": "ValueError: x"}]
    s = prefix.summarise(records)
    assert (s["n"], s["failed"]) == (3, 1)
    assert s["cached_share"] == round(176 / 300, 4) and s["hit_share"] == round(2 / 3, 4)
    assert s["per_worker"] == {"w1": 2, "w2": 1}
    none = {"throughput_tps": 10.0, "cached_share": 0.0}
    cache = {"throughput_tps": 15.0, "cached_share": 0.4}
    aff = {"throughput_tps": 30.0, "cached_share": 0.8}
    r = prefix.ratios({"no_prefix_cache": none, "prefix_cache": cache, "prefix_affinity": aff})
    assert r == {"throughput_vs_no_cache": 3.0, "throughput_vs_cache_alone": 2.0,
                 "cache_alone_throughput_vs_no_cache": 1.5, "cached_share_vs_cache_alone": 2.0}
    assert all(prefix.targets(r).values())


def test_systems_differ_only_in_the_budget_and_the_prefix_weight() -> None:
    assert prefix.settings_of("no_prefix_cache", 100) == \
        ({}, {"SITS_KV_PREFIX_CACHE_BYTES": "0"})
    assert prefix.settings_of("prefix_cache", 100) == \
        ({"affinity_prefix_weight": 0.0}, {"SITS_KV_PREFIX_CACHE_BYTES": "100"})
    assert prefix.settings_of("prefix_affinity", 100) == \
        ({}, {"SITS_KV_PREFIX_CACHE_BYTES": "100"})
