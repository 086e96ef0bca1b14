"""Celery's own features on the sorted-set transport, through real ``celery worker``
subprocesses: canvas (chain, group, chord), countdown / ETA, retries, and the
scheduling options riding along the way (a retried or chained task keeps its class)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import redis
from celery import Celery, chain, chord, group
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from sits_queue.procs import CeleryProcess
from tests.waiting import wait_for

Spawn = Callable[..., CeleryProcess]
RESULT_S = 60


def test_a_chain_passes_each_result_on(spawn: Spawn, client_app: Celery) -> None:
    spawn()
    add = client_app.tasks["w.add"]
    assert chain(add.s(1, 2), add.s(3), add.s(4)).apply_async().get(timeout=RESULT_S) == 10


def test_a_group_and_a_chord_gather_every_result(spawn: Spawn, client_app: Celery) -> None:
    spawn()
    add, total = client_app.tasks["w.add"], client_app.tasks["w.total"]
    assert group(add.s(i, i) for i in range(6)).apply_async().get(timeout=RESULT_S) == \
        [0, 2, 4, 6, 8, 10]
    # The chord's body runs once, after every header task, with their results in order
    assert chord([add.s(i, 1) for i in range(10)])(total.s()).get(timeout=RESULT_S) == 55


def test_a_chord_member_that_replaces_itself_counts_in_its_chord(
        spawn: Spawn, client_app: Celery) -> None:
    """(its request carries the chord as a dict, which the check of the replacement's
    later steps could not weak-reference: the member failed with a TypeError, and the
    chord with a ChordError)"""
    spawn()
    add, total = client_app.tasks["w.add"], client_app.tasks["w.total"]
    replacing = client_app.tasks["w.add_by_replacing"]
    joined = chord([replacing.s(1, 2), add.s(3, 4), replacing.s(5, 6)])(total.s())
    assert joined.get(timeout=RESULT_S) == 21


def test_a_dead_lettered_task_fails_its_chord_and_calls_its_errbacks(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(its FAILURE was stored without its request: the chord's body stayed PENDING for
    good, never failed, and link_error errbacks never ran)"""
    from celery.exceptions import ChordError

    from sits_queue.errors import DeadLettered

    spawn()
    add, total = client_app.tasks["w.add"], client_app.tasks["w.total"]
    unstartable, record = client_app.tasks["w.unstartable"], client_app.tasks["w.record"]
    # Given a chord one of whose parts Celery cannot start (its message is dead-lettered)
    body = chord([add.s(1, 1), unstartable.s(), add.s(2, 2)])(total.s())
    # Then the body fails as for any failed part, naming it (read alone: the chord's
    # handle would raise its failed part's error itself)
    with pytest.raises(ChordError, match="DeadLettered"):
        client_app.AsyncResult(body.id).get(timeout=RESULT_S)
    # And a dead-lettered task's errbacks run
    lone = unstartable.apply_async(link_error=record.si("errback of a dead letter"))
    with pytest.raises(DeadLettered):
        lone.get(timeout=RESULT_S)
    wait_for(lambda: redis_client.sismember("test:done", "errback of a dead letter"),
             RESULT_S, "the errback")


def test_countdown_and_eta_are_honoured(spawn: Spawn, client_app: Celery) -> None:
    spawn()
    add = client_app.tasks["w.add"]
    add.delay(0, 0).get(timeout=RESULT_S)  # the worker is up and serving
    sent = datetime.now(UTC)
    later = add.apply_async((1, 1), countdown=1.5)
    at = add.apply_async((2, 2), eta=sent + timedelta(seconds=1.5))
    now = add.delay(3, 3)
    assert now.get(timeout=RESULT_S) == 6
    assert not later.ready() and not at.ready()  # held by the worker, not run early
    assert later.get(timeout=RESULT_S) == 2 and at.get(timeout=RESULT_S) == 4
    for result in (later, at):
        assert result.date_done is not None
        assert result.date_done >= sent + timedelta(seconds=1.5)


def test_a_retried_task_runs_again_and_keeps_its_class(spawn: Spawn, client_app: Celery,
                                                       redis_client: redis.Redis) -> None:
    spawn()
    flaky = client_app.tasks["w.flaky"]
    ok = flaky.apply_async(("ok", 2), sla_class="high", model="m-x")
    # The third run succeeds, and it still carries the options it was submitted with
    assert ok.get(timeout=RESULT_S) == {"tag": "ok", "runs": 3, "retries": 2,
                                        "sla_class": "high", "model": "m-x"}
    # Past max_retries (3) the task fails with its own error, after 4 runs
    gone = flaky.apply_async(("gone", 10), sla_class="high")
    with pytest.raises(RuntimeError, match="gone: run 4 failed"):
        gone.get(timeout=RESULT_S)
    assert int(redis_client.get("test:flaky:gone") or 0) == 4


def test_a_calls_hard_time_limit_below_the_classs_soft_limit_holds(
        spawn: Spawn, client_app: Celery) -> None:
    """``time_limit=1`` on a call of a class whose soft limit is 36 s: the task is stopped
    at about 1 s (its soft limit, 0.8 s, fires first), not run past it."""
    spawn()
    slow = client_app.tasks["w.slow"]
    started = time.monotonic()
    result = slow.apply_async(("limited", 30), time_limit=1)
    with pytest.raises((SoftTimeLimitExceeded, TimeLimitExceeded)):
        result.get(timeout=60)
    assert time.monotonic() - started < 15  # not the class's 36 s soft limit
