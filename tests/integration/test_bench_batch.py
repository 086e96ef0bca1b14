"""Smoke run of the batch benchmark at a tiny size (a real encoder, the real embed path):
it checks the JSON and what must hold whatever the speed; never a timing."""

from __future__ import annotations

import json
from pathlib import Path

from sits_queue.bench import batch

TINY = batch.SMOKE


def test_frontier_and_controller(tmp_path: Path) -> None:
    out = tmp_path / "batch.json"
    assert batch.main(["--smoke", "--json", str(out), "--zoo", str(tmp_path / "zoo")]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"points", "controller", "best_fixed_under_target", "ratios", "meta"}
    points = result["points"]
    assert [p["batch"] for p in points] == list(batch.SIZES)
    assert all(p["throughput"] > 0 and p["p99_ms"] > 0 for p in points)
    # the frontier is never empty, and a point on it is dominated by none
    on = [p for p in points if p["pareto"]]
    assert on and all(not (q["throughput"] > p["throughput"] and q["p99_ms"] < p["p99_ms"])
                      for p in on for q in points)
    ctl = result["controller"]
    assert ctl["sizes"][0] == 8 and ctl["batches"] == len(ctl["sizes"]) >= 2
    assert all(s in batch.SIZES for s in ctl["sizes"])
    assert result["meta"]["device"] == "cpu" and result["meta"]["target_p95_ms"] == 120.0
