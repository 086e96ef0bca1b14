"""A worker process collects its garbage after tasks that did not succeed, rate-limited
(``workers/childgc.py``): a failed task's traceback cycles waited for a rare full
collection, and pool children grew 6-8 MB a minute in a soak."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
from celery import signals, states

from sits_queue.workers import childgc


@pytest.mark.parametrize(("state", "since", "collects"), [
    (states.FAILURE, 60.0, True), (states.RETRY, 60.0, True), (states.REJECTED, 60.0, True),
    (states.SUCCESS, 60.0, False), (None, 60.0, False),
    (states.FAILURE, childgc.MIN_INTERVAL_S / 2, False),  # one a moment ago: not again
])
def test_a_collection_follows_tasks_that_did_not_succeed_at_most_so_often(
        state: str | None, since: float, collects: bool) -> None:
    assert childgc.due(state, 1000.0, 1000.0 - since) is collects


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_a_failed_tasks_cycles_are_freed_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    childgc.connect()
    childgc.connect()  # (idempotent: one receiver)
    assert sum(1 for r in signals.task_postrun.receivers if "sits-child-gc" in str(r)) == 1
    monkeypatch.setattr(childgc, "_last", [-childgc.MIN_INTERVAL_S])
    # Given cyclic garbage, as a failed task's traceback leaves (a frame's cycle)
    gc.disable()
    try:
        try:
            raise ValueError("a failed task")
        except ValueError:
            info = sys.exc_info()
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        a.info = info  # type: ignore[attr-defined]  # (the traceback refers to this frame)
        alive = weakref.ref(a)
        del a, b, info
        assert alive() is not None  # a cycle: reference counting alone frees nothing
        # When a task's postrun says it failed, the cycle is collected
        signals.task_postrun.send(sender=None, task_id="t", task=None, state=states.FAILURE)
        assert alive() is None
    finally:
        gc.enable()
