"""The worker step that plans the pool before it forks: refuses a pool that runs tasks
side by side in one process (``runtime.pool_problem``), a queue name no SITS queue can
have and a bad cache budget, each in one line, and records the pool's size (after
``-c``, ``auto`` or ``--autoscale``) for the children's slots."""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any

from celery import bootsteps

from sits_queue.broker.keys import check_queue_name
from sits_queue.cache.budgets import CacheBudgets
from sits_queue.errors import ConfigError, InvalidQueueName
from sits_queue.workers import request as admission
from sits_queue.workers import routingversions
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
        routingversions.create(size)  # (shared with the children: made before the fork)
        _say_unused_limits(w)
        if sits_config(w.app).preimport and not (problem or plain_only):
            preimport(w.app)


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


#: What a model load imports, ahead of the fork. transformers' ``modeling_utils`` is the
#: bulk of a Hugging Face load's imports (an architecture's own module is small beside it).
PREIMPORTS = ("torch", "transformers", "transformers.modeling_utils",
              "transformers.models.auto.modeling_auto",
              "transformers.models.auto.tokenization_auto")


def preimport(app: Any) -> list[str]:
    """Import the inference stack in the worker's parent, before its pool forks, when the
    app serves models (``SitsConfig.preimport``); the modules imported.

    Each child, the first and a replacement after a hard-limit kill or a crash, then
    starts with them (the pages shared copy-on-write): a child's first load of a tiny
    model took 4.6-5.4 s, nearly all imports, and takes 0.2-0.3 s. Nothing here touches
    CUDA or starts torch's thread pools: the context and the threads stay each child's.
    A module that is not installed is skipped; one that fails to import is said and left
    for the child, whose model load then fails with the reason."""
    if not len(getattr(app, "models", ())):
        return []
    start = time.perf_counter()
    done = []
    for name in PREIMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        except Exception as exc:  # a broken install: the child's load says it again
            logger.warning("importing %s ahead of the pool failed (%s: %s); each child "
                           "tries again as it loads a model", name, type(exc).__name__, exc)
            continue
        done.append(name)
    if done:
        logger.info("imported %s before the pool forks (%.1f s): each child starts with "
                    "them", ", ".join(done), time.perf_counter() - start)
    return done


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
