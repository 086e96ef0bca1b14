"""Statistics and §2.2 recompute triggers (sits_queue.priority.stats)."""

from __future__ import annotations

import math

import pytest

from sits_queue.priority.stats import (
    TriggerSample,
    TriggerState,
    bandwidth_compliance,
    decay_counts,
    decay_factor,
    evaluate_triggers,
    hotness,
    jitter_ms,
    p95,
    percentile,
)

NAN = math.nan


# -- percentiles ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 95, None),
        ([7.0], 95, 7.0),
        ([1, 2, 3, 4, 5], 0, 1),
        ([1, 2, 3, 4, 5], 20, 1),
        ([1, 2, 3, 4, 5], 21, 2),
        ([1, 2, 3, 4, 5], 50, 3),
        ([5, 1, 4, 2, 3], 100, 5),          # order of samples does not matter
        (list(range(1, 101)), 95, 95),
        (list(range(1, 21)), 95, 19),       # ceil(0.95 * 20) = 19th
        ([1, NAN, 3, math.inf], 50, 1),     # non-finite samples are dropped
        ([NAN, NAN], 50, None),
    ],
)
def test_percentile_nearest_rank(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


@pytest.mark.parametrize("q", [-1, 101, NAN])
def test_percentile_rejects_bad_q(q: float) -> None:
    with pytest.raises(ValueError):
        percentile([1.0], q)


def test_p95_is_the_95th_percentile() -> None:
    values = [float(v) for v in range(200, 0, -1)]
    assert p95(values) == 190.0
    assert p95([]) is None


# -- jitter, compliance -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("latencies", "expected"),
    [
        ([], 0.0),
        ([10.0], 0.0),
        ([10.0, 10.0, 10.0], 0.0),
        ([10.0, 20.0], 10.0),
        ([10.0, 20.0, 10.0, 40.0], (10 + 10 + 30) / 3),
        ([10.0, NAN, 20.0], 10.0),
    ],
)
def test_jitter(latencies: list[float], expected: float) -> None:
    assert jitter_ms(latencies) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("completed", "submitted", "expected"),
    [(0, 0, 1.0), (5, 0, 1.0), (0, 10, 0.0), (5, 10, 0.5), (12, 10, 1.0), (10, 10, 1.0)],
)
def test_bandwidth_compliance(completed: float, submitted: float, expected: float) -> None:
    assert bandwidth_compliance(completed, submitted) == expected


@pytest.mark.parametrize(
    ("completed", "submitted"), [(-1, 10), (1, -1), (NAN, 1), (1, NAN), (math.inf, 1)]
)
def test_bandwidth_compliance_treats_bad_counts_as_no_evidence(
    completed: float, submitted: float
) -> None:
    # Given a counter delta that went negative (reset) or was misread
    # Then the class is not penalised for it
    assert bandwidth_compliance(completed, submitted) == 1.0


# -- hotness ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ({}, {}),
        ({"a": 0.0}, {"a": 0.0}),
        ({"a": 10.0, "b": 5.0, "c": 0.0}, {"a": 1.0, "b": 0.5, "c": 0.0}),
        ({"a": 3.0, "b": -2.0, "c": NAN}, {"a": 1.0, "b": 0.0, "c": 0.0}),
        ({"a": math.inf, "b": 4.0}, {"a": 0.0, "b": 1.0}),
    ],
)
def test_hotness(counts: dict[str, float], expected: dict[str, float]) -> None:
    assert hotness(counts) == expected


@pytest.mark.parametrize(
    ("counts", "factor", "expected"),
    [
        ({"a": 10.0, "b": 0.015}, 0.5, {"a": 5.0}),
        ({"a": 1.0}, 1.0, {"a": 1.0}),
        ({"a": 0.02}, 0.5, {"a": 0.01}),      # exactly at the floor is kept
        ({"a": NAN, "b": 2.0}, 0.5, {"b": 1.0}),
        ({}, 0.9, {}),
    ],
)
def test_decay_counts(counts: dict[str, float], factor: float, expected: dict[str, float]) -> None:
    assert decay_counts(counts, factor) == pytest.approx(expected)


@pytest.mark.parametrize("factor", [0.0, -0.5, 1.5, NAN])
def test_decay_counts_rejects_bad_factor(factor: float) -> None:
    with pytest.raises(ValueError):
        decay_counts({"a": 1.0}, factor)


# -- §2.2 triggers ----------------------------------------------------------------------------
def sample(rtt: float = 100.0, loss: float | None = 0.0,
           wait: float | None = None) -> TriggerSample:
    return TriggerSample(rtt_ms=rtt, loss_rate=loss, oldest_high_wait_ms=wait)


BASE = TriggerState(rtt_baseline_ms=100.0, loss_baseline=0.0)


def test_first_sample_only_sets_baselines() -> None:
    fired, state = evaluate_triggers(TriggerState(), sample(rtt=500, loss=0.5))
    assert fired == ()
    assert state == TriggerState(rtt_baseline_ms=500, loss_baseline=0.5, loss_streak=0)


