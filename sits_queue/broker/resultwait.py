"""Waiting for results: Celery's pub/sub result consumer, subscribing to a task's
result channel when its producer first waits on it rather than at every ``delay()``.

Celery's Redis backend subscribes in ``on_task_call``, on every submission, so that a
result published before anyone waits is buffered; dropping the ``AsyncResult``
unsubscribes. That is a SUBSCRIBE and an UNSUBSCRIBE per ``delay()`` (about a fifth of
what a ``delay()`` costs over loopback) for results most offline-inference producers
never wait on one by one, and a producer holding a million results held a million
channels on the server.

Here a channel is subscribed when something waits on its result (``get()``, ``then()``,
a group's ``join``), and the result's stored state is read after that, so a result
finished before the subscription is not missed (while its record lives, below):

* a waiter reads it anyway (Celery's ``on_wait_for_pending`` reads the stored state of
  what it waits on, once subscribed);
* a ``then()`` callback's result is read at the next drain, where Celery would have
  handed over the message it buffered.

And each subscribed result's stored state is read once more :data:`RECHECK_S` after
its subscription, and every subscribed one's that long after a reconnect: a result whose
message was lost (published between a subscription and the read after it, reaching
Redis in another order; or between a reconnect's read and its resubscription, which
Celery's consumer misses for good) arrives then instead of never. At most twice per
result, whatever the traffic: a join on 20,000 running tasks does not read them all
every second.

What this changes against Celery's consumer, which has a result's messages from its
submission on: a wait that begins after the result's record expired (``result_expires``,
a day by default) finds nothing, where Celery's had the message buffered; and a
``get(on_message=...)`` progress callback is told the state the task is in as the wait
begins (its stored ``STARTED`` or ``PROGRESS``, once), then the states published from
the wait on, not the earlier ones (a task in PROGRESS when its wait began was heard only
at SUCCESS). Only where its channel has said nothing since its subscription: a result
subscribed before its wait (a group's members, by the group's barrier; one waited on
before) has its states on its channel, in order, and those waiting there are told
first; a stored state told before them came out of order, and twice. A state
published in the instant between a wait's subscription and its read of the stored one
(a task updating its state in a tight loop) may come after it.
``result_subscribe_on_send`` (``SITS_RESULT_SUBSCRIBE_ON_SEND``) subscribes at every
submission, as Celery does, for producers that need either.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from celery import states
from celery.backends.redis import ResultConsumer
from celery.exceptions import TimeoutError as CeleryTimeoutError
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)

#: A subscribed result's stored state is read once more this long after its
#: subscription (and every subscribed one's after a reconnect), s.
RECHECK_S = 1.0
#: Fewest entries the re-read deque holds before it is pruned.
PRUNE_LEAST = 1024
#: Pause between reconnects while Redis stays away, s (a wait's timeout, if shorter).
RECONNECT_PAUSE_S = 1.0
#: Most task ids remembered as told of their final state.
TOLD_MOST = 100_000
#: Longest one Redis call of a wait may go unanswered, s: a Redis that hangs (a stopped
#: process, a network partition that drops packets, where a closed port would refuse)
#: held a ``get(timeout=2)`` for the backend's socket timeout (Celery's 120 s) at each
#: try, and the stored-state read's retries many times over: minutes past its timeout.
WAIT_IO_TIMEOUT_S = 1.0


def capped(connparams: dict[str, Any], most_s: float = WAIT_IO_TIMEOUT_S) -> dict[str, Any]:
    """The backend's connection parameters for a wait's own client: socket waits (and
    connects) of at most ``most_s``, and one try per call (redis-py retries a timed-out
    call three times, with backoff): the wait's loop tries again, within its timeout."""
    out = dict(connparams)
    # (a Unix socket's connection takes no connect timeout: Celery leaves it out there)
    for name in ("socket_timeout",) if "path" in out else ("socket_timeout",
                                                           "socket_connect_timeout"):
        given = out.get(name)
        out[name] = most_s if not given else min(float(given), most_s)
    out["retry"] = Retry(NoBackoff(), 0)
    out["retry_on_timeout"] = False
    return out


