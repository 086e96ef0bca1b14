"""Time slices (MISSION §1.4): a long task steps aside for more urgent work, and resumes.

Celery runs a task to completion on its pool slot, so under load an urgent task waits
for some slot's current task to end: on a busy worker its wait is the shortest
remaining run time of the running tasks, whatever the broker's order. A task that calls
``self.yield_point(state)`` between steps (a batch item, a decode chunk) lets its slot go
instead: once it has run ``slice_ms``, if the best waiting task in its queue belongs to
a class of higher weight and has waited ``yield_wait_ms`` (so that a slot freeing on its
own gets it first; ``yield_rank_wait_ms`` more per class below the task's own, when set,
so that the lowest running class yields first), the task saves ``state`` and raises
:class:`Preempted`. The worker
puts the message back at the score it had (``release.lua``: no redelivery counted, no
priority lost); when it runs again, ``self.checkpoint`` returns the saved state.

Cost while nothing urgent arrives: ``put.lua`` announces each put's classes on a
pub/sub channel and a yield point only reads that subscription without blocking
(microseconds); the broker is asked (``preempt.lua``, which also makes sure only one
running task yields per waiting task) only after an announcement of an outranking
class, or every ``RECHECK_S`` in case one was missed.

Everything here runs in the pool child.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
from billiard.einfo import ExceptionInfo, ExceptionWithTraceback
from celery import signals
from celery.app import trace as celery_trace
from celery.exceptions import Ignore, Reject

from sits_queue.broker import clock
from sits_queue.broker.keys import CHECKPOINT_HEADER, DELIVERY_HEADER, QueueKeys
from sits_queue.broker.scripts import Scripts
from sits_queue.config import SitsConfig
from sits_queue.options import HEADER

logger = logging.getLogger(__name__)

#: Ask the broker at least this often while a task is past its slice, s: a missed
#: announcement (a reconnect) or a claim whose yielder died costs at most this much.
RECHECK_S = 0.2
#: While an urgent task has not waited long enough yet (:func:`least_wait_s`), ask again
#: this often, s.
RETRY_S = 0.002
#: A claim to yield for a waiting task stands this long, s: others do not yield for the
#: same task meanwhile; a claimer that died is forgotten after it.
CLAIM_S = 1.0
#: After a Redis error at a yield point, how long yield points ask nothing, s: each ask
#: of a Redis that is down failed in a connect (a warning each: ~50 lines a second from
#: a task of 20 ms steps), and of one that hangs blocked the task up to the socket's
#: timeout, at every yield point.
AWAY_S = 5.0
#: A state whose JSON is longer than this, bytes, is no longer sent with each ask (it is
#: kept only once a yield is granted, a round trip more): a task that carries its results
#: so far re-serialised and re-sent megabytes every 0.2 s, and every 2 ms while an urgent
#: task's wait ran, to yield perhaps never (20 MB: 2x the task's own work).
INLINE_STATE_BYTES = 64 * 1024
#: What ``preempt.lua`` is given instead of the state then (no JSON text is empty).
DEFERRED_STATE = ""
#: Runs remembered as such per child; forgotten past it (each is serialised once more).
_MOST_DEFERRED = 4096


class Preempted(Reject, Ignore):  # type: ignore[misc]
    """Raised by ``yield_point``: the worker puts the message back, to run again later.

    Also an ``Ignore``, which Celery's ``autoretry_for`` wrapper re-raises before it looks
    at the task's exception list: with ``autoretry_for=(Exception,)`` a yield would turn
    into a retry (progress lost, a retry used up). The tracer takes it as a ``Reject``
    (it checks that first). User code must not catch it (``except Exception``)."""

    def __init__(self, reason: str, requeue: bool = True) -> None:
        # (reason, requeue): the signature Exception pickling replays in the parent.
        super().__init__(reason, requeue)


@dataclass(frozen=True)
class Running:
    """What a yield point knows about the task it runs in."""

    queue: str
    message_id: str
    sla_class: str
    started: float  # monotonic s


def running_from(request: Any, started: float) -> Running | None:
    """The running task's queue, message id and class, from its headers; None when it was
    not delivered by the SITS transport (eager call, another broker) or has no class."""
    delivery = getattr(request, DELIVERY_HEADER, None)
    header = getattr(request, HEADER, None)
    if (not isinstance(delivery, (list, tuple)) or len(delivery) != 2
            or not isinstance(header, Mapping)):
        return None
    queue, message_id = delivery
    sla_class = header.get("sla_class")
    if not (isinstance(queue, str) and isinstance(message_id, str)
            and isinstance(sla_class, str)):
        return None
    return Running(queue, message_id, sla_class, started)


def checkpoint_of(request: Any) -> Any:
    """The state saved at the task's last yield (``pick.lua`` hands it over in a header),
    or None on a first run."""
    raw = getattr(request, CHECKPOINT_HEADER, None)
    if not isinstance(raw, (str, bytes)):
        return None
    try:
        return json.loads(raw)
    except ValueError:  # not ours (a foreign producer's header): a first run, not a crash
        logger.warning("checkpoint header is not JSON, starting over: %.200r", raw)
        return None


class _FramelessYields(ExceptionInfo):  # type: ignore[misc]
    """billiard's ``ExceptionInfo``, built without the traceback's frames for a yield.

    Celery's tracer builds two of them for every ``Reject`` it catches (its result, which
    goes back to the parent, and its log record), and billiard copies each frame's code
    positions into each: the tracer's own frame alone is 2,341 positions, ~0.2 ms a copy
    here, ~32 KB pickled, and the traceback text walks them again. That was ~1.1 ms of a
    pool child's time per yield, its slot idle (2.5 ms from the raise to the task's
    postrun, against 0.8 for a task that ended). For a yield the parent reads only the
    exception (``SitsRequest``), so for :class:`Preempted` only the exception and its
    one-line text are kept; anything else is billiard's as it was. Installed as the name
    Celery's tracer module calls (a subclass: ``isinstance`` checks still hold).
    """

    def __init__(self, exc_info: Any = None, internal: bool = False) -> None:
        exc_type, exc, tb = exc_info or sys.exc_info()
        if not isinstance(exc, Preempted):
            super().__init__((exc_type, exc, tb), internal)
            return
        self.type, self.tb, self.internal = exc_type, None, internal
        self.traceback = "".join(traceback.format_exception_only(exc_type, exc))
        self.exception = ExceptionWithTraceback(exc, self.traceback)


celery_trace.ExceptionInfo = _FramelessYields


def state_json(state: Any) -> str:
    """``state`` as the JSON kept for the next run; a clear error when it is not JSON data."""
    try:
        return json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"yield_point state must be JSON data (dicts, lists, str, numbers, "
                        f"bool, None): {exc}") from exc


def past_slice(running: Running, now: float, slice_s: float) -> bool:
    """Whether ``running`` has run its slice (``SitsConfig.slice_s`` of its class) by
    ``now``."""
    return now - running.started >= slice_s


def least_wait_s(config: SitsConfig, sla_class: str) -> float:
    """How long an urgent task must have waited before a running task of ``sla_class``
    yields for it: ``yield_wait_ms``, plus ``yield_rank_wait_ms`` per class of lower
    weight than the runner's. ``preempt.lua`` grants the yield to the first runner that
    asks, and every runner asks at its next yield point after the put's announcement:
    a medium task may give its slot to a high one while a low task runs beside it. With
    the extra wait set, the low one, asking within it, is the one that yields."""
    weight = config.quota(sla_class).weight
    below = sum(1 for c in config.classes if c.weight < weight)
    return (config.yield_wait_ms + below * config.yield_rank_wait_ms) / 1000


class Slicer:
    """One per pool child: the subscription to put announcements and the broker calls."""

    def __init__(self, config: SitsConfig, client: redis.Redis | None = None) -> None:
        self.config = config
        self.client = client or redis.Redis.from_url(config.redis_url, socket_timeout=2)
        self.scripts = Scripts.register()
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call, unused-ignore]
        self._subscribed: set[str] = set()
        self._next_check = 0.0
        self._keys: dict[str, QueueKeys] = {}
        #: Message ids of the runs whose state grew past INLINE_STATE_BYTES.
        self._deferred: set[str] = set()
        #: Per class, what a yield point needs of the configuration (:meth:`_plan`).
        self._plans: dict[str, tuple[str, tuple[str, ...], float]] = {}
        #: Until when (monotonic) yield points ask nothing, Redis having failed; and
        #: whether that outage was said (once, at its first error).
        self._away_until = 0.0
        self._away_said = False

    # -- the task's view --------------------------------------------------------------
    def claim(self, running: Running, now: float, state: Any) -> bool:
        """True when this task should give its slot up now. The yield is then claimed and
        ``state`` kept as the task's checkpoint, in one step (``preempt.lua``); for a
        state past :data:`INLINE_STATE_BYTES`, once the claim is granted.

        The checkpoint is kept even when ``state`` is None: a waiting task with one is a
        resumption, and ``preempt.lua`` lets no one yield for it (else one urgent arrival
        would cascade: high displaces medium, medium displaces low).

        With Redis unreachable the task runs on: False, said once per outage (a
        warning), and nothing asked for :data:`AWAY_S` after each error.
        """
        plan = self._plans.get(running.sla_class)
        if plan is None:
            plan = self._plans[running.sla_class] = self._plan(running.sla_class)
        runs_as, outranking, slice_s = plan
        if not outranking or not past_slice(running, now, slice_s) or now < self._away_until:
            return False
        try:
            granted = self._claim(running, now, state, runs_as, outranking)
        except redis.RedisError as exc:
            # Yielding is an optimisation: with Redis unreachable the task runs on (a
            # yield whose checkpoint could not be saved would lose its progress).
            self._away_until = now + AWAY_S
            if not self._away_said:
                self._away_said = True
                logger.warning("yield point skipped: %s (yield points ask again every "
                               "%g s until Redis answers)", exc, AWAY_S)
            else:
                logger.debug("yield point skipped: %s", exc)
            return False
        if self._away_said:
            self._away_said = False
            logger.info("yield points reach Redis again")
        return granted

    def _claim(self, running: Running, now: float, state: Any, runs_as: str,
               outranking: tuple[str, ...]) -> bool:
        keys = self.keys(running.queue)
        self._listen(keys)
        if self._heard(outranking):
            self._next_check = 0.0  # something urgent was put: ask now
        if now < self._next_check:
            return False
        deferred = running.message_id in self._deferred
        inline = DEFERRED_STATE if deferred else state_json(state)
        if len(inline) > INLINE_STATE_BYTES:  # (sent this once: it is made)
            if len(self._deferred) >= _MOST_DEFERRED:  # (runs that ended unyielded)
                self._deferred.clear()
            self._deferred.add(running.message_id)
        verdict = self.scripts.run("preempt", keys, [
            running.message_id, clock.now(self.client), least_wait_s(self.config, runs_as), CLAIM_S,
            inline, *outranking], self.client)
        if verdict == b"wait" or verdict == "wait":
            self._next_check = now + RETRY_S
            return False
        self._next_check = now + RECHECK_S
        if verdict and deferred:
            self._keep(keys, running.message_id, verdict, state)
        if verdict:
            self._deferred.discard(running.message_id)
        return bool(verdict)

    def _plan(self, sla_class: str) -> tuple[str, tuple[str, ...], float]:
        """(the class it runs as, the classes it yields to, its slice, s): read from the
        configuration once per class, not at every yield point (~25,000 of them in a run
        of ``bench ab``; 8.4 -> 5.8 us a call in a hot loop). A class this worker does
        not know (a foreign header) runs as the default one, as runtime.task_class runs
        it: outranking() would raise."""
        known = sla_class in self.config.class_names
        runs_as = sla_class if known else self.config.default_class
        return runs_as, self.config.outranking(runs_as), self.config.slice_s(sla_class)

    def _keep(self, keys: QueueKeys, message_id: str, claimed: Any, state: Any) -> None:
        """Keep the state of a granted yield whose state was not sent with the ask.
        Before the task raises: the message goes back (and its checkpoint is read) only
        after. A state that is no JSON data any more gives the claim up first, so that
        another runner may yield for the urgent task at once, not CLAIM_S later."""
        try:
            payload = state_json(state)
        except TypeError:
            self.client.hdel(keys.yields, claimed)
            self._deferred.discard(message_id)
            raise
        self.client.hset(keys.checkpoints, message_id, payload)

    def keys(self, queue: str) -> QueueKeys:
        k = self._keys.get(queue)
        if k is None:
            k = self._keys[queue] = QueueKeys.for_queue(queue, self.config.global_keyprefix)
        return k

    # -- announcements ----------------------------------------------------------------
    def _listen(self, keys: QueueKeys) -> None:
        if keys.put_channel not in self._subscribed:
            self.pubsub.subscribe(keys.put_channel)
            self._subscribed.add(keys.put_channel)
            self._next_check = 0.0  # announcements before now were missed: ask once

    def _heard(self, outranking: tuple[str, ...]) -> bool:
        """Drain the announcements without blocking; True if one named an outranking class."""
        heard = False
        try:
            while (message := self.pubsub.get_message(timeout=0.0)) is not None:
                data = message.get("data")
                cls = data.decode() if isinstance(data, bytes) else data
                heard = heard or cls in outranking
        except redis.ConnectionError:
            # Resubscribed on the next use; RECHECK_S covers the gap.
            self._subscribed.clear()
            self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call, unused-ignore]
        return heard


_slicers: dict[tuple[int, int], Slicer] = {}


def slicer_for(config: SitsConfig) -> Slicer:
    """The pool child's slicer (by pid: a forked child must not share its parent's)."""
    key = (os.getpid(), id(config))
    slicer = _slicers.get(key)
    if slicer is None:
        slicer = _slicers[key] = Slicer(config)
    return slicer


def _note_start(task_id: str | None = None, **_: Any) -> None:
    if task_id is not None:
        _starts[task_id] = time.monotonic()


def _forget(task_id: str | None = None, **_: Any) -> None:
    if task_id is not None:
        _starts.pop(task_id, None)


class _QuietYields(logging.Filter):
    """Celery's tracer logs every ``Reject`` as a warning with its traceback; a yield is
    routine (the worker logs one line for it), so drop those records."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, Preempted)


logging.getLogger("celery.app.trace").addFilter(_QuietYields())

#: Task id -> monotonic time its current run started (in this process).
_starts: dict[str, float] = {}
signals.task_prerun.connect(_note_start, weak=False)
signals.task_postrun.connect(_forget, weak=False)


def started_at(task_id: str | None) -> float:
    """When the current run of ``task_id`` started (now if unknown: an eager call)."""
    return _starts.get(task_id or "", time.monotonic())
