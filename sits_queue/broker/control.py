"""Celery's remote-control commands where SITS differs.

``add_consumer``: Celery's own replies "ok" at once and declares the queue later, in the
worker's event loop (``Consumer.call_soon``), where the transport's refusal of the name
(``keys.check_queue_name``) would raise and stop the worker. This one checks the name
first and replies with the error instead; any other name goes to Celery's command.

``time_limit``: Celery's sets the limits on the worker's copy of the task, which the
limits every SITS message carries override; it replied "time limits set successfully"
and changed nothing. This one says so, and where limits are set.

``autoscale``: Celery's, up to the pool size the worker planned its devices, cores and
caches for at start (``--autoscale``'s maximum): more children would share the planned
slots' devices and memory budgets past what they hold. Asked for more, it sets that and
says so; ``pool_grow`` alike.

``enable_events`` and ``disable_events``: a worker sending task events from its start
(SITS turns them on: ``worker_send_task_events``) has no event groups, which means all
of them, and Celery's commands change a group list only where there is one:
``disable_events`` replied "task events already disabled" and the events went on (stock
Celery started with ``-E`` alike). These give such a worker the list it would have had
without them, ``worker``, and take ``task`` off it or put it back.

``conf`` and ``stats``: Celery's, with the credentials of every URL in them masked.
Celery masks its own settings' (``broker_url``, a backend's) but not
``redbeat_redis_url``, and sends the transport options whole: Flower's worker page
showed the Redis password.
"""

from __future__ import annotations

from typing import Any

from celery.worker import control as celery_control

from sits_queue.broker.keys import check_queue_name
from sits_queue.config import without_credentials
from sits_queue.errors import InvalidQueueName

_celery_add_consumer = celery_control.add_consumer
_celery_autoscale = celery_control.autoscale
_celery_pool_grow = celery_control.pool_grow
_celery_conf = celery_control.conf
_celery_stats = celery_control.stats


def add_consumer(state: Any, queue: Any, *args: Any, **options: Any) -> Any:
    """Tell worker(s) to consume from task queue by name."""
    try:
        check_queue_name(queue)
    except InvalidQueueName as exc:
        return celery_control.nok(str(exc))
    return _celery_add_consumer(state, queue, *args, **options)


def time_limit(state: Any, task_name: Any = None, hard: Any = None, soft: Any = None,
               **kwargs: Any) -> Any:
    """Tell worker(s) to modify the time limit for task by type."""
    return celery_control.nok(
        "SITS tasks carry their time limits on each message, set by the producer (the "
        "call's time_limit/soft_time_limit, the task's, the app's task_time_limit/"
        "task_soft_time_limit, then the class's max_run_s): a worker's limits for "
        f"{task_name!r} would change nothing")


def autoscale(state: Any, max: Any = None, min: Any = None) -> Any:
    """Modify autoscale settings."""
    return _autoscale(state, max, min)


def _autoscale(state: Any, most: Any, least: Any) -> Any:
    """``autoscale`` with both bounds capped to the planned pool: a minimum above the
    plan grew the pool past it as a maximum would; and a minimum above the maximum is
    refused (Celery took it, and grew to it)."""
    from sits_queue.workers import runtime

    planned = runtime.plan().slots
    asked = {"max": most, "min": least}
    if most is not None and least is not None and int(least) > int(most):
        return celery_control.nok(f"autoscale: min={least} is above max={most}")
    if planned > 0:
        most = None if most is None else min(int(most), planned)
        least = None if least is None else min(int(least), planned)
    reply = _celery_autoscale(state, most, least)
    capped = [f"{name}={value}" for name, value in asked.items()
              if value is not None and int(value) > planned > 0]
    if capped and isinstance(reply, dict) and "ok" in reply:
        reply = celery_control.ok(
            f"{reply['ok']} (asked {', '.join(capped)}: {_PLANNED.format(planned)}; "
            f"restart it with --autoscale={asked['max'] or asked['min']},... for more)")
    return reply


#: Why a pool does not grow past its plan, in a control command's reply.
_PLANNED = "this worker planned its devices, cores and caches for {} processes at start"


def pool_grow(state: Any, n: Any = 1, **kwargs: Any) -> Any:
    """Grow pool by n processes/threads."""
    from sits_queue.workers import runtime

    planned = runtime.plan().slots
    pool = state.consumer.pool
    if state.consumer.controller.autoscaler or planned <= 0:
        return _celery_pool_grow(state, n, **kwargs)
    room = planned - int(pool.num_processes)
    if room <= 0:
        return celery_control.nok(f"pool not grown: it runs {pool.num_processes} processes "
                                  f"and {_PLANNED.format(planned)} (more would share their "
                                  "devices and memory budgets); restart it with -c N for more")
    grown = _celery_pool_grow(state, min(int(n), room), **kwargs)
    if int(n) > room and isinstance(grown, dict) and "ok" in grown:
        grown = celery_control.ok(f"{grown['ok']} by {room} of the {n} asked "
                                  f"({_PLANNED.format(planned)})")
    return grown


#: The event groups of a worker that sends no task events (Celery's ``Events`` step).
_WITHOUT_TASK_EVENTS = ("worker",)


def enable_events(state: Any) -> Any:
    """Tell worker(s) to send task-related events."""
    dispatcher = state.consumer.event_dispatcher
    if dispatcher is None:
        return celery_control.nok("event dispatcher unavailable")
    if not dispatcher.groups or "task" in dispatcher.groups:  # (none: every group)
        return celery_control.ok("task events already enabled")
    dispatcher.groups.add("task")
    celery_control.logger.info("Events of group {task} enabled by remote.")
    return celery_control.ok("task events enabled")


def disable_events(state: Any) -> Any:
    """Tell worker(s) to stop sending task-related events."""
    dispatcher = state.consumer.event_dispatcher
    if dispatcher is None:
        return celery_control.nok("event dispatcher unavailable")
    if dispatcher.groups and "task" not in dispatcher.groups:
        return celery_control.ok("task events already disabled")
    # (a set of groups kept across reconnects: Celery's Events step reads it back)
    dispatcher.groups = (set(dispatcher.groups) or set(_WITHOUT_TASK_EVENTS)) - {"task"}
    celery_control.logger.info("Events of group {task} disabled by remote.")
    return celery_control.ok("task events disabled")


def conf(state: Any, with_defaults: bool = False, **kwargs: Any) -> Any:
    """List configuration."""
    return without_credentials(_celery_conf(state, with_defaults, **kwargs))


def stats(state: Any, **kwargs: Any) -> Any:
    """Request worker statistics/information."""
    return without_credentials(_celery_stats(state, **kwargs))


def register() -> None:
    """Put this module's commands in Celery's registry of control commands in place of
    Celery's own, with their arguments and help (the registry is process-wide;
    idempotent)."""
    for name, command in (("add_consumer", add_consumer), ("time_limit", time_limit),
                          ("autoscale", autoscale), ("pool_grow", pool_grow),
                          ("enable_events", enable_events),
                          ("disable_events", disable_events),
                          ("conf", conf), ("stats", stats)):
        meta = celery_control.Panel.meta[name]
        celery_control.Panel._register(name=name, **meta._asdict())(command)
