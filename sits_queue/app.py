"""The Celery app, its production defaults, and the task class that carries SITS options."""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from celery import Celery, Task
from celery.app.amqp import AMQP
from kombu.entity import Exchange, Queue
from kombu.utils.objects import cached_property

from sits_queue import flower, quietlogs, redisurl
from sits_queue.cache.budgets import settings_from_env
from sits_queue.calloptions import (
    CALL_OPTIONS,
    RoutedOnce,
    call_options,
    carried_ids,
    check_later_steps,
    hand_made_header,
    header_options,
    leaves,
    routed_options,
    sends_later,
    sits_headers,
)
from sits_queue.checks import finite, is_number, shown
from sits_queue.config import SitsConfig, redacted, without_credentials
from sits_queue.delivery import check_delivery, drop_delivery_only
from sits_queue.errors import ConfigError
from sits_queue.exits import fail_exits
from sits_queue.options import (
    CONTROL_QUEUE,
    HEADER,
    MAINTENANCE_TASKS,
    OPTION_NAMES,
    SUBMITTED_AT,
    derived_from_args,
    route_maintenance,
)
from sits_queue.registry import Loader, ModelRegistry
from sits_queue.settings import DEFAULT_QUEUE as DEFAULT_QUEUE
from sits_queue.settings import OWN_TRANSPORT_OPTIONS as OWN_TRANSPORT_OPTIONS
from sits_queue.settings import TRANSPORT as TRANSPORT
from sits_queue.settings import beat_schedule as beat_schedule
from sits_queue.settings import celery_settings as celery_settings
from sits_queue.settings import prewarm_schedule as prewarm_schedule
from sits_queue.settings import sits_transport_options as sits_transport_options
from sits_queue.timelimits import apply_class_limits as apply_class_limits
from sits_queue.timelimits import fit_carried_limit, settle_bound_limits

logger = logging.getLogger(__name__)

