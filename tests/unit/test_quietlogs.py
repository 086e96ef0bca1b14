"""SITS's housekeeping tasks at debug in Celery's logs (``quietlogs.py``); users' tasks,
and failures of any, as Celery logs them."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from sits_queue import quietlogs


@pytest.fixture
def trace() -> Iterator[logging.Logger]:
    quietlogs.install()
    quietlogs.install()  # (once: a second install adds nothing)
    logger = logging.getLogger("celery.app.trace")
    assert logger.filters.count(quietlogs._FILTER) == 1
    yield logger


def test_a_housekeeping_tasks_info_lines_go_at_debug(
        trace: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    context = {"id": "abc", "name": "sits.check_triggers", "runtime": 0.01,
               "return_value": {}}
    user = {**context, "name": "app.add"}
    with caplog.at_level(logging.INFO):
        trace.info("Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s",
                   context)
        trace.info("Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s", user)
        logging.getLogger("celery.beat").info("Scheduler: Sending due task %s (%s)",
                                              "sits-rescore", "sits.rescore")
        trace.error("Task %(name)s[%(id)s] raised unexpected: %(exc)s",
                    {**context, "exc": "boom"})
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [("INFO", "Task app.add[abc] succeeded in 0.01s: {}"),
                    ("ERROR", "Task sits.check_triggers[abc] raised unexpected: boom")]
    # --loglevel=DEBUG shows them, as debug lines
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("celery.beat").info("Scheduler: Sending due task %s (%s)",
                                              "sits-rescore", "sits.rescore")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("DEBUG", "Scheduler: Sending due task sits-rescore (sits.rescore)")]
