"""The pool's routing-change counters: shared with the children across the fork."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from sits_queue.workers import routingversions


@pytest.fixture(autouse=True)
def counters() -> Iterator[None]:
    yield
    routingversions.forget()


def test_outside_a_worker_there_are_none_and_a_bump_is_nothing() -> None:
    routingversions.bump(0)
    assert routingversions.reading() is None


def test_each_slot_counts_its_own_and_a_slot_past_them_goes_uncounted() -> None:
    routingversions.create(2)
    routingversions.bump(1)
    routingversions.bump(1)
    routingversions.bump(-1)
    routingversions.bump(2 + routingversions.SPARE_SLOTS)
    counts = routingversions.reading()
    assert counts is not None and len(counts) == 2 + routingversions.SPARE_SLOTS
    assert counts[:2] == (0, 2) and sum(counts) == 2


def test_a_forked_childs_bump_is_read_by_the_main_process() -> None:
    """(made before the fork, as the worker's plan step makes them)"""
    routingversions.create(2)
    pid = os.fork()
    if pid == 0:
        try:
            routingversions.bump(1)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    counts = routingversions.reading()
    assert counts is not None and counts[:2] == (0, 1)
