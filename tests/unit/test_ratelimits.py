"""The rate-limit hold (``workers/ratelimits.py``) on Celery's own bucket scheduling, with
a stand-in consumer: a request waiting for a token is out of the prefetch count until
it moves to the pool, and the event loop is woken once the next look at the bucket is
set."""

from __future__ import annotations

from typing import Any

import pytest
from celery.worker.consumer.consumer import Consumer
from kombu.common import QoS
from kombu.utils.limits import TokenBucket

from sits_queue.workers.ratelimits import RateLimitHold


class Transport:
    def __init__(self) -> None:
        self.wakes = 0

    def wake_hub(self) -> None:
        self.wakes += 1


class Timer:
    def __init__(self) -> None:
        self.entries: list[tuple[float, Any, tuple[Any, ...]]] = []

    def call_after(self, secs: float, fun: Any, args: tuple[Any, ...] = (),
                   priority: int = 0) -> None:
        self.entries.append((secs, fun, args))


class StandIn:
    """What Celery's bucket methods use of a consumer; they are Celery's own."""

    _limit_order = 0
    _schedule_bucket_request = Consumer._schedule_bucket_request
    _limit_task = Consumer._limit_task
    _limit_post_eta = Consumer._limit_post_eta

    #: A pool of two: two requests of a type may wait for tokens.
    initial_prefetch_count = 2
    app = type("App", (), {"timezone": "UTC"})()

    def __init__(self) -> None:
        self.qos = QoS(lambda prefetch_count: None, 1)
        self.timer = Timer()
        self.connection = type("Connection", (), {"transport": Transport()})()
        self.moved: list[str] = []

    def _limit_move_to_pool(self, request: str) -> None:
        self.moved.append(request)


def test_a_request_waiting_for_a_token_is_out_of_the_prefetch_count() -> None:
    c = StandIn()
    RateLimitHold(c)
    bucket = TokenBucket(fill_rate=1 / 3600, capacity=1)
    c._limit_task("first", bucket, 1)  # the bucket's one token: to the pool at once
    assert c.moved == ["first"] and c.qos.value == 1
    c._limit_task("second", bucket, 1)  # waits an hour
    c._limit_task("third", bucket, 1)
    assert c.moved == ["first"] and c.qos.value == 3  # room for two more messages
    bucket._tokens = 1  # (a token frees)
    _, look_again, args = c.timer.entries[-1]
    look_again(*args)
    assert c.moved == ["first", "second"] and c.qos.value == 2


def test_a_due_eta_request_keeps_its_place_out_of_the_count_while_it_waits() -> None:
    """(Celery's own gives the ETA's back as it enters the bucket)"""
    c = StandIn()
    RateLimitHold(c)
    bucket = TokenBucket(fill_rate=1 / 3600, capacity=1)
    c._limit_task("first", bucket, 1)
    c.qos.increment_eventually()  # what the strategy does for a request with an ETA
    c._limit_post_eta("due", bucket, 1)
    assert c.qos.value == 2
    bucket._tokens = 1
    _, look_again, args = c.timer.entries[-1]
    look_again(*args)
    assert c.moved == ["first", "due"] and c.qos.value == 1


def test_the_event_loop_is_woken_once_the_next_look_is_set() -> None:
    """(its sleep was computed before: with no pool pipes to wake it, a solo worker slept
    up to a second past each token, and '10/s' ran at about 2/s)"""
    c = StandIn()
    RateLimitHold(c)
    bucket = TokenBucket(fill_rate=10, capacity=1)
    c._limit_task("first", bucket, 1)
    c._limit_task("second", bucket, 1)
    assert c.connection.transport.wakes == 2
    assert c.timer.entries[-1][1] == c._schedule_bucket_request  # wakes again next time


class Released:
    """A request as ``request._give_back`` uses it: its message's QoS records releases."""

    def __init__(self, name: str) -> None:
        self.id, self.acknowledged, self.released = name, False, []
        qos = type("QoS", (), {"release": lambda _, tag, *hold: self.released.append(
            (tag, *hold)) or (hold[0] if hold else 0.0)})()
        self.message = type("Message", (), {"channel": type("C", (), {"qos": qos})(),
                                            "delivery_tag": name, "_state": "RECEIVED"})()

    def send_event(self, *args: Any, **kwargs: Any) -> None:
        return None

    def revoked(self) -> bool:
        return False


def full_bucket() -> tuple[StandIn, TokenBucket]:
    """A stand-in consumer whose '1/h' bucket ran one request on its token and holds as
    many waiting as its pool runs (two)."""
    c = StandIn()
    RateLimitHold(c)
    bucket = TokenBucket(fill_rate=1 / 3600, capacity=1)
    c._limit_task("first", bucket, 1)  # its token: to the pool at once
    c._limit_task("second", bucket, 1)
    c._limit_task("third", bucket, 1)  # two wait: the pool's size
    return c, bucket


