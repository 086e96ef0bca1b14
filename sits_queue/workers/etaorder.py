"""A task held for its ETA takes its turn in the queue once due, not the next free slot.

A worker picks a task with a countdown or an ETA before it is due (when nothing better
waits: its wait counts from when it falls due, so it ranks low meanwhile) and Celery
holds it in the worker's timer, out of the prefetch count. When it fell due Celery sent
it straight to the pool, so it took the next free slot ahead of whatever had come into
the queue meanwhile: a low-class task due while a one-slot worker was busy ran before a
high-class task waiting at the head of the queue (3 s of the high task's 5.4 s).

Here a due task that was picked before it was due goes back to its queue at its score,
uncounted and without a hold, and the pick order decides: a worker picks only for a
free slot, and then the best waiting task (the same worker with a slot free picks it
again at once, if nothing outranks it: two round trips more). A task picked when
already due runs at once, so it is never given back twice; one revoked or expired while
it waited is settled here, as the pool would have. Rate-limited tasks wait for their
token first (``ratelimits.py``); a resumed run (time slices) goes on as it was; one of
a queue the worker no longer consumes runs here, as Celery's would.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from sits_queue.workers.held import consumed, give_back_due, picked_early, resumed

logger = logging.getLogger(__name__)


class EtaOrder(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer step: a due ETA task held in the timer gives way to the queue's order."""

    name = "SITS ETA order"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        # Set now, before the Tasks step builds the strategies, which bind it.
        run = c.apply_eta_task

        def apply_eta_task(request: Any) -> Any:
            if (resumed(request) or not picked_early(request, c.app.timezone)
                    or not consumed(request)):
                return run(request)
            if give_back_due(c, request):
                logger.debug("task %s[%s] due: back to its queue, to take its turn",
                             request.name, request.id)
            return None

        c.apply_eta_task = apply_eta_task