def test_backlog_fires_even_on_the_first_sample() -> None:
    fired, _ = evaluate_triggers(TriggerState(), sample(wait=250))
    assert fired == ("backlog",)


@pytest.mark.parametrize(
    ("rtt", "fires"),
    [(100, False), (115, False), (115.1, True), (85, False), (84.9, True), (300, True)],
)
def test_rtt_fires_beyond_15_percent(rtt: float, fires: bool) -> None:
    fired, _ = evaluate_triggers(BASE, sample(rtt=rtt))
    assert ("rtt" in fired) is fires


def test_zero_rtt_baseline_does_not_divide_by_zero() -> None:
    state = TriggerState(rtt_baseline_ms=0.0, loss_baseline=0.0)
    assert evaluate_triggers(state, sample(rtt=0.0))[0] == ()
    assert evaluate_triggers(state, sample(rtt=1.5))[0] == ("rtt",)


@pytest.mark.parametrize(("base", "rtt", "fires"), [
    (0.1, 0.13, False),   # +30% but 0.03 ms: loopback noise under the 1 ms floor
    (0.1, 1.2, True),     # +1.1 ms: over the floor
    (20.0, 22.0, False),  # +10%: under the relative tolerance
    (20.0, 24.0, True),   # +20% and 4 ms
])
def test_rtt_needs_both_relative_and_absolute_change(base: float, rtt: float,
                                                     fires: bool) -> None:
    state = TriggerState(rtt_baseline_ms=base, loss_baseline=0.0)
    assert ("rtt" in evaluate_triggers(state, sample(rtt=rtt))[0]) is fires


@pytest.mark.parametrize(
    ("wait", "fires"), [(None, False), (0.0, False), (200.0, False), (200.1, True)]
)
def test_backlog_fires_beyond_200_ms(wait: float | None, fires: bool) -> None:
    fired, _ = evaluate_triggers(BASE, sample(wait=wait))
    assert ("backlog" in fired) is fires


def _run(state: TriggerState, losses: list[float | None]) -> list[tuple[str, ...]]:
    fired_each = []
    for loss in losses:
        fired, state = evaluate_triggers(state, sample(loss=loss))
        fired_each.append(fired)
    return fired_each


