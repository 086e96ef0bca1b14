"""Waiting for results (``sits_queue.broker.resultwait``) on a real Redis: a submission
subscribes to nothing, and every way of waiting still gets its result, whether it was
stored before the wait, during it, or without the message that announces it.

The results are stored by a second app, as a worker's pool child stores them (the same
Lua write and PUBLISH)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery, states
from celery.result import GroupResult

from sits_queue.app import make_app
from sits_queue.broker.resultwait import RECHECK_S
from sits_queue.config import SitsConfig
from tests.waiting import wait_for


@pytest.fixture
def producer(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    app = make_app(SitsConfig(redis_url=redis_url), main="test_result_wait")

    @app.task(name="rw.echo", shared=False)  # type: ignore[untyped-decorator]
    def echo(text: str) -> str:
        return text

    yield app
    app.close()


@pytest.fixture
def worker_side(redis_url: str) -> Iterator[Celery]:
    app = make_app(SitsConfig(redis_url=redis_url), main="test_result_wait_worker")
    yield app
    app.close()


def later(seconds: float, action: Callable[[], Any]) -> threading.Thread:
    """``action`` run once ``seconds`` have passed, in a thread (a worker finishing)."""
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def store_silently(worker_side: Celery, client: redis.Redis, task_id: str,
                   value: Any) -> Callable[[], Any]:
    """What stores ``value`` as the task's SUCCESS without its PUBLISH (the message lost
    on the way)."""
    meta = worker_side.backend.encode({"status": states.SUCCESS, "result": value,
                                       "traceback": None, "children": [],
                                       "date_done": None, "task_id": task_id})
    return lambda: client.set(worker_side.backend.get_key_for_task(task_id), meta)


def calls(client: redis.Redis, command: str) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_submission_subscribes_to_nothing(producer: Celery,
                                            redis_client: redis.Redis) -> None:
    before = calls(redis_client, "subscribe") + calls(redis_client, "unsubscribe")
    results = [producer.tasks["rw.echo"].delay(f"t{i}") for i in range(50)]
    del results  # Celery unsubscribed each dropped result here
    after = calls(redis_client, "subscribe") + calls(redis_client, "unsubscribe")
    assert after == before
    assert not producer.backend.result_consumer.subscribed_to


def test_a_result_stored_before_the_wait_is_read(producer: Celery,
                                                 worker_side: Celery) -> None:
    result = producer.tasks["rw.echo"].delay("early")
    worker_side.backend.mark_as_done(result.id, "early")
    assert result.get(timeout=5) == "early"


def test_a_result_stored_during_the_wait_comes_by_its_message(producer: Celery,
                                                              worker_side: Celery) -> None:
    result = producer.tasks["rw.echo"].delay("during")
    timer = later(0.3, lambda: worker_side.backend.mark_as_done(result.id, "during"))
    assert result.get(timeout=10) == "during"
    timer.join()


def test_a_then_callback_of_a_result_done_before_it_is_fires(producer: Celery,
                                                             worker_side: Celery) -> None:
    """Celery buffered the message of a result subscribed at submission; here the stored
    state is read at the next drain (a wait on another result)."""
    done, other = producer.AsyncResult(str(uuid.uuid4())), producer.AsyncResult(
        str(uuid.uuid4()))
    worker_side.backend.mark_as_done(done.id, 41)
    seen: list[Any] = []
    done.then(lambda res: seen.append(res.result))
    timer = later(0.3, lambda: worker_side.backend.mark_as_done(other.id, 42))
    assert other.get(timeout=10) == 42
    timer.join()
    assert seen == [41]


def test_a_group_join_gets_members_done_before_and_during(producer: Celery,
                                                          worker_side: Celery) -> None:
    ids = [str(uuid.uuid4()) for _ in range(4)]
    group = GroupResult(str(uuid.uuid4()), [producer.AsyncResult(i) for i in ids],
                        app=producer)
    worker_side.backend.mark_as_done(ids[0], 0)
    worker_side.backend.mark_as_done(ids[2], 2)

    def finish() -> None:
        worker_side.backend.mark_as_done(ids[1], 1)
        worker_side.backend.mark_as_done(ids[3], 3)

    timer = later(0.3, finish)
    assert group.join_native(timeout=10) == [0, 1, 2, 3]
    timer.join()


def test_a_result_whose_message_never_came_is_read_again(producer: Celery,
                                                         worker_side: Celery,
                                                         redis_client: redis.Redis) -> None:
    """Stored without its PUBLISH (a message lost): Celery's consumer waited for ever."""
    result = producer.AsyncResult(str(uuid.uuid4()))
    timer = later(0.3, store_silently(worker_side, redis_client, result.id, "silent"))
    assert result.get(timeout=5 * RECHECK_S + 5) == "silent"
    timer.join()


