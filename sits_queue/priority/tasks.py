"""The maintenance tasks beat schedules. Thin: decode nothing, call one method, log."""

from __future__ import annotations

import threading
from dataclasses import asdict
from typing import Any

from celery import Celery
from celery.utils.nodenames import worker_direct

from sits_queue.broker import clock
from sits_queue.options import PREWARM_TASK
from sits_queue.priority.prewarm import Prewarmer
from sits_queue.priority.rescore import Rescorer
from sits_queue.workers import advertise

_local = threading.local()


def _rescorer(app: Celery) -> Rescorer:
    # One client per worker process (created after fork, never inherited).
    r: Rescorer | None = getattr(_local, "rescorer", None)
    if r is None:
        r = _local.rescorer = Rescorer(app.sits)
    return r


#: The least hard time limit of a maintenance task, s: it runs in the top class (first
#: in line), but a pass over a deep backlog takes its own time (1-2 s per 100k tasks,
#: measured), and a latency-critical top class's limit (1 s) killed every rescoring pass
#: over 200k tasks: the queue's tail was never aged.
MAINTENANCE_MIN_LIMIT_S = 120.0


def register(app: Celery) -> None:
    top = app.sits.top_class
    # (the task's own limit, the soft one its fraction: over the app's and the class's)
    limit = max(app.sits.time_limits(top)[1], MAINTENANCE_MIN_LIMIT_S)

    @app.task(name="sits.rescore", ignore_result=True, shared=False, sla_class=top,  # type: ignore[untyped-decorator]
              time_limit=limit)
    def rescore() -> dict[str, Any] | None:
        report = _rescorer(app).rescore_all(spaced=True)
        return None if report is None else asdict(report)

    @app.task(name="sits.check_triggers", ignore_result=True, shared=False,  # type: ignore[untyped-decorator]
              sla_class=top, time_limit=limit)
    def check_triggers() -> list[str]:
        return list(_rescorer(app).check_triggers())

    @app.task(name="sits.prewarm_plan", ignore_result=True, shared=False,  # type: ignore[untyped-decorator]
              sla_class=top, time_limit=limit)
    def prewarm_plan() -> dict[str, Any]:
        planner = prewarmer(app)
        return planner.run(clock.now(planner.client))

    @app.task(name="sits.site_sync", ignore_result=True, shared=False,  # type: ignore[untyped-decorator]
              sla_class=top, time_limit=limit)
    def site_sync() -> dict[str, Any] | None:
        from sits_queue.broker import sites

        sync = sites.for_config(app.sits)
        report = None if sync is None else sync.sync_pass_locked(app.backend)
        return None if report is None else asdict(report)


def prewarmer(app: Celery) -> Prewarmer:
    """The planner of ``app``: sends ``sits.prewarm`` to the chosen worker's own queue,
    in the top class (whose VRAM limit admits the largest engines), under
    ``prewarm_time_limit_s``."""
    def send(model: str, hostname: str) -> None:
        # (its own time limit: a load may take longer than the top class's max_run_s;
        # stale after an interval: the next pass plans afresh)
        app.tasks[PREWARM_TASK].apply_async((), model=model, queue=worker_direct(hostname),
                                            sla_class=top,
                                            time_limit=app.sits.prewarm_time_limit_s,
                                            expires=app.sits.prewarm_interval_s or None)

    top = app.sits.top_class
    return Prewarmer(app.sits, advertise.client_for(app.sits), send)
