"""Smoke run of the sites benchmark at a tiny size (two real Redis servers per setup):
it checks the JSON and what must hold whatever the speed; never a timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sits_queue.bench import sites
from sits_queue.bench.sites import CLASSES, Shape

TINY = Shape(tasks=60)


def test_enqueue_three_ways_and_two_failovers(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "sites.json"
    monkeypatch.setattr(sites, "QUICK", TINY)
    assert sites.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["enqueue"]) == {"one_site", "near_peer", "far_peer"}
    for per in result["enqueue"].values():
        assert sum(per[c]["n"] for c in CLASSES) == TINY.tasks
        assert all(per[c]["rate_per_s"] > 0 for c in CLASSES if per[c]["n"])
    near, far = result["failover"]["near_peer"], result["failover"]["far_peer"]
    # A near peer replicates every class: nothing waiting at the lost site is lost
    assert near["waiting_at_b_after"] == near["waiting_at_a"]
    # A far one skips the bottom class (the decision table), keeps the others
    assert far["waiting_at_b_after"]["low"] == 0
    assert far["waiting_at_b_after"]["high"] == far["waiting_at_a"]["high"]
    assert far["waiting_at_b_after"]["medium"] == far["waiting_at_a"]["medium"]
    assert near["takeover_s"] is not None and far["takeover_s"] is not None
    assert result["meta"]["targets"]["near_peer_lost_no_task"] is True
