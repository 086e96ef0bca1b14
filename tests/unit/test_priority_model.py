"""The combined priority score (sits_queue.priority.model): tables, failures, properties."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import pytest

from sits_queue.broker.snapshot import snapshot_from_json
from sits_queue.config import MAX_DURATION_S, ClassQuota, PriorityWeights, SitsConfig
from sits_queue.errors import ConfigError, InvalidTaskOptions
from sits_queue.priority.model import (
    ClassStats,
    PrioritySnapshot,
    Scorer,
    TaskFeatures,
    aging_rate_per_s,
    context_decay,
    explain,
    fresh_priority,
    latency_priority,
    latency_risk,
    max_fresh_priority,
    priority,
    qos_score,
    starvation_bound_s,
)

NOW_S = 1_700_000_000.0
CONFIG = SitsConfig()
WEIGHTS = CONFIG.weights


def task(sla_class: str = "medium", **overrides: object) -> TaskFeatures:
    """A fresh, nominal task: no context, no QoS pull, no entropy, no model."""
    base: dict[str, object] = dict(
        sla_class=sla_class, enqueued_at_s=NOW_S, context_tokens=0,
        latency_sla_ms=1000.0, loss_sensitivity=0.0, input_entropy=0.0, model=None,
    )
    base.update(overrides)
    return TaskFeatures(**base)  # type: ignore[arg-type]


EMPTY = PrioritySnapshot.empty(NOW_S)


# -- §2.1 latency priority -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sla_ms", "p95_ms", "tokens", "expected"),
    [
        # The source's table says 52.3 and 17.6; its own formula gives these.
        (800, 920, 2048, 37.7),
        (5000, 1200, 8192, 10.9),
        (1000, None, 0, 100.0),
        (1000, 500, 0, 100.0),    # risk is never below 1
        (1000, 2000, 1000, 100.0),  # risk 2, decay 1/2
        (1000, 1000, 3000, 25.0),
    ],
)
def test_latency_priority_follows_the_formula(
    sla_ms: float, p95_ms: float | None, tokens: int, expected: float
) -> None:
    assert round(latency_priority(p95_ms, sla_ms, tokens), 1) == expected


def test_second_source_row_is_decay_only() -> None:
    assert latency_risk(1200, 5000) == 1.0
    assert latency_priority(1200, 5000, 8192) == pytest.approx(100 / 9.192)


@pytest.mark.parametrize(
    ("p95_ms", "sla_ms", "cap", "expected"),
    [
        (None, 800, math.inf, 1.0),
        (400, 800, math.inf, 1.0),
        (1600, 800, math.inf, 2.0),
        (8000, 800, 4.0, 4.0),
        (0, 800, 4.0, 1.0),
    ],
)
def test_latency_risk(p95_ms: float | None, sla_ms: float, cap: float, expected: float) -> None:
    assert latency_risk(p95_ms, sla_ms, cap) == expected


@pytest.mark.parametrize(("tokens", "expected"), [(0, 1.0), (1000, 0.5), (3000, 0.25)])
def test_context_decay(tokens: int, expected: float) -> None:
    assert context_decay(tokens) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("p95_ms", "sla_ms", "cap"),
    [(math.nan, 800, 4.0), (math.inf, 800, 4.0), (-1, 800, 4.0), (900, 0, 4.0),
     (900, math.nan, 4.0), (900, -5, 4.0), (900, 800, 0.5), (900, 800, math.nan)],
)
def test_latency_risk_rejects_bad_numbers(p95_ms: float, sla_ms: float, cap: float) -> None:
    with pytest.raises(ValueError):
        latency_risk(p95_ms, sla_ms, cap)


@pytest.mark.parametrize("tokens", [-1, 2**41, 1.5, True])
def test_context_decay_rejects_bad_tokens(tokens: int) -> None:
    with pytest.raises(ValueError):
        context_decay(tokens)


# -- §2.2 QoS ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("jitter_ms", "compliance", "loss", "expected"),
    [
        (0, 1.0, 0.0, 0.0),
        (100, 0.0, 1.0, 1.0),
        (50, 1.0, 0.0, 0.2),
        (500, 1.0, 0.0, 0.4),     # jitter_norm saturates at 1
        (0, 0.6, 0.0, 0.14),
        (0, 1.7, 0.0, 0.0),       # compliance clamped to [0, 1]
        (0, -0.5, 0.0, 0.35),
        (0, 1.0, 0.9, 0.225),     # voice-like preset
        (0, 1.0, 0.2, 0.05),      # bulk-download preset
    ],
)
def test_qos_score(jitter_ms: float, compliance: float, loss: float, expected: float) -> None:
    assert qos_score(jitter_ms, compliance, loss, WEIGHTS) == pytest.approx(expected)


def test_qos_weights_are_configuration() -> None:
    weights = PriorityWeights(qos_jitter=1.0, qos_bandwidth=0.0, qos_loss=0.0)
    assert qos_score(50, 0.0, 0.9, weights) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("jitter_ms", "compliance", "loss"),
    [(math.nan, 1.0, 0.5), (-1, 1.0, 0.5), (0, math.nan, 0.5), (0, 1.0, math.nan),
     (0, 1.0, 1.5), (0, 1.0, -0.1)],
)
def test_qos_rejects_bad_numbers(jitter_ms: float, compliance: float, loss: float) -> None:
    with pytest.raises(ValueError):
        qos_score(jitter_ms, compliance, loss, WEIGHTS)


# -- the combined score -----------------------------------------------------------------------
def test_nominal_fresh_priority_is_weight_times_100() -> None:
    for quota in CONFIG.classes:
        assert fresh_priority(task(quota.name), EMPTY, CONFIG) == pytest.approx(quota.weight * 100)


def test_every_factor_multiplies_in() -> None:
    # Given a task with context, a model, entropy and loss sensitivity, and a stressed class
    snapshot = PrioritySnapshot(
        now_s=NOW_S + 10,
        classes={"high": ClassStats(p95_ms=1600, jitter_ms=50, bandwidth_compliance=0.8)},
        hotness={"llama": 0.5},
    )
    features = task("high", context_tokens=1000, latency_sla_ms=800, loss_sensitivity=0.9,
                    input_entropy=0.5, model="llama")
    # When it is explained
    parts = explain(features, snapshot, CONFIG)
    # Then each factor is the documented one and the score is their product plus aging
    qos = 0.4 * 0.5 + 0.35 * 0.2 + 0.25 * 0.9
    fresh = 100 * (2.0 * 0.5 * 100) * (1 + 0.5 * qos) * (1 + 0.5 * 0.5) * (1 - 0.2 * 0.5)
    assert parts["risk"] == pytest.approx(2.0)
    assert parts["decay"] == pytest.approx(0.5)
    assert parts["qos"] == pytest.approx(qos)
    assert parts["fresh"] == pytest.approx(fresh)
    assert parts["wait_s"] == pytest.approx(10)
    # 10 s is inside the aging grace period: no boost yet
    assert WEIGHTS.aging_start_s > 10
    assert parts["aging"] == 0.0
    assert parts["priority"] == pytest.approx(fresh)
    assert priority(features, snapshot, CONFIG) == parts["priority"]
    # Past the grace period the boost grows linearly with the extra wait
    later = PrioritySnapshot(now_s=NOW_S + WEIGHTS.aging_start_s + 10,
                             classes=snapshot.classes, hotness=snapshot.hotness)
    assert explain(features, later, CONFIG)["priority"] == pytest.approx(
        fresh + 10 * aging_rate_per_s(CONFIG))


def test_no_aging_inside_the_grace_period_keeps_class_order() -> None:
    # A low task that has waited almost aging_start_s still yields to fresh medium work
    low = task("low", enqueued_at_s=NOW_S - WEIGHTS.aging_start_s * 0.99)
    medium = task("medium", context_tokens=2048)
    assert priority(low, EMPTY, CONFIG) < priority(medium, EMPTY, CONFIG)


def test_risk_is_capped() -> None:
    snapshot = PrioritySnapshot(now_s=NOW_S, classes={"low": ClassStats(p95_ms=1e9)})
    assert explain(task("low"), snapshot, CONFIG)["risk"] == WEIGHTS.risk_cap


def test_unknown_class_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="'urgent'"):
        priority(task("urgent"), EMPTY, CONFIG)


def test_unknown_model_and_class_without_stats_score_as_no_data() -> None:
    snapshot = PrioritySnapshot(now_s=NOW_S, hotness={"other": 1.0})
    parts = explain(task("high", model="unseen"), snapshot, CONFIG)
    assert (parts["risk"], parts["hotness"], parts["qos"]) == (1.0, 0.0, 0.0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"enqueued_at_s": math.nan}, {"enqueued_at_s": math.inf},
        {"latency_sla_ms": 0.0}, {"latency_sla_ms": math.nan},
        {"context_tokens": -1}, {"loss_sensitivity": math.nan}, {"loss_sensitivity": 1.2},
        {"input_entropy": math.nan}, {"input_entropy": -0.1},
    ],
)
def test_task_features_reject_bad_numbers(overrides: dict[str, Any]) -> None:
    with pytest.raises(InvalidTaskOptions):
        task(**overrides)


@pytest.mark.parametrize(
    "kwargs",
    [{"p95_ms": math.nan}, {"p95_ms": -1.0}, {"p95_ms": None, "jitter_ms": math.inf},
     {"p95_ms": None, "bandwidth_compliance": 1.5}],
)
def test_class_stats_reject_bad_numbers(kwargs: dict[str, float | None]) -> None:
    with pytest.raises(ValueError):
        ClassStats(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"now_s": math.nan}, {"hotness": {"m": math.nan}},
                                    {"hotness": {"m": 1.5}}])
def test_snapshot_rejects_bad_numbers(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PrioritySnapshot(**{"now_s": NOW_S, **kwargs})  # type: ignore[arg-type]


def test_snapshot_is_immutable_and_detached_from_its_inputs() -> None:
    hot = {"m": 0.5}
    snapshot = PrioritySnapshot(now_s=NOW_S, hotness=hot)
    hot["m"] = 1.0
    assert snapshot.hotness["m"] == 0.5
    with pytest.raises(TypeError):
        snapshot.hotness["m"] = 1.0  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.now_s = 0.0  # type: ignore[misc]


# -- properties -------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [0, 500, 4096, 100_000])
@pytest.mark.parametrize("p95_ms", [None, 300.0, 3000.0])
def test_higher_class_weight_ranks_higher(tokens: int, p95_ms: float | None) -> None:
    snapshot = PrioritySnapshot(now_s=NOW_S, classes={
        name: ClassStats(p95_ms=p95_ms) for name in CONFIG.class_names})
    scores = [priority(task(q.name, context_tokens=tokens), snapshot, CONFIG)
              for q in sorted(CONFIG.classes, key=lambda q: q.weight)]
    assert scores == sorted(scores)
    assert len(set(scores)) == len(scores)


@pytest.mark.parametrize("sla_class", CONFIG.class_names)
def test_longer_context_ranks_lower_within_a_class(sla_class: str) -> None:
    scores = [priority(task(sla_class, context_tokens=t), EMPTY, CONFIG)
              for t in (0, 1, 512, 2048, 32_768, 10**6)]
    assert scores == sorted(scores, reverse=True)
    assert len(set(scores)) == len(scores)


def test_aged_low_task_outranks_fresh_high_task_at_nominal_stats() -> None:
    # Given a low task that has waited exactly aging_bound_s, with a long context
    low = task("low", enqueued_at_s=NOW_S - WEIGHTS.aging_bound_s, context_tokens=8192)
    # And a fresh high task at nominal priority (risk 1, no context, no boosts)
    high = task("high")
    # Then the waiting task runs first
    assert priority(low, EMPTY, CONFIG) > priority(high, EMPTY, CONFIG)


def test_aging_rate_matches_the_documented_crossover() -> None:
    top = max(q.weight for q in CONFIG.classes)
    span = WEIGHTS.aging_bound_s - WEIGHTS.aging_start_s
    assert aging_rate_per_s(CONFIG) * span == pytest.approx(top * 100)


def test_starvation_bound_is_the_boosted_crossover() -> None:
    w = WEIGHTS
    expected = w.aging_start_s + (w.aging_bound_s - w.aging_start_s) * w.risk_cap * (
        1 + w.qos_gain) * (1 + w.hotness_gain)
    assert starvation_bound_s(CONFIG) == pytest.approx(expected)


def test_starvation_bound_holds_against_the_strongest_fresh_task() -> None:
    # Given every boost at its maximum for a fresh high task
    snapshot = PrioritySnapshot(
        now_s=NOW_S,
        classes={"high": ClassStats(p95_ms=1e9, jitter_ms=1e9, bandwidth_compliance=0.0)},
        hotness={"hot": 1.0},
    )
    strongest = task("high", loss_sensitivity=1.0, model="hot")
    assert fresh_priority(strongest, snapshot, CONFIG) == pytest.approx(
        max_fresh_priority(CONFIG))
    # When a worst-case low task has waited just past the bound
    bound = starvation_bound_s(CONFIG)
    starving = task("low", enqueued_at_s=NOW_S - bound * 1.0001, context_tokens=10**6,
                    input_entropy=1.0)
    # Then it still runs first
    assert priority(starving, snapshot, CONFIG) > priority(strongest, snapshot, CONFIG)


def test_clock_skew_never_lowers_a_score() -> None:
    future = task("low", enqueued_at_s=NOW_S + 3600)
    assert priority(future, EMPTY, CONFIG) == fresh_priority(future, EMPTY, CONFIG)


_GRID = list(itertools.product(
    ("high", "low"),
    (0, 8192, 2**40),                 # context tokens
    (None, 0.0, 5000.0, 1e12),        # class p95 ms
    (0.0, 1.0),                       # entropy
    (0.0, 1.0),                       # loss sensitivity and hotness
    (0.0, 1e9),                       # wait s
))


@pytest.mark.parametrize(("sla_class", "tokens", "p95_ms", "entropy", "boost", "wait_s"), _GRID)
def test_priority_is_finite_and_positive(
    sla_class: str, tokens: int, p95_ms: float | None, entropy: float, boost: float,
    wait_s: float,
) -> None:
    snapshot = PrioritySnapshot(
        now_s=NOW_S,
        classes={sla_class: ClassStats(p95_ms=p95_ms, jitter_ms=boost * 1e6,
                                       bandwidth_compliance=1 - boost)},
        hotness={"m": boost},
    )
    features = task(sla_class, enqueued_at_s=NOW_S - wait_s, context_tokens=tokens,
                    latency_sla_ms=1e-3, loss_sensitivity=boost, input_entropy=entropy,
                    model="m")
    score = priority(features, snapshot, CONFIG)
    assert math.isfinite(score)
    assert score > 0
    # The hoisted scorer used on hot paths gives the very same number
    assert Scorer(snapshot, CONFIG).score_features(features) == score


def test_scorer_rejects_an_unknown_class() -> None:
    with pytest.raises(ConfigError, match="urgent"):
        Scorer(EMPTY, CONFIG).score("urgent", NOW_S, 0, 800, 0.5, 0.5, None)


def test_extreme_config_stays_finite_and_positive() -> None:
    config = SitsConfig(
        classes=(ClassQuota("tiny", cpu_cores=1, vram_gib=1, max_run_s=1, weight=1e-4,
                            latency_sla_ms=1, loss_sensitivity=0.1),),
        default_class="tiny",
        weights=PriorityWeights(entropy_gain=0.999, risk_cap=1e6,
                                aging_bound_s=MAX_DURATION_S),
    )
    features = task("tiny", context_tokens=2**40, input_entropy=1.0)
    score = priority(features, EMPTY, config)
    assert math.isfinite(score) and score > 0
    assert math.isfinite(starvation_bound_s(config))


@pytest.mark.parametrize("raw", [
    b"garbage", b"[1, 2]", b'"a string"',
    b'{"classes": {"high": {"p95_ms": NaN}}, "hotness": {"m": NaN}}',
    b'{"classes": {"high": [1, 2], "low": 5}, "hotness": [1]}',
    # an integer past float's range: OverflowError stopped every put
    b'{"classes": {"high": {"p95_ms": 1' + b"0" * 400 + b'}}, "hotness": {"m": 1'
    + b"0" * 400 + b'}}',
])
def test_an_unreadable_stored_snapshot_scores_as_no_data(raw: bytes) -> None:
    got = snapshot_from_json(raw, 100.0)
    assert got.now_s == 100.0 and dict(got.classes) == {} and dict(got.hotness) == {}


def test_a_stored_snapshot_keeps_what_reads_and_ignores_a_newer_beats_fields() -> None:
    got = snapshot_from_json(
        b'{"classes": {"high": {"p95_ms": 900, "jitter_ms": 3, "bandwidth_compliance": 1,'
        b' "p99_ms": 2000}, "low": {"p95_ms": -1}}, "hotness": {"a": 0.5, "b": 7}}', 1.0)
    assert got.classes["high"] == ClassStats(p95_ms=900, jitter_ms=3, bandwidth_compliance=1)
    assert "low" not in got.classes and dict(got.hotness) == {"a": 0.5}
