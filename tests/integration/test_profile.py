"""The runtime profile's feedback against a real Redis and a real worker: a paused
intake picks nothing (and picks again when resumed), a worker whose descriptor
threshold is crossed advertises it and leaves new tasks waiting, and a ``--pool=solo``
worker (whose tasks run on the consumer's event loop) goes on sampling through a task."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Consumer, Queue

from sits_queue.broker import intake
from sits_queue.broker.keys import QueueKeys
from sits_queue.procs import CeleryProcess, start_worker, wait_ready
from sits_queue.workers import advertise
from tests.integration.conftest import ROOT, worker_env
from tests.waiting import wait_for

CELERY = QueueKeys.for_queue("celery")


def collecting(conn: Any, got: list[Any]) -> Consumer:
    """A consumer of the celery queue that keeps each body in ``got`` and acks it."""
    return Consumer(conn.default_channel, [Queue("celery")],
                    callbacks=[lambda body, msg: (got.append(body), msg.ack())],
                    accept=["json"])


def test_a_paused_intake_picks_nothing_until_resumed(redis_client: redis.Redis,
                                                      client_app: Celery) -> None:
    client_app.tasks["w.add"].delay(1, 2)
    got: list[Any] = []
    with client_app.connection_for_read() as conn, collecting(conn, got):
        try:
            intake.pause("a test")
            # drain_events gives up after its timeout: nothing was picked
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=1.0)
            assert got == [] and redis_client.zcard(CELERY.waiting) == 1
        finally:
            intake.pause(None)
        conn.drain_events(timeout=10)
    assert len(got) == 1 and redis_client.zcard(CELERY.waiting) == 0


def test_a_wait_sent_before_the_pause_leaves_what_wakes_it(redis_client: redis.Redis,
                                                           client_app: Celery) -> None:
    got: list[Any] = []
    with client_app.connection_for_read() as conn, collecting(conn, got):
        # Given a consumer blocked on the queue's wake-up marker (an empty queue)
        with pytest.raises(socket.timeout):
            conn.drain_events(timeout=0.3)
        try:
            # When its intake pauses and then a task arrives, waking that wait
            intake.pause("a test")
            client_app.tasks["w.add"].delay(5, 6)
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=1.0)
            # Then the task still waits, and so does the marker for other workers
            assert got == [] and redis_client.zcard(CELERY.waiting) == 1
            assert redis_client.zcard(CELERY.marker) == 1
        finally:
            intake.pause(None)
        conn.drain_events(timeout=10)
    assert len(got) == 1 and redis_client.zcard(CELERY.waiting) == 0


@pytest.fixture
def throttled_worker(spawn: Any) -> Iterator[CeleryProcess]:
    # Any open descriptor crosses a threshold this low: the worker throttles itself.
    yield spawn(concurrency=1, throttle_fd_share="0.000001")


def profile_of(r: redis.Redis, worker: CeleryProcess) -> dict[str, Any]:
    record = advertise.read_worker(r, "", worker.hostname) or {}
    return dict(record.get("profile") or {})


def test_a_worker_short_of_descriptors_leaves_new_tasks_waiting(
        redis_client: redis.Redis, throttled_worker: CeleryProcess, client_app: Celery
        ) -> None:
    # (redis_client first: it resets kombu's pools, which the client app then opens anew)
    worker = throttled_worker
    # Given a worker whose profile says it is throttled (after two samples, ~5 s)
    wait_for(lambda: profile_of(redis_client, worker).get("state") == "throttled", 30,
             "the worker to throttle itself")
    assert "file descriptors" in profile_of(redis_client, worker)["why"]
    first = profile_of(redis_client, worker)["samples"]
    # When a task is sent, and the worker samples and advertises again
    client_app.tasks["w.add"].delay(3, 4)
    wait_for(lambda: profile_of(redis_client, worker).get("samples", 0) > first, 30,
             "the next sample")
    # Then it is still waiting: nobody picked it
    assert redis_client.zcard(CELERY.waiting) == 1 and redis_client.zcard(CELERY.unacked) == 0
    assert "intake paused" in worker.log()
    assert worker.alive()


#: ``short_sample_app.SAMPLE_S``, s; not imported: that module patches the profile
#: module of whichever process imports it, this one's too.
SAMPLE_S = 0.2
#: The task outlasts fifteen of the worker's sampling periods.
TASK_S = 15 * SAMPLE_S


def test_a_solo_worker_samples_its_resources_through_a_long_task(
        tmp_path: Path, redis_url: str, redis_client: redis.Redis, client_app: Celery
        ) -> None:
    # Given a solo worker sampling every fifth of a second
    proc = start_worker("tests.integration.short_sample_app", worker_env(redis_url),
                        tmp_path, concurrency=1, pool="solo", cwd=ROOT)
    try:
        wait_ready(client_app, [proc])
        # When it runs one task for fifteen of those periods
        result = client_app.tasks["w.slow"].delay("long", TASK_S)
        wait_for(lambda: redis_client.llen("test:started") == 1, 30, "the task to start")
        before = profile_of(redis_client, proc).get("samples", 0)
        during: list[int] = []

        def finished() -> bool:
            samples = profile_of(redis_client, proc).get("samples", 0)
            # (the task marks its end before it returns to the event loop)
            if not redis_client.llen("test:finished"):
                during.append(samples)
            return result.ready()

        wait_for(finished, TASK_S + 30, "the long task to finish")
        assert result.get(timeout=1) == "long"
        # Then its profile went on counting samples while the task held the event loop
        # (about fifteen; a third of them is plenty to tell from none)
        assert max(during, default=before) - before >= 5, (before, during)
    finally:
        proc.stop(timeout_s=15)