def test_a_progress_callback_is_not_told_a_state_twice(producer: Celery,
                                                       worker_side: Celery) -> None:
    """The quiet-time reads hand on final states only: a stored STARTED re-read every
    second would reach ``on_message`` again each time. (It is told once, as the wait
    begins: the state the task is in.)"""
    result = producer.AsyncResult(str(uuid.uuid4()))
    worker_side.backend.store_result(result.id, None, states.STARTED)
    seen: list[str] = []
    timer = later(2.5 * RECHECK_S,
                  lambda: worker_side.backend.mark_as_done(result.id, "done"))
    assert result.get(timeout=10, on_message=lambda m: seen.append(m["status"])) == "done"
    timer.join()
    assert seen == [states.STARTED, states.SUCCESS]


def test_a_progress_callback_is_told_the_state_its_task_is_in_as_the_wait_begins(
        producer: Celery, worker_side: Celery) -> None:
    """(a task in PROGRESS when its wait began was heard only at SUCCESS: the wait
    subscribes as it begins, and what was published before never reached it; Celery's
    consumer, subscribed at the submission, heard it)"""
    result = producer.AsyncResult(str(uuid.uuid4()))
    worker_side.backend.store_result(result.id, {"done": 3}, "PROGRESS")
    seen: list[tuple[str, Any]] = []

    def progress() -> None:  # the task goes on: a new PROGRESS, then its result
        worker_side.backend.store_result(result.id, {"done": 7}, "PROGRESS")
        worker_side.backend.mark_as_done(result.id, "done")

    timer = later(0.5, progress)
    assert result.get(timeout=10, on_message=lambda m: seen.append(
        (m["status"], m["result"]))) == "done"
    timer.join()
    # told each state once: the one it was in, the ones published from then on
    assert seen == [("PROGRESS", {"done": 3}), ("PROGRESS", {"done": 7}),
                    (states.SUCCESS, "done")]


def test_a_result_subscribed_before_its_wait_is_told_its_states_in_order(
        producer: Celery, worker_side: Celery) -> None:
    """(the stored state was told first to every wait: a group's members, subscribed by
    the group's barrier, and a result waited on before, had the states published
    since on their channels, and heard P5, STARTED, P0 ... P5 ..., SUCCESS)"""
    for earlier in ("then", "timed_out_get"):
        result = producer.AsyncResult(str(uuid.uuid4()))
        if earlier == "then":  # as a group's barrier subscribes its members
            result.then(lambda _: None)
        else:
            with pytest.raises(Exception, match="timed out"):
                result.get(timeout=0.2)
        worker_side.backend.store_result(result.id, None, states.STARTED)
        for step in range(3):
            worker_side.backend.store_result(result.id, {"step": step}, "PROGRESS")
        seen: list[Any] = []
        timer = later(0.3, lambda r=result: worker_side.backend.mark_as_done(r.id, "end"))
        assert result.get(timeout=10, on_message=lambda m, seen=seen: seen.append(
            (m["status"], m["result"]))) == "end"
        timer.join()
        assert seen == [(states.STARTED, None), ("PROGRESS", {"step": 0}),
                        ("PROGRESS", {"step": 1}), ("PROGRESS", {"step": 2}),
                        (states.SUCCESS, "end")], earlier


