"""Predictive pre-warming (MISSION §4.2), the pure part: per-model demand forecast by
recursive least squares, and the plan of which workers warm which model.

The source: "learn per-model demand from the job history (periodicity offline, bursts
online); online recursive least squares with forgetting factor 0.98, updated every 5
minutes; features: time encoding, previous job type, CPU/memory request ratio. Pre-warm
when the predicted cold start exceeds 850 ms with confidence >= 0.82; pre-warm
ceil(predicted concurrency * 1.3) instances."

Here, per model and per interval (``prewarm_interval_s``, 300 s):

* features: a bias; the time of day and of week as sine/cosine pairs (periodicity);
  the model's demand in the previous two intervals, scaled by its running mean (at least
  one task; bursts: what ran just before is the best hint of what runs next: the source's
  "previous job type"). The source's CPU/memory request ratio is not something a queue of inference
  tasks sees per model; it is left out rather than faked;
* RLS with forgetting factor 0.98 updates the weights once per interval with the demand
  that interval actually had;
* confidence = 1 - (recency-weighted RMS of the one-step errors / the model's mean
  demand), clamped to [0, 1]: a forecast that has been right recently is trusted;
* the plan: a model whose predicted demand needs instances (Little's law: arrivals x
  service time / interval), whose cold start costs more than 850 ms and whose forecast
  is trusted (>= 0.82) gets ``ceil(concurrency x 1.3)`` warm instances (pool children:
  each keeps its own engines); those it lacks are chosen among the children of workers
  that do not hold it warm, a worker at a time, most free device memory first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The source's figures.
FORGETTING = 0.98
COLD_THRESHOLD_MS = 850.0
MIN_CONFIDENCE = 0.82
HEADROOM = 1.3
#: A model without demand this long leaves the forecasts, s (a day).
FORGET_AFTER_S = 86_400.0
#: Initial diagonal of the RLS covariance: large, so the first intervals move the
#: weights quickly.
P0 = 100.0
N_FEATURES = 7
#: Bound on the trace of the RLS covariance (P0 * N_FEATURES = 700 at start).
MAX_TRACE = 1e4
#: The least demand (tasks per interval) the regression scales by. The running mean of a
#: model left idle shrinks 2% an interval and it is forgotten only after a day: at a 2 s
#: interval it reached ~1e-157, its next demand scaled to ~1e157, and the weights
#: overflowed the pass for every model. A sparse model (under one task an interval)
#: learns raw counts instead.
MIN_SCALE = 1.0
#: Bound on a stored state's update count (a year of 5-minute intervals is ~105,000; an
#: int past float's range made the forgetting factor's power raise).
MAX_UPDATES = 10**9


def features(now_s: float, previous: Sequence[float], mean: float) -> list[float]:
    """The feature vector for the interval starting at ``now_s`` (unix s, UTC):
    ``previous`` = the model's demand in the last two intervals, newest first."""
    day = 2 * math.pi * ((now_s % 86_400) / 86_400)
    week = 2 * math.pi * ((now_s % 604_800) / 604_800)
    scale = _scale(mean)
    lag1 = previous[0] / scale if previous else 0.0
    lag2 = previous[1] / scale if len(previous) > 1 else 0.0
    return [1.0, math.sin(day), math.cos(day), math.sin(week), math.cos(week), lag1, lag2]


