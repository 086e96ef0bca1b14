"""Reading a worker's counts, which its children write within a moment of a task's end.

A pool child writes the counts of a run that changed nothing other processes route work
by (its warm engines, KV prefixes, room) from its deferred writer, within
``deferred.DEFER_S`` of the run's end rather than before its result
(``sits_queue/workers/deferred.py``): a test that reads them right after a result waits
for what it expects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import redis

from sits_queue.workers import advertise, deferred
from tests.waiting import wait_for

T = TypeVar("T")

#: Longest a test waits for counts: the writer's delay, and a loaded host's slack.
COUNTS_WAIT_S = 20 * deferred.DEFER_S


def read_once(read: Callable[[], T], ready: Callable[[T], bool], what: str) -> T:
    """``read()`` as soon as ``ready`` holds of it; fails naming ``what`` (with what was
    last read) after :data:`COUNTS_WAIT_S`."""
    seen: list[T] = []

    def check() -> bool:
        seen[:] = [read()]
        return ready(seen[0])

    wait_for(check, COUNTS_WAIT_S, what, seen=lambda: seen[0] if seen else None)
    return seen[0]


def counters_once(r: redis.Redis, hostname: str, ready: Callable[[dict[str, float]], bool],
                  what: str, prefix: str = "") -> dict[str, float]:
    """``hostname``'s counters as soon as ``ready`` holds of them (:func:`read_once`)."""
    return read_once(lambda: {k.decode(): float(v) for k, v in
                              r.hgetall(advertise.counters_key(prefix, hostname)).items()},
                     ready, what)
