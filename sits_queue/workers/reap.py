"""Reap a pool child whose exit its sentinel announced before the child could be reaped.

Celery's prefork pool (``AsynPool``) learns that a child died when the child's sentinel
pipe reads EOF (``_event_process_exit``): it stops watching the sentinel, then runs
``maintain_pool``, whose ``waitpid(WNOHANG)`` reaps the child, fails its task
(``WorkerLostError``: requeued under ``task_reject_on_worker_lost``) and forks its
replacement. But a dying process closes its files (the sentinel's write end among
them) before it becomes a zombie, and the parent, woken by the EOF, often runs first
(on the same core it preempts the exiting child): the child is not reapable yet,
``maintain_pool`` finds nothing, and with its sentinel no longer watched nothing looks
again until the pool's 5 s ``maintain_pool`` timer. Measured on 2 cores (a task that
SIGKILLs its own child, -c 1): 2 in 3 deaths were seen 2.4-5 s late, the slot idle and
the task's redelivery waiting meanwhile; stock Celery 5.7 alike.

So a sentinel that fired for a child still in the pool is followed by short retries of
``maintain_pool`` (1 ms, doubling, for about a second; the 5 s timer after that).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

logger = logging.getLogger(__name__)

#: The first look again after a sentinel fired for a child not yet reapable, s; each
#: next one waits twice as long, up to :data:`LAST_RETRY_S`.
FIRST_RETRY_S = 0.001
LAST_RETRY_S = 0.512


def install(pool: Any) -> bool:
    """Make ``pool`` (a billiard ``AsynPool``, before it registers with the event loop)
    retry ``maintain_pool`` until a child whose sentinel fired is reaped; False for a
    pool without the parts this needs (left as it is)."""
    exited = getattr(pool, "_event_process_exit", None)
    if exited is None or not hasattr(pool, "maintain_pool") or not hasattr(pool, "_pool"):
        return False

    def unreaped(proc: Any) -> bool:
        return any(p is proc for p in pool._pool)

    def again(hub: Any, proc: Any, delay_s: float) -> None:
        if not unreaped(proc):
            return
        pool.maintain_pool()
        if unreaped(proc) and delay_s < LAST_RETRY_S:
            hub.call_later(delay_s * 2, again, hub, proc, delay_s * 2)

    def event_process_exit(hub: Any, proc: Any) -> None:
        exited(hub, proc)
        if unreaped(proc):  # (its sentinel is no longer watched: look again soon)
            if getattr(proc, "_sentinel_poll", 0) is None:
                # (Celery left None there: the pool registered again meanwhile, on a
                # reconnect, watched fd None and the consumer could not restart; gone,
                # the popen's sentinel is watched again, and fires at once)
                del proc._sentinel_poll
            hub.call_later(FIRST_RETRY_S, again, hub, proc, FIRST_RETRY_S)

    pool._event_process_exit = event_process_exit
    return True


class ReapStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker step: :func:`install` on the prefork pool (after it starts, before the
    consumer registers it with the event loop). A step that patches the pool likewise
    subclasses it with its own ``patch``."""

    requires = ("celery.worker.components:Pool",)
    name = "SITS pool child reaping"
    #: Patches the pool (billiard's ``AsynPool``); False for one it leaves as it is.
    patch = staticmethod(install)

    def start(self, w: Any) -> None:
        if not self.patch(getattr(w.pool, "_pool", None)):
            logger.debug("pool %r: %s not installed (not Celery's prefork pool)", w.pool,
                         self.name)
