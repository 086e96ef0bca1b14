"""Finished tasks' statistics (``workers/signals.py``) reach Redis from a real prefork
worker's pool child, whether the child idles after its last task or exits right after
it (billiard ends a child with ``os._exit``: no ``atexit`` handler runs there)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
import redis
from celery import Celery

from sits_queue.config import SitsConfig
from sits_queue.priority import prewarm
from sits_queue.procs import CeleryProcess
from sits_queue.workers import signals
from tests.waiting import wait_for

Spawn = Callable[..., CeleryProcess]
#: Longest a finished task's record may take to reach Redis here, s: the flush period
#: (0.5 s) plus a slow CI box's scheduling.
ARRIVES_S = 10


def done(r: redis.Redis) -> int:
    return sum(int(v) for v in r.hgetall(signals.counter_key(SitsConfig(), "done")).values())


def latencies(r: redis.Redis) -> int:
    return sum(int(r.llen(k)) for k in r.scan_iter(match="sits:lat:*"))


def test_an_idle_childs_statistics_reach_redis(spawn: Spawn, client_app: Celery,
                                               redis_client: redis.Redis) -> None:
    # Given a prefork worker whose one child runs three tasks, then has nothing to do
    spawn(concurrency=1)
    results = [client_app.tasks["w.add"].delay(i, i) for i in range(3)]
    assert [x.get(timeout=30) for x in results] == [0, 2, 4]
    # Then their records reach Redis while the worker idles (they used to wait in the
    # child's buffer until 29 more tasks finished there)
    wait_for(lambda: done(redis_client) == 3, ARRIVES_S, "the idle child's 3 records")
    assert latencies(redis_client) == 3


def test_a_child_that_exits_after_its_task_flushes_its_statistics(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    # Given children replaced after every task: each exits right after its one task
    spawn(concurrency=1, extra_args=("--max-tasks-per-child=1",))
    results = [client_app.tasks["w.add"].delay(i, 1) for i in range(2)]
    assert [x.get(timeout=30) for x in results] == [1, 2]
    # Then neither record died with its child
    wait_for(lambda: done(redis_client) == 2, ARRIVES_S, "the exited children's 2 records")
    assert latencies(redis_client) == 2


def test_a_retried_task_arrives_twice_finishes_once_and_its_class_keeps_up(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    from sits_queue.priority.rescore import Rescorer

    config = SitsConfig()
    spawn(concurrency=1)
    # Given a task that fails its first run and retries itself: two arrivals, one finish
    result = client_app.tasks["w.flaky"].apply_async(("once", 1), sla_class="low")
    assert result.get(timeout=30)["retries"] == 1
    wait_for(lambda: done(redis_client) == 1, ARRIVES_S, "the finished run's record")
    retried = signals.counter_key(config, "retried")
    wait_for(lambda: redis_client.hget(retried, "low") == b"1", ARRIVES_S,
             "the retried run's record")
    # Then its class is not read as falling behind its arrivals: the run that retried
    # handled its message (it read 1 of 2: a standing QoS boost for retrying classes)
    snapshot = Rescorer(config, redis_client).gather_snapshot(time.time())
    assert snapshot.classes["low"].bandwidth_compliance == 1.0
    assert latencies(redis_client) == 1  # the retried run is no latency sample


def test_demand_counts_in_the_interval_its_task_finished_in(
        redis_url: str, redis_client: redis.Redis) -> None:
    # Given a task that finished three pre-warm intervals before its record is flushed
    config = replace(SitsConfig(redis_url=redis_url), prewarm_interval_s=60.0,
                     global_keyprefix="stamp:")
    finished = time.time() - 3 * config.prewarm_interval_s
    request = SimpleNamespace(task="t.any", sits={"sla_class": "low", "model": "m"})
    signals.record_completion(config, request, False, finished)
    signals.flush()
    # Then the forecaster sees its demand in that interval, not in the flush's
    then = prewarm.demand_key(config, prewarm.bucket_of(config, finished))
    now = prewarm.demand_key(config, prewarm.bucket_of(config, time.time()))
    assert redis_client.hget(then, "m") == b"1"
    assert redis_client.hget(now, "m") is None
    assert redis_client.ttl(then) >= 1


@pytest.mark.parametrize("eta", ["aware", "naive"])
def test_a_task_held_for_its_eta_counts_its_latency_from_when_it_was_due(
        redis_url: str, redis_client: redis.Redis, eta: str) -> None:
    """(a countdown=3 task counted 3 s of latency: its class's p95 and priority rose)"""
    config = replace(SitsConfig(redis_url=redis_url), global_keyprefix=f"eta-{eta}:")
    now = time.time()
    due = datetime.fromtimestamp(now - 0.5, timezone.utc)
    request = SimpleNamespace(task="t.any", sits={"sla_class": "low", "model": "m"},
                              sits_submitted_at=now - 30.5,
                              eta=(due if eta == "aware" else due.replace(tzinfo=None))
                              .isoformat())
    signals.record_completion(config, request, False, now)
    late = SimpleNamespace(task="t.any", sits={"sla_class": "low"}, eta="not a date",
                           sits_submitted_at=now - 2.0)
    signals.record_completion(config, late, False, now)
    signals.flush()
    samples = [float(v) for v in redis_client.lrange(f"eta-{eta}:sits:lat:low", 0, -1)]
    assert sorted(samples) == pytest.approx([500.0, 2000.0], abs=1.0)


def test_a_hand_made_header_s_junk_loses_no_other_task_s_statistics(
        redis_url: str, redis_client: redis.Redis) -> None:
    """(a model that was no name, {"a": 1}, was refused as a hash field, and with it the
    whole flush: up to 32 tasks' counts, latencies and demand; a submission time past a
    float's range raised in the post-run handler, and -1e308 wrote an infinite latency)"""
    config = replace(SitsConfig(redis_url=redis_url), global_keyprefix="junk:")
    now = time.time()
    good = SimpleNamespace(task="t.any", sits={"sla_class": "low", "model": "m"},
                           sits_submitted_at=now - 1.0)
    junk = [SimpleNamespace(task="t.any", sits={"sla_class": "low", "model": model},
                            sits_submitted_at=submitted)
            for model, submitted in (({"a": 1}, now - 0.25), (["m"], 10 ** 400), ("", -1e308),
                                     ("x" * 10_000, float("nan")), (7, True))]
    for request in (good, *junk, good):
        signals.record_completion(config, request, False, now)
    signals.flush()
    # Then every task is counted, the good ones' model too, and no latency is junk
    # (the first junk one's time is a time: its latency counts)
    assert redis_client.hget("junk:sits:done", "low") == b"7"
    assert redis_client.hgetall("junk:sits:hot") == {b"m": b"2"}
    samples = [float(v) for v in redis_client.lrange("junk:sits:lat:low", 0, -1)]
    assert sorted(samples) == pytest.approx([250.0, 1000.0, 1000.0], abs=1.0)


def test_each_app_s_statistics_go_to_its_own_redis(redis_url: str,
                                                   redis_client: redis.Redis) -> None:
    """(one flush wrote every buffered record to the Redis of the configuration it was
    called with: a process with two apps, two sites or a test's app beside the package's
    default one on localhost:6379, wrote one's statistics into the other's server)"""
    base = redis_url.rsplit("/", 1)[0]
    ours, theirs = (SitsConfig(redis_url=f"{base}/{db}") for db in (0, 1))
    other = redis.Redis.from_url(theirs.redis_url)
    other.flushdb()
    for config, cls in ((ours, "low"), (theirs, "high")):
        request = SimpleNamespace(task="t.any", sits={"sla_class": cls, "model": "m"})
        signals.record_completion(config, request, False, time.time())
    signals.flush()
    assert redis_client.hget("sits:done", "low") == b"1"
    assert redis_client.hget("sits:done", "high") is None
    assert other.hget("sits:done", "high") == b"1" and other.hget("sits:done", "low") is None
    other.flushdb()
    other.close()


def test_a_counter_field_that_is_no_number_starts_again_and_the_rest_is_recorded(
        redis_url: str, redis_client: redis.Redis) -> None:
    """(another program's "abc" refused every increment: the class's done count stopped
    growing, and every flush logged it)"""
    config = SitsConfig(redis_url=redis_url)
    redis_client.hset("sits:done", "low", "abc")
    redis_client.hset("sits:hot", "m", "lots")
    for _ in range(2):
        request = SimpleNamespace(task="t.any", sits={"sla_class": "low", "model": "m"})
        signals.record_completion(config, request, True, time.time())
        signals.flush()
    assert redis_client.hget("sits:done", "low") == b"2"
    assert redis_client.hget("sits:failed", "low") == b"2"  # (its neighbours were kept)
    assert float(redis_client.hget("sits:hot", "m") or 0) == 2.0


def test_a_counter_refused_by_a_full_server_keeps_its_count(
        redis_url: str, redis_client: redis.Redis) -> None:
    """(an increment refused for want of memory was taken for a field that is no number:
    the count went back to one once the server had room)"""
    config = SitsConfig(redis_url=redis_url)
    redis_client.hset("sits:done", "medium", 300)
    # Given a flush whose increment the server refused while full, and room again since
    refused = redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
    signals._reset_refused_counters(config, [("HINCRBY", "sits:done", "medium", 1)],
                                    [refused])
    # Then the count is as it was, and grows from there
    assert redis_client.hget("sits:done", "medium") == b"300"
    request = SimpleNamespace(task="t.any", sits={"sla_class": "medium", "model": "m"})
    signals.record_completion(config, request, False, time.time())
    signals.flush()
    assert redis_client.hget("sits:done", "medium") == b"301"
