"""Whether this process's consumer may take new work now (the runtime profile's feedback,
``workers/profile.py``, pauses it while a resource runs short). Process-wide: one worker
per process; producers never pause), and when a batch a pick took has been delivered."""

from __future__ import annotations

from collections.abc import Callable

_reason: list[str] = []


def pause(reason: str | None) -> None:
    """Stop picking new messages (``reason``), or pick again (None)."""
    _reason[:] = [reason] if reason else []


def paused() -> str | None:
    """Why picking is paused, or None."""
    return _reason[0] if _reason else None


# -- batches: the worker's batch requests learn where a pick's batch begins and ends -----

BatchHook = Callable[[str, bool], None]
_batch_hooks: list[BatchHook] = []


def on_batch(hook: BatchHook | None) -> None:
    """The worker's main process registers what gathers and runs a delivered batch
    (``workers/batchmain.py``); None unregisters it."""
    _batch_hooks[:] = [hook] if hook is not None else []


def batch_delivery(group: str, done: bool) -> None:
    """Batch ``group``'s messages are about to go to the consumer (``done`` False), or
    all of them that will come have gone (True: a member may have been revoked, expired
    or rejected on the way)."""
    for hook in _batch_hooks:
        hook(group, done)


# -- deliveries the consumer raises on ----------------------------------------------------

_in_worker: list[bool] = []


def in_worker(yes: bool = True) -> None:
    """This process runs a Celery worker of a SITS app (``workers/runtime.py``): a message
    its consumer raises on is dead-lettered instead of stopping the worker's event loop.
    A plain kombu consumer's callback errors reach its caller, as with any transport."""
    _in_worker[:] = [True] if yes else []


def guards_deliveries() -> bool:
    return bool(_in_worker)
