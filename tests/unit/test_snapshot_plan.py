"""The rescoring pass's snapshot, from what Redis held (``rescore.plan_snapshot``): pure,
so each figure it stores is checked here against the readings it came from."""

from __future__ import annotations

import math
from typing import Any

import pytest

from sits_queue.priority import stats
from sits_queue.priority.rescore import (
    COMPLIANCE_HALF_LIFE_S,
    HOTNESS_DECAY,
    StatsReadings,
    plan_snapshot,
)

CLASSES = ("high", "low")
INTERVAL_S = 5.0
FRESH: dict[str, Any] = {"done": {}, "arrived": {}, "rates": {}, "at": math.nan}


def readings(**overrides: Any) -> StatsReadings:
    base: dict[str, Any] = {"latencies_ms": {}, "done": {}, "arrived": {}, "hot": {},
                            "hot_at": math.nan, "last": FRESH}
    return StatsReadings(**{**base, **overrides})


def test_each_class_gets_the_p95_and_jitter_of_its_latencies_oldest_first() -> None:
    # Given twenty latencies of the high class, 10..200 ms, and none of the low class
    got = plan_snapshot(readings(latencies_ms={"high": [10.0 * i for i in range(1, 21)]}),
                        100.0, CLASSES, INTERVAL_S)
    # Then high's p95 is the 19th of 20 (nearest rank), its jitter 10 ms; low has none
    assert got.snapshot.classes["high"].p95_ms == 190.0
    assert got.snapshot.classes["high"].jitter_ms == 10.0
    assert got.snapshot.classes["low"].p95_ms is None
    assert set(got.snapshot.classes) == set(CLASSES)


def test_compliance_compares_the_handled_and_arrived_counts_since_the_last_pass() -> None:
    # Given a last pass, one half-life ago, that had seen 10 high tasks arrive and handled
    last = {"done": {"high": 10.0}, "arrived": {"high": 10.0},
            "rates": {"done": {"high": 4.0}, "arrived": {"high": 4.0}},
            "at": 100.0 - COMPLIANCE_HALF_LIFE_S}
    # When 20 more arrived since and 10 more were handled
    got = plan_snapshot(readings(done={"high": 20.0}, arrived={"high": 30.0}, last=last),
                        100.0, CLASSES, INTERVAL_S)
    # Then the rates are the old ones halved plus the new counts: 12 handled of 22 arrived
    assert got.totals["rates"] == {"done": {"high": 12.0}, "arrived": {"high": 22.0}}
    assert got.snapshot.classes["high"].bandwidth_compliance == pytest.approx(12 / 22)
    # and an idle class complies fully
    assert got.snapshot.classes["low"].bandwidth_compliance == 1.0
    # And the next pass starts from these totals, at this pass's time
    assert got.totals["done"] == {"high": 20.0} and got.totals["arrived"] == {"high": 30.0}
    assert got.totals["at"] == 100.0


def test_hotness_is_relative_and_decays_by_time_as_an_increment() -> None:
    # Given two models' counts, decayed last two intervals ago
    hot = {"gpt": 10.0, "bert": 5.0}
    got = plan_snapshot(readings(hot=hot, hot_at=100.0 - 2 * INTERVAL_S), 100.0, CLASSES,
                        INTERVAL_S)
    # Then the snapshot ranks them against the hottest
    assert got.snapshot.hotness == {"gpt": 1.0, "bert": 0.5}
    # And each count is decayed by two intervals' worth, written as a change (calls the
    # workers count meanwhile are added on top, not overwritten)
    factor = HOTNESS_DECAY ** 2
    assert got.hot_changes == pytest.approx({m: c * (factor - 1) for m, c in hot.items()})
    assert got.faded == []


def test_a_model_whose_count_decays_under_the_floor_fades_out() -> None:
    got = plan_snapshot(readings(hot={"old": stats.MIN_COUNT, "new": 3.0}, hot_at=95.0),
                        100.0, CLASSES, INTERVAL_S)
    assert got.faded == ["old"]


def test_a_first_pass_with_nothing_recorded_is_a_neutral_snapshot() -> None:
    got = plan_snapshot(readings(), 100.0, CLASSES, INTERVAL_S)
    assert got.snapshot.hotness == {}
    assert all(c.bandwidth_compliance == 1.0 and c.p95_ms is None
               for c in got.snapshot.classes.values())
    assert got.hot_changes == {} and got.faded == []
