"""Admission in the worker's main process: a task that cannot fit is left for another worker.

A task may declare ``vram_gib`` (the SITS option). Before the main process hands it to a
pool child, :class:`SitsRequest` asks NVML how much memory the worker's devices have
free right now. If it does not fit, the message goes back to its queue *without*
counting as a redelivery (the broker's ``release.lua``; a redelivery count is for
messages whose worker died, and too many of those dead-letter a message), held off from
this consumer for a short time that doubles each time it releases the same message:
``pick.lua`` does not offer it back to this worker until then and hands it the tasks
behind it instead, while every other worker may take it at once. The task never fails
for want of memory it did not yet try to use, and it does not block the tasks behind it
on a worker that cannot run it.

The main process checks the roomiest device; on a worker of several GPUs it notes the
devices that hold the task, and the prefork pool hands it to an idle child pinned to one
of them (``steer.py``). Where none is idle the pool's own choice stands, and the child
checks its own device again (``devicefit.py``), raising :class:`NotOnThisDevice` when
the task does not fit there, which gives the message back the same way.

A task that declares more than this worker's largest device holds in all can never start
here: it is held off for :data:`NEVER_HERE_HOLD_S` at once, for a worker with a larger
device. And when no live worker advertises a device that large (their records in Redis,
``advertise.py``), no worker could ever start it, and it would circle between them for
good, its caller waiting without a word: its message is dead-lettered with
:class:`~sits_queue.errors.NoDeviceLargeEnough` (its caller's ``get()`` raises), to be
put back by ``sitsq dead requeue`` once a larger device serves.

A worker for plain tasks only (``plain_tasks_only``, with a pool that runs several
tasks in one process) leaves every inference task the same way: one process cannot give
each its class's VRAM cap and CPU cores, and its engine cache would be shared.

Everything here runs in the parent process: NVML only, never CUDA.

Why a wrapper rather than an override: Celery builds, per task type, a subclass of
``Task.Request`` (``celery.worker.request.create_request_cls``) whose own
``execute_using_pool`` does not call ``super()``. ``SitsRequest.__init_subclass__``
wraps that method in every such subclass, so the check runs whatever Celery generates.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from celery.exceptions import Reject, TaskRevokedError
from celery.worker.request import Request
from celery.worker.state import task_ready

from sits_queue.broker.keys import DELIVERY_HEADER
from sits_queue.errors import NoDeviceLargeEnough, TaskOutOfMemory
from sits_queue.options import HEADER, MAX_VRAM_GIB, PREWARM_TASK
from sits_queue.spells import Spell
from sits_queue.workers import steer
from sits_queue.workers.consumer import note_reject, task_reject_reason
from sits_queue.workers.freemem import FreeMemoryProbe, HostProbe
from sits_queue.workers.limits import BYTES_PER_GIB, fits
from sits_queue.workers.slices import Preempted

logger = logging.getLogger(__name__)

#: Kept free on a device beyond a task's declaration: a child's CUDA context and the
#: caching allocator's slack take a few hundred MiB that ``vram_gib`` does not count.
HEADROOM_BYTES = 512 * 2**20
#: First hold of a released message from its releaser, s: long enough for a peer's poll
#: to win it. It doubles each time the same worker releases the same message again...
HOLD_FIRST_S = 0.25
#: ...up to this, s: bounds how late this worker notices that memory came free.
HOLD_LONGEST_S = 4.0
#: Hold of a message that declares more than this worker's largest device holds in all,
#: s: no memory coming free lets it start here.
NEVER_HERE_HOLD_S = 60.0


class NotStartedHere(TaskRevokedError):  # type: ignore[misc]
    """Raised to the worker after a release: it frees the pool slot, as for a revoke."""


class NotOnThisDevice(Preempted):
    """Raised in a pool child whose own device cannot hold the task's declared
    ``vram_gib`` (``devicefit.py``): the main process gives the message back uncounted
    and held off from this worker, as after its own refusal. A ``Preempted``: Celery's
    tracer takes it as a ``Reject``, ``autoretry_for`` lets it through, and its
    traceback frames do not travel to the main process."""


@dataclass(frozen=True)
class Verdict:
    """Why a task does not start here (None from :func:`admit` means it does)."""

    needed_gib: float
    free_bytes: int

    def reason(self) -> str:
        return (f"declares vram_gib={self.needed_gib:g} but the roomiest device has "
                f"{self.free_bytes / BYTES_PER_GIB:.2f} GiB free "
                f"(minus {HEADROOM_BYTES / BYTES_PER_GIB:.2f} GiB headroom)")


@dataclass(frozen=True)
class NeverFits:
    """Why a task never starts on a worker: it declares more than the largest device
    (this worker's, or any live worker's: ``fleet``) holds in all."""

    needed_gib: float
    total_bytes: int
    fleet: bool = False

    def reason(self) -> str:
        whose = "of any live worker" if self.fleet else "of this worker"
        return (f"declares vram_gib={self.needed_gib:g} but the largest device {whose} "
                f"has {self.total_bytes / BYTES_PER_GIB:.2f} GiB in all (minus "
                f"{HEADROOM_BYTES / BYTES_PER_GIB:.2f} GiB headroom)")


@dataclass(frozen=True)
class SharedProcess:
    """Why an inference task does not start on a worker of plain tasks only."""

    pool: str
    #: Whether the pool runs several tasks in one process (else only the setting says so).
    shared: bool = True

    def reason(self) -> str:
        why = (f"its {self.pool!r} pool runs several tasks in one process" if self.shared
               else "SITS_PLAIN_TASKS_ONLY")
        return f"is an inference task, and this worker runs plain tasks only ({why})"


def declared_vram_gib(headers: Mapping[str, Any]) -> float | None:
    """The ``vram_gib`` a message declares; None when absent or unreadable (run it)."""
    header = headers.get(HEADER)
    if not isinstance(header, Mapping):
        return None
    value = header.get("vram_gib")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        gib = float(value)
    except OverflowError:  # an int beyond floats: no device holds it
        return None
    # NaN / inf from a foreign producer: unreadable, like any other bad value (fits()
    # would raise in the main process, where nothing catches it and the slot is lost)
    return gib if math.isfinite(gib) and gib >= 0 else None


def class_vram_gib(request: Request) -> float | None:
    """The VRAM limit of the class the task runs in, GiB (None: no limit, or no app to
    read it from): the class the runtime gives it (``taskheader.task_class``): its header's,
    else the task's declared one, else the default. (A class this worker does not know
    read as no limit, and a task of it declaring more than any device holds was released
    for ever, though it would have run in the default class, under that cap.)"""
    from sits_queue.app import sits_config
    from sits_queue.workers.taskheader import task_class

    try:  # (nothing here may raise in the main process: the pool slot would be lost)
        config = sits_config(request.task.app)
        return task_class(config, request.request_dict,
                          getattr(request.task, "sla_class", None)).vram_gib
    except Exception:
        return None


def admit(needed_gib: float | None, free_bytes: int,
          headroom_bytes: int = HEADROOM_BYTES) -> Verdict | None:
    """None if a task declaring ``needed_gib`` may start now, else the reason it may not."""
    if fits(needed_gib, free_bytes, headroom_bytes):
        return None
    assert needed_gib is not None  # fits() admits every undeclared task
    return Verdict(needed_gib=needed_gib, free_bytes=free_bytes)


_probe: FreeMemoryProbe | None = None
#: The probe's failures to read, said once a spell.
_unreadable = Spell(logger)
#: Set when this worker's pool runs several tasks in one process (plain tasks only).
_shared: SharedProcess | None = None


def leave_inference(pool: str | None, shared: bool = True) -> None:
    """Leave every inference task for another worker: this worker's ``pool`` (its name)
    runs several tasks in one process (``shared``), or it is set to run plain tasks only;
    None: run them (the runtime does, from its plan step)."""
    global _shared
    _shared = SharedProcess(pool, shared) if pool is not None else None


def plain_only_pool() -> str | None:
    """The pool of a worker that leaves inference tasks to others (its advert says so)."""
    return _shared.pool if _shared is not None else None


#: This worker's children's cached device memory by device UUID (:func:`cached_by_device`
#: over their records), for the probe; None: NVML's figure alone.
_cached: Callable[[], Mapping[str, int]] | None = None


def configure(probe: FreeMemoryProbe | None,
              cached: Callable[[], Mapping[str, int]] | None = None) -> None:
    """Install the parent's probe (runtime does, from its NVML discovery), and what reads
    its children's cached memory."""
    global _probe, _cached
    _probe, _cached = probe, cached


