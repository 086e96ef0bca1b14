"""Bulk submission: many calls of one SitsTask, validated once, enqueued in few round trips.

``enqueue_many(task, [(a1,), (a2,), ...], sla_class="low")`` does what
``[task.apply_async(args, sla_class="low") for args in ...]`` does, with the per-call work
hoisted out of the loop: SITS options are resolved and validated once (only the input
entropy is measured per item), routing, time limits and the queue declaration happen
once, and each chunk of messages reaches Redis as one ``put.lua`` call
(:meth:`Channel._put_records_start`) instead of one round trip per task, and the next
chunk is built while Redis runs the previous one.

Each message is built by Celery's own ``amqp.create_task_message`` (protocol 2) and
turned into a transport message by kombu's own ``Channel.prepare_message`` and
``Channel._inplace_augment_message``, with the same body serialization, properties and
headers as ``Producer.publish`` gives, so a worker cannot tell it from ``apply_async``'s.
``task-sent`` events go out as one ``task.multi`` event per chunk (the batching Celery
workers use for their own task events; Flower's receiver unpacks it).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from celery import Celery, signals
from celery.app.task import Task
from celery.utils.nodenames import anon_nodename
from celery.utils.time import subtract_datetimes
from kombu.compression import compress
from kombu.entity import Queue, maybe_delivery_mode
from kombu.serialization import dumps
from kombu.utils.uuid import uuid

from sits_queue.app import sits_config
from sits_queue.broker import clock
from sits_queue.broker.fastencode import fast_saferepr, plain_json
from sits_queue.calloptions import (
    call_options,
    check_later_steps,
    hand_made_header,
    header_options,
    routed_options,
    sits_headers,
)
from sits_queue.delivery import check_delivery, drop_delivery_only
from sits_queue.errors import SitsError
from sits_queue.etas import read_eta
from sits_queue.options import (
    HEADER,
    OPTION_NAMES,
    SUBMITTED_AT,
    TaskOptions,
    derive_prefix_key,
    route_maintenance,
    unchanged,
)
from sits_queue.priority.entropy import input_entropy

#: Messages per ``put.lua`` call. Throughput is flat from ~200 up (the round trip is paid
#: once per chunk), while one call of 1000 holds Redis 15-30 ms on a small 2-core host and
#: workers' picks wait behind it; 200 keeps each call to a few ms.
DEFAULT_CHUNK = 200
#: Largest chunk accepted: 10,000 messages hold Redis for a few hundred milliseconds.
MAX_CHUNK = 10_000
#: A chunk also ends once its encoded messages reach this many bytes: counted in
#: messages alone, 200 of 50 MB each would have been built in memory at once (three took
#: a producer to 926 MB).
CHUNK_BYTES = 64 * 2**20
#: ``apply_async`` options ``enqueue_many`` understands (besides the SITS options). Others
#: (``task_id``, ``exchange``, ``retry``...) make no sense for a batch or are not supported.
SUPPORTED_OPTIONS = frozenset({
    "queue", "priority", "serializer", "compression", "headers",
    "ignore_result", "time_limit", "soft_time_limit", "expires", "countdown", "eta",
    "shadow", "link", "link_error", "producer", "delivery_mode",
})


class BulkEnqueueError(SitsError):
    """Sending a chunk failed after earlier chunks were enqueued, or with a chunk's fate
    unknown.

    ``task_ids`` lists the tasks that are in the queue. ``uncertain_ids``: a chunk whose
    reply was lost with its connection (Redis may or may not have run it; none of its
    messages is still waiting, so if it ran they were all taken already): check them
    (``AsyncResult``) before sending them again. The items after both were not sent. A
    chunk is one atomic Lua call, so no chunk is ever half-enqueued.
    """

    def __init__(self, message: str, task_ids: list[str],
                 uncertain_ids: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.task_ids = task_ids
        self.uncertain_ids = list(uncertain_ids)


# -- the SITS part of apply_async, as reusable steps -------------------------------------------
# -- what stays the same for every item of one call ----------------------------------------------
@dataclass(frozen=True)
class _Plan:
    """Everything ``send_task`` + ``Producer.publish`` decide per call, decided once."""

    name: str
    queue: Queue
    qname: str
    priority: int
    delivery_mode: int
    serializer: str
    compression: str | None
    expiration: str | None
    headers: dict[str, Any]  # caller headers + sits header (input_entropy filled per item)
    options: TaskOptions  # validated once; the transport trusts it (no re-validation)
    measure_entropy: bool
    derive_prefix_key: bool  # a model is named and no prefix_key: one per item's prompt
    prefix_key_chars: int
    message_args: dict[str, Any]  # keyword arguments of create_task_message
    shadow_per_item: bool  # the task overrides shadow_name and the call named no shadow
    plain_json: bool  # JSON bodies, no links: flat-scalar bodies may take the orjson path
    send_event: bool


@dataclass(frozen=True)
class _Built:
    """One built item: the transport message and what the post-publish hooks need."""

    task_id: str
    message: dict[str, Any]
    body: Any  # (args, kwargs, embed) for the publish signals
    sent_event: dict[str, Any] | None
    #: None: read from the message's header by the put (a publish receiver changed it)
    options: TaskOptions | None
    #: Where its ``before_task_publish`` ran (see :func:`_build`); None without receivers.
    context: contextvars.Context | None = None


@dataclass(frozen=True)
class _Sent:
    """What is kept of an item once its ``put.lua`` record is made: the message dicts
    are dropped at once, so they die young instead of filling the GC's older generations
    while the chunk waits (a quarter more bulk throughput, measured)."""

    task_id: str
    headers: dict[str, Any] | None  # only when after_task_publish has receivers
    body: Any
    sent_event: dict[str, Any] | None
    context: contextvars.Context | None  # its after_task_publish runs there


def _items(name: str, what: str, value: Any) -> list[Any]:
    """``value``, any iterable of items (a list, a tuple, a generator), as a list; a
    string, bytes or a mapping is refused naming ``name`` (``what``: its items)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of {what} (a list, a tuple, a "
                        f"generator), got {type(value).__name__}")
    return value if isinstance(value, list) else list(value)


