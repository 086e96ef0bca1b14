"""A task that tries to end its process fails instead (:class:`~sits_queue.errors.TaskExited`).

Celery's tracer re-raises a ``SystemExit`` or ``KeyboardInterrupt`` a task raises: in a
pool child it ends the child (its warm engines lost), and the message, redelivered,
ended a child at every run until the broker dead-lettered it as poison; in a solo pool it
stopped the worker. In a worker, either becomes the task's own failure. Celery's
shutdown (``WorkerShutdown``/``WorkerTerminate``, raised into a solo pool's running task
by the worker's signal handlers) goes through, and so does the ``SystemExit`` billiard's
terminate-signal handler raises in a pool child (``revoke(terminate=True)``, a cold
shutdown: converted, the child lived on and the revoked task failed as if it had exited
itself), and anything in an eager call: there the process is the caller's, and a Ctrl+C
is the caller's to have.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery.exceptions import WorkerShutdown, WorkerTerminate

from sits_queue.errors import TaskExited


@contextmanager
def fail_exits(task: Any, what: str | None = None) -> Iterator[None]:
    """Run ``task``'s body: a ``SystemExit``/``KeyboardInterrupt`` it raises in a worker
    is raised as :class:`TaskExited`, naming ``what`` ran (default: the task and its id;
    a batch's run is under its first call's request, and every call failed naming that
    one's id as its own)."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt) as exc:
        request = task.request
        if worker_exit(exc) or request.is_eager:
            raise
        code = f"({exc.code!r})" if isinstance(exc, SystemExit) else ""
        ran = what or f"task {task.name}[{request.id}]"
        raise TaskExited(f"{ran} tried to end its process: "
                         f"{type(exc).__name__}{code}; failed instead (a task may not "
                         "end its worker's process)") from exc


def worker_exit(exc: BaseException) -> bool:
    """Whether ``exc`` is the worker's own way out, not the code's it interrupted:
    Celery's shutdown (``WorkerShutdown``/``WorkerTerminate``), or the ``SystemExit``
    billiard's terminate-signal handler raised in this pool child. Either must go
    through whatever wraps a task's or a loader's exits."""
    return isinstance(exc, WorkerShutdown | WorkerTerminate) or (
        isinstance(exc, SystemExit) and _terminating())


def _terminating() -> bool:
    """Whether billiard's terminate-signal handler has run in this process: a
    ``SystemExit`` now is the pool's, not the task's."""
    from billiard import common

    fired = getattr(common, "terminate_handler_fired", None)
    if callable(fired):
        return bool(fired())
    flag = getattr(common, "_should_have_exited", None)  # (billiard before 4.3)
    return bool(flag and flag[0])