@dataclass(frozen=True)
class Forecaster:
    """One model's RLS state (JSON-able: lists of floats)."""

    weights: tuple[float, ...] = (0.0,) * N_FEATURES
    covariance: tuple[tuple[float, ...], ...] = tuple(
        tuple(P0 if i == j else 0.0 for j in range(N_FEATURES)) for i in range(N_FEATURES))
    #: Demand of the last intervals, newest first (two are used).
    history: tuple[float, ...] = ()
    #: Running (forgetting) mean of the demand, and of the squared one-step error.
    mean: float = 0.0
    mse: float = 0.0
    updates: int = 0
    #: Start of the latest interval with demand, s (of the first one seen, before any).
    last_demand_s: float | None = None

    def predict(self, now_s: float) -> float:
        """Demand (tasks) expected in the interval starting at ``now_s``, >= 0."""
        if self.mean <= 0:
            return 0.0
        x = features(now_s, self.history, self.mean)
        return max(0.0, _scale(self.mean) * sum(w * xi for w, xi in
                                                zip(self.weights, x, strict=True)))

    @property
    def confidence(self) -> float:
        """1 - relative RMS error of recent one-step forecasts, in [0, 1]; 0 until a few
        intervals were seen."""
        if self.updates < 3 or self.mean <= 0:
            return 0.0
        return max(0.0, min(1.0, 1.0 - math.sqrt(self.mse) / self.mean))


def _scale(mean: float) -> float:
    """What demand is divided by in the regression: the running mean, at least
    :data:`MIN_SCALE`."""
    return mean if mean > MIN_SCALE else MIN_SCALE


def update(f: Forecaster, start_s: float, demand: float,
           forgetting: float = FORGETTING) -> Forecaster:
    """The state after the interval that started at ``start_s`` had ``demand`` tasks.

    A state that this leaves not finite (a demand past float's range, or a stored state no
    update of ours wrote) starts over from this interval rather than fail the pass."""
    after = _update(f, start_s, demand, forgetting)
    if _finite(after):
        return after
    fresh = _update(Forecaster(), start_s, demand, forgetting)
    return fresh if _finite(fresh) else Forecaster()


def _update(f: Forecaster, start_s: float, demand: float, forgetting: float) -> Forecaster:
    error = demand - f.predict(start_s)
    mean = demand if f.updates == 0 else forgetting * f.mean + (1 - forgetting) * demand
    # The first interval had no forecast to miss (its "error" is the whole demand, which
    # would keep confidence under the bar for ~170 intervals, 14 h at 5 min). From the
    # second on, a recency-weighted mean of the squared one-step errors, bias-corrected
    # (weights (1-l) l^i normalised over the errors seen) so early intervals count as
    # much as the forgetting factor says and no more.
    seen = f.updates  # real one-step errors, this one included
    mse = 0.0 if seen == 0 else \
        f.mse + (error * error - f.mse) * (1 - forgetting) / (1 - forgetting ** seen)
    # the regression runs on demand scaled by its mean, so models of any volume learn alike
    scale = _scale(f.mean if f.mean > 0 else demand)
    x = features(start_s, f.history, scale)
    y = demand / scale
    p = [list(row) for row in f.covariance]
    px = [sum(p[i][j] * x[j] for j in range(N_FEATURES)) for i in range(N_FEATURES)]
    denom = forgetting + sum(x[i] * px[i] for i in range(N_FEATURES))
    gain = [v / denom for v in px]
    residual = y - sum(w * xi for w, xi in zip(f.weights, x, strict=True))
    weights = tuple(w + g * residual for w, g in zip(f.weights, gain, strict=True))
    raw = [[(p[i][j] - gain[i] * px[j]) / forgetting for j in range(N_FEATURES)]
           for i in range(N_FEATURES)]
    # Symmetrised: rounding leaves P - P^T, which dividing by the forgetting factor grows
    # 2% an interval (e-fold every 50): unchecked, the forecast diverged within a week.
    covariance = tuple(tuple((raw[i][j] + raw[j][i]) / 2 for j in range(N_FEATURES))
                       for i in range(N_FEATURES))
    # Forgetting also inflates P along what the features never vary (steady demand: the
    # bias and both lags are one direction): bounded, it cannot overflow to NaN.
    trace = sum(covariance[i][i] for i in range(N_FEATURES))
    if not math.isfinite(trace):
        covariance = Forecaster().covariance
    elif trace > MAX_TRACE:
        covariance = tuple(tuple(v * MAX_TRACE / trace for v in row) for row in covariance)
    last = start_s if demand > 0 or f.last_demand_s is None else f.last_demand_s
    return Forecaster(weights, covariance, (demand, *f.history)[:2], mean, mse, f.updates + 1,
                      last)


