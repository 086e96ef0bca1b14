"""The consuming side's picks: ``pick.lua`` for a consumer, what it took handed to the
consumer (a batch between its marks, a malformed message dead-lettered on the way), and
which of its queues a consumer with room picks from, in which order, in how few round
trips (:meth:`PickingChannel._fast_pick`).

``transport.Channel`` builds on this class with the blocking wait, the acks and the
queue primitives; ``publishing.py`` is the side that puts.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import time
from collections.abc import Sequence
from typing import Any
from uuid import uuid4

import redis
from kombu.transport import virtual
from kombu.utils.json import dumps
from redis.exceptions import NoScriptError

from sits_queue.broker import affinity, clock, deadletters, intake, payload, wait
from sits_queue.broker.keys import CONTROL_QUEUE
from sits_queue.broker.payload import SitsMessage, poison_split
from sits_queue.broker.publishing import PublishingChannel
from sits_queue.checks import text

logger = logging.getLogger(__name__)

Empty = virtual.Empty
#: How long a consumer stops looking after a pick found only messages it holds off, s.
HELD_PAUSE_S = 0.25
#: Looked again this long after a hold of its own runs out, s.
HOLD_END_MARGIN_S = 0.002
#: Malformed messages skipped in one get before yielding to the event loop.
MAX_BAD_IN_A_ROW = 100
#: How long a consumer leaves a queue whose pick Redis refused (a key of the wrong type:
#: ``lua/queue_types.lua``), s; it is said in the log once a period.
REFUSED_PAUSE_S = 5.0
#: :meth:`PickingChannel._pick` was given no reply: it sends the pick itself.
UNSENT: Any = object()
#: A consumer picks from every queue at least this often, s, whatever its marker says: a
#: marker taken by a wait whose worker then died (or whose pick then failed) announces
#: none of the messages behind it.
SWEEP_S = 1.0


class PickingChannel(PublishingChannel):
    Message = SitsMessage

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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
        #: When every queue is picked next, whatever its marker (:data:`SWEEP_S`).
        self._sweep_due = 0.0
        #: The queues :meth:`_pick_next` last saw marked (or picked from).
        self._seen_marked: set[str] = set()
        self.affinity_policy = self.config.affinity
        self._warm_seen: affinity.Warm | None = None
        self._warm_args: list[Any] = []
        #: Messages this channel took ahead of their queue's head by affinity.
        self.affinity_picks = 0

    def _pick_args(self, batch_window: int, no_ack: bool = False) -> list[Any]:
        """``pick.lua``'s arguments for this consumer."""
        warm = affinity.warm_now() if self.affinity_policy.enabled else affinity.NOTHING_WARM
        if warm is not self._warm_seen:  # the warm set is re-read rarely; picks are many
            self._warm_seen, self._warm_args = warm, affinity.lua_args(self.affinity_policy,
                                                                       warm)
        extra = ["noack"] if no_ack else self._warm_args
        return [clock.now(self.raw), self.config.max_redeliveries, self.consumer_id,
                batch_window, *extra]

    def _pick(self, queue: str, batch_window: int, no_ack: bool = False,
              reply: Any = UNSENT) -> list[SitsMessage]:
        """The best message for this consumer, with its batch kin when ``batch_window``
        allows (``pick.lua``), as kombu messages; raises Empty when there is none.
        ``reply``: that of a pick sent already (:meth:`_pick_next`), an error unraised."""
        if self._refused_until.get(queue, 0.0) > time.monotonic():
            raise Empty()
        for _ in range(MAX_BAD_IN_A_ROW):
            if reply is UNSENT or isinstance(reply, NoScriptError):  # (this one reloads)
                try:
                    reply = self._run("pick", queue, self._pick_args(batch_window, no_ack))
                except redis.ResponseError as exc:
                    reply = exc
            if isinstance(reply, redis.ResponseError):
                # The queue, not the worker: raised, it stopped the worker ("Unrecoverable
                # error"), and every worker of the queue after it. The pick wrote nothing.
                self._refused(queue, reply)
                raise Empty() from reply
            if self._refused_until.pop(queue, None) is not None:
                logger.info("queue %r: Redis takes its picks again", queue)
            picked, poisoned = poison_split(reply)
            if poisoned:  # dead-lettered by the pick: the log says so (it said only that
                # a dead worker's were restored), their replicas go as an ack's would,
                # and their callers learn why
                logger.error("queue %r: %d message(s) redelivered more than %d times "
                             "dead-lettered as poison (sitsq dead list): %s", queue,
                             len(poisoned), self.config.max_redeliveries,
                             ", ".join(map(text, poisoned[:10])))
                self._replicas_gone(queue, poisoned)
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
            reply = UNSENT  # all of it dead-lettered: pick again
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

    def _control_first(self) -> list[str]:
        """The active queues in kombu's fair order, the control queue first: its
        maintenance passes are short and few (the beat sends one of each at a time), and
        taken in turn with the others, on a worker whose every slot was busy with long
        tasks, they waited behind one task each (BZPOPMIN reads its keys in order too)."""
        queues = self._queue_cycle.consume(len(self.active_queues))
        return sorted(queues, key=lambda q: q != CONTROL_QUEUE)

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
                if not self._pick_next(self._control_first()):
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

    def _pick_next(self, queues: list[str]) -> bool:
        """:meth:`_pick_one` among those of ``queues`` whose wake-up marker is set.

        A queue with messages waiting has its marker (``put.lua`` sets it, and a pick
        that leaves messages sets it again); an empty one has it only until a pick or a
        wait finds it so. Without this each fast pick ran the pick script on every queue
        the worker consumes (its own, the control queue, the pre-warm one): three round
        trips where the load leaves the queues empty between arrivals. A marker that
        cannot be read (another type of key) counts as set: the pick says why. Every
        :data:`SWEEP_S`, and for a queue whose pick Redis refused, all are picked.

        The queue last seen marked (else the first after the control queue) is picked in
        the round trip that reads the others' markers: a freed slot waited for two (the
        markers, then the pick), ~0.25 ms of its ~1.2 ms between one task and the next
        on a busy worker. Should a queue ahead of it turn out marked (a beat's pass in
        the control queue), that one is picked first, as before, and what the early
        pick took goes back uncounted, where it was (``release.lua``), unless the
        consumer still has room for it.
        """
        now = time.monotonic()
        if len(queues) < 2 or now >= self._sweep_due:
            self._sweep_due = now + SWEEP_S
            return self._pick_one(queues)
        # the one likeliest to be picked: marked at the last look, or picked from then
        work = [q for q in queues if q != CONTROL_QUEUE] or queues
        first = next((q for q in work if q in self._seen_marked), work[0])
        if first in self._refused_until:  # (its pick says when it serves again)
            return self._pick_one(self._marked(queues))
        others = [q for q in queues if q != first]
        names = self.keys(first).all()
        window = self.config.batch_window
        no_ack = first in self._no_ack
        marks, reply = wait.marked_and(self.raw, [self.keys(q).marker for q in others], (
            "EVALSHA", self.scripts.shas["pick"], len(names), *names,
            *self._pick_args(window, no_ack)))
        on = {q for q, set_ in zip(others, marks, strict=True)
              if set_ or q in self._refused_until}
        self._seen_marked = on
        at = queues.index(first)
        ahead = [q for q in queues[:at] if q in on]
        if ahead and self._pick_one(ahead):
            self._settle_early(first, window, no_ack, reply)
            return True
        try:
            batch = self._pick(first, window, no_ack, reply)
        except Empty:
            return self._pick_one([q for q in queues[at + 1:] if q in on])
        on.add(first)  # (what is left of its messages keeps its marker set)
        self._queue_cycle.rotate(first)
        self._deliver(first, batch)
        return True

    def _settle_early(self, queue: str, window: int, no_ack: bool, reply: Any) -> None:
        """What an early pick of ``queue`` took (:meth:`_pick_next`), after a queue ahead
        of it was served: delivered if the consumer has room still, else put back."""
        if isinstance(reply, redis.ResponseError):
            return  # nothing was taken (a refused pick is met again at the next one)
        try:
            batch = self._pick(queue, window, no_ack, reply)
        except Empty:
            return
        if no_ack or self.qos.can_consume():  # (no_ack: Redis forgot it; no prefetch)
            self._queue_cycle.rotate(queue)
            self._deliver(queue, batch)
        else:
            self.qos._release(queue, [m.delivery_tag for m in batch])

    def _marked(self, queues: list[str]) -> list[str]:
        """Those of ``queues`` whose wake-up marker is set (:meth:`_pick_next`), in order:
        one round trip for all of them."""
        marked = wait.marked(self.raw, [self.keys(q).marker for q in queues])
        return [q for q, on in zip(queues, marked, strict=True)
                if on or q in self._refused_until]
