"""Predictive pre-warming against a real Redis and a real worker: finished tasks count as
demand per interval, the planner folds it into the forecast, and a pre-warm sent to the
chosen worker's own queue (Celery's worker_direct, through the sorted-set transport)
leaves the model warm on that worker."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery

from sits_queue.config import SitsConfig
from sits_queue.priority import forecast as fc
from sits_queue.priority import prewarm
from sits_queue.priority.forecast import Forecaster
from sits_queue.priority.tasks import prewarmer
from sits_queue.procs import CeleryProcess
from sits_queue.workers import advertise, signals
from tests.integration.prewarming import INTERVAL_S, worker_fixture
from tests.waiting import wait_for

setup = worker_fixture("prewarm", 1)


def warm_on(r: redis.Redis, hostname: str) -> dict[str, str]:
    record = advertise.read_worker(r, "", hostname) or {}
    return {m: t for c in (record.get("children") or {}).values()
            for m, t in (c.get("warm") or {}).items()}


def demand(r: redis.Redis, config: SitsConfig, bucket: int, model: str) -> int:
    return int(r.hget(prewarm.demand_key(config, bucket), model) or 0)


def test_finished_tasks_count_as_demand_and_are_folded_into_the_forecast(
        setup: tuple[Celery, CeleryProcess], r: redis.Redis) -> None:
    app, _ = setup
    config = app.sits
    # Given a child that imported torch and transformers with another model (a first
    # load pays for them: seconds) and then three generations with lm-b
    app.tasks["sits.generate"].apply_async(("warm",), model="gpt").get(timeout=120)
    first = prewarm.bucket_of(config, time.time())
    for i in range(3):
        app.tasks["sits.generate"].apply_async((f"p{i}",), {"max_new_tokens": 2},
                                               model="lm-b").get(timeout=120)
    last = prewarm.bucket_of(config, time.time())

    def counted() -> bool:
        # the child flushes its statistics with a later task once 0.5 s have passed
        app.tasks["t.ping"].apply_async(("flush",)).get(timeout=30)
        return sum(demand(r, config, b, "lm-b") for b in range(first, last + 3)) == 3

    wait_for(counted, 20, "the demand counts")
    last = max(b for b in range(first, last + 3) if demand(r, config, b, "lm-b"))
    # When the planner runs once those intervals are over
    wait_for(lambda: prewarm.bucket_of(config, time.time()) >= last + 2, 10, "the interval")
    report = prewarmer(app).run(time.time())
    # Then lm-b has a forecaster that saw each interval's demand, stored for the next pass
    stored = {k.decode(): v for k, v in r.hgetall(prewarm.state_key(config)).items()}
    done, interval = json.loads(stored["__bucket__"])  # (the interval it counts in)
    assert interval == config.prewarm_interval_s
    f = fc.from_json(json.loads(stored["lm-b"]))
    assert done >= last + 1 and f.updates >= 1  # from the first interval it was seen in
    assert list(f.history) == [demand(r, config, done, "lm-b"),
                               demand(r, config, done - 1, "lm-b")]
    # and with cold starts of a tiny model far under 850 ms nothing was worth pre-warming
    lm_b = next(o for o in report["outlooks"] if o["model"] == "lm-b")
    assert "not worth it" in lm_b["reason"] and report["sent"] == []


def test_a_confident_forecast_of_a_costly_model_warms_it_on_a_worker(
        setup: tuple[Celery, CeleryProcess], r: redis.Redis) -> None:
    app, worker = setup
    config = app.sits
    assert "lm-c" not in warm_on(r, worker.hostname)
    # Given a forecast that has been right for a day (steady ~90 tasks per interval) ...
    f = fc.Forecaster()
    start = (prewarm.bucket_of(config, time.time()) - 300) * INTERVAL_S
    for k in range(299):
        f = fc.update(f, start + k * INTERVAL_S, 90.0 + (k % 3))
    r.hset(prewarm.state_key(config), "lm-c", json.dumps(fc.to_json(f)))
    r.hset(prewarm.state_key(config), "__bucket__",
           json.dumps(prewarm.bucket_of(config, time.time()) - 1))
    # ... and a model whose cold starts cost 2 s and whose tasks take 60 ms each (as the
    # worker would have counted them on a real GPU fleet)
    counters = advertise.counters_key("", worker.hostname)
    r.hset(counters, mapping={"model_cold_ms:lm-c": 2000.0, "model_cold:lm-c": 1,
                              "model_run_ms:lm-c": 60.0, "model_runs:lm-c": 1})
    # When the planner runs
    report = prewarmer(app).run(time.time())
    # Then it wanted ceil(90 x 0.06 s / 2 s x 1.3) = 4 warm instances, had none, and sent
    # a pre-warm to the one worker there is, which now holds lm-c on its device
    lm_c = next(o for o in report["outlooks"] if o["model"] == "lm-c")
    assert lm_c["reason"] == "pre-warm" and lm_c["confidence"] >= fc.MIN_CONFIDENCE
    assert lm_c["instances"] >= 2 and lm_c["warm_now"] == 0
    assert report["sent"] == [{"model": "lm-c", "hostname": worker.hostname}]
    wait_for(lambda: warm_on(r, worker.hostname).get("lm-c") == "device", 60,
             "the pre-warm to load lm-c")
    # the next pass sees it warm and sends nothing more for it (one worker: no one else)
    again = prewarmer(app).run(time.time())
    assert not [s for s in again["sent"] if s["model"] == "lm-c"]
    assert next(o for o in again["outlooks"] if o["model"] == "lm-c")["warm_now"] == 1


def test_the_prewarm_task_went_through_the_workers_own_queue(
        setup: tuple[Celery, CeleryProcess], r: redis.Redis) -> None:
    _, worker = setup
    queues = {q.decode() for q in r.smembers("sits:queues")}
    assert f"{worker.hostname}.dq2" in queues
    assert worker.alive(), worker.log()[-2000:]
    # under a limit of its own (a load may take longer than the top class's 45 s)
    ran = [line for line in worker.log().splitlines()
           if "sits.prewarm[" in line and "succeeded" in line]
    assert ran and all("'soft_time_limit_s': 480.0, 'time_limit_s': 600.0" in line
                       for line in ran), ran


def test_a_model_without_demand_for_a_day_leaves_the_stored_forecasts(
        redis_url: str, r: redis.Redis) -> None:
    config = replace(SitsConfig(redis_url=redis_url), prewarm_interval_s=300.0,
                     global_keyprefix="forget:")
    key = prewarm.state_key(config)
    stale = fc.update(Forecaster(), 0.0, 3.0)  # demand last seen at t=0
    r.hset(key, mapping={"stale": json.dumps(fc.to_json(stale)),
                         "busy": json.dumps(fc.to_json(fc.update(Forecaster(), 0.0, 3.0))),
                         "__bucket__": json.dumps(int(fc.FORGET_AFTER_S / 300.0))})
    now = fc.FORGET_AFTER_S + 2 * 300.0
    r.hset(prewarm.demand_key(config, prewarm.bucket_of(config, now) - 1), "busy", 4)
    report = prewarm.Prewarmer(config, r, lambda model, host: None).run(now)
    assert set(r.hkeys(key)) == {b"busy", b"__bucket__"}
    assert [o["model"] for o in report["outlooks"]] == ["busy"]


def test_a_prewarm_is_not_demand_nor_work_in_the_statistics(redis_url: str,
                                                            r: redis.Redis) -> None:
    # (counted, the forecaster learned its own pre-warms as demand, and they made hot
    # models hotter and the top class's latency and done counts)
    config = replace(SitsConfig(redis_url=redis_url), prewarm_interval_s=60.0,
                     global_keyprefix="own:")  # (the module's worker counts its tasks)
    for task in ("sits.prewarm", "t.real"):
        request = SimpleNamespace(task=task, sits={"sla_class": "high", "model": "pm"})
        signals.record_completion(config, request, False, time.time())
    signals.flush()
    demand = [r.hget(k, "pm") for k in r.scan_iter(match=prewarm.demand_key(config, 0)[:-1]
                                                   + "*")]
    assert sum(int(d or 0) for d in demand) == 1
    assert int(r.hget(signals.counter_key(config, "done"), "high") or 0) == 1


def test_a_short_interval_still_keeps_its_demand(redis_url: str, r: redis.Redis) -> None:
    # (an interval this short made EXPIRE 0, which deletes the key it should keep)
    config = replace(SitsConfig(redis_url=redis_url), prewarm_interval_s=0.05)
    request = SimpleNamespace(task="t.any", sits={"sla_class": "low", "model": "m"})
    signals.record_completion(config, request, False, time.time())
    signals.flush()
    keys = list(r.scan_iter(match=prewarm.demand_key(config, 0)[:-1] + "*"))
    assert keys and all(r.ttl(k) >= 1 for k in keys)
    assert sum(int(r.hget(k, "m") or 0) for k in keys) == 1


def test_a_changed_interval_starts_the_forecasts_afresh_and_they_update_again(
        redis_url: str, r: redis.Redis) -> None:
    """(the last folded bucket was kept as an index under the old interval: raised from
    60 to 300 s, the next bucket to fold lay centuries ahead and the forecasts froze)"""
    minute = replace(SitsConfig(redis_url=redis_url), prewarm_interval_s=60.0,
                     global_keyprefix="interval:")
    now = 1_800_000_000.0

    def updates(config: SitsConfig, at: float) -> int:
        r.hincrby(prewarm.demand_key(config, prewarm.bucket_of(config, at) - 1), "m1", 10)
        prewarm.Prewarmer(config, r, lambda model, host: None).run(at)
        return int(json.loads(r.hget(prewarm.state_key(config), "m1") or "{}").get("n", 0))

    counts = [updates(minute, now + i * 60) for i in range(3)]
    assert counts[-1] > counts[0]
    five = replace(minute, prewarm_interval_s=300.0)
    later = [updates(five, now + 180 + i * 300) for i in range(1, 4)]
    assert later == sorted(later) and later[-1] > later[0]  # folding again, every pass


@pytest.mark.parametrize("junk", [
    {"state": {"m1": b"{not json"}}, {"state": {"m1": b"\xff\xfe"}},
    {"state": {"m1": b"[1, 2]"}},
    {"state": {"m1": json.dumps({**fc.to_json(fc.update(Forecaster(), 0.0, 5.0)), "e": -1})}},
    {"state": {"__bucket__": b"yesterday"}}, {"state": {"__bucket__": b"[\"x\", 300.0]"}},
    {"demand": {"m1": b"abc"}}, {"demand": {"m1": b"-3"}}, {"demand": {"m1": b"inf"}},
    {"counters": {"model_run_ms:m1": b"1e308", "model_runs:m1": b"1e-300"}},
])
def test_a_record_no_worker_or_beat_writes_does_not_stop_the_planning(
        junk: dict[str, dict[str, Any]], redis_url: str, r: redis.Redis) -> None:
    """(a stored forecast that was no JSON, a bucket that was no number, a demand count of
    "abc", or counters whose mean was inf each failed every planning pass, for every
    model, until someone deleted the record)"""
    config = replace(SitsConfig(redis_url=redis_url), prewarm_interval_s=300.0,
                     global_keyprefix="junk:")
    r.delete(*r.keys("junk:*") or ["junk:none"])
    now = 1_800_000_000.0
    bucket = prewarm.bucket_of(config, now) - 1
    r.hset(prewarm.state_key(config), "m1", json.dumps(fc.to_json(
        fc.update(Forecaster(), (bucket - 1) * 300.0, 5.0))))
    r.hset(prewarm.state_key(config), mapping=junk.get("state", {"__bucket__": "null"}))
    r.hset(prewarm.demand_key(config, bucket),
           mapping={"m1": 5, "m2": 4, **junk.get("demand", {})})
    worker = "junk@host"
    r.hset(advertise.counters_key(config.global_keyprefix, worker),
           mapping=junk.get("counters", {"tasks": 1}))
    r.set(advertise.worker_key(config.global_keyprefix, worker),
          json.dumps({"hostname": worker}), ex=60)
    r.zadd(advertise.workers_key(config.global_keyprefix), {worker: now})

    report = prewarm.Prewarmer(config, r, lambda model, host: None).run(now)

    assert "m2" in {o["model"] for o in report["outlooks"]}  # the good demand was folded
    stored = r.hgetall(prewarm.state_key(config))
    assert json.loads(stored[b"__bucket__"]) == [bucket, 300.0]
    assert fc.from_json(json.loads(stored[b"m2"])).updates >= 1


def confident_forecasts(redis_url: str, r: redis.Redis, prefix: str, models: list[str]
                        ) -> tuple[SitsConfig, float]:
    """A config under ``prefix`` (emptied) whose stored forecasts of ``models`` are
    confident of steady demand; and the time now."""
    config = replace(SitsConfig(redis_url=redis_url), prewarm_interval_s=INTERVAL_S,
                     global_keyprefix=prefix)
    r.delete(*r.keys(f"{prefix}*") or [f"{prefix}none"])
    now = time.time()
    f = fc.Forecaster()
    start = (prewarm.bucket_of(config, now) - 300) * INTERVAL_S
    for k in range(299):
        f = fc.update(f, start + k * INTERVAL_S, 90.0 + (k % 3))
    r.hset(prewarm.state_key(config), mapping={
        **{m: json.dumps(fc.to_json(f)) for m in models},
        "__bucket__": json.dumps(prewarm.bucket_of(config, now) - 1)})
    return config, now


def test_a_worker_of_plain_tasks_only_is_sent_no_prewarm(redis_url: str,
                                                         r: redis.Redis) -> None:
    """(it leaves every inference task: its pre-warms were released in its own queue for
    good, one more each pass, and the model was warmed nowhere)"""
    config, now = confident_forecasts(redis_url, r, "plain:", ["lm-c"])
    # Given a worker of plain tasks only with the most free memory, and one that runs
    # inference, both live, the model's cold starts costly
    for name, free, extra in (("plain@host", 80 * 2**30, {"plain_tasks_only": "threads"}),
                              ("gpu@host", 10 * 2**30, {})):
        r.set(advertise.worker_key("plain:", name), json.dumps(
            {"hostname": name, "devices": [{"free_vram_bytes": free}], **extra}), ex=60)
        r.zadd(advertise.workers_key("plain:"), {name: now})
    r.hset(advertise.counters_key("plain:", "gpu@host"), mapping={
        "model_cold_ms:lm-c": 2000.0, "model_cold:lm-c": 1, "model_run_ms:lm-c": 60.0,
        "model_runs:lm-c": 1})
    sent: list[tuple[str, str]] = []
    report = prewarm.Prewarmer(config, r, lambda m, host: sent.append((m, host))).run(now)
    # Then the pre-warm goes to the worker that can run it
    assert report["sent"] and sent == [("lm-c", "gpu@host")]


def test_a_model_whose_pre_warm_did_not_take_lets_the_next_one_be_warmed(
        redis_url: str, r: redis.Redis) -> None:
    """(a model whose loads fail took the worker's one pre-warm a round at every pass,
    first by name, and the model behind it was never pre-warmed)"""
    config, now = confident_forecasts(redis_url, r, "miss:", ["a-flaky", "b-slow"])
    r.set(advertise.worker_key("miss:", "gpu@host"), json.dumps(
        {"hostname": "gpu@host", "devices": [{"free_vram_bytes": 2**30}]}), ex=60)
    r.zadd(advertise.workers_key("miss:"), {"gpu@host": now})
    r.hset(advertise.counters_key("miss:", "gpu@host"), mapping={
        f"{name}:{m}": value for m in ("a-flaky", "b-slow")
        for name, value in (("model_cold_ms", 2000.0), ("model_cold", 1),
                            ("model_run_ms", 60.0), ("model_runs", 1))})
    sent: list[tuple[str, str]] = []
    prewarmer = prewarm.Prewarmer(config, r, lambda m, host: sent.append((m, host)))
    prewarmer.run(now)
    assert sent == [("a-flaky", "gpu@host")]
    # When its load failed (the worker holds nothing warm at the next pass)
    report = prewarmer.run(now + INTERVAL_S)
    # Then the next model gets the worker's pre-warm, and the first is held off
    assert sent[1:] == [("b-slow", "gpu@host")] and report["held_off"] == ["a-flaky"]
