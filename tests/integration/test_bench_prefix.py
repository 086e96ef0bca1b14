"""Smoke run of the KV-prefix benchmark at a tiny size: two real workers, a real model,
real Redis. It checks the JSON and what must hold whatever the speed; never a timing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from sits_queue.bench import prefix
from sits_queue.bench.prefix import Shape

TINY = Shape(workers=2, templates=3, n_requests=24, template_chars=600, seed=5)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory, redis_url: str
           ) -> Iterator[dict[str, Any]]:
    """One run through the CLI entry point, as ``sitsq bench prefix --quick`` does."""
    out = tmp_path_factory.mktemp("prefix") / "prefix.json"
    zoo = tmp_path_factory.mktemp("zoo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefix, "QUICK", TINY)
        assert prefix.main(["--quick", "--json", str(out), "--redis-url", redis_url,
                            "--zoo", str(zoo)]) == 0
    yield json.loads(out.read_text())


def test_json_has_every_system_ratio_and_meta(result: dict[str, Any]) -> None:
    assert set(result) == {"systems", "ratios", "meta"}
    assert set(result["systems"]) == set(prefix.SYSTEMS)
    for name, s in result["systems"].items():
        assert (s["n"], s["failed"]) == (TINY.n_requests, 0), (name, s["errors"])
        assert len(s["per_worker"]) == TINY.workers and s["prompt_tokens"] > 0
    assert set(result["ratios"]) == {"throughput_vs_no_cache", "throughput_vs_cache_alone",
                                     "cache_alone_throughput_vs_no_cache",
                                     "cached_share_vs_cache_alone"}
    assert {"date", "shape", "model", "prefix_budget_bytes_per_child", "targets"} <= \
        set(result["meta"])


def test_only_the_systems_with_a_prefix_cache_skip_prefill(result: dict[str, Any]) -> None:
    systems = result["systems"]
    assert systems["no_prefix_cache"]["cached_tokens"] == 0
    # every request shares its template with 7 others on average: some find it cached
    assert systems["prefix_cache"]["cached_tokens"] > 0
    assert systems["prefix_affinity"]["cached_tokens"] > 0
    for s in systems.values():
        assert s["cached_tokens"] < s["prompt_tokens"]  # never a whole prompt
