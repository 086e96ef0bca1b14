"""The worker's main process end of a batch's time budget (``batchtime.py``): what each
batch key's runs took, and the cut of a gathered batch before it goes to the pool."""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from sits_queue.exits import worker_exit
from sits_queue.options import HEADER
from sits_queue.workers import batchtime
from sits_queue.workers import request as admission

logger = logging.getLogger(__name__)

#: Each batch key's recent runs (this worker's main process), the least recently used
#: key dropped past :data:`MOST_KEYS` (a key includes its limits: callers that vary them
#: per call would add one a call).
_times: OrderedDict[str, batchtime.Times] = OrderedDict()
MOST_KEYS = 1024
#: Task types whose ``work=`` function failed here (said once each).
_failing: set[str] = set()


def key_of(request: Any) -> str | None:
    """The batch key of ``request``'s message (task, model, class, precision, limits)."""
    header = (getattr(request, "request_dict", None) or {}).get(HEADER)
    key = header.get("batch") if isinstance(header, dict) else None
    return key if isinstance(key, str) else None


def work_of(request: Any) -> float:
    """``request``'s units of work: what its task's ``batch_work`` says of its arguments,
    else 1. Never raises: a malformed call (it fails on its own in the batch) counts 1,
    and so does a call the function fails on, ``sys.exit()`` and ``KeyboardInterrupt``
    included. (The user's function runs in the worker's main process: its SystemExit
    ended the worker after the batch ran, its message was given back unacked, and the
    next worker to run it ended alike, the task never dead-lettered.)"""
    measure: Callable[..., Any] | None = getattr(request.task, "batch_work", None)
    if measure is None:
        return 1.0
    try:
        work = float(measure(*(request.args or ()), **(request.kwargs or {})))
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # (see above)
        if worker_exit(exc):
            raise  # (Celery's own, from a signal handler that ran meanwhile: it stops)
        _said_failing(request.name, exc)
        return 1.0
    return work if math.isfinite(work) and work > 0 else 1.0


def _said_failing(task: str, exc: BaseException) -> None:
    """Once per task type a worker: its ``work=`` function failed on a call's
    arguments (the call counted as 1 unit)."""
    if task in _failing:
        return
    _failing.add(task)
    logger.warning("task %s: its work= function failed on a call's arguments (%s: %s); "
                   "such a call counts as 1 unit of work in its batch's time budget "
                   "(said once)", task, type(exc).__name__, exc)


def limit_of(request: Any) -> float | None:
    """The time limit a batch led by ``request`` runs under, s: its soft one, else its
    hard one (None: none)."""
    hard, soft = admission.time_limits(request)
    limit = soft or hard
    return float(limit) if limit else None


def share_of(request: Any) -> float:
    config = getattr(request.task.app, "sits", None)
    return float(getattr(config, "batch_time_share", 0.0) or 0.0)


def cut(members: list[Any]) -> list[Any]:
    """The members of a gathered batch to run now; the others go back to their queue
    uncounted (``batchtime.fitting``)."""
    if len(members) < 2 or (key := key_of(members[0])) is None:
        return members
    if any(getattr(m, "time_start", None) for m in members):
        # joins the batch they were pushed to did not take, run apart: already started
        # (events sent, acked early for a task without acks_late), they must run here
        return members
    limit, share = limit_of(members[0]), share_of(members[0])
    keep = batchtime.fitting(_times.get(key), [work_of(m) for m in members], limit, share)
    if keep >= len(members):
        return members
    for request in members[keep:]:
        admission._give_back(request)
    _, soft = admission.time_limits(members[0])
    # (%g: a 0.05 s limit read "0.1 s" at one decimal)
    logger.info("batch of %d %s tasks cut to %d: the rest would not finish within %.0f%% "
                "of its %g s %s time limit at the %.3f s per unit its last runs took; they "
                "went back to their queue", len(members), members[0].name, keep,
                100 * share, limit or 0.0, "soft" if soft else "hard",
                _times[key].per_unit_s() or 0.0)
    return members[:keep]


def ran(requests: list[Any], seconds: float | None) -> None:
    """A batch of ``requests`` ran (its cold start excluded: ``seconds``)."""
    _record(requests, seconds, cut_short=False)


def stopped(requests: list[Any], seconds: float | None = None) -> None:
    """A batch of ``requests`` was stopped at its time limit (after ``seconds``, else
    the limit it ran under)."""
    if seconds is None and requests:
        seconds = limit_of(requests[0])
    _record(requests, seconds, cut_short=True)


def _record(requests: list[Any], seconds: float | None, cut_short: bool) -> None:
    key = key_of(requests[0]) if requests else None
    if key is None or seconds is None:
        return
    run = batchtime.Run(sum(work_of(r) for r in requests), float(seconds), cut_short)
    _times[key] = _times.pop(key, batchtime.Times()).record(run)
    while len(_times) > MOST_KEYS:
        _times.popitem(last=False)
