"""Same-model batching: tasks of one batch task, model and class run as one batch.

Offline inference submits work one item per task (``embed.delay(text)`` a million
times), while a model runs a batch of 32 in about the time it runs one. Here the
broker gathers and the worker batches, without holding anything back in a buffer:

1. The producer marks a batch task's message with its batch key (task, model, class,
   precision, time limits) and ``max_batch`` (``options.batch_key``). ``pick.lua``,
   when the task it picks has one, also takes the waiting tasks with the same key among
   the first ``batch_window`` of the queue, up to ``max_batch`` in all, atomically
   with the pick; each is unacked like any picked message. Nothing waits for a batch
   to fill: a batch is what was waiting, so a quiet queue runs tasks one by one at once.
2. The transport delivers them one after another between two marks, each message
   marked ``[batch, index, size]``; Celery makes a request of each as usual (received
   events, revokes, expiry), and :func:`gather` holds them until the end mark, then
   passes the first on through Celery's pool semaphore carrying the others, and
   :class:`BatchRequest` sends the pool one job for all of them (each checked for
   revokes and VRAM admission first), with their time limits.
3. In the pool child, :func:`run_batch` gets the engine once and calls the task's
   function once with every call (:class:`Call`); then each request goes through
   Celery's own tracer as if it had run alone, with the outcome the batch gave it:
   its result stored, its signals sent, its failure its own. The main process acks
   each message and sends each its events (Flower sees every task).

A batch task's function takes the engine and a list of calls and returns one output
per call, in order; an exception instance in that list fails that call only::

    @app.batch_inference_task(model="encoder", max_batch=64)
    def score(engine, calls):
        return engine.module.score([c.args[0] for c in calls])

    score.delay("one text")   # -> {"output": ..., "sits": {..., "batch": {"size", "index"}}}

Why not celery-batches: it buffers prefetched messages in the worker for a count or a
time, which needs prefetching (it would take tasks out of our priority order) and
holds early tasks back; here the batch is taken from Redis by priority in one step.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from weakref import ref

from billiard.einfo import ExceptionInfo
from billiard.exceptions import Terminated
from celery import bootsteps, current_app
from celery.app.trace import fast_trace_task, trace_task_ret
from celery.exceptions import SoftTimeLimitExceeded, TaskRevokedError
from celery.worker import state
from kombu.serialization import loads

from sits_queue import tracing
from sits_queue.broker import intake
from sits_queue.broker.keys import DELIVERY_HEADER, batch_mark, batch_units
from sits_queue.errors import InferenceError, InvalidInput
from sits_queue.options import HEADER
from sits_queue.workers import acquire, advertise, batchbudget, inference, joins, metrics, runtime
from sits_queue.workers import request as admission
from sits_queue.workers.request import SitsRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Call:
    """One task of a batch: its id and the arguments it was called with."""

    id: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: Its task's ``prefix_key`` (what the KV of its prompt's start is advertised as):
    #: a batch's calls may start with different templates.
    prefix_key: str | None = None


def split_outputs(outputs: Any, calls: list[Call], meta: dict[str, Any]) -> dict[str, Any]:
    """Each call's outcome from a batch run: its ``{"output", "sits"}`` result, or the
    exception that fails it. An output list of the wrong shape fails every call."""
    if not isinstance(outputs, (list, tuple)) or len(outputs) != len(calls):
        got = (f"{len(outputs)} outputs" if isinstance(outputs, (list, tuple))
               else type(outputs).__name__)
        error = InferenceError(f"batch function returned {got} for {len(calls)} calls; "
                               "it must return one output per call, in order")
        return {c.id: error for c in calls}
    return {c.id: out if isinstance(out, BaseException) else _result(out, meta, i, len(calls))
            for i, (c, out) in enumerate(zip(calls, outputs, strict=True))}


def _result(output: Any, meta: dict[str, Any], index: int, size: int,
            joined: bool = False) -> dict[str, Any]:
    batch: dict[str, Any] = {"size": size, "index": index}
    if joined:  # it joined the batch while it decoded (joins.py)
        batch["joined"] = True
    return {"output": output, "sits": {**meta, "batch": batch}}


# -- the pool child ------------------------------------------------------------------------

#: Outcomes :func:`run_batch` computed, by task id, until the tracer asks for them, each
#: with the ``sits.*`` attributes of the batch's span (``tracing.batch_span``).
_outcomes: dict[str, tuple[Any, Mapping[str, Any]]] = {}


def run_batch(given: list[tuple[Any, ...]], join: dict[str, Any] | None = None
              ) -> tuple[list[tuple[Any, Any, float] | None], dict[str, Any]]:
    """Pool job: the batch's calls in one run, then Celery's tracer per task.

    ``given`` are the arguments Celery's own job would have had per task (name, id,
    request, body, content type, encoding). Returns what that job returns, per task,
    each with the batch's run time, and the run's timing for the batch's time budget
    (``batchtime.py``): its seconds without the cold start, and whether its time limit
    stopped it. ``join`` (a batch that takes joins, ``joins.py``): its join list's keys,
    its capacity in rows and for how long it takes joins, s; the jobs that joined are
    returned after the batch's own, None for each it declined.
    """
    began = time.monotonic()
    app = current_app._get_current_object()
    task = app.tasks[given[0][0]]
    jobs: list[tuple[Any, ...]] = []
    calls: list[Call] = []

    def add(job: tuple[Any, ...]) -> tuple[int, Call]:
        _name, task_id, request, body, content_type, encoding = job
        args, kwargs, _embed = loads(body, content_type, encoding,  # type: ignore[no-untyped-call]
                                     accept={content_type})
        jobs.append(job)
        calls.append(Call(task_id, tuple(args), dict(kwargs),
                          runtime.task_prefix_key(request)))
        return len(calls) - 1, calls[-1]

    for job in given:
        add(job)
    trace = fast_trace_task if app.use_fast_trace_task else trace_task_ret
    traced: dict[int, Any] = {}  # calls done before the batch: what their trace returned
    said: dict[str, Any] = {}  # what the batch's span says, for each member's own

    def early(index: int, output: Any, meta: dict[str, Any]) -> bool:
        # Celery's tracer, as for any task (result, signals, chord), run now: the
        # caller's get() returns while the batch goes on. Events and the ack follow
        # with the batch's, from the main process. A call is traced once.
        if index in traced or not 0 <= index < len(calls):
            return False
        _outcomes[calls[index].id] = (output if isinstance(output, BaseException) else
                                      _result(output, meta, index, len(calls),
                                              joined=index >= len(given)), said)
        traced[index] = trace(*jobs[index])
        return True

    feed = _feed(app, join, add) if join is not None else None
    try:
        # its own span: the members' run spans begin only as each is traced, after it
        with tracing.batch_span(f"run_batch/{task.name}", [job[2] for job in jobs], said):
            outcomes, timing = _run(task, calls, jobs[0][2], early, feed)
        declined = feed.declined if feed is not None else set()
        _outcomes.update({c.id: (outcomes[c.id], said) for i, c in enumerate(calls)
                          if i not in traced and i not in declined})
        results = [None if i in declined else traced[i] if i in traced else trace(*job)
                   for i, job in enumerate(jobs)]
    finally:
        for call in calls:
            _outcomes.pop(call.id, None)
    elapsed = time.monotonic() - began
    timing["seconds"] = max(0.0, elapsed - timing.pop("cold_s"))
    return [None if r is None else (r[0], r[1], elapsed) for r in results], timing


def _feed(app: Any, join: dict[str, Any], add: Callable[[tuple[Any, ...]], tuple[int, Call]]
          ) -> joins.Feed:
    """The child's end of a batch's joins (``joins.py``), from the job's start: its soft
    time limit counts from there, the engine's load included."""
    now = time.monotonic()
    soft = join.get("soft_s")
    deadline = now + float(soft) if soft else None
    return joins.Feed(advertise.client_for(runtime.for_app(app).config), list(join["keys"]),
                      int(join["capacity"]), now + float(join["for_s"]), add,
                      lambda: deadline)


