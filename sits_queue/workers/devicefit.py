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

A batch's calls run together on one engine: the child checks the most any of them
declares, once, and gives them all back when it does not fit (:func:`batch_misfit`,
``batched.run_batch``).

Only where it can differ from the main process's check: a prefork child of a worker of
several GPUs, running a task the SITS transport delivered. NVML, not CUDA: a plain task
declaring ``vram_gib`` has no CUDA context yet, and creating one to ask would cost the
child its context's memory and seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sits_queue.broker.keys import DELIVERY_HEADER
from sits_queue.options import HEADER
from sits_queue.spells import Spell
from sits_queue.workers import freemem, gpu, request
from sits_queue.workers.limits import BYTES_PER_GIB, fits
from sits_queue.workers.runtime import ChildRuntime
from sits_queue.workers.taskheader import task_class

logger = logging.getLogger(__name__)

#: This child's NVML reader of its own device (opened at the first check, kept open).
_probe: freemem.FreeMemoryProbe | None = None
#: This child's failures to read its device's memory, said once a spell.
_unreadable = Spell(logger)


def own_free_bytes(rt: ChildRuntime) -> int:
    """Free memory of ``rt``'s device as a task starting in this child finds it, bytes:
    NVML's free figure plus this child's cached blocks (reserved, not allocated)."""
    global _probe
    if _probe is None:
        _probe = freemem.NvmlProbe([rt.device.uuid])
    stats = gpu.memory_stats()
    cached = max(0, stats["reserved_bytes"] - stats["allocated_bytes"])
    return _probe.max_free_bytes({rt.device.uuid: cached})


def applies(rt: ChildRuntime | None, task: Any, task_request: Any = None) -> bool:
    """Whether the child's check can differ from the main process's for ``task``'s run
    (under ``task_request``, default the task's own): a pool child on one GPU of several,
    a task the SITS transport delivered (not an eager call) whose message is still there
    to give back (acked late: a task acked before it runs would be lost)."""
    task_request = task.request if task_request is None else task_request
    return (rt is not None and rt.pool_child and rt.device.kind == "cuda"
            and sum(d.kind == "cuda" for d in rt.plan.devices) > 1
            and bool(getattr(task, "acks_late", False))
            and not getattr(task_request, "is_eager", False)
            and getattr(task_request, DELIVERY_HEADER, None) is not None)


def _needed(rt: ChildRuntime, task: Any, task_request: Any) -> float | None:
    """The ``vram_gib`` the call under ``task_request`` declares, GiB; None when it
    declares none, or more than its class's cap (it runs under the cap, as the main
    process said)."""
    needed = request.declared_vram_gib({HEADER: getattr(task_request, HEADER, None)})
    if needed is None or needed > task_class(rt.config, task_request,
                                             getattr(task, "sla_class", None)).vram_gib:
        return None
    return needed


def check(rt: ChildRuntime | None, task: Any) -> None:
    """Raise ``NotOnThisDevice`` when ``task``'s declared ``vram_gib`` cannot fit this
    child's device now; return when it fits, declares nothing, or the check does not
    apply here. An unreadable device lets the task run (its class cap still holds), as
    in the main process."""
    if not applies(rt, task):
        return
    assert rt is not None
    misfit = _misfit(rt, task, _needed(rt, task, task.request), task.request.id)
    if misfit is not None:
        raise misfit


def batch_misfit(rt: ChildRuntime | None, task: Any, requests: Sequence[Any]
                 ) -> request.NotOnThisDevice | None:
    """For a batch run in this child (``requests``: its calls'): ``NotOnThisDevice`` when
    the most any call declares cannot fit this child's device now (they run together,
    on one engine, which the largest declaration sizes), for each call to be given back
    with; None when it fits or nothing applies. One read of the device for the batch."""
    if rt is None or not requests or not all(applies(rt, task, r) for r in requests):
        return None
    declared = [n for r in requests if (n := _needed(rt, task, r)) is not None]
    return _misfit(rt, task, max(declared, default=None), requests[0].id)


def _misfit(rt: ChildRuntime, task: Any, needed: float | None, task_id: Any
            ) -> request.NotOnThisDevice | None:
    if needed is None:
        return None
    try:
        free = own_free_bytes(rt)
    except Exception as exc:
        total = rt.device.total_vram_bytes
        if rt.device.kind == "cuda" and not fits(needed, total, request.HEADROOM_BYTES):
            # (its size is known from the start: a 50 GiB task on a 24 GB GPU whose free
            # memory could not be read ran, and failed there)
            return request.NotOnThisDevice(
                f"declares vram_gib={needed:g} but this child's device {rt.device.index} "
                f"({rt.device.uuid}) has {total / BYTES_PER_GIB:.2f} GiB in all (its free "
                f"memory could not be read: {exc})")
        # (once a spell: a driver that refuses the call, as some refuse a MIG UUID,
        # refuses it at every task)
        _unreadable.failed(
            "task %s[%s]: could not read device %s's free memory (%s); started without "
            "this child's vram_gib check", task.name, task_id, rt.device.uuid, exc)
        return None
    _unreadable.over()
    if request.admit(needed, free) is None:
        return None
    return request.NotOnThisDevice(
        f"declares vram_gib={needed:g} but this child's device {rt.device.index} "
        f"({rt.device.uuid}) has {free / BYTES_PER_GIB:.2f} GiB free (minus "
        f"{request.HEADROOM_BYTES / BYTES_PER_GIB:.2f} GiB headroom)")


def check_here(task: Any) -> None:
    """:func:`check` in this process (a no-op outside a pool child)."""
    from sits_queue.workers import runtime

    check(runtime.child(), task)