def test_a_final_state_read_and_then_heard_is_told_once(producer: Celery,
                                                        worker_side: Celery) -> None:
    """(the read after the subscription handed SUCCESS on, and the message the same
    drain then took from the channel handed it on again: a progress callback heard
    SUCCESS twice in a third of the runs of a ~1 s task)"""
    result = producer.AsyncResult(str(uuid.uuid4()))
    consumer = producer.backend.result_consumer
    consumer.consume_from(result.id)  # subscribed: its stored state is to be read
    # Given the result stored and published while nobody drained
    worker_side.backend.mark_as_done(result.id, "once")
    seen: list[str] = []
    consumer.on_message = lambda meta: seen.append(meta["status"])
    # When one drain reads the stored state and then takes the channel's message
    consumer.drain_events(timeout=1.0)
    consumer.drain_events(timeout=0.2)
    # Then the callback was told of it once
    assert seen == [states.SUCCESS]
    consumer.on_message = None
    consumer.cancel_for(result.id)


def test_a_dropped_result_leaves_no_subscription(producer: Celery,
                                                 worker_side: Celery) -> None:
    result = producer.tasks["rw.echo"].delay("gone")
    worker_side.backend.mark_as_done(result.id, "gone")
    assert result.get(timeout=5) == "gone"
    assert not producer.backend.result_consumer.subscribed_to


