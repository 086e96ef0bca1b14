"""The embedding cache (§4.4): LRU with a TTL per pool child, and ``embed`` using it."""

from __future__ import annotations

from typing import Any

import pytest

from sits_queue.cache.embeddings import EmbeddingCache
from sits_queue.cache.engines import engine_from_path
from sits_queue.config import SitsConfig
from sits_queue.errors import ConfigError
from sits_queue.models import tiny
from sits_queue.workers import batching, inference, metrics
from sits_queue.workers import runtime as rt


class Model:
    """Stands in for a model: a vector per text, and the batches it was given."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def __call__(self, texts: list[str]) -> list[list[float]]:
        self.batches.append(texts)
        return [[float(len(t)), float(len(self.batches))] for t in texts]


def test_only_texts_not_cached_reach_the_model_once_each() -> None:
    cache, model = EmbeddingCache(100, 60.0, clock=lambda: 0.0), Model()
    first, hits = cache.embed("m", True, ["a", "bb", "a"], model)
    assert hits == 0 and model.batches == [["a", "bb"]]  # "a" once
    assert first == [[1.0, 1.0], [2.0, 1.0], [1.0, 1.0]]
    second, hits = cache.embed("m", True, ["bb", "ccc", "a"], model)
    assert hits == 2 and model.batches[-1] == ["ccc"]
    assert second == [[2.0, 1.0], [3.0, 2.0], [1.0, 1.0]]  # in the order asked
    assert (cache.hits, cache.misses) == (2, 4) and len(cache) == 3


def test_model_and_normalisation_are_part_of_the_key() -> None:
    cache, model = EmbeddingCache(100, 60.0), Model()
    cache.embed("m", True, ["a"], model)
    assert cache.embed("other", True, ["a"], model)[1] == 0
    assert cache.embed("m", False, ["a"], model)[1] == 0
    assert len(model.batches) == 3


def test_entries_expire_after_the_ttl_and_the_least_recent_go_first() -> None:
    now = [0.0]
    cache, model = EmbeddingCache(2, 10.0, clock=lambda: now[0]), Model()
    cache.embed("m", True, ["a", "b"], model)
    now[0] = 9.9
    assert cache.embed("m", True, ["a"], model)[1] == 1
    cache.embed("m", True, ["c"], model)  # past 2 entries: the least recent ("b") goes
    assert cache.embed("m", True, ["b"], model)[1] == 0
    now[0] = 30.0
    assert cache.embed("m", True, ["c"], model)[1] == 0  # expired


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        EmbeddingCache(0)
    with pytest.raises(ValueError, match="ttl_s"):
        EmbeddingCache(10, 0.0)
    with pytest.raises(ConfigError, match="embed_cache_entries"):
        SitsConfig(embed_cache_entries=-1)
    with pytest.raises(ConfigError, match="embed_cache_ttl_s"):
        SitsConfig(embed_cache_ttl_s=0)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tiny.build_tiny_encoder(tmp_path_factory.mktemp("enc") / "enc", seed=1)
    engine = engine_from_path("enc", path, "cpu")
    engine.to_device("cpu")
    return engine


def test_embed_serves_repeated_texts_from_the_cache(encoder: Any) -> None:
    counts: dict[str, float] = {}
    active = rt.ActiveTask("enc", SitsConfig().quota("low"), encoder.size_bytes(), "cpu",
                           embeddings=EmbeddingCache(), count=lambda f: metrics.merge(counts, f))
    plain = inference.embed(encoder, ["a model serves", "the cache warms", "a fleet"])
    with rt.activated(active):
        first = inference.embed(encoder, ["a model serves", "the cache warms"])
        mixed = inference.embed(encoder, ["a fleet", "a model serves"])
        single = inference.embed(encoder, "the cache warms")
    # computed as one batch of two (padding to another length may round differently)
    for got, want in zip(first, plain[:2], strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    assert mixed[1] == first[0] and single == first[1]  # from the cache: the same floats
    assert mixed[0] == pytest.approx(plain[2], abs=1e-5)
    assert counts == {"emb_texts": 5, "emb_cached": 2}


def test_a_large_embed_call_runs_in_controller_sized_batches(encoder: Any) -> None:
    from sits_queue.workers.batching import Batcher, BatchPolicy

    texts = [f"document {i} about queues and workers" for i in range(40)]
    whole = inference.embed(encoder, texts)
    batcher = Batcher(BatchPolicy(start=4, target_p95_ms=10_000.0))
    active = rt.ActiveTask("enc", SitsConfig().quota("low"), encoder.size_bytes(), "cpu",
                           batcher=batcher)
    with rt.activated(active):
        split = inference.embed(encoder, texts)
    # Then it started at 4 and probed 8 next (far under the target); what follows depends
    # on which size measured faster; every recorded batch was a whole one of a size it
    # chooses among, each timed (a short remainder is not recorded); the vectors are the
    # texts', in order
    sizes = [s.size for s in batcher.state.samples]
    assert sizes[:2] == [4, 8] and sum(sizes) <= 40 and set(sizes) <= set(batching.SIZES)
    assert all(s.latency_ms > 0 for s in batcher.state.samples)
    for got, want in zip(split, whole, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
