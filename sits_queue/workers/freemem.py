"""How much device memory the worker's devices have free, read in the worker's main
process for admission (``request.py``) and in a pool child for its own device
(``devicefit.py``): NVML only, never CUDA; host RAM on a CPU host. What this worker's own
children hold in torch's cache counts as free (:func:`cached_by_device`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import psutil

from sits_queue.workers import nvmlfork


class FreeMemoryProbe(Protocol):
    def max_free_bytes(self, cached: Mapping[str, int] | None = None) -> int:
        """Free memory of the worker's roomiest device, bytes, counting what ``cached``
        says this worker's own children hold cached there (by device UUID)."""

    def max_total_bytes(self) -> int:
        """Memory of the worker's largest device in all, bytes."""


class HostProbe:
    """The CPU fallback: host RAM stands in for device memory (as in ``cpu_device``)."""

    def max_free_bytes(self, cached: Mapping[str, int] | None = None) -> int:
        return int(psutil.virtual_memory().available)

    def max_total_bytes(self) -> int:
        return int(psutil.virtual_memory().total)


class NvmlProbe:
    """Free memory of the worker's GPUs through NVML: kept open between reads, closed
    before each fork of the pool (:mod:`nvmlfork`: a child must not inherit it open)."""

    def __init__(self, uuids: Sequence[str], nvml: Any = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml: Any = nvml
        self._uuids = tuple(uuids)
        self._handles: list[Any] | None = None
        nvmlfork.close_before_fork(self.close)

    def _open(self) -> list[Any]:
        if self._handles is None:
            self._nvml.nvmlInit()
            try:
                self._handles = [self._nvml.nvmlDeviceGetHandleByUUID(u)
                                 for u in self._uuids]
            except BaseException:
                self._nvml.nvmlShutdown()
                raise
        return self._handles

    def max_free_bytes(self, cached: Mapping[str, int] | None = None) -> int:
        return max(self.free_by_device(cached).values())

    def free_by_device(self, cached: Mapping[str, int] | None = None) -> dict[str, int]:
        """Each device's free memory by UUID, bytes, counting ``cached`` as free (see
        :meth:`FreeMemoryProbe.max_free_bytes`)."""
        cached = cached or {}
        with nvmlfork.session():
            return {uuid: int(self._nvml.nvmlDeviceGetMemoryInfo(h).free) + cached.get(uuid, 0)
                    for uuid, h in zip(self._uuids, self._open(), strict=True)}

    def max_total_bytes(self) -> int:
        with nvmlfork.session():
            return max(int(self._nvml.nvmlDeviceGetMemoryInfo(h).total) for h in self._open())

    def close(self) -> None:
        """Shut the session down (it reopens at the next read)."""
        with nvmlfork.session():
            if self._handles is not None:
                self._handles = None
                self._nvml.nvmlShutdown()


def cached_by_device(children: Mapping[str, Any], device_of: Callable[[int], Any]
                     ) -> dict[str, int]:
    """Device memory this worker's children hold in torch's cache (reserved, not
    allocated), by the UUID of the device each is pinned to, from their records: the
    least any child of that device holds (the task goes to whichever is idle).

    NVML counts it used, yet the child that gets the task reuses it (its allocator frees
    cached blocks before it fails an allocation): a task declaring 40 GiB after one
    that had used and freed 50 on an 80 GB device was refused with ~26 GiB "free", held
    off and released again for ever by a worker whose own child could run it."""
    least: dict[str, int] = {}
    for slot, child in children.items():
        memory = child.get("memory") if isinstance(child, Mapping) else None
        reserved = memory.get("reserved_bytes") if isinstance(memory, Mapping) else None
        allocated = memory.get("allocated_bytes") if isinstance(memory, Mapping) else None
        if not isinstance(reserved, int) or not isinstance(allocated, int) \
                or isinstance(reserved, bool) or isinstance(allocated, bool):
            continue  # (an older or foreign writer's record: nothing counted)
        try:
            device = device_of(int(slot))
        except (TypeError, ValueError):
            continue
        if getattr(device, "kind", None) != "cuda":
            continue
        held = max(0, reserved - allocated)
        least[device.uuid] = min(least.get(device.uuid, held), held)
    return least
