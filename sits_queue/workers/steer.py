"""Which pool child gets a task: one pinned to a device that can hold it, and one that
holds its engine warm.

The main process admits a task, then hands it to the pool, and Celery's prefork pool
writes it to an idle child of its own choosing: the first writable one in its list
(``AsynPool.schedule_writes`` starts its rotation afresh at every call, celery 5.x).

* On a host of GPUs of mixed sizes that child may be pinned to a GPU that cannot hold a
  task declaring ``vram_gib``: it gives the task back (``devicefit.py``), the worker
  takes it again after the hold, and the pool hands it to the same child, for good,
  while the child on the large GPU sits idle (seen with a stand-in NVML of an 80 GB and
  a 40 GB GPU: a 50 GiB task given back once a second for a minute, never run).
* Each child keeps its own warm engines. The worker's pick takes a task by affinity
  when some child holds its model (``broker/affinity.py``), and the pool then wrote it
  to whichever child came first: the model loaded again there, cold, and in time every
  child held every model, each device tier thrashing, while one child per model would
  have served warm.

So the main process says, per task, which devices can hold it now (:func:`want`, at
admission) and which engine and prompt prefix it runs (:func:`want_warm`); it keeps
each child's warm set as its advert says (:func:`note_children`, from the same read the
picks use), and the jobs waiting in the pool's outbound buffer are shared among its
idle children (:func:`share`, pure), written one at a time: each job with a wish to the
idle child on a device that holds it whose warm set weighs most for it
(:func:`choose`), the others to those left. Where no idle child fits, or none holds
anything of the task's, it goes where the pool would put it (and a child on a device too
small still gives the task back). The transport's picks weigh only the idle children no
waiting job will take (:func:`idle_slots`). Only Celery's prefork pool (``AsynPool``) is
steered; any other pool runs as it did.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from celery import bootsteps

from sits_queue.broker import affinity

logger = logging.getLogger(__name__)

#: Task ids whose wishes are remembered, at most: a task admitted that never reaches the
#: pool (revoked meanwhile) leaves its entry until this many newer ones push it out.
MOST_REMEMBERED = 4096


@dataclass(frozen=True)
class Wanted:
    """Where a task would best run: on one of ``devices`` (UUIDs; None: any), on the
    child whose warm set weighs most for its engine and prompt prefix."""

    devices: frozenset[str] | None = None
    model: str | None = None
    prefix: str | None = None
    precision: str | None = None
    #: Its declared ``arithmetic_intensity``, FLOP/byte: on a host of unlike GPUs, to
    #: the child whose device is rich in the resource that bounds it (§3.1).
    intensity: float | None = None
    #: A pre-warm: to a child that does not hold ``model`` on its device (one that does
    #: would load nothing; the planner counts each child as an instance).
    spread: bool = False


#: Task id -> what it wants.
_wanted: OrderedDict[str, Wanted] = OrderedDict()
#: Each child's warm set by slot (its advert's, as the picks read it).
_children: dict[int, affinity.Warm] = {}
#: Each child's device-tier room by slot, bytes (its advert's ``device_room``).
_room: dict[int, int] = {}


@dataclass(frozen=True)
class _Steered:
    """The steered pool, and what is known of each child, by its inqueue's fd."""

    pool: Any
    #: The device (UUID) each slot is pinned to.
    device_of_slot: Callable[[int], str | None]
    #: Each device's roofline against the host's others, by UUID (``fleet.host_rooflines``;
    #: empty on a host of one kind).
    rooflines: Mapping[str, affinity.Roofline] = field(default_factory=dict)
    #: Each device's precision weights against the host's others, by UUID
    #: (``fleet.host_precisions``; empty on a host of one kind).
    precisions: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @property
    def unlike(self) -> bool:
        """Whether its devices differ in what a task's wish can weigh."""
        return bool(self.rooflines or self.precisions)

    def slot(self, fd: int) -> int | None:
        slot = getattr(self.pool._fileno_to_inq.get(fd), "index", None)
        return slot if isinstance(slot, int) else None

    def idle(self, fds: Sequence[int]) -> list[int]:
        busy, writing = self.pool._busy_workers, self.pool._active_writes
        return [fd for fd in fds if fd not in busy and fd not in writing]

    def device(self, fd: int) -> str | None:
        slot = self.slot(fd)
        return self.device_of_slot(slot) if slot is not None else None

    def warm(self, fd: int) -> affinity.Warm | None:
        """The child's warm set, with its device's roofline and precision weights against
        the host's others."""
        slot = self.slot(fd)
        if slot is None:
            return None
        warm = _children.get(slot)
        if not self.unlike:
            return warm
        device = self.device_of_slot(slot) or ""
        roofline = self.rooflines.get(device)
        precisions = self.precisions.get(device)
        if roofline is None and precisions is None:
            return warm
        warm = warm or affinity.Warm()
        if roofline is not None:
            warm = replace(warm, ridges=roofline.ridges, bounds=roofline.bounds)
        return replace(warm, precisions=precisions) if precisions is not None else warm

    def room(self, fd: int) -> int | None:
        slot = self.slot(fd)
        return _room.get(slot) if slot is not None else None

    def share(self, fds: Sequence[int], wants: Sequence[Wanted | None]) -> list[int]:
        return share(fds, wants, self.device, self.warm, self.room)


