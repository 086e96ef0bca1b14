"""A pool child's advert writes, coalesced when nothing that routes work has changed.

A child published its record (warm engines, KV prefixes, room, counts, memory) twice
per inference task, each a MULTI/EXEC round trip with the record rebuilt: once its
engine was acquired (so a child killed at its hard limit has its task counted) and
once the run ended. For short tasks run one at a time that was the largest cost beside
the model: a profile of a one-at-a-time embedding burst (py-spy on the pool child,
2026-12-06) put 14% of the child's samples in those writes, ~2 ms of a 14 ms task.

What other processes act on at once is what routes work: the warm set, what it serves,
the ``prefix_key`` s whose KV it holds, the device tier's room (affinity picks, the
pool's steering, the pre-warm planner). Those are still written before the task
returns whenever they change. A task that changed none of them (a warm run) only adds
counts, which :class:`Deferred` writes from a thread within :data:`DEFER_S`, together
with whatever else counted meanwhile; ``sitsq status`` and the metrics read them that
much later. A child killed within :data:`DEFER_S` of its last count loses those counts
(a hard time limit is seconds at least; the process-exit flush covers a clean stop).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

#: Longest a child's new counts wait when its record's routing part has not changed, s.
DEFER_S = 0.5
#: The fields of a child's record that other processes route work by: a change is
#: written before the task returns; the rest (counts, memory, the cores of the last
#: task's class, ``kv_prefixes``: how many prompt prefixes it holds per model, which
#: grows with each new prompt until the store is full and which nothing routes by;
#: ``kv_keys`` is what affinity reads) can wait.
ROUTING_FIELDS = ("device", "warm", "warm_bytes", "device_room", "serves", "kv_keys")


def routing(record: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a child's record that :data:`ROUTING_FIELDS` names."""
    return {name: record[name] for name in ROUTING_FIELDS}


class Deferred:
    """Runs ``write`` from a daemon thread ``defer_s`` after :meth:`arm`, once for every
    arming meanwhile; :meth:`flush` runs it at once when armed. The thread starts at the
    first arming, in the process that arms (a pool child, after its fork). A child's
    advert (:data:`DEFER_S`) and the finished tasks' statistics (``signals.py``) are
    written so; ``name`` names the thread, ``what`` what a failed write's log line says
    could not be done.

    A process forked from the arming one starts with nothing pending and no thread
    (:func:`_after_fork_in_child`).

    Lock order: a write (the thread's, a flush's) holds ``_writing`` and then whatever
    ``write`` takes; :meth:`arm` and :meth:`disarm` never take ``_writing``, so
    ``write``'s own callers may call them under the lock ``write`` takes.
    """

    def __init__(self, write: Callable[[], None], defer_s: float = DEFER_S,
                 *, name: str = "deferred", what: str = "write what was deferred") -> None:
        self._write = write
        self._defer_s = defer_s
        self._name, self._what = f"sits-{name}", what
        self._armed = threading.Event()
        self._writing = threading.Lock()
        self._starting = threading.Lock()
        self._thread: threading.Thread | None = None
        _live.add(self)

    @property
    def armed(self) -> bool:
        return self._armed.is_set()

    def arm(self) -> None:
        self._armed.set()
        with self._starting:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name,
                                                daemon=True)
                self._thread.start()

    def disarm(self) -> None:
        """What was pending has just been written another way (a write at once)."""
        self._armed.clear()

    def flush(self) -> None:
        """Write now what is pending (a clean exit)."""
        with self._writing:
            if self._armed.is_set():
                self._armed.clear()
                self._write()

    def drop(self) -> None:
        """Forget what is pending, once any write in progress has ended."""
        with self._writing:
            self._armed.clear()

    def _forked(self) -> None:
        self._armed = threading.Event()
        self._writing = threading.Lock()
        self._starting = threading.Lock()
        self._thread = None

    def _loop(self) -> None:
        while True:
            self._armed.wait()
            time.sleep(self._defer_s)
            try:
                self.flush()  # (nothing when written at once meanwhile)
            except Exception:  # the thread must outlive anything one write meets
                logger.exception("could not %s", self._what)


#: Every writer of this process, for the exit's flush (and a test's drop).
_live: weakref.WeakSet[Deferred] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A process forked from one with writers (a task that forks): what was pending is
    its parent's, which writes it; a writer armed in the child starts a thread of its
    own (the parent's is not there), and its locks are new (copied as another thread
    held them, they were held for ever)."""
    for writer in list(_live):
        writer._forked()


def flush_all() -> None:
    """Write what every writer of this process holds: at a solo worker's exit (a pool
    child's is ``worker_process_shutdown``'s, as billiard ends it without ``atexit``)."""
    for writer in list(_live):
        writer.flush()


def drop_all() -> None:
    """Forget what every writer holds (a unit test's end: its Redis was a stand-in)."""
    for writer in list(_live):
        writer.drop()


atexit.register(flush_all)
os.register_at_fork(after_in_child=_after_fork_in_child)