def test_loss_fires_on_the_third_consecutive_rise_then_restarts() -> None:
    fired = _run(BASE, [0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    assert [("loss" in f) for f in fired] == [False, False, True, False, False, True]


def test_loss_streak_breaks_on_a_normal_sample() -> None:
    fired = _run(BASE, [0.1, 0.1, 0.0, 0.1, 0.1])
    assert not any("loss" in f for f in fired)


def test_a_check_with_no_task_finished_is_no_reading_and_breaks_no_streak() -> None:
    # Given every task failing, one finishing every other check (None: none finished;
    # read as a loss of 0, it reset the streak and the trigger never fired)
    fired = _run(BASE, [1.0, None, 1.0, None, 1.0])
    assert [("loss" in f) for f in fired] == [False, False, False, False, True]
    _, state = evaluate_triggers(BASE, sample(rtt=200.0, loss=None))
    assert state.loss_baseline == 0.0 and state.rtt_baseline_ms > 100.0  # rtt still read
    # A first sample without a loss reading leaves the loss baseline to the next one
    _, state = evaluate_triggers(TriggerState(), sample(loss=None))
    assert state.loss_baseline is None
    assert evaluate_triggers(state, sample(loss=0.3))[1].loss_baseline == 0.3


def test_loss_rise_of_exactly_5_points_does_not_count() -> None:
    assert not any("loss" in f for f in _run(BASE, [0.05] * 6))


def test_small_sustained_loss_rise_is_not_absorbed_by_the_baseline() -> None:
    # Given a rise of 7 points, which a free-running EWMA would swallow by sample 3
    fired = _run(BASE, [0.07, 0.07, 0.07])
    # Then the held baseline still sees three rises
    assert "loss" in fired[-1]


def test_baselines_follow_an_ewma() -> None:
    _, state = evaluate_triggers(BASE, sample(rtt=200.0, loss=0.02))
    assert state.rtt_baseline_ms == pytest.approx(0.8 * 100 + 0.2 * 200)
    assert state.loss_baseline == pytest.approx(0.2 * 0.02)


def test_rtt_baseline_adapts_to_a_new_normal() -> None:
    # Given RTT moves permanently from 100 ms to 130 ms
    state, fired_each = BASE, []
    for _ in range(10):
        fired, state = evaluate_triggers(state, sample(rtt=130.0))
        fired_each.append("rtt" in fired)
    # Then it fires at first and stops once the baseline has caught up
    assert fired_each[0] and not fired_each[-1]


def test_all_triggers_fire_together_in_a_fixed_order() -> None:
    state = TriggerState(rtt_baseline_ms=100.0, loss_baseline=0.0, loss_streak=2)
    fired, new_state = evaluate_triggers(state, sample(rtt=200, loss=0.5, wait=1000))
    assert fired == ("rtt", "loss", "backlog")
    assert new_state.loss_streak == 0


@pytest.mark.parametrize(
    ("rtt", "loss", "wait"),
    [(NAN, 0.0, None), (-1.0, 0.0, None), (math.inf, 0.0, None), (1.0, NAN, None),
     (1.0, 1.5, None), (1.0, -0.1, None), (1.0, 0.0, NAN), (1.0, 0.0, -5.0)],
)
def test_trigger_sample_rejects_bad_numbers(rtt: float, loss: float, wait: float | None) -> None:
    with pytest.raises(ValueError):
        TriggerSample(rtt_ms=rtt, loss_rate=loss, oldest_high_wait_ms=wait)


@pytest.mark.parametrize("alpha", [0.0, 1.5, NAN])
def test_evaluate_triggers_rejects_bad_alpha(alpha: float) -> None:
    with pytest.raises(ValueError):
        evaluate_triggers(BASE, sample(), baseline_alpha=alpha)


@pytest.mark.parametrize(
    ("elapsed_s", "expected"),
    [
        (5.0, 0.9),                 # one period: the per-period decay
        (1.0, 0.9 ** 0.2),          # a triggered pass a second after the last
        (0.0, 1.0),                 # two passes at one instant: no decay
        (50.0, 0.9 ** 10),
        (-3.0, 0.9),                # a clock gone back: one period
        (NAN, 0.9),                 # no earlier pass
        (math.inf, 0.9),
        (1e12, 0.0),                # long idle: everything fades
    ],
)
def test_decay_factor_is_by_time(elapsed_s: float, expected: float) -> None:
    assert decay_factor(elapsed_s, 5.0, 0.9) == pytest.approx(expected)


@pytest.mark.parametrize(("period_s", "per_period"), [(0.0, 0.9), (5.0, 0.0), (5.0, 1.5),
                                                      (5.0, NAN), (NAN, 0.9)])
def test_decay_factor_rejects_bad_arguments(period_s: float, per_period: float) -> None:
    with pytest.raises(ValueError):
        decay_factor(1.0, period_s, per_period)


def test_a_latency_past_a_year_is_dropped_as_corrupt() -> None:
    from sits_queue.priority.model import ClassStats

    # (a foreign producer's sits_submitted_at of -1e305: a finite latency of 1e308 ms, and
    # the jitter's sum of two such overflowed to inf, so every rescoring pass raised)
    samples = [1e308, 0.0, 1e308, 250.0, 150.0]
    assert jitter_ms(samples) == 175.0 and p95(samples) == 250.0  # of 0, 250, 150
    ClassStats(p95_ms=p95(samples), jitter_ms=jitter_ms(samples))


def test_smoothed_counts_fade_by_the_factor_add_the_window_and_skip_resets() -> None:
    from sits_queue.priority.stats import smoothed_counts

    assert smoothed_counts({}, {"low": 3.0}, 0.5) == {"low": 3.0}
    assert smoothed_counts({"low": 4.0, "gone": 0.015}, {"low": 1.0, "high": -5.0},
                           0.5) == {"low": 3.0}  # -5: a counter reset; 0.0075: dropped
    assert smoothed_counts({"low": math.inf}, {"low": math.nan}, 0.5) == {}


def test_a_class_keeping_up_unevenly_reads_as_keeping_up() -> None:
    from sits_queue.priority.stats import smoothed_counts

    # A class that finishes exactly what arrives, but lumpily: 2 arrive and 1 finishes in
    # one second, 0 arrive and 1 finishes in the next. Compared second by second it read
    # 0.5 every other pass (a 17% jump of its whole class's score each time).
    fade = decay_factor(1.0, 30.0, 0.5)
    done: dict[str, float] = {}
    arrived: dict[str, float] = {}
    readings = []
    for second in range(120):
        arrived = smoothed_counts(arrived, {"low": 2.0 if second % 2 == 0 else 0.0}, fade)
        done = smoothed_counts(done, {"low": 1.0}, fade)
        readings.append(bandwidth_compliance(done["low"], arrived["low"]))
    assert min(readings[20:]) > 0.95


@pytest.mark.parametrize("raw", [
    b"{not json", b"\xff", b"[1]", b'"x"', b'{"state": {"bogus": 1}}', b'{"done": "x"}',
    b'{"state": [1]}', b'{"state": {"loss_baseline": 7}}', b'{"state": {"loss_streak": -2}}',
    b'{"state": {"rtt_baseline_ms": NaN}}', b'{"done": 1e999}',
])
def test_a_trigger_record_of_another_shape_counts_as_none(raw: bytes) -> None:
    """(each failed every trigger check, before the write that would have replaced it)"""
    from sits_queue.priority.rescore import saved_triggers

    done, failed, state = saved_triggers(raw)
    assert (done, failed) == (0.0, 0.0)
    assert state == TriggerState()


def test_a_trigger_record_of_ours_reads_back() -> None:
    import json

    from sits_queue.priority.rescore import saved_triggers

    state = TriggerState(rtt_baseline_ms=1.5, loss_baseline=0.01, loss_streak=2)
    raw = json.dumps({"done": 40, "failed": 2, "state": state.__dict__})
    assert saved_triggers(raw) == (40.0, 2.0, state)
    assert saved_triggers(None) == (0.0, 0.0, TriggerState())
