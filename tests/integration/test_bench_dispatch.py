"""Smoke run of the dispatch benchmark at a tiny size (real workers of all three
systems): the JSON and what must hold whatever the speed; never a timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from sits_queue.bench import dispatch
from sits_queue.bench.dispatch import Shape
from sits_queue.bench.dispatch_apps import SYSTEMS, build

# Big enough that stock Celery's ~1 ms tasks outlast the benchmark's 50 ms poll by far
# more than ``MIN_CPU_TASKS``: a 40-task burst could be over before the first poll saw
# a result, leaving no span to time CPU over.
TINY = Shape(burst=300, idle=3, rounds=1)


def test_every_system_runs_its_burst_and_idle_probe(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str,
        redis_client: redis.Redis) -> None:
    out = tmp_path / "dispatch.json"
    monkeypatch.setattr(dispatch, "QUICK", TINY)
    assert dispatch.main(["--quick", "--json", str(out), "--redis-url", redis_url]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"systems", "ratios", "targets", "meta"}
    assert set(result["systems"]) == set(SYSTEMS)
    for name, s in result["systems"].items():
        assert len(s["rounds"]) == 1, name
        assert s["tasks_per_s"] > 0 and s["cpu_ms_per_task"] > 0, (name, s)
        assert s["idle_p99_ms"] >= s["idle_p50_ms"] > 0, (name, s)
    assert all(v is not None for v in result["ratios"].values())
    assert result["meta"]["shape"] == {"burst": 300, "idle": 3, "rounds": 1}
    # Every system's database is left empty
    for db in dispatch.DATABASES.values():
        assert redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + f"/{db}").dbsize() == 0


def test_an_unknown_system_is_refused(redis_url: str) -> None:
    with pytest.raises(ValueError, match="unknown system 'rabbit'"):
        build("rabbit", redis_url)
