"""Smoke run of the affinity benchmark at a tiny size: two real workers, real tiny
models, real Redis. It checks the JSON and what must hold whatever the speed; never a
timing or a cold-start share (those depend on how the two workers' picks interleave)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from sits_queue.bench import affinity
from sits_queue.bench.coldstart import REQUIRED

TINY = affinity.SMOKE


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory, redis_url: str
           ) -> Iterator[dict[str, Any]]:
    """One run through the CLI entry point, as ``sitsq bench affinity --smoke`` does."""
    out = tmp_path_factory.mktemp("affinity") / "affinity.json"
    zoo = tmp_path_factory.mktemp("zoo")
    assert affinity.main(["--smoke", "--json", str(out), "--redis-url", redis_url,
                          "--zoo", str(zoo)]) == 0
    yield json.loads(out.read_text())


def test_json_has_both_systems_ratios_and_meta(result: dict[str, Any]) -> None:
    assert set(result) == {"systems", "ratios", "meta"}
    assert set(result["systems"]) == set(affinity.SYSTEMS)
    for name, s in result["systems"].items():
        assert set(REQUIRED) <= set(s), name
        # Every request ran on one of the two workers, none failed; warm-ups not counted.
        assert (s["n"], s["failed"]) == (TINY.shape.n_requests, 0), (name, s["errors"])
        workers = 1 if name in affinity.ONE_WORKER else TINY.workers
        assert len(s["per_worker"]) == workers, name
        assert len(s["per_child"]) <= TINY.workers, name  # (one child per worker or slot)
        assert sum(w["n"] for w in s["per_worker"].values()) == TINY.shape.n_requests
        assert s["device"] == ["cpu"]
    assert set(result["ratios"]) == {
        "cold_share_vs_priority_order", "throughput_vs_priority_order",
        "p99_vs_priority_order", "one_worker_cold_share_vs_unsteered",
        "one_worker_throughput_vs_unsteered", "one_worker_cold_share_vs_fleet"}
    meta = result["meta"]
    assert meta["workers"] == TINY.workers and meta["requests"] == TINY.shape.n_requests
    assert meta["windows"] == {"sits_priority_order": 0, "sits_affinity": 16,
                               "sits_one_worker": 16, "sits_one_worker_unsteered": 16}
    assert {"date", "budget", "warm_model", "targets", "cpus_per_worker"} <= set(meta)


def test_only_the_affinity_fleet_takes_tasks_ahead_of_the_head(result: dict[str, Any]
                                                               ) -> None:
    systems = result["systems"]
    # With the window at 0 the workers take the head, always; with affinity on, a worker
    # holding one of three models warm finds one behind a head of another.
    assert systems["sits_priority_order"]["affinity_picks"] == 0
    assert systems["sits_affinity"]["affinity_picks"] > 0


def test_each_worker_reads_each_model_from_disk_at_most_once(result: dict[str, Any]
                                                             ) -> None:
    # the host tier holds the zoo: what a worker evicts from its device tier stays there
    for s in result["systems"].values():
        assert s["disk_loads"] <= TINY.workers * TINY.shape.n_models
        assert s["cold"] >= s["disk_loads"]