def _check_items(task: Task, arg_list: Sequence[Any],
                 kwargs_list: Sequence[Any] | None) -> list[Mapping[str, Any]]:
    """Argument shapes and signatures of every item, before anything is sent."""
    if kwargs_list is None:
        kwargs_all: list[Mapping[str, Any]] = [{}] * len(arg_list)
    else:
        if len(kwargs_list) != len(arg_list):
            raise ValueError(f"kwargs_list has {len(kwargs_list)} items, arg_list "
                             f"{len(arg_list)}")
        kwargs_all = [{} if kw is None else kw for kw in kwargs_list]
    check = getattr(task, "__header__", None) if task.typing else None
    for i, (args, kwargs) in enumerate(zip(arg_list, kwargs_all, strict=True)):
        if not isinstance(args, (list, tuple)):
            raise TypeError(f"item {i}: task args must be a list or tuple, got "
                            f"{type(args).__name__}")
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"item {i}: task keyword arguments must be a mapping, got "
                            f"{type(kwargs).__name__}")
        if check is not None:
            try:
                check(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"item {i}: {exc}") from exc
    return kwargs_all


def _plan(task: Task, options: dict[str, Any], producer: Any = None) -> _Plan:
    """Validate the options and do ``apply_async``/``send_task``'s per-call work once."""
    app: Celery = task._get_app()
    if app.conf.task_protocol != 2:
        raise SitsError("enqueue_many builds task protocol 2 messages; "
                        f"task_protocol is {app.conf.task_protocol}")
    unsupported = set(options) - SUPPORTED_OPTIONS - set(OPTION_NAMES)
    if unsupported:
        raise TypeError(f"enqueue_many does not support {sorted(unsupported)}; supported: "
                        f"{sorted(SUPPORTED_OPTIONS | set(OPTION_NAMES))}")
    # (as send_task checks them: an ETA past year 9999 was enqueued, to be dead-lettered)
    check_delivery(task.name, options, app.timezone)
    drop_delivery_only(options)
    config = sits_config(app)
    header = hand_made_header(options)
    if header is not None:  # used as send_task uses it (it was replaced by the defaults
        # unchecked: {"sla_class": "high"} went as the task's class, "nope" was taken)
        opts = header_options(task, task.name, config, header, options, app.conf)
    else:
        # a route's SITS options too, as delay()'s (its class was dropped, its queue kept)
        routed_options(app, task.name, (), {}, options)
        opts = call_options(task, config, options, app.conf)
    # (its callbacks are sent from the worker: checked now, as delay()'s are)
    check_later_steps(app, config, options, options.get("link"), options.get("link_error"))
    if task.soft_time_limit and task.time_limit and task.soft_time_limit > task.time_limit:
        raise ValueError("soft_time_limit must be less than or equal to time_limit")
    options = {**task._get_exec_options(), **options}
    route_maintenance(task.name, options)
    options.setdefault("ignore_result", task.ignore_result)
    router = options.pop("router", None) or app.amqp.router
    routed = router.route(options, task.name, (), {}, task)
    queue: Queue = routed.get("queue") or _bound_queue(app, producer, routed)
    exchange_type = getattr(queue.exchange, "type", "direct")
    if exchange_type != "direct":
        raise SitsError(f"enqueue_many needs a direct-exchange queue; {queue.name!r} is "
                        f"bound to a {exchange_type} exchange")
    send_event = bool(app.conf.task_send_sent_event)
    if (note := getattr(app, "note_priority", None)) is not None:
        note(task.name, routed.get("priority"))
    return _Plan(
        name=task.name, queue=queue, qname=queue.name,
        priority=routed.get("priority") or 0,
        delivery_mode=maybe_delivery_mode(  # type: ignore[no-untyped-call]
            routed.get("delivery_mode") or queue.exchange.delivery_mode
            or app.conf.task_default_delivery_mode),
        serializer=routed.get("serializer") or app.conf.task_serializer,
        compression=routed.get("compression") or app.conf.task_compression,
        expiration=_expiration(app, routed.get("expires")),
        headers=sits_headers(config, opts, routed.get("headers"), 0.0),
        options=opts,
        measure_entropy=opts.input_entropy is None,
        derive_prefix_key=opts.prefix_key is None and opts.model is not None
        and config.prefix_key_chars > 0,
        prefix_key_chars=config.prefix_key_chars,
        message_args=_message_args(app, routed, send_event),
        shadow_per_item=(routed.get("shadow") is None
                         and type(task).shadow_name is not Task.shadow_name),
        plain_json=(routed.get("serializer") or app.conf.task_serializer) == "json"
        and not routed.get("link") and not routed.get("link_error"),
        send_event=send_event)


