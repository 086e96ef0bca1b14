"""A pool child's record, lost with Redis's data, written back by the main process.

Each child writes its own record (``advertise.publish``: warm engines, KV prefixes,
room, memory) when it changes, and the main process re-arms its TTL every
:data:`~sits_queue.workers.advertise.REFRESH_S`. A Redis that lost its data (restarted
without persistence, flushed) lost those records too, and an idle child writes nothing
until its next task: its warm engines were out of affinity's, the pre-warm planner's,
``sitsq status``'s and the metrics' sight until then, though it held them all along.

The main process keeps the last record it read of each live child and writes it back
where it is missing (``SET NX``: a child that wrote its own meanwhile wins), only while
the child that wrote it is the one alive in that slot (a child replaced after a hard
time limit kill holds nothing of its predecessor's).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import redis

from sits_queue.workers import advertise

logger = logging.getLogger(__name__)


def live_pids(pool: Any, slots: list[int]) -> dict[int, int]:
    """Slot -> pid of each live child of ``pool`` (:func:`advertise.pool_children`); a
    pool with no processes of its own (solo, threads) runs its tasks in this process."""
    found = {slot: pid for slot, pid in advertise.pool_children(pool).items()
             if isinstance(pid, int) and pid}
    return found or dict.fromkeys(slots, os.getpid())


class ChildRecords:
    """The main process's copy of its children's records (:meth:`keep`, every refresh)."""

    def __init__(self) -> None:
        self._last: dict[int, bytes | str] = {}

    def keep(self, client: redis.Redis, prefix: str, hostname: str,
             live: Mapping[int, int]) -> list[int]:
        """Read each live child's record, remember it, and write back a missing one this
        process remembers of the same child; the slots written back."""
        slots = sorted(live)
        values = client.mget([advertise.child_key(prefix, hostname, s) for s in slots]) \
            if slots else []
        restored = []
        for slot, value in zip(slots, values, strict=True):
            if value is not None:
                self._last[slot] = value
                continue
            last = self._last.get(slot)
            if last is not None and _pid_of(last) == live[slot] and client.set(
                    advertise.child_key(prefix, hostname, slot), last, ex=advertise.TTL_S,
                    nx=True):
                restored.append(slot)
        for slot in set(self._last) - set(live):  # (a slot the pool no longer has)
            del self._last[slot]
        if restored:
            # (gone either way: expired while Redis stalled past their TTL, or lost with
            # a restart's data; a probe read "lost with Redis's data" after a mere stall)
            logger.warning("wrote back the records of children %s, gone from Redis (expired "
                           "during an outage, or lost with its data)", restored)
        return restored


def _pid_of(raw: bytes | str) -> int | None:
    try:
        record = json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        return None
    pid = record.get("pid") if isinstance(record, dict) else None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None