#: Marks a function whose first argument the worker supplies (the warm engine).
ENGINE_ARG = "__sits_engine_arg__"
class SitsTask(Task):  # type: ignore[misc]
    """Celery task whose ``apply_async`` validates and attaches the SITS options.

    Options are settable on the decorator (``@app.task(sla_class="high")``) and per
    call (``t.apply_async(args, sla_class="low", context_tokens=4096)``). Invalid
    options raise :class:`~sits_queue.errors.InvalidTaskOptions` and nothing is sent.

    In the worker, :class:`~sits_queue.workers.request.SitsRequest` checks a declared
    ``vram_gib`` against the devices' free memory before the task reaches the pool.
    """

    Request = "sits_queue.workers.request:SitsRequest"

    sla_class: str | None = None
    model: str | None = None
    context_tokens: int | None = None
    latency_sla_ms: float | None = None
    loss_sensitivity: float | None = None
    input_entropy: float | None = None
    vram_gib: float | None = None
    prefix_key: str | None = None
    precision: str | None = None
    arithmetic_intensity: float | None = None
    #: Batch tasks (``app.batch_inference_task``): most tasks one batch may take.
    max_batch: int | None = None
    #: Whether its calls run as batches (only ``BatchInferenceTask``'s do).
    batches: ClassVar[bool] = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from sits_queue.workers import devicefit

        with fail_exits(self):
            devicefit.check_here(self)  # (the pool child's own device: it may be full)
            return super().__call__(*args, **kwargs)

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    producer: Any = None, link: Any = None, link_error: Any = None,
                    shadow: str | None = None, **options: Any) -> Any:
        if hand_made_header(options) is not None and \
                not any(name in options for name in CALL_OPTIONS):
            # A hand-made header, send_task's way: checked there, its class's limits
            # set (made again from the task's defaults here, it was replaced unsaid:
            # {"sla_class": "high"} ran as medium, "nope" was taken). Keywords beside
            # one (a retry's, from the running task's) make the header afresh, below.
            settle_bound_limits(self)
            return super().apply_async(args, kwargs, task_id, producer, link, link_error,
                                       shadow, **options)
        routed_options(self.app, self.name, args, kwargs, options)
        config = sits_config(self.app)
        later = sends_later(options, link, link_error)
        sla_class = options.get("sla_class")
        # (whether a worker sends it on matters to a class foreign here, or to the
        # canvas the call carries: asked then only, it walks the task stack)
        sent_on = (later or (isinstance(sla_class, str)
                             and sla_class not in config.class_names)) \
            and _sent_on(self.app, options, task_id)
        if sent_on:
            self._drop_foreign_class(config, options)
        opts = call_options(self, config, options, self.app.conf, args, kwargs)
        if later and not sent_on:  # (after its own: a call's own typo is the one named)
            check_later_steps(self.app, config, options, link, link_error)
        options["headers"] = sits_headers(config, opts, options.pop("headers", None),
                                          time.time())
        settle_bound_limits(self)
        return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow,
                                   **options)

    def apply(self, args: Any = None, kwargs: Any = None, link: Any = None,
              link_error: Any = None, task_id: str | None = None, retries: int | None = None,
              throw: bool | None = None, logfile: Any = None, loglevel: Any = None,
              headers: Mapping[str, Any] | None = None, **options: Any) -> Any:
        """Celery's, with the call's SITS options (``model=``, ``sla_class=``,
        ``precision=`` ...) in the eager request's headers, where the runtime reads them:
        Celery's ``apply`` drops options it does not know, so a task running another
        model's task in its own process got its own model, and the built-in tasks none.
        A call through ``apply_async`` (``task_always_eager``) has them there already."""
        given = any(name in options for name in CALL_OPTIONS)
        if given or not (isinstance(headers, Mapping) and HEADER in headers):
            routed_options(self.app, self.name, args, kwargs, options)
            config = sits_config(self.app)
            opts = call_options(self, config, options, self.app.conf, args, kwargs)
            headers = sits_headers(config, opts, headers, time.time())
        return super().apply(args, kwargs, link, link_error, task_id, retries, throw,
                             logfile, loglevel, headers, **options)

    def signature_from_request(self, request: Any = None, args: Any = None,
                               kwargs: Any = None, queue: Any = None,
                               **extra_options: Any) -> Any:
        """Celery's (``retry`` builds the new message from it), carrying the running
        task's SITS options over: Celery copies its own options from the request, not
        ours, so a retried task would come back in the default class, without its model.
        Options given to ``retry`` itself still win."""
        sig = super().signature_from_request(request, args, kwargs, queue, **extra_options)
        # Celery copies the delivered message's headers into the retry: what the broker
        # added for that delivery (a time-slice checkpoint, the affinity mark, the queue
        # and id it came from, the redelivery flag) would make the retry resume mid-way.
        # And its ``sits`` header: the options are carried below as keywords, and the
        # header is made afresh from them; where none is carried (a hand-made header
        # whose only option was a class of another producer's table, dropped), the copy
        # was taken for a hand-made header, checked again, and the retry refused.
        drop_delivery_only(sig.options)
        headers = sig.options.get("headers")
        if isinstance(headers, Mapping) and HEADER in headers:
            sig.options["headers"] = {k: v for k, v in headers.items() if k != HEADER}
        running = self.request if request is None else request
        header = getattr(running, HEADER, None)
        if isinstance(header, Mapping):
            config = sits_config(self.app)
            # New arguments: what the first send worked out from the old ones (its input
            # entropy, its prompt's prefix key) is worked out afresh from these
            derived = {} if args is None and kwargs is None else derived_from_args(
                config, getattr(running, "args", None) or (),
                getattr(running, "kwargs", None) or {})
            for name in OPTION_NAMES:
                value = header.get(name)
                if name == "sla_class" and value not in config.class_names:
                    # (a producer of another class table's: refused, the retry was
                    # dead-lettered; the task's own or the default class applies)
                    if value is not None and "sla_class" not in sig.options:
                        _said_foreign(config, self.name, value, self.sla_class)
                    continue
                if value is not None and (name not in derived or derived[name] != value):
                    sig.options.setdefault(name, value)
            old = header.get("sla_class")
            if isinstance(old, str) and sig.options.get("sla_class") != old:
                self._forget_class_defaults(sig.options, old, extra_options)
            fit_carried_limit(config, sig.options, old, extra_options)
        return sig

    def replace(self, sig: Any) -> Any:
        """Celery's, with the replacement sent in the running task's class: Celery carries
        the chord, group and root over, not the options, so an urgent task that replaced
        itself went on in the default class. Each task of the replacement (each step of a
        chain, each member of a group or chord header, a chord's body) that names no class
        of its own, on its signature or its task, takes the running one's."""
        header = getattr(self.request, HEADER, None)
        running = header.get("sla_class") if isinstance(header, Mapping) else None
        if isinstance(running, str) and running in sits_config(self.app).class_names:
            for leaf in leaves(sig):
                declared = getattr(self.app.tasks.get(leaf.task), "sla_class", None)
                if leaf.options.get("sla_class") is None and declared is None:
                    leaf.options["sla_class"] = running
        return super().replace(sig)

    def _drop_foreign_class(self, config: SitsConfig, options: dict[str, Any]) -> None:
        """A chain's next step, a callback or a chord's body that Celery sends on from a
        worker (:func:`_sent_on`; a retry's options also carry ``retries``) in a class this
        worker's table lacks: the class came with the canvas from its producer (one of
        another table, in an upgrade that renames classes); it is dropped, said in a
        warning, and the task's own or the default class applies, as a put drops it.
        (Refused, the chain stopped at that step.) A retry's carried class is dropped
        where it is carried (:meth:`signature_from_request`); a class a call names,
        a producer's or a task's own code's (``retry(sla_class=...)`` included), is
        refused as before: a typo is the caller's to hear."""
        sla_class = options.get("sla_class")
        if not isinstance(sla_class, str) or sla_class in config.class_names or \
                "retries" in options:
            return
        del options["sla_class"]
        _said_foreign(config, self.name, sla_class, self.sla_class)

    def _forget_class_defaults(self, options: dict[str, Any], old: str,
                               given: Mapping[str, Any]) -> None:
        """A retry into another class: drop what the first send filled in from ``old``
        (its SLA, loss preset and time limits), so the new class's own apply. The header
        does not say which values were defaults: one equal to ``old``'s default is taken
        for it (a caller who chose exactly that value gets the new class's instead)."""
        config = sits_config(self.app)
        if old not in config.class_names:
            return
        quota = config.quota(old)
        soft, hard = config.time_limits(old)
        for name, default in (("latency_sla_ms", quota.latency_sla_ms),
                              ("loss_sensitivity", quota.loss_sensitivity),
                              ("soft_time_limit", soft), ("time_limit", hard)):
            if name not in given and options.get(name) == default:
                options.pop(name)

    # -- time slices (sits_queue.workers.slices) ------------------------------------------
    def yield_point(self, state: Any = None, remaining_s: float | None = None) -> None:
        """Give the pool slot to more urgent work if it is time to; call between steps.

        Returns at once (microseconds) unless this task has run its ``slice_ms`` and a
        task of a higher-weight class waits; then ``state`` (JSON data) is saved, the
        task stops with :class:`~sits_queue.workers.slices.Preempted` and runs again
        later, from the same place in the queue, where ``self.checkpoint`` returns it
        (as JSON gives it back: tuples as lists, dict keys as strings).
        ``remaining_s``, the task's own estimate of the work left, lets it finish instead
        when that is under ``yield_min_remaining_ms``. Outside a SITS worker (an eager
        call) and in a batch task (``app.batch_inference_task``) it never yields.
        """
        from sits_queue.workers import slices

        if remaining_s is not None and not (
                is_number(remaining_s) and finite(remaining_s) and remaining_s >= 0):
            # ("x" raised a bare TypeError from a comparison; -1 never yielded, NaN always)
            raise ValueError(f"yield_point: remaining_s must be a finite number of seconds "
                             f">= 0 or None, got {shown(remaining_s)}")
        if self.batches:  # one run serves many calls: no one call's slice to give up
            return
        config = sits_config(self.app)
        if remaining_s is not None and remaining_s * 1000 < config.yield_min_remaining_ms:
            return
        request = self.request
        running = slices.running_from(request, slices.started_at(request.id))
        if running is None:
            return
        if not slices.slicer_for(config).claim(running, time.monotonic(), state):
            return  # (with Redis unreachable too: the task runs on)
        raise slices.Preempted(f"yielded its slot after {running.sla_class!r} time slice")

    @property
    def checkpoint(self) -> Any:
        """The state saved at this task's last yield, or None on its first run."""
        from sits_queue.workers import slices

        return slices.checkpoint_of(self.request)


