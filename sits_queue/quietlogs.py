"""SITS's own housekeeping at debug level in Celery's logs: the beat sends a trigger
check every second and a rescoring pass every five, and Celery logged each one's
sending (the beat), receipt and success (the worker) at info: ~3 lines a second, ~50 MB
a day of a worker's and its beat's logs with nothing running, between which a user's
own tasks were hard to find. Their failures, and anything above info, are logged as
before; ``--loglevel=DEBUG`` shows them all."""

from __future__ import annotations

import logging

from sits_queue.options import MAINTENANCE_TASKS

#: Celery's loggers of a task's sending (beat), receipt (worker) and success (pool).
LOGGERS = ("celery.beat", "celery.worker.strategy", "celery.app.trace")
#: How each of those lines names a maintenance task: ``name[id]``, ``(name)``.
_MARKS = tuple(mark for task in MAINTENANCE_TASKS for mark in (f"{task}[", f"({task})"))


class QuietMaintenance(logging.Filter):
    """A logger's filter: its info records about a maintenance task go at debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        try:
            message = record.getMessage()
        except Exception:  # (a record that does not format: not ours to judge)
            return True
        if not any(mark in message for mark in _MARKS):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


_FILTER = QuietMaintenance()


def install() -> None:
    """Add the filter to Celery's loggers (once; a forked pool child inherits it)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
