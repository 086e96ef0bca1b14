"""The dispatch benchmark's statistics (pure)."""

from __future__ import annotations

import pytest

from sits_queue.bench.dispatch import (
    MIN_CPU_TASKS,
    burst_rate,
    cpu_per_task,
    ratios,
    summarise,
    table,
    targets,
)


def test_burst_rate_counts_intervals_between_first_and_last_result() -> None:
    assert burst_rate([10.0, 10.5, 11.0]) == pytest.approx(2.0)  # 2 intervals in 1 s
    assert burst_rate([3.0, 1.0, 2.0]) == pytest.approx(1.0)  # order does not matter
    assert burst_rate([5.0]) == 0.0 and burst_rate([]) == 0.0
    assert burst_rate([5.0, 5.0]) == 0.0  # no span to divide by


def figures(tps: float, cpu: float, p50: float) -> dict[str, float]:
    return {"tasks_per_s": tps, "cpu_ms_per_task": cpu, "parent_cpu_ms_per_task": cpu / 2,
            "child_cpu_ms_per_task": cpu / 2, "idle_p50_ms": p50, "idle_p99_ms": p50 * 2}


def test_summary_is_the_median_of_the_rounds() -> None:
    s = summarise([figures(100, 4, 8), figures(300, 2, 6), figures(200, 3, 7)])
    assert s["tasks_per_s"] == 200 and s["cpu_ms_per_task"] == 3 and s["idle_p50_ms"] == 7
    assert len(s["rounds"]) == 3


def test_ratios_and_targets() -> None:
    systems = {"sits": figures(500, 3, 6), "celery_guarantees": figures(250, 4, 8),
               "celery_default": figures(540, 3.5, 5)}
    r = ratios(systems)
    assert r["throughput_vs_same_guarantees"] == 2.0
    assert r["throughput_vs_stock_defaults"] == pytest.approx(0.926)
    assert r["cpu_per_task_vs_same_guarantees"] == 0.75
    assert r["idle_p50_vs_stock_defaults"] == 1.2
    assert targets(r) == {"throughput_vs_same_guarantees": True}
    slower = ratios({**systems, "sits": figures(240, 3, 6)})
    assert targets(slower) == {"throughput_vs_same_guarantees": False}
    nothing = ratios({**systems, "celery_guarantees": figures(0, 0, 0)})
    assert nothing["throughput_vs_same_guarantees"] is None
    assert targets(nothing)["throughput_vs_same_guarantees"] is False


def test_cpu_per_task_needs_enough_tasks_between_readings() -> None:
    parent, child = cpu_per_task((1.0, 2.0), (1.5, 2.25), 50)  # type: ignore[misc]
    assert parent == pytest.approx(10.0) and child == pytest.approx(5.0)
    # A burst over before the first poll: nothing ran between the readings, and a few
    # tasks are under psutil's clock tick; neither is reported as a figure (least of
    # all as 0 ms).
    assert cpu_per_task((1.0, 2.0), (1.0, 2.0), 0) is None
    assert cpu_per_task((1.0, 2.0), (1.01, 2.0), MIN_CPU_TASKS - 1) is None


def test_rounds_without_cpu_figures_are_left_out_of_the_median() -> None:
    unmeasured = {**figures(400, 0, 5), "cpu_ms_per_task": None,
                  "parent_cpu_ms_per_task": None, "child_cpu_ms_per_task": None}
    s = summarise([figures(100, 4, 8), unmeasured, figures(200, 2, 7)])
    assert s["cpu_ms_per_task"] == 3 and s["tasks_per_s"] == 200
    none = summarise([unmeasured])
    assert none["cpu_ms_per_task"] is None and none["tasks_per_s"] == 400
    systems = {"sits": none, "celery_guarantees": figures(250, 4, 8),
               "celery_default": figures(540, 3.5, 5)}
    r = ratios(systems)
    assert r["cpu_per_task_vs_same_guarantees"] is None
    assert r["throughput_vs_same_guarantees"] == 1.6
    text = table({"systems": systems, "ratios": r, "targets": targets(r)})
    assert text.splitlines()[1].split()[:3] == ["sits", "400.0", "-"]
