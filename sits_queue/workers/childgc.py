"""The garbage collector in a worker's processes: what was imported is frozen, so that a
full collection, in a pool child between two tasks, scans only what the tasks made.

A failed, retried or rejected task leaves a cycle behind: Celery's ``ExceptionInfo``,
its traceback, and billiard's copy of every frame's code, each holding a list of the
code's positions (thousands of tuples, which Python's collector does not count towards
its next full collection). Those cycles wait for a full collection, which came rarely:
in a 22-minute soak with a few failing tasks a second, each pool child grew 6-8 MB a
minute (65 -> 149 MB) with 1.9M blocks that one ``gc.collect()`` brought down to 0.4M.
A collection after such a task, at most every :data:`MIN_INTERVAL_S`, keeps that garbage
to what a few seconds of failures leave. (Not re-measured in that soak: 6,000 plain
failing tasks on one slot kept the child at 72.5 MB with and without it.)

A full collection walks every object the collector tracks, and a pool child holds those
of every module it imported: ~93k objects in a child of a bench worker took 35-90 ms a
collection, and torch alone adds ~147k (86 ms here). It ran after the task's postrun,
before the child reports the task done, so the slot stayed busy that long; a time slice
yields (a ``Reject``) often enough for each child to pay it every 10 s. So, as Python's
``gc`` docs advise for a process that forks without exec: the worker's main process
freezes what it holds right before its first child is forked (:func:`gc.freeze`: moved
to a generation no collection scans; nothing is touched, so the pages stay shared with
the children), each child freezes again once its start-up is done, and again after its
first ``import torch`` (:func:`settle`, called by ``workers/gpu.py``, which imports it
before any engine exists). What is frozen is never collected as a cycle, only freed by
reference counting: so a freeze comes only where what is alive is the process's
start-up (modules, the app, the pool), never after an engine or a task's data exists.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from celery import signals, states

#: Fewest seconds between two collections of one process.
MIN_INTERVAL_S = 10.0

_last = [-MIN_INTERVAL_S]
#: The pid whose start-up froze (a pool child's, or a main process's before its first
#: fork): :func:`settle` freezes only there, never in a process that is no worker's.
_frozen_in = [0]


def due(state: Any, now: float, last: float) -> bool:
    """Whether a task that ended in ``state`` should be followed by a collection."""
    return state != states.SUCCESS and state is not None and now - last >= MIN_INTERVAL_S


def _after_task(state: Any = None, **_: Any) -> None:
    now = time.monotonic()
    if due(state, now, _last[0]):
        _last[0] = now
        gc.collect()


def freeze() -> None:
    """Collect, then freeze what survives (this process's start-up), and mark this
    process as one whose later imports :func:`settle` may freeze."""
    gc.collect()
    gc.freeze()
    _frozen_in[0] = os.getpid()


def settle() -> None:
    """After a large import in a worker process that froze its start-up (a pool child's
    first ``import torch``): freeze again, so later collections skip the module's
    objects. A no-op in any other process: there it would make a user's objects
    uncollectable."""
    if _frozen_in[0] == os.getpid():
        freeze()


def _before_first_fork(**_: Any) -> None:
    if not _frozen_in[0]:  # (later forks: a replacement child inherits this freeze)
        freeze()


def _child_started(**_: Any) -> None:
    freeze()


def connect() -> None:
    """Collect after the tasks of this process that do not succeed; freeze the start-up
    of the main process and of each pool child (idempotent). The child's receiver is
    connected after the runtime's ``worker_process_init`` one, so it runs after it."""
    signals.task_postrun.connect(_after_task, weak=False, dispatch_uid="sits-child-gc")
    signals.worker_before_create_process.connect(_before_first_fork, weak=False,
                                                 dispatch_uid="sits-gc-freeze-main")
    signals.worker_process_init.connect(_child_started, weak=False,
                                        dispatch_uid="sits-gc-freeze-child")
