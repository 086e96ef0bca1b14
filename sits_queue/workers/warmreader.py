"""What a worker's children hold, read for its picks: the transport's warm source
(``broker/affinity.py``), with the worker's fleet weights (``workers/fleet.py``).

Read from the child records the children publish and the fleet's advertisements
(``workers/advertise.py``), never from the children themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from sits_queue.broker import affinity
from sits_queue.config import SitsConfig
from sits_queue.workers import fleet, routingversions, steer
from sits_queue.workers.advertise import (
    child_key,
    client_for,
    fleet_members,
    json_object,
    live_hostnames,
    worker_key,
)

logger = logging.getLogger(__name__)


class WarmReader:
    """Worker main process: what its children hold (engines by tier, KV of prompt
    prefixes) as affinity weights, for the transport's picks (``broker/affinity.py``).

    One ``MGET`` of the child records, reused for :data:`WARM_MAX_AGE_S` and read again
    after an ack when a child has written a change of what it holds (before its task
    returned: counted in ``routingversions``). A Redis error means no affinity for that
    pick, never a failed pick.
    """

    #: Longest a warm set is reused without an ack, s (another worker's hold runs out,
    #: a child was replaced): picks stay cheap, a stale set costs only a cold start.
    WARM_MAX_AGE_S = 0.5

    def __init__(self, config: SitsConfig, hostname: str, slots: Iterable[int],
                 clock: Any = time.monotonic) -> None:
        """``slots``: the children's slots (:func:`pool_slots`)."""
        self._policy = config.affinity
        self._config = config
        self._hostname = hostname
        self._fleet = fleet.FleetWeights(
            self._policy, self._read_fleet,
            lambda: fleet_members(client_for(config), config.global_keyprefix), clock)
        self._slots: tuple[int, ...] = ()
        self._keys: list[str] = []
        self.resize(slots)
        self._clock = clock
        self._warm = affinity.Warm()
        self._read_at: float | None = None
        #: The children's routing-change counts as that reading began.
        self._counts_read: tuple[int, ...] | None = None
        #: The last reading's child records by slot, and the idle children's views of it.
        self._by_slot: dict[int, Mapping[str, Any]] = {}
        self._idle_warm: dict[frozenset[int], affinity.Warm] = {}
        #: The fleet weights those views were made with.
        self._idle_standing: fleet.Standing | None = None

    @property
    def slots(self) -> tuple[int, ...]:
        return self._slots

    @property
    def standing(self) -> fleet.Standing:
        """The fleet weights its picks use now, as last read (reads nothing)."""
        return self._fleet.current

    def resize(self, slots: Iterable[int]) -> None:
        """Read the children in ``slots`` from now on (:func:`pool_slots`: a pool grown
        or shrunk by remote control)."""
        self._slots = tuple(slots)
        self._keys = [child_key(self._config.global_keyprefix, self._hostname, s)
                      for s in self._slots]
        self._read_at = None

    def invalidate(self) -> None:
        # Where the pool counts its children's routing changes (a worker's main process:
        # workers/routingversions.py), only when one moved since the last reading: the
        # warm run of a task changes none. Elsewhere, only once some child holds
        # something: a worker of plain tasks must not pay a read per ack.
        counts = routingversions.reading()
        if counts is not None:
            if counts != self._counts_read:
                self._read_at = None
        elif self._warm.models or self._warm.prefixes:
            self._read_at = None

    def __call__(self) -> affinity.Warm:
        now = self._clock()
        if self._read_at is not None and now - self._read_at < self.WARM_MAX_AGE_S:
            return self._idle_view(self._fleet())
        self._read_at = now
        self._counts_read = routingversions.reading()  # (before the read: never a miss)
        try:
            raw = client_for(self._config).mget(self._keys)
        except redis.RedisError as exc:
            logger.debug("warm set unreadable, picking without affinity: %s", exc)
            self._warm, self._by_slot = affinity.Warm(), {}
            return self._warm
        children = [c for c in (json_object(v) for v in raw) if c is not None]
        standing = self._fleet()
        self._warm = affinity.warm_of(children, self._policy, standing.precisions,
                                      standing.roofline)
        self._idle_warm = {}
        if not steer.steering():  # (nothing reads each child's own where none is chosen)
            self._by_slot = {}
            return self._warm
        # (each child's own, for the pool's choice of child: workers/steer.py)
        self._by_slot = {c["slot"]: c for c in children
                         if isinstance(c.get("slot"), int) and c["slot"] in self._slots}
        steer.note_children({slot: affinity.warm_of([c], self._policy)
                             for slot, c in self._by_slot.items()},
                            {slot: room for slot, c in self._by_slot.items()
                             if isinstance(room := c.get("device_room"), int)
                             and not isinstance(room, bool)})
        return self._idle_view(standing)

    def _idle_view(self, standing: fleet.Standing) -> affinity.Warm:
        """What the idle children hold, where the pool is steered: the freed slot's pick
        is for them (under a backlog, one), and a task warm only in a busy child, picked
        by the union of all, went cold to the idle one. The same object while neither
        the reading nor the idle set changes (the transport re-reads it by identity).

        On a host of unlike GPUs, idle children all on one device pick by that device's
        roofline and precision weights (``Standing.devices``, ``device_precisions``):
        the L4's child of a host with an H200 pulls the compute-bound work, the H200's
        the memory-bound, an A100's the bf16 tasks beside a T4 (by the worker's best
        device, each freed child pulled alike)."""
        idle = steer.idle_slots()
        if not idle or not self._by_slot:
            return self._warm
        key = idle.intersection(self._by_slot)
        if not key:
            return self._warm
        if standing is not self._idle_standing:
            self._idle_warm, self._idle_standing = {}, standing
        if (view := self._idle_warm.get(key)) is None:
            roofline, precisions = standing.roofline, standing.precisions
            if len(uuids := {steer.device_of(s) for s in key}) == 1:
                device = uuids.pop() or ""
                roofline = standing.devices.get(device, roofline)
                precisions = standing.device_precisions.get(device, precisions)
            view = self._idle_warm[key] = affinity.warm_of(
                [self._by_slot[s] for s in sorted(key)], self._policy, precisions, roofline)
        return view

    def _read_fleet(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """This worker's own record and every live worker's (their own records only, no
        child records), for :class:`fleet.FleetWeights`. A device without datasheet
        figures (a CPU) is matched to nothing: no fleet to read."""
        client, prefix = client_for(self._config), self._config.global_keyprefix
        own = json_object(client.get(worker_key(prefix, self._hostname)))
        names = live_hostnames(client, prefix) \
            if own is not None and fleet.device_peaks(own) else []
        records = [r for raw in (client.mget([worker_key(prefix, n) for n in names])
                                 if names else [])
                   if (r := json_object(raw)) is not None]
        return own, records
