"""Worker signal handlers: record each finished task for the priority statistics.

Recording must never fail a task: Redis errors are logged and dropped.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery, signals

from sits_queue import tracing
from sits_queue.app import sits_config
from sits_queue.config import SitsConfig
from sits_queue.options import HEADER, UNCOUNTED_TASKS
from sits_queue.priority.prewarm import MAX_CATCH_UP, bucket_of, demand_key
from sits_queue.priority.rescore import counter_key, hot_key, latency_key

logger = logging.getLogger(__name__)

_clients: dict[int, redis.Redis] = {}
#: Completion records are flushed in batches: one round trip per task would sit on the
#: critical path between a task's end and the slot's next pick.
FLUSH_EVERY_RECORDS = 32
FLUSH_EVERY_S = 0.5


@dataclass
class _Buffer:
    pid: int
    records: list[tuple[str, str | None, float | None, bool]] = field(default_factory=list)
    flushed_at: float = field(default_factory=time.monotonic)


_buffer: _Buffer | None = None
#: A worker of plain tasks only may run them in threads of one process (runtime.py).
_lock = threading.Lock()


def _client(config: SitsConfig) -> redis.Redis:
    # Keyed by pid: a forked pool child must not reuse its parent's sockets.
    pid = os.getpid()
    client = _clients.get(pid)
    if client is None:
        client = _clients[pid] = redis.Redis.from_url(config.redis_url, socket_timeout=2)
    return client


def record_completion(config: SitsConfig, request: Any, failed: bool, now_s: float) -> None:
    """Buffer one finished task's statistics; flush every 32 records or 0.5 s."""
    global _buffer
    header = getattr(request, HEADER, None)
    if not isinstance(header, dict) or request.task is None or request.task in UNCOUNTED_TASKS:
        return
    sla_class = header.get("sla_class")
    if sla_class not in config.class_names:
        return
    submitted = getattr(request, "sits_submitted_at", None)
    latency_ms = (round(max(0.0, now_s - submitted) * 1000, 3)
                  if isinstance(submitted, (int, float)) else None)
    with _lock:
        if _buffer is None or _buffer.pid != os.getpid():
            _buffer = _Buffer(pid=os.getpid())
            atexit.register(flush, config)
        _buffer.records.append((sla_class, header.get("model"), latency_ms, failed))
        due = (len(_buffer.records) >= FLUSH_EVERY_RECORDS
               or time.monotonic() - _buffer.flushed_at >= FLUSH_EVERY_S)
    if due:
        flush(config)


def flush(config: SitsConfig) -> None:
    """Write buffered records in one pipeline; Redis errors are logged, never raised."""
    with _lock:
        if _buffer is None or _buffer.pid != os.getpid() or not _buffer.records:
            return
        records, _buffer.records = _buffer.records, []
        _buffer.flushed_at = time.monotonic()
    pipe = _client(config).pipeline(transaction=False)
    demand = demand_key(config, bucket_of(config, time.time())) \
        if config.prewarm_interval_s > 0 else ""
    for sla_class, model, latency_ms, failed in records:
        if latency_ms is not None:
            pipe.lpush(latency_key(config, sla_class), latency_ms)
        pipe.hincrby(counter_key(config, "done"), sla_class, 1)
        if failed:
            pipe.hincrby(counter_key(config, "failed"), sla_class, 1)
        if model:
            pipe.hincrbyfloat(hot_key(config), model, 1.0)
            if config.prewarm_interval_s > 0:  # demand per interval, for the forecast
                pipe.hincrby(demand, model, 1)
    for sla_class in {r[0] for r in records}:
        pipe.ltrim(latency_key(config, sla_class), 0, config.stats_window - 1)
    if demand:  # after the increments: EXPIRE on a missing key does nothing
        # at least a second: a short interval rounded to EXPIRE 0 would delete the key
        pipe.expire(demand, max(1, math.ceil(config.prewarm_interval_s * (MAX_CATCH_UP + 2))))
    try:
        pipe.execute()
    except redis.RedisError as exc:
        logger.warning("could not record %d task statistics: %s", len(records), exc)


def connect(app: Celery) -> None:
    def on_postrun(sender: Any = None, task: Any = None, state: str | None = None,
                   **_: Any) -> None:
        if task is None or getattr(task, "app", None) is not app:
            return
        if state not in ("SUCCESS", "FAILURE"):
            return  # a retry, or a slot yielded (REJECTED): the task has not finished
        record_completion(sits_config(app), task.request, failed=state == "FAILURE",
                          now_s=time.time())

    # weak=False: the closure would otherwise be collected at once.
    signals.task_postrun.connect(on_postrun, weak=False)
    # A pool child's buffered spans would die with it (billiard ends it with _exit).
    signals.worker_process_shutdown.connect(_flush_traces, weak=False)


def _flush_traces(**_: Any) -> None:
    tracing.flush()