#: This process's steered pool; None where it is not steered (nothing is noted per task).
_steered: _Steered | None = None


def _note(task_id: str, **fields: Any) -> None:
    _wanted[task_id] = replace(_wanted.get(task_id, Wanted()), **fields)
    _wanted.move_to_end(task_id)
    while len(_wanted) > MOST_REMEMBERED:
        _wanted.popitem(last=False)


def want(task_id: str, uuids: frozenset[str]) -> None:
    """The task ``task_id`` fits only the devices ``uuids`` now (main process, at
    admission): the pool should hand it to a child pinned to one of them."""
    _note(task_id, devices=uuids)


def want_warm(task_id: str, model: str, prefix: str | None, precision: str | None,
              spread: bool = False, intensity: float | None = None) -> None:
    """The task ``task_id`` runs engine ``model`` (at ``precision``) on prompt prefix
    ``prefix``: the pool should hand it to the child that holds them warm (``spread``, a
    pre-warm: to one that does not hold the model), else to one whose device suits its
    ``intensity`` (:func:`want_bound`). Noted only where the pool is steered."""
    if _steered is not None:
        _note(task_id, model=model, prefix=prefix, precision=precision, spread=spread,
              intensity=intensity)


def want_bound(task_id: str, intensity: float | None, precision: str | None) -> None:
    """The task ``task_id`` (one running no engine of ours) declares ``intensity``
    FLOP/byte, or asks for ``precision``: on a host of unlike GPUs the pool should hand it
    to the child whose device is rich in the resource that bounds it, or relatively
    strong at that precision. Noted only where the pool is steered and its devices
    differ (elsewhere every child suits it alike)."""
    if _steered is not None and _steered.unlike:
        _note(task_id, precision=precision, intensity=intensity)


def steering() -> bool:
    """Whether this process's pool is steered."""
    return _steered is not None


def idle_slots() -> frozenset[int] | None:
    """The slots of the steered pool's children that are idle now and that no job waiting
    in its outbound buffer will take (event loop's thread, as the pool's own marks); None
    where the pool is not steered.

    (The transport picks several messages in one turn of the loop while the pool has
    room, each written to a child only on a later turn: weighed by every idle child, a
    burst took two tasks of the model one idle child held for the two idle children,
    and the second loaded it cold in the other child, evicting what that one held, while
    tasks of its model waited.)"""
    steered = _steered
    if steered is None:
        return None
    idle = steered.idle(list(steered.pool._fileno_to_inq))
    waiting = list(itertools.islice(getattr(steered.pool, "outbound_buffer", ()), len(idle)))
    taken = set(steered.share(idle, [wanted(getattr(job, "correlation_id", None))
                                     for job in waiting]))
    return frozenset(slot for fd in idle if fd not in taken
                     and (slot := steered.slot(fd)) is not None)


def device_of(slot: int) -> str | None:
    """The device (UUID) the steered pool's child ``slot`` is pinned to; None where the
    pool is not steered."""
    return _steered.device_of_slot(slot) if _steered is not None else None


