"""A worker process collects its garbage after tasks that did not succeed, rate-limited
(``workers/childgc.py``): a failed task's traceback cycles waited for a rare full
collection, and pool children grew 6-8 MB a minute in a soak."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator

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


@pytest.fixture
def unfrozen(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process that froze nothing, and is left so (this one runs the other tests)."""
    monkeypatch.setattr(childgc, "_frozen_in", [0])
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_a_pool_child_freezes_its_start_up_and_what_it_imports_later(unfrozen: None) -> None:
    childgc.connect()
    for signal, receiver in ((signals.worker_process_init, "sits-gc-freeze-child"),
                             (signals.worker_before_create_process, "sits-gc-freeze-main")):
        assert sum(1 for r in signal.receivers if receiver in str(r)) == 1
    # When a pool child's start-up is done
    childgc._child_started()
    frozen = gc.get_freeze_count()
    # Then what it holds is frozen: no collection walks it
    assert frozen > 1000 and not gc.get_objects(generation=2)
    # And what a later large import makes is frozen with it
    imported = [[i] for i in range(5000)]
    childgc.settle()
    assert gc.get_freeze_count() >= frozen + 5000
    del imported


def test_settle_freezes_nothing_in_a_process_that_froze_no_start_up(unfrozen: None) -> None:
    # (a script that runs the runtime's torch code outside a worker: its objects must stay
    # collectable)
    childgc.settle()
    assert gc.get_freeze_count() == 0


def test_the_main_process_freezes_before_its_first_fork_only(unfrozen: None) -> None:
    childgc._before_first_fork()
    frozen = gc.get_freeze_count()
    assert frozen > 1000
    # (a replacement child, forked later, inherits that freeze: the main process's
    # requests in flight then are not frozen with it)
    in_flight = [[i] for i in range(5000)]
    childgc._before_first_fork()
    # (not ==: what was frozen is still freed by reference counting meanwhile)
    assert gc.get_freeze_count() <= frozen
    del in_flight


def test_what_a_child_froze_is_still_freed_by_reference_counting(unfrozen: None) -> None:
    node = _Node()
    alive = weakref.ref(node)
    childgc._child_started()
    assert gc.is_tracked(node) and gc.get_freeze_count()
    del node
    assert alive() is None
