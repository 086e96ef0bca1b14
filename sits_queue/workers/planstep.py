"""The worker step that plans the pool before it forks: refuses a pool that runs tasks
side by side in one process (``runtime.pool_problem``), a queue name no SITS queue can
have and a bad cache budget, each in one line, and records the pool's size (after
``-c``, ``auto`` or ``--autoscale``) for the children's slots."""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from sits_queue.broker.keys import check_queue_name
from sits_queue.cache.budgets import CacheBudgets
from sits_queue.errors import ConfigError, InvalidQueueName
from sits_queue.workers import request as admission
from sits_queue.workers.runtime import pool_name, pool_problem, record_slots

logger = logging.getLogger(__name__)


class PlanStep(bootsteps.Step):  # type: ignore[misc]
    """Worker step: refuses a pool that runs tasks side by side in one process (see
    :func:`pool_problem`) and records the final pool size (after ``-c`` / ``auto``)
    before forking."""

    name = "SITS worker plan"

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        from sits_queue.app import sits_config

        pool_module = getattr(w.pool_cls, "__module__", str(w.pool_cls))
        # With --autoscale the pool grows to its maximum: its slots (cores, memory
        # budgets) are that many (it recorded its starting size: each child then took a
        # whole host's share, and the grown ones shared cores)
        size = max(int(w.concurrency), autoscale_max(
            kwargs.get("autoscale") or getattr(w, "autoscale", None)))
        if pool_name(pool_module) == "solo":
            # One process, one slot, whatever -c or worker_concurrency say (Celery's
            # solo pool ignores them): it was confined to 1/N of the cores and budgets,
            # and on a GPU host, where the default concurrency is the GPUs, to 1/8 on 8
            size = 1
        problem = pool_problem(pool_module, size)
        plain_only = sits_config(w.app).plain_tasks_only
        # Here the worker stops before any task, in one line, as a bad setting does at
        # import (ImproperlyConfigured printed some 45 lines of traceback above it)
        if problem and not plain_only:
            raise SystemExit(f"Error: {problem}")
        try:  # read again by each pool child: a bad value must stop the worker here
            CacheBudgets.from_env()
        except ConfigError as exc:
            raise SystemExit(f"Error: {exc}") from None
        queues = w.app.amqp.queues
        for name in (queues.consume_from or queues):
            try:  # (a name no SITS queue can have stopped the consumer on a traceback)
                check_queue_name(name)
            except InvalidQueueName as exc:
                raise SystemExit(f"Error: {exc}: rename it (-Q, or the app's task_queues "
                                 "/ task_default_queue)") from None
        # Tasks share this process: none of them gets the per-task runtime, and an
        # inference task is left for another worker (workers/request.py). So on any pool
        # of a worker of plain tasks only (on prefork it ran them: the setting read as a
        # licence for shared pools alone)
        admission.leave_inference(pool_name(pool_module) if problem or plain_only else None,
                                  shared=bool(problem))
        record_slots(size)
        _say_unused_limits(w)


def _say_unused_limits(w: Any) -> None:
    """A worker's own ``--time-limit``/``--soft-time-limit`` apply to no SITS task (each
    message carries its limits): said once at start, not ignored unsaid."""
    for flag, setting in (("time_limit", "task_time_limit"),
                          ("soft_time_limit", "task_soft_time_limit")):
        given = getattr(w, flag, None)
        if given and given != w.app.conf.get(setting):
            logger.warning("--%s=%s applies to no SITS task: each message carries its own "
                           "limits (the call's, the task's, the app's %s, else its "
                           "class's max_run_s); set those instead", flag.replace("_", "-"),
                           given, setting)


def autoscale_max(autoscale: Any) -> int:
    """The most pool processes ``--autoscale`` asks for ("max,min", or Celery's parsed
    [max, min]); 0 without it."""
    if isinstance(autoscale, str):
        autoscale = autoscale.partition(",")[0]
    elif isinstance(autoscale, list | tuple):
        autoscale = autoscale[0] if autoscale else 0
    try:
        return max(0, int(autoscale or 0))
    except (TypeError, ValueError):
        return 0  # (Celery refuses it itself)
