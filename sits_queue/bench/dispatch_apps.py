"""The apps ``sitsq bench dispatch`` runs in its ``celery worker`` subprocesses.

Selected by environment (the worker imports this module with ``-A``):

* ``celery_default``: stock Celery with its defaults (prefetch 4 per process, the
  message acked when a task starts, no events, nothing tracked as STARTED); results in
  Redis, as for the others;
* ``celery_guarantees``: stock Celery set up to give what SITS gives by default: late
  acks with requeue on a lost worker (a task whose worker dies runs again), prefetch 1
  (no task held back behind a running one), task events (Flower) and STARTED tracked
  (extended results too until 2026-12-06, when SITS's default turned them off);
* ``sits``: a SITS app with its defaults.

All three run the same no-op task, so what differs is the per-task cost of getting a
task to a pool child and its result back.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from sits_queue.app import make_app
from sits_queue.config import SitsConfig

SYSTEMS = ("celery_default", "celery_guarantees", "sits")
TASK = "bench.dispatch.noop"
ENV_SYSTEM = "SITS_DISPATCH_SYSTEM"
ENV_URL = "SITS_DISPATCH_REDIS_URL"
#: Stock Celery settings that give SITS's defaults (``sits_queue.app.celery_settings``).
GUARANTEES: dict[str, Any] = {
    "task_acks_late": True, "task_reject_on_worker_lost": True,
    "worker_prefetch_multiplier": 1, "task_track_started": True,
    "worker_send_task_events": True,
}


def build(system: str, url: str) -> Celery:
    """The app of ``system`` on database ``url``."""
    app: Celery
    if system == "sits":
        app = make_app(SitsConfig(redis_url=url), main="bench_dispatch_sits")
    elif system in ("celery_default", "celery_guarantees"):
        app = Celery(f"bench_dispatch_{system}", broker=url, backend=url)
        if system == "celery_guarantees":
            app.conf.update(GUARANTEES)
    else:
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")

    @app.task(name=TASK, shared=False)  # type: ignore[untyped-decorator]
    def noop(i: int) -> int:
        return i

    return app


_system = os.environ.get(ENV_SYSTEM)
if _system:
    app = build(_system, os.environ[ENV_URL])
