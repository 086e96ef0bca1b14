"""What the rescoring pass takes out of Redis that would only accumulate
(``priority/pruning.py``): idle queues no worker consumes, and the remote-control and
event bindings of workers killed; on a real Redis, and with a real worker killed."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from celery import Celery

from sits_queue.app import make_app
from sits_queue.broker.keys import QueueKeys, queues_registry
from sits_queue.config import SitsConfig
from sits_queue.priority import pruning
from sits_queue.priority.rescore import PRUNE_MARK, Rescorer
from sits_queue.procs import celery_command, wait_ready
from sits_queue.workers.advertise import worker_key, workers_key
from tests.integration.conftest import APP_MODULE, ROOT, worker_env
from tests.waiting import wait_for

SEP = "\x06\x16"


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    app = make_app(SitsConfig(redis_url=redis_url, idle_queue_forget_s=2.0), main="prune")

    @app.task(name="t.echo", shared=False)
    def echo(x: str) -> str:
        return x

    yield app
    app.close()


def live(client: redis.Redis, hostname: str, queues: list[str] | None, pid: int = 7
         ) -> None:
    """A worker advertised as live (process ``pid``), consuming ``queues`` (None: its
    record does not say, an earlier release's)."""
    record: dict[str, object] = {"hostname": hostname, "pid": pid}
    if queues is not None:
        record["queues"] = queues
    client.set(worker_key("", hostname), json.dumps(record), ex=60)
    client.zadd(workers_key(""), {hostname: 1.0})


def rescoring_pass(config: SitsConfig, client: redis.Redis) -> None:
    """A pass that prunes: the fleet's mark of the last pruning (one a minute, whichever
    process's pass it is) taken away first."""
    client.delete(f"sits:state:{PRUNE_MARK}")
    Rescorer(config, client).rescore_all()


def registered(client: redis.Redis) -> set[str]:
    return {m.decode() for m in client.smembers(queues_registry(""))}


def test_an_idle_queue_no_worker_consumes_is_forgotten_and_comes_back_with_a_put(
        app: Celery, redis_client: redis.Redis) -> None:
    """(a queue per job left four keys and a registry entry for good, each walked by
    every pass and listed by `sitsq status`)"""
    echo = app.tasks["t.echo"]
    live(redis_client, "w@h", ["served"])
    # Given queues used and emptied (a purge, a worker), one still holding a task, one a
    # live worker consumes, and one registered by a consumer that never got a put
    for queue in ("job-1", "job-2", "busy", "served"):
        echo.apply_async((queue,), queue=queue)
    for queue in ("job-1", "job-2", "served"):
        redis_client.delete(*QueueKeys.for_queue(queue).all()[:4])
    echo.apply_async(("left",), queue="busy")
    redis_client.sadd(queues_registry(""), "never-put")
    for queue in ("job-1", "job-2", "served"):  # (the put counters stay: seq, arr)
        assert redis_client.exists(QueueKeys.for_queue(queue).seq)
    # When a pass sees them, then job-2 gets a put (taken at once), and a pass comes
    # after idle_queue_forget_s (2 s)
    rescoring_pass(app.sits, redis_client)
    assert {"job-1", "job-2", "busy", "served", "never-put"} <= registered(redis_client)
    time.sleep(3.0)  # (the scenario: 2 s without a put)
    echo.apply_async(("again",), queue="job-2")
    redis_client.delete(*QueueKeys.for_queue("job-2").all()[:4])
    rescoring_pass(app.sits, redis_client)
    # Then the empty unconsumed ones without a put go, with their counters; kombu's
    # bindings stay (a producer that declared the queue once routes by them)
    assert registered(redis_client) >= {"busy", "served", "job-2"}
    assert not {"job-1", "never-put"} & registered(redis_client)
    assert redis_client.exists(*QueueKeys.for_queue("job-1").all()) == 0
    assert redis_client.exists("_kombu.binding.job-1")
    assert redis_client.zcard(QueueKeys.for_queue("busy").waiting) == 2
    # (a put count of 1, as job-1's: an integer Redis shares among keys, whose idle
    # time, OBJECT IDLETIME, was any such key's: counted by what the passes saw instead)
    # A put registers it again, and the task is there
    echo.apply_async(("again",), queue="job-1")
    assert "job-1" in registered(redis_client)
    assert redis_client.zcard(QueueKeys.for_queue("job-1").waiting) == 1


def test_no_queue_is_forgotten_where_a_worker_does_not_say_what_it_consumes(
        app: Celery, redis_client: redis.Redis) -> None:
    live(redis_client, "old@h", None)  # (an earlier release's record)
    redis_client.sadd(queues_registry(""), "never-put")
    rescoring_pass(app.sits, redis_client)
    assert "never-put" in registered(redis_client)
    # nor with no worker live (a fleet stopped: none to say what is consumed), and its
    # workers' bindings stay
    redis_client.delete(worker_key("", "old@h"))
    pidbox = SEP.join(["", "", "old@h.celery.pidbox"])
    redis_client.sadd("_kombu.binding.celery.pidbox", pidbox)
    rescoring_pass(app.sits, redis_client)
    assert "never-put" in registered(redis_client)
    assert redis_client.sismember("_kombu.binding.celery.pidbox", pidbox)
    # nor with the setting at 0
    live(redis_client, "new@h", [])
    kept = replace(app.sits, idle_queue_forget_s=0.0)
    rescoring_pass(kept, redis_client)
    assert "never-put" in registered(redis_client)


def test_departed_workers_remote_control_and_event_bindings_are_removed(
        app: Celery, redis_client: redis.Redis) -> None:
    live(redis_client, "up@h", [])
    pidbox = [SEP.join(["", "", f"{host}.celery.pidbox"]) for host in ("up@h", "gone@h")]
    events = [SEP.join(["worker.#", "", f"celeryev.{n}"])
              for n in ("up", "gone", "flower", "before-restart")]
    for table in ("binding", "binding_permanent"):
        redis_client.sadd(f"_kombu.{table}.celery.pidbox", *pidbox)
        redis_client.sadd(f"_kombu.{table}.celeryev", *events)
    pruning.record_event_queues(redis_client, "", "up@h", 7, ["celeryev.up"])
    pruning.record_event_queues(redis_client, "", "gone@h", 8, ["celeryev.gone"])
    # (up@h's crashed process, before it was restarted under its name: by hostname
    # alone, its binding stayed for good)
    pruning.record_event_queues(redis_client, "", "up@h", 6, ["celeryev.before-restart"])
    rescoring_pass(app.sits, redis_client)
    for table in ("binding", "binding_permanent"):
        assert redis_client.smembers(f"_kombu.{table}.celery.pidbox") == {pidbox[0].encode()}
        # (one no worker recorded, Flower's receiver, say, is not ours to remove)
        assert redis_client.smembers(f"_kombu.{table}.celeryev") == {
            events[0].encode(), events[2].encode()}
    assert redis_client.hgetall(pruning.event_queues_key("")) == {b"celeryev.up": b"7 up@h"}


def test_a_killed_workers_bindings_go_once_its_advertisement_expires(
        tmp_path: Path, redis_url: str, redis_client: redis.Redis,
        client_app: Celery) -> None:
    """(each SIGKILL left a pair of members for good: ``celery.pidbox`` and ``celeryev``)"""
    # (a worker as `celery worker` starts one: with gossip, whose event queue is bound)
    host = f"gossip-{os.getpid()}@{os.uname().nodename}"
    worker = celery_command(APP_MODULE, ["worker", "--loglevel=INFO", "--concurrency=1",
                                         f"--hostname={host}"],
                            worker_env(redis_url), tmp_path / "worker.log", ROOT)
    worker.hostname = host
    try:
        wait_ready(client_app, [worker])

        def said() -> list[str]:
            owners = redis_client.hgetall(pruning.event_queues_key(""))
            return [q.decode() for q, h in owners.items() if h.decode().endswith(f" {host}")]

        wait_for(lambda: bool(said()), 30, "the worker to record its event queues")
        (gossip,) = said()
        events = {m.decode() for m in redis_client.smembers("_kombu.binding.celeryev")}
        assert any(m.endswith(gossip) for m in events), events
        assert redis_client.sismember("_kombu.binding.celery.pidbox",
                                      SEP.join(["", "", f"{host}.celery.pidbox"]))
    finally:
        worker.kill()
    # When its advertisement has expired (a crash: nothing said goodbye), in a fleet that
    # goes on (another worker live)
    wait_for(lambda: not redis_client.exists(worker_key("", host)), 30,
             "the killed worker's advertisement to expire")
    live(redis_client, "other@h", [])
    rescoring_pass(client_app.sits, redis_client)
    members = {m.decode() for key in ("_kombu.binding.celeryev", "_kombu.binding.celery.pidbox")
               for m in redis_client.smembers(key)}
    assert not any(m.endswith(gossip) or host in m for m in members), members


def test_a_put_racing_the_forgetting_keeps_its_queue_registered(
        app: Celery, redis_client: redis.Redis) -> None:
    """(forget.lua is atomic, the registry's SREM comes after it: a put in between
    registered the queue first, and the SREM took a queue holding a task out of sight)"""
    echo = app.tasks["t.echo"]
    redis_client.sadd(queues_registry(""), "job-race", "job-quiet")
    # Given both forgotten, and a task put to one before they leave the registry
    echo.apply_async(("raced",), queue="job-race")
    pruning._unregister(redis_client, "", [], [], ["job-race", "job-quiet"])
    # Then the one the put reached stays listed, the other goes
    assert "job-race" in registered(redis_client)
    assert "job-quiet" not in registered(redis_client)


def test_one_pass_a_minute_of_the_whole_fleet_prunes(
        app: Celery, redis_client: redis.Redis) -> None:
    """(each worker's process pruned once a minute: a fleet of N read N records N times)"""
    live(redis_client, "w@h", [])
    table = "_kombu.binding.celery.pidbox"
    redis_client.sadd(table, SEP.join(["", "", "gone-1@h.celery.pidbox"]))
    Rescorer(app.sits, redis_client).rescore_all()  # (another process's, say)
    assert redis_client.scard(table) == 0
    redis_client.sadd(table, SEP.join(["", "", "gone-2@h.celery.pidbox"]))
    Rescorer(app.sits, redis_client).rescore_all()
    assert redis_client.scard(table) == 1  # (within the minute: not again)
    assert 0 < redis_client.pttl(f"sits:state:{PRUNE_MARK}") <= 60_000