def test_no_more_of_a_type_wait_than_the_pool_runs_the_rest_go_back() -> None:
    """(every waiting rate-limited task was taken into the bucket: an idle worker beside
    this one got none, and an urgent task ran behind them all)"""
    from sits_queue.workers.ratelimits import MAX_TOKEN_HOLD_S

    c, bucket = full_bucket()
    fourth = Released("fourth")
    c._limit_task(fourth, bucket, 1)
    assert len(bucket.contents) == 2 and c.qos.value == 3  # not counted out
    # held off from this worker until its bucket's next token (an hour: the longest)
    assert fourth.released == [("fourth", MAX_TOKEN_HOLD_S, MAX_TOKEN_HOLD_S)]
    assert fourth.acknowledged and fourth.message._state == "REQUEUED"


def test_a_message_given_back_is_held_until_the_next_token_not_a_backoff() -> None:
    """(held on the VRAM refusals' backoff, 0.25 s doubling to 4 s, a backlog of '10/s'
    tasks ran at about one per 4 s per pool slot)"""
    from sits_queue.workers.ratelimits import MIN_TOKEN_HOLD_S, token_hold

    c = StandIn()
    RateLimitHold(c)
    bucket = TokenBucket(fill_rate=10, capacity=1)
    c._limit_task("first", bucket, 1)  # its token: to the pool
    c._limit_task("second", bucket, 1)
    c._limit_task("third", bucket, 1)  # two wait for the next tokens
    given = [Released(f"later {i}") for i in range(3)]
    for request in given:
        c._limit_task(request, bucket, 1)
    # Each is held off for about the time to the next token (0.1 s at 10/s), each the same
    holds = [r.released[0][1:] for r in given]
    assert all(first == longest for first, longest in holds)
    assert all(MIN_TOKEN_HOLD_S <= first <= 0.1 + 1e-6 for first, _ in holds)
    assert token_hold(TokenBucket(fill_rate=1000, capacity=1)) == MIN_TOKEN_HOLD_S
    assert token_hold(object()) == pytest.approx(MIN_TOKEN_HOLD_S)


def test_a_consumer_finding_only_its_held_messages_looks_again_when_a_hold_ends() -> None:
    """(it always paused 0.25 s: a message given back until its bucket's next token came
    back up to 0.25 s late, and '10/s' ran at about 7.5/s on one slot)"""
    import time

    from sits_queue.broker.picking import HELD_PAUSE_S, HOLD_END_MARGIN_S
    from sits_queue.broker.transport import Channel

    channel = type("Held", (), {"_hold_ends": []})()
    assert Channel._held_pause_s(channel) == HELD_PAUSE_S  # none of its own: the usual
    Channel.note_hold(channel, 0.08)
    Channel.note_hold(channel, 0.05)
    Channel.note_hold(channel, 0.0)  # (no hold: nothing to wait for)
    pause = Channel._held_pause_s(channel)
    assert 0.0 < pause <= 0.05 + HOLD_END_MARGIN_S
    Channel.note_hold(channel, 10.0)  # a long one: looked at again within the usual
    channel._hold_ends = [time.monotonic() - 1.0, time.monotonic() + 10.0]
    assert Channel._held_pause_s(channel) == HELD_PAUSE_S
    assert len(channel._hold_ends) == 1  # the one that ran out is forgotten


def test_a_due_eta_request_goes_back_when_its_bucket_is_full_or_it_waited_here() -> None:
    """(the ETA's entered the bucket whatever its size: a worker kept every countdown
    task of a '1/h' type for hours while another worker stood idle)"""
    import time
    from datetime import UTC, datetime

    from sits_queue.workers.ratelimits import MAX_TOKEN_HOLD_S

    c, bucket = full_bucket()
    late = Released("late")  # picked when due, its bucket full: back, held to the token
    late.eta, late.utc = datetime.now(UTC), True
    late.message.picked_at = time.monotonic() + 1
    c.qos.increment_eventually()  # what the strategy does for a request with an ETA
    c._limit_post_eta(late, bucket, 1)
    assert late.released == [("late", MAX_TOKEN_HOLD_S, MAX_TOKEN_HOLD_S)]
    assert len(bucket.contents) == 2 and c.qos.value == 3  # its count out given back
    # one that waited here for its ETA takes its turn in the queue, room or not
    c2 = StandIn()
    RateLimitHold(c2)
    early = Released("early")
    early.eta, early.utc = datetime.now(UTC), True
    early.message.picked_at = time.monotonic() - 5
    c2.qos.increment_eventually()
    c2._limit_post_eta(early, TokenBucket(fill_rate=1 / 3600, capacity=1), 1)
    assert early.released == [("early",)] and c2.qos.value == 1
