"""Smoke run of the cold-start benchmark at a tiny size: real workers, real tiny models,
real Redis. It checks the JSON and what must hold whatever the speed; never a timing.

Two models and a device budget that holds only one of them: every change of model is a
cold start for the LRU and for SITS alike, and SITS's host tier holds both, so it reads
each model from disk at most once and brings a demoted one back from host memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from sits_queue.bench import coldstart
from sits_queue.bench.coldstart import REQUIRED, Shape

#: ``--smoke``'s: seed 1 gives a 4/4 stream over the two models with six model changes.
TINY = coldstart.SMOKE


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory, redis_url: str
           ) -> Iterator[dict[str, Any]]:
    """One run through the CLI entry point, as ``sitsq bench coldstart --smoke`` does."""
    out = tmp_path_factory.mktemp("coldstart") / "coldstart.json"
    zoo = tmp_path_factory.mktemp("zoo")
    assert coldstart.main(["--smoke", "--json", str(out), "--redis-url", redis_url,
                           "--zoo", str(zoo)]) == 0
    yield json.loads(out.read_text())


def test_json_has_every_system_ratio_and_meta(result: dict[str, Any]) -> None:
    assert set(result) == {"systems", "ratios", "meta"}
    assert set(result["systems"]) == {"celery_load_per_task", "celery_lru", "sits"}
    for name, s in result["systems"].items():
        assert set(REQUIRED) <= set(s), name
        assert all(isinstance(s[k], (int, float)) for k in REQUIRED), name
        # Every request of the stream ran, none failed, and the warm-up is not counted.
        assert (s["n"], s["failed"]) == (TINY.n_requests, 0), (name, s["errors"])
        assert sum(s["sources"].values()) == TINY.n_requests
        assert s["device"] == ["cpu"]
        # Every task reported when its first token came (§4.4), its load included
        assert s["first_tokens"] == TINY.n_requests, name
        assert 0 < s["first_token_ms_p50"] <= s["first_token_ms_p99"], name
        assert s["first_token_ms_std"] >= 0, name
    assert set(result["ratios"]) == {"cold_cost_vs_lru", "throughput_vs_lru",
                                     "throughput_vs_load_per_task",
                                     "first_token_spread_vs_lru"}
    meta = result["meta"]
    assert meta["quick"] is True and meta["smoke"] is True
    assert meta["requests"] == TINY.n_requests
    assert meta["concurrency"] == 1 and meta["device"] == "cpu"
    assert len(meta["models"]) == TINY.n_models
    assert {"date", "budget", "warm_model", "targets"} <= set(meta)


def test_budget_holds_one_model_and_the_stream_needs_both(result: dict[str, Any]) -> None:
    meta = result["meta"]
    sizes = sorted(m["bytes"] for m in meta["models"].values())
    assert sizes[-1] <= meta["budget"]["device_bytes"] < sum(sizes)
    assert meta["budget"]["host_bytes"] >= sum(sizes)
    assert all(m["requests"] > 0 for m in meta["models"].values())
    assert meta["one_model_cache_switches"] == 6  # the stream in submission order


def test_load_per_task_reads_every_model_from_disk(result: dict[str, Any]) -> None:
    s = result["systems"]["celery_load_per_task"]
    assert s["cold_share"] == 1.0 and s["sources"] == {"disk": TINY.n_requests}
    assert s["cold_cost_ms_mean"] > 0
    # Each task's first token came after its model was read (the load is in it), so the
    # first-token times dominate the load times, task by task, and so their p99
    assert s["first_token_ms_p99"] >= s["cold_cost_ms_p99"]


def test_lru_is_cold_exactly_when_the_model_changes(result: dict[str, Any]) -> None:
    # Given a budget for one model, when the model changes, then the LRU reloads it.
    s = result["systems"]["celery_lru"]
    assert s["cold"] == s["model_switches"] == s["sources"].get("disk", 0)
    assert s["sources"].get("device", 0) == TINY.n_requests - s["cold"]


def test_sits_reloads_nothing_from_disk_after_a_demotion(result: dict[str, Any]) -> None:
    s, meta = result["systems"]["sits"], result["meta"]
    # Every change of model is cold (the device holds one model) ...
    assert s["cold"] == s["model_switches"] >= 2
    # ... but only the first use of the model that was not warmed up reads the disk;
    assert s["disk_loads_by_model"] == {m: 1 for m in meta["models"]
                                        if m != meta["warm_model"]}
    # every other cold start promotes a demoted engine from the host tier.
    assert s["sources"]["host"] == s["cold"] - 1 >= 1
    assert set(s["cold_cost_ms_mean_by_source"]) == {"disk", "host"}


def test_the_run_leaves_its_databases_empty(result: dict[str, Any], redis_url: str) -> None:
    from sits_queue.bench.coldstart_apps import DATABASES, system_url

    for name in DATABASES:
        client = redis.Redis.from_url(system_url(redis_url, name))
        try:
            assert client.dbsize() == 0, name
        finally:
            client.close()


def test_stream_is_seeded_and_zipf_like() -> None:
    models = [f"tiny-lm-{i}" for i in range(4)]
    shape = Shape(n_models=4, n_requests=400, seed=3)
    assert coldstart.make_stream(models, shape) == coldstart.make_stream(models, shape)
    weights = coldstart.popularity(models, shape.seed, shape.zipf_exponent)
    ranked = sorted(weights.values(), reverse=True)
    assert ranked == pytest.approx([0.48, 0.24, 0.16, 0.12], abs=0.001)
    counts = {m: sum(r.model == m for r in coldstart.make_stream(models, shape))
              for m in models}
    top = max(weights, key=lambda m: weights[m])
    assert counts[top] == max(counts.values())


def test_switches_counts_model_changes_after_the_warm_one() -> None:
    assert coldstart.switches(["a", "a", "b", "a"], warm="a") == 2
    assert coldstart.switches(["b"], warm="a") == 1
    assert coldstart.switches([], warm="a") == 0


def test_weights_bytes_reads_the_safetensors_header(tmp_path: Path) -> None:
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [3], "data_offsets": [8, 20]}})
    blob = len(header).to_bytes(8, "little") + header.encode() + bytes(20)
    (tmp_path / "model.safetensors").write_bytes(blob)
    assert coldstart.weights_bytes(tmp_path) == 20