def test_a_connection_lost_on_a_quiet_read_is_reconnected(
        producer: Celery, worker_side: Celery, redis_client: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Handled as Celery handles one on the pub/sub path, not raised out of ``get()``."""
    result = producer.AsyncResult(str(uuid.uuid4()))
    client = producer.backend.result_consumer.backend.client  # (the waits' own client)
    real_mget = client.mget
    failed: list[bool] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(True)
            raise redis.ConnectionError("connection lost")
        return real_mget(*args, **kwargs)

    monkeypatch.setattr(client, "mget", flaky)
    timer = later(0.3, store_silently(worker_side, redis_client, result.id, "back"))
    assert result.get(timeout=5 * RECHECK_S + 5) == "back"
    timer.join()
    assert failed


@pytest.mark.parametrize("record", [
    b"\xff not json",
    # an exception type that is no exception: Celery's decoding raises SecurityError
    json.dumps({"status": "FAILURE", "task_id": "x", "result": {
        "exc_module": "os", "exc_type": "system", "exc_message": ["true"]}}).encode(),
    json.dumps({"status": "SUCCESS", "result": 1}).encode(),  # no task id
])
def test_an_unreadable_result_does_not_fail_a_wait_on_another(
        record: bytes, producer: Celery, worker_side: Celery,
        redis_client: redis.Redis) -> None:
    """The read after a subscription meets every subscribed result's record: a junk one
    (another program's) is its own waiter's to be told of, not this one's."""
    junk, waited = producer.AsyncResult(str(uuid.uuid4())), producer.AsyncResult(
        str(uuid.uuid4()))
    junk.then(lambda res: None)  # subscribed, not waited on
    redis_client.set(worker_side.backend.get_key_for_task(junk.id), record)
    timer = later(1.5 * RECHECK_S, lambda: worker_side.backend.mark_as_done(waited.id, 7))
    assert waited.get(timeout=10) == 7
    timer.join()


def test_a_lost_message_is_found_while_other_results_keep_arriving(
        producer: Celery, worker_side: Celery, redis_client: redis.Redis) -> None:
    """(the second read waited for a quiet second of the whole consumer: a producer
    whose other results kept arriving never made it, and the lost one was waited on for
    ever)"""
    silent = producer.AsyncResult(str(uuid.uuid4()))
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(silent.get(timeout=30)))
    waiter.start()
    key = worker_side.backend.get_key_for_task(silent.id)
    wait_for(lambda: key in producer.backend.result_consumer.subscribed_to, 10,
             "the waiter's subscription")
    timer = later(0.1, store_silently(worker_side, redis_client, silent.id, "found"))
    for i in range(40):  # another result every 0.2 s, until the silent one is had
        if got:
            break
        other = producer.AsyncResult(str(uuid.uuid4()))
        step = later(0.2, lambda o=other, i=i: worker_side.backend.mark_as_done(o.id, i))
        assert other.get(timeout=10) == i
        step.join()
    assert got == ["found"]  # had while the others kept coming (8 s of them)
    waiter.join(timeout=30)
    timer.join()


def test_a_message_lost_across_a_reconnect_is_found(producer: Celery, worker_side: Celery,
                                                    redis_client: redis.Redis) -> None:
    """Celery's reconnect reads the subscribed states, then subscribes again: a result
    published in between was lost for good."""
    result = producer.AsyncResult(str(uuid.uuid4()))
    result.then(lambda res: None)  # subscribed
    consumer = producer.backend.result_consumer
    consumer._unread.clear()  # as if its reads after the subscription were done
    consumer._recheck.clear()
    consumer._reconnect_pubsub()
    timer = later(0.3, store_silently(worker_side, redis_client, result.id, "after"))
    assert result.get(timeout=5 * RECHECK_S + 5) == "after"
    timer.join()


def test_results_dropped_unwaited_leave_nothing_kept(producer: Celery) -> None:
    """A group's members are subscribed as it is made; dropped without a wait, their
    keys were kept in the unread set for good."""
    import gc

    from celery import group

    for _ in range(20):
        group(producer.tasks["rw.echo"].s(f"g{i}") for i in range(10)).apply_async()
    gc.collect()
    consumer = producer.backend.result_consumer
    assert not consumer.subscribed_to
    assert not consumer._unread


def test_subscribing_at_submission_is_celerys_way_when_asked(
        redis_url: str, redis_client: redis.Redis, worker_side: Celery) -> None:
    """``result_subscribe_on_send``: a result whose record expired before the wait is
    still had from its message, as with Celery's consumer."""
    app = make_app(SitsConfig(redis_url=redis_url, result_subscribe_on_send=True),
                   main="test_result_wait_on_send")
    try:
        before = calls(redis_client, "subscribe")
        result = app.send_task("rw.echo", ("x",))
        assert calls(redis_client, "subscribe") == before + 1
        # (its messages come from the submission on: nothing to read back besides)
        assert not app.backend.result_consumer._unread
        worker_side.backend.mark_as_done(result.id, "from its message")
        redis_client.delete(worker_side.backend.get_key_for_task(result.id))  # expired
        assert result.get(timeout=5) == "from its message"
    finally:
        app.close()


def test_a_result_dropped_by_another_thread_mid_read_fails_no_wait(producer: Celery) -> None:
    """``cancel_for`` runs from ``AsyncResult.__del__`` in any thread, without the lock:
    a drop while a waiter went through the unread keys raised "Set changed size during
    iteration" out of its ``get()``."""
    consumer = producer.backend.result_consumer
    dropped = [producer.AsyncResult(str(uuid.uuid4())) for _ in range(3)]
    for result in dropped:
        result.then(lambda res: None)

    class DroppingOnLookup(set):  # type: ignore[type-arg]
        """The subscribed keys, whose every lookup sees another result dropped."""

        def __contains__(self, key: object) -> bool:
            if dropped:
                consumer.cancel_for(dropped.pop().id)
            return super().__contains__(key)

    consumer.subscribed_to = DroppingOnLookup(consumer.subscribed_to)
    assert len(consumer._take_unread()) >= 1


def test_a_second_read_queue_emptied_meanwhile_is_nothing_due(producer: Celery) -> None:
    """(another waiter may take the last entry between the check and the peek)"""
    from collections import deque

    class SaysFull(deque):  # type: ignore[type-arg]
        def __bool__(self) -> bool:
            return True

    consumer = producer.backend.result_consumer
    consumer._recheck = SaysFull()
    assert consumer._take_due() == []


def test_reconnects_while_many_results_are_held_keep_subscribing_cheap(
        producer: Celery) -> None:
    """Each reconnect queues a second read of every subscribed result; past the prune
    mark, a deque of live keys only was rebuilt whole at every later subscription."""
    consumer = producer.backend.result_consumer
    held = [producer.AsyncResult(str(uuid.uuid4())) for _ in range(3000)]
    for result in held:
        result.then(lambda res: None)
    for _ in range(3):
        consumer._reconnect_pubsub()
    rebuilt = 0
    for _ in range(200):
        before = consumer._recheck
        later_one = producer.AsyncResult(str(uuid.uuid4()))
        later_one.then(lambda res: None)
        held.append(later_one)
        rebuilt += consumer._recheck is not before
    assert rebuilt <= 1


def test_a_wait_through_a_redis_outage_ends_at_its_timeout_then_gets_the_result(
        tmp_path: Any) -> None:
    """(Celery's consumer reconnected with twenty tries a second apart: a get(timeout=3)
    went on ~20 s into the outage, then raised "Retry limit exceeded ... the Celery
    application must be restarted", which it need not be)"""
    from celery.exceptions import TimeoutError as CeleryTimeout

    from sits_queue.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    port = server.port
    app = make_app(SitsConfig(redis_url=url), main="result-outage")
    try:
        result = app.AsyncResult("t-outage")
        with pytest.raises(CeleryTimeout):
            result.get(timeout=0.2)  # subscribed, its consumer connected
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                result.get(timeout=3)
            except BaseException as exc:  # (what the wait ended with)
                errors.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        redis.Redis.from_url(url).save()
        server.stop()  # while it waits
        waiter.join(60)
        assert not waiter.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], CeleryTimeout), errors
        # Redis back: the same process gets the result
        server = EmbeddedRedis(tmp_path / "redis", port=port)
        server.start()
        make_app(SitsConfig(redis_url=url), main="result-outage-worker").backend \
            .mark_as_done("t-outage", 7)
        assert result.get(timeout=30) == 7
    finally:
        app.close()
        server.stop()


