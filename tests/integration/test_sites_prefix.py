"""Sites whose deployments use different key prefixes (``SITS_GLOBAL_KEYPREFIX``): a peer
named with ``?prefix=`` gets its heartbeats and replicas under its own prefix, takes a
lost site over from them, and hands them back; a site restored from it finds them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from sits_queue.app import make_app
from sits_queue.broker import sites
from sits_queue.broker.keys import (
    QueueKeys,
    epoch_key,
    missing_since_key,
    takenover_key,
)
from sits_queue.config import SitsConfig
from sits_queue.embedded import EmbeddedRedis
from sits_queue.priority.sites import parse_peers
from sits_queue.status import site_status

A_PREFIX, B_PREFIX = "east:", "west:"


@pytest.fixture(scope="module")
def site_b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(Path(tmp_path_factory.mktemp("site-b-prefix")))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture
def clients(redis_client: redis.Redis, site_b: str) -> Iterator[tuple[redis.Redis, redis.Redis]]:
    a, b = redis_client, redis.Redis.from_url(site_b)
    a.flushall()
    b.flushall()
    sites._syncs.clear()
    yield a, b
    b.close()


def site_app(url: str, name: str, prefix: str, peer: str, peer_url: str,
             peer_prefix: str) -> Celery:
    config = SitsConfig(redis_url=url, site=name, global_keyprefix=prefix,
                        site_peers=f"{peer}={peer_url}?rtt_ms=1&prefix={peer_prefix}")
    app = make_app(config, main=f"site-{name}")

    @app.task(name="t.site", shared=False)
    def work(x: Any) -> Any:
        return x

    return app


def sync_of(app: Celery) -> sites.SiteSync:
    sync = sites.for_config(app.sits)
    assert sync is not None
    return sync


def ids(client: redis.Redis, key: str) -> set[str]:
    return {i.decode() for i in client.zrange(key, 0, -1)}


def submit(app: Celery, local: redis.Redis, sla_class: str) -> str:
    """One task enqueued; its id in the queue (the message's delivery tag)."""
    before = ids(local, QueueKeys.for_queue("celery", app.sits.global_keyprefix).waiting)
    app.tasks["t.site"].apply_async((sla_class,), sla_class=sla_class)
    (tag,) = ids(local, QueueKeys.for_queue("celery", app.sits.global_keyprefix).waiting) \
        - before
    return tag


def test_the_prefix_option_is_taken_out_of_the_peer_url() -> None:
    (peer,) = parse_peers("b=redis://h:6379/0?hops=2&prefix=west%3A&socket_timeout=5")
    assert peer.key_prefix == "west:" and peer.hops == 2
    assert peer.redis_url == "redis://h:6379/0?socket_timeout=5"
    (same,) = parse_peers("b=redis://h:6379/0")
    assert same.key_prefix is None


def test_a_peer_with_its_own_prefix_keeps_takes_over_and_hands_back_the_work(
        clients: tuple[redis.Redis, redis.Redis], redis_url: str, site_b: str) -> None:
    a, b = clients
    app_a = site_app(redis_url, "a", A_PREFIX, "b", site_b, B_PREFIX)
    app_b = site_app(site_b, "b", B_PREFIX, "a", redis_url, A_PREFIX)
    urgent, bulk = submit(app_a, a, "high"), submit(app_a, a, "low")
    report = sync_of(app_a).sync_pass()
    assert report.errors == [] and report.peer == "b"
    # At b, under b's prefix: the replicas, a's heartbeat, a's epoch record
    z = sites.replica_keys(B_PREFIX, "a", "celery")[0]
    assert ids(b, z) == {urgent, bulk}
    assert b.exists(sites.alive_key(B_PREFIX, "a"), epoch_key(B_PREFIX, "a")) == 2
    assert not [k for k in b.scan_iter(f"{A_PREFIX}*")]  # nothing under a's prefix there
    held = site_status(b, app_b.sits)
    assert held is not None and held["replicas_held"] == {"a": 2}
    # While a heartbeats, b keeps them; once it has heard nothing for site_dead_after_s,
    # it takes them over into its own queue (under its prefix)
    assert sync_of(app_b).sync_pass().taken_over == 0
    b.delete(sites.alive_key(B_PREFIX, "a"))
    assert sync_of(app_b).sync_pass().taken_over == 0
    since = float(b.get(missing_since_key(B_PREFIX, "a")) or 0)
    b.set(missing_since_key(B_PREFIX, "a"), since - app_b.sits.site_dead_after_s)
    assert sync_of(app_b).sync_pass().taken_over == 2
    assert ids(b, QueueKeys.for_queue("celery", B_PREFIX).waiting) == {urgent, bulk}
    assert b.scard(takenover_key(B_PREFIX, "a")) == 2
    # When a is back, it reads b's record of what was taken over (under b's prefix) and
    # drops its own copies: they run at b, not twice
    back = sync_of(app_a).sync_pass()
    assert back.dropped == 2, back
    assert a.zcard(QueueKeys.for_queue("celery", A_PREFIX).waiting) == 0
    app_a.close()
    app_b.close()


def test_a_site_restarted_empty_gets_its_work_back_from_a_peer_with_another_prefix(
        clients: tuple[redis.Redis, redis.Redis], site_b: str, tmp_path: Path) -> None:
    _, b = clients
    server = EmbeddedRedis(tmp_path / "site-a")
    server.start()
    try:
        app = site_app(server.url, "a", A_PREFIX, "b", site_b, B_PREFIX)
        a = redis.Redis.from_url(server.url)
        urgent = submit(app, a, "high")
        sync = sync_of(app)
        sync.sync_pass()
        assert urgent in ids(b, sites.replica_keys(B_PREFIX, "a", "celery")[0])
        # a's Redis comes back empty, another server: b's record (under b's prefix) says
        # so; the first pass holds the put-back, one site_dead_after_s later puts it back
        port = server.port
        server.stop()
        server = EmbeddedRedis(tmp_path / "site-a-again", port=port)
        server.start()
        assert a.zcard(QueueKeys.for_queue("celery", A_PREFIX).waiting) == 0
        held = sync.sync_pass()
        assert held.restored == 0 and [e for e in held.errors if "comes back" in e], held
        clock = sync.clock
        sync.clock = lambda: clock() + app.sits.site_dead_after_s
        assert sync.sync_pass().restored == 1
        assert ids(a, QueueKeys.for_queue("celery", A_PREFIX).waiting) == {urgent}
        a.close()
        app.close()
    finally:
        server.stop()
