"""Celery's ``rate_limit`` on a SITS worker (``workers/ratelimits.py``): a task waiting for
its token holds its message, not the worker's intake. Real Redis, real workers."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from celery import Celery

from sits_queue.broker.keys import QueueKeys
from sits_queue.procs import CeleryProcess
from tests.integration.conftest import served
from tests.waiting import wait_for

KEYS = QueueKeys.for_queue("celery")


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_tasks_waiting_for_a_token_leave_the_worker_serving_the_rest(
        pool: str, spawn: Callable[..., CeleryProcess], client_app: Celery,
        redis_client: redis.Redis) -> None:
    """(with prefetch off, SITS's default, they took up the prefetch count: a one-slot
    worker with an '1/h' task waiting took nothing else for the hour)"""
    spawn(concurrency=1, pool=pool)
    hourly = client_app.tasks["w.hourly"]
    assert hourly.delay("first").get(timeout=60) == "first"  # the bucket's one token
    waiting = [hourly.delay("second"), hourly.apply_async(("after its eta",), countdown=1)]
    # The first waits for its token in the worker; the ETA one, once due, goes back to
    # the queue (no more of a type wait here than the pool runs), held off from this
    # worker until its next token
    wait_for(lambda: redis_client.zcard(KEYS.unacked) == 1
             and redis_client.zcard(KEYS.waiting) == 1, 30,
             "one task to wait in the worker and the due one in the queue")
    # plain work still runs, in turn
    results = [client_app.tasks["w.add"].delay(i, i) for i in range(5)]
    assert [r.get(timeout=60) for r in results] == [0, 2, 4, 6, 8]
    assert all(r.state == "PENDING" for r in waiting)


def test_a_worker_holds_no_more_token_waiters_than_its_pool_the_rest_stay_queued(
        spawn: Callable[..., CeleryProcess], client_app: Celery,
        redis_client: redis.Redis) -> None:
    """(it took every waiting rate-limited task into its bucket: an idle worker beside
    it got none, and an urgent task submitted later ran behind them all)"""
    spawn(concurrency=1)
    hourly = client_app.tasks["w.hourly"]
    assert hourly.delay("first").get(timeout=60) == "first"  # the bucket's one token
    later = [hourly.delay(f"later {i}") for i in range(6)]
    # One waits for its token in the worker; the rest stay in the queue
    wait_for(lambda: redis_client.zcard(KEYS.unacked) == 1
             and redis_client.zcard(KEYS.waiting) == 5, 30,
             "one task to wait in the worker and five in the queue")
    # ... where a second worker takes one (its bucket has a token)
    spawn(concurrency=1)
    wait_for(lambda: sum(r.state == "SUCCESS" for r in later) == 1, 60,
             "the second worker to run one of them")


def test_countdown_tasks_of_a_rate_limited_type_are_capped_alike(
        spawn: Callable[..., CeleryProcess], client_app: Celery,
        redis_client: redis.Redis) -> None:
    """(with a countdown each went into the bucket once due, whatever its size: a worker
    kept five '1/h' tasks for five hours while a second worker stood idle)"""
    spawn(concurrency=1)
    hourly = client_app.tasks["w.hourly"]
    later = [hourly.apply_async((f"later {i}",), countdown=1) for i in range(6)]
    # One runs on the bucket's token, one waits for the next in the worker, the rest
    # are back in the queue once due...
    wait_for(lambda: sum(r.state == "SUCCESS" for r in later) == 1
             and redis_client.zcard(KEYS.unacked) == 1
             and redis_client.zcard(KEYS.waiting) == 4, 60,
             "one run, one waiting for its token in the worker and four in the queue")
    # ... where a second worker takes one (its bucket has a token)
    spawn(concurrency=1)
    wait_for(lambda: sum(r.state == "SUCCESS" for r in later) == 2, 60,
             "the second worker to run one of them")


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_backlog_runs_at_its_rate_not_at_the_give_backs_pace(
        pool: str, spawn: Callable[..., CeleryProcess], client_app: Celery) -> None:
    """(the tasks past the pool's size were given back on the VRAM refusals' backoff,
    0.25 s doubling to 4 s: 20 tasks at '10/s' took 26 s on one slot, ~2 s in Celery)"""
    spawn(concurrency=1, pool=pool)
    tenth = client_app.tasks["w.tenth"]
    results = [tenth.delay(f"t{i}") for i in range(20)]
    # All done within a bound for them all (~2 s at the rate asked; room for a slow
    # machine), not one per result
    wait_for(lambda: all(r.ready() for r in results), 15, "the 20 tasks to run")
    assert [r.get(timeout=1) for r in results] == [f"t{i}" for i in range(20)]


def sweep(client_app: Celery, redis_client: redis.Redis) -> int:
    """The visibility sweep's restore (``restore.lua``) of every message held on queue
    ``celery``, as a live worker's sweep runs it once the holder's beat is overdue."""
    now = redis_client.time()[0] + 1
    served(redis_client)  # (and no gap in its sweeps and beats holds this one)
    with client_app.connection_for_write() as conn:
        return int(conn.default_channel._run("restore", "celery", [now, 1000, now + 86_400,
                                                                   1.0]))


def test_a_task_waiting_for_its_token_in_a_killed_worker_is_no_redelivery(
        spawn: Callable[..., CeleryProcess], client_app: Celery,
        redis_client: redis.Redis) -> None:
    """(it had not started, yet each crash of a worker holding it counted: at '1/h' a
    few host failures dead-lettered as poison a task that never ran)"""
    worker = spawn(concurrency=1)
    hourly = client_app.tasks["w.hourly"]
    assert hourly.delay("first").get(timeout=60) == "first"  # the bucket's one token
    second = hourly.delay("second")
    wait_for(lambda: redis_client.scard(KEYS.idle) == 1, 30,
             "the worker to say it holds a task it has not started")
    (tag,) = redis_client.smembers(KEYS.idle)
    assert redis_client.zscore(KEYS.unacked, tag) is not None
    # When its worker dies (the host, say) and a sweep restores what it held
    worker.kill()
    assert sweep(client_app, redis_client) == 1
    # Then it waits again, uncounted, and another worker runs it
    assert redis_client.zscore(KEYS.waiting, tag) is not None
    assert redis_client.hget(KEYS.redelivered, tag) is None
    assert redis_client.scard(KEYS.idle) == 0
    spawn(concurrency=1)
    assert second.get(timeout=60) == "second"


def test_a_task_that_waited_for_its_token_then_crashed_its_worker_counts(
        spawn: Callable[..., CeleryProcess], client_app: Celery,
        redis_client: redis.Redis) -> None:
    """A task says it has started before it runs: one that kills its worker is counted
    (poison), however long it waited for its token."""
    worker = spawn(concurrency=1)
    task = client_app.tasks["w.each_second_or_die"]
    assert task.delay("first").get(timeout=60) == "first"
    task.delay("die")  # waits ~1 s for its token, then kills its worker
    try:
        wait_for(lambda: redis_client.scard(KEYS.idle) == 1, 30, "it to wait for its token")
        (tag,) = redis_client.smembers(KEYS.idle)
        wait_for(lambda: not worker.alive(), 30, "the task to kill its worker")
        worker.kill()  # (the pool child's group, if any is left)
        assert redis_client.scard(KEYS.idle) == 0  # said started before it ran
        assert sweep(client_app, redis_client) == 1
        assert redis_client.hget(KEYS.redelivered, tag) == b"1"
    finally:
        # The task that kills its worker, back in the queue, is not left there: the next
        # test of this process to start a worker on this server had it killed at start
        worker.kill()
        redis_client.flushall()
