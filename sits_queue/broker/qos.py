"""Ack emulation for the sorted-set transport: kombu's Redis QoS, re-pointed at the
per-queue unacked sets that ``pick.lua`` fills (ack, reject, release, restore and the
heartbeat of held messages each run on the message's own queue)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

from kombu.transport import redis as kredis
from kombu.transport import virtual

from sits_queue.broker import affinity
from sits_queue.broker.keys import batch_units, queues_registry

logger = logging.getLogger(__name__)

#: Restored per sweep per queue: a crashed worker's backlog comes back over a few sweeps.
RESTORE_LIMIT = 1000


class QoS(kredis.QoS):
    """Ack emulation over the per-queue unacked sets.

    ``pick.lua`` already recorded the message as unacked, so ``append`` only keeps the
    local bookkeeping; ack, reject and restore run one script on the message's queue.
    """

    restore_at_shutdown = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_sweep = 0.0
        self._last_heartbeat = time.monotonic()

    def _queue_of(self, delivery_tag: str) -> str | None:
        message = self._delivered.get(delivery_tag)
        if message is None:
            return None
        queue: str | None = message.delivery_info.get("sits_queue")
        return queue

    def append(self, message: Any, delivery_tag: str) -> None:
        virtual.QoS.append(self, message, delivery_tag)

    def can_consume(self) -> bool:
        """Prefetch counts pool jobs: a batch (one pick, one job) counts once."""
        pcount = self.prefetch_count
        return not pcount or held_units(self._delivered, self._dirty) < pcount

    def ack(self, delivery_tag: str) -> None:
        queue = self._queue_of(delivery_tag)
        if queue is not None:
            self.channel._ack(queue, [delivery_tag])
            self.channel._replicas_gone(queue, [delivery_tag])
        virtual.QoS.ack(self, delivery_tag)
        affinity.invalidate()  # its child has published what it holds now

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        queue = self._queue_of(delivery_tag)
        if queue is not None:
            if requeue:
                self.channel._run("restore", queue, ["-", 0, delivery_tag])
            else:
                # Rejected for good (unknown task, Reject(requeue=False)): keep it inspectable.
                self.channel._run("dead", queue, [time.time(), "rejected by consumer",
                                                  delivery_tag])
                self.channel._replicas_gone(queue, [delivery_tag])
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
        queue = self._queue_of(delivery_tag)
        hold = 0.0
        if queue is not None:
            _, hold_text = self.channel._run("release", queue, [
                self.channel.consumer_id, time.time(), first_hold_s,
                max(first_hold_s, longest_hold_s), delivery_tag])
            hold = float(hold_text)
        virtual.QoS.ack(self, delivery_tag)  # forget it locally; Redis already has it back
        return hold

    def _held_by_queue(self) -> dict[str, list[str]]:
        """Delivery tags this channel holds (running or reserved), grouped by queue."""
        by_queue: dict[str, list[str]] = defaultdict(list)
        for tag in list(self._delivered):
            queue = self._queue_of(tag)
            if queue is not None:
                by_queue[queue].append(tag)
        return by_queue

    def restore_unacked(self, client: Any = None) -> None:
        by_queue = self._held_by_queue()
        for queue, tags in by_queue.items():
            self.channel._run("restore", queue, ["-", 0, *tags])
        self._delivered.clear()

    def restore_visible(self, start: int = 0, num: int | None = 10, interval: int = 10) -> None:
        """Heartbeat held messages, then restore messages whose holder went silent."""
        self.channel._deferred.poll()  # an idle worker's owed ack replies, errors too
        now_mono = time.monotonic()
        period = self.channel.visibility_timeout / 3
        if now_mono - self._last_heartbeat >= period:
            self.heartbeat()
        if now_mono - self._last_sweep < period:
            return
        self._last_sweep = now_mono
        ceiling = time.time() - self.channel.visibility_timeout
        durable = [q for q in self.channel.active_queues if q not in self.channel._expires]
        if durable:  # consumers keep the registry whole too (the rescoring pass reads it)
            self.channel.raw.sadd(queues_registry(self.channel.global_keyprefix), *durable)
        for queue in self.channel.active_queues:
            restored = self.channel._run("restore", queue, [ceiling, num or RESTORE_LIMIT])
            if restored:
                logger.warning("restored %d message(s) of queue %r whose worker stopped "
                               "heartbeating for %.0f s", restored, queue,
                               self.channel.visibility_timeout)

    def heartbeat(self) -> None:
        """Push the deadline of every message this channel holds (running or reserved)."""
        self._last_heartbeat = time.monotonic()
        now = time.time()
        by_queue = self._held_by_queue()
        if not by_queue:
            return
        with self.channel.raw.pipeline(transaction=False) as pipe:
            for queue, tags in by_queue.items():
                pipe.zadd(self.channel.keys(queue).unacked, dict.fromkeys(tags, now), xx=True)
            pipe.execute()


def held_units(delivered: dict[str, Any], done: Any = ()) -> int:
    """Messages held and not ``done``, a batch counting as one (it is one pool job)."""
    return batch_units((tag, getattr(message, "delivery_info", None))
                       for tag, message in list(delivered.items()) if tag not in done)
