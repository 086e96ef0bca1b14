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


def task_events_of(sub: Any, ids: set[str], wait_s: float) -> set[str]:
    """The types of the task events of ``ids`` heard within ``wait_s``."""
    seen: set[str] = set()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if (message := sub.get_message(timeout=0.2)) is not None:
            seen |= {e["type"] for e in events_of(message) if e.get("uuid") in ids}
    return seen


def test_task_events_turned_off_and_on_by_remote_control(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(a worker sending task events from its start has no event groups, which means all
    of them: Celery's disable_events replied "task events already disabled" and they
    went on)"""
    sub = redis_client.pubsub(ignore_subscribe_messages=True)
    sub.psubscribe("*celeryev*")
    try:
        worker = spawn(concurrency=1)
        add = client_app.tasks["w.add"]
        # When task events are turned off by remote control
        reply = client_app.control.disable_events(destination=[worker.hostname], reply=True)
        assert reply == [{worker.hostname: {"ok": "task events disabled"}}]
        off = add.delay(1, 1)
        assert off.get(timeout=30) == 2
        # Then the task's events are not sent
        assert task_events_of(sub, {off.id}, 1.5) == set()
        again = client_app.control.disable_events(destination=[worker.hostname], reply=True)
        assert again == [{worker.hostname: {"ok": "task events already disabled"}}]
        # And once turned on again, they are
        reply = client_app.control.enable_events(destination=[worker.hostname], reply=True)
        assert reply == [{worker.hostname: {"ok": "task events enabled"}}]
        on = add.delay(2, 2)
        assert on.get(timeout=30) == 4
        assert {"task-received", "task-started", "task-succeeded"} <= task_events_of(
            sub, {on.id}, 3.0)
    finally:
        sub.close()
