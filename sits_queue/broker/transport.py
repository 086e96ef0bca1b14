"""kombu transport whose queues are Redis sorted sets ordered by a live priority score.

Built on kombu's Redis transport: connection handling, fanout (pub/sub), events,
remote control, the event-loop poller and Sentinel support are inherited; only the
queue primitives (put, get, the blocking wait, size, purge, delete) and the ack
emulation (QoS, ``qos.py``) are replaced: the put and the channel's plumbing in
``publishing.py``, the picks in ``picking.py``, the rest here. See ``keys.py`` for the
key layout and ``lua/`` for the atomic steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from typing import Any

import redis
from kombu.transport import redis as kredis
from kombu.transport import virtual

from sits_queue.broker import clock, intake, wait
from sits_queue.broker.keys import MARKER_MEMBER, queues_registry
from sits_queue.broker.payload import SitsMessage
from sits_queue.broker.picking import PickingChannel
from sits_queue.broker.qos import QoS
from sits_queue.checks import text
from sits_queue.errors import InvalidQueueName

logger = logging.getLogger(__name__)

Empty = virtual.Empty
#: Messages moved per Lua call when purging: bounds how long one call holds Redis.
PURGE_CHUNK = 1000
#: How soon a consumer whose intake is paused looks again, s.
INTAKE_RECHECK_S = 1.0


class Channel(PickingChannel):
    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The queues the blocking wait in flight watches; () once it is answered.
        self._watched: tuple[str, ...] = ()
        #: Why the consumer is about to reject a delivered message, and whether its task
        #: fails with it (``workers/consumer.py``); read by ``QoS.reject``.
        self.reject_reasons: dict[str, tuple[str, bool]] = {}

    def _ack(self, queue: str, tags: list[str]) -> None:
        """``ack.lua`` for ``tags``; in a worker, without waiting for Redis's reply.

        With late acks a task is acked when its result comes back from the pool, and
        only then does the worker pick the freed slot's next task: the round trip sat on
        that path, with the child idle. Sent deferred (``fanout.py``), the ack has reached
        Redis when this returns; its reply is read later. A refused or lost one runs
        again here (``ack.lua`` is idempotent: after NOSCRIPT or a lost connection);
        failing that, it is logged and the message stays unacked, as when kombu's ack
        fails. Outside a worker's event loop (a plain consumer) the ack is awaited, so
        that other clients see it as soon as ``ack()`` returns, and so is a late ack
        through a channel closed meanwhile (a task that ran across a lost connection)."""
        if self.connection is None or self.connection._hub is None:
            self._run("ack", queue, tags)
            return
        names = self.keys(queue).all()

        def again(exc: redis.RedisError) -> None:
            try:
                self._run("ack", queue, tags)
            except Exception:
                logger.exception("could not ack %s of queue %r (%s); it stays unacked "
                                 "and is redelivered once its visibility timeout passes",
                                 tags, queue, exc)

        self._deferred.send_or_run(
            self.pool, ("EVALSHA", self.scripts.shas["ack"], len(names), *names, *tags),
            lambda: self._run("ack", queue, tags), again)  # unsent: awaited, or it raises

    def close(self) -> None:
        if not self.closed:
            # for late acks through it: a task still running at the close of a lost
            # connection acks here when it ends (qos.py), after kombu dropped the pool
            with contextlib.suppress(Exception):
                self._closed_params = self._connparams()
            self._forget_record()
            self._deferred.close()
            if self._in_poll and self._watched:
                # kombu would read the wait's answer first: up to brpop_timeout, then a
                # pick for a closing consumer. A wait holds no message: give it up.
                self._give_up_wait()
        super().close()

    def _forget_record(self) -> None:
        """A consumer that closes holding nothing drops its record (``holders.py``), sent
        with the owed acks and read with them: left, each restart's record read as a
        dead holder's by its neighbours. (One that holds messages gives them back
        first: ``QoS.restore_unacked_once`` drops it then.)"""
        qos = self._qos
        if (qos is None or qos._delivered or self._pool is None
                or (command := qos.record_to_drop()) is None):
            return
        with contextlib.suppress(Exception):  # (Redis away: the neighbours drop it)
            self._deferred.send(self._pool, [command], lambda exc: None)

    # -- consuming -------------------------------------------------------------------------
    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> SitsMessage | None:
        """kombu's, with the pick told whether the message will be acked: a ``no_ack``
        consumer's message is gone once taken, as with stock kombu, instead of waiting
        unacked for the restore that would deliver it again."""
        try:
            (message,) = self._pick(queue, batch_window=0, no_ack=no_ack)
        except Empty:
            return None
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        self.keys(queue)  # validates the name here, not in the event loop's next wait
        # kombu keeps one callback per queue, so the latest consumer's no_ack holds.
        (self._no_ack.add if no_ack else self._no_ack.discard)(queue)
        tag = super().basic_consume(queue, no_ack, *args, **kwargs)
        if not no_ack:  # before its first pick: a task that kills it at once is seen
            with contextlib.suppress(redis.RedisError):  # (else the first tick writes it)
                self.qos.record(self.raw, clock.now(self.raw), ())
        if self._in_poll and wait.misses(self._watched, queue, self.active_queues):
            self._give_up_wait()  # the next wait watches this queue too (broker/wait.py)
        return tag

    def _basic_cancel(self, consumer_tag: str) -> Any:
        """kombu's; then a wait in flight on a queue no longer consumed is given up: it
        could take a wake-up meant for another consumer (broker/wait.py)."""
        cancelled = super()._basic_cancel(consumer_tag)
        if self._in_poll and any(q not in self.active_queues for q in self._watched):
            self._give_up_wait()
        return cancelled

    def _connparams(self, asynchronous: bool = False) -> Any:
        params = super()._connparams(asynchronous)
        if asynchronous:  # the wait's connection: polled by the event loop (wait.py)
            params["connection_class"] = wait.unpolled_on_disconnect(
                params["connection_class"],
                lambda: getattr(getattr(self.connection, "cycle", None), "poller", None))
        return params

    def _give_up_wait(self) -> None:
        connection, watched = self._in_poll, self._watched
        self._in_poll, self._watched = None, ()  # type: ignore[assignment]
        wait.give_up(connection, watched, lambda queue: self._run("arm", queue, []),
                     self.connection_errors)

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        """One message's payload (tests and benchmarks): never a batch."""
        raw: dict[str, Any] = self._pick(queue, batch_window=0)[0]._raw
        return raw

    def _brpop_start(self, timeout: float | None = None) -> None:
        if timeout is None:
            timeout = self.brpop_timeout
        if self._paused() or self._throttled():
            return
        if not self.connection.cycle._in_protected_read and self._fast_pick():
            return  # delivered until the consumer is full: nothing to wait for
        if self._paused():  # that pick found only messages this consumer holds off
            return
        queues = self._control_first()
        if not queues:
            return
        markers = [self.keys(q).marker for q in queues]
        self._in_poll = self.client.connection
        self._watched = tuple(queues)
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]
        # Wait on the markers, not the queues: the pick itself must be the atomic script.
        self.client.connection.send_command("BZPOPMIN", *markers, timeout or 0)

    def pick_for_freed_slot(self) -> None:
        """A task's message was acked in a worker's event loop: pick the freed slot's
        next task now, as the loop's next turn would (:meth:`_brpop_start`:
        the fast pick, else the wait on the markers). That turn came after the rest of
        this one (the ack's own write, the task's events, the timers): ~0.3 ms of the
        child's wait for its next task on a busy worker. Nothing where a wait is in
        flight already (its answer picks), outside the loop's thread or without a loop
        (a plain consumer picks when it asks), for a consumer with no room, or for one
        whose wait connection kombu has not registered (its turn does, and sends its
        own wait). A lost connection is left to the loop's own pick, which meets it
        again and recovers. (Not after a give-back, a yield's: Celery's
        ``worker_disable_prefetch`` counts the request as reserved until
        ``SitsRequest`` has forgotten it, after the release, so no pick could start.)"""
        if self.connection is None:  # (closed: a late ack through it, qos.py)
            return
        hub, cycle = self.connection._hub, self.connection.cycle
        if (hub is None or self._in_poll or not self.active_queues
                or threading.get_ident() != getattr(hub, "_loop_thread", None)
                or cycle._in_protected_read or not self.qos.can_consume()
                # (unregistered, kombu's next turn registers it and sends its own wait)
                or not cycle._client_registered(self, self.client, "BRPOP")):
            return
        try:
            self._brpop_start()
        except self.connection_errors as exc:
            logger.debug("pick after an ack failed (the loop's next turn retries): %s", exc)

    def _throttled(self) -> bool:
        """True while the worker's runtime profile pauses intake: look again in a second
        (running tasks go on; waiting ones stay for workers with room)."""
        if intake.paused() is None:
            return False
        self.connection.call_later(INTAKE_RECHECK_S)
        return True

    def _paused(self) -> bool:
        """True while only messages this consumer holds off were waiting: it looks again
        after the pause (a timer ends the hub's sleep then), not on the marker those
        messages keep set for the other consumers, which would wake it at once."""
        pause = self._held_pause_until - time.monotonic()
        if pause <= 0:
            return False
        self.connection.call_later(pause)
        return True

    def _brpop_read(self, **options: Any) -> bool:
        watched = self._watched
        try:
            if not self._in_poll:  # no wait in flight: a read would block for ever
                wait.stray_readable(self.client.connection, self.connection_errors)
            try:
                woke = self.client.parse_response(self.client.connection, "BZPOPMIN",
                                                  **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            finally:
                self._watched = ()
            if not woke:
                # Without an event loop (a plain consumer: remote-control replies) nothing
                # else picks: a wake-up another client took (a wait nobody reads, a
                # process killed mid-wait) would leave its message for ever. Picked once
                # the wait times out, it is late by brpop_timeout at most. (A worker's
                # loop picks every queue once a second: _fast_pick, _marked.)
                if self.connection._hub is None and self._pick_one(
                        [q for q in watched if q in self.active_queues]):
                    return True
                raise Empty()
            key = woke[0] if isinstance(woke[0], bytes) else str(woke[0]).encode()
            if self._throttled():
                # A wait sent before intake paused woke up: leave the message, and the
                # wake-up marker this wait took, to the workers with room.
                self.raw.zadd(key, {MARKER_MEMBER: 0})
                raise Empty()
            queue = self._marker_queue[key]
            if queue not in self._active_queues:
                # Sent before this queue's consumer was cancelled: the message is not
                # ours to take. Leave it, and its wake-up, to the queue's consumers.
                self._run("arm", queue, [])
                raise Empty()
            self._queue_cycle.rotate(queue)
            self._deliver(queue, self._consumer_pick(queue))
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            self._flush_brpop_reauth()

    def _size(self, queue: str) -> int:
        return int(self.raw.zcard(self.keys(queue).waiting))

    def _purge(self, queue: str) -> int:
        try:
            self.keys(queue)
        except InvalidQueueName as exc:
            # No SITS queue has that name, so it holds nothing: said in one line (``celery
            # purge -Q 'b{r}'`` ended on a traceback)
            logger.warning("%s: no SITS queue has it, nothing to purge", exc)
            return 0
        total = 0
        while ids := self._run("purge", queue, [PURGE_CHUNK]):
            total += len(ids)
            self._replicas_gone(queue, [text(i, "replace") for i in ids])
        return total

    def _delete(self, queue: str, exchange: str, routing_key: str, pattern: str, *args: Any,
                **kwargs: Any) -> None:
        if getattr(self, "_closing", False):
            # kombu's close deletes the channel's auto-delete fanout queues (Celery's
            # gossip, its events): with Redis away the error escaped the close, and
            # Celery's consumer restart, whose connection is gone by then, logged some
            # 60 lines of "Error on restarting Gossip: AttributeError" at each outage
            try:
                self._delete_queue(queue, exchange, routing_key, pattern)
            except self.connection_errors as exc:
                logger.debug("queue %r not deleted at the channel's close: %s", queue, exc)
            return
        self._delete_queue(queue, exchange, routing_key, pattern)

    def _delete_queue(self, queue: str, exchange: str, routing_key: str, pattern: str
                      ) -> None:
        self.auto_delete_queues.discard(queue)
        if self._site_sync(queue) is not None:  # its tasks' replicas at the peer go too
            ids = [text(i, "replace") for i in self.raw.hkeys(self.keys(queue).payloads)]
            for at in range(0, len(ids), PURGE_CHUNK):
                self._replicas_gone(queue, ids[at:at + PURGE_CHUNK])
        member = self.sep.join([routing_key or "", pattern or "", queue or ""])
        removals = [(self.global_keyprefix + self.keyprefix_queue % (exchange,), member),
                    (self.global_keyprefix + self.keyprefix_binding_permanent % (exchange,),
                     member),
                    (queues_registry(self.global_keyprefix), queue)]
        with self.raw.pipeline(transaction=False) as pipe:
            for key, value in removals:
                pipe.srem(key, value)
            # UNLINK frees large hashes off the main thread.
            pipe.unlink(*self.keys(queue).all())
            *removed, unlinked = pipe.execute(raise_on_error=False)
        # A set of another type (another program's, on the registry's key): logged. Raised,
        # it failed every remote-control call (kombu deletes each reply queue after use),
        # and the queue's own keys were gone all the same.
        for (key, _), reply in zip(removals, removed, strict=True):
            if isinstance(reply, redis.ResponseError):
                logger.warning("could not take queue %r off %s: %s", queue, key, reply)
        if isinstance(unlinked, Exception):
            raise unlinked

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        k = self.keys(queue)
        return bool(self.raw.exists(k.waiting, k.unacked))

    def _restore(self, message: Any, leftmost: bool = False) -> None:
        queue = message.delivery_info.get("sits_queue")
        if queue is not None:
            self._run("restore", queue, ["-", 0, message.delivery_tag])

    # -- inspection ------------------------------------------------------------------------
    def dead_letters(self, queue: str) -> dict[str, Any]:
        raw = self.raw.hgetall(self.keys(queue).dead)
        return {text(k): json.loads(v) for k, v in raw.items()}


class MultiChannelPoller(kredis.MultiChannelPoller):
    def maybe_restore_messages(self) -> None:
        """Every consuming channel's sweep, not the first one's: kombu keeps one unacked
        index for all queues, where ours are per queue (a sweep covers its channel's
        queues), and which channel came first was arbitrary (a worker's pidbox channel's
        sweep left its task queues unswept)."""
        for channel in list(self._channels):
            if not channel.active_queues:
                continue
            try:
                channel.qos.restore_visible(num=channel.unacked_restore_limit,
                                            interval=channel.unacked_restore_throttle)
            except channel.connection_errors:
                # the polling loop reconnects; the next tick sweeps again
                logger.debug("unacked sweep: connection error; next tick", exc_info=True)


class Transport(kredis.Transport):
    Channel = Channel
    driver_type = "redis"
    driver_name = "redis"
    _hub: Any = None
    _wake_scheduled = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle = MultiChannelPoller()  # type: ignore[assignment]  # (kombu: FairCycle)

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        self._hub = loop

    def call_later(self, delay_s: float) -> None:
        """Make the event loop turn again in ``delay_s`` (its tick callbacks then run,
        the fast pick among them). Without a hub (a plain drain_events loop) there is
        nothing to wake: that loop polls again by itself.

        The hub computed this turn's poll timeout from its timers before the tick
        callbacks ran, this one's caller among them: a timer added now was not in it,
        and the loop slept on to the next older timer (up to 1 s). A worker holding off
        given-back messages looked again every ~0.5-1 s, not every 0.25, and every task
        put meanwhile waited for it. The hub is woken, so that the next turn's timeout
        counts this timer."""
        if self._hub is not None and not self._wake_scheduled:
            self._wake_scheduled = True
            self._hub.call_later(delay_s, self._woken)
            self.wake_hub()

    def _woken(self) -> None:
        self._wake_scheduled = False

    def wake_hub(self) -> None:
        """Make the event loop's next poll return at once.

        A fast pick delivers from a tick callback. The hub computed its poll timeout (up
        to 1 s) before the tick callbacks ran, and the prefork pool writes jobs to its
        children from a tick callback of its own, which may have run already this turn:
        without a wake-up the job would sit in the pool's outbox until the poll times
        out. The hub has no public wake for its own thread, hence its waker.
        """
        waker = getattr(self._hub, "_waker", None)
        if waker is not None:
            waker.wake()
