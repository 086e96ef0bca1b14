"""A task whose message the broker dead-letters gets a FAILURE result saying why.

``pick.lua`` parks a poison message (redelivered more than ``max_redeliveries`` times:
it kept killing the workers that ran it) in its queue's dead letters, inspectable, and
never runs it again. Without a result its caller's ``get()`` would wait for ever; here
the task's result becomes a FAILURE with a :class:`~sits_queue.errors.DeadLettered`
naming the reason, stored through the app's own result backend (whatever it is: the
transport cannot know, so ``current_app``'s, the worker's own app in a worker), which
never overwrites a stored SUCCESS (``store_result.lua``).

Best effort, as the dead-lettering itself is what matters: a record that does not read,
or a backend that cannot store, is logged and left.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from sits_queue.errors import DeadLettered

logger = logging.getLogger(__name__)


def task_of(record: bytes | str) -> tuple[str, str, str] | None:
    """(task id, task name, reason) of a dead-letter record; None if its message has no
    task id."""
    try:
        parsed = json.loads(record)
        headers = json.loads(parsed["payload"])["headers"]
        task_id, name = headers["id"], headers.get("task", "?")
        reason = str(parsed.get("reason", "dead-lettered"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return (task_id, str(name), reason) if isinstance(task_id, str) and task_id else None


def fail_tasks(client: Any, dead_key: str, ids: Sequence[str], backend: Any = None) -> int:
    """Store FAILURE for the tasks of dead-lettered messages ``ids``; how many were."""
    if backend is None:
        from celery import current_app

        backend = current_app.backend
    failed = 0
    for message_id, record in zip(ids, client.hmget(dead_key, list(ids)), strict=True):
        task = task_of(record) if record is not None else None
        if task is None:
            continue
        task_id, name, reason = task
        try:
            backend.mark_as_failure(task_id, DeadLettered(
                f"task {name}[{task_id}] was not run: its message was dead-lettered "
                f"({reason}); it stays in the queue's dead letters as {message_id}"))
        except Exception as exc:  # a disabled or unreachable backend: the record remains
            logger.warning("dead-lettered task %s[%s]: could not store its failure: %s",
                           name, task_id, exc)
            continue
        failed += 1
    return failed
