"""The benchmark workload generator and the ideal-schedule floor (pure, no services)."""

from __future__ import annotations

import pytest

from sits_queue.bench.workload import (
    CLASS_MIX,
    Completion,
    Job,
    Workload,
    ideal_priority_schedule,
    mixed_workload,
    summarise,
)

ORDER = ("high", "medium", "low")


def workload(slots: int, *jobs: tuple[str, float, float]) -> Workload:
    """Jobs as (class, arrival s, service ms)."""
    return Workload(seed=0, concurrency=slots, load_factor=1.0, jobs=tuple(
        Job(i, cls, arrival, service, 128) for i, (cls, arrival, service) in enumerate(jobs)))


def waits(done: list[Completion], cls: str) -> list[float]:
    return [round(c.wait_ms, 6) for c in sorted(done, key=lambda c: c.submitted_s)
            if c.sla_class == cls]


def test_a_high_task_waits_only_for_the_running_one() -> None:
    # One slot busy with a 100 ms low task; a low then a high arrive while it runs
    w = workload(1, ("low", 0.0, 100.0), ("low", 0.01, 50.0), ("high", 0.02, 10.0))
    done = ideal_priority_schedule(w, ORDER)
    # The high starts when the first low ends (80 ms after it arrived), ahead of the
    # earlier low, which then waits for both
    assert waits(done, "high") == [80.0]
    assert waits(done, "low") == [0.0, pytest.approx(100.0)]


def test_slots_idle_until_work_arrives_and_fifo_within_a_class() -> None:
    w = workload(2, ("medium", 1.0, 30.0), ("medium", 1.0, 30.0), ("medium", 1.0, 30.0),
                 ("medium", 5.0, 10.0))
    done = ideal_priority_schedule(w, ORDER)
    assert waits(done, "medium") == [0.0, 0.0, pytest.approx(30.0), 0.0]
    assert max(c.finished_s for c in done) == pytest.approx(5.01)


def test_ranking_a_class_first_shortens_its_waits_not_the_throughput() -> None:
    w = mixed_workload(seed=3, n_jobs=800, concurrency=4)
    first = summarise(ideal_priority_schedule(w, ORDER), ORDER)
    last = summarise(ideal_priority_schedule(w, ("low", "medium", "high")), ORDER)
    assert first["high"]["p99_wait_ms"] < last["high"]["p99_wait_ms"]  # type: ignore[index]
    assert first["low"]["p99_wait_ms"] > last["low"]["p99_wait_ms"]  # type: ignore[index]
    # Every job is served exactly once and no slot idles while work waits: the same
    # throughput whatever the order
    assert sum(first[c]["n"] for c in ORDER) == 800  # type: ignore[index]
    # (up to where the last few tasks land)
    assert first["throughput_tps"] == pytest.approx(last["throughput_tps"], rel=0.01)


def test_the_mix_matches_the_issue() -> None:
    assert dict((c, s) for c, s in CLASS_MIX) == {"high": 0.10, "medium": 0.20, "low": 0.70}
