"""Worker signal handlers: record each finished task for the priority statistics.

Recording must never fail a task: Redis errors are logged and dropped.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import redis
from celery import Celery, signals

from sits_queue.app import sits_config
from sits_queue.config import SitsConfig
from sits_queue.options import HEADER
from sits_queue.priority.rescore import counter_key, hot_key, latency_key

logger = logging.getLogger(__name__)

_clients: dict[int, redis.Redis] = {}


def _client(config: SitsConfig) -> redis.Redis:
    # Keyed by pid: a forked pool child must not reuse its parent's sockets.
    pid = os.getpid()
    client = _clients.get(pid)
    if client is None:
        client = _clients[pid] = redis.Redis.from_url(config.redis_url, socket_timeout=2)
    return client


def record_completion(config: SitsConfig, request: Any, failed: bool, now_s: float) -> None:
    header = getattr(request, HEADER, None)
    if not isinstance(header, dict) or request.task is None or request.task.startswith("sits."):
        return
    sla_class = header.get("sla_class")
    if sla_class not in config.class_names:
        return
    submitted = getattr(request, "sits_submitted_at", None)
    pipe = _client(config).pipeline(transaction=False)
    if isinstance(submitted, (int, float)):
        pipe.lpush(latency_key(config, sla_class), round(max(0.0, now_s - submitted) * 1000, 3))
        pipe.ltrim(latency_key(config, sla_class), 0, config.stats_window - 1)
    pipe.hincrby(counter_key(config, "failed" if failed else "done"), sla_class, 1)
    if failed:
        pipe.hincrby(counter_key(config, "done"), sla_class, 1)
    if header.get("model"):
        pipe.hincrbyfloat(hot_key(config), header["model"], 1.0)
    try:
        pipe.execute()
    except redis.RedisError as exc:
        logger.warning("could not record task statistics: %s", exc)


def connect(app: Celery) -> None:
    def on_postrun(sender: Any = None, task: Any = None, state: str | None = None,
                   **_: Any) -> None:
        if task is None or getattr(task, "app", None) is not app:
            return
        record_completion(sits_config(app), task.request, failed=state == "FAILURE",
                          now_s=time.time())

    # weak=False: the closure would otherwise be collected at once.
    signals.task_postrun.connect(on_postrun, weak=False)
