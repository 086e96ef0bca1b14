"""A worker's advertisement and counters (``workers/advertise.py``) live as long as the
worker, on every pool: with ``--pool=solo`` a task runs on the thread of the consumer's
event loop, which cannot refresh anything until the task ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from celery import Celery

from sits_queue.config import SitsConfig
from sits_queue.procs import start_worker, wait_ready
from sits_queue.workers import advertise, metrics
from tests.integration import short_ttl_app
from tests.integration.conftest import ROOT, worker_env
from tests.waiting import wait_for

#: The task outlasts four of the worker's TTLs (the counters' expiry used to be four).
TASK_S = 5 * short_ttl_app.TTL_S


def test_a_solo_worker_stays_advertised_with_its_counts_through_a_long_task(
        tmp_path: Path, redis_url: str, client_app: Celery, redis_client: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a solo worker whose advertisement lives a second unless refreshed
    proc = start_worker("tests.integration.short_ttl_app", worker_env(redis_url), tmp_path,
                        concurrency=1, pool="solo", cwd=ROOT)
    try:
        wait_ready(client_app, [proc])
        # and what its earlier inference tasks counted, as a child of it publishes it
        monkeypatch.setattr(advertise, "TTL_S", short_ttl_app.TTL_S)
        assert advertise.publish_child(SitsConfig(redis_url=redis_url), proc.hostname, 0,
                                       {}, {"tasks": 120, "tasks:medium": 120, "cold": 7})
        counters = advertise.counters_key("", proc.hostname)
        counted = redis_client.hgetall(counters)
        # When it runs one task for five of those TTLs
        result = client_app.tasks["w.slow"].delay("long", TASK_S)
        wait_for(lambda: redis_client.llen("test:started") == 1, 30, "the task to start")
        missing: list[str] = []

        def finished() -> bool:
            # (what `sitsq status` lists, and what its own /metrics endpoint reads)
            if proc.hostname not in advertise.live_hostnames(redis_client):
                missing.append("advertisement")
            if not metrics.read(redis_client, "", proc.hostname):
                missing.append("metrics record")
            if redis_client.hgetall(counters) != counted:
                missing.append("counters")
            return result.ready()

        wait_for(finished, TASK_S + 30, "the long task to finish")
        assert result.get(timeout=1) == "long"
        # Then nobody saw it gone, nor its counts restart, while the task ran
        assert not missing, sorted(set(missing))
        assert redis_client.hgetall(counters) == counted
    finally:
        proc.stop(timeout_s=15)
    # and a worker that stops takes its advertisement and its counters with it
    assert proc.hostname not in advertise.live_hostnames(redis_client)
    assert not redis_client.exists(counters)


def test_workers_are_found_without_scanning_the_keyspace(
        redis_client: redis.Redis) -> None:
    """(a SCAN of every key found them: a round trip per 200 keys, 43k a call beside a
    day of results at 100 tasks/s, on every `sitsq status` and fleet scrape)"""
    from sits_queue.workers.devices import cpu_device

    # Given many other keys (a result backend's), one live worker and one killed
    redis_client.mset({f"celery-task-meta-{i}": "{}" for i in range(5000)})
    advertise.refresh(redis_client, "", "live@h", 1, 1, [cpu_device()], 1.0)
    advertise.refresh(redis_client, "", "killed@h", 2, 1, [cpu_device()], 1.0)
    redis_client.delete(advertise.worker_key("", "killed@h"))  # its record expired
    before = redis_client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)
    # Then the live one is found, the killed one leaves the registry, and nothing scans
    assert advertise.live_hostnames(redis_client) == ["live@h"]
    assert redis_client.zrange(advertise.workers_key(""), 0, -1) == [b"live@h"]
    assert [w["hostname"] for w in advertise.read_workers(redis_client)] == ["live@h"]
    after = redis_client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)
    assert after == before
    # and one that stops withdraws from it
    advertise.withdraw(redis_client, "", "live@h", 1)
    assert advertise.live_hostnames(redis_client) == []
    assert redis_client.zcard(advertise.workers_key("")) == 0


def test_a_workers_counts_are_read_as_of_now_not_as_of_its_last_refresh(
        redis_client: redis.Redis) -> None:
    """(`sitsq status` read the record's copy, up to a refresh old: it said 0 tasks while
    /metrics said 3)"""
    from sits_queue.workers.devices import cpu_device

    advertise.refresh(redis_client, "", "w@h", 1, 1, [cpu_device()], 1.0)
    redis_client.hset(advertise.counters_key("", "w@h"), mapping={"tasks": 3, "cold": 1})
    (worker,) = advertise.read_workers(redis_client)
    assert (worker["cold_start"]["tasks"], worker["cold_start"]["cold"]) == (3, 1)
    # A counters key of another type (another program's) leaves the record's copy
    redis_client.delete(advertise.counters_key("", "w@h"))
    redis_client.set(advertise.counters_key("", "w@h"), "junk")
    (worker,) = advertise.read_workers(redis_client)
    assert worker["cold_start"]["tasks"] == 0


def test_a_refresh_keeps_the_records_of_the_slots_it_is_given(
        redis_client: redis.Redis) -> None:
    """A pool shrunk from three to two children keeps slots 1 and 2: both records are
    kept alive and read back, not 0 (gone) and 1."""
    from sits_queue.workers.devices import cpu_device

    for slot in (1, 2):
        redis_client.set(advertise.child_key("", "shrunk@h", slot),
                         json.dumps({"warm": {f"m{slot}": "device"}}))
    advertise.refresh(redis_client, "", "shrunk@h", 1, 2, [cpu_device()], 1.0, slots=[1, 2])
    for slot in (1, 2):  # (-1 before: kept for good)
        assert 0 < redis_client.pttl(advertise.child_key("", "shrunk@h", slot)) \
            <= advertise.TTL_S * 1000
    record = advertise.read_worker(redis_client, "", "shrunk@h")
    assert record is not None
    assert (record["slots"], sorted(record["children"])) == ([1, 2], ["1", "2"])
    assert record["warm"] == ["m1", "m2"]
    # what admission reads of its own worker: the same children, without the counters
    assert advertise.read_children(redis_client, "", "shrunk@h") == record["children"]
    assert advertise.read_children(redis_client, "", "gone@h") == {}


def test_a_child_record_lost_with_redis_s_data_is_written_back(
        tmp_path: Path, redis_url: str, client_app: Celery,
        redis_client: redis.Redis) -> None:
    """(after a Redis restart without persistence an idle child's record, its warm
    engines, stayed missing, out of affinity's, status's and the metrics' sight, until
    the child ran a task)"""
    proc = start_worker("tests.integration.short_ttl_app", worker_env(redis_url), tmp_path,
                        concurrency=1, cwd=ROOT)
    key = advertise.child_key("", proc.hostname, 0)
    try:
        wait_ready(client_app, [proc])
        assert client_app.tasks["w.add"].delay(1, 2).get(timeout=30) == 3
        wait_for(lambda: redis_client.exists(key), 15, "the child's record")
        record = json.loads(redis_client.get(key))
        redis_client.delete(key)  # (what a restart without persistence leaves)
        wait_for(lambda: redis_client.exists(key), 5, "the record written back")
        assert json.loads(redis_client.get(key)) == record
        assert "wrote back the records of children [0]" in proc.log()
    finally:
        proc.stop(timeout_s=15)


def test_only_the_same_live_child_s_record_is_written_back(redis_client: redis.Redis) -> None:
    from sits_queue.workers.readvert import ChildRecords

    records = ChildRecords()
    for slot, pid in ((0, 111), (1, 222), (2, 333)):
        redis_client.set(advertise.child_key("", "w@h", slot), json.dumps({"pid": pid}))
    assert records.keep(redis_client, "", "w@h", {0: 111, 1: 222, 2: 333}) == []
    redis_client.delete(*(advertise.child_key("", "w@h", s) for s in range(3)))
    redis_client.set(advertise.child_key("", "w@h", 2), json.dumps({"pid": 333, "new": 1}))
    # slot 0: its child lives on; slot 1: replaced (a hard-limit kill): not its record;
    # slot 2: the child wrote its own meanwhile, which stays
    assert records.keep(redis_client, "", "w@h", {0: 111, 1: 999, 2: 333}) == [0]
    assert json.loads(redis_client.get(advertise.child_key("", "w@h", 0))) == {"pid": 111}
    assert not redis_client.exists(advertise.child_key("", "w@h", 1))
    assert json.loads(redis_client.get(advertise.child_key("", "w@h", 2)))["new"] == 1
    assert 0 < redis_client.ttl(advertise.child_key("", "w@h", 0)) <= advertise.TTL_S