def _cached_now() -> Mapping[str, int]:
    """:data:`_cached`'s reading; nothing where it cannot be read (NVML's figure alone)."""
    if _cached is None:
        return {}
    try:
        return _cached()
    except Exception as exc:  # Redis away: the check as it was, not a lost slot
        logger.debug("children's cached device memory not read (%s)", exc)
        return {}


def probe() -> FreeMemoryProbe:
    global _probe
    if _probe is None:
        _probe = HostProbe()
    return _probe


#: The holds of a message given back because it cannot start here now: first, longest.
HOLDS = (HOLD_FIRST_S, HOLD_LONGEST_S)
#: ...because the child the pool handed it to cannot hold it (``devicefit.py``): the
#: worker has room on another device, whose child was busy (else ``steer.py`` would have
#: handed it there), so it looks again sooner.
CHILD_HOLDS = (HOLD_FIRST_S, 1.0)


def _give_back(request: Request, holds: tuple[float, float] | None = None) -> float:
    """Put the message back at its score without a redelivery (held off from this
    consumer for ``holds``, its first and longest hold, when given); forget the
    request. Returns the hold, s."""
    message = request.message
    qos: Any = getattr(getattr(message, "channel", None), "qos", None)
    held = 0.0
    if qos is not None and callable(getattr(qos, "release", None)):
        held = float(qos.release(message.delivery_tag, *(holds or ())) or 0.0)
    else:  # another transport: a plain requeue (it may count as a redelivery there)
        message.requeue()
    _forget_given_back(request)
    return held


