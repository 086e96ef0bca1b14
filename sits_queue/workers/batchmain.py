"""Same-model batches in the worker's main process (``batched.py`` says how a batch
goes, and runs it in the pool child): a delivered batch's requests gathered before
Celery's pool semaphore (:func:`gather`, :func:`delivery`), sent to the pool as one job
(:class:`BatchRequest`, :func:`submit`), and the pool's callbacks fanned out to each
request (:class:`_PoolJob`); the consumer step that wires it in (:class:`Batches`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from weakref import ref

from billiard.einfo import ExceptionInfo
from billiard.exceptions import Terminated
from celery import bootsteps
from celery.exceptions import TaskRevokedError
from celery.worker import state

from sits_queue.broker import intake
from sits_queue.broker.keys import DELIVERY_HEADER, batch_mark, batch_units
from sits_queue.options import HEADER
from sits_queue.workers import batchbudget, joins, runtime
from sits_queue.workers import request as admission
from sits_queue.workers.batched import run_batch
from sits_queue.workers.request import SitsRequest

logger = logging.getLogger(__name__)

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
    its message goes back to the queue, as ``request.py`` does for any task), or that
    Celery raises on (then it is dead-lettered with the error, its batch-mates run)."""
    try:
        return not request.revoked() and not admission.refused(request)
    except Exception as exc:
        if not admission.dead_letter_unstartable(request, exc):
            raise
        return False


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


@dataclass
class _PoolJob:
    """A batch's requests as one pool job: what Celery's pool callbacks for the job do to
    each request (and to those that joined it on the way, ``joins.py``)."""

    requests: list[Any]  # joins.attach appends to it
    own: int  # the batch's own requests, the first ones; any after them joined it
    join: dict[str, Any] | None  # _join_spec's: None where the batch takes no joins
    setup: JoinSetup | None  # _joins as it was when the job was sent
    #: Once the run failed: the requests it served (set once).
    ended: list[list[Any]] = field(default_factory=list)

    @property
    def first(self) -> Any:
        return self.requests[0]

    def rerun(self, rest: list[Any]) -> None:
        # A worker shutting down (the step stopped) leaves them unacked: they go back
        # to the queue with the channel's unacked messages.
        if rest and self.setup is not None and _joins is self.setup:
            run_apart(rest, self.setup.run)

    def served(self, error: bool) -> list[Any]:
        """The requests the run served; once it failed or its child died (``error``),
        the attached ones it had not taken run again (once)."""
        if self.join is None or self.setup is None or not error:
            back = joins.given_back(self.first.id) if self.join is not None else set()
            return [r for r in self.requests if r.id not in back] if back else self.requests
        if not self.ended:
            done_by_run, rest = joins.finish(self.first.id, self.setup.client)
            # (a batch joins no longer knows: its own requests at least)
            self.ended.append(done_by_run or self.requests[:self.own])
            self.rerun(rest)
        return list(self.ended[0])

    def each(self, method: str, error: bool = True) -> Callable[..., None]:
        """A pool callback that calls ``method`` of each request served (``error``: the
        callback of a failure, after which finished and killed ones are told apart)."""
        def call(*args: Any, **kwargs: Any) -> None:
            self._each(method, error, args, kwargs)
        return call

    def _each(self, method: str, error: bool, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
        # billiard calls the timeout callback by keyword: (soft=, timeout=)
        soft = kwargs.get("soft", args[0] if args else False)
        hard = method != "on_timeout" or not soft
        terminated = method == "on_failure" and isinstance(
            admission.failure_of(args[0] if args else kwargs.get("exc_info")), Terminated)
        if method == "on_timeout" and hard:  # killed: the child says nothing more
            batchbudget.stopped(self.requests[:self.own])
        served = self.served(error and hard)
        mate_revoked = terminated and any(_revoked(r) for r in served)
        for request in served:
            if error and hard and len(self.requests) > 1 and _finished(request):
                continue
            if terminated and not _revoked(request):
                if mate_revoked:
                    # A batch-mate of a task revoked with terminate=True: the kill that
                    # stopped that task stopped the whole batch. Not revoked itself, it
                    # goes back to its queue uncounted (it was announced revoked, and lost)
                    admission._give_back(request)
                # else a cold shutdown's cancel (none revoked): held, as a plain task's
                # message is, for the channel's close to give back, counted (it started;
                # given back uncounted, a batch that hung its worker into a cold shutdown
                # never neared the poison limit, and came back as kin of new arrivals)
                continue
            getattr(request, method)(*args, **kwargs)

    def done(self, ran: Any) -> None:
        """The pool's success callback: each call's outcome to its request."""
        if isinstance(ran, ExceptionInfo):
            # The solo and threads pools' apply_target hands a BaseException the run
            # raised (a batch function's SystemExit) to the success callback, wrapped as
            # a lost worker: unpacked as results it raised here, and no call was answered.
            self.each("on_failure")(ran)
            return
        results, timing = ran
        if (reason := timing.get("not_here")) is not None:
            # None ran: the child's device cannot hold what they declare (devicefit.py)
            if self.join is not None and self.setup is not None:
                self.rerun(joins.finish(self.first.id, self.setup.client, taken=0)[1])
            admission.release_batch(self.requests[:self.own], reason)
            return
        if not timing.get("failed"):  # every call it served, joined ones included
            (batchbudget.stopped if timing["cut_short"] else batchbudget.ran)(
                [r for r, o in zip(self.requests, results, strict=False) if o is not None],
                timing["seconds"])
        rest: list[Any] = []
        back: set[str] = set()
        if self.join is not None and self.setup is not None:
            back = joins.given_back(self.first.id)  # (declined, run again already)
            _, rest = joins.finish(self.first.id, self.setup.client,
                                   taken=len(results) - self.own)
        for request, outcome in zip(self.requests, results, strict=False):
            if outcome is None:  # a join the child declined
                if request.id not in back:
                    rest.append(request)
            else:
                request.on_success(outcome)
        self.rerun(rest)


def submit(requests: list[Any], pool: Any) -> Any:
    """One pool job for ``requests``; Celery's callbacks fan out to each of them (and to
    the tasks that joined it on the way, ``joins.py``)."""
    first = requests[0]
    hard, soft = admission.time_limits(first)
    job = _PoolJob(list(requests), len(requests), _join_spec(requests, soft), _joins)
    join = job.join
    result = pool.apply_async(
        run_batch, args=([_job(r) for r in job.requests],),
        kwargs={"join": {k: join[k] for k in ("keys", "capacity", "for_s", "soft_s")}}
        if join else {},
        accept_callback=job.each("on_accepted", error=False),
        timeout_callback=job.each("on_timeout"), callback=job.done,
        error_callback=job.each("on_failure"), soft_timeout=soft, timeout=hard,
        correlation_id=first.id)
    if result is not None:
        for request in job.requests:
            request._apply_result = ref(result)
        if join is not None:
            joins.start(first.id, join["queue"], join["key"], join["keys"], job.requests,
                        lambda: getattr(result, "_worker_pid", None))
    if len(job.requests) > 1:
        logger.debug("batch of %d %s tasks sent to the pool", len(job.requests), first.name)
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