class _WaitSide:
    """The backend as its result consumer sees it: itself, but for ``client``, one of its
    own whose calls a hung Redis cannot hold past :data:`WAIT_IO_TIMEOUT_S` (Celery's
    consumer makes its pub/sub connection and its reads through ``backend.client``)."""

    def __init__(self, backend: Any) -> None:
        self.unwrapped = backend
        self.client = backend._create_client(**capped(backend.connparams))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.unwrapped, name)


def waited_ids(result: Any) -> list[str]:
    """The task ids whose stored states Celery's ``on_wait_for_pending`` reads for
    ``result``: its own, or a result set's members'."""
    members = getattr(result, "results", None)
    if members is None:
        return [result.id]
    return [member.id for member in members]


class SitsResultConsumer(ResultConsumer):  # type: ignore[misc]
    """Celery's Redis result consumer, subscribing on first wait (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        backend: Any = self.backend
        self.backend: Any = _WaitSide(backend)
        #: Keys subscribed whose stored state nobody has read since.
        self._unread: set[Any] = set()
        #: (when, key): keys to read once more RECHECK_S after ``when``, oldest first.
        self._recheck: deque[tuple[float, Any]] = deque()
        #: Its length at which entries of keys no longer subscribed are dropped.
        self._prune_at = PRUNE_LEAST
        #: Task ids whose final state was handed on (insertion order: oldest first).
        self._told: dict[str, None] = {}
        #: Whether the pub/sub connection is to be made again (Redis was away).
        self._reconnect_due = False
        #: Task id -> the state a progress callback was told as its wait began (read
        #: from the store): the same state heard from the channel next is not told again.
        self._current: dict[str, Any] = {}
        #: Task ids whose channel has said something since their subscription (insertion
        #: order: oldest first): their stored state is not told at a wait's start.
        self._heard: dict[str, None] = {}

    def on_after_fork(self) -> None:
        self._current = {}
        self._heard = {}
        self._unread = set()
        self._recheck = deque()
        self._prune_at = PRUNE_LEAST
        self._told = {}
        self._reconnect_due = False
        # Celery's resets the pool of the client it sees, the waits' own here; the
        # backend's, which stores results, is reset as Celery's step would have
        try:
            self.backend.unwrapped.client.connection_pool.reset()
        except KeyError as exc:  # (as Celery's step says it)
            logger.warning("%s", exc)
        super().on_after_fork()

    def on_state_change(self, meta: Any, message: Any) -> None:
        """Celery's, but a final state is handed on once: read from the store (the reads
        after a subscription) and then heard from the channel in the same drain, a
        progress callback (``get(on_message=...)``) was told SUCCESS twice."""
        if message is not None and isinstance(meta, dict):  # (from its channel)
            self._heard[str(meta.get("task_id"))] = None
            if len(self._heard) > TOLD_MOST:
                del self._heard[next(iter(self._heard))]
        if isinstance(meta, dict) and self._current and \
                self._current.pop(str(meta.get("task_id")), None) == meta:
            return  # (the state it was told as the wait began, heard now)
        if isinstance(meta, dict) and meta.get("status") in states.READY_STATES:
            task_id = meta.get("task_id")
            if isinstance(task_id, str):
                if task_id in self._told:
                    return
                self._told[task_id] = None
                if len(self._told) > TOLD_MOST:  # (results never cancelled: bounded)
                    del self._told[next(iter(self._told))]
        super().on_state_change(meta, message)

    def consume_from(self, task_id: str) -> None:
        key = self._get_key_for_task(task_id)
        # A new wait under the id hears its states anew. (Kept when Celery cancels the
        # subscription at a final state: that state's message may still be on its way.)
        self._told.pop(task_id, None)
        with self._locked():
            fresh = key not in self.subscribed_to
            super().consume_from(task_id)
            # (subscribed at submission, Celery's way: its messages come from then on)
            if fresh and not getattr(self.backend, "subscribes_on_send", False):
                self._unread.add(key)
                self._recheck_later([key])
            if fresh:  # (its channel has said nothing yet)
                self._heard.pop(task_id, None)

    def cancel_for(self, task_id: str) -> None:
        # (a group's members are subscribed as it is made: a producer that never waits
        # on them kept their keys here.) Without the lock: this runs from
        # AsyncResult.__del__, which must never block; the set is only ever iterated as
        # a copy taken in one step (_take_unread)
        self._unread.discard(self._get_key_for_task(task_id))
        super().cancel_for(task_id)

    def _reconnect_pubsub(self) -> None:
        super()._reconnect_pubsub()
        with self._locked():
            self._recheck_later(list(self.subscribed_to))

    def _reconnect(self) -> None:
        """One try, not Celery's twenty a second apart: those held a ``get(timeout=5)``
        ~20 s into an outage, then raised "Retry limit exceeded ... the Celery
        application must be restarted" (it need not be). Redis still away, the
        reconnect is tried again at each drain (:meth:`drain_events`), so a wait ends
        at its timeout with Celery's ``TimeoutError`` and a wait without one goes on
        until Redis is back and the result comes."""
        try:
            self._reconnect_pubsub()
            self._reconnect_due = False
        except self._connection_errors as exc:
            if not self._reconnect_due:
                logger.warning("result consumer: Redis unreachable (%s); reconnecting at "
                               "each wait", exc)
            self._reconnect_due = True

    def on_wait_for_pending(self, result: Any, timeout: Any = None, **kwargs: Any) -> None:
        """The stored states of what is waited on (subscribed by now: add_pending_result
        came first), and of whatever else was subscribed unread, in one read through the
        wait's own client. Not Celery's step, which reads through the backend's, retrying
        (``result_backend_always_retry``) a Redis that hangs for its socket timeout each
        time. Only final states are handed on, as Celery's step amounts to: a state
        before it goes to the progress callback of the wait before (``on_message`` is
        set after this step)."""
        own = [self._get_key_for_task(task_id) for task_id in waited_ids(result)]
        with self._locked():
            self._unread.difference_update(own)
        if self._reconnect_due:  # Redis away just now (the subscription found it so): the
            return  # reconnect, at the first drain, reads every subscribed key's state
        # (Celery's step then drops what it buffered of a result that its message had
        # resolved meanwhile: here that final state was told once already, and a second
        # telling stops in on_state_change before anything is buffered.)
        self._read_ready(own + self._take_unread(), own=frozenset(own))

    def _wait_for_pending(self, result: Any, timeout: Any = None, on_interval: Any = None,
                          on_message: Any = None, **kwargs: Any) -> Iterator[None]:
        """Celery's, but a progress callback is first told the state each result waited
        on is in now, where it is no final one: a wait subscribes as it begins, so the
        states published before (a STARTED, the PROGRESS the task is at) never reach it,
        where Celery's consumer, subscribed at the submission, had them all."""
        if on_message is None or getattr(self.backend, "subscribes_on_send", False):
            yield from super()._wait_for_pending(
                result, timeout=timeout, on_interval=on_interval, on_message=on_message,
                **kwargs)
            return
        self.on_wait_for_pending(result, timeout=timeout, **kwargs)
        before: Any = getattr(self, "on_message", None)
        self.on_message = on_message
        try:
            # What their channels hold already first (a group's members are subscribed
            # as it is sent), then the stored state of those whose channel said nothing
            self._drain_buffered()
            self._tell_current([t for t in waited_ids(result) if t not in self._heard])
            for _ in self.drain_events_until(result.on_ready, timeout=timeout,
                                             on_interval=on_interval):
                yield
                time.sleep(0)
        except TimeoutError:
            raise CeleryTimeoutError("The operation timed out.") from None
        finally:
            self.on_message = before

    def _drain_buffered(self, most: int = 10_000) -> None:
        """The messages already read from the result channels handed on, without
        waiting (Celery's ``_drain_one``: none where this Celery has no such step, or
        another thread waits on the socket)."""
        drain_one = getattr(self, "_drain_one", None)
        if drain_one is None or self._reconnect_due:
            return
        with self._locked():
            pubsub = self._pubsub
            if pubsub is None or getattr(self, "_socket_waiter", False):
                return
            for _ in range(most):
                if not drain_one(pubsub, 0):
                    return

    def _tell_current(self, task_ids: list[str]) -> None:
        """The progress callback told the stored state of each of ``task_ids`` (those
        whose channel said nothing yet) that is not final (a final one was handed on by
        :meth:`on_wait_for_pending`)."""
        if self._reconnect_due:
            return
        ids = {self._get_key_for_task(t): t for t in task_ids}
        # (one unreadable was raised by the wait's own read already: skipped here)
        for key, meta in self._stored(list(ids)):
            task_id = ids[key]
            if isinstance(meta, dict) and meta.get("status") not in states.READY_STATES:
                if len(self._current) >= TOLD_MOST:
                    self._current.clear()
                self._current[task_id] = meta
                if self.on_message:
                    self.on_message(meta)

    def drain_events(self, timeout: float | None = None) -> None:
        if self._reconnect_due:
            self._reconnect()
            if self._reconnect_due:  # (still away: the wait's own timeout decides)
                time.sleep(RECONNECT_PAUSE_S if timeout is None
                           else min(timeout, RECONNECT_PAUSE_S))
                return
        self._read_ready(self._take_unread() + self._take_due())
        super().drain_events(timeout)

    def _recheck_later(self, keys: list[Any]) -> None:
        """Called holding the lock."""
        now = time.monotonic()
        self._recheck.extend((now, key) for key in keys)
        if len(self._recheck) > self._prune_at:
            # results dropped unread (their keys unsubscribed): forgotten here too. Then
            # not before the deque has doubled again: entries of live keys (each
            # reconnect adds one per key) are not walked again at every subscription
            live = self.subscribed_to
            self._recheck = deque(entry for entry in self._recheck if entry[1] in live)
            self._prune_at = 2 * len(self._recheck) + PRUNE_LEAST

    def _take_unread(self) -> list[Any]:
        if not self._unread:  # (the common case, read without the lock)
            return []
        with self._locked():
            # swapped, then copied in one step: cancel_for discards without the lock
            taken, self._unread = self._unread, set()
            keys = [key for key in list(taken) if key in self.subscribed_to]
        return keys

    def _take_due(self) -> list[Any]:
        recheck, now, due = self._recheck, time.monotonic(), []
        try:  # (peeked without the lock: another waiter may empty it meanwhile)
            if now - recheck[0][0] < RECHECK_S:
                return []
        except IndexError:
            return []
        with self._locked():
            while self._recheck and now - self._recheck[0][0] >= RECHECK_S:
                _, key = self._recheck.popleft()
                if key in self.subscribed_to:
                    due.append(key)
        return due

    def _read_ready(self, keys: list[Any], own: frozenset[Any] = frozenset()) -> None:
        """Hand on the stored states of ``keys`` that are final, as if their messages
        had come. Not the others: a progress callback (``get(on_message=...)``) would
        be told again of a state it was told of. A record of ``own`` (what the wait is
        on) that does not decode raises, as Celery's read does (``UnreadableResult``)."""
        for _, meta in self._stored(keys, own):
            if (isinstance(meta, dict) and meta.get("status") in states.READY_STATES
                    and isinstance(meta.get("task_id"), str)):
                self.on_state_change(meta, None)

    def _stored(self, keys: list[Any], own: frozenset[Any] = frozenset()
                ) -> list[tuple[Any, Any]]:
        """(key, decoded record) of each of ``keys`` that has one, in one read through
        the wait's own client. A record of ``own`` that does not decode raises, as
        Celery's read does (``UnreadableResult``); another's is skipped."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return []
        raws: list[Any] | None = None
        # A lost connection is Celery's to handle, as on the pub/sub path: it reconnects,
        # reading every subscribed key's state then
        with self.reconnect_on_error():
            raws = self.backend.client.mget(keys)
        found: list[tuple[Any, Any]] = []
        for key, raw in zip(keys, raws or [], strict=False):
            if raw is None:
                continue
            try:
                found.append((key, self._decode_result(raw)))
            except Exception as exc:  # whatever its decoding raises
                # (a bad exception type, a corrupt compressed payload...): its own waiter
                # is told; a wait on another result must not fail for it
                if key in own:
                    raise
                logger.debug("result %r not readable on a second read: %s", key, exc)
        return found