def _bound_queue(app: Celery, producer: Any, routed: Mapping[str, Any]) -> Queue:
    """The queue ``delay()`` reaches by a route naming no queue: by its exchange and
    routing key, the one the transport finds bound (``Channel._lookup``), else Celery's
    default queue. (Celery's router names none, and this failed on KeyError('queue').)"""
    exchange, key = routed.get("exchange"), routed.get("routing_key")
    exchange = getattr(exchange, "name", exchange)
    if not exchange:
        return app.amqp.default_queue  # type: ignore[no-any-return]
    with app.producer_or_acquire(producer) as prod:
        names = sorted(prod.channel._lookup(exchange, key))
    if len(names) != 1:  # (one put reaches one queue)
        raise SitsError(f"enqueue_many sends to one queue; exchange {exchange!r} with "
                        f"routing key {key!r} reaches {names or 'none'}: route the task "
                        "to a queue (a task_routes entry's 'queue', or queue=)")
    return Queue(names[0])  # type: ignore[no-untyped-call]


def _message_args(app: Celery, routed: Mapping[str, Any], send_event: bool) -> dict[str, Any]:
    """``create_task_message`` keywords, as ``send_task`` passes them."""
    root_id = parent_id = None
    parent = app.current_worker_task
    if parent is not None:  # submitted from inside a task: link the tree like send_task
        root_id = parent.request.root_id or parent.request.id
        parent_id = parent.request.id
    return {
        "countdown": routed.get("countdown"), "eta": routed.get("eta"),
        "expires": routed.get("expires"), "callbacks": _as_list(routed.get("link")),
        "errbacks": _as_list(routed.get("link_error")), "reply_to": app.thread_oid,
        "time_limit": routed.get("time_limit"),
        "soft_time_limit": routed.get("soft_time_limit"), "create_sent_event": send_event,
        "root_id": root_id, "parent_id": parent_id, "shadow": routed.get("shadow"),
        "ignore_result": bool(routed.get("ignore_result")),
        # anon_nodename() once, not per message (as_task_v2 would call it each time).
        "origin": anon_nodename(),
    }


