"""Priority sync between two sites (MISSION §2.3) against two real Redis servers: site
"a" on the session server, site "b" on one of its own. The links' RTTs are pinned in the
peers' URLs (``?rtt_ms=``) so each test chooses its side of the 5 ms threshold."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from sits_queue.app import make_app
from sits_queue.broker import sites
from sits_queue.broker.keys import SEQ_BITS, QueueKeys
from sits_queue.cli import _format_status
from sits_queue.config import SitsConfig
from sits_queue.embedded import EmbeddedRedis

QUEUE = QueueKeys.for_queue("celery")


@pytest.fixture(scope="module")
def site_b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(Path(tmp_path_factory.mktemp("site-b")))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture
def clients(redis_client: redis.Redis, site_b: str) -> Iterator[tuple[redis.Redis, redis.Redis]]:
    b = redis.Redis.from_url(site_b)
    b.flushall()
    sites._syncs.clear()  # each test builds its own sites
    yield redis_client, b
    b.close()


def site_app(url: str, name: str, peer: str, peer_url: str, rtt_ms: float) -> Celery:
    config = SitsConfig(redis_url=url, site=name, site_peers=f"{peer}={peer_url}?rtt_ms={rtt_ms}")
    app = make_app(config, main=f"site-{name}")

    @app.task(name="t.site", shared=False)
    def work(x: Any) -> Any:
        return x

    return app


def replica_ids(b: redis.Redis, origin: str = "a") -> set[str]:
    z = sites.replica_keys("", origin, "celery")[0]
    return {i.decode() for i in b.zrange(z, 0, -1)}


def submit(app: Celery, sla_class: str) -> str:
    """Enqueue one task at site "a"; its id in the queue (the message's delivery tag)."""
    task_id = str(app.tasks["t.site"].apply_async((sla_class,), sla_class=sla_class).id)
    local = redis.Redis.from_url(app.sits.redis_url)
    for tag, payload in local.hscan_iter(QUEUE.payloads):
        if json.loads(payload)["headers"]["id"] == task_id:
            return str(tag.decode())
    raise AssertionError(f"task {task_id} is not in the queue")


def sync_of(app: Celery) -> sites.SiteSync:
    sync = sites.for_config(app.sits)
    assert sync is not None
    return sync


def test_near_peer_top_class_is_replicated_in_the_enqueue(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    _, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    high, medium, low = (submit(app, c) for c in ("high", "medium", "low"))
    # Strong: at the peer before the producer got its AsyncResult back
    assert replica_ids(b) == {high}
    # The others follow with the sync pass: medium digest-checked, low eventually
    report = sync_of(app).sync_pass()
    assert report.peer == "b" and report.modes == {"high": "strong",
                                                   "medium": "async+digest",
                                                   "low": "eventual"}
    assert replica_ids(b) == {high, medium, low}
    # with priorities and payloads, and a heartbeat for the peer to watch
    z, p, _ = sites.replica_keys("", "a", "celery")
    # the same priority level (the arrival counter is the origin's own)
    assert int(b.zscore(z, high) or 0) >> SEQ_BITS == \
        int(clients[0].zscore(QUEUE.waiting, high) or 0) >> SEQ_BITS
    assert b.hget(p, low) == clients[0].hget(QUEUE.payloads, low)
    assert b.exists(sites.alive_key("", "a"))
    # sitsq status: each side's view
    mine = sites.status(clients[0], app.sits)
    assert mine is not None and mine["outbox"] == 0
    assert mine["last_pass"]["peer"] == "b" and mine["last_pass"]["replicated"] == 2
    theirs = sites.status(b, SitsConfig(redis_url="redis://unused", site="b"))
    assert theirs is not None and theirs["replicas_held"] == {"a": 3}
    assert "replica at b (1.0 ms; high strong" in _format_status(
        {"queues": [], "workers": [], "site": mine})
    app.close()


def test_far_peer_skips_the_bottom_class_and_checks_the_top(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    _, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=40.0)
    high, low = submit(app, "high"), submit(app, "low")
    assert replica_ids(b) == set()  # beyond 5 ms nothing waits on the WAN in the enqueue
    sync_of(app).sync_pass()
    assert replica_ids(b) == {high}
    assert low not in replica_ids(b)
    app.close()


def test_an_acked_task_leaves_the_replica(clients: tuple[redis.Redis, redis.Redis],
                                           redis_url: str, site_b: str) -> None:
    _, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    task = submit(app, "high")
    assert replica_ids(b) == {task}
    with app.connection_for_read() as conn:
        message = conn.default_channel.basic_get("celery")
        assert message.delivery_tag == task
        message.ack()
    sync_of(app).sync_pass()
    assert replica_ids(b) == set()
    app.close()


def test_the_digest_repairs_a_replica_that_drifted(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    _, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    kept, lost = submit(app, "medium"), submit(app, "medium")
    sync = sync_of(app)
    sync.sync_pass()
    # Given the peer lost one replica and holds one of a task site a no longer has
    z, p, m = sites.replica_keys("", "a", "celery")
    b.zrem(z, lost)
    b.hdel(p, lost)
    b.hdel(m, lost)
    b.zadd(z, {"ghost": 1.0})
    b.hset(m, "ghost", '{"c": "medium"}')
    sync._digest_at = float("-inf")  # due now
    report = sync.sync_pass()
    assert report.repaired == 2
    assert replica_ids(b) == {kept, lost}
    app.close()


def test_a_silent_site_is_taken_over_and_drops_its_copies_when_back(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    a, b = clients
    app_a = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    app_b = site_app(site_b, "b", "a", redis_url, rtt_ms=1.0)
    urgent, bulk = submit(app_a, "high"), submit(app_a, "low")
    sync_of(app_a).sync_pass()
    assert replica_ids(b) == {urgent, bulk}
    # While site a heartbeats, site b only keeps the replicas
    assert sync_of(app_b).sync_pass().taken_over == 0
    # When a's heartbeat expires at b (here: removed), b first starts counting...
    b.delete(sites.alive_key("", "a"))
    assert sync_of(app_b).sync_pass().taken_over == 0
    # ...and once it has itself heard nothing for site_dead_after_s, takes a's work over
    since = float(b.get(sites.missing_since_key("", "a")) or 0)
    b.set(sites.missing_since_key("", "a"), since - app_b.sits.site_dead_after_s)
    report = sync_of(app_b).sync_pass()
    assert report.taken_over == 2
    assert {i.decode() for i in b.zrange(QUEUE.waiting, 0, -1)} == {urgent, bulk}
    assert b.zscore(QUEUE.waiting, urgent) < b.zscore(QUEUE.waiting, bulk)  # priority kept
    assert replica_ids(b) == set()
    # When a is back, its pass dead-letters its own copies that still wait: they run at b
    back = sync_of(app_a).sync_pass()
    assert back.dropped == 2
    assert a.zcard(QUEUE.waiting) == 0
    assert b"taken over by site b" in (a.hget(QUEUE.dead, urgent) or b"")
    app_a.close()
    app_b.close()


def test_an_unreachable_peer_never_fails_a_put(clients: tuple[redis.Redis, redis.Redis],
                                               redis_url: str) -> None:
    a, _ = clients
    # Given a peer nobody listens on (port 1)
    app = site_app(redis_url, "a", "b", "redis://127.0.0.1:1/0", rtt_ms=1.0)
    task = submit(app, "high")
    assert a.zscore(QUEUE.waiting, task) is not None  # enqueued all the same
    report = sync_of(app).sync_pass()
    assert report.peer is None  # no live peer: nothing to sync with, nothing lost
    # its replica waits in the outbox for the peer to come back
    assert a.llen(sites.outbox_key("")) == 1
    app.close()


def test_a_full_outbox_stops_queueing_eventual_replicas_only(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = clients
    monkeypatch.setattr(sites, "OUTBOX_MAX", 2)
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)  # medium: digest, low: eventual
    for _ in range(3):
        submit(app, "low")  # the third push passes the cap
    assert a.llen(sites.outbox_key("")) == 3
    submit(app, "low")  # eventual: not queued while the outbox is full
    submit(app, "medium")  # digest-checked: still queued
    assert a.llen(sites.outbox_key("")) == 4
    app.close()