def wanted(task_id: str | None) -> Wanted | None:
    return None if task_id is None else _wanted.get(task_id)


def forget(task_id: str) -> None:
    _wanted.pop(task_id, None)


def note_children(by_slot: Mapping[int, affinity.Warm],
                  room: Mapping[int, int] | None = None) -> None:
    """Each child's warm set, and the room left in its device tier (bytes), by slot (the
    main process's read of their adverts)."""
    if _steered is not None:
        _children.clear()
        _children.update(by_slot)
        _room.clear()
        _room.update(room or {})


def expect(slot: int, want: Wanted) -> None:
    """The child ``slot`` was handed a task of ``want``'s engine: it holds it on its
    device from now on. (Its advert says so once the engine is loaded, and the main
    process reads that later still: a pre-warm written meanwhile went to the child that
    had just taken a task of its model, as if it held nothing, and loaded nothing.) The
    next reading of the adverts replaces this."""
    if want.model is None:
        return
    key = affinity.engine_key(want.model, None if want.spread else want.precision)
    warm = _children.get(slot, affinity.Warm())
    if warm.models.get(key, 0.0) < affinity.DEVICE_WEIGHT:
        _children[slot] = replace(warm, models={**warm.models, key: affinity.DEVICE_WEIGHT})


def choose(idle_fds: Sequence[int], want: Wanted, device_of: Callable[[int], str | None],
           warm_of: Callable[[int], affinity.Warm | None],
           room_of: Callable[[int], int | None] = lambda fd: None) -> list[int] | None:
    """The one idle child's fd a task should go to: among those on a device ``want``
    allows, the first whose warm set weighs most for it (its engine, prompt prefix and,
    for a declared intensity, its device's roofline: ``_Steered.warm``); for an engine
    warm in none of them, the one with the most room left in its device tier
    (``room_of``: it loads there evicting least, where the first idle child would evict
    what it holds); else the first (where it asks for a device); None where there is
    none (the pool chooses as before)."""
    fits = [fd for fd in idle_fds if want.devices is None or device_of(fd) in want.devices]
    if not fits:
        return None
    if want.model is not None and want.spread:
        fits = [fd for fd in fits if not holds(warm_of(fd), want.model)]
        if not fits:  # (every idle child holds it: the pool's choice, a load of nothing)
            return None
        # (the one holding it in its host tier promotes it: no read from disk; else the
        # roomiest; rooms unknown, the first: the pool's choice could be a holder)
        as_task = replace(want, spread=False, precision=None, prefix=None)
        return choose(fits, as_task, device_of, warm_of, room_of) or [fits[0]]
    if want.model is not None or want.intensity is not None or want.precision is not None:
        weights = [(w.weight(want.model, want.prefix, want.precision, want.intensity)
                    if (w := warm_of(fd)) is not None else 0.0) for fd in fits]
        best = max(weights)
        if best > 0:
            return [fits[weights.index(best)]]
    if want.model is not None:
        rooms = [room_of(fd) for fd in fits]
        if any(r is not None for r in rooms):
            most = max(r for r in rooms if r is not None)
            return [fits[rooms.index(most)]]
    return [fits[0]] if want.devices is not None else None


def holds(warm: affinity.Warm | None, model: str) -> bool:
    """Whether a child's warm set has ``model`` on its device tier, at any precision (as
    the pre-warm planner counts it: demand is counted by model)."""
    return warm is not None and any(
        affinity.model_of(key) == model and weight >= affinity.DEVICE_WEIGHT
        for key, weight in warm.models.items())


def share(fds: Sequence[int], wants: Sequence[Wanted | None],
          device_of: Callable[[int], str | None],
          warm_of: Callable[[int], affinity.Warm | None],
          room_of: Callable[[int], int | None] = lambda fd: None) -> list[int]:
    """The idle children ``fds`` (in the pool's order) shared among the jobs at the head
    of the outbound buffer (``wants``: each one's wish, None for none; at most one job
    per child), the fd each goes to: first each job with a wish, in order, takes the
    child :func:`choose` gives it among those left, then the others take those left, in
    order."""
    assert len(wants) <= len(fds)
    free = list(fds)
    chosen: list[int | None] = [None] * len(wants)
    for n, want in enumerate(wants):
        if want is not None and (fd := choose(free, want, device_of, warm_of, room_of)):
            chosen[n] = fd[0]
            free.remove(fd[0])
    return [fd if fd is not None else free.pop(0) for fd in chosen]