def _as_list(value: Any) -> list[Any] | None:
    """Celery's ``maybe_list`` for link/link_error: one signature or several."""
    if value is None or isinstance(value, list):
        return value
    return list(value) if isinstance(value, tuple) else [value]


def _expiration(app: Celery, expires: Any) -> str | None:
    """The AMQP ``expiration`` property send_task + Producer.publish derive from ``expires``."""
    if expires is None:
        return None
    if isinstance(expires, str):
        expires = read_eta(expires)
    if isinstance(expires, datetime):  # a naive one as UTC, as send_task reads it
        seconds = subtract_datetimes(expires, app.now()).total_seconds()
    else:
        seconds = float(expires)
    return str(int(max(0.0, seconds) * 1000))


# -- per item ----------------------------------------------------------------------------------
def _build(app: Celery, task: Task, plan: _Plan, channel: Any, args: Sequence[Any],
           kwargs: Mapping[str, Any]) -> _Built:
    """One item as the transport message ``apply_async`` would hand to ``Channel._put``."""
    task_id = uuid()
    message_args = plan.message_args
    if plan.shadow_per_item:
        message_args = {**message_args, "shadow": task.shadow_name(args, kwargs, {})}
    amqp = app.amqp
    # as_task_v2 reprs ``args or ()`` and ``kwargs or {}``; None lets it use saferepr.
    argsrepr = fast_saferepr(args or (), amqp.argsrepr_maxsize)
    kwargsrepr = fast_saferepr(kwargs or {}, amqp.kwargsrepr_maxsize)
    headers, properties, body, sent_event = amqp.create_task_message(
        task_id, plan.name, args, kwargs, argsrepr=argsrepr, kwargsrepr=kwargsrepr,
        **message_args)
    headers.update(plan.headers)
    options: TaskOptions | None = plan.options
    if plan.measure_entropy or plan.derive_prefix_key:
        o = plan.options
        entropy = input_entropy(args, kwargs) if plan.measure_entropy else o.input_entropy
        prefix = derive_prefix_key(args, kwargs, plan.prefix_key_chars) \
            if plan.derive_prefix_key else o.prefix_key
        headers[HEADER] = {**plan.headers[HEADER], "input_entropy": entropy,
                           "prefix_key": prefix}
        # the constructor, not dataclasses.replace: 3x cheaper per item
        options = TaskOptions(o.sla_class, o.model, o.context_tokens, o.latency_sla_ms,
                              o.loss_sensitivity, entropy, o.vram_gib, prefix, o.batch,
                              o.batch_max, o.precision, o.arithmetic_intensity)
    headers[SUBMITTED_AT] = time.time()
    before = signals.before_task_publish
    context = None
    if before.receivers:
        # (its own: the plan's is every item's, and a receiver's change to one item's
        # reached the items after it)
        made = headers[HEADER] = dict(headers[HEADER])
        copy = dict(made)
        # Each item's publish signals run in a context of their own (its after_task_publish
        # too, once its chunk is in Redis): a receiver that makes something current until
        # the matching "after" (OpenTelemetry's Celery instrumentation: the publish span)
        # must not parent the next item's span under this one, nor leave an ended span
        # current for the caller, as the chunk's "befores" all come before its "afters".
        context = contextvars.copy_context()
        context.run(before.send, sender=plan.name, body=body, exchange="",
                    routing_key=plan.qname, declare=[plan.queue], headers=headers,
                    properties=properties, retry_policy={})
        if headers.get(HEADER) is not made or not unchanged(made, copy):
            # a receiver changed the options (as apply_async's would be read): the record
            # is made from what the message carries, read as the put reads it
            options = None
    # What Producer.publish does between Celery and the channel.
    if (plan.plain_json and argsrepr is not None and kwargsrepr is not None
            and not before.receivers):
        content_type, content_encoding, data = plain_json(body)
    else:
        content_type, content_encoding, data = dumps(  # type: ignore[no-untyped-call]
            body, serializer=plan.serializer)
    if plan.compression:
        data, headers["compression"] = compress(  # type: ignore[no-untyped-call]
            data, plan.compression)
    properties["delivery_mode"] = plan.delivery_mode
    if plan.expiration is not None:
        properties["expiration"] = plan.expiration
    message: dict[str, Any] = channel.prepare_message(
        data, plan.priority, content_type, content_encoding, headers, properties)
    # What virtual Channel.basic_publish does for the anonymous exchange before _put.
    channel._inplace_augment_message(message, "", plan.qname)
    if sent_event is not None:
        sent_event.update(queue=plan.qname, exchange="", routing_key=plan.qname)
    return _Built(task_id, message, body, sent_event, options, context)


