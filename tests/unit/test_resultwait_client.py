"""The result consumer's own Redis client (``broker/resultwait.py``): its calls give up
on a silent Redis after ``WAIT_IO_TIMEOUT_S``, one try each; the backend's own client,
which stores results, is left as it is. No Redis: nothing here connects."""

from __future__ import annotations

from typing import Any

from sits_queue.app import make_app
from sits_queue.broker.resultwait import WAIT_IO_TIMEOUT_S, capped
from sits_queue.config import SitsConfig


def test_capped_params_bound_every_socket_wait_and_try_once() -> None:
    out = capped({"host": "h", "socket_timeout": 120.0, "socket_connect_timeout": None,
                  "retry_on_timeout": True})
    assert out["host"] == "h"
    assert out["socket_timeout"] == out["socket_connect_timeout"] == WAIT_IO_TIMEOUT_S
    assert out["retry_on_timeout"] is False and out["retry"].get_retries() == 0
    # (a shorter one given is kept)
    assert capped({"socket_timeout": 0.25})["socket_timeout"] == 0.25
    # a Unix socket's: no connect timeout, as Celery leaves it
    unix = capped({"path": "/tmp/redis.sock", "socket_timeout": None})
    assert unix["socket_timeout"] == WAIT_IO_TIMEOUT_S and "socket_connect_timeout" not in unix


def test_the_consumer_waits_through_its_own_client_and_resets_both_after_fork() -> None:
    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="resultwait-client")
    backend = app.backend
    consumer: Any = backend.result_consumer
    own = consumer.backend.client
    assert own is not backend.client
    assert own.connection_pool.connection_kwargs["socket_timeout"] == WAIT_IO_TIMEOUT_S
    assert backend.client.connection_pool.connection_kwargs.get("socket_timeout") != \
        WAIT_IO_TIMEOUT_S  # (storing a result keeps the backend's own timeout)
    # everything else is the backend's
    assert consumer.backend.get_key_for_task("t") == backend.get_key_for_task("t")
    reset: list[str] = []
    backend.client.connection_pool.reset = lambda: reset.append("backend")
    own.connection_pool.reset = lambda: reset.append("waits")
    consumer.on_after_fork()
    assert sorted(reset) == ["backend", "waits"]
    app.close()
