"""A site's worker coming back: it settles what its peer took over before it takes a
task, and its heartbeats go on while its consumer reconnects to the site's Redis."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from sits_queue.app import make_app
from sits_queue.broker import sites
from sits_queue.broker.keys import QueueKeys, missing_since_key
from sits_queue.config import SitsConfig
from sits_queue.embedded import EmbeddedRedis
from sits_queue.procs import CeleryProcess, start_worker, wait_ready
from tests.integration.conftest import APP_MODULE, ROOT, worker_env
from tests.integration.worker_app import register
from tests.waiting import wait_for

QUEUE = QueueKeys.for_queue("celery")


@pytest.fixture
def site_b(tmp_path: Path) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path / "site-b")
    server.start()
    sites._syncs.clear()
    yield server.url
    server.stop()
    sites._syncs.clear()


def site_app(url: str, name: str, peer: str, peer_url: str) -> Celery:
    app = make_app(SitsConfig(redis_url=url, site=name,
                              site_peers=f"{peer}={peer_url}?rtt_ms=1"), main=f"site-{name}")
    register(app)
    return app


def take_over(app_b: Celery, b: redis.Redis) -> int:
    """Site b, having heard nothing from a for site_dead_after_s, takes a's work over."""
    sync = sites.for_config(app_b.sits)
    assert sync is not None
    b.delete(sites.alive_key("", "a"))
    sync.sync_pass()  # (starts counting)
    since = float(b.get(missing_since_key("", "a")) or 0)
    b.set(missing_since_key("", "a"), since - app_b.sits.site_dead_after_s)
    return sync.sync_pass().taken_over


def test_a_restarted_worker_settles_take_overs_before_it_takes_a_task(
        redis_client: redis.Redis, redis_url: str, site_b: str,
        spawn: Callable[..., CeleryProcess]) -> None:
    """(left to the beat's first pass, up to 30 s after a beat's restart, the worker ran
    them first, at the top of its queue: each ran at both sites)"""
    a, b = redis_client, redis.Redis.from_url(site_b)
    app_a = site_app(redis_url, "a", "b", site_b)
    app_b = site_app(site_b, "b", "a", redis_url)
    # Given urgent tasks of site a's (replicated at b as they are put) that b took over
    # while a's worker and beat were down
    for i in range(5):
        app_a.tasks["w.record"].apply_async((f"t{i}",), sla_class="high")
    sites.for_config(app_a.sits).sync_pass()  # (a heartbeats b once)
    assert take_over(app_b, b) == 5
    assert a.zcard(QUEUE.waiting) == 5  # a's copies still wait there
    # When a's worker starts again (no beat yet)
    spawn(concurrency=1, site="a", site_peers=f"b={site_b}?rtt_ms=1")
    # Then it runs none of them: their copies went to a's dead letters first
    wait_for(lambda: a.hlen(QUEUE.dead) == 5, 30, "the taken-over copies dead-lettered")
    assert app_a.tasks["w.add"].delay(1, 2).get(timeout=30) == 3  # (it serves)
    assert int(a.get("test:runs") or 0) == 0
    app_a.close()
    app_b.close()
    b.close()


def test_heartbeats_go_on_while_the_consumer_reconnects(site_b: str, tmp_path: Path) -> None:
    """(the heartbeat thread stopped with the consumer's lost connection, and started
    again only after Celery's reconnect backoff, seconds after the site's Redis was back:
    a peer took over a site whose Redis was away for less than site_dead_after_s)"""
    server = EmbeddedRedis(tmp_path / "site-a", appendonly=True)
    url = server.start()
    port, password = server.port, server.password
    b = redis.Redis.from_url(site_b)
    alive = sites.alive_key("", "a")
    env = worker_env(url, site="a", site_peers=f"b={site_b}?rtt_ms=1",
                     site_sync_interval_s="0.5")
    app = site_app(url, "a", "b", site_b)
    worker = start_worker(APP_MODULE, env, tmp_path / "logs", concurrency=1, cwd=ROOT)
    try:
        wait_ready(app, [worker])
        wait_for(lambda: b.exists(alive) == 1, 10, "a's first heartbeat")
        # When a's Redis is away for 7 s (the consumer's reconnect backoff: 2, 4, 6 s)
        server.stop()
        time.sleep(7)
        server = EmbeddedRedis(tmp_path / "site-a", port=port, password=password,
                               appendonly=True)
        server.start()
        b.delete(alive)
        # Then its heartbeats reach b again within a few sync intervals of its return,
        # not once the consumer's backoff has run out (its next try, ~5 s later)
        wait_for(lambda: b.exists(alive) == 1, 3.0, "a's heartbeat after its Redis is back")
    finally:
        worker.stop(timeout_s=10)
        server.stop()
        app.close()
        b.close()
