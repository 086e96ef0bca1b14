"""Everything that touches CUDA, in one module, imported lazily, only in pool children.

The worker's parent process never calls anything here: a CUDA context created before
``fork`` is unusable in every child ("Cannot re-initialize CUDA in forked subprocess",
celery#6036). Children call it only after :mod:`sits_queue.workers.runtime` has pinned
them to one device through ``CUDA_VISIBLE_DEVICES``, so inside a child the device is
always ``cuda:0``. On a host without CUDA every function is a cheap no-op, so callers
need no branches.

``torch`` itself is imported inside the functions: importing this module costs nothing
and never loads the CUDA runtime.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

from sits_queue.workers import childgc, softsignal

#: Bytes of the allocation that forces the caching allocator (and cuBLAS-free parts of the
#: context) to exist, so the first task's timing does not include them. One float32.
_TOUCH_ELEMENTS = 1
_MS_PER_S = 1000.0

_context_created = False


_available: bool | None = None
#: The fraction :func:`cap_memory` last set (None: uncapped), for :func:`free_bytes`.
_fraction: float | None = None


def _torch() -> Any:
    if "torch" not in sys.modules:  # its first import: not to be cut by a soft limit
        with softsignal.held():
            import torch

            # (before any engine exists: its objects, not a model's, are what is frozen)
            childgc.settle()
    import torch

    return torch


def cuda_available() -> bool:
    """Whether this process can use CUDA (answer cached; no torch means no CUDA).

    The first call initialises the CUDA driver (``cudaGetDeviceCount``), which is part of
    the context cost: :func:`create_context` times it.
    """
    global _available
    if _available is None:
        try:
            torch = _torch()
        except ImportError:
            _available = False
        else:
            _available = bool(torch.cuda.is_available())
    return _available


def cuda_known() -> bool | None:
    """:func:`cuda_available`'s answer if some call has asked already, else None; never
    imports torch nor starts the driver (for a child's start-up, which Celery times)."""
    return _available


def create_context() -> float:
    """Create this process's CUDA context on device 0, ms; 0.0 if it exists or on CPU.

    MISSION §4.1 times the context separately from engine load: ``cuInit``, the primary
    context and the caching allocator's first segment all happen here, so the first
    engine load is not charged for them. Idempotent: a long-lived child pays it once.
    """
    global _context_created
    if _context_created:
        return 0.0
    try:
        # Importing torch is the process's start-up, not the context (a CUDA build takes
        # seconds): before the clock. The driver's start (cuda_available) is after it.
        _torch()
    except ImportError:
        return 0.0
    start = time.perf_counter()
    if not cuda_available():
        return 0.0
    torch = _torch()
    torch.cuda.init()
    torch.empty(_TOUCH_ELEMENTS, device="cuda:0")
    torch.cuda.synchronize()
    _context_created = True
    return (time.perf_counter() - start) * _MS_PER_S


def context_created() -> bool:
    return _context_created


def total_memory_bytes() -> int | None:
    """Total memory of this child's device (cuda:0), or None without CUDA."""
    if not cuda_available():
        return None
    return int(_torch().cuda.get_device_properties(0).total_memory)


def cap_memory(fraction: float) -> bool:
    """Cap this process's CUDA caching allocator at ``fraction`` of the device; True if set.

    ``torch.cuda.set_per_process_memory_fraction``: an allocation that would take the
    allocator's reserved memory past the cap raises ``torch.OutOfMemoryError`` instead of
    succeeding, after the allocator has freed its unused cache. Needs the context, so it
    creates it (a no-op when it exists). False on a host without CUDA.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction!r}")
    if not cuda_available():
        return False
    global _fraction
    create_context()
    _torch().cuda.set_per_process_memory_fraction(fraction, 0)
    _fraction = fraction
    return True


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is a device out-of-memory error (torch's, or a CUDA runtime message).

    Checks the message as well as the type: some paths (cuBLAS workspace, custom kernels)
    raise a plain ``RuntimeError("CUDA out of memory ...")`` / ``"CUBLAS_STATUS_ALLOC_FAILED"``.
    """
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text


def release_memory() -> None:
    """Return freed blocks to the driver after a failure, so the next task starts clean.

    ``gc.collect()`` first: tensors held by the failed frame's traceback are only freed
    once the cycle through the exception is broken; then ``empty_cache`` gives the
    allocator's unused segments back (celery#6009: memory "never freed" between tasks).
    """
    gc.collect()
    if _context_created:
        _torch().cuda.empty_cache()


def memory_stats() -> dict[str, int]:
    """Allocated/reserved/peak bytes of this child's allocator (zeros without a context)."""
    if not _context_created:
        return {"allocated_bytes": 0, "reserved_bytes": 0, "peak_allocated_bytes": 0}
    cuda = _torch().cuda
    return {"allocated_bytes": int(cuda.memory_allocated(0)),
            "reserved_bytes": int(cuda.memory_reserved(0)),
            "peak_allocated_bytes": int(cuda.max_memory_allocated(0))}


def reset_peak() -> None:
    if _context_created:
        _torch().cuda.reset_peak_memory_stats(0)


def free_bytes() -> int | None:
    """Device memory this child could still allocate; None without a context (a CPU
    child: not the limit).

    The driver's free memory plus the allocator's cached blocks, and under the class's
    cap (:func:`cap_memory`) no more than the cap less what is allocated: the allocator
    refuses to reserve past ``fraction x total``, cache reuse included, so on a large
    device the driver's figure alone would size a batch for memory the task may not take.
    """
    if not _context_created:
        return None
    cuda = _torch().cuda
    free, total = cuda.mem_get_info(0)
    allocated = int(cuda.memory_allocated(0))
    return allocatable(int(free), int(total), int(cuda.memory_reserved(0)), allocated,
                       _fraction)


def allocatable(free: int, total: int, reserved: int, allocated: int,
                fraction: float | None) -> int:
    """Bytes a caching allocator can still hand out (pure: :func:`free_bytes`'s sum)."""
    room = free + max(0, reserved - allocated)
    if fraction is not None:
        room = min(room, int(fraction * total) - allocated)
    return max(0, room)
