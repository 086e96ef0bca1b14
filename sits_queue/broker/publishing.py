"""The SITS channel's plumbing and publishing side: its Redis clients, queue keys and
scripts, and the put of a message (``put.lua``) with what follows it (the queues
registry, reply-queue expiry, the peer site's replica).

``transport.Channel`` builds on this class with the consuming side (picks, the blocking
wait, acks); the split keeps each module readable, not two kinds of channel.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from kombu.transport import redis as kredis
from kombu.utils.json import dumps

from sits_queue.broker import clock, payload, sites
from sits_queue.broker.fanout import DeferredCommands
from sits_queue.broker.keys import (
    REPLY_QUEUE_EXPIRES_MS,
    RESULT_QUEUE_EXPIRES_MS,
    QueueKeys,
    is_reply_queue,
    is_result_queue_name,
    queues_registry,
    score_base,
    site_local,
)
from sits_queue.broker.meta import WaitingMeta, due_at, task_id_of
from sits_queue.broker.scripts import Scripts
from sits_queue.broker.snapshot import SnapshotCache
from sits_queue.config import SitsConfig
from sits_queue.errors import Unroutable
from sits_queue.options import SUBMITTED_AT, UNCOUNTED_TASKS, TaskOptions
from sits_queue.priority.model import Scorer
from sits_queue.settings import config_from_options

logger = logging.getLogger(__name__)

#: Producers re-add their queues to the registry this often, s (heals a flushed registry).
REGISTRY_REFRESH_S = 10.0


class PublishingChannel(kredis.Channel):
    sits_config: dict[str, Any] | None = None
    from_transport_options = (*kredis.Channel.from_transport_options,  # type: ignore[assignment]
                              "sits_config")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config = (config_from_options(self.sits_config, "broker_transport_options")
                       if self.sits_config else SitsConfig())
        self.unacked_restore_throttle = 1  # our QoS throttles by time itself
        self._raw_client: redis.Redis | None = None
        self._raw_pool: Any = None
        self._closed_params: dict[str, Any] | None = None
        self._sync_client: tuple[Any, Any] | None = None
        self.scripts = Scripts.register()
        self._keys: dict[str, QueueKeys] = {}
        self._marker_queue: dict[bytes, str] = {}
        self._registry_refreshed: dict[str, float] = {}
        self.snapshots = SnapshotCache(self.config)
        #: Fanout publishes and, in a worker, acks: sent without waiting for the reply.
        self._deferred = DeferredCommands()

    # kombu's publish batches buffer plain Redis commands; a put here is a script whose
    # arguments (score, record) are computed per message. Bulk submission has its own path
    # (``sits_queue.broker.bulk.enqueue_many``), so producers publish one by one.
    @property
    def supports_batch_publish(self) -> bool:
        return False

    # -- plumbing --------------------------------------------------------------------------
    def _create_client(self, asynchronous: bool = False) -> Any:
        """kombu builds a new client per ``conn_or_acquire`` (events, fanout, bindings):
        ~0.2 ms of redis-py set-up each time. Reuse one per pool; clients are thread-safe."""
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        if self._sync_client is None or self._sync_client[0] is not pool:
            self._sync_client = (pool, super()._create_client(asynchronous=False))
        return self._sync_client[1]

    @property
    def raw(self) -> redis.Redis:
        """A client on kombu's pool that does not re-prefix keys (we prefix them ourselves);
        once the channel is closed, one of its own on the same server."""
        if self.connection is None and self._closed_params is not None:
            if self._raw_pool is not self._closed_params:
                self._raw_client = redis.Redis(
                    connection_pool=redis.ConnectionPool(**self._closed_params))
                self._raw_pool = self._closed_params
            assert self._raw_client is not None
            return self._raw_client
        pool = self.pool
        if self._raw_client is None or self._raw_pool is not pool:
            self._raw_client = redis.Redis(connection_pool=pool)
            self._raw_pool = pool
        return self._raw_client

    def keys(self, queue: str) -> QueueKeys:
        k = self._keys.get(queue)
        if k is None:
            k = self._keys[queue] = QueueKeys.for_queue(queue, self.global_keyprefix)
            self._marker_queue[k.marker.encode()] = queue
        return k

    def _run(self, script: str, queue: str, args: list[Any]) -> Any:
        return self.scripts.run(script, self.keys(queue), args, self.raw)


    # -- publishing ------------------------------------------------------------------------
    def basic_publish(self, message: dict[str, Any], exchange: str, routing_key: str,
                      **kwargs: Any) -> Any:
        """kombu's, but a task sent to an exchange whose routing key reaches no queue is
        refused (:class:`Unroutable`): kombu dropped it, unsaid, and its caller's
        ``get()`` waited for good (``apply_async(exchange="x", routing_key="y")`` with
        nothing bound; ``enqueue_many`` refused the same route). Other messages (control
        replies, events) are kombu's to deliver or drop, as on any transport."""
        headers = message.get("headers")
        if not exchange or not isinstance(headers, dict) or "task" not in headers \
                or self.typeof(exchange).type == "fanout":
            return super().basic_publish(message, exchange, routing_key, **kwargs)
        self._inplace_augment_message(message, exchange, routing_key)
        queues = self._lookup(exchange, routing_key)
        if not queues:
            # (kombu keeps exchange types in each connection's memory: one this producer
            # never declared is read as direct, a topic pattern matching nothing)
            unknown = "" if exchange in self.state.exchanges else (
                "; this producer has not declared that exchange, so kombu reads it as a "
                "direct one (a topic exchange: route the task to its queue, queue=, "
                "whose declaration declares the exchange)")
            raise Unroutable(
                f"task {headers.get('task')}[{headers.get('id')}]: exchange {exchange!r} "
                f"with routing key {routing_key!r} reaches no queue, so it was not sent: "
                "route it to a queue (queue=, or a task_routes entry's 'queue'), or "
                f"declare a queue bound to that key (task_queues){unknown}")
        for queue in queues:  # (what kombu's exchange types do)
            self._put(queue, message, **kwargs)
        return None

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str,
                    **kwargs: Any) -> None:
        """Events and broadcasts: PUBLISH without waiting for the reply (broker/fanout.py)."""
        if kwargs.get("_publish_batch") is not None:
            super()._put_fanout(exchange, message, routing_key, **kwargs)
            return
        # kombu's prefixed client puts global_keyprefix on PUBLISH's channel name.
        topics = [f"{self.global_keyprefix}{topic}"
                  for topic in self._get_publish_topics(exchange, routing_key)]
        self._deferred.publish(self.pool, topics, dumps(message))


    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        """One published message: one ``put.lua`` call (bulk submission has its own path,
        :meth:`_put_records_start`)."""
        kwargs.pop("_publish_batch", None)
        now = clock.now(self.raw)
        record = self._put_record(message, None, now, self.snapshots.scorer(self.raw, now))
        n, waiting = (int(x) for x in self.scripts.run("put", self.keys(queue), record,
                                                        self.raw))
        if self._result_put(queue, message):  # a result, kept until its client reads it
            self._after_put(queue, n, waiting, RESULT_QUEUE_EXPIRES_MS)
            return
        self._after_put(queue, n, waiting)
        self._replicate(queue, [record])

    def _put_record(self, message: dict[str, Any], options: TaskOptions | None, now: float,
                    scorer: Scorer) -> list[Any]:
        """One message's five ``put.lua`` arguments. ``options``: already validated ones
        (bulk submission), else they are read from the message's header."""
        meta = (WaitingMeta.of_message(self.config, message, now) if options is None else
                WaitingMeta(options, now, str(message["headers"].get("task", "")),
                            due_at(message["headers"]), task_id_of(message["headers"])))
        o = meta.options
        headers = message.get("headers")
        if isinstance(headers, dict) and SUBMITTED_AT in headers:
            # On Redis's clock, as the wait is: the worker that ends the task takes its
            # latency on it (the producer's own clock an hour out was an hour of latency)
            headers[SUBMITTED_AT] = now
        prio = scorer.score(o.sla_class, now, o.context_tokens, o.latency_sla_ms,
                            o.loss_sensitivity, o.input_entropy or 0.0, o.model)
        # "~": announce the class to running tasks, but count no arrival (put.lua)
        counted = "~" if meta.task in UNCOUNTED_TASKS else ""
        return [message["properties"]["delivery_tag"], payload.encode(message), meta.to_json(),
                score_base(prio), counted + o.sla_class]

    def _put_records_start(self, queue: str, args: list[Any]) -> Callable[[], int]:
        """Send one ``put.lua`` call of records made by :meth:`_put_record` now; the
        returned function waits for Redis's reply and returns how many were enqueued.

        Bulk submission builds its next chunk in between, so Redis's work on this chunk
        overlaps the producer's Python instead of being waited for.
        """
        reply = self.scripts.start("put", self.keys(queue), args, self.raw)

        def finish() -> int:
            n, waiting = (int(x) for x in reply())
            self._after_put(queue, n, waiting)
            self._replicate(queue, [args[i:i + 5] for i in range(0, len(args), 5)])
            return n

        return finish

    def _site_sync(self, queue: str) -> sites.SiteSync | None:
        """Multi-site deployments (``broker/sites.py``): who keeps ``queue``'s replica in
        step; None for one site, and for reply queues (they are not work)."""
        # (nor for the beat's control queue and workers' own queues: their tasks are
        # this site's, and replicated they filled the outbox while no peer was up)
        if self._expiry_ms(queue) is not None or site_local(queue):
            return None
        return sites.for_config(self.config)

    def _replicate(self, queue: str, records: list[Any]) -> None:
        """A put's records to the peer's replica, now or by the sync pass, as their
        class's sync mode says."""
        if (sync := self._site_sync(queue)) is not None:
            sync.on_put(queue, records)

    def _replicas_gone(self, queue: str, ids: list[str]) -> None:
        if (sync := self._site_sync(queue)) is not None:
            sync.on_ack(queue, ids)

    def _expiry_ms(self, queue: str) -> int | None:
        """How long an unused ``queue`` lives, ms (kombu's ``x-expires``): as declared on
        this channel, or, for a control reply queue another process declared (a worker
        replying to ``celery inspect``), :data:`REPLY_QUEUE_EXPIRES_MS`; None: for good."""
        if queue in self._expires:
            return int(self._expires[queue])
        return REPLY_QUEUE_EXPIRES_MS if is_reply_queue(queue) else None

    def _result_put(self, queue: str, message: dict[str, Any]) -> bool:
        """Whether ``message`` is an ``rpc://`` result put by a worker to its client's
        result queue, which the worker did not declare: a queue named by a UUID, and a
        message that is no task (task protocol 2 names its task in the headers)."""
        headers = message.get("headers")
        return (queue not in self._expires and is_result_queue_name(queue)
                and not (isinstance(headers, dict) and "task" in headers))

    def _after_put(self, queue: str, n: int, waiting: int,
                   expires: int | None = None) -> None:
        if (expires := expires or self._expiry_ms(queue)) is not None:
            # Reply queues come and go: keep them expiring and out of the registry (a
            # reply that comes after its client stopped waiting would stay for good).
            with self.raw.pipeline(transaction=False) as pipe:
                for key in self.keys(queue).all():
                    pipe.pexpire(key, expires)
                pipe.execute()
            if queue not in self._expires and queue not in self.active_queues:
                self._forget_keys(queue)  # a replier meets a new one per client
        elif waiting == n or time.monotonic() - self._registry_refreshed.get(
                queue, -REGISTRY_REFRESH_S) >= REGISTRY_REFRESH_S:
            # When this put made the queue appear (new, or Redis was flushed), and
            # periodically: idempotent, so a lost registry heals at once or within the period.
            self.register(queue)
            self._registry_refreshed[queue] = time.monotonic()

    def _forget_keys(self, queue: str) -> None:
        k = self._keys.pop(queue, None)
        if k is not None:
            self._marker_queue.pop(k.marker.encode(), None)

    def _new_queue(self, queue: str, auto_delete: bool = False, **kwargs: Any) -> None:
        self.keys(queue)  # validates the name, before kombu records the queue
        super()._new_queue(queue, auto_delete=auto_delete, **kwargs)
        if self._expiry_ms(queue) is None:  # reply queues come and go; do not list them
            self.register(queue)

    def register(self, *queues: str) -> None:
        """List ``queues`` in the registry the rescoring pass and ``sitsq status`` read.
        A registry of another type (another program's) is logged, not raised: after a
        put, the producer would retry the put and its task run twice; in a consumer's
        sweep, the restores after it never ran."""
        try:
            self.raw.sadd(queues_registry(self.global_keyprefix), *queues)
        except redis.ResponseError as exc:
            logger.warning("could not list queue(s) %s in %s: %s", list(queues),
                           queues_registry(self.global_keyprefix), exc)
