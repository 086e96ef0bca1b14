"""Ack emulation for the sorted-set transport: kombu's Redis QoS, re-pointed at the
per-queue unacked sets that ``pick.lua`` fills (ack, reject, release, restore and the
heartbeat of held messages each run on the message's own queue).

What counts as a redelivery (``restore.lua``; more than ``max_redeliveries`` of them
dead-letter a message as poison) and what does not (``release.lua``):

* counts: the visibility sweep's restore (the holder went silent: it died), a reject
  with requeue (Celery's ``task_reject_on_worker_lost``: the pool child running it
  died), and a give-back at channel close of a task that had *started* and no longer
  runs (a cold shutdown cancels it: the task may be what kept its worker from
  stopping). One still running at the close (a lost connection: Celery reconnects and
  lets it run) is not given back at all: it is beaten until it acks;
* does not: a give-back at channel close of a message the worker held but had not
  started (a warm shutdown or a reconnect while it was reserved, an ETA task in
  Celery's timer), and a release (a task the worker chose not to start, or that
  yielded its slot). Nothing crashed; restarts alone must never make a task poison.

"Started" is Celery's own: the worker's accepted requests
(``celery.worker.state.active_requests``), read at the give-back and remembered at each
sweep tick (kombu's restore interval, a sixth of the visibility timeout: ``app.py``)
while held, because a cold shutdown cancels the running requests, and Celery forgets
them, before the channel closes: a task that started less than a tick before a cold
shutdown does not count. A plain kombu consumer has no requests, so its clean close
never counts; if it dies instead, the sweep restores what it held, and counts.

The held messages' deadlines are pushed from a thread (``heartbeat.py``), beside the
event loop. One lock orders its beats against every give-back (release, reject,
restore): a message this channel gave back, which another consumer may hold by now,
is never extended by a beat that had already read it as held. Acked messages are not
beaten either: an ack that failed for good leaves its message to the sweep.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import redis
from celery.worker import state as worker_state
from kombu.transport import redis as kredis
from kombu.transport import virtual

from sits_queue.broker import affinity, clock, deadletters, holders
from sits_queue.broker.heartbeat import Heartbeat
from sits_queue.broker.keys import batch_units

logger = logging.getLogger(__name__)

#: Restored per sweep per queue: a crashed worker's backlog comes back over a few sweeps.
RESTORE_LIMIT = 1000
#: A held message's deadline base is its pick or last beat time on its worker's clock; one
#: more than a day ahead of ours is no clock skew but a score another program wrote (a
#: +inf held its message unacked for good), so the sweep restores it as overdue.
FUTURE_DEADLINE_S = 86_400.0
#: QoS objects of channels closed while Redis was away, held until they owe nothing: once
#: closed, a channel and its messages are a cycle nothing else holds (Celery has dropped
#: the unstarted ones), and the heartbeat thread only holds it weakly.
_OUTLIVING: set[Any] = set()


class QoS(kredis.QoS):
    """Ack emulation over the per-queue unacked sets.

    ``pick.lua`` already recorded the message as unacked, so ``append`` only keeps the
    local bookkeeping; ack, reject and restore run one script on the message's queue.
    """

    restore_at_shutdown = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_sweep = 0.0
        self._last_reclaim = -math.inf
        self._look_failing = False  # (the heartbeat thread's look: _thread_beat)
        #: The process whose record this consumer writes (``holders.py``): a child
        #: forked with the channel writes none, or its end would look like ours.
        self._owner_pid = os.getpid()
        #: Whether it wrote one (a clean close drops it: transport.Channel.close).
        self.recorded = False
        #: (when, what) the fleet's adverts last said of a live worker of an earlier
        #: release (:meth:`_older_release`)
        self._older_seen: tuple[float, str | None] = (-math.inf, None)
        #: Held while a beat reads and extends what is held, and while a message is
        #: given back or forgotten (see the module docstring). Re-entrant: a signal
        #: handler that closes the channel may run while this thread holds it.
        self._lock = threading.RLock()
        self._heartbeat: Heartbeat | None = None
        #: Held tags the worker has started (see the module docstring), and Celery's
        #: count of accepted tasks when they were last read.
        self._started: set[str] = set()
        self._accepted_seen = -1
        #: The channel closed while Redis was away: the beat gives back what had not
        #: started (see _outlive_close).
        self._give_back_pending = False

    def _queue_of(self, delivery_tag: str) -> str | None:
        message = self._delivered.get(delivery_tag)
        if message is None:
            return None
        queue: str | None = message.delivery_info.get("sits_queue")
        return queue

    def append(self, message: Any, delivery_tag: str) -> None:
        with self._lock:  # it forgets given-back tags (kombu's _flush) too
            virtual.QoS.append(self, message, delivery_tag)
        if self._heartbeat is None:  # a channel that never holds anything needs no thread
            self._start_heartbeat()

    @property
    def beat_period_s(self) -> float:
        """How often a holder beats, and a consumer sweeps, s: a third of the timeout."""
        return float(self.channel.visibility_timeout) / 3

    def _start_heartbeat(self) -> None:
        self._heartbeat = Heartbeat(weakref.WeakMethod(self._thread_beat),
                                    self.channel._connparams(), self.beat_period_s,
                                    name=f"sits-heartbeat-{self.channel.consumer_id[:8]}")
        self._heartbeat.start()

    def can_consume(self) -> bool:
        """Prefetch counts pool jobs: a batch (one pick, one job) counts once."""
        pcount = self.prefetch_count
        return not pcount or held_units(self._delivered, self._dirty) < pcount

    def ack(self, delivery_tag: str) -> None:
        # Not under the lock: a beat's ZADD XX cannot re-add an acked message, and its id
        # never comes back (ack.lua drops the payload).
        queue = self._queue_of(delivery_tag)
        # Forgotten here first, even when the ack then fails (Celery logs it and never
        # acks again): held, it was heartbeated for good and filled a prefetch slot; now
        # the sweep restores it once the visibility timeout passes.
        virtual.QoS.ack(self, delivery_tag)
        affinity.invalidate()  # its child has published what it holds now
        try:
            # The ack first (sent without waiting for Redis's reply: transport._ack),
            # then the freed slot's next task: on --pool=solo that pick runs the task
            # then and there. Sent after it, the ack waited for that task's end, the
            # finished one no longer beaten: one longer than the visibility timeout had
            # it restored by another worker's sweep, and run again.
            if queue is not None:
                self.channel._ack(queue, [delivery_tag])
                self.channel._replicas_gone(queue, [delivery_tag])
        finally:
            self.channel.pick_for_freed_slot()

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        with self._lock:
            try:
                queue = self._queue_of(delivery_tag)
                if queue is not None:
                    if requeue:  # counts: Celery requeues a task whose pool child died
                        self.channel._run("restore", queue, ["-", 0, delivery_tag])
                    else:
                        # Rejected for good (unknown task, Reject(requeue=False)): keep it
                        # inspectable, with the consumer's reason when it gave one.
                        reason, fail = self.channel.reject_reasons.pop(
                            delivery_tag, ("rejected by consumer", False))
                        self.channel._run("dead", queue,
                                          [clock.now(self.channel.raw), reason,
                                           delivery_tag])
                        self.channel._replicas_gone(queue, [delivery_tag])
                        if fail:  # its caller's get() raises instead of waiting for ever
                            deadletters.fail_tasks(self.channel.raw,
                                                   self.channel.keys(queue).dead,
                                                   [delivery_tag])
            finally:  # (as ack: a failed call leaves it to the sweep, not held for good)
                self.channel.reject_reasons.pop(delivery_tag, None)
                virtual.QoS.ack(self, delivery_tag)

    def release(self, delivery_tag: str, first_hold_s: float = 0.0,
                longest_hold_s: float = 0.0) -> float:
        """Put a delivered message back with its score, *not* counting a redelivery;
        returns the hold it got, s.

        For a worker that chose not to start the task (its device lacks the VRAM the
        task declares: ``first_hold_s`` > 0, and this consumer is not offered it again
        for that long, doubling per repeat up to ``longest_hold_s``; it takes the tasks
        behind it meanwhile) or a task that yielded its time slice (no hold). Since
        nothing crashed, it must not creep towards the poison-message limit. See
        ``lua/release.lua``.
        """
        return self.release_many([delivery_tag], first_hold_s, longest_hold_s)

    def release_many(self, delivery_tags: Sequence[str], first_hold_s: float = 0.0,
                     longest_hold_s: float = 0.0) -> float:
        """:meth:`release` for messages of one queue in one call, at one instant: held,
        they come back together (a batch its child's device could not hold, given back
        one by one, came back in pieces, each hold ending a few ms after the last)."""
        tags = list(delivery_tags)
        with self._lock:
            by_queue: dict[str, list[str]] = defaultdict(list)
            for tag in tags:
                if (queue := self._queue_of(tag)) is not None:
                    by_queue[queue].append(tag)
            hold = 0.0
            try:
                for queue, own in by_queue.items():
                    hold = self._release(queue, own, first_hold_s, longest_hold_s)
                    self.channel.note_hold(hold)
            finally:  # forget them locally: Redis has them back (or, failing, the sweep will)
                for tag in tags:
                    virtual.QoS.ack(self, tag)
        return hold

    def note_unstarted(self, delivery_tag: str, unstarted: bool) -> None:
        """Say in Redis that a held message has not started (it waits here for a
        rate-limit token: its restore after this worker dies is then no redelivery,
        ``lua/restore.lua``), or, before it starts, no longer so.

        Both go out on the channel's one deferred connection, so they reach Redis in
        the order said; the second is written before the task goes to the pool, so a
        task that crashes its worker is counted. Said only: an id acked, released or
        restored meanwhile is dropped from the set by that script, and a message its
        holder could not mark is counted, as before."""
        queue = self._queue_of(delivery_tag)
        if queue is None:
            return
        key = self.channel.keys(queue).idle
        command = ("SADD" if unstarted else "SREM", key, delivery_tag)

        def run() -> None:
            try:
                self.channel.raw.execute_command(*command)
            except self.channel.connection_errors as exc:
                logger.warning("could not note message %s of queue %r as %s: %s",
                               delivery_tag, queue,
                               "not started" if unstarted else "started", exc)

        self.channel._deferred.send_or_run(self.channel.pool, command, run)

    def _release(self, queue: str, tags: list[str], first_hold_s: float = 0.0,
                 longest_hold_s: float = 0.0, client: Any = None) -> float:
        """``release.lua`` for ``tags``, on ``client`` (the heartbeat thread's) or the
        channel's; the hold given to the last of them, s."""
        _, hold_text = self.channel.scripts.run("release", self.channel.keys(queue), [
            self.channel.consumer_id, clock.now(client or self.channel.raw), first_hold_s,
            max(first_hold_s, longest_hold_s), *tags], client or self.channel.raw)
        return float(hold_text)

    def _held_by_queue(self) -> dict[str, list[str]]:
        """Delivery tags this channel holds (running or reserved) and has not acked or
        given back yet, grouped by queue."""
        by_queue: dict[str, list[str]] = defaultdict(list)
        for tag in list(self._delivered):
            queue = self._queue_of(tag)
            if queue is not None and tag not in self._dirty:
                by_queue[queue].append(tag)
        return by_queue

    def restore_unacked(self, client: Any = None) -> None:
        """Give back what is held (channel close, a reconnect, ``basic_recover``): a
        task that had started counts as a redelivery, one that had not does not (see
        the module docstring). A task still running here is kept instead: the close of
        a lost connection (Redis up) leaves Celery's running tasks going, to ack through
        this QoS when they end; given back, the message ran again beside itself. The
        heartbeat goes on beating it until then (:meth:`_keep_beating`)."""
        self.note_started()
        started = self._started
        running = started_tags()
        with self._lock:
            for queue, tags in self._held_by_queue().items():
                ran = [tag for tag in tags if tag in started and tag not in running]
                if ran:
                    self.channel._run("restore", queue, ["-", 0, *ran])
                if idle := [tag for tag in tags if tag not in started]:
                    self._release(queue, idle)
                for tag in (*ran, *idle):
                    virtual.QoS.ack(self, tag)
            self._started &= running
            kept = sum(len(tags) for tags in self._held_by_queue().values())
        if kept:  # (not under the lock: a beat that waits on it would stall the stop)
            logger.warning("channel closed with %d task(s) still running: their messages "
                           "are kept until they end", kept)
            self._keep_beating()

    def note_started(self) -> None:
        """Remember which held messages the worker has started (event-loop thread: Celery
        changes its request sets there)."""
        accepted = worker_state.all_total_count[0]  # a task started since the last look?
        held = self._delivered
        if accepted != self._accepted_seen:
            self._accepted_seen = accepted
            self._started |= started_tags()
        self._started = {tag for tag in self._started
                         if tag in held and tag not in self._dirty}

    def restore_unacked_once(self, stderr: Any = None) -> None:
        """At channel close (and at exit): the heartbeat stops first; what is given back
        after that is beaten by no one here. A give-back that cannot reach Redis (the
        close of a lost connection) is finished later instead (:meth:`_outlive_close`)."""
        if getattr(self._delivered, "restored", False):
            return  # kombu's own check asserts that nothing is held by then: we may hold
        self.stop_heartbeat()
        had = bool(self._delivered)
        try:
            super().restore_unacked_once(stderr)
        except self.channel.connection_errors as exc:
            self._outlive_close(exc)
            return
        # Given all back: the record goes too (transport.Channel.close drops that of a
        # channel that held nothing, on the connection its acks went by). The give-back
        # reached Redis through a client of the closing channel, opened again for it:
        # reused here, never opened for this alone (Redis may be away).
        if had and self.channel._pool is not None \
                and (command := self.record_to_drop()) is not None:
            with contextlib.suppress(Exception):
                self.channel.raw.execute_command(*command)

    def record_to_drop(self) -> tuple[str, str, str] | None:
        """The command that drops this consumer's record (``holders.forget``) once it
        holds nothing; None if it wrote none, or still holds something (a reconnect
        with a task running: its beats go on)."""
        if not self.recorded or self._held_by_queue():
            return None
        return holders.forget(self.channel.global_keyprefix, self.channel.consumer_id)

    def _outlive_close(self, exc: BaseException) -> None:
        """Redis was away when the channel closed: nothing was given back. Left so, the
        visibility sweep would restore it all, counting a redelivery each time (tasks
        never started would turn poison after a few restarts), and a task still running
        here, beaten by no one, would be restored and run again beside itself. So a
        heartbeat goes on: once Redis answers it gives back what had not started
        (uncounted), and keeps the running tasks' messages until their acks come
        (Celery acks them through this channel's QoS, when they end)."""
        self._give_back_pending = True
        logger.warning("Redis unreachable at channel close (%s): %d held message(s) kept "
                       "and given back once it answers", str(exc), len(self._delivered))
        # (the text, not the exception: a kept log record would keep its traceback's
        # frames, and this channel with them)
        self._keep_beating()

    def _keep_beating(self) -> None:
        """A closed channel still owes acks or give-backs: held here (the heartbeat
        thread only holds it weakly) and beaten until it owes nothing."""
        _OUTLIVING.add(self)
        self.stop_heartbeat()
        self._heartbeat = None
        self._start_heartbeat()

    def stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def restore_visible(self, start: int = 0, num: int | None = 10, interval: int = 10) -> None:
        """Restore messages whose holder went silent (this channel's own are kept fresh
        by its heartbeat thread)."""
        self.channel._deferred.poll()  # an idle worker's owed ack replies, errors too
        self.note_started()
        self._reclaim()
        now_mono = time.monotonic()
        period = self.beat_period_s
        if now_mono - self._last_sweep < period:
            return
        self._last_sweep = now_mono
        # The ceiling first, then our own held messages' beat: after a Redis stall as long
        # as the timeout, the beats the thread missed would otherwise let this very sweep
        # restore the tasks this worker is running. The beat's deadline is read after the
        # ceiling, so it is above it however long the beat waits on a stalled Redis.
        now = clock.now(self.channel.raw)
        ceiling = now - self.channel.visibility_timeout
        self.heartbeat()
        durable = [q for q in self.channel.active_queues if q not in self.channel._expires]
        if durable:  # consumers keep the registry whole too (the rescoring pass reads it)
            self.channel.register(*durable)
        for queue in self.channel.active_queues:
            restored = self.channel._run("restore", queue, [
                ceiling, num or RESTORE_LIMIT, now + FUTURE_DEADLINE_S,
                period])  # (the holders' beat: heartbeat.py)
            if restored:
                logger.warning("restored %d message(s) of queue %r whose worker stopped "
                               "heartbeating for %.0f s", restored, queue,
                               self.channel.visibility_timeout)

    def _reclaim(self) -> None:
        """Each tick: this consumer's record, and the messages that consumers of this
        host whose process ended held, put back (``holders.py``)."""
        channel = self.channel
        now_mono = time.monotonic()
        # (a worker's ticks come every sixth of the timeout; a plain consumer's
        # drain_events calls this at each poll)
        if (not channel.config.reclaim_dead_holders
                or now_mono - self._last_reclaim < self.beat_period_s / 3):
            return
        self._last_reclaim = now_mono
        try:
            now = clock.now(channel.raw)
            self.record(channel.raw, now, self._held_by_queue())
            self._put_back_dead(channel.raw, now)
        except channel.connection_errors:
            raise  # (the poller's: the loop reconnects)
        except Exception as exc:  # (a key of another type, a record no one can read:
            # the sweep after this must run all the same; the timeout restores)
            logger.warning("dead holders of this host not looked for: %r", exc)

    def _put_back_dead(self, client: Any, now: float) -> None:
        """``holders.reclaim`` on ``client``: the channel's, or the heartbeat thread's."""
        channel = self.channel
        holders.reclaim(client, channel.global_keyprefix, channel.consumer_id, now,
                        lambda queue, args: channel.scripts.run(
                            "restore", channel.keys(queue), args, client),
                        older=lambda: self._older_release(client))

    def _thread_beat(self, client: Any) -> None:
        """The heartbeat thread's call: the beat, then, if the event loop has not looked
        for dead holders for a whole period, the look from here. A ``--pool=solo``
        worker runs its task in the loop: busy, it ticked only between tasks, and a dead
        neighbour's messages waited for its task's end (or another worker's tick)."""
        self.heartbeat(client)
        channel = self.channel
        if (not channel.config.reclaim_dead_holders or channel.closed
                or time.monotonic() - self._last_reclaim < self.beat_period_s):
            return
        self._last_reclaim = time.monotonic()
        try:  # (the beat just wrote this consumer's record)
            self._put_back_dead(client, clock.now(client))
        except Exception as exc:  # (not the beat's failure; said once a failing stretch)
            if not self._look_failing:
                logger.warning("dead holders of this host not looked for: %r", exc)
            self._look_failing = True
        else:
            self._look_failing = False

    def _older_release(self, client: Any) -> str | None:
        """:func:`advertise.older_release` for ``holders.reclaim``, read at most once per
        advert TTL (it reads every worker's advert), and only when someone died."""
        from sits_queue.workers import advertise  # (workers/ builds on broker/)

        if time.monotonic() - self._older_seen[0] >= advertise.TTL_S:
            self._older_seen = (time.monotonic(), advertise.older_release(
                client, self.channel.global_keyprefix))
        return self._older_seen[1]

    def record(self, client: Any, now: float, held: Iterable[str]) -> None:
        """Which process this consumer is, and its queues with those it holds messages
        of (``holders.py``): written at its first consume and refreshed at every beat
        (``now``: that of the beat's deadlines) and sweep tick. A consumer that acks
        nothing (Celery's reply and event receivers) holds nothing: not written."""
        channel = self.channel
        queues = [*(q for q in channel.active_queues if q not in channel._no_ack), *held]
        if (queues and channel.config.reclaim_dead_holders
                and os.getpid() == self._owner_pid):
            holders.record(client, channel.global_keyprefix, channel.consumer_id, queues,
                           now, channel.visibility_timeout)
            self.recorded = True

    def heartbeat(self, client: Any = None) -> None:
        """Push the deadline of every message this channel holds (running or reserved),
        on ``client`` (the heartbeat thread's own) or the channel's."""
        with self._lock:
            if self._give_back_pending:
                self._give_back_idle(client or self.channel.raw)
            by_queue = self._held_by_queue()
            if not by_queue:
                _OUTLIVING.discard(self)  # owes nothing more (a live channel: not there)
                return
            redis_client = client or self.channel.raw
            now = clock.now(redis_client)
            try:  # (before the beats: their deadlines are no later than its time)
                self.record(redis_client, now, by_queue)
            except Exception as exc:  # (the beats matter more: they go on)
                logger.debug("holder record not written: %r", exc)
            period = self.beat_period_s
            # (beat.lua: only ids still unacked, an id acked meanwhile is not brought back;
            # and Redis hears the queue is served, by its own clock: a gap holds the sweeps)
            refused: list[redis.ResponseError] = []
            for queue, tags in by_queue.items():
                try:
                    self.channel.scripts.run("beat", self.channel.keys(queue),
                                             [now, period, *tags], redis_client)
                except redis.ResponseError as exc:  # (a queue key of another type: the
                    refused.append(exc)             # other queues are beaten all the same)
            if refused:
                raise refused[0]

    def _give_back_idle(self, client: Any) -> None:
        """After a close that could not reach Redis: release the held messages that had
        not started (``release.lua``, uncounted; it moves only ids still unacked, so a
        sweep that restored one first is not undone) and forget them here."""
        started = self._started
        for queue, tags in self._held_by_queue().items():
            if idle := [tag for tag in tags if tag not in started]:
                self._release(queue, idle, client=client)
                for tag in idle:
                    virtual.QoS.ack(self, tag)
        self._give_back_pending = False
        logger.info("held messages given back after Redis came back; %d still running",
                    len(self._held_by_queue()))


def started_tags() -> set[str]:
    """Delivery tags of the tasks this process's Celery worker has started and not
    finished (none outside a worker)."""
    tags: set[str] = set()
    for request in list(worker_state.active_requests):
        tag = getattr(getattr(request, "message", None), "delivery_tag", None)
        if tag is not None:
            tags.add(tag)
    return tags


def held_units(delivered: dict[str, Any], done: Any = ()) -> int:
    """Messages held and not ``done``, a batch counting as one (it is one pool job)."""
    return batch_units((tag, getattr(message, "delivery_info", None))
                       for tag, message in list(delivered.items()) if tag not in done)
