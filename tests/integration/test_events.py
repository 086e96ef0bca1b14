"""Task events on a real worker: every task's received, started and succeeded events
reach the events exchange, published together (``workers/eventflush.py``), not in a
message per event loop turn."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from sits_queue.procs import CeleryProcess
from tests.integration.test_fanout import body

Spawn = Callable[..., CeleryProcess]
TASKS = 30


def events_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The events one published message carries (``task.multi``: a list of them)."""
    published = body(json.loads(message["data"]))
    return published if isinstance(published, list) else [published]


def test_every_task_event_arrives_in_fewer_messages_than_tasks(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(one at a time, each task took three loop turns, each turn a publish of its own:
    ~0.9 ms of the worker's main process a task, 31% of its time in a burst of 14 ms
    embeddings)"""
    sub = redis_client.pubsub(ignore_subscribe_messages=True)
    sub.psubscribe("*celeryev*")
    try:
        spawn(concurrency=1)
        results = [client_app.tasks["w.add"].delay(i, i) for i in range(TASKS)]
        assert [r.get(timeout=60) for r in results] == [2 * i for i in range(TASKS)]
        ids = {r.id for r in results}
        seen: dict[str, set[str]] = defaultdict(set)
        messages = 0
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(
                seen[i] != {"task-received", "task-started", "task-succeeded"} for i in ids):
            message = sub.get_message(timeout=0.2)
            if message is None:
                continue
            ours = [e for e in events_of(message) if e.get("uuid") in ids]
            messages += bool(ours)
            for event in ours:
                seen[event["uuid"]].add(event["type"])
    finally:
        sub.close()
    missing = {i: sorted(seen[i]) for i in ids
               if seen[i] != {"task-received", "task-started", "task-succeeded"}}
    assert not missing, missing
    assert messages < TASKS, f"{3 * TASKS} events in {messages} messages"
