"""The combined priority score: a pure function of a task, a stats snapshot and the config.

Higher runs sooner. With ``w = config.weights`` and the task's class quota ``cls``::

    priority = cls.weight                                          # §1.3 business SLA class
             * min(w.risk_cap, max(1, p95_ms / latency_sla_ms))    # §2.1 risk (capped)
             * 1 / (1 + 0.001 * context_tokens)                    # §2.1 context decay
             * 100                                                 # §2.1 scale
             * (1 + w.qos_gain * qos)                              # §2.2 QoS, qos in [0, 1]
             * (1 + w.hotness_gain * hotness[model])               # §1.3 model hotness
             * (1 - w.entropy_gain * input_entropy)                # §1.3 entropy (sharded)
             + aging_rate_per_s * max(0, wait_s - w.aging_start_s) # ours: no starvation

    qos = w.qos_jitter    * clamp(jitter_ms / 100, 0, 1)           # §2.2
        + w.qos_bandwidth * (1 - clamp(bandwidth_compliance, 0, 1))
        + w.qos_loss      * loss_sensitivity

``p95_ms``, ``jitter_ms`` and ``bandwidth_compliance`` are the task's class statistics
from the :class:`PrioritySnapshot`; everything else comes from :class:`TaskFeatures`.
High-entropy inputs rank slightly lower because §1.3 splits them into early-stoppable
shards (``sits_queue/shards.py``): a long, dense input should not block short ones.

Nothing here reads a clock, Redis or the environment; ``now`` is ``snapshot.now_s``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from sits_queue.config import PriorityWeights, SitsConfig
from sits_queue.errors import ConfigError, InvalidTaskOptions

#: §2.1 context decay per token, 1/token: 1000 tokens halve the latency priority.
CONTEXT_DECAY_PER_TOKEN = 0.001
#: §2.1 scale of the latency priority, dimensionless: risk 1 and no context give 100.
PRIORITY_SCALE = 100.0
#: §2.2 jitter that saturates ``jitter_norm``, ms.
JITTER_NORM_MS = 100.0
#: Largest context accepted, tokens: keeps ``0.001 * tokens`` a finite float.
MAX_CONTEXT_TOKENS = 2**40


def _finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _unit(name: str, value: float) -> None:
    _finite(name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def _positive_finite(name: str, value: float) -> None:
    _finite(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _non_negative_finite(name: str, value: float) -> None:
    _finite(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def _tokens(tokens: int) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise ValueError(f"context_tokens must be an int, got {tokens!r}")
    if not 0 <= tokens <= MAX_CONTEXT_TOKENS:
        raise ValueError(f"context_tokens must be in [0, {MAX_CONTEXT_TOKENS}], got {tokens}")


def _clamp(value: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, value))


@dataclass(frozen=True)
class TaskFeatures:
    """What the scorer knows about one waiting task (from its headers).

    Invalid values raise :class:`~sits_queue.errors.InvalidTaskOptions` (a ``ValueError``)
    at construction, so the score itself never sees NaN or a negative context.
    """

    #: Business SLA class name; must be one of ``config.class_names`` when scored.
    sla_class: str
    #: Unix time the task entered the queue, s.
    enqueued_at_s: float
    #: Input length, tokens (§1.1, §2.1).
    context_tokens: int
    #: Latency SLA of this task, ms (§2.1); usually the class default.
    latency_sla_ms: float
    #: §2.2 loss sensitivity in [0, 1]; class presets are in [0.1, 0.9].
    loss_sensitivity: float
    #: Normalised input entropy in [0, 1] (see ``sits_queue.priority.entropy``).
    input_entropy: float
    #: Model the task runs, for §1.3 hotness; None means no hotness boost.
    model: str | None = None

    def __post_init__(self) -> None:
        try:
            _finite("enqueued_at_s", self.enqueued_at_s)
            _positive_finite("latency_sla_ms", self.latency_sla_ms)
            _tokens(self.context_tokens)
            _unit("loss_sensitivity", self.loss_sensitivity)
            _unit("input_entropy", self.input_entropy)
        except ValueError as exc:
            raise InvalidTaskOptions(f"task features: {exc}") from exc


@dataclass(frozen=True)
class ClassStats:
    """Observed behaviour of one SLA class, from the stats window (see ``stats``)."""

    #: Observed p95 latency, ms; None until the class has completed a task.
    p95_ms: float | None
    #: Mean absolute difference of successive latencies, ms (§2.2).
    jitter_ms: float = 0.0
    #: Share of submitted work completed in the window, [0, 1] (§2.2).
    bandwidth_compliance: float = 1.0

    def __post_init__(self) -> None:
        if self.p95_ms is not None:
            _non_negative_finite("p95_ms", self.p95_ms)
        _non_negative_finite("jitter_ms", self.jitter_ms)
        _unit("bandwidth_compliance", self.bandwidth_compliance)


#: Stats used for a class the snapshot has no entry for: no data, no QoS penalty.
NO_STATS = ClassStats(p95_ms=None)


@dataclass(frozen=True)
class PrioritySnapshot:
    """Everything time-varying the score depends on, read once per rescoring pass."""

    #: The pass's notion of now, unix time s; aging is measured against it.
    now_s: float
    #: Per-class stats; a class missing here scores as :data:`NO_STATS`.
    classes: Mapping[str, ClassStats] = field(default_factory=dict)
    #: Model name -> hotness in [0, 1]; a missing model has hotness 0.
    hotness: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _finite("now_s", self.now_s)
        for model, value in self.hotness.items():
            _unit(f"hotness[{model!r}]", value)
        # Copies behind read-only views: the snapshot cannot change under a pass.
        object.__setattr__(self, "classes", MappingProxyType(dict(self.classes)))
        object.__setattr__(self, "hotness", MappingProxyType(dict(self.hotness)))

    @classmethod
    def empty(cls, now_s: float) -> PrioritySnapshot:
        """A snapshot with no observations yet (a fresh deployment)."""
        return cls(now_s=now_s)

    def stats_for(self, sla_class: str) -> ClassStats:
        return self.classes.get(sla_class, NO_STATS)

    def hotness_of(self, model: str | None) -> float:
        return 0.0 if model is None else self.hotness.get(model, 0.0)


# -- the factors ---------------------------------------------------------------------------
def latency_risk(p95_ms: float | None, sla_ms: float, cap: float = math.inf) -> float:
    """§2.1 ``risk = max(1, p95 / sla)``, capped at ``cap``; 1.0 while p95 is unknown."""
    _positive_finite("sla_ms", sla_ms)
    if math.isnan(cap) or cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap!r}")
    if p95_ms is None:
        return 1.0
    _non_negative_finite("p95_ms", p95_ms)
    return min(cap, max(1.0, p95_ms / sla_ms))


def context_decay(tokens: int) -> float:
    """§2.1 ``decay = 1 / (1 + 0.001 * tokens)``: long inputs yield to short ones."""
    _tokens(tokens)
    return 1.0 / (1.0 + CONTEXT_DECAY_PER_TOKEN * tokens)


def latency_priority(
    p95_ms: float | None, sla_ms: float, tokens: int, cap: float = math.inf
) -> float:
    """§2.1 ``priority = risk * decay * 100``, exactly as the source's formula states.

    The source's example table disagrees with its own formula: it lists SLA 800 ms,
    p95 920 ms, 2048 tokens -> 52.3, and SLA 5000 ms, p95 1200 ms, 8192 tokens -> 17.6,
    whereas the formula gives 1.15 / 3.048 * 100 ~= 37.7 and 1 / 9.192 * 100 ~= 10.9
    (``risk`` is ``max(1, 0.24) = 1`` in the second row). We implement the formula,
    not the table.
    """
    return latency_risk(p95_ms, sla_ms, cap) * context_decay(tokens) * PRIORITY_SCALE


def qos_score(
    jitter_ms: float,
    bandwidth_compliance: float,
    loss_sensitivity: float,
    weights: PriorityWeights,
) -> float:
    """§2.2 ``qos = w_j*jitter_norm + w_b*(1 - compliance) + w_l*loss_sensitivity``.

    In [0, 1] because the weights sum to 1 and each term is in [0, 1].
    """
    _non_negative_finite("jitter_ms", jitter_ms)
    _finite("bandwidth_compliance", bandwidth_compliance)
    _unit("loss_sensitivity", loss_sensitivity)
    jitter_norm = _clamp(jitter_ms / JITTER_NORM_MS, 0.0, 1.0)
    shortfall = 1.0 - _clamp(bandwidth_compliance, 0.0, 1.0)
    return (weights.qos_jitter * jitter_norm + weights.qos_bandwidth * shortfall
            + weights.qos_loss * loss_sensitivity)


# -- aging ---------------------------------------------------------------------------------
def aging_rate_per_s(config: SitsConfig) -> float:
    """Priority a waiting task gains per second of wait beyond ``aging_start_s``, 1/s.

    Chosen so that a task of *any* class that has waited ``weights.aging_bound_s``
    strictly outranks a fresh task of the top class at nominal priority: risk 1, zero
    context, qos 0, hotness 0, entropy 0, i.e. ``max_weight * 100``. Boosts can make a
    fresh task worth more than nominal; :func:`starvation_bound_s` covers that case.
    Before ``aging_start_s`` there is no boost at all, so under a short overload the
    classes keep their strict order (a linear boost from t=0 would let a low task that
    waited a few seconds overtake fresh medium work, ten times its weight).
    """
    top_weight = max(c.weight for c in config.classes)
    w = config.weights
    return top_weight * PRIORITY_SCALE / (w.aging_bound_s - w.aging_start_s)


def aging_boost(wait_s: float, config: SitsConfig) -> float:
    """The aging term of the score for a task that has waited ``wait_s``."""
    return aging_rate_per_s(config) * max(0.0, wait_s - config.weights.aging_start_s)


def max_fresh_priority(config: SitsConfig) -> float:
    """Largest :func:`fresh_priority` any task can have: every boost at its maximum."""
    w = config.weights
    top_weight = max(c.weight for c in config.classes)
    return (top_weight * PRIORITY_SCALE * w.risk_cap
            * (1.0 + w.qos_gain) * (1.0 + w.hotness_gain))


def starvation_bound_s(config: SitsConfig) -> float:
    """Worst-case wait advantage that guarantees a task outranks another, s.

    Guarantee: if task A was enqueued more than this many seconds before task B, then
    A's priority exceeds B's at every ``now``, whatever their classes, stats, context,
    hotness or entropy. So a task can only be overtaken by tasks enqueued less than this
    long after it, and cannot starve. Equals ``aging_start_s + (aging_bound_s -
    aging_start_s) * risk_cap * (1 + qos_gain) * (1 + hotness_gain)`` (the boosts delay
    the nominal crossover by at most that factor). Scores are rewritten once per
    rescoring pass, so in the queue the bound holds up to one ``rescore_interval_s`` of
    staleness.
    """
    return config.weights.aging_start_s + max_fresh_priority(config) / aging_rate_per_s(config)


# -- the score -----------------------------------------------------------------------------
def explain(
    features: TaskFeatures, snapshot: PrioritySnapshot, config: SitsConfig
) -> dict[str, float]:
    """Every factor of the score for one task, keyed by name (``sitsq status``, docs).

    Raises :class:`~sits_queue.errors.ConfigError` for a class the config does not know.
    """
    quota = config.quota(features.sla_class)
    stats = snapshot.stats_for(features.sla_class)
    w = config.weights
    risk = latency_risk(stats.p95_ms, features.latency_sla_ms, cap=w.risk_cap)
    decay = context_decay(features.context_tokens)
    qos = qos_score(stats.jitter_ms, stats.bandwidth_compliance, features.loss_sensitivity, w)
    hot = snapshot.hotness_of(features.model)
    factors = {
        "class_weight": quota.weight,
        "risk": risk,
        "decay": decay,
        "latency_priority": risk * decay * PRIORITY_SCALE,
        "qos": qos,
        "qos_factor": 1.0 + w.qos_gain * qos,
        "hotness": hot,
        "hotness_factor": 1.0 + w.hotness_gain * hot,
        "entropy": features.input_entropy,
        "entropy_factor": 1.0 - w.entropy_gain * features.input_entropy,
    }
    fresh = math.prod(factors[k] for k in
                      ("class_weight", "latency_priority", "qos_factor",
                       "hotness_factor", "entropy_factor"))
    wait_s = max(0.0, snapshot.now_s - features.enqueued_at_s)
    aging = aging_boost(wait_s, config)
    factors.update(fresh=fresh, wait_s=wait_s, aging_rate_per_s=aging_rate_per_s(config),
                   aging=aging, priority=fresh + aging)
    return factors


def fresh_priority(
    features: TaskFeatures, snapshot: PrioritySnapshot, config: SitsConfig
) -> float:
    """The score without aging: what the task is worth the moment it is enqueued."""
    return explain(features, snapshot, config)["fresh"]


def priority(features: TaskFeatures, snapshot: PrioritySnapshot, config: SitsConfig) -> float:
    """The sorted-set score: :func:`fresh_priority` plus aging. Finite and > 0."""
    return explain(features, snapshot, config)["priority"]


class Scorer:
    """:func:`priority` for many tasks under one snapshot, with per-class terms hoisted.

    The rescoring pass and producers score every message; :func:`explain` builds a
    dict per task, which costs several times the arithmetic. Same operations in the same
    order as :func:`explain`, so the results are identical, not just close.
    """

    def __init__(self, snapshot: PrioritySnapshot, config: SitsConfig) -> None:
        w = config.weights
        self.now_s = snapshot.now_s
        self._hotness = snapshot.hotness
        self._risk_cap = w.risk_cap
        self._qos_loss = w.qos_loss
        self._qos_gain, self._hot_gain, self._ent_gain = w.qos_gain, w.hotness_gain, w.entropy_gain
        self._rate = aging_rate_per_s(config)
        self._aging_start = w.aging_start_s
        self._classes: dict[str, tuple[float, float | None, float]] = {}
        for quota in config.classes:
            stats = snapshot.stats_for(quota.name)
            qos_without_loss = (w.qos_jitter * _clamp(stats.jitter_ms / JITTER_NORM_MS, 0.0, 1.0)
                                + w.qos_bandwidth
                                * (1.0 - _clamp(stats.bandwidth_compliance, 0.0, 1.0)))
            self._classes[quota.name] = (quota.weight, stats.p95_ms, qos_without_loss)
        self._names = list(config.class_names)

    def score(self, sla_class: str, enqueued_at_s: float, context_tokens: int,
              latency_sla_ms: float, loss_sensitivity: float, input_entropy: float,
              model: str | None) -> float:
        try:
            weight, p95, qos_base = self._classes[sla_class]
        except KeyError:
            raise ConfigError(f"unknown SLA class {sla_class!r}; known classes: "
                              f"{self._names}") from None
        risk = 1.0 if p95 is None else min(self._risk_cap, max(1.0, p95 / latency_sla_ms))
        decay = 1.0 / (1.0 + CONTEXT_DECAY_PER_TOKEN * context_tokens)
        qos = qos_base + self._qos_loss * loss_sensitivity
        hot = 0.0 if model is None else self._hotness.get(model, 0.0)
        fresh = (weight * (risk * decay * PRIORITY_SCALE) * (1.0 + self._qos_gain * qos)
                 * (1.0 + self._hot_gain * hot) * (1.0 - self._ent_gain * input_entropy))
        wait_s = max(0.0, self.now_s - enqueued_at_s)
        return fresh + self._rate * max(0.0, wait_s - self._aging_start)

    def score_features(self, f: TaskFeatures) -> float:
        return self.score(f.sla_class, f.enqueued_at_s, f.context_tokens, f.latency_sla_ms,
                          f.loss_sensitivity, f.input_entropy, f.model)
