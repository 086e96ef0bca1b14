"""``worker_app`` under an app that names its own default queue, as a Celery app may
(``app.conf.task_default_queue``): ``test_worker.py`` checks that its worker consumes it."""

from __future__ import annotations

from tests.integration.worker_app import app, tasks

#: The app's default queue.
QUEUE = "mine"
app.conf.task_default_queue = QUEUE

__all__ = ["app", "tasks"]
