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
   events, revokes, expiry), and, in the main process (``batchmain.py``), ``gather``
   holds them until the end mark, then passes the first on through Celery's pool
   semaphore carrying the others, and ``BatchRequest`` sends the pool one job for all
   of them (each checked for revokes and VRAM admission first), with their time limits.
3. In the pool child, :func:`run_batch` marks each call ``STARTED`` (one packet for
   the batch, :func:`mark_started`), gets the engine once and calls the task's
   function once with every call (:class:`Call`); then each request goes through
   Celery's own tracer as if it had run alone, with the outcome the batch gave it:
   its result stored, its signals sent, its failure its own. The main process sends
   each its ``task-started`` event when the child takes the job, and acks each message
   and sends each its other events (Flower sees every task).

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
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery import current_app, states
from celery._state import _task_stack
from celery.app.task import Context, get_actual_ignore_result
from celery.app.trace import fast_trace_task, trace_task_ret
from celery.exceptions import Retry, SoftTimeLimitExceeded
from kombu.serialization import loads, prepare_accept_content

from sits_queue import tracing
from sits_queue.broker.keys import AFFINITY_HEADER
from sits_queue.errors import InferenceError, InvalidInput
from sits_queue.exits import fail_exits
from sits_queue.workers import (
    acquire,
    advertise,
    devicefit,
    inference,
    joins,
    metrics,
    runtime,
    softsignal,
    taskheader,
)

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
    # (a pool job of its own, not through Celery's tracer, whose task_prerun gives the
    # soft-limit signal back: muted since the child's last task ended, it stayed so,
    # and the batch's soft limit never fired; its members' traces leave it to the job)
    with softsignal.batch_job():
        return _run_batch(given, join)


def _run_batch(given: list[tuple[Any, ...]], join: dict[str, Any] | None
               ) -> tuple[list[tuple[Any, Any, float] | None], dict[str, Any]]:
    began = time.monotonic()
    app = current_app._get_current_object()
    task = app.tasks[given[0][0]]
    jobs: list[tuple[Any, ...]] = []
    calls: list[Call] = []
    requests: list[Context] = []  # each call's request as Celery's tracer makes it

    # The app's accepted content only: a job that joined came from a Redis list anyone
    # with the broker's password can push to, and one declaring pickle was unpickled
    # here (its own content type was taken as accepted)
    accept = prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]

    def add(job: tuple[Any, ...]) -> tuple[int, Call]:
        _name, task_id, request, body, content_type, encoding = job
        args, kwargs, embed = loads(body, content_type, encoding,  # type: ignore[no-untyped-call]
                                    accept=accept)
        jobs.append(job)
        calls.append(Call(task_id, tuple(args), dict(kwargs),
                          taskheader.task_prefix_key(request)))
        requests.append(Context({**request, **(embed or {}), "args": args, "kwargs": kwargs,
                                 "is_eager": False}, called_directly=False))
        return len(calls) - 1, calls[-1]

    def joined(job: tuple[Any, ...]) -> tuple[int, Call]:
        index, call = add(job)
        mark_started(task, requests[index:index + 1])
        return index, call

    for job in given:
        add(job)
    # This child's device may not hold what the calls declare (``devicefit.py``): none
    # runs, nor is marked STARTED; the main process gives them all back together
    # (``batchmain.py``), uncounted, as a task alone
    misfit = devicefit.batch_misfit(runtime.child(), task, requests)
    if misfit is not None:
        return [None] * len(jobs), {"seconds": 0.0, "cut_short": False, "failed": True,
                                    "not_here": misfit.reason}
    # (each call's record stayed PENDING until its trace after the batch: a revoke()
    # without terminate, on a worker that did not hold the batch, marked a running call
    # REVOKED and its caller's get() raised, though the batch ran it to its SUCCESS)
    mark_started(task, requests)
    trace = fast_trace_task if app.use_fast_trace_task else trace_task_ret
    traced: dict[int, Any] = {}  # calls done before the batch: what their trace returned
    said: dict[str, Any] = {}  # what the batch's span says, for each member's own

    feed = _feed(app, join, joined) if join is not None else None

    def early(index: int, output: Any, meta: dict[str, Any]) -> bool:
        # Celery's tracer, as for any task (result, signals, chord), run now: the
        # caller's get() returns while the batch goes on. Events and the ack follow
        # with the batch's, from the main process. A call is traced once.
        if index in traced or not 0 <= index < len(calls):
            return False
        late = index >= len(given)  # it joined the batch on the way
        if late and feed is not None:  # its own run: its join to its end, warm
            meta = feed.own_meta(index, meta)
        _outcomes[calls[index].id] = (output if isinstance(output, BaseException) else
                                      # (its size: the calls it began with, for every
                                      # member; it was the count joined so far)
                                      _own_pick(_result(output, meta, index, len(given),
                                                        joined=late), requests[index]),
                                      said)
        traced[index] = trace(*jobs[index])
        return True

    try:
        # its own span: the members' run spans begin only as each is traced, after it
        with tracing.batch_span(f"run_batch/{task.name}", [job[2] for job in jobs], said):
            outcomes, timing = _run(task, calls, jobs[0][2], early, feed)
        declined = feed.declined if feed is not None else set()
        _outcomes.update({c.id: (_own_pick(outcomes[c.id], requests[i]), said)
                          for i, c in enumerate(calls) if i not in traced and i not in declined})
        results = [None if i in declined else traced[i] if i in traced else trace(*job)
                   for i, job in enumerate(jobs)]
    finally:
        for call in calls:
            _outcomes.pop(call.id, None)
    elapsed = time.monotonic() - began
    timing["seconds"] = max(0.0, elapsed - timing.pop("cold_s"))
    return [None if r is None else (r[0], r[1], elapsed) for r in results], timing