def _finite(f: Forecaster) -> bool:
    numbers = (*f.weights, *(v for row in f.covariance for v in row), *f.history, f.mean,
               f.mse)
    return all(math.isfinite(v) for v in numbers)


def forgotten(f: Forecaster, now_s: float) -> bool:
    """A model with no demand for :data:`FORGET_AFTER_S`: its forecast is ~0 by then
    (the forgetting factor keeps ~50 intervals), and kept, the state would list every
    model ever named."""
    return f.last_demand_s is not None and now_s - f.last_demand_s > FORGET_AFTER_S


# -- the plan -----------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerView:
    """What the planner needs of a live worker (from its advertisement)."""

    hostname: str
    #: Model -> how many of its children hold it on their device tier (each keeps its
    #: own engines: an instance each).
    holders: Mapping[str, int] = field(default_factory=dict)
    free_vram_bytes: int = 0
    #: Its pool's children a pre-warm can be sent to; 1 where the pool is not steered:
    #: the pool's own choice of child can land every pre-warm on the same one.
    slots: int = 1

    @property
    def warm(self) -> frozenset[str]:
        """Models warm on its device tier (in one of its children or more)."""
        return frozenset(m for m, n in self.holders.items() if n > 0)

    def instances(self, model: str) -> int:
        """Warm instances of ``model`` here: its children that hold it."""
        return max(0, self.holders.get(model, 0))

    def room(self, model: str) -> int:
        """Pre-warms of ``model`` this worker can take: its children without it."""
        return max(0, self.slots - self.instances(model))


@dataclass(frozen=True)
class ModelOutlook:
    model: str
    predicted: float  # tasks in the next interval
    confidence: float
    concurrency: float  # instances busy on average (Little's law)
    cold_ms: float  # mean measured cold start; 0 unknown
    instances: int  # warm instances wanted (pool children; one per worker unsteered)
    warm_now: int
    reason: str


@dataclass(frozen=True)
class Prewarm:
    model: str
    hostname: str


def outlook(model: str, f: Forecaster, now_s: float, interval_s: float, service_ms: float,
            cold_ms: float, warm_now: int) -> ModelOutlook:
    # (a service time or cold start past float's range: the workers' counters summed)
    service_ms = service_ms if math.isfinite(service_ms) else 0.0
    cold_ms = cold_ms if math.isfinite(cold_ms) else 0.0
    predicted = f.predict(now_s)
    concurrency = predicted * (service_ms / 1000.0) / interval_s
    instances = math.ceil(concurrency * HEADROOM) \
        if predicted > 0 and math.isfinite(concurrency * HEADROOM) else 0
    if cold_ms <= COLD_THRESHOLD_MS:
        reason = f"cold start {cold_ms:.0f} ms <= {COLD_THRESHOLD_MS:.0f} ms: not worth it"
    elif f.confidence < MIN_CONFIDENCE:
        reason = f"confidence {f.confidence:.2f} < {MIN_CONFIDENCE}"
    elif instances <= warm_now:
        reason = f"{warm_now} warm, {instances} needed"
    else:
        reason = "pre-warm"
    return ModelOutlook(model, round(predicted, 3), round(f.confidence, 3),
                        round(concurrency, 4), cold_ms, instances, warm_now, reason)