def _check_takes(fun: Callable[..., Any], first: tuple[str, ...], what: str) -> None:
    """Refuse, where it is defined, a function that cannot take the arguments the worker
    passes first (the engine; a batch task's calls too): each call failed instead,
    blaming its caller ("takes 0 positional arguments but 1 was given"; by name, "too
    many positional arguments" for a call that gave none)."""
    try:
        params = inspect.signature(fun, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):
        return  # (no signature to read: a builtin; its calls say it)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < len(first):
        name = getattr(fun, "__qualname__", repr(fun))
        raise TypeError(f"{name} is {what}: it must take {' and '.join(first)} as its first "
                        f"positional argument{'s' if len(first) > 1 else ''}, the worker's "
                        f"to pass; it takes {len(positional)}")


def _sent_on(app: Celery, options: Mapping[str, Any], task_id: str | None) -> bool:
    """Whether Celery sends this from a worker, on from the running task: a chain's next
    step or a callback (the tracer's send, with ``parent_id``), or the chord's body
    that the header's last task sends (the result backend's ``callback.delay``, with the
    body's frozen id and no ``parent_id``: taken for a submission, a body of a class the
    worker's table lacks failed the chord, where a chain's step went on)."""
    if app.current_worker_task is None:
        return False
    return "parent_id" in options or (task_id is not None
                                      and task_id in carried_ids(app).chord)


