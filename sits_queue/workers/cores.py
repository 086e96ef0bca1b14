"""The CPU cores a process may run on, and pinning threads to some of them.

Linux has ``os.sched_getaffinity``/``os.sched_setaffinity``; macOS (a developer's
laptop) has neither, and a worker that called them died at start with an
AttributeError. There every core counts as usable and nothing is pinned: class
confinement is then torch's thread count alone, which :meth:`ChildRuntime.confine`
still sets, and :data:`UNPINNED_NOTICE` says so once in the worker's log.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence

#: The worker's one line where :func:`can_pin` is False.
UNPINNED_NOTICE = ("CPU confinement is unavailable on this platform (no sched_setaffinity): "
                   "tasks run on every core; each class's cpu_cores only sets torch's "
                   "thread count")


def can_pin() -> bool:
    """Whether this platform can pin a thread to cores (False on macOS)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def usable(pid: int = 0) -> tuple[int, ...]:
    """The sorted cores ``pid`` (0: this process) may run on; every core where the
    platform keeps no affinity."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(pid)))
    return tuple(range(os.cpu_count() or 1))


def pinned_to(cpus: Sequence[int]) -> bool:
    """Whether this thread runs on exactly ``cpus``; True where nothing can be pinned
    (there is nothing to re-apply)."""
    return not can_pin() or os.sched_getaffinity(0) == set(cpus)


def pin(thread_ids: Iterable[int], cpus: Sequence[int]) -> None:
    """Pin each thread to ``cpus`` (a no-op where the platform cannot)."""
    if not can_pin():
        return
    for tid in thread_ids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended
            os.sched_setaffinity(tid, cpus)
