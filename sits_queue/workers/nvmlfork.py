"""NVML and ``fork()``: the pool forks only while no NVML call is in flight and NVML is
closed in the worker's parent, as it is when the pool first starts.

The parent asks NVML (never CUDA) about its GPUs: at start (:func:`devices.discover`),
from the advertiser's thread every few seconds, and on the main thread when it admits a
task that declares its VRAM (``freemem.NvmlProbe``, which keeps NVML open). The pool
forks later too: a replacement for a child killed at its hard time limit. A fork copies
libnvidia-ml as the other threads left it (a call in flight holds the library's own
mutexes; an open session holds its connection to the driver), and the child asks NVML
itself, through torch: ``torch.cuda.device_count()`` reads the devices' UUIDs through
NVML when ``CUDA_VISIBLE_DEVICES`` names them by UUID, as our pinning does.

Seen on an H200 host (2026-12-04): a replacement child forked 100 ms after its
predecessor's kill hung in its first task until its hard limit, while children forked at
start, before the advertiser's first refresh, never did. It was forked about when a
refresh was due; the NVML state a fork copies is the one difference found between the two
forks, not a proven cause (this guard was not yet tried there: the session's device time
was spent).

So every use of NVML in the parent is a :func:`session`; an ``os.register_at_fork`` hook
waits (at most :data:`FORK_WAIT_S`) for the session in flight to end, and closes the
sessions kept open (:func:`close_before_fork`) before each fork; each reopens at its next
use. A child starts with a lock of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

#: Longest a fork waits for an NVML call in flight, s. NVML answers in milliseconds
#: (an nvmlInit in a VM in ~0.1 s); past this it is stuck, and the fork goes ahead.
FORK_WAIT_S = 10.0

_lock = threading.RLock()
_held_for_fork = False
#: Closers of sessions kept open, called before each fork (weakly held: a closed-over
#: probe may go away).
_closers: list[weakref.ReferenceType[Any]] = []


@contextlib.contextmanager
def session() -> Iterator[None]:
    """Hold off forks while NVML is used: wrap each init ... calls ... shutdown, and
    each call on a session kept open."""
    with _lock:
        yield


def close_before_fork(closer: Callable[[], None]) -> None:
    """Call ``closer``, a bound method (held weakly: its object may go away), before each
    fork, under the lock: it shuts down the NVML session its object keeps open, to be
    reopened at its next use."""
    if not hasattr(closer, "__self__"):
        raise TypeError(f"close_before_fork takes a bound method, not {closer!r}")
    _closers.append(weakref.WeakMethod(closer))


def _before_fork() -> None:
    global _held_for_fork
    _held_for_fork = _lock.acquire(timeout=FORK_WAIT_S)
    if not _held_for_fork:
        logger.warning("forking while an NVML call has been in flight for %g s: the "
                       "child may hang on NVML", FORK_WAIT_S)
    alive = []
    for ref in _closers:
        closer = ref()
        if closer is None:
            continue
        alive.append(ref)
        with contextlib.suppress(Exception):  # a broken NVML must not stop the fork
            closer()
    _closers[:] = alive


def _after_fork_in_parent() -> None:
    global _held_for_fork
    if _held_for_fork:
        _held_for_fork = False
        _lock.release()


def _after_fork_in_child() -> None:
    # The lock as the forking thread held it is the parent's: the child gets its own.
    global _lock, _held_for_fork
    _lock = threading.RLock()
    _held_for_fork = False


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
