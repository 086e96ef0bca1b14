"""A request the worker holds before it runs it: a resumed run (time slices) and a task
picked before its ETA was due (``etaorder.py``, ``ratelimits.py``)."""

from __future__ import annotations

from typing import Any

from celery.utils.time import timezone
from kombu.asynchronous.timer import to_timestamp

from sits_queue.broker.keys import CHECKPOINT_HEADER
from sits_queue.workers import request as admission


def resumed(request: Any) -> bool:
    """Whether ``request`` resumes a task that yielded its slot (time slices): the same
    run going on, its token taken when it started. As a new run it waited for another
    (an hour at ``'1/h'``), and each yield used up one of the type's rate."""
    return (getattr(request, "request_dict", None) or {}).get(CHECKPOINT_HEADER) is not None


def due_at(request: Any, app_timezone: Any) -> float | None:
    """When ``request``'s ETA falls due, as Celery's strategy reads it for the worker's
    timer (``time.monotonic()``; None: no ETA, or one it could not read)."""
    eta = getattr(request, "eta", None)
    if not eta:
        return None
    try:
        if getattr(request, "utc", True):
            return float(to_timestamp(timezone.to_system(eta)))  # type: ignore[no-untyped-call]
        return float(to_timestamp(eta, app_timezone))  # type: ignore[no-untyped-call]
    except (OverflowError, ValueError, TypeError, AttributeError):
        return None


def picked_early(request: Any, app_timezone: Any) -> bool:
    """Whether ``request``'s message was picked before its ETA was due (so it waited in
    this worker's timer, not in the queue)."""
    picked = getattr(getattr(request, "message", None), "picked_at", None)
    due = due_at(request, app_timezone)
    return isinstance(picked, float) and due is not None and picked < due


def consumed(request: Any) -> bool:
    """Whether this worker still consumes the queue ``request`` came from. A task held
    for its ETA in a queue it stopped consuming (remote control's ``cancel_consumer``)
    runs here once due, as Celery runs the tasks a worker reserved: given back to take
    its turn, it waited in a queue that perhaps no worker consumed."""
    message = getattr(request, "message", None)
    queue = (getattr(message, "delivery_info", None) or {}).get("sits_queue")
    active = getattr(getattr(message, "channel", None), "active_queues", None)
    return queue is None or active is None or queue in active


def give_back_due(c: Any, request: Any, hold_s: float | None = None) -> bool:
    """A request held for its ETA, now due, goes back to its queue (uncounted; held off
    from this worker for ``hold_s``, if given) rather than to the pool: out of the
    prefetch count its wait for the ETA was counted out of, and, where it was revoked or
    expired meanwhile, settled here as the pool's run would have (the next worker may
    not know). False for one settled so."""
    c.qos.decrement_eventually()
    if request.revoked():
        return False
    admission._give_back(request, None if hold_s is None else (hold_s, hold_s))
    return True
