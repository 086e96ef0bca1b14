"""Where a worker's pool children run: the plan the parent makes before forking (its
devices, cores and pool size), which device each child is pinned to, and which pools
can give each task its own limits. Pure: the parent's discovery is its input."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sits_queue.config import ClassQuota
from sits_queue.workers.devices import Device, Discovery
from sits_queue.workers.limits import cpu_set, numa_cpu_set


@dataclass(frozen=True)
class WorkerPlan:
    """What the parent learnt before forking; every child inherits it."""

    hostname: str
    discovery: Discovery
    #: CPUs the worker may use (its affinity at start); children split them by slot.
    available_cpus: tuple[int, ...]
    #: Pool size; 0 until :class:`PlanStep` records it.
    slots: int = 0
    #: CPUs' worth of time the worker's cgroup may use (a container's ``--cpus``); None:
    #: no quota. Caps each child's torch threads at its share (``cores.py``).
    cpu_quota: float | None = None
    #: Each NUMA node's usable cores, ``(node, cores)`` pairs (``cores.numa_nodes``);
    #: empty where unknown (one node, or not Linux).
    node_cpus: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def child_cpus(self, quota: ClassQuota, slot: int) -> tuple[int, ...]:
        """The cores child ``slot`` runs a task of this class on: its share of its GPU's
        NUMA node where the host has several (:func:`numa_cpu_set`), else its share of
        the worker's cores (:func:`cpu_set`)."""
        slots = max(1, self.slots)
        slot %= slots
        if self.node_cpus and self.discovery.cuda_devices:
            nodes = [device_for_slot(self.discovery, i).numa_node for i in range(slots)]
            near = numa_cpu_set(quota, dict(self.node_cpus), nodes, slot)
            if near is not None:
                return near
        return cpu_set(quota, self.available_cpus, slot, slots)

    @property
    def devices(self) -> tuple[Device, ...]:
        """The devices this worker's children use (:func:`used_devices`)."""
        return used_devices(self.discovery, self.slots)


#: Pools whose tasks each run in a process of their own (prefork's children) or alone in
#: the worker (solo): the per-process CUDA memory cap, CPU confinement and the running
#: task's state hold for one task at a time. Any other pool (threads, gevent, eventlet)
#: runs several tasks in one process, so they would share one cap and clobber each
#: other's confinement: allowed only at concurrency 1.
PROCESS_POOLS = ("celery.concurrency.prefork", "celery.concurrency.solo")


def pool_name(pool_module: str) -> str:
    """The ``--pool`` value that selects the pool class of ``pool_module``."""
    name = pool_module.rsplit(".", 1)[-1]
    return "threads" if name == "thread" else name  # celery.concurrency.thread


def pool_problem(pool_module: str, concurrency: int) -> str | None:
    """Why a worker must not start with the pool class of ``pool_module`` at this
    concurrency unless it runs plain tasks only (None: it may)."""
    if pool_module in PROCESS_POOLS or concurrency <= 1:
        return None
    return (f"sits_queue: the {pool_name(pool_module)!r} pool would run {concurrency} tasks in one "
            "process, sharing one CUDA memory cap, one CPU confinement and one engine cache; "
            "per-class VRAM and CPU limits need a process per task. Use the prefork pool "
            "(the default: one child per GPU), --pool=solo, or --concurrency=1; or, for a "
            "worker of plain (non-inference) tasks only, set SITS_PLAIN_TASKS_ONLY=1.")


def device_for_slot(discovery: Discovery, slot: int) -> Device:
    """Slot ``i`` gets GPU ``i mod n`` (more children than GPUs share round-robin)."""
    gpus = discovery.cuda_devices
    if not gpus:
        return discovery.devices[0]
    return gpus[slot % len(gpus)]


def used_devices(discovery: Discovery, slots: int) -> tuple[Device, ...]:
    """The devices a pool of ``slots`` children is pinned to (:func:`device_for_slot`),
    in discovery order; every device while the pool's size is unknown (0). A pool of
    fewer children than GPUs leaves the rest unused: not this worker's to admit by or
    to advertise (a 50 GiB task admitted for an unused 80 GB GPU's room was given back by
    the one child, on a 40 GB GPU, for good)."""
    gpus = discovery.cuda_devices
    if not gpus or slots <= 0 or slots >= len(gpus):
        return discovery.devices
    return gpus[:slots]


def slot_devices(discovery: Discovery, slots: Iterable[int]) -> tuple[Device, ...]:
    """The devices the pool children of these ``slots`` (process indexes) are pinned to,
    in discovery order; every device for none. A pool that autoscales is planned at its
    most (:func:`used_devices`) and runs fewer children until it grows: only these
    devices can run a task meanwhile."""
    pinned = {device_for_slot(discovery, slot).uuid for slot in slots}
    return tuple(d for d in discovery.devices if d.uuid in pinned) or discovery.devices


def unused_notice(discovery: Discovery, slots: int) -> str | None:
    """One line naming the GPUs no child of a pool of ``slots`` is pinned to; None."""
    used = used_devices(discovery, slots)
    idle = [d for d in discovery.cuda_devices if d not in used]
    if not idle:
        return None
    names = ", ".join(f"GPU {d.index} ({d.name}, {d.uuid})" for d in idle)
    return (f"sits-queue: {names} {'has' if len(idle) == 1 else 'have'} no pool child "
            f"({slots} for {len(discovery.cuda_devices)} GPUs): this worker neither runs "
            f"on nor advertises {'it' if len(idle) == 1 else 'them'}; leave -c out (one "
            "child per GPU), or name this worker's GPUs with CUDA_VISIBLE_DEVICES")


def pin_env(device: Device) -> dict[str, str]:
    """Environment that pins a child to ``device``; empty for the CPU device.

    The UUID, not the NVML index: CUDA numbers devices fastest-first by default while
    NVML numbers them by PCI bus, so an index could name a different GPU. Inside the
    child the one visible device is ``cuda:0``.
    """
    if device.kind != "cuda":
        return {}
    return {"CUDA_VISIBLE_DEVICES": device.uuid}
