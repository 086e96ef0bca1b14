"""A freed slot's pick (``Channel._pick_next``), in-process against a real Redis: the
markers are read and the likeliest queue picked in one round trip, and a queue ahead
of it in the consumer's order (the control queue) is still served first."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.connection
from celery import Celery
from kombu import Queue

from sits_queue.app import make_app
from sits_queue.broker.keys import CONTROL_QUEUE, QueueKeys
from sits_queue.config import SitsConfig

WORK, OTHER = "celery", "fp-other"


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    app = make_app(SitsConfig(redis_url=redis_url), main="fast_pick_test")

    @app.task(name="fp.echo", sla_class="low", shared=False)
    def echo(tag: str) -> str:
        return tag

    yield app
    app.close()


class Consumer:
    """A channel consuming the control queue, then ``WORK`` and ``OTHER``, with room for
    ``room`` unacked messages; what it is handed, in order."""

    def __init__(self, app: Celery, room: int) -> None:
        self.conn = app.connection_for_read()
        self.channel: Any = self.conn.default_channel
        self.channel.basic_qos(0, room, False)
        self.got: list[tuple[str, str]] = []
        for name in (CONTROL_QUEUE, WORK, OTHER):
            Queue(name).bind(self.channel).declare()
            self.channel.basic_consume(name, False, self._take(name), consumer_tag=name)
        # past the once-a-second sweep, which picks every queue whatever its marker says
        self.channel._sweep_due = time.monotonic() + 60

    def _take(self, queue: str) -> Any:
        def take(message: Any) -> None:
            self.got.append((queue, message.payload[0][0]))
        return take

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.release()


def send(app: Celery, queue: str, tag: str) -> None:
    app.tasks["fp.echo"].apply_async((tag,), queue=queue)


def round_trips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every write to Redis from here on (a pipeline is one)."""
    writes = [0]
    real = redis.connection.AbstractConnection.send_packed_command

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        writes[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    return writes


def test_a_freed_slot_reads_the_markers_and_picks_in_one_round_trip(
        app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    with Consumer(app, room=1) as consumer:
        for tag in ("a", "b"):
            send(app, WORK, tag)
        order = consumer.channel._control_first()
        assert order[0] == CONTROL_QUEUE
        # Given the consumer has seen WORK marked (its last look), as a busy worker has
        consumer.channel._seen_marked = {WORK}
        consumer.channel.raw.time()  # (the clock offset measured before counting)
        writes = round_trips(monkeypatch)
        # When its slot frees
        assert consumer.channel._fast_pick() is True
        # Then the best message came in one round trip: markers and pick together
        assert consumer.got == [(WORK, "a")]
        assert writes[0] == 1
        assert redis_client.zcard(QueueKeys.for_queue(WORK).waiting) == 1


def test_a_guess_that_finds_its_queue_empty_still_serves_the_marked_one(
        app: Celery, redis_client: redis.Redis) -> None:
    with Consumer(app, room=1) as consumer:
        send(app, OTHER, "o")
        consumer.channel._seen_marked = {WORK}  # stale: WORK is empty now
        assert consumer.channel._fast_pick() is True
        assert consumer.got == [(OTHER, "o")]
        # and the next look guesses the queue it found marked
        assert OTHER in consumer.channel._seen_marked


def test_the_control_queue_ahead_is_served_first_and_the_early_pick_goes_back(
        app: Celery, redis_client: redis.Redis) -> None:
    keys = QueueKeys.for_queue(WORK)
    with Consumer(app, room=1) as consumer:
        send(app, WORK, "work")
        score = redis_client.zrange(keys.waiting, 0, -1, withscores=True)[0][1]
        send(app, CONTROL_QUEUE, "pass")
        consumer.channel._seen_marked = {WORK}
        # When a slot frees with a control message waiting too
        assert consumer.channel._fast_pick() is True
        # Then the control message goes first; the work message the same round trip
        # took is waiting again, at its score, held by nobody, no redelivery counted
        assert consumer.got == [(CONTROL_QUEUE, "pass")]
        waiting = redis_client.zrange(keys.waiting, 0, -1, withscores=True)
        assert len(waiting) == 1 and waiting[0][1] == score
        assert redis_client.zcard(keys.unacked) == 0
        assert redis_client.hlen(keys.redelivered) == 0
        assert redis_client.zcard(keys.marker) == 1
        # and it is the next pick, by this consumer as well (the release held it off none)
        consumer.channel.qos.ack(next(iter(consumer.channel.qos._delivered)))
        assert consumer.channel._fast_pick() is True
        assert consumer.got[-1] == (WORK, "work")


def test_with_room_for_both_the_control_message_and_the_early_pick_are_delivered(
        app: Celery, redis_client: redis.Redis) -> None:
    with Consumer(app, room=2) as consumer:
        send(app, WORK, "work")
        send(app, CONTROL_QUEUE, "pass")
        consumer.channel._seen_marked = {WORK}
        assert consumer.channel._fast_pick() is True
        assert consumer.got == [(CONTROL_QUEUE, "pass"), (WORK, "work")]
        assert redis_client.zcard(QueueKeys.for_queue(WORK).unacked) == 1


def test_an_early_pick_redis_refuses_leaves_that_queue_and_serves_the_others(
        app: Celery, redis_client: redis.Redis) -> None:
    with Consumer(app, room=1) as consumer:
        send(app, OTHER, "o")
        # Given WORK's payloads key of another type (pick.lua refuses to touch it)
        redis_client.set(QueueKeys.for_queue(WORK).payloads, "not a hash")
        consumer.channel._seen_marked = {WORK}
        assert consumer.channel._fast_pick() is True
        assert consumer.got == [(OTHER, "o")]
        assert WORK in consumer.channel._refused_until


@contextlib.contextmanager
def looped(app: Celery) -> Iterator[tuple[Any, Any, list[Any]]]:
    """A consumer of ``WORK`` with room for one, on a real kombu event loop (a hub): the
    hub, the channel and what it is handed, in order."""
    from kombu.asynchronous import Hub

    hub = Hub()
    got: list[Any] = []
    with app.connection_for_read() as conn:
        conn.register_with_event_loop(hub)
        channel: Any = conn.default_channel
        channel.basic_qos(0, 1, False)
        Queue(WORK).bind(channel).declare()
        channel.basic_consume(WORK, False, got.append, consumer_tag="work")
        try:
            yield hub, channel, got
        finally:
            hub.close()


def test_an_ack_in_the_event_loop_picks_the_freed_slots_next_task_at_once(
        app: Celery, redis_client: redis.Redis) -> None:
    """(``QoS.ack`` -> ``Channel.pick_for_freed_slot``: the pick waited for the loop's
    next turn, after the ack's own write and the rest of that turn)"""
    with looped(app) as (hub, channel, got):
        for tag in ("a", "b"):
            send(app, WORK, tag)
        loop = hub.create_loop()  # (this thread is the loop's, as a worker's main thread)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            next(loop)
        assert [m.payload[0][0] for m in got] == ["a"]
        # When the task's message is acked in the loop, as Celery acks it
        got[0].ack()
        # Then the next one is delivered before the loop turns again
        assert [m.payload[0][0] for m in got] == ["a", "b"]
        # and the ack reached Redis: the first is gone, the second held
        keys = QueueKeys.for_queue(WORK)
        channel._deferred.settle()
        assert redis_client.zcard(keys.unacked) == 1
        assert redis_client.zcard(keys.waiting) == 0
        # An ack from another thread leaves the pick to the loop (its turn picks)
        import threading
        ack = threading.Thread(target=got[1].ack)
        ack.start()
        ack.join()
        assert len(got) == 2


def test_a_consumer_holding_off_given_back_messages_picks_a_new_one_at_its_pause_end(
        app: Celery, redis_client: redis.Redis) -> None:
    """(with only messages it gave back and holds off waiting, a consumer pauses and looks
    again when the pause ends (``Channel._paused``): the pause's timer, added in a tick
    callback, was not in that turn's poll timeout, so the loop slept on to its next
    older timer, and a task put meanwhile waited for it: ~0.5 s, up to 1 s, where the
    pause is 0.25)"""
    with looped(app) as (hub, channel, got):
        send(app, WORK, "given back")
        loop = hub.create_loop()
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            next(loop)
        # Given the one message given back, held off from this consumer for a minute
        channel.qos.release(got.pop().delivery_tag, first_hold_s=60, longest_hold_s=60)
        while channel._held_pause_until <= time.monotonic() and time.monotonic() < deadline:
            next(loop)  # (its next pick finds only that one: the consumer pauses)
        # When a task is put while it pauses, and the loop's next timer is far off
        sentinel: list[str] = []
        hub.call_later(0.9, lambda: sentinel.append("loop slept to its older timer"))
        send(app, WORK, "new")
        while not got and not sentinel and time.monotonic() < deadline:
            next(loop)
        # Then it is picked when the pause ends, before that timer
        assert [m.payload[0][0] for m in got] == ["new"] and not sentinel
