"""Per-class limit arithmetic (MISSION §1.4): pure functions over a :class:`ClassQuota`.

The worker child applies the results (``torch.cuda.set_per_process_memory_fraction``,
``os.sched_setaffinity``, Celery time limits); nothing here touches a device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from sits_queue.config import ClassQuota
from sits_queue.errors import VramLimitExceeded

#: Bytes per GiB: quotas are in GiB (binary), as ``nvidia-smi`` and torch report memory.
BYTES_PER_GIB = 2**30


def vram_fraction(quota: ClassQuota, device_total_bytes: int) -> float:
    """Share of the device a task of this class may allocate, in (0, 1].

    The argument of ``torch.cuda.set_per_process_memory_fraction``: the class's VRAM
    limit over the device total, capped at 1 on a device smaller than the limit.
    """
    if device_total_bytes <= 0:
        raise ValueError(f"device_total_bytes must be > 0, got {device_total_bytes}")
    return min(1.0, quota.vram_gib * BYTES_PER_GIB / device_total_bytes)


def fits(vram_gib_needed: float | None, device_free_bytes: int, headroom_bytes: int) -> bool:
    """Whether a task declaring ``vram_gib_needed`` can start on the device right now.

    None means the task declared nothing, so it always fits (its class cap still
    applies). ``headroom_bytes`` stays free for the CUDA context and allocator slack.
    """
    if headroom_bytes < 0:
        raise ValueError(f"headroom_bytes must be >= 0, got {headroom_bytes}")
    if vram_gib_needed is None:
        return True
    if not math.isfinite(vram_gib_needed) or vram_gib_needed < 0:
        raise ValueError(f"vram_gib_needed must be finite and >= 0, got {vram_gib_needed!r}")
    return vram_gib_needed * BYTES_PER_GIB + headroom_bytes <= device_free_bytes


def _share(cpus: Sequence[int], slot: int, slots: int) -> Sequence[int]:
    """Slot ``slot``'s contiguous share when ``cpus`` is split into ``slots`` near-equal runs."""
    base, extra = divmod(len(cpus), slots)
    start = slot * base + min(slot, extra)
    return cpus[start:start + base + (1 if slot < extra else 0)]


def cpu_set(quota: ClassQuota, available_cpus: Sequence[int], slot: int,
            slots: int) -> tuple[int, ...]:
    """The cores pool child ``slot`` (of ``slots``) may run a task of this class on.

    The sorted, de-duplicated ``available_cpus`` are split into ``slots`` disjoint
    contiguous runs (sizes differ by at most one; adjacent core ids usually share a
    socket and cache), so children never contend for a core. The child takes the first
    ``quota.cpu_cores`` of its run. With fewer cores than slots, slot ``i`` gets core
    ``i mod n``: the set is never empty, at the price of sharing.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if not 0 <= slot < slots:
        raise ValueError(f"slot must be in [0, {slots}), got {slot}")
    cpus = sorted(set(available_cpus))
    if not cpus:
        raise ValueError("available_cpus is empty")
    if len(cpus) < slots:
        return (cpus[slot % len(cpus)],)
    return tuple(_share(cpus, slot, slots)[:quota.cpu_cores])


def numa_cpu_set(quota: ClassQuota, node_cpus: Mapping[int, Sequence[int]],
                 slot_nodes: Sequence[int | None], slot: int) -> tuple[int, ...] | None:
    """The cores pool child ``slot`` may run a task of this class on, taken from the NUMA
    node of its GPU (``slot_nodes[i]``: child ``i``'s device's node; ``node_cpus``: each
    node's usable cores); None where that does not apply: a host of one node, a device
    whose node is unknown, or a node with no usable core (then :func:`cpu_set`).

    The children of one node split its cores as :func:`cpu_set` splits the host's: a
    child's host-side work (tokenising, pinned-memory copies to its GPU, the CPU half of
    a generation step) stays on its GPU's socket instead of crossing the interconnect
    for every buffer, and no two children share a core where the node has enough. The
    cores of a node with no GPU child go unused by the children."""
    if not 0 <= slot < len(slot_nodes):
        raise ValueError(f"slot must be in [0, {len(slot_nodes)}), got {slot}")
    nodes = {n: sorted(set(c)) for n, c in node_cpus.items() if c}
    if len(nodes) < 2 or any(n not in nodes for n in slot_nodes):
        return None
    node = slot_nodes[slot]
    assert node is not None  # (every slot's node is a key of nodes)
    peers = [i for i, n in enumerate(slot_nodes) if n == node]
    cpus, index = nodes[node], peers.index(slot)
    if len(cpus) < len(peers):
        return (cpus[index % len(cpus)],)
    return tuple(_share(cpus, index, len(peers))[:quota.cpu_cores])


def time_limits(quota: ClassQuota, soft_fraction: float) -> tuple[float, float]:
    """Celery ``(soft_time_limit, time_limit)`` for the class, seconds.

    The hard limit is the class's ``max_run_s``; the soft one comes ``soft_fraction``
    of the way there, so the task has time to clean up after ``SoftTimeLimitExceeded``.
    """
    if not 0 < soft_fraction < 1:
        raise ValueError(f"soft_fraction must be in (0, 1), got {soft_fraction!r}")
    return quota.max_run_s * soft_fraction, quota.max_run_s


def class_bytes(quota: ClassQuota) -> int:
    return int(quota.vram_gib * BYTES_PER_GIB)


def memory_cap_fraction(quota: ClassQuota, allocated_bytes: int, engine_bytes: int,
                        device_total_bytes: int) -> float:
    """Allocator fraction so this task can add at most its class limit minus its engine.

    The class limit covers the task's own footprint: its engine's weights plus what it
    allocates while running. Engines the warm cache keeps for *other* models are already
    in ``allocated_bytes`` and are not this task's, so the cap sits on top of what is
    allocated now: ``allocated + (class - engine)``, as a fraction of the device.
    """
    if device_total_bytes <= 0:
        raise ValueError(f"device_total_bytes must be > 0, got {device_total_bytes}")
    headroom = max(0, class_bytes(quota) - engine_bytes)
    return max(1e-6, min(1.0, (allocated_bytes + headroom) / device_total_bytes))


def check_engine_fits_class(model: str, quota: ClassQuota, engine_bytes: int,
                            extra_bytes: int = 0) -> None:
    """Raise :class:`VramLimitExceeded` if weights plus an estimate exceed the class limit."""
    need = engine_bytes + max(0, extra_bytes)
    if need > class_bytes(quota):
        detail = (f"{engine_bytes / BYTES_PER_GIB:.4g} GiB of weights" if not extra_bytes else
                  f"{engine_bytes / BYTES_PER_GIB:.4g} GiB of weights + "
                  f"{extra_bytes / BYTES_PER_GIB:.4g} GiB estimated working memory")
        raise VramLimitExceeded(f"model {model!r} needs {detail}, over the "
                                f"{quota.vram_gib:g} GiB VRAM limit of class {quota.name!r}")
