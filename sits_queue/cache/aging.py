"""Aging of the host shadow pool (MISSION §4.3: "aged out by time and memory pressure").

A pool child's host tier keeps demoted engines' weights in host memory so a promotion
skips the disk. Left alone it keeps them for good: an engine used once a week ago holds
its bytes as long as the child lives, and a host short of memory (tasks' own buffers,
other processes) would rather have them back than swap. So, every :data:`PERIOD_S`:

* **time**: a host-tier engine not used for ``ttl_s`` (counted from its last use, which may
  have been on the device before its demotion) is released
  (:func:`~sits_queue.cache.policy.plan_expire`);
* **memory pressure**: while the host has less than ``pressure_share`` of its memory
  available, the child lowers its host budget to give back its share of the shortfall,
  coldest engines first (:func:`~sits_queue.cache.policy.plan_shrink_host`), and puts
  the full budget back once the host has ``relief`` times that share available again
  (hysteresis: a host that hovers at the level does not shrink and regrow each period).

The decision is :func:`host_budget`, pure; :class:`HostPoolAger` is the thread that
samples and applies it, beside the child's tasks (the engine cache has its own lock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: How often a child ages its host tier, s (more often for a TTL under two minutes, so
#: an engine outlives its TTL by a quarter of it at most; never more often than once a
#: second).
PERIOD_S = 30.0
MIN_PERIOD_S = 1.0
#: The full budget comes back once available memory is this many times the level.
RELIEF = 1.5


@dataclass(frozen=True)
class HostMemory:
    """One look at the host and the tier: bytes."""

    available: int
    total: int
    host_used: int
    host_budget: int


def period_for(ttl_s: float) -> float:
    return min(PERIOD_S, max(MIN_PERIOD_S, ttl_s / 4)) if ttl_s > 0 else PERIOD_S


def host_budget(m: HostMemory, full_budget: int, pressure_share: float, sharers: int
                ) -> int | None:
    """The host tier's budget for now, or None to leave it as it is.

    Under pressure each of the ``sharers`` children on the host gives back its share of
    the shortfall (all giving the whole of it would empty every host tier for one
    child's worth of pressure)."""
    if pressure_share <= 0 or m.total <= 0:
        return None
    level = pressure_share * m.total
    if m.available < level:
        shortfall = (level - m.available) / max(1, sharers)
        budget = max(0, min(m.host_budget, int(m.host_used - shortfall)))
        return budget if budget < m.host_budget else None
    if m.host_budget < full_budget and m.available >= RELIEF * level:
        return full_budget
    return None


class HostPoolAger:
    """Ages one engine cache's host tier from a daemon thread (see the module)."""

    def __init__(self, cache: Any, ttl_s: float, pressure_share: float, sharers: int,
                 memory: Callable[[], tuple[int, int]], on_change: Callable[[], None],
                 period_s: float = PERIOD_S) -> None:
        self.cache, self.ttl_s, self.pressure_share = cache, ttl_s, pressure_share
        self.sharers, self.memory, self.on_change = sharers, memory, on_change
        self.period_s = period_s
        self.full_budget = int(cache.state.host_budget_bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sits-host-pool-ager",
                                        daemon=True)

    def start(self) -> HostPoolAger:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.tick()
            except Exception:  # aging is housekeeping: it must never end the child
                logger.exception("aging the host pool failed; trying again in %.0f s",
                                 self.period_s)

    def tick(self) -> tuple[str, ...]:
        """One pass; the engines it released."""
        released: tuple[str, ...] = ()
        if self.ttl_s > 0:
            released += tuple(self.cache.expire(self.ttl_s))
        available, total = self.memory()
        state = self.cache.state
        budget = host_budget(HostMemory(available, total, state.host_used,
                                        state.host_budget_bytes),
                             self.full_budget, self.pressure_share, self.sharers)
        if budget is not None:
            released += tuple(self.cache.shrink_host(budget))
            logger.info("host memory %.0f%% available: host pool budget %d -> %d bytes",
                        100.0 * available / max(1, total), state.host_budget_bytes, budget)
        if released:
            logger.info("host pool released %s", ", ".join(released))
        if released or budget is not None:
            self.on_change()
        return released
