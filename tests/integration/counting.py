"""Reading a worker's counts, which its children write within a moment of a task's end.

A pool child writes the counts of a run that changed nothing other processes route work
by (its warm engines, KV prefixes, room) from its deferred writer, within
``deferred.DEFER_S`` of the run's end rather than before its result
(``sits_queue/workers/deferred.py``): a test that reads them right after a result waits
for what it expects.
"""

from __future__ import annotations

from collections.abc import Callable

import redis

from sits_queue.workers import advertise, deferred
from tests.waiting import wait_for

#: Longest a test waits for counts: the writer's delay, and a loaded host's slack.
COUNTS_WAIT_S = 20 * deferred.DEFER_S


def counters_once(r: redis.Redis, hostname: str, ready: Callable[[dict[str, float]], bool],
                  what: str, prefix: str = "") -> dict[str, float]:
    """``hostname``'s counters as soon as ``ready`` holds of them; fails naming ``what``
    (with the counters last read) after :data:`COUNTS_WAIT_S`."""
    seen: dict[str, float] = {}

    def read() -> bool:
        seen.clear()
        seen.update({k.decode(): float(v) for k, v in
                     r.hgetall(advertise.counters_key(prefix, hostname)).items()})
        return ready(seen)

    try:
        wait_for(read, COUNTS_WAIT_S, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the counters: {seen}") from None
    return seen
