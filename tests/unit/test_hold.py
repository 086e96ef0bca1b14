"""``procs.Hold``: a held stream's arrival, as the benchmarks time it."""

from __future__ import annotations

import pytest

from sits_queue.bench.coldstart import arrived
from sits_queue.procs import Hold


def test_a_task_sent_in_the_hold_arrives_at_the_release_one_after_it_when_sent() -> None:
    hold = Hold(released_s=100.0)
    assert hold.arrived(90.0) == 100.0
    assert hold.arrived(100.5) == 100.5


def test_an_unreleased_hold_has_no_arrival_time() -> None:
    with pytest.raises(RuntimeError, match="not released"):
        Hold().arrived(1.0)


def test_records_keep_when_they_were_sent_and_are_timed_from_their_arrival() -> None:
    records = [{"i": 0, "sub": 90.0, "fin": 101.0}, {"i": 1, "sub": None, "error": "x"}]
    assert arrived(Hold(released_s=100.0), records) == [
        {"i": 0, "sub": 100.0, "sent": 90.0, "fin": 101.0}, {"i": 1, "sub": None, "error": "x"}]