def _run(task: Any, calls: list[Call], request: dict[str, Any],
         early: Callable[[int, Any, dict[str, Any]], bool] | None = None,
         feed: joins.Feed | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The batch through ``run_inference`` (engine, limits, accounting) under the first
    task's request; every call's outcome (the error of a failed run fails them all but
    those ``early`` took before it failed, and those ``feed`` declined), and the run's
    cold start, s, and whether its time limit stopped it. Calls that join on the way
    (``feed``) are appended to ``calls``; their outcomes go through ``early``."""
    own = list(calls)
    delivered: set[int] = set()
    failed: list[str] = []  # reasons, one per failed call, counted once each

    def fail(out: Any) -> None:
        if isinstance(out, BaseException) and (reason := metrics.failure_reason(out)):
            failed.append(reason)

    def taking(index: int, output: Any, meta: dict[str, Any]) -> bool:
        # a call delivered early is counted then (run_inference leaves it out of a
        # failure of the rest), whether it joined or was the batch's own
        taken = early is not None and early(index, output, meta)
        if taken:
            delivered.add(index)
            fail(output)
        return taken

    task.push_request(**{**request, "id": calls[0].id, "args": calls[0].args,
                         "kwargs": calls[0].kwargs, "is_eager": False})
    try:
        result = inference.run_inference(runtime.for_app(task.app), task, (calls,), {},
                                         tasks=len(calls), early=taking if early else None,
                                         joins=feed)
    except Exception as exc:  # SoftTimeLimitExceeded too: each call fails with it
        # (run_inference counted it for the calls not delivered)
        _count(failed)
        return ({c.id: exc for c in calls},
                # (a run that failed otherwise, a load or the memory, says nothing of
                # how long its calls take: the budget leaves it out)
                {"cold_s": 0.0, "cut_short": isinstance(exc, SoftTimeLimitExceeded),
                 "failed": not isinstance(exc, SoftTimeLimitExceeded)})
    finally:
        task.pop_request()
        if feed is not None:  # before the tracing: what is pushed from now runs apart
            feed.close()
    outcomes = split_outputs(result["output"], own, result["sits"])
    declined = feed.declined if feed is not None else set()
    for i, call in enumerate(calls):
        if i >= len(own):  # a joined call's outcome went through early, if it had one
            outcomes[call.id] = InferenceError(f"call {call.id} joined the batch but got "
                                               "no result")
        if i not in delivered and i not in declined:
            fail(outcomes[call.id])
    _count(failed)
    # (a generation's own check between steps fails the rows still going, one by one)
    stopped = any(isinstance(o, SoftTimeLimitExceeded) for o in outcomes.values())
    return outcomes, {"cold_s": acquire.cold_seconds(result["sits"]), "cut_short": stopped}


def _count(failed: list[str]) -> None:
    child = runtime.child()
    if failed and child is not None:
        for reason in failed:
            child.count(metrics.failure_fields(reason))
        child.publish()


# -- the built-in batch functions' arguments (batchembed.py, batchgen.py) -----------------

def arguments(signature: inspect.Signature, task: str, engine: Any, call: Call
               ) -> dict[str, Any] | InvalidInput:
    """One call's arguments by name, defaults filled in, as the batch function's
    single-call signature reads them; or the error that fails that call alone."""
    try:
        bound = signature.bind(engine, *call.args, **call.kwargs)
    except TypeError as exc:
        return InvalidInput(f"{task} arguments: {exc}")
    bound.apply_defaults()
    return dict(bound.arguments)


class BatchInferenceTask(inference.InferenceTask):
    """Task base for ``@app.batch_inference_task``: ``fun(engine, calls) -> outputs``."""

    abstract = True
    Request = "sits_queue.workers.batched:BatchRequest"
    batches = True
    #: Callers pass one call's arguments, not the function's (engine, calls).
    typing = False
    #: Whether a running batch takes waiting tasks of its key into rows it freed
    #: (``joins.py``): only a function that reads joining calls does (the built-in
    #: generation batch, ``batchgen.py``).
    joins = False
    #: ``work(*args, **kwargs) -> float``: a call's share of a batch's time (None: 1).
    batch_work: Callable[..., float] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task_id = self.request.id
        if task_id in _outcomes:  # a batch computed it (run_batch)
            outcome, said = _outcomes.pop(task_id)
            # this task's run span began after the batch ran: it says what the batch did
            tracing.annotate({**said, **_own_attributes(outcome)})
        else:  # alone: a batch of one (an eager call, or a worker without batches)
            call = Call(task_id or "", args, kwargs)
            result = inference.run_inference(runtime.for_app(self.app), self, ([call],), {})
            outcome = split_outputs(result["output"], [call], result["sits"])[call.id]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def _own_attributes(outcome: Any) -> dict[str, Any]:
    """The span attributes a batch's call has of its own (a generation row's first
    token and cached prompt tokens), from its outcome."""
    if not isinstance(outcome, dict):
        return {}
    meta, output = outcome.get("sits") or {}, outcome.get("output")
    cached = output.get("cached_tokens") if isinstance(output, dict) else None
    return {"sits.first_token_ms": meta.get("first_token_ms"),
            "sits.cached_tokens": cached if isinstance(cached, int) else None}


# -- the main process ----------------------------------------------------------------------

#: Batches being delivered now (the transport's marks), with the requests that came.
_open: dict[str, list[Any]] = {}
#: Whole batches on their way to the pool, by their first request's id.
_ready: dict[str, list[Any]] = {}


def gather(request: Any, run: Callable[[Any], Any]) -> Any:
    """The consumer's ``on_task_request`` for every request (``run`` is Celery's own):
    a member of a batch being delivered is held until the batch is whole; the first one
    held then goes to ``run`` (through the pool semaphore, once for all) carrying the
    others. Anything else, a late member included, runs as usual."""
    mark = batch_mark(getattr(request, "request_dict", None))
    members = _open.get(mark[0]) if mark is not None else None
    if members is None:
        return run(request)
    members.append(request)
    return None


def delivery(batch: str, done: bool, run: Callable[[Any], Any]) -> None:
    """The transport's marks around a batch's delivery; at the end, send what came (a
    join delivery's to the running batch it joins, ``joins.py``)."""
    if not done:
        _open[batch] = []
        return
    members = _open.pop(batch, None)
    for lone in [m for m in members or () if not getattr(m, "batchable", False)]:
        # a task that is no batch task under a batch key (a header made by hand, an app
        # that changed): run as usual, or it would be held for ever
        run(lone)
    members = [m for m in members or () if getattr(m, "batchable", False)]
    if not members:
        return
    if joins.joining(batch) and _joins is not None:
        joins.attach(batch, members, _admitted, lambda rest: run_apart(rest, run),
                     _joins.client)
        return
    run_apart(members, run)


def run_apart(members: list[Any], run: Callable[[Any], Any]) -> None:
    """``members`` as one batch of their own, through Celery's pool semaphore."""
    _ready[members[0].id] = members
    run(members[0])


def _execute_batched(self: Any, pool: Any, **kwargs: Any) -> Any:
    """``execute_using_pool`` of a batch task: the request and those it carries, each
    checked (revoked, VRAM admission) and run as one pool job."""
    members = _ready.pop(self.id, None) or [self]
    runnable = [m for m in members if _admitted(m)]
    if not runnable:
        raise TaskRevokedError(self.id)  # frees the pool slot it was given
    # (the calls that would not fit the batch's time limit go back to their queue)
    return submit(batchbudget.cut(runnable), pool)


def _admitted(request: Any) -> bool:
    """False for a request revoked meanwhile, or whose declared VRAM does not fit (then
    its message goes back to the queue, as ``request.py`` does for any task)."""
    return not request.revoked() and not admission.refused(request)


@dataclass(frozen=True)
class JoinSetup:
    """What the main process needs to run batches that take joins (``joins.py``)."""

    client: Any  # the transport's Redis client
    prefix: str  # the transport's global key prefix
    for_s: float  # SitsConfig.batch_join_s
    run: Callable[[Any], Any]  # Celery's on_task_request


#: Set by the :class:`Batches` step on a prefork worker whose transport can join.
_joins: JoinSetup | None = None


def _join_spec(requests: list[Any], soft: float | None) -> dict[str, Any] | None:
    """The ``join`` argument of :func:`run_batch` for a batch that takes joins here."""
    first = requests[0]
    if _joins is None or not getattr(first.task, "joins", False):
        return None
    headers = first.request_dict or {}
    delivery, header = headers.get(DELIVERY_HEADER), headers.get(HEADER)
    queue = delivery[0] if isinstance(delivery, list) and delivery else None
    key = header.get("batch") if isinstance(header, dict) else None
    if not isinstance(queue, str) or not isinstance(key, str):
        return None
    # a call's own max_batch bounds the batch it leads, joins included
    capacity = int(getattr(first.task, "max_batch", 1) or 1)
    most = header.get("batch_max") if isinstance(header, dict) else None
    if isinstance(most, int) and not isinstance(most, bool) and most >= 1:
        capacity = min(capacity, most)
    return {"queue": queue, "key": key, "keys": joins.join_keys(queue, first.id, _joins.prefix),
            "capacity": capacity, "for_s": _joins.for_s, "soft_s": soft}


def submit(requests: list[Any], pool: Any) -> Any:
    """One pool job for ``requests``; Celery's callbacks fan out to each of them (and to
    the tasks that joined it on the way, ``joins.py``)."""
    first = requests[0]
    hard, soft = admission.time_limits(first)
    setup, join = _joins, _join_spec(requests, soft)
    requests = list(requests)  # joins.attach appends to it
    own = len(requests)
    ended: list[Any] = []  # once the run failed: the requests it served

    def rerun(rest: list[Any]) -> None:
        # A worker shutting down (the step stopped) leaves them unacked: they go back
        # to the queue with the channel's unacked messages.
        if rest and setup is not None and _joins is setup:
            run_apart(rest, setup.run)

    def served(error: bool) -> list[Any]:
        """The requests the run served; once it failed or its child died (``error``),
        the attached ones it had not taken run again (once)."""
        if join is None or setup is None or not error:
            back = joins.given_back(first.id) if join is not None else set()
            return [r for r in requests if r.id not in back] if back else requests
        if not ended:
            done_by_run, rest = joins.finish(first.id, setup.client)
            # (a batch joins no longer knows: its own requests at least)
            ended.append(done_by_run or requests[:own])
            rerun(rest)
        return list(ended[0])

    def each(method: str, error: bool = True) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            # billiard calls the timeout callback by keyword: (soft=, timeout=)
            soft = kwargs.get("soft", args[0] if args else False)
            hard = method != "on_timeout" or not soft
            terminated = method == "on_failure" and isinstance(
                admission.failure_of(args[0] if args else kwargs.get("exc_info")),
                Terminated)
            if method == "on_timeout" and hard:  # killed: the child says nothing more
                batchbudget.stopped(requests[:own])
            for request in served(error and hard):
                if error and hard and len(requests) > 1 and _finished(request):
                    continue
                if terminated and not _revoked(request):
                    # A batch-mate of a task revoked with terminate=True: the kill that
                    # stopped that task stopped the whole batch. Not revoked itself, it
                    # goes back to its queue uncounted (it was announced revoked, and lost)
                    admission._give_back(request)
                    continue
                getattr(request, method)(*args, **kwargs)
        return call

    def done(ran: Any) -> None:
        if isinstance(ran, ExceptionInfo):
            # The solo and threads pools' apply_target hands a BaseException the run
            # raised (a batch function's SystemExit) to the success callback, wrapped as
            # a lost worker: unpacked as results it raised here, and no call was answered.
            each("on_failure")(ran)
            return
        results, timing = ran
        if not timing.get("failed"):  # every call it served, joined ones included
            (batchbudget.stopped if timing["cut_short"] else batchbudget.ran)(
                [r for r, o in zip(requests, results, strict=False) if o is not None],
                timing["seconds"])
        rest: list[Any] = []
        back: set[str] = set()
        if join is not None and setup is not None:
            back = joins.given_back(first.id)  # (declined, run again already)
            _, rest = joins.finish(first.id, setup.client, taken=len(results) - own)
        for request, outcome in zip(requests, results, strict=False):
            if outcome is None:  # a join the child declined
                if request.id not in back:
                    rest.append(request)
            else:
                request.on_success(outcome)
        rerun(rest)

    result = pool.apply_async(
        run_batch, args=([_job(r) for r in requests],),
        kwargs={"join": {k: join[k] for k in ("keys", "capacity", "for_s", "soft_s")}}
        if join else {},
        accept_callback=each("on_accepted", error=False), timeout_callback=each("on_timeout"),
        callback=done, error_callback=each("on_failure"), soft_timeout=soft,
        timeout=hard, correlation_id=first.id)
    if result is not None:
        for request in requests:
            request._apply_result = ref(result)
        if join is not None:
            joins.start(first.id, join["queue"], join["key"], join["keys"], requests,
                        lambda: getattr(result, "_worker_pid", None))
    if len(requests) > 1:
        logger.debug("batch of %d %s tasks sent to the pool", len(requests), first.name)
    return result


def _revoked(request: Any) -> bool:
    """Whether ``request`` itself was revoked (not a batch-mate of one); read without
    ``Request.revoked()``, which would announce it so."""
    return bool(request._already_revoked or request.id in state.revoked)


def _finished(request: Any) -> bool:
    """Whether the failed run had finished ``request`` already: a generation row that
    ended before the batch and stored its SUCCESS. Its failure would fire its errbacks,
    count a chord part twice and run its task_failure handlers for a task that
    succeeded; it is done: acked, as Celery treats one whose worker was lost after it."""
    try:
        stored = request._success_was_stored()
    except Exception:  # a backend that cannot say: treat it as the rest
        return False
    if not stored:
        return False
    if request.task.acks_late:
        request.acknowledge()
    state.task_ready(request)
    return True


def _job(request: Any) -> tuple[Any, ...]:
    return (request.type, request.id, request.request_dict, request.body,
            request.content_type, request.content_encoding)


class BatchRequest(SitsRequest):
    """Request of a batch task: runs with the requests of its batch in one pool job.

    Celery generates a subclass per task type with its own ``execute_using_pool``;
    the batch one replaces it (it does SitsRequest's VRAM admission per member).
    """

    #: Whether a delivered batch may carry it (any other request in one runs alone).
    batchable = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.execute_using_pool = _execute_batched


BatchRequest.execute_using_pool = _execute_batched


def reserved_units() -> int:
    """Reserved requests, a batch counting as one (it takes one pool slot; so do the tasks
    that joined it)."""
    return batch_units((id(r), getattr(r, "request_dict", None))
                       for r in list(state.reserved_requests) if not joins.attached(r))


def _has_gpus() -> bool:
    """Whether this worker's children run on GPUs (NVML's discovery in the parent)."""
    return bool(runtime.plan().discovery.cuda_devices)


class Batches(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer step: requests of a delivered batch are gathered before Celery's pool
    semaphore (one slot for the batch), and a batch counts as one task where the worker
    decides whether to take more (``worker_disable_prefetch`` counts reserved requests
    against the pool size: a batch of 32 would stop a worker whose second child is idle
    from taking anything)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    name = "SITS batches"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        run = c.on_task_request  # before Tasks.start builds the strategies around it
        c.on_task_request = lambda request: gather(request, run)
        self.run = run

    def start(self, c: Any) -> None:
        intake.on_batch(lambda batch, done: delivery(batch, done, self.run))
        self._start_joins(c)
        if not c.app.conf.worker_disable_prefetch or c.task_consumer is None:
            return
        qos = c.task_consumer.channel.qos
        plain = type(qos).can_consume

        def can_consume(self: Any) -> bool:
            limit = getattr(c.controller, "max_concurrency", None) or c.pool.num_processes
            return reserved_units() < limit and bool(plain(self))

        qos.can_consume = can_consume.__get__(qos)

    def _start_joins(self, c: Any) -> None:
        """Continuous batching (``joins.py``) on a prefork worker of our transport: the
        main process must go on polling while a child runs the batch."""
        global _joins
        channel: Any = getattr(c.task_consumer, "channel", None)
        config = getattr(c.app, "sits", None)
        if (config is None or not joins.wanted(config.batch_join, _has_gpus())
                or type(c.pool).__module__ != "celery.concurrency.prefork"
                or not hasattr(channel, "join_pick") or c.timer is None):
            return
        _joins = JoinSetup(channel.raw, channel.global_keyprefix or "", config.batch_join_s,
                           self.run)
        self._poll = c.timer.call_repeatedly(
            joins.POLL_S, joins.poll,
            (channel.raw, channel.join_pick, lambda rest: run_apart(rest, self.run)))

    def stop(self, c: Any) -> None:
        global _joins
        intake.on_batch(None)
        poll, self._poll = getattr(self, "_poll", None), None
        if poll is not None:
            poll.cancel()
        _joins = None
        # A batch cut short by a reconnect or shutdown: its messages go back to the queue
        # with the channel's unacked ones (or by the visibility timeout).
        _open.clear()
        _ready.clear()
