"""Smoke test of the broker benchmark's building blocks at a tiny size (no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from sits_queue.bench import broker
from sits_queue.bench.broker import Sizes
from sits_queue.bench.report import database_url

TINY = Sizes(delay_n=20, rounds=2, bulk_n=300, picks=50)


def test_run_reports_every_measure_with_the_right_counts(redis_url: str,
                                                         redis_client: redis.Redis) -> None:
    result = broker.run(quick=True, redis_url=redis_url, sizes=TINY,
                        on_progress=lambda _line: None)
    assert set(result) == {"delay_rate", "bulk_enqueue", "pick_latency", "rescore_pass",
                           "targets", "meta"}
    delay = result["delay_rate"]
    assert {"sits_tps", "celery_tps", "ratio"} <= set(delay)
    assert delay["n"] == TINY.delay_n
    assert result["bulk_enqueue"]["n"] == TINY.bulk_n and result["bulk_enqueue"]["tps"] > 0
    rescore = result["rescore_pass"]
    assert {"waiting", "duration_ms", "max_call_ms_client", "slowlog_over_5ms"} <= set(rescore)
    assert rescore["waiting"] == rescore["rewritten"] == TINY.bulk_n
    pick = result["pick_latency"]
    assert {"waiting", "p50_ms", "p99_ms", "max_ms"} <= set(pick)
    assert pick["waiting"] == TINY.bulk_n and pick["picks"] == TINY.picks
    assert set(result["targets"]) == {"delay_rate", "bulk_enqueue", "pick_latency",
                                      "rescore_pass"}
    assert {"redis_version", "python", "date", "quick"} <= set(result["meta"])
    assert broker.table(result).count("\n") >= 4
    # The bench leaves nothing behind and puts the server's SLOWLOG settings back.
    assert redis_client.dbsize() == 0
    assert redis_client.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"] \
        == "10000"


def test_main_writes_the_json_file(redis_url: str, redis_client: redis.Redis,
                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "bench.json"
    monkeypatch.setattr(broker, "QUICK", TINY)
    assert broker.main(["--quick", "--json", str(out), "--redis-url", redis_url]) == 0
    assert json.loads(out.read_text())["bulk_enqueue"]["n"] == TINY.bulk_n


def test_fill_items_follow_the_class_mix() -> None:
    plan = broker.fill_items(1000)
    assert [(c, len(items)) for c, _m, items in plan] == [("high", 100), ("medium", 200),
                                                          ("low", 700)]


def test_db_url_moves_to_the_next_database() -> None:
    assert database_url("redis://:pw@127.0.0.1:7000/3", 1) == "redis://:pw@127.0.0.1:7000/4"
    assert database_url("redis://127.0.0.1:7000", 1) == "redis://127.0.0.1:7000/1"