def _forget_given_back(request: Request) -> None:
    """The worker's side of a give-back, once the message is back in its queue."""
    # kombu's own requeue() marks the message so; nothing may ack it after this.
    request.message._state = "REQUEUED"
    request.acknowledged = True
    with contextlib.suppress(Exception):  # events are best effort, as in Request.reject
        request.send_event("task-rejected", requeue=True)
    task_ready(request)


def release_batch(requests: Sequence[Request], reason: str) -> float:
    """Give back a batch's messages, none of whose calls ran because the child that got
    it cannot hold what they declare (``devicefit.py``): in one call, under one hold, so
    that they come back together as the batch they were (given back one by one, each
    hold ended a few ms after the last, and the batch came back in pieces); held off
    from this worker as a task alone. Returns the hold, s."""
    channel = getattr(requests[0].message, "channel", None) if requests else None
    release_many = getattr(getattr(channel, "qos", None), "release_many", None)
    if not callable(release_many) or any(
            getattr(r.message, "channel", None) is not channel for r in requests):
        return max((_released(r, reason, CHILD_HOLDS) for r in requests), default=0.0)
    hold = float(release_many([r.message.delivery_tag for r in requests], *CHILD_HOLDS)
                 or 0.0)
    for request in requests:
        _forget_given_back(request)
    logger.info("batch of %d %s tasks [%s] not started here: %s; released to their queue "
                "together, not taken back here for %.2f s", len(requests), requests[0].name,
                ", ".join(r.id for r in requests), reason, hold)
    return hold


def dead_letter_unstartable(request: Request, exc: Exception) -> bool:
    """Dead-letter the message of a request Celery raised on before its pool took it,
    with the error (its caller's result fails with it), and forget the request here;
    False where the message is not of our transport, or the error is a lost connection
    (then the error is raised)."""
    if not _dead_letter(request, exc):
        return False
    logger.error("task %s[%s]: Celery could not start it (%s: %s); its message is "
                 "dead-lettered", request.name, request.id, type(exc).__name__, exc,
                 exc_info=exc)
    return True


def _dead_letter(request: Request, exc: Exception) -> bool:
    """Dead-letter ``request``'s message with ``exc`` and forget the request here; False
    where the message is not of our transport, or ``exc`` is a lost connection."""
    message = request.message
    delivery = (request.request_dict or {}).get(DELIVERY_HEADER)  # [queue, message id]
    refuse = getattr(getattr(message, "channel", None), "refuse", None)
    if not callable(refuse) or not isinstance(delivery, list) or not delivery \
            or not isinstance(delivery[0], str) or not refuse(delivery[0], message, exc):
        return False
    request.acknowledged = True
    task_ready(request)
    return True


def release(request: Request, verdict: Verdict | SharedProcess | NeverFits) -> float:
    """Give the message back without a redelivery, held off from this worker; hold s."""
    return _released(request, verdict.reason(), (NEVER_HERE_HOLD_S, NEVER_HERE_HOLD_S)
                     if isinstance(verdict, NeverFits) else HOLDS)


def _released(request: Request, reason: str, holds: tuple[float, float]) -> float:
    hold = _give_back(request, holds)
    logger.info("task %s[%s] not started here: %s; released to its queue, not taken "
                "back here for %.2f s", request.name, request.id, reason, hold)
    return hold


