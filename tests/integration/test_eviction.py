"""A Redis that may evict keys is said when a worker starts (``broker/eviction.py``):
its queues and results can go unsaid when it fills."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from sits_queue.broker.eviction import eviction_risk
from sits_queue.procs import CeleryProcess
from tests.waiting import wait_for

Spawn = Callable[..., CeleryProcess]


@pytest.fixture
def evicting(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    """The test server set to evict, set back after."""
    was = {**redis_client.config_get("maxmemory"),
           **redis_client.config_get("maxmemory-policy")}
    redis_client.config_set("maxmemory", "1gb")
    redis_client.config_set("maxmemory-policy", "allkeys-lru")
    yield redis_client
    redis_client.config_set("maxmemory", was["maxmemory"])
    redis_client.config_set("maxmemory-policy", was["maxmemory-policy"])


def test_the_servers_policy_is_read_as_a_risk_only_with_a_limit_to_hit(
        redis_client: redis.Redis) -> None:
    was = {**redis_client.config_get("maxmemory"),
           **redis_client.config_get("maxmemory-policy")}
    try:
        redis_client.config_set("maxmemory-policy", "volatile-lru")
        redis_client.config_set("maxmemory", "0")  # no limit: nothing is ever evicted
        assert eviction_risk(redis_client) is None
        redis_client.config_set("maxmemory", "1gb")
        assert eviction_risk(redis_client) == "volatile-lru"
        redis_client.config_set("maxmemory-policy", "noeviction")
        assert eviction_risk(redis_client) is None
    finally:
        redis_client.config_set("maxmemory", was["maxmemory"])
        redis_client.config_set("maxmemory-policy", was["maxmemory-policy"])


def test_a_server_that_will_not_say_is_no_risk_said() -> None:
    class Refusing:
        def config_get(self, name: str) -> Any:
            raise redis.ResponseError("unknown command 'CONFIG'")  # (a managed Redis)

    assert eviction_risk(Refusing()) is None


def test_a_worker_on_a_server_that_may_evict_says_so_at_start(
        spawn: Spawn, client_app: Celery, evicting: redis.Redis) -> None:
    worker = spawn(concurrency=1)
    wait_for(lambda: "may evict keys when full (maxmemory-policy allkeys-lru): queued tasks "
             "and results can be lost unsaid" in worker.log_path.read_text(), 10,
             "the warning", seen=lambda: worker.log_path.read_text()[-1500:])
    assert client_app.tasks["w.add"].delay(1, 2).get(timeout=30) == 3
