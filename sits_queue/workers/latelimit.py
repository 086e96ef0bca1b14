"""A hard time limit that fires late does not kill a child that has already finished.

Celery's prefork pool arms each task's hard limit on the parent's event loop and, when
it fires, kills the child if the task's result has not been read (``AsynPool.
_on_hard_timeout``). A parent whose loop was blocked past the limit (a Redis outage
holding its main thread, the host swapping, a ``SIGSTOP``) runs the overdue timer
before it reads the pipes, so a child that finished in time and wrote its result
meanwhile was killed as it sat idle, with its warm engines and a ~120-line
``TimeLimitExceeded`` traceback per task (a probe: "succeeded in 22.05s", then "Hard
time limit (10.0s) exceeded" for the same task). So a hard limit that finds its child's
result pipe readable waits one short turn for the loop to read it; a task still
running then is killed as before, :data:`GRACE_S` later.
"""

from __future__ import annotations

import logging
import select
from typing import Any

from sits_queue.workers.reap import ReapStep

logger = logging.getLogger(__name__)

#: How long a hard limit waits when its child's result pipe holds something unread, s:
#: the loop reads it within one turn.
GRACE_S = 0.25


def _pipe_readable(pool: Any, result: Any) -> bool:
    """Whether the pipe ``result``'s child writes its outcome to holds something unread
    (False where that cannot be told)."""
    try:
        proc, _ = pool._process_by_pid(getattr(result, "_worker_pid", None))
        readable, _, _ = select.select([proc.outq._reader.fileno()], [], [], 0)
    except (AttributeError, OSError, ValueError):
        return False
    return bool(readable)


def install(pool: Any) -> bool:
    """Make ``pool`` (a billiard ``AsynPool``, before it registers with the event loop)
    read a child's pending outcome before its overdue hard limit kills it; False for a
    pool without the parts this needs (left as it is)."""
    fire = getattr(pool, "_on_hard_timeout", None)
    register = getattr(pool, "register_with_event_loop", None)
    cache = getattr(pool, "_cache", None)
    if fire is None or register is None or cache is None:
        return False
    hubs: list[Any] = []

    def register_with_event_loop(hub: Any) -> Any:
        hubs[:] = [hub]
        return register(hub)

    def on_hard_timeout(job: Any, looked: bool = False) -> None:
        result = cache.get(job)
        if result is not None and not looked and hubs and _pipe_readable(pool, result):
            logger.debug("hard time limit of job %r: its child's pipe holds an unread "
                         "outcome; read first", job)
            hubs[0].call_later(GRACE_S, on_hard_timeout, job, True)
            return
        fire(job)

    pool.register_with_event_loop = register_with_event_loop
    pool._on_hard_timeout = on_hard_timeout
    return True


class LateLimitStep(ReapStep):
    """Worker step: :func:`install` on the prefork pool, as ``reap.ReapStep`` installs
    its own."""

    name = "SITS late hard limits"
    patch = staticmethod(install)