def _said_foreign(config: SitsConfig, task: str, sla_class: object,
                  declared: str | None) -> None:
    runs_as = declared if declared in config.class_names else config.default_class
    logger.warning("task %s: sla_class %r is not in this worker's classes %s (a producer of "
                   "another class table?): sent on in %r", task, sla_class,
                   list(config.class_names), runs_as)


def sits_config(app: Celery) -> SitsConfig:
    """The SitsConfig an app was built with (stored on the app, not in Celery's conf)."""
    config: SitsConfig | None = getattr(app, "sits", None)
    if config is None:
        config = SitsConfig.from_env()
        app.sits = config
    return config


F = TypeVar("F", bound=Callable[..., Any])


class SitsAMQP(AMQP):  # type: ignore[misc]
    """Celery's, whose declared queues are the app's (``task_queues``, else its
    ``task_default_queue``, whatever the app set it to) and the control queue: a
    fixed ``task_queues`` setting kept "celery", and an app's own default queue got its
    tasks with no worker consuming it."""

    @cached_property
    def queues(self) -> Any:
        queues = self.Queues(self.app.conf.task_queues)
        if CONTROL_QUEUE not in queues:
            queues.add(control_queue())
        return queues


def control_queue() -> Queue:
    """The control queue's declaration: an exchange and a routing key of its own. Left to
    the app's defaults it was bound with the default routing key, so a pass went to the
    app's default queue as well (with a topic exchange routing "task.#" there: every pass
    ran twice), and a task sent to that key landed in the control queue too."""
    return Queue(CONTROL_QUEUE, Exchange(CONTROL_QUEUE, type="direct"),  # type: ignore[no-untyped-call]
                 routing_key=CONTROL_QUEUE)


