"""A task held for its ETA takes its turn in the queue once due (``workers/etaorder.py``),
in a real worker of one slot. (Celery sent it to the pool when it fell due: a low-class
task due while the slot was busy ran before a high-class task waiting in the queue.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from sits_queue.broker.keys import QueueKeys
from sits_queue.procs import CeleryProcess
from tests.waiting import wait_for

Spawn = Callable[..., CeleryProcess]
KEYS = QueueKeys.for_queue("celery")


def started(r: redis.Redis) -> list[str]:
    return [t.decode() for t in r.lrange("test:started", 0, -1)]


def test_a_due_task_held_for_its_eta_runs_after_a_higher_class_task_waiting(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    spawn(concurrency=1)
    slow = client_app.tasks["w.slow"]
    # Given a low-class task with a countdown, picked at once (nothing else waits) and
    # held in the worker's timer...
    countdown_s = 1.0
    due = time.time() + countdown_s
    held = slow.apply_async(("eta-low", 0), countdown=countdown_s, sla_class="low")
    wait_for(lambda: redis_client.zcard(KEYS.waiting) == 0
             and redis_client.zcard(KEYS.unacked) == 1, 20, "the worker to pick it early")
    # ...and the worker's only slot busy past its due time
    busy = slow.apply_async(("busy", 4), sla_class="low")
    wait_for(lambda: "busy" in started(redis_client), 30, "the busy task to start")
    wait_for(lambda: time.time() > due + 0.5, 10, "the countdown to pass")
    # When a high-class task comes into the queue while the slot is still busy
    urgent = slow.apply_async(("urgent", 0), sla_class="high")
    assert "busy" not in [t.decode() for t in redis_client.lrange("test:finished", 0, -1)], \
        "the busy task ended before the urgent one came: the test proves nothing"
    for result in (busy, urgent, held):
        result.get(timeout=60)
    # Then the urgent task takes the slot first, and the due one its turn after it
    assert started(redis_client) == ["busy", "urgent", "eta-low"]
    assert redis_client.hlen(KEYS.redelivered) == 0  # given back uncounted


def test_a_task_picked_when_due_runs_and_is_not_given_back(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    # A countdown already past when the worker first sees it (no worker yet at its put)
    held = client_app.tasks["w.slow"].apply_async(("late", 0), countdown=0.2)
    spawn(concurrency=1)  # (a worker takes longer than that to start)
    assert held.get(timeout=60) == "late"
    assert started(redis_client) == ["late"]


@pytest.mark.parametrize("name, args", [("w.slow", ("eta", 0)), ("w.tenth", ("eta",))],
                         ids=["plain", "rate-limited"])
def test_a_due_task_of_a_queue_the_worker_no_longer_consumes_runs_there(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis, name: str,
        args: tuple[Any, ...]) -> None:
    """(as stock Celery runs the ETA tasks a worker holds after ``cancel_consumer``:
    given back to take its turn, it waited in a queue no worker consumed)"""
    worker = spawn(concurrency=1)
    # Given a countdown task a worker picked early and holds for its ETA
    held = client_app.tasks[name].apply_async(args, countdown=2.0)
    wait_for(lambda: redis_client.zcard(KEYS.waiting) == 0
             and redis_client.zcard(KEYS.unacked) == 1, 20, "the worker to pick it early")
    # When the worker is told to stop consuming its queue before the task falls due
    replies = client_app.control.cancel_consumer("celery", destination=[worker.hostname],
                                                 reply=True, timeout=5)
    assert replies, "the worker did not answer cancel_consumer"
    # Then it runs the task it holds once due, there
    assert held.get(timeout=30) == "eta"
    wait_for(lambda: redis_client.zcard(KEYS.unacked) == 0, 10, "the ack")
    assert redis_client.zcard(KEYS.waiting) == 0
