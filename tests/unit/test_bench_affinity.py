"""The affinity benchmark's pure parts: CPU shares, the fleet's shape, its statistics."""

from __future__ import annotations

from typing import Any

import pytest

from sits_queue.bench import affinity
from sits_queue.bench.affinity import Fleet
from sits_queue.bench.coldstart import Shape


@pytest.mark.parametrize(("workers", "cpus", "expected"), [
    (2, [0, 1], [[0], [1]]), (2, [0, 1, 2, 3, 4], [[0, 1], [2, 3]]),
    (3, [0, 1], [[0], [1], [0]]), (2, [5], [[5], [5]]),
])
def test_cpu_sets(workers: int, cpus: list[int], expected: list[list[int]]) -> None:
    assert affinity.cpu_sets(workers, cpus) == expected


def test_fleet_rejects_shapes_where_affinity_cannot_matter() -> None:
    with pytest.raises(ValueError, match="2 workers"):
        Fleet(1, Shape(n_models=4, n_requests=10))
    with pytest.raises(ValueError, match="more models than workers"):
        Fleet(3, Shape(n_models=3, n_requests=10))


def rec(i: int, host: str, model: str, source: str, start: float, ahead: bool = False,
        pid: int = 1) -> dict[str, Any]:
    cold = source != "device"
    return {"i": i, "sub": 0.0, "start": start, "fin": start + 0.01, "host": host,
            "model": model, "cold": cold, "cold_ms": 2.0 if cold else 0.0, "source": source,
            "device": "cpu", "affinity": ahead, "pid": pid}


def test_fleet_summary_counts_per_worker_in_each_workers_order() -> None:
    records = [rec(0, "w1", "a", "device", 0.1), rec(1, "w2", "b", "disk", 0.1),
               rec(2, "w1", "b", "host", 0.2, ahead=True), rec(3, "w2", "b", "device", 0.2),
               rec(4, "w1", "a", "host", 0.3)]
    s = affinity.fleet_summary(records, warm="a")
    assert s["n"] == 5 and s["cold"] == 3 and s["cold_share"] == 0.6
    # w1 served a, b, a after the warm a: 2 switches; w2 served b, b: 1
    assert s["model_switches"] == 3
    assert s["per_worker"] == {"w1": {"n": 3, "cold_share": 0.6667, "models": {"a": 2, "b": 1}},
                               "w2": {"n": 2, "cold_share": 0.5, "models": {"b": 2}}}
    assert (s["disk_loads"], s["affinity_picks"]) == (1, 1)
    assert not any(k.startswith("gap_") for k in s)


def test_one_workers_children_are_counted_each_in_its_order() -> None:
    # One worker, two children: each keeps its own cache
    records = [rec(0, "w", "a", "device", 0.1, pid=7), rec(1, "w", "b", "disk", 0.1, pid=8),
               rec(2, "w", "b", "device", 0.2, pid=8), rec(3, "w", "a", "device", 0.3, pid=7)]
    s = affinity.fleet_summary(records, warm="a")
    assert list(s["per_worker"]) == ["w"] and s["per_worker"]["w"]["n"] == 4
    assert s["per_child"] == {"w pid 7": {"n": 2, "cold_share": 0.0, "models": {"a": 2}},
                              "w pid 8": {"n": 2, "cold_share": 0.5, "models": {"b": 2}}}
    # child 7 served a, a (no change after the warm a); child 8 b, b (one): in the worker's
    # order, a b b a, it read as three
    assert s["model_switches"] == 1


def test_ratios_and_targets() -> None:
    off = {"cold_share": 0.6, "throughput_tps": 100.0, "p99_ms": 1000.0}
    on = {"cold_share": 0.12, "throughput_tps": 110.0, "p99_ms": 900.0}
    r = affinity.ratios({"sits_priority_order": off, "sits_affinity": on})
    assert r == {"cold_share_vs_priority_order": 0.2, "throughput_vs_priority_order": 1.1,
                 "p99_vs_priority_order": 0.9}
    both = affinity.ratios({"sits_priority_order": off, "sits_affinity": on,
                            "sits_one_worker": {**on, "cold_share": 0.06},
                            "sits_one_worker_unsteered": {**off, "cold_share": 0.3}})
    assert (both["one_worker_cold_share_vs_unsteered"],
            both["one_worker_cold_share_vs_fleet"]) == (0.2, 0.5)
    assert all(affinity.targets(r).values())
    worse = affinity.ratios({"sits_priority_order": off,
                             "sits_affinity": {**on, "cold_share": 0.4}})
    assert not all(affinity.targets(worse).values())
