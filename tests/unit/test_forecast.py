"""Predictive pre-warming, pure: the RLS demand forecast, its confidence, and the plan."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from sits_queue.config import SitsConfig
from sits_queue.errors import ConfigError
from sits_queue.priority import forecast as fc
from sits_queue.priority.forecast import Forecaster, ModelOutlook, Prewarm, WorkerView, plan

DAY = 86_400
T0 = 1_700_006_400 - (1_700_006_400 % DAY)  # a midnight, UTC
STEP = 300


def daily(t: float) -> float:
    return 50 + 40 * math.sin(2 * math.pi * (t % DAY) / DAY)


def learn(days: float, noise: float = 3.0, seed: int = 1) -> tuple[Forecaster, list[float]]:
    """Feed ``days`` of a daily pattern; the absolute one-step errors of the last day."""
    rng, f, errors = random.Random(seed), Forecaster(), []
    steps = int(days * DAY / STEP)
    for k in range(steps):
        t = T0 + k * STEP
        demand = max(0.0, daily(t) + rng.gauss(0, noise))
        if k >= steps - DAY // STEP:
            errors.append(abs(f.predict(t) - demand))
        f = fc.update(f, t, demand)
    return f, errors


def test_rls_learns_a_daily_pattern_and_trusts_itself() -> None:
    f, errors = learn(2)
    assert sum(errors) / len(errors) < 2 * 3.0  # within twice the noise
    assert f.confidence >= fc.MIN_CONFIDENCE
    assert f.updates == 2 * DAY // STEP


def test_a_forecast_stays_right_after_ten_days() -> None:
    # (rounding left the covariance a little asymmetric, and dividing by the forgetting
    # factor grew that 2% an interval: after a week the forecast diverged, and was no
    # longer trusted, so pre-warming stopped)
    f, errors = learn(10)
    assert sum(errors) / len(errors) < 2 * 3.0
    assert f.confidence >= fc.MIN_CONFIDENCE
    p = f.covariance
    assert all(p[i][j] == p[j][i] for i in range(fc.N_FEATURES) for j in range(fc.N_FEATURES))


def test_a_steady_demand_keeps_the_covariance_bounded_and_a_step_is_followed() -> None:
    # Given exactly steady demand (a cron job): the bias and both lags are one direction,
    # along which forgetting inflated the covariance without bound (NaN after 122 days;
    # the forecast then said 0 for good)
    f = Forecaster()
    steps = 5_000
    for k in range(steps):
        f = fc.update(f, T0 + k * STEP, 100.0)
    trace = sum(f.covariance[i][i] for i in range(fc.N_FEATURES))
    assert math.isfinite(trace) and trace <= fc.MAX_TRACE * (1 + 1e-9)
    assert f.predict(T0 + steps * STEP) == pytest.approx(100.0, rel=0.01)
    # When the level steps up, the forecast follows it without overshooting wildly
    for k in range(steps, steps + 12):
        f = fc.update(f, T0 + k * STEP, 150.0)
    assert 140.0 <= f.predict(T0 + (steps + 12) * STEP) <= 165.0


def test_confidence_needs_history_and_a_forecast_that_was_right() -> None:
    assert Forecaster().confidence == 0.0 and Forecaster().predict(T0) == 0.0
    f = fc.update(fc.update(Forecaster(), T0, 10.0), T0 + STEP, 10.0)
    assert f.confidence == 0.0  # two intervals are not a track record
    rng, noisy = random.Random(3), Forecaster()
    for k in range(300):  # demand that no feature explains
        noisy = fc.update(noisy, T0 + k * STEP, rng.expovariate(1 / 30.0))
    assert noisy.confidence < fc.MIN_CONFIDENCE


def test_a_steady_demand_is_trusted_within_a_few_intervals_not_hours() -> None:
    # the first interval has no forecast to miss: its demand is not an error that the
    # forgetting factor then takes ~170 intervals (14 h) to wash out
    f, trusted_at = Forecaster(), None
    for k in range(200):
        f = fc.update(f, T0 + k * STEP, 100.0)
        if trusted_at is None and f.confidence >= fc.MIN_CONFIDENCE:
            trusted_at = k + 1
    assert trusted_at is not None and trusted_at <= 5
    # a forecast that then goes badly wrong loses that trust as fast
    for k in range(200, 206):
        f = fc.update(f, T0 + k * STEP, 0.0 if k % 2 else 300.0)
    assert f.confidence < fc.MIN_CONFIDENCE


def test_forgetting_follows_a_change_of_level() -> None:
    f = Forecaster()
    for k in range(200):
        f = fc.update(f, T0 + k * STEP, 10.0 if k < 100 else 60.0)
    assert f.predict(T0 + 200 * STEP) == pytest.approx(60.0, rel=0.1)


def outlook(cold_ms: float = 2000.0, warm_now: int = 0, days: float = 2.0,
            service_ms: float = 9000.0) -> ModelOutlook:
    f, _ = learn(days)
    return fc.outlook("m", f, T0 + 2 * DAY + DAY / 4, STEP, service_ms, cold_ms, warm_now)


def test_outlook_follows_the_sources_rule() -> None:
    o = outlook()
    # ~90 tasks x 9 s / 300 s = ~2.7 busy instances -> ceil(x 1.3) warm ones wanted
    assert o.concurrency == pytest.approx(o.predicted * 9.0 / STEP, rel=1e-3)
    assert o.instances == math.ceil(o.concurrency * fc.HEADROOM) and o.instances >= 3
    assert o.reason == "pre-warm"
    assert "not worth it" in outlook(cold_ms=850.0).reason  # 850 ms exactly is not above
    assert "confidence" in outlook(days=0.01).reason
    assert "warm" in outlook(warm_now=10).reason


def test_plan_fills_the_gap_on_the_roomiest_workers_without_the_model() -> None:
    workers = [WorkerView("a", {"m": 1}, 10), WorkerView("b", {}, 50),
               WorkerView("c", {}, 70), WorkerView("d", {"x": 1}, 60)]
    need = ModelOutlook("m", 90, 0.9, 2.0, 2000, 3, 1, "pre-warm")
    other = ModelOutlook("x", 90, 0.9, 1.0, 2000, 2, 1, "pre-warm")
    skip = ModelOutlook("y", 90, 0.5, 1.0, 2000, 2, 0, "confidence 0.50 < 0.82")
    got = fc.plan([need, other, skip], workers)
    # m lacks 2 (c and d: most free memory, without m); x lacks 1, and b is left for it
    assert [(p.model, p.hostname) for p in got] == [("m", "c"), ("m", "d"), ("x", "b")]


def test_each_child_of_a_steered_worker_is_an_instance() -> None:
    """(a worker of four GPU children holding a model in one counted as one warm
    instance, and was sent one pre-warm a round at most, which its pool handed to any
    child: the forecast's instances never came on a single host)"""
    from sits_queue.priority.prewarm import _view

    record = {"hostname": "big", "steered": True, "slots": [0, 1, 2, 3],
              "devices": [{"free_vram_bytes": 40 * 2**30}],
              "children": {"0": {"warm": {"gpt": "device"}}, "1": {"warm": {"gpt": "host"}},
                           "2": {"warm": {"gpt@bf16": "device"}}, "3": {"warm": {}}}}
    big = _view(record)
    assert (big.slots, big.instances("gpt"), big.room("gpt"), big.room("t5")) == (4, 2, 2, 4)
    # a pool that is not steered (or an older worker's record): one instance at most
    plain = _view({**record, "steered": False})
    assert (plain.slots, plain.instances("gpt"), plain.room("gpt"), plain.room("t5")) \
        == (1, 2, 0, 1)
    small = WorkerView("small", {}, 2**30, slots=2)
    # gpt wants 5 and has 2: three more, taken a worker at a time (roomiest first); t5
    # wants 4, and what is left this round is one child of "big" (a pre-warm per child)
    gpt = ModelOutlook("gpt", 90, 0.9, 3.5, 2000, 5, 2, "pre-warm")
    t5 = ModelOutlook("t5", 90, 0.9, 3.0, 2000, 4, 0, "pre-warm")
    got = fc.plan([gpt, t5], [small, big])
    assert [(p.model, p.hostname) for p in got] == [
        ("t5", "big"), ("t5", "small"), ("t5", "big"), ("t5", "small"),
        ("gpt", "big"), ("gpt", "big")]
    assert fc.plan([gpt], [small, big]) == [fc.Prewarm("gpt", h) for h in ("big", "small",
                                                                          "big")]
    # two sent to one worker that holds the model in neither: one miss, not two
    sent = [fc.Prewarm("t5", "big"), fc.Prewarm("t5", "big")]
    assert fc.missed(sent, [big], {}, now_s=0.0, interval_s=300.0) == {"t5": (1, 300.0)}


def test_a_model_whose_pre_warms_miss_is_held_off_longer_each_time() -> None:
    """(a model that failed to load took the worker's one pre-warm a round at every
    pass, first by name: the models behind it were never pre-warmed)"""
    flaky = ModelOutlook("flaky", 90, 0.9, 1.0, 2000, 1, 0, "pre-warm")
    slow = ModelOutlook("slow", 90, 0.9, 1.0, 2000, 1, 0, "pre-warm")
    idle = [WorkerView("w", {}, 10)]
    first = fc.plan([flaky, slow], idle)
    assert [p.model for p in first] == ["flaky"]
    # its pre-warm did not take (the worker holds nothing): held off one interval
    misses = fc.missed(first, idle, {}, now_s=300.0, interval_s=300.0)
    assert misses == {"flaky": (1, 600.0)}
    assert [p.model for p in fc.plan([flaky, slow], idle, frozenset({"flaky"}))] == ["slow"]
    # missing again: 3 intervals, then 7, ... at most 16
    misses = fc.missed(first, idle, misses, now_s=900.0, interval_s=300.0)
    assert misses["flaky"] == (2, 900.0 + 3 * 300.0)
    misses = fc.missed(first, idle, {"flaky": (9, 0.0)}, now_s=0.0, interval_s=300.0)
    assert misses["flaky"] == (10, fc.MOST_HELD_OFF_INTERVALS * 300.0)
    # warm where it was sent: forgotten
    warm = [WorkerView("w", {"flaky": 1}, 10)]
    assert fc.missed(first, warm, misses, now_s=1.0, interval_s=300.0) == {}


def test_state_round_trips_and_foreign_records_start_over() -> None:
    f, _ = learn(0.2)
    assert fc.from_json(fc.to_json(f)) == f
    assert fc.from_json({"w": [1.0]}) == Forecaster()
    assert fc.from_json({"w": "x", "p": [], "h": [], "m": 0, "e": 0, "n": 0}) == Forecaster()
    # a state that diverged before (NaN in Redis) starts over instead of forecasting 0
    broken = fc.to_json(f)
    broken["p"][0][0] = math.nan
    assert fc.from_json(broken) == Forecaster()


@pytest.mark.parametrize("field", [
    {"e": -1.0}, {"m": -5.0}, {"h": [-1.0, 2.0]}, {"n": -1}, {"n": 10 ** 400}, {"n": 2.5},
    {"n": True}, {"l": math.nan}, {"l": math.inf}, {"w": [10 ** 400] * fc.N_FEATURES},
])
def test_a_stored_state_no_update_writes_starts_over(field: dict[str, Any]) -> None:
    """(a negative error failed confidence's square root, an update count of inf or past
    float's range raised OverflowError: each failed every planning pass for every model)"""
    f, _ = learn(0.2)
    assert fc.from_json({**fc.to_json(f), **field}) == Forecaster()


def test_a_model_back_after_a_long_idle_spell_at_a_short_interval_does_not_overflow() -> None:
    """At a 2 s interval a model idle for hours kept a mean of ~1e-157 (forgotten only
    after a day); its next demand, scaled by that mean, was ~1e157: the weights overflowed
    and every later pass raised OverflowError."""
    f, t = Forecaster(), 0.0
    for k in range(18_050):
        f = fc.update(f, t, 10.0 if k < 50 else 0.0)
        t += 2.0
    for _ in range(30):
        f = fc.update(f, t, 3.0)
        t += 2.0
    assert max(abs(w) for w in f.weights) < 100
    assert 0.0 <= f.predict(t) < 10.0 and 0.0 <= f.confidence <= 1.0


def test_a_demand_past_floats_range_starts_the_state_over_instead_of_raising() -> None:
    f, _ = learn(0.2)
    huge = fc.update(fc.update(f, T0, 1e308), T0 + STEP, 1e308)
    after = fc.update(huge, T0 + 2 * STEP, 10.0)
    assert all(math.isfinite(v) for v in (*after.weights, after.mean, after.mse))
    assert math.isfinite(after.predict(T0 + 3 * STEP))


@pytest.mark.parametrize(("service_ms", "cold_ms"), [(math.inf, 2000.0), (9000.0, math.inf),
                                                     (math.nan, math.nan)])
def test_an_outlook_with_a_cost_past_floats_range_plans_nothing_instead_of_raising(
        service_ms: float, cold_ms: float) -> None:
    # (two workers' counters of 1e308 summed to inf: ceil(inf) failed the whole pass);
    # such a cost is unknown, as for a model never run
    o = outlook(service_ms=service_ms, cold_ms=cold_ms)
    assert o.reason != "pre-warm"
    assert math.isfinite(o.concurrency) and math.isfinite(o.cold_ms)


def test_a_model_without_demand_for_a_day_is_forgotten() -> None:
    # (the planner kept a forecast, and an outlook per pass, for every model ever named)
    f = fc.update(Forecaster(), 0.0, 5.0)
    assert f.last_demand_s == 0.0
    for k in range(1, 300):  # a day of 5-minute intervals without demand, and more
        f = fc.update(f, k * 300.0, 0.0)
    assert f.last_demand_s == 0.0
    assert not fc.forgotten(f, fc.FORGET_AFTER_S) and fc.forgotten(f, fc.FORGET_AFTER_S + 1)
    assert not fc.forgotten(fc.update(f, 299 * 300.0, 1.0), 300 * 300.0)
    # a model first seen idle starts its clock then; an older record without one too
    assert fc.update(Forecaster(), 600.0, 0.0).last_demand_s == 600.0
    assert not fc.forgotten(Forecaster(), 10 ** 9)
    old = {k: v for k, v in fc.to_json(f).items() if k != "l"}
    assert fc.from_json(old).last_demand_s is None


def test_config_interval() -> None:
    assert SitsConfig().prewarm_interval_s == 300.0
    assert SitsConfig(prewarm_interval_s=0).prewarm_interval_s == 0
    with pytest.raises(ConfigError, match="prewarm_interval_s"):
        SitsConfig(prewarm_interval_s=-1)


@pytest.mark.parametrize(("interval_s", "runs_at"), [
    (300.0, [(14, 10)]), (60.0, [(14, 8)]), (1800.0, [(14, 30)]), (7200.0, [(16, 0)]),
])
def test_the_plan_runs_as_each_demand_interval_begins(interval_s: float,
                                                      runs_at: list[tuple[int, int]]) -> None:
    from datetime import UTC, datetime

    from sits_queue.app import beat_schedule

    # (run every 300 s from the beat's start, a plan forecast the interval it ran in,
    # half gone on average, and pre-warmed for what was ending)
    schedule = beat_schedule(SitsConfig(prewarm_interval_s=interval_s))[
        "sits-prewarm-plan"]["schedule"]
    last = datetime(2026, 12, 3, 14, 7, 31, tzinfo=UTC)
    start, delta, _ = schedule.remaining_delta(last)
    due = start + delta
    assert [(due.hour, due.minute)] == runs_at and due.second == 0
    assert due.timestamp() % interval_s == 0  # a bucket's start (bucket_of)


def test_an_interval_no_crontab_can_say_runs_every_interval() -> None:
    from sits_queue.app import beat_schedule

    entry = beat_schedule(SitsConfig(prewarm_interval_s=420.0))["sits-prewarm-plan"]
    # (no expiry: the beat sends none beside one still waiting, priority/beat.py)
    assert entry["schedule"] == 420.0 and "options" not in entry


@pytest.mark.parametrize("odd", [
    {"devices": "cuda:0"}, {"devices": [5]}, {"devices": [{"free_vram_bytes": "lots"}]},
    {"devices": [{"free_vram_bytes": float("inf")}]}, {"devices": [{"free_vram_bytes": -5}]},
    {"children": ["0"]}, {"children": {"0": "x"}}, {"children": {"0": {"warm": ["gpt"]}}},
])
def test_a_worker_record_of_another_shape_counts_as_holding_nothing(
        odd: dict[str, Any]) -> None:
    """(the planner read every worker's record with int() and .items(): one odd record
    stopped the pre-warm planning for the whole fleet)"""
    from sits_queue.priority.prewarm import _view

    view = _view({"hostname": "odd@h", **odd})
    assert view == WorkerView("odd@h", {}, 0)
    good = _view({"hostname": "w", "devices": [{"free_vram_bytes": 2**33}, {}],
                  "children": {"0": {"warm": {"gpt": "device", "bert": "host"}}}})
    assert good == WorkerView("w", {"gpt": 1}, 2**33)


def test_a_worker_ranks_by_its_roomiest_device_not_their_sum() -> None:
    """(a model loads on one device: eight nearly full GPUs, 40 GiB free in all, outranked
    one GPU with 30 GiB free, for a model neither of the eight could hold)"""
    from sits_queue.priority.prewarm import _view

    eight = _view({"hostname": "eight", "devices": [{"free_vram_bytes": 5 * 2**30}] * 8})
    one = _view({"hostname": "one", "devices": [{"free_vram_bytes": 30 * 2**30}]})
    assert (eight.free_vram_bytes, one.free_vram_bytes) == (5 * 2**30, 30 * 2**30)
    need = ModelOutlook("gpt", 9.0, 0.9, 1.0, 900.0, 1, 0, "pre-warm")
    assert plan([need], [eight, one]) == [Prewarm("gpt", "one")]


def test_a_model_warm_at_a_precision_is_warm_for_its_demand() -> None:
    """(demand is counted by model: a worker holding only gpt@bf16 counted as cold, and
    every pass pre-warmed an as-loaded copy no task used)"""
    from sits_queue.priority.prewarm import _view

    view = _view({"hostname": "w@h", "children": {"0": {"warm": {
        "gpt@bf16": "device", "enc": "device", "lm@fp16": "host"}}}})
    assert view.warm == frozenset({"gpt", "enc"})