def _call(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return f(*args, **kwargs)


def _announce(plan: _Plan, built: list[_Sent], dispatcher: Any) -> None:
    """After a chunk is in Redis: its ``after_task_publish`` signals and its task-sent
    events, as one ``task.multi`` event (the batching Celery workers use for their own)."""
    after = signals.after_task_publish
    if after.receivers:
        for b in built:
            (b.context.run if b.context is not None else _call)(
                after.send, sender=plan.name, body=b.body, headers=b.headers, exchange="",
                routing_key=plan.qname)
    if dispatcher is not None:
        for b in built:
            if b.sent_event is not None:
                dispatcher.send("task-sent", **b.sent_event)
        # Events are best effort, as in send_task: an offline dispatcher buffers them.
        dispatcher.flush(errors=False, groups=True)


def enqueue_many(task: Task, arg_list: Iterable[Sequence[Any]], *,
                 kwargs_list: Iterable[Mapping[str, Any] | None] | None = None,
                 chunk: int = DEFAULT_CHUNK, **options: Any) -> list[str]:
    """Submit ``task`` once per item of ``arg_list`` (a list, a tuple, a generator...);
    returns the task ids, in its order.

    ``options`` are ``apply_async`` options shared by every item: the SITS options
    (``sla_class``, ``model``, ``context_tokens``...) and those in
    :data:`SUPPORTED_OPTIONS`. Input entropy is measured per item unless given. Routers
    are consulted once per call (with no arguments). Items of one chunk keep their order
    among equal priorities.

    Raises :class:`~sits_queue.errors.InvalidTaskOptions` for invalid options and
    ``TypeError`` for a malformed item (not a sequence, the wrong arity) before anything
    is sent. An item its serializer refuses (an ``object()`` under JSON) fails as its
    chunk is built, while the chunk before it is being stored: a chunk is encoded only
    once the one before is sent, so that a large submission never holds all its
    messages at once. If a chunk fails after earlier chunks were enqueued (to encode, or
    in Redis), or its reply was lost with its connection, raises
    :class:`BulkEnqueueError` with their ids (and the lost chunk's, as enqueued or as
    uncertain); if the first chunk fails, the original error (nothing was enqueued).
    """
    if not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be in [1, {MAX_CHUNK}], got {chunk}")
    # @app.task returns a lazy proxy until the app is finalized; work on the task itself.
    task = task._get_current_object() if hasattr(task, "_get_current_object") else task
    options = dict(options)
    producer = options.pop("producer", None)
    plan = _plan(task, options, producer)
    # (a generator, a set or a dict's keys failed on len() or slicing, saying neither)
    arg_list = _items("arg_list", "argument tuples", arg_list)
    if kwargs_list is not None:
        kwargs_list = _items("kwargs_list", "keyword-argument mappings", kwargs_list)
    kwargs_all = _check_items(task, arg_list, kwargs_list)
    app: Celery = task._get_app()
    # As a task call finalizes it: what waits on that (tracing's set-up) is done first.
    # (a producer that only sent this way sent no trace context)
    app.finalize(auto=True)
    ids: list[str] = []
    with app.producer_or_acquire(producer) as prod:
        channel = prod.channel
        if not hasattr(channel, "_put_records_start"):
            raise SitsError("enqueue_many needs the SITS sorted-set transport; this app "
                            f"uses {type(channel).__module__}")
        prod.maybe_declare(plan.queue)
        dispatcher = (app.events.Dispatcher(prod.connection, buffer_group=("task",),
                                            buffer_limit=chunk + 1)
                      if plan.send_event else None)
        try:
            _pipeline(app, task, plan, channel, dispatcher, arg_list, kwargs_all, chunk, ids)
        finally:
            if dispatcher is not None:
                dispatcher.close()
    return ids


def _pipeline(app: Celery, task: Task, plan: _Plan, channel: Any, dispatcher: Any,
              arg_list: Sequence[Sequence[Any]], kwargs_all: Sequence[Mapping[str, Any]],
              chunk: int, ids: list[str]) -> None:
    """Send chunk k, build chunk k+1 while Redis runs k's ``put.lua``, then read k's reply.

    One chunk is in flight at a time, so chunks reach Redis in order, and ``ids`` grows
    only once a chunk is confirmed: it always names exactly what is enqueued.
    """
    in_flight: tuple[Callable[[], int], list[_Sent], list[Any]] | None = None
    uncertain: list[str] = []

    def settle() -> None:
        nonlocal in_flight
        if in_flight is not None:
            reply, sent, tags = in_flight
            in_flight = None
            try:
                reply()
            except (redis.ConnectionError, redis.TimeoutError):
                # The reply is lost, not necessarily the chunk: Redis may have run it.
                if not _landed(channel, plan.qname, tags):
                    uncertain.extend(b.task_id for b in sent)
                    raise
                ids.extend(b.task_id for b in sent)
                raise
            ids.extend(b.task_id for b in sent)
            _announce(plan, sent, dispatcher)

    try:
        start = 0
        while start < len(arg_list):
            records, sent = _build_chunk(app, task, plan, channel,
                                         arg_list[start:start + chunk],
                                         kwargs_all[start:start + chunk])
            start += len(sent)  # (fewer than chunk where CHUNK_BYTES ended it)
            settle()
            in_flight = (channel._put_records_start(plan.qname, records), sent, records[::5])
        settle()
    except Exception as exc:
        if in_flight is not None:  # building a chunk failed: count the one in flight
            with contextlib.suppress(Exception):  # the first error is the one to report
                settle()
        if not ids and not uncertain:
            raise
        # Confirmed chunks are a prefix of the items, then the uncertain one if any.
        sure = f"items from {len(ids) + len(uncertain)} on were not enqueued " \
               f"({len(ids)} were"
        raise BulkEnqueueError(
            f"{sure}, {len(uncertain)} may have been: the reply to their chunk was lost): "
            f"{exc}" if uncertain else f"{sure}): {exc}", ids, uncertain) from exc
    except BaseException:
        if in_flight is not None:  # interrupted: still hand the connection back
            with contextlib.suppress(BaseException):
                in_flight[0]()
        raise


def _landed(channel: Any, queue: str, tags: list[Any]) -> bool:
    """Whether a chunk whose reply was lost is in the queue: one of its messages is still
    stored (put.lua is atomic: one is all). False when none is, or Redis cannot say."""
    payloads = channel.keys(queue).payloads
    try:
        with channel.raw.pipeline(transaction=False) as pipe:
            for tag in tags:
                pipe.hexists(payloads, tag)
            return any(pipe.execute())
    except redis.RedisError:
        return False


def _build_chunk(app: Celery, task: Task, plan: _Plan, channel: Any,
                 arg_list: Sequence[Sequence[Any]], kwargs_list: Sequence[Mapping[str, Any]]
                 ) -> tuple[list[Any], list[_Sent]]:
    """The chunk's ``put.lua`` arguments, and per item what the post-publish hooks need;
    of the items given, those up to the one that brings the chunk to CHUNK_BYTES."""
    dump_pydantic = getattr(task, "_dump_pydantic_arguments", None)
    if plan.serializer == "pickle":
        dump_pydantic = None  # pickle sends models as they are (apply_async's rule)
    keep = bool(signals.after_task_publish.receivers)
    now = clock.now(channel.raw)
    scorer = channel.snapshots.scorer(channel.raw, now)
    records: list[Any] = []
    sent: list[_Sent] = []
    size = 0
    for args, kwargs in zip(arg_list, kwargs_list, strict=True):
        if dump_pydantic is not None:
            args, kwargs = dump_pydantic(args, kwargs)
        b = _build(app, task, plan, channel, args, kwargs)
        record = channel._put_record(b.message, b.options, now, scorer)
        records += record
        sent.append(_Sent(b.task_id, b.message["headers"] if keep else None,
                          b.body if keep else None, b.sent_event,
                          b.context if keep else None))
        size += sum(len(x) for x in record if isinstance(x, (bytes, str)))
        if size >= CHUNK_BYTES:
            break
    return records, sent
