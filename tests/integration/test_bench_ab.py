"""Smoke test of ``sitsq bench ab`` at a tiny size: real workers for every system,
the JSON the issue names, and the ideal-schedule floor (no timing asserts)."""

from __future__ import annotations

import pytest
import redis

from sits_queue.bench import ab

CLASSES = ("high", "medium", "low")


@pytest.mark.slow
def test_every_system_runs_the_whole_workload(redis_url: str,
                                              redis_client: redis.Redis) -> None:
    result = ab.run(redis_url=redis_url, shape={"n_jobs": 60, "concurrency": 2},
                    on_progress=lambda _line: None)
    assert set(result["systems"]) == {"celery_fifo", "celery_priority", "sits",
                                      "sits_run_to_completion"}
    for name, system in result["systems"].items():
        assert system["completed"] == 60, name
        assert sum(system[c]["n"] for c in CLASSES) == 60
        assert system["throughput_tps"] > 0
        for c in CLASSES:
            assert {"n", "p50_wait_ms", "p99_wait_ms", "max_wait_ms"} <= set(system[c])
    assert set(result["ratios"]) == {
        f"{r}{suffix}" for suffix in ("", "_run_to_completion")
        for r in ("high_p99_vs_fifo", "high_p99_vs_priority", "throughput_vs_fifo")}
    ideal = result["ideal_nonpreemptive"]
    assert sum(ideal[c]["n"] for c in CLASSES) == 60
    assert ideal["high"]["p99_wait_ms"] <= ideal["low"]["p99_wait_ms"]
    assert set(result["targets"]) == {
        f"{name}: {t}" for name in ("sits", "sits_run_to_completion")
        for t in ("high_p99_vs_fifo<=0.10", "high_p99_vs_priority<=0.5",
                  "throughput_vs_fifo>=0.95", "low_max_wait<=aging_bound")}
    assert "ideal (sim)" in ab.table(result)
