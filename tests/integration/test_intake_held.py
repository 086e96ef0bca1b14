"""``procs.intake_held``: the benchmarks' backlog. Submitted while the workers' intake is
held, a stream is all waiting before any of it is taken, whatever the producer's speed
(a producer slower than the workers fed them one task at a time: the affinity benchmark
then found nothing to choose among and took 0 tasks ahead of the head)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis
from celery import Celery

from sits_queue.broker.keys import QueueKeys
from sits_queue.procs import CeleryProcess, intake_held

Spawn = Callable[..., CeleryProcess]
WAITING = QueueKeys.for_queue("celery").waiting


def test_what_is_submitted_while_held_waits_then_all_of_it_runs(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    workers = [spawn(concurrency=1), spawn(concurrency=1)]
    # Given two idle workers, the intake held
    with intake_held(client_app, workers) as hold:
        # When tasks are sent one at a time, each a round trip through both workers'
        # loops after the one before (a ping: the loop that answers it also picks)
        results = []
        for i in range(6):
            results.append(client_app.tasks["w.add"].delay(i, i))
            assert len(client_app.control.ping(
                destination=[w.hostname for w in workers], timeout=5)) == 2
        # Then every one of them is waiting
        assert redis_client.zcard(WAITING) == 6
        last_sent = time.time()
    # (the stream's arrival, for a benchmark's clock: once all of it was sent)
    assert hold.released_s is not None and hold.released_s >= last_sent
    assert hold.arrived(last_sent - 60) == hold.released_s
    # And once the block ends, the workers take them all
    assert [r.get(timeout=20) for r in results] == [0, 2, 4, 6, 8, 10]
    # and consume the queue as before (a task sent after runs)
    assert client_app.tasks["w.add"].delay(20, 1).get(timeout=20) == 21


def test_a_queue_the_workers_do_not_consume_is_refused_by_name(
        spawn: Spawn, client_app: Celery) -> None:
    worker = spawn(concurrency=1)
    with pytest.raises(ValueError, match="do not consume 'elsewhere'"), \
            intake_held(client_app, [worker], queue="elsewhere"):
        pytest.fail("the block ran")
    # (and the worker's own queue is left as it was)
    assert client_app.tasks["w.add"].delay(1, 1).get(timeout=20) == 2


def test_a_worker_that_never_answers_is_a_timeout_naming_it(
        spawn: Spawn, client_app: Celery) -> None:
    worker = spawn(concurrency=1)
    gone = CeleryProcess(name="worker", popen=worker.popen, log_path=worker.log_path,
                         hostname="nobody@nowhere")
    with pytest.raises(TimeoutError, match="nobody@nowhere"), \
            intake_held(client_app, [worker, gone], timeout_s=1):
        pytest.fail("the block ran")


def test_a_block_that_raises_leaves_the_workers_consuming_again(
        spawn: Spawn, client_app: Celery) -> None:
    worker = spawn(concurrency=1)
    with pytest.raises(RuntimeError, match="the producer failed"), \
            intake_held(client_app, [worker]) as hold:
        sent = client_app.tasks["w.add"].delay(2, 3)
        raise RuntimeError("the producer failed")
    # What was sent before the error runs, and so does what is sent after
    assert hold.released_s is not None
    assert sent.get(timeout=20) == 5
    assert client_app.tasks["w.add"].delay(4, 4).get(timeout=20) == 8