def install(pool: Any, device_of_slot: Callable[[int], str | None],
            rooflines: Mapping[str, affinity.Roofline] | None = None,
            precisions: Mapping[str, Mapping[str, float]] | None = None) -> bool:
    """Steer ``pool`` (a billiard ``AsynPool``, before it registers with the event loop)
    by :func:`share`, ``rooflines`` and ``precisions`` being its devices' against each
    other's (by UUID); False for a pool without the parts this needs (another pool, or a
    Celery whose pool changed), which is left as it is."""
    global _steered
    create = getattr(pool, "_create_write_handlers", None)
    needed = ("outbound_buffer", "_fileno_to_inq", "_busy_workers", "_active_writes")
    if create is None or not all(hasattr(pool, name) for name in needed):
        return False
    steered = _Steered(pool, device_of_slot, dict(rooflines or {}), dict(precisions or {}))

    def create_write_handlers(hub: Any, *args: Any, **kwargs: Any) -> Any:
        out = create(hub, *args, **kwargs)
        schedule = hub.consolidate_callback

        def schedule_writes(ready_fds: Sequence[int], *rest: Any) -> Any:
            # One job at a time while a job with a wish waits to be written: Celery's own
            # writes one job per writable child in a call, and the jobs behind the head
            # went to whichever child came next, unsteered.
            outbound = pool.outbound_buffer
            while outbound:
                idle = steered.idle(ready_fds)
                ids = [getattr(job, "correlation_id", None)
                       for job in itertools.islice(outbound, len(idle))]
                wants = [wanted(task_id) for task_id in ids]
                if not any(wants):  # (plain tasks: the pool's own way, at its own cost)
                    return schedule(ready_fds, *rest)
                before = len(outbound)
                chosen = steered.share(idle, wants)[:1]
                schedule(chosen, *rest)
                if len(outbound) >= before:  # (not written: the pool puts it back)
                    return None
                if wants[0] is not None and (slot := steered.slot(chosen[0])) is not None:
                    expect(slot, wants[0])
                if ids[0] is not None:
                    forget(ids[0])
            return None

        hub.consolidate_callback = schedule_writes
        return out

    pool._create_write_handlers = create_write_handlers
    _steered = steered
    return True


class SteerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker step: steer the prefork pool of a worker of several children (after the
    pool starts, before the consumer registers it with the event loop)."""

    requires = ("celery.worker.components:Pool",)
    name = "SITS pool steering"

    def start(self, w: Any) -> None:
        from sits_queue.app import sits_config
        from sits_queue.workers import advertise, fleet, runtime
        from sits_queue.workers.placement import used_devices

        plan = runtime.plan()
        config = sits_config(w.app)
        if plan.slots < 2 or not config.steer_pool:
            return

        def device_of_slot(slot: int) -> str | None:
            return runtime.device_for_slot(plan.discovery, slot).uuid

        records = [advertise.device_record(d)
                   for d in used_devices(plan.discovery, plan.slots)]
        rooflines = fleet.host_rooflines(records, config.affinity.roofline_weight)
        precisions = fleet.host_precisions(records, config.affinity.precision_weight)
        if rooflines:
            logger.info("pool steering: a task's declared arithmetic intensity goes to the "
                        "child whose GPU suits it (%s)", ", ".join(
                            f"{uuid}: {' '.join(sorted(r.bounds))}"
                            for uuid, r in sorted(rooflines.items())))
        if precisions:
            logger.info("pool steering: a task's precision goes to the child whose GPU is "
                        "relatively strong at it (%s)", ", ".join(
                            f"{uuid}: {' '.join(sorted(w)) or '-'}"
                            for uuid, w in sorted(precisions.items())))
        if not install(getattr(w.pool, "_pool", None), device_of_slot, rooflines,
                       precisions):
            logger.debug("pool %r not steered: not Celery's prefork pool", w.pool)
