"""Celery's ``add_consumer`` remote-control command, refusing a queue name this broker
cannot use.

Celery's own command replies "ok" at once and declares the queue later, in the worker's
event loop (``Consumer.call_soon``), where the transport's refusal of the name
(``keys.check_queue_name``) would raise and stop the worker. This one checks the name
first and replies with the error instead; any other name goes to Celery's command.
"""

from __future__ import annotations

from typing import Any

from celery.worker import control as celery_control

from sits_queue.broker.keys import check_queue_name
from sits_queue.errors import InvalidQueueName

_celery_add_consumer = celery_control.add_consumer


def add_consumer(state: Any, queue: Any, *args: Any, **options: Any) -> Any:
    """Tell worker(s) to consume from task queue by name."""
    try:
        check_queue_name(queue)
    except InvalidQueueName as exc:
        return celery_control.nok(str(exc))
    return _celery_add_consumer(state, queue, *args, **options)


def register() -> None:
    """Put :func:`add_consumer` in Celery's registry of control commands in place of
    Celery's own, with its arguments and help (the registry is process-wide; idempotent)."""
    meta = celery_control.Panel.meta["add_consumer"]
    celery_control.Panel._register(name="add_consumer", **meta._asdict())(add_consumer)
