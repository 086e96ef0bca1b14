"""Tasks with a ``rate_limit`` wait for their token without holding the worker's intake.

Celery keeps a request whose task type is out of tokens in the consumer, in that type's
token bucket, its message unacked, until a token frees. SITS's default of no prefetch
(``worker_disable_prefetch``, prefetch multiplier 1: exact priority) sets the channel's
prefetch count to the pool size, and requests waiting for tokens took it up: a two-slot
worker with two ``'6/m'`` tasks waiting took nothing else, from any queue, for the
minute (and a one-slot CPU worker, one ``'1/h'`` task for the hour). Celery counts a
task waiting for its ETA out of the prefetch count (``qos.increment_eventually``); this
step does the same for a request waiting for a token, from when it enters the bucket
until Celery moves it to the pool.

At most as many of one task type wait in the worker as its pool runs at once; the
rest are given back to the queue, for another worker, or for this one once its bucket
has taken the next token (:func:`token_hold`: held off from this worker until then, not
longer: held on the VRAM refusals' backoff, 0.25 s doubling to 4 s, a backlog at
``'10/s'`` ran at about one task per 4 s per slot).

It also wakes the event loop once Celery has set its next look at a bucket: that is a
timer entry added after the loop computed how long to sleep, and with nothing else to
wake it (a solo pool has no children's pipes) the loop slept up to a second past each
token: ``rate_limit="10/s"`` ran at about 2/s on ``--pool=solo``.
"""

from __future__ import annotations

import math
from typing import Any

from celery import bootsteps

from sits_queue.workers import request as admission
from sits_queue.workers.held import consumed, give_back_due, picked_early, resumed

#: Bounds of the hold of a rate-limited message given back, s: not a busy loop of
#: picks while tokens come faster than this; not so long that a slow rate's next token
#: (an hour at '1/h') keeps it from this worker past a change of its rate.
MIN_TOKEN_HOLD_S = 0.02
MAX_TOKEN_HOLD_S = 60.0


def token_hold(bucket: Any) -> float:
    """How long a message given back because ``bucket`` is full is held off from this
    worker, s: until the bucket's next token, when the request waiting first moves on
    and there is room again."""
    try:
        wait = float(bucket.expected_time(1))
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        wait = MIN_TOKEN_HOLD_S
    if not math.isfinite(wait):
        wait = MAX_TOKEN_HOLD_S
    return min(MAX_TOKEN_HOLD_S, max(MIN_TOKEN_HOLD_S, wait))


def most_waiting(c: Any) -> int:
    """How many requests of one task type may wait here for tokens: the pool's size (the
    consumer's prefetch count, SITS's multiplier being 1)."""
    try:
        return max(1, int(getattr(c, "initial_prefetch_count", 0) or 1))
    except (TypeError, ValueError):
        return 1


class RateLimitHold(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer step: a request waiting in a rate-limit bucket is out of the prefetch
    count, as one waiting for its ETA is."""

    name = "SITS rate-limit hold"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        # Requests (by identity) counted out: the bucket holds each one until it moves
        # to the pool, so an id is not reused meanwhile.
        self.held: set[int] = set()
        # Those of them said in Redis not to have started (:meth:`_waits`).
        self.unstarted: set[int] = set()
        # Set now, before the Tasks step builds the strategies, which bind the first
        # two; Celery's own bucket scheduling calls the other two on the consumer.
        move = c._limit_move_to_pool

        def limit_task(request: Any, bucket: Any, tokens: int) -> Any:
            if resumed(request):  # (its run took its token: it goes on as it was)
                return move(request)
            if len(getattr(bucket, "contents", ())) >= most_waiting(c):
                # As many of its type wait here as the pool runs at once: the rest wait
                # in the queue, at their priority, for another worker or for this one
                # later (counted out, they were all taken in: an idle worker beside it
                # got none, and an urgent task arriving later ran behind them all)
                hold = token_hold(bucket)  # (the same each time: no backoff)
                admission._give_back(request, (hold, hold))
                return None
            self.held.add(id(request))
            c.qos.increment_eventually()
            bucket.add((request, tokens))
            return self._waits(request, bucket, c._schedule_bucket_request(bucket))

        def limit_post_eta(request: Any, bucket: Any, tokens: int) -> Any:
            if resumed(request):
                c.qos.decrement_eventually()  # (the count out of its wait for the ETA)
                return move(request)
            full = len(getattr(bucket, "contents", ())) >= most_waiting(c)
            if consumed(request) and (full or picked_early(request, c.app.timezone)):
                # Due after waiting here: it takes its turn in the queue, as a task
                # without a rate limit does (etaorder.py), and no more of its type wait
                # here than the pool runs at once (limit_task's rule). (Into the bucket
                # whatever its size, a worker kept every countdown task of a '1/h' type
                # for hours while another worker stood idle.)
                give_back_due(c, request, token_hold(bucket) if full else None)
                return None
            # (one of a queue this worker no longer consumes waits for its token here, as
            # Celery's does: given back, perhaps no worker would take it)
            # Its ETA was due when picked: the count out it had while waiting for the
            # ETA carries over to its wait for a token (Celery's own gives it back here).
            self.held.add(id(request))
            bucket.add((request, tokens))
            return self._waits(request, bucket, c._schedule_bucket_request(bucket))

        def move_to_pool(request: Any) -> Any:
            if id(request) in self.held:
                self.held.discard(id(request))
                c.qos.decrement_eventually()
            if id(request) in self.unstarted:  # (before it starts: a crash then counts)
                self.unstarted.discard(id(request))
                _note_unstarted(request, False)
            return move(request)

        schedule = c._schedule_bucket_request

        def schedule_and_wake(bucket: Any) -> None:
            schedule(bucket)
            wake = getattr(getattr(c.connection, "transport", None), "wake_hub", None)
            if wake is not None:
                wake()

        c._limit_task = limit_task
        c._limit_post_eta = limit_post_eta
        c._limit_move_to_pool = move_to_pool
        c._schedule_bucket_request = schedule_and_wake

    def _waits(self, request: Any, bucket: Any, scheduled: Any) -> Any:
        """After Celery's look at ``bucket``: a request still in it waits here for a
        token, not started, and says so in Redis. A worker that dies meanwhile then
        costs it no redelivery (at ``'1/h'`` it may wait an hour; counted, a few
        crashes of its workers dead-lettered as poison a task that never ran)."""
        if any(waiting is request for waiting, *_ in getattr(bucket, "contents", ())):
            self.unstarted.add(id(request))
            _note_unstarted(request, True)
        return scheduled

    def start(self, c: Any) -> None:
        # A new connection: Celery dropped the buckets' requests (their messages come
        # back by the unacked sweep) and counts the prefetch afresh.
        self.held.clear()
        self.unstarted.clear()


def _note_unstarted(request: Any, unstarted: bool) -> None:
    """Tell the SITS transport's QoS (another transport's has no such record)."""
    message = getattr(request, "message", None)
    qos = getattr(getattr(message, "channel", None), "qos", None)
    note = getattr(qos, "note_unstarted", None)
    if callable(note) and message is not None:
        note(message.delivery_tag, unstarted)
