"""What counts as a redelivery, with real ``celery worker`` subprocesses.

A message's redelivery count is for crashes (more than ``max_redeliveries`` dead-letter
it as poison): a warm shutdown that gives back a task it never started must not add
to it, and a worker busy in a long task (``--pool=solo``, where the task blocks the
event loop) must keep its message's deadline fresh, so that no other worker restores
and runs it a second time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from sits_queue.broker.keys import QueueKeys
from sits_queue.procs import CeleryProcess, start_worker, wait_ready
from tests.integration.conftest import APP_MODULE, ROOT, worker_env
from tests.waiting import wait_for

KEYS = QueueKeys.for_queue("celery")
Start = Callable[..., CeleryProcess]


@pytest.fixture
def start(tmp_path: Path, redis_url: str, client_app: Celery,
          redis_client: redis.Redis) -> Iterator[Start]:
    """start(pool=..., **settings): a ready worker of one slot; all stopped at teardown."""
    started: list[CeleryProcess] = []

    def _start(pool: str = "prefork", **settings: str) -> CeleryProcess:
        proc = start_worker(APP_MODULE, worker_env(redis_url, **settings), tmp_path,
                            concurrency=1, pool=pool, cwd=ROOT)
        started.append(proc)
        wait_ready(client_app, [proc])
        return proc

    yield _start
    for proc in started:
        proc.stop(timeout_s=10)


#: Longest a cold shutdown may take: its pool's children killed, its channel closed.
COLD_SHUTDOWN_S = 30.0


def exited_or_stacks(worker: CeleryProcess) -> None:
    """Wait for a worker sent SIGQUIT to exit; one that does not is asked for every
    thread's stack (Celery's SIGUSR1 handler writes them to its log) and the test fails
    with them: a cold shutdown once outlasted 20 s on CI's loaded host, and its log
    said only that it had begun."""
    try:
        worker.popen.wait(COLD_SHUTDOWN_S)
    except subprocess.TimeoutExpired:
        os.kill(worker.pid, signal.SIGUSR1)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: "LOCAL VARIABLES" in worker.log(), 5, "the stacks")
        pytest.fail(f"the worker did not exit within {COLD_SHUTDOWN_S:g} s of SIGQUIT; "
                    f"its log, stacks last:\n{worker.log()[-12000:]}")


def test_a_held_task_survives_more_warm_restarts_than_max_redeliveries(
        start: Start, client_app: Celery, redis_client: redis.Redis) -> None:
    restarts = 3  # more than max_redeliveries=1 below: two would dead-letter it
    # Given a task that each worker takes and holds without starting it (an ETA ahead:
    # Celery keeps such a task, unacked, in its timer)
    result = client_app.tasks["w.slow"].apply_async(("held", 0.0), countdown=restarts * 7)
    sent = time.monotonic()
    for i in range(restarts):
        worker = start(max_redeliveries="1")
        wait_for(lambda: redis_client.zcard(KEYS.unacked) == 1, 30, "the worker to take it")
        # When the worker shuts down warm (SIGTERM), giving back what it holds
        worker.stop()
        assert not worker.alive()
        assert redis_client.get("test:started:held") is None, \
            f"the ETA passed during restart {i + 1}: this machine restarts too slowly"
        # Then the task is waiting again, not counted as redelivered
        assert redis_client.zcard(KEYS.waiting) == 1, worker.log()[-2000:]
        assert redis_client.hlen(KEYS.redelivered) == 0
    assert time.monotonic() - sent < restarts * 7
    # And the next worker runs it when it is due, once; nothing was dead-lettered
    start(max_redeliveries="1")
    assert result.get(timeout=restarts * 7 + 30) == "held"
    assert redis_client.get("test:started:held") == b"1"
    assert redis_client.hlen(KEYS.dead) == 0


@pytest.mark.parametrize(("pool", "to_group", "said"), [
    ("prefork", True, None),  # a terminal's Ctrl-\: the whole process group
    # the main process alone, as systemd's KillMode=mixed signals it: Celery ends the
    # running child itself (a check on the pool's class, where prefork sets terminate_job
    # on the instance, took it for a pool that cannot, and waited for the task)
    ("prefork", False, None),
    # (Celery asked the solo pool to end the job: its NotImplementedError was raised
    # into the running task, which was stored as FAILURE and acked, its work lost)
    ("solo", False, "cold shutdown of a solo pool with a task running"),
])
def test_a_task_running_at_a_cold_shutdown_goes_back_counted(
        start: Start, client_app: Celery, redis_client: redis.Redis, pool: str,
        to_group: bool, said: str | None) -> None:
    worker = start(pool=pool, visibility_timeout_s="4")  # the loop's sweep tick: 1 s
    result = client_app.tasks["w.slow"].delay("hung", 60.0)
    wait_for(lambda: redis_client.get("test:started:hung") == b"1", 30, "the task to start")
    time.sleep(2.0)  # a sweep tick or two see it started
    # When the worker is stopped cold (SIGQUIT): Celery cancels the running task
    (os.killpg if to_group else os.kill)(worker.pid, signal.SIGQUIT)
    exited_or_stacks(worker)
    # Then its message went back counted: a task that keeps a worker from stopping
    # (or brings it down) is a poison candidate; it is not failed
    assert redis_client.zcard(KEYS.waiting) == 1, worker.log()[-2000:]
    assert list(redis_client.hvals(KEYS.redelivered)) == [b"1"]
    assert result.state == "STARTED"
    assert "cannot be stopped" not in worker.log()
    assert said is None or said in worker.log()


def test_a_threads_workers_running_task_ends_before_a_cold_shutdown_does(
        start: Start, client_app: Celery, redis_client: redis.Redis) -> None:
    """(a thread cannot be stopped: Celery's ask raised NotImplementedError out of the
    signal handler, logged as an "Unrecoverable error" with its traceback)"""
    worker = start(pool="threads")
    result = client_app.tasks["w.slow"].delay("threads-cold", 3.0)
    wait_for(lambda: redis_client.get("test:started:threads-cold") == b"1", 30,
             "the task to start")
    os.kill(worker.pid, signal.SIGQUIT)
    exited_or_stacks(worker)
    assert result.get(timeout=10) == "threads-cold"
    assert "its 1 running task(s) cannot be stopped" in worker.log()
    assert "Unrecoverable error" not in worker.log()
    assert redis_client.zcard(KEYS.waiting) == 0


def test_a_batch_running_at_a_cold_shutdown_counts_as_a_task_does(
        start: Start, client_app: Celery, redis_client: redis.Redis) -> None:
    """(a batch's members were given back uncounted, as the mates of a revoke(terminate=
    True): a batch that hung its worker into cold shutdowns never neared the poison
    limit, and came back as the kin of new arrivals)"""
    worker = start(visibility_timeout_s="4")
    hung = client_app.tasks["w.lengths_hung"].delay("hung batch")
    wait_for(lambda: redis_client.get("test:started:hung batch") == b"1", 60,
             "the batch to start")

    def accepted() -> bool:  # (the worker's main process has it as started)
        replies = client_app.control.inspect(destination=[worker.hostname],
                                             timeout=1).active() or {}
        return hung.id in {t["id"] for tasks in replies.values() for t in tasks}

    wait_for(accepted, 30, "the worker to count the batch started")
    time.sleep(2.0)  # a sweep tick or two see it started
    os.killpg(worker.pid, signal.SIGQUIT)
    exited_or_stacks(worker)
    assert redis_client.zcard(KEYS.waiting) == 1, worker.log()[-2000:]
    assert list(redis_client.hvals(KEYS.redelivered)) == [b"1"]


def test_a_solo_worker_keeps_a_task_longer_than_the_visibility_timeout(
        start: Start, client_app: Celery, redis_client: redis.Redis) -> None:
    # Given a solo worker running a task 2.5x the visibility timeout (the task blocks
    # its event loop)...
    solo = start(pool="solo", visibility_timeout_s="4")
    result = client_app.tasks["w.slow"].delay("long", 10.0)
    wait_for(lambda: redis_client.get("test:started:long") == b"1", 30, "the task to start")
    # ...and another worker sweeping the queue for silent holders meanwhile
    sweeper = start(visibility_timeout_s="4")
    # Then the task runs once: its holder's heartbeat kept it
    assert result.get(timeout=30) == "long"
    time.sleep(1.0)  # a second run would have started by now
    assert redis_client.get("test:started:long") == b"1"
    assert redis_client.lrange("test:finished", 0, -1) == [b"long"]
    assert "whose worker stopped heartbeating" not in sweeper.log() + solo.log()
    assert redis_client.hlen(KEYS.redelivered) == 0


def test_a_solo_worker_acks_a_task_before_it_runs_the_next(
        start: Start, client_app: Celery, redis_client: redis.Redis) -> None:
    """(the freed slot's next task was picked before the finished one's ack was sent: on
    ``--pool=solo`` that pick runs the next task then and there, so the ack waited for
    its end; one longer than the visibility timeout had the finished task, no longer
    beaten, restored by another worker's sweep and run again)"""
    slow = client_app.tasks["w.slow"]
    # Given a solo worker that runs a short task, then one longer than the timeout, put
    # while the first runs (picked when the first ends, by the pick for the freed slot)
    solo = start(pool="solo", visibility_timeout_s="4")
    slow.delay("short", 1.0)
    wait_for(lambda: redis_client.get("test:started:short") == b"1", 30, "the short one")
    slow.delay("long", 12.0)
    wait_for(lambda: redis_client.get("test:started:long") == b"1", 30, "the long one")
    # and another worker sweeping the queue meanwhile
    sweeper = start(visibility_timeout_s="4")
    # Then the short one runs once: acked when it ended, nothing to restore
    wait_for(lambda: redis_client.lrange("test:finished", 0, -1) == [b"short", b"long"],
             40, "both to finish", seen=lambda: redis_client.lrange("test:finished", 0, -1))
    assert redis_client.get("test:started:short") == b"1", sweeper.log()[-2000:]
    assert "whose worker stopped heartbeating" not in sweeper.log() + solo.log()


def test_a_busy_solo_worker_still_restores_what_a_dead_worker_held(
        start: Start, client_app: Celery, redis_client: redis.Redis) -> None:
    """The sweeps hold off after a gap in a queue's sweeps and beats (``sweeps.lua``: a
    Redis stall). A solo worker running task after task sweeps only between them, further
    apart than that gap: counted by its sweeps alone, its every sweep found a gap and
    held, and what a dead worker held stayed unacked while it was busy. Its heartbeat
    thread's beats keep the queue's record fresh."""
    slow = client_app.tasks["w.slow"]
    # Given a worker holding a running task (as one of another host: it does not say
    # which process it is, so its death is seen by the timeout alone)
    doomed = start(visibility_timeout_s="5", reclaim_dead_holders="0")
    slow.delay("held", 60.0)
    wait_for(lambda: redis_client.get("test:started:held") == b"1", 30, "the task to start")
    # and a solo worker busy with tasks longer than the sweeps' period allows between
    # two sweeps (5 s against 1.75 x 5/3 s)
    solo = start(pool="solo", visibility_timeout_s="5")
    busy = [slow.delay(f"busy{i}", 5.0) for i in range(10)]
    wait_for(lambda: redis_client.get("test:started:busy0") == b"1", 30, "the solo's work")
    # When the first worker dies
    doomed.kill()
    died = time.monotonic()
    # Then the solo worker restores its task between two of its own and runs it, well
    # before its own work is done (50 s)
    wait_for(lambda: redis_client.get("test:started:held") == b"2", 30,
             "the dead worker's task to run again", seen=lambda: solo.log()[-2000:])
    assert time.monotonic() - died < 30
    assert sum(r.ready() for r in busy) < len(busy)