class SitsCelery(Celery):  # type: ignore[misc]
    """Celery with a model registry and inference tasks that receive a warm engine::

        @app.model("summarizer")
        def load():
            return "/models/summarizer"      # a HF directory, an nn.Module or an Engine

        @app.inference_task(model="summarizer", sla_class="medium")
        def summarize(engine, text): ...

        summarize.delay("...")  # -> {"output": ..., "sits": {"cold": ..., ...}}
    """

    sits: SitsConfig
    amqp_cls = "sits_queue.app:SitsAMQP"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.models = ModelRegistry()
        self._priority_noted = False
        # Flower's Broker page reads Redis lists; under `celery flower` Flower is loaded
        # before the app, and is shown the sorted sets instead (sits_queue/flower.py).
        flower.install()
        quietlogs.install()  # (SITS's housekeeping tasks: at debug in Celery's logs)

    def _connection(self, url: Any, *args: Any, transport_options: Any = None,
                    **kwargs: Any) -> Any:
        """Celery's, with the SITS transport options whatever became of the app's
        ``broker_transport_options`` (a plain assignment replaces the whole dict), and
        only to the SITS Redis: a broker URL of its own (``-b``, ``CELERY_BROKER_URL``, an
        app's ``broker_url``) put the queues on one server while the worker records,
        results and rescoring passes went to the other, and ``sitsq status`` saw none."""
        options = self.broker_options(url, transport_options)
        return super()._connection(url, *args, transport_options=options, **kwargs)

    def broker_options(self, url: Any, transport_options: Any = None) -> dict[str, Any]:
        """The transport options a connection to ``url`` gets; a ConfigError for a URL
        that is not the SITS Redis's or an option that contradicts the SITS config (a
        worker checks both as it starts: ``workers/runtime.py``)."""
        config = sits_config(self)
        expected, _ = redisurl.celery_parts(config.redis_url)
        if url is not None and str(url) != expected:
            raise ConfigError(f"the broker URL {redacted(str(url))!r} (-b, CELERY_BROKER_URL "
                              "or broker_url) is not the SITS Redis URL "
                              f"{redacted(expected)!r}: set SITS_REDIS_URL instead")
        return sits_transport_options(config, self.conf.broker_transport_options,
                                      transport_options)

    def bugreport(self) -> str:
        """Celery's, with the credentials of every URL in it masked: ``celery report``
        and the remote ``celery inspect report`` printed the beat's Redis URL
        (``redbeat_redis_url``, which Celery's censoring does not know) in clear."""
        return str(without_credentials(super().bugreport()))

    def note_priority(self, name: str, priority: Any) -> None:
        """Tell the producer, once per process, that Celery's ``priority=`` does not
        order SITS queues (stock Celery orders by it; here the class and the live score
        do). Once: a producer may pass it on every call; a retry passes 0 on."""
        if priority and not self._priority_noted:
            self._priority_noted = True
            logger.warning("task %s: Celery's priority=%r does not order SITS queues; "
                           "give sla_class= (and the SITS options) instead", name, priority)

    def send_task(self, name: str, args: Any = None, kwargs: Any = None,
                  **options: Any) -> Any:
        """Celery's, with the SITS options validated and attached on every path that
        publishes: ``send_task`` by name, ``celery call``, a task whose base is a plain
        ``celery.Task``. (``SitsTask.apply_async`` attaches them before it gets here.)
        A task registered in this app lends its declared options and time limits."""
        self.note_priority(name, options.get("priority"))
        check_delivery(name, options, self.timezone)
        drop_delivery_only(options)
        route_maintenance(name, options)
        if name in MAINTENANCE_TASKS and self.amqp.router.routes \
                and not isinstance(options.get("router"), RoutedOnce):
            # no route of the app's applies to them, a hand-made header's call included
            options["router"] = RoutedOnce(self.amqp.router, None)
        header = hand_made_header(options)
        if header is not None:
            # Attached already (apply_async, a retry) or by hand: checked either way
            headers = options["headers"]
            header_options(self.tasks.get(name), name, sits_config(self), header, options,
                           self.conf)
            if SUBMITTED_AT not in headers:  # (a retry's keeps the first submission's)
                # (without it the task's latency went unrecorded in its class's stats)
                options["headers"] = {**headers, SUBMITTED_AT: time.time()}
            return super().send_task(name, args, kwargs, **options)
        routed_options(self, name, args, kwargs, options)
        config = sits_config(self)
        opts = call_options(self.tasks.get(name), config, options, self.conf, args, kwargs,
                            name)
        link, link_error = options.get("link"), options.get("link_error")
        if sends_later(options, link, link_error) and \
                not _sent_on(self, options, options.get("task_id")):
            check_later_steps(self, config, options, link, link_error)
        options["headers"] = sits_headers(config, opts, options.pop("headers", None),
                                          time.time())
        return super().send_task(name, args, kwargs, **options)

    def model(self, name: str, *, sample_inputs: tuple[Any, ...] | None = None,
              replace: bool = False) -> Callable[[Loader], Loader]:
        """Decorator registering a zero-argument loader for model ``name``."""
        def decorate(loader: Loader) -> Loader:
            self.models.register(name, loader, sample_inputs=sample_inputs, replace=replace)
            return loader

        return decorate

    def register_model(self, name: str, source: Loader | str | os.PathLike[str], *,
                       sample_inputs: tuple[Any, ...] | None = None,
                       replace: bool = False) -> None:
        """Register a loader, or a path: a model directory (``from_pretrained``) or an
        engine file (``.onnx``, ``.pt2``, ``.plan``/``.engine``)."""
        self.models.register(name, source, sample_inputs=sample_inputs, replace=replace)

    def inference_task(self, *, model: str | None = None, **options: Any) -> Callable[[F], Any]:
        """Decorator for a task whose first argument is the warm engine of ``model``.

        ``model`` becomes the task's default model option (the message carries it, so
        the broker and the worker see it); a call may pass ``model=`` to override it.
        Other keywords are Celery task options and SITS options (``sla_class`` ...).
        """
        from sits_queue.workers.inference import InferenceTask

        if options.get("bind"):
            raise TypeError("inference tasks cannot bind=True: the first argument is the "
                            "engine; use celery.current_task for the request")

        def decorate(fun: F) -> Any:
            _check_takes(fun, ("engine",), "an inference task")
            setattr(fun, ENGINE_ARG, True)
            return self.task(base=InferenceTask, model=model, **options)(fun)

        return decorate

    def batch_inference_task(self, *, model: str | None = None, max_batch: int | None = None,
                             work: Callable[..., float] | None = None,
                             **options: Any) -> Callable[[F], Any]:
        """Decorator for a batch task: ``fun(engine, calls) -> outputs``, one output per
        call in order (an exception instance fails that call alone); callers submit one
        call per task (``fun.delay(text)``). Tasks of the same model and class that wait
        together run as one batch of at most ``max_batch`` (default ``batch_max_tasks``);
        see ``sits_queue/workers/batched.py``. ``work(*args, **kwargs)``: a call's share
        of a batch's time, from its arguments (default 1 per call), for the batch's time
        budget (``workers/batchtime.py``).
        """
        from sits_queue.config import MAX_BATCH_TASKS
        from sits_queue.workers.batched import BatchInferenceTask

        most = sits_config(self).batch_max_tasks if max_batch is None else max_batch
        if isinstance(most, bool) or not isinstance(most, int) \
                or not 1 <= most <= MAX_BATCH_TASKS:
            raise ValueError(f"max_batch must be an integer in [1, {MAX_BATCH_TASKS}], "
                             f"got {max_batch!r}")
        if options.get("bind"):
            raise TypeError("batch tasks cannot bind=True: the first argument is the engine")
        if options.get("autoretry_for"):
            # (the batch runs under one hand-made request: Celery's retry re-raised, and
            # every call failed for good without a word about it)
            raise TypeError("batch tasks cannot autoretry_for=...: one run serves many "
                            "calls, and a retry would re-send one call's arguments; fail "
                            "a call alone by returning an exception in its place, and "
                            "retry from the caller")

        if work is not None and not callable(work):
            raise TypeError(f"work must be a callable of a call's arguments, got {work!r}")

        def decorate(fun: F) -> Any:
            _check_takes(fun, ("engine", "calls"), "a batch task")
            setattr(fun, ENGINE_ARG, True)
            # (a function as a class attribute would be bound to the task)
            return self.task(base=BatchInferenceTask, model=model, max_batch=most,
                             batch_work=None if work is None else staticmethod(work),
                             **options)(fun)

        return decorate

    def type_checker(self, fun: Callable[..., Any], bound: bool = False) -> Any:
        # Callers do not pass the engine: check their arguments as if it were bound.
        return super().type_checker(fun, bound=bound or getattr(fun, ENGINE_ARG, False))


def make_app(config: SitsConfig | None = None, main: str = "sits_queue") -> SitsCelery:
    """A configured Celery app. ``celery -A sits_queue`` uses the one built from the env."""
    if config is None:
        config = settings_from_env()
    app = SitsCelery(main, task_cls=SitsTask)
    app.sits = config
    app.conf.update(celery_settings(config))
    from sits_queue import lifeline, tracing
    from sits_queue.broker import control
    from sits_queue.priority import tasks as maintenance
    from sits_queue.workers import inference, runtime, signals

    maintenance.register(app)
    inference.register(app)
    signals.connect(app)
    runtime.connect(app)
    lifeline.connect()
    control.register()
    tracing.configure_when_finalized(app, config.otel_traces)
    return app
