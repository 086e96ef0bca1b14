"""Priority sync between two sites (MISSION §2.3) against two real Redis servers: site
"a" on the session server, site "b" on one of its own. The links' RTTs are pinned in the
peers' URLs (``?rtt_ms=``) so each test chooses its side of the 5 ms threshold."""

from __future__ import annotations

import json
import math
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from celery import Celery
from kombu import Exchange, Queue

from sits_queue.app import make_app
from sits_queue.broker import deadletters, recovery, sites, takeover
from sits_queue.broker.keys import (
    SEQ_BITS,
    QueueKeys,
    epoch_key,
    missing_since_key,
    takenover_key,
)
from sits_queue.broker.scripts import Scripts
from sits_queue.config import SitsConfig
from sits_queue.embedded import EmbeddedRedis
from sits_queue.priority.sites import Link, Peer, encode_choice
from sits_queue.procs import CeleryProcess
from sits_queue.status import format_status, site_status
from tests.waiting import wait_for

QUEUE = QueueKeys.for_queue("celery")


def embedded_site(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[str]:
    """Another site's Redis: a private server of its own."""
    server = EmbeddedRedis(Path(tmp_path_factory.mktemp(name)))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def site_b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from embedded_site(tmp_path_factory, "site-b")


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


@pytest.fixture(scope="module")
def site_c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from embedded_site(tmp_path_factory, "site-c")


@pytest.fixture
def c(site_c: str) -> Iterator[redis.Redis]:
    """A client on site c's Redis, emptied first."""
    client = redis.Redis.from_url(site_c)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def hung_peer() -> Iterator[tuple[str, list[socket.socket]]]:
    """A peer that accepts connections and never answers, as a hung Redis does; and the
    connections it was offered (one per attempt: redis-py drops one that timed out)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.05)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:  # the accept timed out: look at stop again
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0", accepted
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


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


def forget_here(local: redis.Redis, task: str) -> None:
    """``task`` acked at site "a" (ack.lua), and nothing more: no replica delete queued."""
    Scripts.register().run("ack", QUEUE, [task], local)


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
    mine = site_status(clients[0], app.sits)
    assert mine is not None and mine["outbox"] == 0
    assert mine["last_pass"]["peer"] == "b" and mine["last_pass"]["replicated"] == 2
    theirs = site_status(b, SitsConfig(redis_url="redis://unused", site="b"))
    assert theirs is not None and theirs["replicas_held"] == {"a": 3}
    shown = format_status({"queues": [], "workers": [], "site": mine})
    assert "replica at b (1.0 ms; high strong" in shown
    assert 0 <= mine["last_pass_age_s"] < 60 and "last sync pass " in shown
    # a site whose beat never ran says so (its peers would take it over)
    assert "no sync pass yet (is a beat running?" in format_status(
        {"queues": [], "workers": [], "site": theirs})
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


def test_a_task_whose_ack_failed_keeps_its_replica(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    """qos.ack queues the replica's delete with the deferred ack; an ack that then fails
    for good leaves the task here (redelivered later): it keeps its replica, which goes
    with the digest once the task is gone after all."""
    a, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=40.0)
    sync = sync_of(app)
    kept, done = submit(app, "high"), submit(app, "high")
    sync.sync_pass()
    assert replica_ids(b) == {kept, done}
    forget_here(a, done)
    sync.on_ack("celery", [kept, done])  # kept's ack never took effect
    sync.sync_pass()
    assert replica_ids(b) == {kept}
    forget_here(a, kept)  # its redelivery ran and was acked, the del lost with a crash
    sync._digest_at = float("-inf")
    assert sync.sync_pass().repaired == 1
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


def test_a_peer_restarted_empty_gets_the_replicas_and_their_registration_back(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    """The digest rewrote the replicas, but the registration that take-over and `sitsq
    status` find them by waited for a per-process 10 s cache: a peer flushed within it
    held replicas it would never take over."""
    _, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    held = {submit(app, "medium"), submit(app, "medium")}
    sync = sync_of(app)
    sync.sync_pass()
    b.flushall()  # the peer restarts empty, inside the registration cache's period
    sync._digest_at = float("-inf")
    assert sync.sync_pass().repaired == 2
    assert replica_ids(b) == held
    assert b.smembers(sites.origins_key("")) == {b"a"}
    assert b.smembers(sites.replica_queues_key("", "a")) == {b"celery"}
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
    since = float(b.get(missing_since_key("", "a")) or 0)
    b.set(missing_since_key("", "a"), since - app_b.sits.site_dead_after_s)
    report = sync_of(app_b).sync_pass()
    assert report.taken_over == 2
    assert {i.decode() for i in b.zrange(QUEUE.waiting, 0, -1)} == {urgent, bulk}
    assert b.zscore(QUEUE.waiting, urgent) < b.zscore(QUEUE.waiting, bulk)  # priority kept
    assert replica_ids(b) == set()
    # Given a replica of the bulk task back at b meanwhile (an outbox entry drained
    # late): eventual, so no digest would ever remove it
    z, p, m = sites.replica_keys("", "a", "celery")
    b.zadd(z, {bulk: 1.0})
    b.hset(p, bulk, a.hget(QUEUE.payloads, bulk) or b"")
    b.hset(m, bulk, a.hget(QUEUE.meta, bulk) or b"")
    # When a is back, its pass dead-letters its own copies that still wait: they run at b
    sync_of(app_a)._digest_at = float("-inf")  # a digest due too: it must not re-add them
    back = sync_of(app_a).sync_pass()
    assert back.dropped == 2 and back.repaired == 0
    assert a.zcard(QUEUE.waiting) == 0
    assert b"taken over by site b" in (a.hget(QUEUE.dead, urgent) or b"")
    # and no replica of either is left for a later take-over to run again
    assert replica_ids(b) == set()
    app_a.close()
    app_b.close()


def test_a_pass_lock_left_by_a_killed_worker_stops_no_heartbeat(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    """A worker killed mid-pass leaves the pass lock for its timeout (30 s or more), past
    a short site_dead_after_s: the other workers' beats skipped everything, heartbeats
    too, and the peer took over a live site."""
    a, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    sync = sync_of(app)
    assert sync.local.lock("sits:site:sync-lock", timeout=60).acquire(blocking=False)
    try:
        assert sync.sync_pass_locked() is None  # the pass is skipped
        assert b.exists(sites.alive_key("", "a"))  # the heartbeat is not
    finally:
        a.delete("sits:site:sync-lock")
        app.close()


def test_a_worker_heartbeats_its_site_while_every_slot_is_busy_and_no_beat_runs(
        clients: tuple[redis.Redis, redis.Redis], site_b: str, client_app: Celery,
        spawn: Callable[..., CeleryProcess]) -> None:
    """(heartbeats came from the sync pass, a task run in a pool slot: while long tasks
    held every slot, or the beat was down, the site went silent and its peer took its
    work over, running it a second time)"""
    a, b = clients
    alive = sites.alive_key("", "a")
    spawn(concurrency=1, site="a", site_peers=f"b={site_b}?rtt_ms=1")
    busy = client_app.tasks["w.slow"].apply_async(("busy", 8.0))
    wait_for(lambda: a.llen("test:started") == 1, 30, "the only slot to be taken")
    # While the slot is busy (and no beat runs passes), the heartbeat comes back each time
    for _ in range(3):
        b.delete(alive)
        wait_for(lambda: b.exists(alive), 5, "the worker's heartbeat at the peer")
    assert not busy.ready()
    assert busy.get(timeout=30) == "busy"


def test_no_heartbeat_goes_while_the_sites_own_redis_does_not_answer(
        clients: tuple[redis.Redis, redis.Redis], site_b: str) -> None:
    """(a site whose Redis is lost must read as lost, whatever its workers do)"""
    _, b = clients
    config = SitsConfig(redis_url="redis://127.0.0.1:1/0", site="a",
                        site_peers=f"b={site_b} c=redis://127.0.0.1:1/0")
    with pytest.raises(redis.ConnectionError):
        sites.SiteSync(config).heartbeat_peers()
    assert not b.exists(sites.alive_key("", "a"))
    # With it answering, each peer that answers hears; one that does not is tried again
    # only after a while (each try waits for it)
    sync = sites.SiteSync(config, local=b)
    assert sync.heartbeat_peers() == ({"b"}, {"c"})
    assert b.exists(sites.alive_key("", "a"))
    assert sync.heartbeat_peers() == ({"b"}, set())


def test_a_peer_url_naming_this_sites_own_redis_is_refused_and_said(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str) -> None:
    """(a peer URL pointing back here under another name took the replicas into the
    site's own Redis, and nothing said so)"""
    a, _ = clients
    app = site_app(redis_url, "a", "b", redis_url, rtt_ms=1.0)
    submit(app, "medium")  # an eventual replica: left to the pass
    report = sync_of(app).sync_pass()
    assert [e.startswith("b: is this site's own Redis server") for e in report.errors] == [
        True]
    assert a.keys("sits:replica:*") == []  # nothing drained or digested into itself
    # nor written there by a producer: an urgent task's replica is strong, in the put
    # itself (it went there, was never deleted, and the "peer" ran the task again once
    # this site's workers stopped), and no heartbeat goes there either
    submit(app, "high")
    sync_of(app).sync_pass()
    assert a.keys("sits:replica:*") == []
    assert not a.exists(sites.alive_key("", "a"))
    line = format_status({"queues": [], "workers": [], "stray": {},
                           "site": site_status(a, app.sits)})
    assert "last pass: b: is this site's own Redis server" in line
    app.close()


def test_two_deployments_under_one_site_name_are_said_and_take_none_of_each_others_tasks(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str,
        c: redis.Redis, site_c: str) -> None:
    """Each took the other's record at the peer for its own Redis having restarted, and
    put back the other's replicated tasks into its own queues: they ran twice. (Here
    site c's Redis is the second deployment's, also named "a".)"""
    a, _ = clients
    first = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    second = site_app(site_c, "a", "b", site_b, rtt_ms=1.0)
    mine = {submit(first, "high") for _ in range(2)}
    theirs = {submit(second, "high") for _ in range(2)}
    syncs = [sync_of(first), sync_of(second)]
    assert syncs[0] is not syncs[1]
    # When their passes alternate, each clock moved past every confirmation time
    reports: list[list[sites.PassReport]] = [[], []]
    for n in range(4):
        for i, sync in enumerate(syncs):
            sync.clock = lambda n=n: time.time() + n * 2 * first.sits.site_dead_after_s
            reports[i].append(sync.sync_pass())
    # Then neither put back the other's tasks, and each says why it syncs no more there
    assert {i.decode() for i in a.zrange(QUEUE.waiting, 0, -1)} == mine
    assert {i.decode() for i in c.zrange(QUEUE.waiting, 0, -1)} == theirs
    for own in reports:
        assert sum(r.restored for r in own) == 0
        last = own[-1].errors
        assert len(last) == 1 and "writes here as site 'a' too: two deployments must not " \
            "share a site name" in last[0], last
    line = format_status({"queues": [], "workers": [], "stray": {},
                           "site": site_status(a, first.sits)})
    assert "two deployments must not share a site name" in line
    first.close()
    second.close()


def test_a_peer_that_forbids_info_is_synced_to(clients: tuple[redis.Redis, redis.Redis],
                                              redis_url: str, site_b: str) -> None:
    """(a managed Redis may refuse INFO: the own-server check is then skipped, the pass
    goes on)"""
    _, b = clients
    b.acl_setuser("noinfo", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                  commands=["+@all", "-info"])
    parts = urlsplit(site_b)
    url = f"redis://noinfo:pw@{parts.hostname}:{parts.port}/0"
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis.from_url(url).info("server")
    try:
        app = site_app(redis_url, "a", "b", url, rtt_ms=1.0)
        medium = submit(app, "medium")
        report = sync_of(app).sync_pass()
        assert report.errors == [] and replica_ids(b) == {medium}
        assert b.get(epoch_key("", "a")) is not None  # the pass's record, written there
        app.close()
    finally:
        b.acl_deluser("noinfo")


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


def test_this_sites_own_queues_are_not_replicated(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str) -> None:
    # (the beat's tasks on the control queue and a worker's own queue's are this site's
    # alone; replicated, they filled the outbox, ~5 entries a second with no traffic,
    # while the peer was away)
    a, _ = clients
    app = site_app(redis_url, "a", "b", "redis://127.0.0.1:1/0", rtt_ms=1.0)
    app.tasks["sits.check_triggers"].apply_async()
    app.tasks["t.site"].apply_async(("high",), sla_class="high", queue="w1@h.dq2")
    assert a.llen(sites.outbox_key("")) == 0
    submit(app, "high")  # a task of a shared queue still is
    assert a.llen(sites.outbox_key("")) == 1
    app.close()


def test_the_digest_leaves_this_sites_own_queues_and_a_take_over_drops_their_replicas(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    """(the digest walked every registered queue: a peer that took over got the origin's
    maintenance tasks, and its workers' own queues, which no worker there serves)"""
    a, b = clients
    app_a = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    app_b = site_app(site_b, "b", "a", redis_url, rtt_ms=1.0)
    app_a.tasks["sits.check_triggers"].apply_async()
    app_a.tasks["t.site"].apply_async(("high",), sla_class="high", queue="w1@h.dq2")
    shared = submit(app_a, "high")
    sync = sync_of(app_a)
    sync._digest_at = float("-inf")  # due now
    assert sync.sync_pass().repaired == 0
    assert {k.decode() for k in b.keys("sits:replica:{a:*:z")} == {
        "sits:replica:{a:celery}:z"}
    # Given replicas of the site's own queues at b (as an older digest wrote them)
    for queue in ("sits.control", "w1@h.dq2"):
        b.zadd(sites.replica_keys("", "a", queue)[0], {"old": 1.0})
        b.hset(sites.replica_keys("", "a", queue)[2], "old", '{"c": "high"}')
        b.sadd(sites.replica_queues_key("", "a"), queue)
    # When b takes a over, it takes the shared queue's task only, and drops the others
    b.delete(sites.alive_key("", "a"))
    sync_of(app_b).sync_pass()
    since = float(b.get(missing_since_key("", "a")) or 0)
    b.set(missing_since_key("", "a"), since - app_b.sits.site_dead_after_s)
    assert sync_of(app_b).sync_pass().taken_over == 1
    assert {i.decode() for i in b.zrange(QUEUE.waiting, 0, -1)} == {shared}
    assert b.keys("sits:replica:*") == [] and not b.exists("sits:{w1@h.dq2}:z")
    assert a.zcard(QueueKeys.for_queue("sits.control").waiting) == 1  # still a's own
    app_a.close()
    app_b.close()


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


def test_a_full_outbox_caps_while_no_peer_answers(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap is for a long outage: with no live peer every class's mode is SKIP, and
    the filter by mode let every put through."""
    a, _ = clients
    monkeypatch.setattr(sites, "OUTBOX_MAX", 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens there
    app = site_app(redis_url, "a", "b", gone, rtt_ms=1.0)
    assert sync_of(app).plan().link is None
    for _ in range(3):
        submit(app, "low")
    assert a.llen(sites.outbox_key("")) == 3
    for _ in range(5):
        submit(app, "low")  # bottom tier: not queued while the outbox is full
    submit(app, "medium")  # digest-checked: still queued
    assert a.llen(sites.outbox_key("")) == 4
    app.close()


def test_a_dead_letter_requeued_with_its_id_gets_its_replica_back(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    # (its delete and its new put, of one id, reach the outbox one after the other)
    _, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    task = submit(app, "low")  # eventual: no digest would ever repair it
    sync_of(app).sync_pass()
    assert replica_ids(b) == {task}
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        channel.basic_get("celery").reject(requeue=False)  # a dead letter: its delete
        assert deadletters.requeue(channel, "celery", [task]) == ([task], {})  # its put
    sync_of(app).sync_pass()
    assert replica_ids(b) == {task}
    app.close()


def three_sites(redis_url: str, site_b: str, site_c: str, monkeypatch: pytest.MonkeyPatch,
                rtt: dict[str, float]) -> tuple[Celery, sites.SiteSync]:
    """Site a with peers b and c, whose links "measure" as ``rtt`` says at the time (an
    infinite RTT: down)."""
    app = make_app(SitsConfig(redis_url=redis_url, site="a",
                              site_peers=f"b={site_b} c={site_c}"), main="site-a3")

    @app.task(name="t.site", shared=False)
    def work(x: Any) -> Any:
        return x

    sync = sync_of(app)
    monkeypatch.setattr(sync, "_measure", lambda peer: Link(peer, rtt[peer.name],
                                                            math.isfinite(rtt[peer.name])))
    return app, sync


def test_a_new_replica_peer_gets_the_replicas_and_the_old_one_still_hears_from_us(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str, site_c: str,
        c: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    _, b = clients
    rtt = {"b": 1.0, "c": 2.0}
    app, sync = three_sites(redis_url, site_b, site_c, monkeypatch, rtt)
    done, waits = submit(app, "high"), submit(app, "high")
    assert sync.sync_pass().peer == "b" and replica_ids(b) == {done, waits}
    # When a route change makes c the nearer peer
    rtt.update(b=3.0, c=1.0)
    sync._links_at = float("-inf")  # measured again now
    report = sync.sync_pass()
    # Then c keeps the replicas and b none: b hears of no ack any more
    assert report.peer == "c" and report.handed_over == 2
    assert replica_ids(c) == {done, waits} and replica_ids(b) == set()
    held = site_status(b, SitsConfig(redis_url="redis://unused", site="b"))
    assert held is not None and held["replicas_held"] == {"a": 0}
    # and both hear a's heartbeat: a live peer may hold replicas (below), and one that
    # stops hearing from a site takes over what it holds
    assert b.exists(sites.alive_key("", "a")) and c.exists(sites.alive_key("", "a"))
    with app.connection_for_read() as conn:
        message = conn.default_channel.basic_get("celery")
        assert message.delivery_tag == done
        message.ack()
    sync.sync_pass()
    assert replica_ids(c) == {waits}
    # Given a producer still on the old choice, writing its strong replica at b
    sync._links = [Link(Peer("b", site_b), 1.0), Link(Peer("c", site_c), 3.0)]
    sync._links_at, sync._measured = time.monotonic(), False
    late = submit(app, "high")
    assert replica_ids(b) == {late}
    # the next pass moves it to c
    sync._links_at = float("-inf")
    assert sync.sync_pass().handed_over == 1
    assert replica_ids(c) == {waits, late} and replica_ids(b) == set()
    app.close()


def test_a_producer_follows_the_passs_choice_and_reads_it_again_in_time(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str, site_c: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = clients
    app, sync = three_sites(redis_url, site_b, site_c, monkeypatch, {"b": 2.0, "c": 1.0})
    assert sync.sync_pass().peer == "c"
    # A producer process: it plans with the pass's choice, without measuring
    producer = sites.SiteSync(app.sits)

    def measured(peer: Peer) -> Link:
        raise AssertionError(f"the producer measured {peer.name}")

    monkeypatch.setattr(producer, "_measure", measured)
    link = producer.plan().link
    assert link is not None and link.peer.name == "c" and link.rtt_ms == 1.0
    # and once the choice is older than link_max_age_s, it reads the new one
    a.set(sites.link_key(""), encode_choice(None))
    assert producer.plan().link is not None  # not yet
    producer._links_at -= sites.link_max_age_s(app.sits)
    assert producer.plan().link is None
    app.close()


def test_a_hung_peer_holds_up_one_strong_put_not_each(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str,
        hung_peer: tuple[str, list[socket.socket]], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = clients
    hung_url, attempts = hung_peer
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    first = submit(app, "high")
    assert replica_ids(b) == {first}
    # When the peer hangs (its socket accepts, nothing answers)
    sync = sync_of(app)
    sync.clients["b"] = redis.Redis.from_url(hung_url, socket_timeout=0.2,
                                             socket_connect_timeout=0.2)
    stuck = [submit(app, "high") for _ in range(3)]
    # Then the first strong put timed out; the next ones did not try: all queued
    assert len(attempts) == 1
    assert a.llen(sites.outbox_key("")) == 3
    assert all(a.zscore(QUEUE.waiting, t) is not None for t in stuck)
    # Nor does the put path measure it again while it is backed off
    sync._links_at = float("-inf")
    submit(app, "high")
    assert len(attempts) == 1 and sync.plan().link is None
    app.close()


def test_a_producer_measuring_by_itself_waits_on_a_hung_peer_once_per_backoff(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str,
        hung_peer: tuple[str, list[socket.socket]]) -> None:
    """(with no pass's choice published, its PING timed out again at every re-read of
    the links, every 10 s, where the README says once per 30 s)"""
    a, _ = clients
    hung_url, attempts = hung_peer
    app = site_app(redis_url, "a", "b", hung_url, rtt_ms=1.0)
    sync = sync_of(app)
    assert a.get(sites.link_key("")) is None  # no pass has run: the producer measures
    submit(app, "high")
    assert len(attempts) == 1 and sync.plan().link is None
    # When its links are next re-read (link_max_age_s on), inside the backoff
    sync._links_at = float("-inf")
    submit(app, "high")
    # Then the hung peer is not waited on again, and the puts are queued for the pass
    assert len(attempts) == 1
    assert a.llen(sites.outbox_key("")) == 2
    app.close()


def test_purged_deleted_and_poison_tasks_leave_the_replica(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    a, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    sync = sync_of(app)
    purged = {submit(app, "low"), submit(app, "medium")}
    sync.sync_pass()
    assert replica_ids(b) == purged
    # A purge: eventual replicas included, which no digest checks
    assert app.control.purge() == 2
    sync.sync_pass()
    assert replica_ids(b) == set()
    # A poison message, dead-lettered by the pick that meets it
    poison = submit(app, "low")
    sync.sync_pass()
    a.hset(QUEUE.redelivered, poison, 99)
    with app.connection_for_read() as conn:
        assert conn.default_channel.basic_get("celery") is None
    assert a.hexists(QUEUE.dead, poison)
    sync.sync_pass()
    assert replica_ids(b) == set()
    # A deleted queue: waiting and running tasks alike
    gone = {submit(app, "low"), submit(app, "medium")}
    sync.sync_pass()
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert channel.basic_get("celery") is not None  # one is running
        queue = Queue("celery", Exchange("celery"), routing_key="celery")(channel)
        queue.declare()
        queue.delete()
    assert replica_ids(b) == gone
    sync.sync_pass()
    assert replica_ids(b) == set()
    app.close()


def test_overlapping_passes_drain_each_entry_once_and_lose_none(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    slow, other = sites.SiteSync(app.sits), sites.SiteSync(app.sits)
    first = [submit(app, "low") for _ in range(3)]
    # Given a pass stalled while writing (it outlived its lock)...
    stalled, go_on = threading.Event(), threading.Event()
    write = slow._write_replicas

    def stalling(*args: Any) -> int:
        stalled.set()
        go_on.wait(10)
        return write(*args)

    monkeypatch.setattr(slow, "_write_replicas", stalling)
    thread = threading.Thread(target=slow.sync_pass)
    thread.start()
    assert stalled.wait(10)
    # ...and another that ran meanwhile
    mid = [submit(app, "low") for _ in range(2)]
    other.sync_pass()
    late = [submit(app, "low") for _ in range(3)]
    go_on.set()
    thread.join()
    # Then the entries queued after both began are still there for the next pass
    assert a.llen(sites.outbox_key("")) == 3
    other.sync_pass()
    assert replica_ids(b) == {*first, *mid, *late}
    app.close()


def test_entries_the_peer_did_not_take_go_back_to_the_outbox(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    tasks = [submit(app, "low") for _ in range(3)]
    outbox = sites.outbox_key("")
    before = a.lrange(outbox, 0, -1)
    sync = sync_of(app)

    def refused(*args: Any) -> int:
        raise redis.ConnectionError("peer gone mid-pass")

    monkeypatch.setattr(sync, "_write_replicas", refused)
    assert sync.sync_pass().errors
    # all still to send, in their order: aside for the next pass
    assert a.lrange(sites.taken_key(""), 1, -1) + a.lrange(outbox, 0, -1) == before
    assert site_status(a, app.sits)["outbox"] == 3  # type: ignore[index]
    monkeypatch.undo()
    sync.sync_pass()
    assert replica_ids(b) == set(tasks)
    assert a.llen(outbox) == 0 and not a.exists(sites.taken_key(""))
    app.close()


def test_a_pass_that_dies_midway_leaves_its_batch_to_the_next(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The process running a pass dies after taking a batch, before the peer has it: the
    next pass (another process) sends that batch, then the newer entries, in order."""
    a, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    first = [submit(app, "low") for _ in range(3)]
    dying = sites.SiteSync(app.sits)

    class Died(BaseException):
        pass

    def die(*args: Any) -> int:
        raise Died

    monkeypatch.setattr(dying, "_write_replicas", die)
    with pytest.raises(Died):
        dying.sync_pass()
    assert replica_ids(b) == set()
    later = [submit(app, "low") for _ in range(2)]
    acked = first[0]
    forget_here(a, acked)  # acked after the batch was taken: its del comes later
    sites.SiteSync(app.sits).sync_pass()
    # the left batch went first, the newer entries (the del included) after it
    assert replica_ids(b) == {*first[1:], *later}
    assert a.llen(sites.outbox_key("")) == 0 and not a.exists(sites.taken_key(""))
    app.close()


def test_a_peer_that_is_replica_peer_again_drops_replicas_of_tasks_finished_meanwhile(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str, site_c: str,
        c: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """An eventual replica is not digest-checked: one left at b while b was down (the
    ack's delete went to c) stayed there for good, and b's take-over of a would run the
    finished task again."""
    _, b = clients
    rtt = {"b": 1.0, "c": 2.0}
    app, sync = three_sites(redis_url, site_b, site_c, monkeypatch, rtt)
    done, waits = submit(app, "low"), submit(app, "low")
    assert sync.sync_pass().peer == "b" and replica_ids(b) == {done, waits}
    # Given b down: c is the replica peer, and done is acked meanwhile
    rtt["b"] = math.inf
    sync._links_at = float("-inf")
    assert sync.sync_pass().peer == "c"
    with app.connection_for_read() as conn:
        message = conn.default_channel.basic_get("celery")
        assert message.delivery_tag == done
        message.ack()
    sync.sync_pass()
    # When b is back and the nearer peer again
    rtt["b"] = 1.0
    sync._links_at = float("-inf")
    report = sync.sync_pass()
    # Then its replica of done is gone; the one of the task still waiting stays
    assert report.peer == "b" and report.repaired == 1
    assert replica_ids(b) == {waits}
    app.close()


def test_a_task_put_while_the_digest_reads_keeps_its_replica(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest read this site's ids, then the replica's: a strong task put between
    the two was at the peer and not in this site's list, and its replica was deleted."""
    _, b = clients
    app = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    sync = sync_of(app)
    first = submit(app, "high")
    sync.sync_pass()
    late: list[str] = []
    held = sync._held

    def put_meanwhile(queue: str) -> dict[str, str | None]:
        ids = held(queue)
        if not late:  # a producer's put (strong: at b at once) lands just after this read
            late.append(submit(app, "high"))
        return ids

    monkeypatch.setattr(sync, "_held", put_meanwhile)
    sync._digest_at = float("-inf")
    sync.sync_pass()
    assert late and replica_ids(b) == {first, late[0]}
    app.close()


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[list[EmbeddedRedis]]:
    """Site a's own Redis, to restart: the servers started, the last one running."""
    servers = [EmbeddedRedis(tmp_path / "site-a", appendonly=True)]
    servers[0].start()
    yield servers
    for server in servers:
        server.stop()


def restore_pass(sync: sites.SiteSync) -> sites.PassReport:
    """The passes after a's Redis changed: the first holds the put-back (another
    server's record at the peer could be a second deployment under a's name), and
    drains, digests and hands over nothing there; the next one site_dead_after_s later
    (its clock moved on, not waited for), finding the record still a's, puts back."""
    held = sync.sync_pass()
    assert held.restored == 0 and [e for e in held.errors if "comes back from here" in e], \
        held
    clock = sync.clock
    sync.clock = lambda: clock() + sync.config.site_dead_after_s
    try:
        return sync.sync_pass()
    finally:
        sync.clock = clock


def restart(servers: list[EmbeddedRedis], empty: bool) -> None:
    """Stop site a's Redis and start it again on its port, with its data or without."""
    old = servers[-1]
    port = old.port
    old.stop()
    if empty:
        shutil.rmtree(old.data_dir / "appendonlydir", ignore_errors=True)
    servers.append(EmbeddedRedis(old.data_dir, port=port, appendonly=not empty))
    servers[-1].start()


def test_tasks_an_origin_restarted_empty_lost_come_back_from_the_replica(
        clients: tuple[redis.Redis, redis.Redis], site_b: str,
        restartable: list[EmbeddedRedis]) -> None:
    """Back within site_dead_after_s, nobody took a's replicas over, and a's digest
    deleted them all as replicas of tasks it no longer held: the tasks were lost."""
    _, b = clients
    app = site_app(restartable[0].url, "a", "b", site_b, rtt_ms=1.0)
    sync = sync_of(app)
    high, medium, low = (submit(app, c) for c in ("high", "medium", "low"))
    sync.sync_pass()
    a = redis.Redis.from_url(restartable[0].url)
    before = {i.decode(): s for i, s in a.zrange(QUEUE.waiting, 0, -1, withscores=True)}
    assert replica_ids(b) == {high, medium, low}
    # When a's Redis restarts empty, a producer puts a task, and a's next pass is a
    # digest's
    restart(restartable, empty=True)
    assert a.zcard(QUEUE.waiting) == 0
    new = submit(app, "low")
    sync._digest_at = float("-inf")
    report = restore_pass(sync)
    # Then the three come back into a's queue, at their priorities, and stay replicated
    assert report.restored == 3 and report.repaired == 0 and not report.errors
    after = {i.decode(): s for i, s in a.zrange(QUEUE.waiting, 0, -1, withscores=True)}
    assert set(after) == {high, medium, low, new}
    assert [int(after[i]) >> SEQ_BITS for i in (high, medium, low)] == \
        [int(before[i]) >> SEQ_BITS for i in (high, medium, low)]
    assert replica_ids(b) == {high, medium, low, new}
    # and they run from there, each once
    with app.connection_for_read() as conn:
        got = [conn.default_channel.basic_get("celery") for _ in range(5)]
    assert [m.delivery_tag for m in got[:2]] == [high, medium] and got[4] is None
    assert {m.delivery_tag for m in got[2:4]} == {low, new}  # one level: arrival renumbered
    # The next pass restores nothing again
    assert sync.sync_pass().restored == 0
    a.close()
    app.close()


def test_an_origin_restarted_empty_gets_its_tasks_back_a_chunk_per_call(
        clients: tuple[redis.Redis, redis.Redis], site_b: str,
        restartable: list[EmbeddedRedis], monkeypatch: pytest.MonkeyPatch) -> None:
    """(one put.lua of a whole queue's replicas held the origin's Redis for ~0.9 s at
    100k tasks, as a take-over's did)"""
    monkeypatch.setattr(recovery, "RESTORE_CHUNK", 2)
    puts: list[int] = []
    run = Scripts.run

    def counted(self: Scripts, name: str, keys: QueueKeys, args: list[Any],
                client: redis.Redis) -> Any:
        if name == "put":
            puts.append(len(args) // 5)
        return run(self, name, keys, args, client)

    app = site_app(restartable[0].url, "a", "b", site_b, rtt_ms=1.0)
    sync = sync_of(app)
    tasks = {submit(app, c) for c in ("high", "medium", "low", "high", "low")}
    sync.sync_pass()
    # When a's Redis restarts empty and its next pass puts the five back
    restart(restartable, empty=True)
    monkeypatch.setattr(Scripts, "run", counted)
    report = restore_pass(sync)
    # Then all five come back, in puts of at most two
    assert report.restored == 5, report
    a = redis.Redis.from_url(restartable[-1].url)
    assert {i.decode() for i in a.zrange(QUEUE.waiting, 0, -1)} == tasks
    assert sum(puts) >= 5 and max(puts) <= 2
    a.close()
    app.close()


def test_a_restart_that_kept_the_data_puts_back_no_finished_task(
        clients: tuple[redis.Redis, redis.Redis], site_b: str,
        restartable: list[EmbeddedRedis]) -> None:
    _, b = clients
    app = site_app(restartable[0].url, "a", "b", site_b, rtt_ms=1.0)
    sync = sync_of(app)
    done, waits = submit(app, "medium"), submit(app, "medium")
    sync.sync_pass()
    assert replica_ids(b) == {done, waits}
    with app.connection_for_read() as conn:  # done: its replica's delete waits in the outbox
        message = conn.default_channel.basic_get("celery")
        assert message.delivery_tag == done
        message.ack()
    # When a's Redis restarts with its data (AOF)
    restart(restartable, empty=False)
    report = restore_pass(sync)
    # Then the finished task is not put back, and its replica goes as it would have
    assert report.restored == 0 and not report.errors
    a = redis.Redis.from_url(restartable[-1].url)
    assert {i.decode() for i in a.zrange(QUEUE.waiting, 0, -1)} == {waits}
    assert replica_ids(b) == {waits}
    a.close()
    app.close()


def test_an_origin_whose_redis_forbids_info_keeps_an_epoch_of_its_own(
        redis_client: redis.Redis, redis_url: str) -> None:
    assert recovery.epoch(redis_client, "") == redis_client.info("server")["run_id"]
    # A managed Redis that forbids INFO (here: an ACL user without it)
    redis_client.execute_command("ACL", "SETUSER", "sits-noinfo", "on", ">pw", "~*", "&*",
                                 "+@all", "-info")
    try:
        host_port = redis_url.split("@")[-1].split("//")[-1]
        limited = redis.Redis.from_url(f"redis://sits-noinfo:pw@{host_port}")
        with pytest.raises(redis.exceptions.NoPermissionError):
            limited.info("server")
        first = recovery.epoch(limited, "noinfo:")
        assert first.startswith("key:") and recovery.epoch(limited, "noinfo:") == first
        # it changes when the data is lost
        redis_client.delete(f"noinfo:{recovery.FALLBACK_EPOCH}")
        assert recovery.epoch(limited, "noinfo:") != first
        limited.close()
    finally:
        redis_client.execute_command("ACL", "DELUSER", "sits-noinfo")
        redis_client.delete(f"noinfo:{recovery.FALLBACK_EPOCH}")


@pytest.fixture
def two_sites(clients: tuple[redis.Redis, redis.Redis], redis_url: str,
              site_b: str) -> Iterator[tuple[Celery, Celery]]:
    """Sites a and b, each the other's near peer (1 ms)."""
    app_a = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    app_b = site_app(site_b, "b", "a", redis_url, rtt_ms=1.0)
    yield app_a, app_b
    app_a.close()
    app_b.close()


def take_over(app_b: Celery, b: redis.Redis) -> sites.PassReport:
    """Site b's passes once site a's heartbeat is gone and b has heard nothing for
    site_dead_after_s (its count moved back rather than waited for)."""
    b.delete(sites.alive_key("", "a"))
    assert sync_of(app_b).sync_pass().taken_over == 0  # it starts counting
    since = float(b.get(missing_since_key("", "a")) or 0)
    b.set(missing_since_key("", "a"), since - app_b.sits.site_dead_after_s)
    return sync_of(app_b).sync_pass()


def test_a_copy_running_at_the_origin_during_a_take_over_does_not_run_again_there(
        clients: tuple[redis.Redis, redis.Redis], two_sites: tuple[Celery, Celery]) -> None:
    """The origin, back, dead-lettered only its copies still waiting and forgot the rest
    of the take-over: a copy that was running (or prefetched) when the site went silent,
    given back later (its worker died, a requeue), ran at the origin too, after it had
    heard of the take-over."""
    a, b = clients
    app_a, app_b = two_sites
    x = submit(app_a, "high")
    sync_of(app_a).sync_pass()
    with app_a.connection_for_read() as conn:  # a worker of a holds it, unacked
        held = conn.default_channel.basic_get("celery")
        assert held.delivery_tag == x
        # Given b took a's work over while a was silent
        assert take_over(app_b, b).taken_over == 1
        # When a is back while its copy still runs, then gives it back (its worker died)
        assert sync_of(app_a).sync_pass().dropped == 0
        held.requeue()
    assert a.zscore(QUEUE.waiting, x) is not None
    # Then a's next pass dead-letters it: it runs at b
    assert sync_of(app_a).sync_pass().dropped == 1
    assert a.zscore(QUEUE.waiting, x) is None and b"taken over by site b" in (
        a.hget(QUEUE.dead, x) or b"")
    assert b.zscore(QUEUE.waiting, x) is not None
    assert b.scard(takenover_key("", "a")) == 0  # settled


def test_a_copy_acked_at_the_origin_settles_its_take_over_record(
        clients: tuple[redis.Redis, redis.Redis], two_sites: tuple[Celery, Celery]) -> None:
    _, b = clients
    app_a, app_b = two_sites
    submit(app_a, "high")
    sync_of(app_a).sync_pass()
    with app_a.connection_for_read() as conn:
        held = conn.default_channel.basic_get("celery")
        assert take_over(app_b, b).taken_over == 1
        sync_of(app_a).sync_pass()
        assert b.scard(takenover_key("", "a")) == 1  # kept while it runs
        held.ack()  # it finished at a (the documented at-least-once gap: and at b)
    sync_of(app_a).sync_pass()
    assert b.scard(takenover_key("", "a")) == 0


def run_all(app: Celery, n: int) -> None:
    """Site a's workers run its next ``n`` tasks (picked and acked)."""
    with app.connection_for_read() as conn:
        for _ in range(n):
            conn.default_channel.basic_get("celery").ack()


@pytest.fixture
def own_peer(tmp_path: Path) -> Iterator[list[EmbeddedRedis]]:
    """Site b's own Redis, to restart (:func:`restart_peer`): the servers started, the
    last one running; give ``appendonly`` by starting the first one yourself."""
    servers: list[EmbeddedRedis] = []
    yield servers
    for server in servers:
        server.stop()


def restart_peer(servers: list[EmbeddedRedis]) -> None:
    """Stop b's Redis and start it on its port from its data dir: from its last SAVE
    (RDB), or all its data (AOF)."""
    old = servers[-1]
    port = old.port  # (none once stopped)
    old.stop()
    servers.append(EmbeddedRedis(old.data_dir, port=port, appendonly=old.appendonly))
    servers[-1].start()


def replicated(restartable: list[EmbeddedRedis], peer: list[EmbeddedRedis], data_dir: Path,
               appendonly: bool) -> tuple[redis.Redis, Celery, set[str]]:
    """Site a (``restartable``) with three top-class tasks replicated to a b of its own."""
    peer.append(EmbeddedRedis(data_dir, appendonly=appendonly))
    peer[0].start()
    b = redis.Redis.from_url(peer[0].url)
    app = site_app(restartable[0].url, "a", "b", peer[0].url, rtt_ms=1.0)
    tasks = {submit(app, "high") for _ in range(3)}
    sync_of(app).sync_pass()
    assert replica_ids(b) == tasks
    return b, app, tasks


def test_a_peer_back_from_an_older_snapshot_makes_the_origin_rerun_nothing(
        clients: tuple[redis.Redis, redis.Redis], restartable: list[EmbeddedRedis],
        own_peer: list[EmbeddedRedis], tmp_path: Path) -> None:
    """A rolling restart: b snapshots, a's tasks finish, a restarts keeping its data, b
    restarts from its snapshot. b's old record of a's server and its replicas of the
    finished tasks came back together, and a put them all back to run again."""
    b, app, tasks = replicated(restartable, own_peer, tmp_path / "b-rdb", appendonly=False)
    sync = sync_of(app)
    b.save()  # b's periodic snapshot
    run_all(app, len(tasks))
    sync.sync_pass()
    assert replica_ids(b) == set()
    restart(restartable, empty=False)  # a restarts with its data: a new server
    assert sync.sync_pass().restored == 0  # (held: to be confirmed)
    restart_peer(own_peer)  # b, from the snapshot
    assert replica_ids(b) == tasks  # the finished tasks' replicas are back
    report = sync.sync_pass()
    # Then a puts none of them back: they are no work it lost
    assert report.restored == 0, report
    a = redis.Redis.from_url(restartable[-1].url)
    assert a.zcard(QUEUE.waiting) == 0
    a.close()
    b.close()
    app.close()


def test_a_site_without_peers_keeps_no_outbox(redis_url: str,
                                              redis_client: redis.Redis) -> None:
    """(nothing drains an outbox without a peer: it grew by a put and a delete per task)"""
    sites._syncs.clear()
    app = make_app(SitsConfig(redis_url=redis_url, site="a"), main="site-alone")

    @app.task(name="t.alone", shared=False)
    def alone() -> None:
        return None

    assert sites.for_config(app.sits) is None
    for _ in range(3):
        alone.apply_async(sla_class="high")
    run_all(app, 3)
    assert redis_client.llen(sites.outbox_key("")) == 0
    app.close()


def test_a_full_outbox_stops_queueing_deletes_the_digest_makes_anyway(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = clients
    monkeypatch.setattr(sites, "OUTBOX_MAX", 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # the peer is away
    app = site_app(redis_url, "a", "b", gone, rtt_ms=1.0)
    for _ in range(3):
        submit(app, "medium")  # the third passes the cap
    run_all(app, 3)
    # Then the deletes are not queued past the cap: the digest deletes the replicas of
    # tasks gone once the peer answers (each was queued, for as long as it was away)
    assert a.llen(sites.outbox_key("")) == 3
    app.close()


def test_a_silent_site_is_taken_over_about_site_dead_after_s_after_its_last_heartbeat(
        clients: tuple[redis.Redis, redis.Redis], two_sites: tuple[Celery, Celery]) -> None:
    """Its heartbeat lived site_dead_after_s, and only then did the peer start its own
    count of as long: the take-over came after twice that. And a count the peer stopped
    keeping (its own outage) never expired: its first pass after took the site over."""
    _, b = clients
    app_a, app_b = two_sites
    config = app_a.sits
    submit(app_a, "high")  # (a site with replicas at b: one b watches)
    sync_of(app_a).sync_pass()
    # The heartbeat lives a few pass intervals, not the whole site_dead_after_s
    beat_ms = b.pttl(sites.alive_key("", "a"))
    assert 0 < beat_ms <= 3 * config.site_sync_interval_s * 1000 < \
        config.site_dead_after_s * 1000
    # The peer's count of the silence expires unless its passes renew it
    b.delete(sites.alive_key("", "a"))
    sync_of(app_b).sync_pass()
    count_ms = b.pttl(missing_since_key("", "a"))
    assert 0 < count_ms <= config.site_dead_after_s * 1000


def test_a_take_over_and_its_settling_go_in_chunks(
        clients: tuple[redis.Redis, redis.Redis], two_sites: tuple[Celery, Celery],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(one put.lua of a whole replica held the peer's Redis for 0.9 s at 100k tasks,
    and the origin settled the take-over with a round trip per task: 45 s for 2,000
    over a 20 ms link, past the pass lock)"""
    monkeypatch.setattr(takeover, "PROMOTE_CHUNK", 2)
    monkeypatch.setattr(takeover, "TAKEOVER_CHUNK", 2)
    a, b = clients
    app_a, app_b = two_sites
    tasks = [submit(app_a, c) for c in ("high", "medium", "low", "high", "medium")]
    sync_of(app_a).sync_pass()
    assert replica_ids(b) == set(tasks)
    assert take_over(app_b, b).taken_over == 5
    assert {i.decode() for i in b.zrange(QUEUE.waiting, 0, -1)} == set(tasks)
    assert replica_ids(b) == set() and not any(
        b.exists(k) for k in sites.replica_keys("", "a", "celery"))
    # the classes keep their order at b
    order = [i.decode() for i in b.zrange(QUEUE.waiting, 0, -1)]
    assert set(order[:2]) == {tasks[0], tasks[3]} and order[-1] == tasks[2]
    back = sync_of(app_a).sync_pass()
    assert back.dropped == 5 and a.zcard(QUEUE.waiting) == 0
    assert b.scard(takenover_key("", "a")) == 0


def test_an_origin_that_lost_its_data_while_its_peer_restarted_too_gets_its_tasks_back(
        clients: tuple[redis.Redis, redis.Redis], restartable: list[EmbeddedRedis],
        own_peer: list[EmbeddedRedis], tmp_path: Path) -> None:
    """Both restarted between two passes (a deploy of both): the peer kept its data
    (AOF), the origin lost its own. The peer's new server must not read as the peer's
    data gone back: the origin's tasks come back."""
    b, app, tasks = replicated(restartable, own_peer, tmp_path / "b-aof", appendonly=True)
    restart_peer(own_peer)
    restart(restartable, empty=True)
    report = restore_pass(sync_of(app))
    assert report.restored == 3, report
    a = redis.Redis.from_url(restartable[-1].url)
    assert {i.decode() for i in a.zrange(QUEUE.waiting, 0, -1)} == tasks
    a.close()
    b.close()
    app.close()


def test_entries_another_writer_corrupted_do_not_stop_the_passes(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    from sits_queue.broker.keys import last_pass_key, outbox_key

    a, b = clients
    app_a = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    task = submit(app_a, "low")  # eventual: its replica goes through the outbox
    # Given entries no site writes: in a's outbox, in b's record of what it took over
    # from a, and as a's last pass (each raised, failing every pass after it)
    a.rpush(outbox_key(""), "not json", json.dumps(["put", ["unhashable"], "x"]),
            json.dumps({"a": 1}))
    b.sadd(takenover_key("", "a"), "not json", json.dumps(["only one"]), json.dumps(5))
    a.set(last_pass_key(""), "{{{")
    # Then the status reads, and the pass sends the good entry and drops the rest
    assert site_status(a, app_a.sits) is not None
    report = sync_of(app_a).sync_pass()
    assert report.errors == []
    assert replica_ids(b) == {task}
    assert b.scard(takenover_key("", "a")) == 0
    app_a.close()


@pytest.mark.parametrize("junk", ["yesterday", "nan"])
def test_a_missing_since_record_no_site_writes_starts_the_count_again(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str,
        junk: str) -> None:
    b = clients[1]
    app_a = site_app(redis_url, "a", "b", site_b, rtt_ms=1.0)
    app_b = site_app(site_b, "b", "a", redis_url, rtt_ms=1.0)
    submit(app_a, "high")
    sync_of(app_a).sync_pass()
    b.delete(sites.alive_key("", "a"))
    # Given b's count of how long a has been silent replaced by what no site writes
    b.set(missing_since_key("", "a"), junk)
    # Then b's pass goes on ("yesterday" raised in every pass; NaN never let the count end)
    assert sync_of(app_b).sync_pass().taken_over == 0
    since = float(b.get(missing_since_key("", "a")) or "nan")
    assert math.isfinite(since)
    # and the count, started again, ends as it should
    b.set(missing_since_key("", "a"), since - app_b.sits.site_dead_after_s)
    assert sync_of(app_b).sync_pass().taken_over == 1
    app_a.close()
    app_b.close()
