"""How many times each pool child has written a change of what routes work to it, in
memory the worker's main process shares with its children across the fork.

The main process reads its children's records (one ``MGET``) for the transport's
affinity picks, and read them again after every ack, since the child that ran the task
had published what it holds before the task returned. Most tasks change nothing that
routes work (a warm model run again): that read was a Redis round trip on the path of
every pick, between a slot freeing and its next task. Now a child counts each write
that changed its record's routing part (``deferred.ROUTING_FIELDS``), after Redis took
it, and an ack makes the next pick read again only when some child's count moved
(``warmreader.WarmReader``). A count bumped after its write is never seen before the
record is: a reading taken before the ``MGET`` that misses a bump only reads once more.

Each child writes only its own slot's counter (no lost updates without a lock); a
64-bit aligned load or store is whole on the platforms CPython runs workers on.
"""

from __future__ import annotations

import ctypes
import multiprocessing
from typing import Any

#: Counters beyond the planned pool (a slot past it, were billiard ever to number one
#: so, goes uncounted: its changes are then read with age, ``WARM_MAX_AGE_S``).
SPARE_SLOTS = 8

_counts: Any = None


def create(slots: int) -> None:
    """Main process, before the pool forks: counters for ``slots`` children (new ones:
    a worker's start)."""
    global _counts
    _counts = multiprocessing.RawArray(ctypes.c_uint64, max(1, slots) + SPARE_SLOTS)


def bump(slot: int) -> None:
    """A child: it has just written a change of its routing part."""
    counts = _counts
    if counts is not None and 0 <= slot < len(counts):
        counts[slot] += 1


def reading() -> tuple[int, ...] | None:
    """Every child's count now; None where no counters were made (outside a worker)."""
    counts = _counts
    return None if counts is None else tuple(counts)


def forget() -> None:
    """No counters (a test's end)."""
    global _counts
    _counts = None
