"""How much device memory the worker's devices have free, read in the worker's main
process for admission (``request.py``) and in a pool child for its own device
(``devicefit.py``): NVML only, never CUDA; host RAM on a CPU host. What this worker's own
children hold in torch's cache counts as free (:func:`cached_by_device`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import psutil

from sits_queue.workers import nvmlfork

logger = logging.getLogger(__name__)


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
        #: Devices whose last read failed (said once a spell).
        self._failing: set[str] = set()
        nvmlfork.close_before_fork(self.close)

    @property
    def uuids(self) -> tuple[str, ...]:
        """The devices it reads."""
        return self._uuids

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
        :meth:`FreeMemoryProbe.max_free_bytes`), of those that could be read: one that
        cannot (a GPU fallen off the bus, "GPU is lost") is left out, said once, and
        admits nothing until it reads again (read as a failure of all, every device's
        check was skipped: tasks of 50 GiB ran on a 24 GB L4). Raises the error when no
        device could be read."""
        cached = cached or {}
        return {uuid: free + cached.get(uuid, 0)
                for uuid, free in self._each(lambda info: int(info.free)).items()}

    def max_total_bytes(self) -> int:
        return max(self._each(lambda info: int(info.total)).values())

    def _each(self, field: Callable[[Any], int]) -> dict[str, int]:
        """``field`` of each readable device's memory info, by UUID (see
        :meth:`free_by_device`)."""
        out: dict[str, int] = {}
        error: Exception | None = None
        with nvmlfork.session():
            for uuid, handle in zip(self._uuids, self._open(), strict=True):
                try:
                    out[uuid] = field(self._nvml.nvmlDeviceGetMemoryInfo(handle))
                except Exception as exc:  # (NVMLError, or a driver's odder failure)
                    error = error or exc
                    if uuid not in self._failing and len(self._uuids) > 1:
                        logger.warning("device %s: its memory could not be read (%s): "
                                       "tasks declaring vram_gib are not admitted there "
                                       "until it reads again", uuid, exc)
                    self._failing.add(uuid)
                    continue
                if uuid in self._failing:
                    self._failing.discard(uuid)
                    logger.info("device %s: its memory reads again", uuid)
        if not out and error is not None:
            raise error
        return out

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