def plan(outlooks: Sequence[ModelOutlook], workers: Sequence[WorkerView],
         held_off: frozenset[str] = frozenset()) -> list[Prewarm]:
    """Which worker warms which model: for each model marked ``pre-warm`` (most needed
    first), its missing instances on children of workers without it (each child an
    instance: :meth:`WorkerView.room`), a worker at a time in turn, most free memory
    first (a fleet's instances on several hosts, not all on the roomiest); each worker
    asked for at most one pre-warm per child a round; none of ``held_off``
    (:func:`missed`). A worker asked for ``k`` pre-warms of a model is named ``k``
    times."""
    asked: dict[str, int] = {}  # pre-warms per worker this round
    out: list[Prewarm] = []
    ranked = sorted(workers, key=lambda w: (-w.free_vram_bytes, w.hostname))
    for o in sorted(outlooks, key=lambda o: (o.warm_now - o.instances, o.model)):
        if o.reason != "pre-warm" or o.model in held_off:
            continue
        missing = o.instances - o.warm_now
        given: dict[str, int] = {}
        while missing > 0:
            takers = [w for w in ranked if given.get(w.hostname, 0) < w.room(o.model)
                      and asked.get(w.hostname, 0) < w.slots][:missing]
            if not takers:
                break
            for w in takers:
                out.append(Prewarm(o.model, w.hostname))
                given[w.hostname] = given.get(w.hostname, 0) + 1
                asked[w.hostname] = asked.get(w.hostname, 0) + 1
            missing -= len(takers)
    return out


#: Most intervals a model whose pre-warms keep missing is held off from planning.
MOST_HELD_OFF_INTERVALS = 16


def missed(sent: Sequence[Prewarm], workers: Sequence[WorkerView],
           misses: Mapping[str, tuple[int, float]], now_s: float, interval_s: float
           ) -> dict[str, tuple[int, float]]:
    """The models' pre-warm misses after the last pass's ``sent``: model -> (misses in a
    row, held off from planning until, s). A model sent to a worker that does not hold
    it warm now missed (its load failed, or it never ran): held off 1, 3, 7 ...
    intervals (up to :data:`MOST_HELD_OFF_INTERVALS`). A model that failed to load took
    the worker's one pre-warm a round at every pass, and models behind it by name were
    never pre-warmed. One warm where it was sent is forgotten."""
    out = dict(misses)
    views = {w.hostname: w for w in workers}
    for p in dict.fromkeys(sent):  # (several to one worker's children: one outcome)
        view = views.get(p.hostname)
        if view is not None and p.model in view.warm:
            out.pop(p.model, None)
            continue
        count = out.get(p.model, (0, 0.0))[0] + 1
        out[p.model] = (count, now_s + interval_s * min(2 ** count - 1,
                                                        MOST_HELD_OFF_INTERVALS))
    return out


def to_json(f: Forecaster) -> dict[str, Any]:
    return {"w": list(f.weights), "p": [list(r) for r in f.covariance],
            "h": list(f.history), "m": f.mean, "e": f.mse, "n": f.updates,
            "l": f.last_demand_s}


def from_json(raw: Mapping[str, Any]) -> Forecaster:
    """A stored state; a record of another shape starts over (no crash on old data)."""
    try:
        weights = tuple(float(v) for v in raw["w"])
        cov = tuple(tuple(float(v) for v in row) for row in raw["p"])
        if len(weights) != N_FEATURES or len(cov) != N_FEATURES \
                or any(len(row) != N_FEATURES for row in cov):
            return Forecaster()
        last = raw.get("l")  # (an older record has none: the clock starts now)
        updates = raw["n"]
        if isinstance(updates, bool) or not isinstance(updates, int) \
                or not 0 <= updates <= MAX_UPDATES:
            return Forecaster()
        state = Forecaster(weights, cov, tuple(float(v) for v in raw["h"])[:2],
                           float(raw["m"]), float(raw["e"]), updates,
                           None if last is None else float(last))
    except (KeyError, TypeError, ValueError, OverflowError):
        return Forecaster()
    # A state that diverged (stored before the covariance was kept bounded) predicted 0
    # for good: max(0, nan) is 0. It starts over instead, as does one with a negative
    # mean or error (a square root of it failed every pass) or a clock that is not one.
    sane = state.mean >= 0 and state.mse >= 0 and all(v >= 0 for v in state.history) \
        and (state.last_demand_s is None or math.isfinite(state.last_demand_s))
    return state if sane and _finite(state) else Forecaster()