def refused(request: Request) -> bool:
    """Give the message back (:func:`release`) when the VRAM it declares does not fit the
    roomiest device now, or it is an inference task on a worker of plain tasks only;
    True when it was given back."""
    verdict: Verdict | SharedProcess | NeverFits | None = None
    if _shared is not None and getattr(request.task, "runs_inference", False):
        verdict = _shared
    elif (needed := declared_vram_gib(request.request_dict)) is not None:
        limit = min(MAX_VRAM_GIB, class_vram_gib(request) or MAX_VRAM_GIB)
        if needed > limit:
            # No worker may start it (a producer that skipped the check at submission):
            # released, it would come back for ever. It runs under its class's cap.
            logger.warning("task %s[%s] declares vram_gib=%g, over what its class admits "
                           "(%g GiB): started under the class's cap", request.name,
                           request.id, needed, limit)
            return False
        try:
            verdict = admit(needed, _free_now(request, needed))
            if verdict is not None and not fits(needed, total := probe().max_total_bytes(),
                                                HEADROOM_BYTES):
                verdict = NeverFits(needed, total)
        except Exception as exc:  # NVML gone away: run it; its class cap still holds
            # (once a spell: a driver that refuses the call refuses it at each task)
            _unreadable.failed(
                "task %s[%s]: could not read free device memory (%s); started without "
                "the vram_gib check", request.name, request.id, exc)
            return False
        _unreadable.over()
    if verdict is None:
        return False
    if isinstance(verdict, NeverFits) and _fits_no_worker(request, verdict):
        return True
    release(request, verdict)
    return True


#: The GPUs this worker's live pool children are pinned to (its advertiser says, at each
#: refresh); empty: every GPU admission was armed with.
_admit_on: frozenset[str] = frozenset()


def admit_on(uuids: frozenset[str]) -> None:
    """Admit by these GPUs alone (an autoscaled pool's live children's), from now on."""
    global _admit_on
    _admit_on = uuids


def _free_now(request: Request, needed: float) -> int:
    """The roomiest device's free memory for a task declaring ``needed`` GiB, of those its
    live children are pinned to (:func:`admit_on`); on a worker of several GPUs, the
    devices that can hold it are noted for the pool (``steer.py``: it hands the task to
    a child pinned to one of them, not to whichever is idle)."""
    by_device = getattr(probe(), "free_by_device", None)
    if by_device is None:
        return probe().max_free_bytes(_cached_now())
    free: dict[str, int] = by_device(_cached_now())
    devices = set(getattr(probe(), "uuids", free))
    if live := {u: f for u, f in free.items() if u in _admit_on}:
        free = live
        devices &= _admit_on
    if not free:  # (the live children's devices all unreadable: none admits)
        return 0
    roomy = frozenset(u for u, f in free.items() if fits(needed, f, HEADROOM_BYTES))
    # (where every device holds it, any child may; a device that could not be read is
    # not one that holds it)
    if roomy and len(roomy) < len(devices | free.keys()):
        steer.want(request.id, roomy)
    return max(free.values())


def _want_child(request: Request) -> None:
    """Note the engine and prompt prefix an inference task runs, and the arithmetic
    intensity and precision any task declares, for the pool's choice of child
    (``steer.py``: the one that holds them warm, or whose device suits the intensity and
    precision). Nothing here may raise."""
    if not steer.steering():
        return
    try:
        from sits_queue.workers.taskheader import (
            task_intensity,
            task_model,
            task_precision,
            task_prefix_key,
        )

        headers = request.request_dict
        task = request.task
        intensity = task_intensity(headers)
        precision = task_precision(headers, getattr(task, "precision", None))
        if getattr(task, "runs_inference", False):
            steer.want_warm(request.id, task_model(headers, getattr(task, "model", None)),
                            task_prefix_key(headers), precision,
                            spread=request.name == PREWARM_TASK, intensity=intensity)
        elif intensity is not None or precision is not None:
            steer.want_bound(request.id, intensity, precision)
    except Exception as exc:  # (no model named: the child fails it, saying so)
        logger.debug("task %s[%s]: no engine to steer by (%s)", request.name, request.id, exc)


