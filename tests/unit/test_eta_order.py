"""When a task held for its ETA was picked early (``workers/etaorder.py``)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from sits_queue.workers.held import consumed, due_at, picked_early


def request(eta: Any, picked_at: Any, utc: bool = True) -> Any:
    return SimpleNamespace(eta=eta, utc=utc, message=SimpleNamespace(picked_at=picked_at))


def test_the_due_time_is_on_the_timers_monotonic_clock() -> None:
    eta = datetime.now(UTC) + timedelta(seconds=30)
    assert due_at(request(eta, None), "UTC") == pytest.approx(time.monotonic() + 30, abs=1)
    assert due_at(request(None, None), "UTC") is None
    assert due_at(request("not a date", None), "UTC") is None


@pytest.mark.parametrize(("ahead_s", "picked_ago_s", "early"), [
    (10, 0, True),     # picked now, due in 10 s: held in the timer
    (-10, 0, False),   # picked after it was due: runs at once, never given back
    (-10, 20, True),   # picked 20 s ago, due 10 s ago: it waited in the timer
])
def test_picked_early(ahead_s: float, picked_ago_s: float, early: bool) -> None:
    eta = datetime.now(UTC) + timedelta(seconds=ahead_s)
    assert picked_early(request(eta, time.monotonic() - picked_ago_s), "UTC") is early


@pytest.mark.parametrize("picked_at", [None, "soon", 3])
def test_a_message_of_another_transport_is_never_early(picked_at: Any) -> None:
    eta = datetime.now(UTC) + timedelta(seconds=10)
    assert picked_early(request(eta, picked_at), "UTC") is False


@pytest.mark.parametrize(("queue", "active", "expected"), [
    ("a", ["a", "b"], True),
    ("a", ["b"], False),   # cancel_consumer("a"): it runs here, as Celery's would
    (None, ["b"], True),   # a message of another transport: the default path
])
def test_a_held_task_whose_queue_is_no_longer_consumed_is_not_given_back(
        queue: Any, active: list[str], expected: bool) -> None:
    message = SimpleNamespace(delivery_info={"sits_queue": queue} if queue else {},
                              channel=SimpleNamespace(active_queues=active))
    assert consumed(SimpleNamespace(message=message)) is expected
    assert consumed(SimpleNamespace(message=None)) is True
