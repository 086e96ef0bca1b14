"""kombu transport whose queues are Redis sorted sets ordered by a live priority score.

Built on kombu's Redis transport: connection handling, fanout (pub/sub), events,
remote control, the event-loop poller and Sentinel support are inherited; only the
queue primitives (put, get, the blocking wait, size, purge, delete) and the ack
emulation (QoS, ``qos.py``) are replaced: the put and the channel's plumbing in
``publishing.py``, the rest here. See ``keys.py`` for the key layout and ``lua/``
for the atomic steps.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import time
from collections.abc import Sequence
from typing import Any
from uuid import uuid4

import redis
from kombu.transport import redis as kredis
from kombu.transport import virtual
from kombu.utils.json import dumps

from sits_queue.broker import affinity, clock, deadletters, intake, payload, wait
from sits_queue.broker.keys import CONTROL_QUEUE, MARKER_MEMBER, queues_registry
from sits_queue.broker.payload import SitsMessage, poison_split, text
from sits_queue.broker.publishing import PublishingChannel
from sits_queue.broker.qos import QoS
from sits_queue.errors import InvalidQueueName

logger = logging.getLogger(__name__)

Empty = virtual.Empty
#: Messages moved per Lua call when purging: bounds how long one call holds Redis.
PURGE_CHUNK = 1000
#: How long a consumer stops looking after a pick found only messages it holds off, s.
HELD_PAUSE_S = 0.25
#: Looked again this long after a hold of its own runs out, s.
HOLD_END_MARGIN_S = 0.002
#: How soon a consumer whose intake is paused looks again, s.
INTAKE_RECHECK_S = 1.0
#: Malformed messages skipped in one get before yielding to the event loop.
MAX_BAD_IN_A_ROW = 100
#: How long a consumer leaves a queue whose pick Redis refused (a key of the wrong type:
#: ``lua/queue_types.lua``), s; it is said in the log once a period.
REFUSED_PAUSE_S = 5.0
#: A consumer picks from every queue at least this often, s, whatever its marker says: a
#: marker taken by a wait whose worker then died (or whose pick then failed) announces
#: none of the messages behind it.
SWEEP_S = 1.0


class Channel(PublishingChannel):
    Message = SitsMessage
    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The queues the blocking wait in flight watches; () once it is answered.
        self._watched: tuple[str, ...] = ()
        #: Queues consumed without acks (kombu's no_ack): their picks forget what they take.
        self._no_ack: set[str] = set()
        #: Who this channel is to pick.lua/release.lua: a message it released with a
        #: hold is not offered back to it until the hold runs out.
        self.consumer_id = uuid4().hex
        self._held_pause_until = 0.0
        #: When (monotonic s) holds this channel gave runs out, soonest first.
        self._hold_ends: list[float] = []
        #: Queues whose pick Redis refused, and until when (monotonic s) they are left.
        self._refused_until: dict[str, float] = {}
        self._sweep_due = 0.0
        #: Why the consumer is about to reject a delivered message, and whether its task
        #: fails with it (``workers/consumer.py``); read by ``QoS.reject``.
        self.reject_reasons: dict[str, tuple[str, bool]] = {}
        self.affinity_policy = self.config.affinity
        self._warm_seen: affinity.Warm | None = None
        self._warm_args: list[Any] = []
        #: Messages this channel took ahead of their queue's head by affinity.
        self.affinity_picks = 0

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
            self._deferred.close()
            if self._in_poll and self._watched:
                # kombu would read the wait's answer first: up to brpop_timeout, then a
                # pick for a closing consumer. A wait holds no message: give it up.
                self._give_up_wait()
        super().close()

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

    def _pick(self, queue: str, batch_window: int, no_ack: bool = False) -> list[SitsMessage]:
        """The best message for this consumer, with its batch kin when ``batch_window``
        allows (``pick.lua``), as kombu messages; raises Empty when there is none."""
        warm = affinity.warm_now() if self.affinity_policy.enabled else affinity.NOTHING_WARM
        if warm is not self._warm_seen:  # the warm set is re-read rarely; picks are many
            self._warm_seen, self._warm_args = warm, affinity.lua_args(self.affinity_policy,
                                                                       warm)
        extra = ["noack"] if no_ack else self._warm_args
        if self._refused_until.get(queue, 0.0) > time.monotonic():
            raise Empty()
        for _ in range(MAX_BAD_IN_A_ROW):
            try:
                reply = self._run("pick", queue, [clock.now(self.raw),
                                                  self.config.max_redeliveries,
                                                  self.consumer_id, batch_window, *extra])
            except redis.ResponseError as exc:
                # The queue, not the worker: raised, it stopped the worker ("Unrecoverable
                # error"), and every worker of the queue after it. The pick wrote nothing.
                self._refused(queue, exc)
                raise Empty() from exc
            if self._refused_until.pop(queue, None) is not None:
                logger.info("queue %r: Redis takes its picks again", queue)
            picked, poisoned = poison_split(reply)
            if poisoned:  # dead-lettered by the pick: their replicas go as an ack's would,
                self._replicas_gone(queue, poisoned)  # and their callers learn why
                deadletters.fail_tasks(self.raw, self.keys(queue).dead, poisoned)
            if isinstance(picked, int) and picked > 0:
                # Only messages this consumer released (and still holds off) wait at the
                # head: pause briefly, or the marker they keep set would wake us at once.
                self._held_pause_until = time.monotonic() + self._held_pause_s()
                raise Empty()
            if not picked:
                raise Empty()
            if no_ack:  # acked by the pick itself: the replicas go as an ack's would
                self._replicas_gone(queue, [text(i, "replace")
                                            for i in [picked[0], *picked[5::3]]])
            first = self._decode(queue, picked, no_ack)
            batch: list[SitsMessage] = [first] if first is not None else []
            for i in range(5, len(picked) - 2, 3):  # the kin pick.lua took with it
                kin = self._decode(queue, picked[i:i + 3], no_ack)
                if kin is not None:
                    batch.append(kin)
            if len(batch) > 1:
                payload.mark(batch, batch[0].delivery_tag)
            if batch:
                return batch
        raise Empty()

    def _refused(self, queue: str, exc: redis.ResponseError) -> None:
        """Leave ``queue`` for :data:`REFUSED_PAUSE_S` after Redis refused its pick, and
        say so; the other queues are served meanwhile."""
        if queue not in self._refused_until:  # once per spell, not once per pick
            logger.error("queue %r: Redis refused its pick (%s); its messages stay where "
                         "they are, other queues are served, and it is tried again every "
                         "%.0f s", queue, exc, REFUSED_PAUSE_S)
        self._refused_until[queue] = time.monotonic() + REFUSED_PAUSE_S

    def _consumer_pick(self, queue: str) -> list[SitsMessage]:
        """:meth:`_pick` for the consumer of ``queue`` (``basic_consume``)."""
        return self._pick(queue, self.config.batch_window, no_ack=queue in self._no_ack)

    def _deliver(self, queue: str, batch: list[SitsMessage]) -> None:
        """Hand a pick's messages to the consumer, a batch between its two marks."""
        if len(batch) == 1:
            self._hand_over(queue, batch[0])
            return
        self._deliver_group(queue, batch, batch[0].delivery_tag)

    def _deliver_group(self, queue: str, batch: list[SitsMessage], group: str) -> None:
        intake.batch_delivery(group, done=False)
        handed = 0
        try:
            for message in batch:
                handed += 1
                self._hand_over(queue, message)
        except BaseException:
            # The pick took the whole batch off the queue: those not handed over are
            # unacked in Redis but held by no one (neither heartbeated nor given back at
            # close). Back uncounted: they never ran.
            if rest := [m.delivery_tag for m in batch[handed:]]:
                with contextlib.suppress(Exception):
                    self.qos._release(queue, rest)
            raise
        finally:
            intake.batch_delivery(group, done=True)

    def _hand_over(self, queue: str, message: SitsMessage) -> None:
        """One message to its consumer. In a worker, one the consumer raises on (a message
        no check here foresaw that Celery cannot take) is dead-lettered with the error:
        raised on, it would stop the worker's event loop, and every worker's after it,
        held by no one and never counted (a KeyError would even pass for a lost
        connection)."""
        try:
            self.connection._deliver(message, queue)
        except Exception as exc:
            if not intake.guards_deliveries() or not self.refuse(queue, message, exc):
                raise
            logger.error("queue %r message %s: its consumer raised; moved to dead letters",
                         queue, message.delivery_tag, exc_info=exc)

    def refuse(self, queue: str, message: Any, exc: Exception) -> bool:
        """Dead-letter a delivered ``message`` of ``queue`` its consumer could not take,
        with the error, and forget it here (Redis has it parked); False, and nothing
        done, for a lost connection, which is no fault of the message (the caller raises
        it: a KeyError is the message's, though kombu counts it as a connection error)."""
        if isinstance(exc, self.connection_errors) and not isinstance(exc, KeyError):
            return False
        tag = message.delivery_tag
        self._dead_letter(queue, [tag, dumps(message.serializable())], exc,
                          queue in self._no_ack, "consumer refused it")
        if tag in self.qos._delivered:
            virtual.QoS.ack(self.qos, tag)
        return True

    def join_pick(self, queue: str, key: str, most: int, group: str) -> int:
        """Up to ``most`` waiting tasks of batch key ``key`` for a running batch's free
        rows (``pick.lua``'s join mode, ``workers/joins.py``), delivered to the consumer
        as batch ``group``; how many came."""
        picked = self._run("pick", queue, [clock.now(self.raw), self.config.max_redeliveries,
                                           self.consumer_id, self.config.batch_window,
                                           "join", key, most])
        batch = [m for i in range(0, len(picked) - 2, 3)
                 if (m := self._decode(queue, picked[i:i + 3])) is not None]
        if batch:
            self._deliver_group(queue, payload.mark(batch, group), group)
        return len(batch)

    def _decode(self, queue: str, picked: list[Any], no_ack: bool = False) -> SitsMessage | None:
        """One picked message ([id, payload, times, checkpoint, by affinity], the last two
        optional) as kombu's message; None after dead-lettering it as malformed.

        Everything that could fail on the way to the consumer runs here, the building of
        kombu's message (which decodes the body) included: outside, the error would stop
        the worker's event loop with the message unacked but held by no one, and so
        neither heartbeated nor dead-lettered, crashing a worker again after each
        visibility timeout.
        """
        try:
            tag = text(picked[0])
            by_affinity = len(picked) > 4 and bool(int(picked[4]))
            checkpoint = picked[3] if len(picked) > 3 else None
            message = payload.decode(picked[1], self.codecs)
            payload.prepare(message, queue, tag, int(picked[2]), checkpoint, by_affinity)
            built = self.Message(message, channel=self)
            if built.errors:  # kombu keeps a body it could not decompress, raising later
                raise payload.MalformedPayload(
                    f"body does not decompress ({built.headers.get('compression')!r}): "
                    f"{built.errors[0][1]!r}")
            payload.check_task_body(built)
            # On the clock Celery's timer holds an ETA on (monotonic): a task picked
            # before it was due takes its turn in the queue once due (workers/etaorder.py)
            built.picked_at = time.monotonic()
        except Exception as exc:
            self._dead_letter(queue, picked, exc, no_ack)
            return None
        self.affinity_picks += by_affinity
        return built

    def note_hold(self, hold_s: float) -> None:
        """A message this channel gave back is held off from it for ``hold_s``."""
        now = time.monotonic()
        while self._hold_ends and self._hold_ends[0] <= now:  # (run out: bounded)
            heapq.heappop(self._hold_ends)
        if hold_s > 0:
            heapq.heappush(self._hold_ends, now + hold_s)

    def _held_pause_s(self) -> float:
        """How long to stop looking when only messages this consumer holds off wait:
        until the soonest of its holds runs out, at most HELD_PAUSE_S. (Always that
        long, a rate-limited task given back until its bucket's next token came back
        up to 0.25 s late: '10/s' ran at about 7.5/s on one slot.)"""
        now = time.monotonic()
        ends = self._hold_ends
        while ends and ends[0] <= now:
            heapq.heappop(ends)
        if not ends:
            return HELD_PAUSE_S
        # (a hair past it: the pick compares against Redis's clock, not ours)
        return min(HELD_PAUSE_S, ends[0] - now + HOLD_END_MARGIN_S)

    def _dead_letter(self, queue: str, picked: list[Any], exc: Exception, no_ack: bool,
                     why: str = "malformed payload") -> None:
        deadletters.park(self, queue, picked, exc, no_ack, why)

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

    def _control_first(self) -> list[str]:
        """The active queues in kombu's fair order, the control queue first: its
        maintenance passes are short and few (the beat sends one of each at a time), and
        taken in turn with the others, on a worker whose every slot was busy with long
        tasks, they waited behind one task each (BZPOPMIN reads its keys in order too)."""
        queues = self._queue_cycle.consume(len(self.active_queues))
        return sorted(queues, key=lambda q: q != CONTROL_QUEUE)

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

    def _fast_pick(self) -> bool:
        """Event-loop path: pick straight away while the consumer has room.

        A slot that frees while messages wait would otherwise cost a BZPOPMIN round trip
        and an extra loop turn before the pick. Returns True when it stopped because the
        consumer is full (then no blocking wait is needed), False when the queues are
        empty (the caller blocks on the markers).
        """
        delivered = False
        try:
            while self.qos.can_consume():
                if not self._pick_one(self._marked(self._control_first())):
                    return False
                delivered = True
            return True
        finally:
            if delivered:
                self.connection.wake_hub()

    def _pick_one(self, queues: Sequence[str]) -> bool:
        """Deliver the first pick that finds a message among ``queues``, in order; False
        when none did."""
        for queue in queues:
            try:
                batch = self._consumer_pick(queue)
            except Empty:
                continue
            self._queue_cycle.rotate(queue)
            self._deliver(queue, batch)
            return True
        return False

    def _marked(self, queues: list[str]) -> list[str]:
        """Those of ``queues`` whose wake-up marker is set, in order: one round trip for
        all of them. A queue with messages waiting has it (``put.lua`` sets it, and a
        pick that leaves messages sets it again); an empty one has it only until a pick
        or a wait finds it so. Without this each fast pick ran the pick script on every
        queue the worker consumes (its own, the control queue, the pre-warm one): three
        round trips where the load leaves the queues empty between arrivals. A marker
        that cannot be read (another type of key) counts as set: the pick says why. Every
        :data:`SWEEP_S`, and for a queue whose pick Redis refused, all are picked."""
        now = time.monotonic()
        if len(queues) < 2 or now >= self._sweep_due:
            self._sweep_due = now + SWEEP_S
            return queues
        marked = wait.marked(self.raw, [self.keys(q).marker for q in queues])
        return [q for q, on in zip(queues, marked, strict=True)
                if on or q in self._refused_until]

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
        nothing to wake: that loop polls again by itself."""
        if self._hub is not None and not self._wake_scheduled:
            self._wake_scheduled = True
            self._hub.call_later(delay_s, self._woken)

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