def _own_pick(outcome: Any, request: Any) -> Any:
    """A member's outcome saying whether it was itself taken ahead of its queue's head
    by affinity: the first call's flag was every member's (each result said true where
    the worker counted one such pick), and its kin were only gathered with it."""
    if isinstance(outcome, dict) and isinstance(outcome.get("sits"), dict):
        outcome["sits"]["affinity"] = bool(getattr(request, AFFINITY_HEADER, False))
    return outcome


def mark_started(task: Any, requests: list[Context]) -> None:
    """``STARTED`` for each call about to run, as Celery's tracer stores it for a task
    with ``track_started`` (``{"pid", "hostname"}``, the request's fields), unless the
    task or its call ignores results; in one packet on SITS's backend (one revoked
    meanwhile stays REVOKED there). Its tracer stores it again after the batch, as for
    any task. A backend that fails here only loses the early mark."""
    wanted = [r for r in requests
              if task.track_started and not get_actual_ignore_result(task, r)]
    if not wanted:
        return
    pid = os.getpid()
    started = [(r.id, {"pid": pid, "hostname": r.hostname or socket.gethostname()}, r)
               for r in wanted]
    backend = task.backend
    try:
        store = getattr(backend, "store_started", None)
        if store is not None:
            store(started)
            return
        for task_id, result, request in started:  # another backend: as Celery's tracer
            backend.store_result(task_id, result, states.STARTED, request=request)
    except Exception as exc:
        logger.warning("could not mark %d %s calls STARTED at their batch's start: %s",
                       len(started), task.name, exc)


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
        if not isinstance(out, BaseException):
            return
        # (a BaseException that is no Exception fails its call with an InferenceError:
        # BatchInferenceTask.__call__)
        reason = metrics.failure_reason(out) if isinstance(out, Exception) \
            else InferenceError.__name__
        if reason:
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
    # celery.current_task too, as Celery's tracer sets it around a task's body: it is an
    # inference function's way to its request (it cannot bind), and was None here
    _task_stack.push(task)
    try:
        # (a batch function's sys.exit(): each call fails with it)
        with fail_exits(task, f"the batch of {len(calls)} {getattr(task, 'name', '?')} "
                              f"calls led by {calls[0].id}"):
            result = inference.run_inference(runtime.for_app(task.app), task, (calls,), {},
                                             tasks=len(calls),
                                             early=taking if early else None, joins=feed)
    except Exception as exc:  # SoftTimeLimitExceeded too: each call fails with it
        if isinstance(exc, Retry):
            # (its request is hand-made, called directly to Celery: retry() sent nothing,
            # and each call was stored as RETRY and never ran again)
            exc = InferenceError(
                f"batch task {task.name}: a batch function cannot retry() (one run serves "
                f"{len(calls)} calls, and a retry would re-send one call's arguments); "
                "fail the calls, or return an exception for those that failed, and "
                "retry from the caller")
        # (run_inference counted it for the calls not delivered)
        _count(failed)
        return ({c.id: exc for c in calls},
                # (a run that failed otherwise, a load or the memory, says nothing of
                # how long its calls take: the budget leaves it out)
                {"cold_s": 0.0, "cut_short": isinstance(exc, SoftTimeLimitExceeded),
                 "failed": not isinstance(exc, SoftTimeLimitExceeded)})
    finally:
        _task_stack.pop()
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
    Request = "sits_queue.workers.batchmain:BatchRequest"
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
            with fail_exits(self):
                devicefit.check_here(self)
                result = inference.run_inference(runtime.for_app(self.app), self, ([call],),
                                                 {})
            outcome = split_outputs(result["output"], [call], result["sits"])[call.id]
        if isinstance(outcome, Exception):
            raise outcome
        if isinstance(outcome, BaseException):
            # (a SystemExit, KeyboardInterrupt or other BaseException given for one call:
            # Celery's tracer re-raises those, which ended the batch's loop over its calls
            # and failed every call traced after this one with its error)
            raise InferenceError(f"the batch function failed this call with "
                                 f"{type(outcome).__name__}: {outcome} (a BaseException "
                                 "that is no Exception; give an Exception)") from outcome
        return outcome


def _own_attributes(outcome: Any) -> dict[str, Any]:
    """The span attributes a batch's call has of its own (a generation row's first
    token and cached prompt tokens, whether it was taken ahead by affinity; a call that
    joined it on the way, its warm start), from its outcome."""
    if not isinstance(outcome, dict):
        return {}
    meta, output = outcome.get("sits") or {}, outcome.get("output")
    cached = output.get("cached_tokens") if isinstance(output, dict) else None
    own = {"sits.first_token_ms": meta.get("first_token_ms"),
           "sits.cached_tokens": cached if isinstance(cached, int) else None,
           "sits.affinity": meta.get("affinity")}
    if (meta.get("batch") or {}).get("joined"):
        own["sits.cold"] = meta.get("cold")
    return own
