"""The last word on a declared ``vram_gib``, in the pool child that got the task.

The main process admits a task by its worker's roomiest device (``request.py``): it
cannot know which child the pool will hand the task to. On a worker of several GPUs (the
default: one child per GPU) the child that gets it may be pinned to a device with far
less room: a task declaring 40 GiB, admitted for GPU 1's 70 GiB free, started on GPU 0
with 10 GiB free and failed out of memory. So before the task's code runs, its child
reads its own device's free memory (NVML, by UUID, plus what its own allocator holds
cached: NVML counts that used, yet the task reuses it); when the task does not fit there
it raises :class:`~sits_queue.workers.request.NotOnThisDevice` and the main process
gives the message back uncounted, held off from this worker as after its own refusal
(0.25 s, doubling to 4 s): a peer may take it at once, and this worker takes it again
once the hold runs out, when another of its children may be the idle one.

Only where it can differ from the main process's check: a prefork child of a worker of
several GPUs, running a task the SITS transport delivered. NVML, not CUDA: a plain task
declaring ``vram_gib`` has no CUDA context yet, and creating one to ask would cost the
child its context's memory and seconds.
"""

from __future__ import annotations

import logging
from typing import Any

from sits_queue.broker.keys import DELIVERY_HEADER
from sits_queue.options import HEADER
from sits_queue.spells import Spell
from sits_queue.workers import gpu, request
from sits_queue.workers.limits import BYTES_PER_GIB
from sits_queue.workers.runtime import ChildRuntime
from sits_queue.workers.taskheader import task_class

logger = logging.getLogger(__name__)

#: This child's NVML reader of its own device (opened at the first check, kept open).
_probe: request.FreeMemoryProbe | None = None
#: This child's failures to read its device's memory, said once a spell.
_unreadable = Spell(logger)


def own_free_bytes(rt: ChildRuntime) -> int:
    """Free memory of ``rt``'s device as a task starting in this child finds it, bytes:
    NVML's free figure plus this child's cached blocks (reserved, not allocated)."""
    global _probe
    if _probe is None:
        _probe = request.NvmlProbe([rt.device.uuid])
    stats = gpu.memory_stats()
    cached = max(0, stats["reserved_bytes"] - stats["allocated_bytes"])
    return _probe.max_free_bytes({rt.device.uuid: cached})


def applies(rt: ChildRuntime | None, task: Any) -> bool:
    """Whether the child's check can differ from the main process's for ``task``'s run:
    a pool child on one GPU of several, a task the SITS transport delivered (not an eager
    call) whose message is still there to give back (acked late: a task acked before
    it runs would be lost)."""
    return (rt is not None and rt.pool_child and rt.device.kind == "cuda"
            and sum(d.kind == "cuda" for d in rt.plan.devices) > 1
            and bool(getattr(task, "acks_late", False))
            and not getattr(task.request, "is_eager", False)
            and getattr(task.request, DELIVERY_HEADER, None) is not None)


def check(rt: ChildRuntime | None, task: Any) -> None:
    """Raise ``NotOnThisDevice`` when ``task``'s declared ``vram_gib`` cannot fit this
    child's device now; return when it fits, declares nothing, or the check does not
    apply here. An unreadable device lets the task run (its class cap still holds), as
    in the main process."""
    if not applies(rt, task):
        return
    task_request = task.request
    assert rt is not None
    header = getattr(task_request, HEADER, None)
    needed = request.declared_vram_gib({HEADER: header})
    if needed is None or needed > task_class(rt.config, task_request,
                                             getattr(task, "sla_class", None)).vram_gib:
        return  # (over its class's cap: it runs under the cap, as the main process said)
    try:
        free = own_free_bytes(rt)
    except Exception as exc:
        # (once a spell: a driver that refuses the call, as some refuse a MIG UUID,
        # refuses it at every task)
        _unreadable.failed(
            "task %s[%s]: could not read device %s's free memory (%s); started without "
            "this child's vram_gib check", task.name, task_request.id, rt.device.uuid, exc)
        return
    _unreadable.over()
    verdict = request.admit(needed, free)
    if verdict is not None:
        raise request.NotOnThisDevice(
            f"declares vram_gib={needed:g} but this child's device {rt.device.index} "
            f"({rt.device.uuid}) has {free / BYTES_PER_GIB:.2f} GiB free (minus "
            f"{request.HEADROOM_BYTES / BYTES_PER_GIB:.2f} GiB headroom)")


def check_here(task: Any) -> None:
    """:func:`check` in this process (a no-op outside a pool child)."""
    from sits_queue.workers import runtime

    check(runtime.child(), task)
