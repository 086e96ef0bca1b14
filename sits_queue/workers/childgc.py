"""A worker process collects its garbage after tasks that did not succeed, at most every
:data:`MIN_INTERVAL_S`.

A failed, retried or rejected task leaves a cycle behind: Celery's ``ExceptionInfo``,
its traceback, and billiard's copy of every frame's code, each holding a list of the
code's positions (thousands of tuples, which Python's collector does not count towards
its next full collection). Those cycles wait for a full collection, which came rarely:
in a 22-minute soak with a few failing tasks a second, each pool child grew 6-8 MB a
minute (65 -> 149 MB) with 1.9M blocks that one ``gc.collect()`` brought down to 0.4M.
A collection here, between tasks and rate-limited, keeps that garbage to what a few
seconds of failures leave. (Not re-measured in that soak: 6,000 plain failing tasks on
one slot kept the child at 72.5 MB with and without it.)
"""

from __future__ import annotations

import gc
import time
from typing import Any

from celery import signals, states

#: Fewest seconds between two collections of one process.
MIN_INTERVAL_S = 10.0

_last = [-MIN_INTERVAL_S]


def due(state: Any, now: float, last: float) -> bool:
    """Whether a task that ended in ``state`` should be followed by a collection."""
    return state != states.SUCCESS and state is not None and now - last >= MIN_INTERVAL_S


def _after_task(state: Any = None, **_: Any) -> None:
    now = time.monotonic()
    if due(state, now, _last[0]):
        _last[0] = now
        gc.collect()


def connect() -> None:
    """Collect after the tasks of this process that do not succeed (idempotent)."""
    signals.task_postrun.connect(_after_task, weak=False, dispatch_uid="sits-child-gc")
