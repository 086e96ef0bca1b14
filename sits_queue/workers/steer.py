"""Which pool child gets a task that declares ``vram_gib``, on a worker of several GPUs.

The main process admits such a task by its devices' free memory (``request.py``), then
hands it to the pool, and Celery's prefork pool writes it to an idle child of its own
choosing: the first writable one in its list (``AsynPool.schedule_writes`` starts its
rotation afresh at every call, celery 5.x). On a host of mixed sizes that child may be
pinned to a GPU that cannot hold the task: it gives the task back (``devicefit.py``),
the worker takes it again after the hold, and the pool hands it to the same child, for
good, while the child on the large GPU sits idle (seen with a stand-in NVML of an 80 GB
and a 40 GB GPU: a 50 GiB task given back once a second for a minute, never run).

So the main process says which devices can hold the task now (:func:`want`, at
admission), and this module narrows the pool's choice for the task at the head of its
outbound buffer to an idle child pinned to one of them (:func:`choose`, pure). Where
none is idle the pool chooses as before, and the child's own check stays the last word.
Only Celery's prefork pool (``AsynPool``) is steered; any other pool runs as it did.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from celery import bootsteps

logger = logging.getLogger(__name__)

#: Task ids whose devices are remembered, at most: a task admitted that never reaches the
#: pool (revoked meanwhile) leaves its entry until this many newer ones push it out.
MOST_REMEMBERED = 4096

#: Task id -> UUIDs of the devices that could hold it when it was admitted.
_wanted: OrderedDict[str, frozenset[str]] = OrderedDict()


def want(task_id: str, uuids: frozenset[str]) -> None:
    """The task ``task_id`` fits only the devices ``uuids`` now (main process, at
    admission): the pool should hand it to a child pinned to one of them."""
    _wanted[task_id] = uuids
    _wanted.move_to_end(task_id)
    while len(_wanted) > MOST_REMEMBERED:
        _wanted.popitem(last=False)


def wanted(task_id: str | None) -> frozenset[str] | None:
    return None if task_id is None else _wanted.get(task_id)


def forget(task_id: str) -> None:
    _wanted.pop(task_id, None)


def choose(ready_fds: Sequence[int], devices: frozenset[str],
           device_of: Callable[[int], str | None],
           idle: Callable[[int], bool]) -> list[int] | None:
    """The one writable child's fd the head task should go to: the first idle one pinned
    to one of ``devices``; None where there is none (the pool chooses as before)."""
    for fd in ready_fds:
        if idle(fd) and device_of(fd) in devices:
            return [fd]
    return None


def install(pool: Any, device_of_slot: Callable[[int], str | None]) -> bool:
    """Steer ``pool`` (a billiard ``AsynPool``, before it registers with the event loop)
    by :func:`choose`; False for a pool without the parts this needs (another pool, or a
    Celery whose pool changed), which is left as it is."""
    create = getattr(pool, "_create_write_handlers", None)
    needed = ("outbound_buffer", "_fileno_to_inq", "_busy_workers", "_active_writes")
    if create is None or not all(hasattr(pool, name) for name in needed):
        return False

    def device_of(fd: int) -> str | None:
        proc = pool._fileno_to_inq.get(fd)
        slot = getattr(proc, "index", None)
        return device_of_slot(slot) if isinstance(slot, int) else None

    def idle(fd: int) -> bool:
        return fd not in pool._busy_workers and fd not in pool._active_writes

    def create_write_handlers(hub: Any, *args: Any, **kwargs: Any) -> Any:
        out = create(hub, *args, **kwargs)
        schedule = hub.consolidate_callback

        def schedule_writes(ready_fds: Sequence[int], *rest: Any) -> Any:
            outbound = pool.outbound_buffer
            task_id = getattr(outbound[0], "correlation_id", None) if outbound else None
            devices = wanted(task_id)
            if devices and (chosen := choose(ready_fds, devices, device_of, idle)):
                assert task_id is not None
                forget(task_id)
                ready_fds = chosen
            return schedule(ready_fds, *rest)

        hub.consolidate_callback = schedule_writes
        return out

    pool._create_write_handlers = create_write_handlers
    return True


class SteerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker step: steer the prefork pool of a worker of several GPUs (after the pool
    starts, before the consumer registers it with the event loop)."""

    requires = ("celery.worker.components:Pool",)
    name = "SITS device steering"

    def start(self, w: Any) -> None:
        from sits_queue.workers import runtime

        discovery = runtime.plan().discovery
        if sum(d.kind == "cuda" for d in runtime.plan().devices) < 2:
            return

        def device_of_slot(slot: int) -> str | None:
            return runtime.device_for_slot(discovery, slot).uuid

        if not install(getattr(w.pool, "_pool", None), device_of_slot):
            logger.debug("pool %r not steered by device: not Celery's prefork pool", w.pool)