def _fits_no_worker(request: Request, verdict: NeverFits) -> bool:
    """Dead-letter a task no live worker's device could ever hold (True: done); False
    when some worker's could, or the fleet could not be read (it is released then)."""
    from sits_queue.app import sits_config
    from sits_queue.workers import advertise

    try:  # (nothing here may raise in the main process: the pool slot would be lost)
        config = sits_config(request.task.app)
        largest = advertise.largest_device_bytes(advertise.read_workers(
            advertise.client_for(config), config.global_keyprefix))
    except Exception as exc:
        logger.warning("task %s[%s]: the workers' devices could not be read (%s)",
                       request.name, request.id, exc)
        return False
    if largest is None or fits(verdict.needed_gib, largest, HEADROOM_BYTES):
        return False
    fleet = NeverFits(verdict.needed_gib, max(largest, verdict.total_bytes), fleet=True)
    error = NoDeviceLargeEnough(f"task {request.name}[{request.id}] {fleet.reason()}: no "
                                "worker can start it; `sitsq dead requeue` puts it back "
                                "once a worker with a larger device serves its queue")
    return _dead_letter(request, error)  # (the broker logs it, with the reason)


def _guard(execute: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(execute)
    def execute_using_pool(self: Request, pool: Any, **kwargs: Any) -> Any:
        if refused(self):
            raise NotStartedHere(self.id)
        _want_child(self)
        try:
            # Celery's own execute_using_pool checks for a revoke before the pool takes
            # the request, done here first: Celery took a pool slot for the request
            # before this and gives it back on a revoke only, so an error in that check
            # (malformed stamps) held the slot for good (a worker of one child served
            # nothing more). A revoke found here is announced once: Celery's own check
            # then answers from its flag.
            self.revoked()
        except Exception as exc:
            if not dead_letter_unstartable(self, exc):
                raise
            raise NotStartedHere(self.id) from exc
        return execute(self, pool, **kwargs)

    execute_using_pool.__sits_guarded__ = True  # type: ignore[attr-defined]
    return execute_using_pool


def time_limits(request: Any) -> tuple[float | None, float | None]:
    """The (hard, soft) time limits ``request`` runs under, s: its message's, else its
    task's (None: none)."""
    hard, soft = request.time_limits
    return hard or request.task.time_limit, soft or request.task.soft_time_limit


def failure_of(exc_info: Any) -> BaseException | None:
    """The exception a failed run's ``exc_info`` holds, unwrapped from billiard's
    ``ExceptionWithTraceback`` as ``Request.on_failure`` unwraps it."""
    exc = getattr(exc_info, "exception", None)
    return exc.exc if isinstance(exc, ExceptionWithTraceback) else exc


class SitsRequest(Request):  # type: ignore[misc]
    """``Task.Request`` for SITS tasks: checks declared VRAM before the pool runs a task,
    and gives back the message of a task that yielded its time slice."""

    execute_using_pool = _guard(Request.execute_using_pool)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> Any:
        exc = failure_of(exc_info)
        if isinstance(exc, NotOnThisDevice):
            _released(self, exc.reason, CHILD_HOLDS)
            return None
        if isinstance(exc, Reject) and exc.requeue:
            # Not a failure, not a redelivery: the task yielded its slot (Preempted: it
            # runs again from its checkpoint) or asked to run again (Reject(requeue=True),
            # which stock Celery requeues as often as asked; counted, it would dead-letter
            # the task as poison after max_redeliveries). It goes back to the place in
            # the queue it had (release.lua restores its score).
            _give_back(self)
            logger.info("task %s[%s] %s: %s", self.name, self.id,
                        "yielded its slot" if isinstance(exc, Preempted)
                        else "rejected itself and is requeued", exc.reason)
            return None
        if isinstance(exc, Reject) and self.message is not None:
            # Rejected for good by the task (or a retry() its options refused): the dead
            # letter says why, as the result does (it read "rejected by consumer")
            note_reject(self.message, task_reject_reason(exc), fail=False)
        if isinstance(exc, MemoryError):
            # The task's failure (its result, stored by the child, says MemoryError), not
            # the worker's: Celery re-raises it here, in the main process, and stops
            exc_info = copy.copy(exc_info)
            failed = TaskOutOfMemory(f"task {self.name}[{self.id}] ran out of memory: "
                                     f"MemoryError: {exc}")
            exc_info.type = TaskOutOfMemory
            logger.error("%s: %s; it failed alone, the worker serves on",
                         TaskOutOfMemory.__name__, failed)
            # (as is: wrapped in billiard's ExceptionWithTraceback, never pickled here,
            # the task-failed event, Flower's page, read "ExceptionWithTraceback()")
            exc_info.exception = failed
        return super().on_failure(exc_info, send_failed_event, return_ok)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("execute_using_pool")
        if own is not None and not getattr(own, "__sits_guarded__", False):
            cls.execute_using_pool = _guard(own)