@pytest.mark.parametrize("subscribed_before", [True, False])
def test_a_wait_that_starts_while_redis_hangs_ends_near_its_timeout(
        tmp_path: Any, subscribed_before: bool) -> None:
    """Redis stopped (SIGSTOP: connections are accepted, nothing is answered, as in a
    partition that drops packets). (The wait's subscription waited out the backend's
    socket timeout, 120 s, and the stored-state read its retries of it: a get(timeout=2)
    was still blocked after 5 minutes.)"""
    import os
    import signal
    import time

    from celery.exceptions import TimeoutError as CeleryTimeout

    from sits_queue.broker.resultwait import WAIT_IO_TIMEOUT_S
    from sits_queue.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    pid = server.pid
    assert pid is not None
    app = make_app(SitsConfig(redis_url=url), main="result-hang")
    result = app.AsyncResult("t-hang")
    try:
        if subscribed_before:
            with pytest.raises(CeleryTimeout):
                result.get(timeout=0.2)  # its consumer connected and subscribed
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(CeleryTimeout):
            result.get(timeout=2)
        # (each of its few calls gives up after WAIT_IO_TIMEOUT_S, 4 s in all here; 120 s
        # each before, for minutes: the bound leaves a loaded host room)
        assert time.monotonic() - started < 2 + 18 * WAIT_IO_TIMEOUT_S
        os.kill(pid, signal.SIGCONT)
        # Redis answering again: the same wait gets the result
        make_app(SitsConfig(redis_url=url), main="result-hang-worker").backend \
            .mark_as_done("t-hang", 9)
        assert result.get(timeout=30) == 9
    finally:
        os.kill(pid, signal.SIGCONT)
        app.close()
        server.stop()
