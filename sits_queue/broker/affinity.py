"""Affinity-aware pulling: a worker takes a task whose model it holds warm from near the
head of a queue, instead of always the head (the design card's "workers pull by
affinity"; MISSION §4.4: cold starts cut by sending work where its engine is warm).

With several workers on one stream, plain priority order hands every worker every model
in turn, so each worker's cache churns: the cold-start share is set by the stream, not
by the fleet's memory. Letting each worker prefer what it already holds makes the
workers specialise, so the fleet's caches together hold the working set.

What bounds the reordering (delay scheduling, Zaharia et al., EuroSys 2010):

* only the first :attr:`AffinityPolicy.window` waiting tasks are looked at;
* a task is taken ahead of the head only when its priority is at least the head's
  divided by :attr:`AffinityPolicy.priority_ratio` (classes differ by 10x in weight, so
  the default 2 keeps a lower class from jumping a higher one at nominal priority);
* once the head has been passed over for :attr:`AffinityPolicy.max_skip_s`, nobody
  passes it over again (the time counts from the first pick that passed it at the head,
  kept in the queue's ``skipped`` hash; counting from its enqueueing instead would
  switch affinity off in exactly the deep backlogs where it pays).

The weight of a warm model is 1 on the device and :attr:`AffinityPolicy.host_weight` in
the host shadow tier (a promotion is cheap but not free); a task whose ``prefix_key``
the worker holds KV for (``cache/prefix.py``: a shared prompt prefix it need not
prefill) adds :attr:`AffinityPolicy.prefix_weight`. The highest weight wins, the queue's
order breaks ties. A task that asks for a ``precision`` (§3.2) matches the engine held
at that precision (``<model>@<precision>``), and adds its precision's weight on this
worker (:func:`precision_weights`: the device's comparative advantage at it across the
fleet, so in a mixed fleet INT8 work drifts to the parts strongest at INT8 and FP16 work
to the FP16 ones; nothing in a fleet of one kind). A task that declares its
``arithmetic_intensity`` (§3.1, FLOP per byte) is memory-bound on a device below that
device's ridge point and compute-bound at or above it; its bound adds the device's
weight for that resource (:func:`roofline_weights`: how bandwidth-rich or compute-rich
the device is against the fleet, by its alpha), so memory-bound work (decoding) drifts
to the parts with the most bandwidth per FLOP and compute-bound work (prefill, encoders
over long batches) to those with the most FLOPs per byte. :func:`choose` is the reference of
what ``lua/pick.lua`` does inside Redis (the integration tests check they agree).

The warm set comes from the pool children's advertisements (a worker's pick cannot
choose which of its children runs the task, so it is the union of its children's
caches); the worker registers a source with :func:`set_warm_source`, producers and
plain consumers have none and pick plain priority order at no cost.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sits_queue.broker.keys import LEVELS_PER_E
from sits_queue.checks import is_positive
from sits_queue.spells import Spell

logger = logging.getLogger(__name__)

#: Cache tiers as the engine cache names them (``sits_queue.cache.policy.Tier``).
DEVICE_TIER = "device"
HOST_TIER = "host"
#: A model's affinity weight in a child that holds it on its device (the host tier's is
#: ``AffinityPolicy.host_weight``).
DEVICE_WEIGHT = 1.0


@dataclass(frozen=True)
class AffinityPolicy:
    #: Waiting tasks a pick looks at, head included; below 2 affinity is off.
    window: int = 16
    #: A task may be taken ahead of the head when its priority >= head's / this (>= 1).
    priority_ratio: float = 2.0
    #: The head is taken, whatever is warm, once picks have passed it over this long, s.
    max_skip_s: float = 1.0
    #: Weight of a model warm in the host tier; one on the device weighs 1.
    host_weight: float = 0.5
    #: Added for a task whose prompt prefix's KV the worker holds.
    prefix_weight: float = 0.5
    #: Most added for a task's precision on a device with an advantage at it (§3.2).
    precision_weight: float = 0.5
    #: Most added for a task's roofline bound on a device relatively rich in the
    #: resource that bounds it (§3.1).
    roofline_weight: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) \
                or not 0 <= self.window <= 1024:
            raise ValueError(f"affinity_window must be an integer in [0, 1024], got "
                             f"{self.window!r}")
        if not _finite(self.priority_ratio) or self.priority_ratio < 1:
            raise ValueError(f"affinity_priority_ratio must be >= 1, got "
                             f"{self.priority_ratio!r}")
        if not _finite(self.max_skip_s) or self.max_skip_s < 0:
            raise ValueError(f"affinity max_skip_s must be >= 0 s, got {self.max_skip_s!r}")
        if not _finite(self.host_weight) or not 0 <= self.host_weight <= 1:
            raise ValueError(f"affinity_host_weight must be in [0, 1], got "
                             f"{self.host_weight!r}")
        if not _finite(self.prefix_weight) or not 0 <= self.prefix_weight <= 10:
            raise ValueError(f"affinity_prefix_weight must be in [0, 10], got "
                             f"{self.prefix_weight!r}")
        if not _finite(self.precision_weight) or not 0 <= self.precision_weight <= 10:
            raise ValueError(f"affinity_precision_weight must be in [0, 10], got "
                             f"{self.precision_weight!r}")
        if not _finite(self.roofline_weight) or not 0 <= self.roofline_weight <= 10:
            raise ValueError(f"affinity_roofline_weight must be in [0, 10], got "
                             f"{self.roofline_weight!r}")

    @property
    def enabled(self) -> bool:
        return self.window >= 2


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


@dataclass(frozen=True)
class Candidate:
    """One waiting task near the head, as a pick sees it."""

    id: str
    #: Priority level (``keys.priority_level``): higher runs sooner.
    level: int
    model: str | None
    #: When a pick first passed it over at the head, unix s; None if none has.
    skipped_since_s: float | None = None
    #: This consumer released it and its hold has not run out: not to be taken.
    held: bool = False
    #: Its ``prefix_key`` (what its prompt starts with), if any.
    prefix: str | None = None
    #: The precision it asks its model to be served at, if any.
    precision: str | None = None
    #: Its declared ``arithmetic_intensity``, FLOP/byte, if any.
    intensity: float | None = None


def engine_key(model: str, precision: str | None) -> str:
    """The key a worker's cache holds ``model`` under at ``precision`` (as
    ``cache/precision.py`` names it)."""
    return model if precision is None else f"{model}@{precision}"


def model_of(key: str) -> str:
    """The model an engine key (:func:`engine_key`) serves, whatever its precision."""
    return key.partition("@")[0]


#: The roofline's two bounds (``workers/devices.py``'s ``Device.bound``).
MEMORY, COMPUTE = "memory", "compute"
#: The precision a task that names none is served at, for its ridge point: inference's
#: usual one (``Device.alpha`` is at it too).
DEFAULT_PRECISION = "fp16"


@dataclass(frozen=True)
class Warm:
    """What a worker holds, as affinity weights: models (engine keys, by tier), prompt
    prefixes (by ``prefix_key``), precisions (its device's advantage at each) and the
    roofline's bounds (:func:`bound_key`, ``memory@fp16``: how rich its device is in
    each resource against the fleet, at each precision), with the ridge points
    (FLOP/byte, per precision) that tell a task's bound here. Only positive weights are
    kept."""

    models: Mapping[str, float] = field(default_factory=dict)
    prefixes: Mapping[str, float] = field(default_factory=dict)
    precisions: Mapping[str, float] = field(default_factory=dict)
    bounds: Mapping[str, float] = field(default_factory=dict)
    ridges: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("models", "prefixes", "precisions", "bounds", "ridges"):
            object.__setattr__(self, name,
                               {k: w for k, w in getattr(self, name).items() if w > 0})
        if not self.ridges:  # (a bound no task can be told to have weighs nothing)
            object.__setattr__(self, "bounds", {})

    def __bool__(self) -> bool:
        return bool(self.models or self.prefixes or self.precisions or self.bounds)

    @property
    def top(self) -> float:
        """The largest weight a task can have here (model + prefix + precision + bound)."""
        return max(self.models.values(), default=0.0) + \
            max(self.prefixes.values(), default=0.0) + \
            max(self.precisions.values(), default=0.0) + \
            max(self.bounds.values(), default=0.0)

    def bound(self, intensity: float | None, precision: str | None = None) -> str | None:
        """A task's roofline bound on this device: ``memory`` below the ridge point at
        its precision, ``compute`` at or above it; None without an intensity or a ridge
        point at that precision."""
        ridge = self.ridges.get(precision or DEFAULT_PRECISION)
        if intensity is None or ridge is None:
            return None
        return MEMORY if intensity < ridge else COMPUTE

    def weight(self, model: str | None, prefix: str | None,
               precision: str | None = None, intensity: float | None = None) -> float:
        """The task's weight here: its engine held (at its precision), its prompt
        prefix's KV (where that engine is), its precision's and its bound's weights."""
        held = self.models.get(engine_key(model, precision), 0.0) if model is not None \
            else 0.0
        # A prompt prefix's KV is reused by the engine that holds it only: counted where
        # the task's engine is warm here (a template shared by several models pulled a
        # task for a model this worker does not hold, to a cold start, "by affinity")
        kv = self.prefixes.get(prefix, 0.0) if prefix is not None and held > 0 else 0.0
        bound = self.bound(intensity, precision) if self.bounds else None
        return held + kv + \
            (self.precisions.get(precision, 0.0) if precision is not None else 0.0) + \
            (self.bounds.get(bound_key(bound, precision), 0.0) if bound is not None else 0.0)


def bound_key(bound: str, precision: str | None) -> str:
    """A bound's weight's key in :attr:`Warm.bounds`: ``memory@fp16`` (the device's
    richness in a resource is weighed at the precision the task runs at)."""
    return f"{bound}@{precision or DEFAULT_PRECISION}"


def warm_weights(warm_maps: Iterable[Mapping[str, Any]], host_weight: float
                 ) -> dict[str, float]:
    """Model -> affinity weight, from each child's ``{model: tier}``; the best child's."""
    weights: dict[str, float] = {}
    for warm in warm_maps:
        for model, tier in warm.items():
            w = DEVICE_WEIGHT if tier == DEVICE_TIER else host_weight if tier == HOST_TIER else 0.0
            if w > weights.get(model, 0.0):
                weights[model] = w
    return weights


def warm_of(children: Iterable[Mapping[str, Any]], policy: AffinityPolicy,
            precisions: Mapping[str, float] | None = None,
            roofline: Roofline | None = None) -> Warm:
    """A worker's :class:`Warm` from its children's advertised records: ``warm``
    (engine key -> tier) and ``kv_keys`` (prefix keys whose KV the child holds), with
    its ``precisions`` weights (:func:`precision_weights`) and ``roofline``
    (:func:`roofline_weights`)."""
    records = [c for c in children if isinstance(c, Mapping)]
    models = warm_weights((_serving(c) for c in records if isinstance(c.get("warm"), Mapping)),
                          policy.host_weight)
    keys = {str(k) for c in records if isinstance(c.get("kv_keys"), list)
            for k in c["kv_keys"]}
    roof = roofline or NO_ROOFLINE
    return Warm(models, dict.fromkeys(sorted(keys), policy.prefix_weight),
                dict(precisions or {}), dict(roof.bounds), dict(roof.ridges))


def _serving(child: Mapping[str, Any]) -> dict[str, Any]:
    """A child's warm map (engine key -> tier) with the keys it serves from another
    entry (its ``serves``: ``gpt@int8`` by ``gpt@fp16`` on a GPU) at that entry's tier."""
    warm = dict(child["warm"])
    serves = child.get("serves")
    for asked, served in (serves.items() if isinstance(serves, Mapping) else ()):
        if isinstance(asked, str) and served in warm:
            warm.setdefault(asked, warm[served])
    return warm


def precision_profile(peaks: Mapping[str, float]) -> dict[str, float]:
    """Each precision's peak throughput as a share of the device's best (1 at its best
    precision); empty for a device without figures (a CPU)."""
    top = max((v for v in peaks.values() if _finite(v) and v > 0), default=0.0)
    return {p: v / top for p, v in peaks.items() if top and _finite(v) and v > 0}


#: Least advantage over the fleet that weighs anything (precision share, bandwidth per
#: FLOP): less is datasheet rounding and boost clocks, not a difference between parts
#: (an L4's fp16 of 121 TFLOP/s beside its int8 of 242.5 gave an A100 an fp16 weight of
#: 0.0005, and every fp16 task went ahead of plain ones at equal priority).
MIN_ADVANTAGE = 0.1


def _advantage_weight(weight: float, advantage: float) -> float:
    return round(weight * min(1.0, advantage), 6) if advantage >= MIN_ADVANTAGE else 0.0


def precision_weights(own: Mapping[str, float], fleet: Sequence[Mapping[str, float]],
                      weight: float) -> dict[str, float]:
    """§3.2, matching precisions to devices: this worker's weight per precision, from
    its device's peak throughput per precision (``own``) and every live worker's
    (``fleet``, own included).

    Comparative advantage: a device's profile (:func:`precision_profile`) against the
    fleet's mean profile; a precision it is relatively stronger at than the fleet gets
    up to ``weight`` (at twice the mean share and beyond), the rest nothing. So a T4
    (INT8 twice its FP16) next to V100s (no INT8 tensor cores) pulls the INT8 tasks, the
    V100s the FP16 ones; a fleet of one kind gets no weights (nothing to match).
    """
    mine = precision_profile(own)
    # (a worker without figures, a CPU's, is no device to match against: counted as all
    # zeros, it gave every GPU of a fleet of one kind weights for every precision)
    profiles = [p for p in (precision_profile(peaks) for peaks in fleet) if p] or [mine]
    out: dict[str, float] = {}
    for precision, share in mine.items():
        mean = sum(p.get(precision, 0.0) for p in profiles) / len(profiles)
        w = _advantage_weight(weight, share / mean - 1 if mean > 0 else 0.0)
        if w > 0:
            out[precision] = w
    return out


@dataclass(frozen=True)
class Roofline:
    """A worker's roofline figures for picks (§3.1): its device's ridge point per
    precision (FLOP/byte, at the precision a task asking for it is served at) and the
    weight of each bound at each precision (:func:`bound_key`, :func:`roofline_weights`)."""

    ridges: Mapping[str, float] = field(default_factory=dict)
    bounds: Mapping[str, float] = field(default_factory=dict)


NO_ROOFLINE = Roofline()


def ridge_points(peaks_tflops: Mapping[str, float], bandwidth_gb_s: float | None
                 ) -> dict[str, float]:
    """Ridge point per precision, FLOP/byte (``peak / bandwidth``), from datasheet peaks
    in TFLOP/s and the memory bandwidth in GB/s; empty where the bandwidth is unknown."""
    if not is_positive(bandwidth_gb_s):
        return {}
    return {p: round(v * 1e12 / (bandwidth_gb_s * 1e9), 6) for p, v in peaks_tflops.items()
            if is_positive(v)}


def roofline_weights(own_ridge: float | None, fleet_ridges: Sequence[float | None],
                     weight: float) -> dict[str, float]:
    """§3.1, roofline placement: this worker's weight per bound (``memory``,
    ``compute``) at one precision, from its device's ridge point at it and every live
    worker's (own included; None: unknown, a CPU's).

    By alpha (bandwidth per FLOP, ``word_size / ridge``) against the fleet's geometric
    mean: a device with more bandwidth per FLOP than the mean weighs memory-bound tasks
    (up to ``weight`` at twice the mean and beyond), one with less weighs compute-bound
    ones as much. So an H200 beside L4s takes the decoding, the L4s the long-prompt
    encoding; a fleet of one kind weighs neither (nothing to match). Advantages under
    :data:`MIN_ADVANTAGE` weigh nothing."""
    known = [r for r in fleet_ridges if is_positive(r)]
    if not is_positive(own_ridge) or not known:
        return {}
    # (alphas' ratios are the ridges' inverted: the word size cancels)
    mean = math.exp(sum(math.log(r) for r in known) / len(known))
    out: dict[str, float] = {}
    for bound, richer in ((MEMORY, mean / own_ridge), (COMPUTE, own_ridge / mean)):
        w = _advantage_weight(weight, richer - 1)
        if w > 0:
            out[bound] = w
    return out


#: What a level may fall short of :func:`min_level` and still be taken: levels are whole,
#: the floor's rounding error (pick.lua's, which has no log1p and expm1) ~1e-9 of one; at a
#: ratio of 1 the floor is the head's own level, and Lua's came out a hair above it.
FLOOR_SLACK = 1e-6


def min_level(head_level: int, ratio: float) -> float:
    """The lowest level a task may have to be taken ahead of a head at ``head_level``:
    that of the head's priority divided by ``ratio`` (levels are ``log1p(p) * 2**17``)."""
    head_priority = math.expm1(head_level / LEVELS_PER_E)
    return math.log1p(head_priority / ratio) * LEVELS_PER_E


def choose(candidates: Sequence[Candidate], warm: Warm, policy: AffinityPolicy,
           now_s: float) -> int:
    """Index in ``candidates`` (queue order, head first) of the task to take.

    0, the head, unless affinity is off, nothing is warm, the head is as warm as anything
    can be, it is held, or picks have passed it over for
    :attr:`~AffinityPolicy.max_skip_s`. Otherwise the warmest candidate within the
    window and the priority ratio, earliest on ties (and whoever applies the choice
    stamps the head's ``skipped_since_s`` if it has none).
    """
    if not policy.enabled or len(candidates) < 2 or not warm:
        return 0
    head = candidates[0]
    top = warm.top
    best_w = warm.weight(head.model, head.prefix, head.precision, head.intensity)
    if head.held or best_w >= top:
        return 0
    since = head.skipped_since_s
    # (a stamp no pick of this clock wrote, inf, nan or ahead of now, is none: as pick.lua)
    if since is not None and math.isfinite(since) and since <= now_s \
            and now_s - since >= policy.max_skip_s:
        return 0
    floor = min_level(head.level, policy.priority_ratio) - FLOOR_SLACK
    best = 0
    for i, cand in enumerate(candidates[1:policy.window], start=1):
        if cand.level < floor:
            break  # queue order: every later one ranks lower still
        w = warm.weight(cand.model, cand.prefix, cand.precision, cand.intensity)
        if not cand.held and w > best_w:
            best, best_w = i, w
            if w >= top:
                break
    return best


def lua_args(policy: AffinityPolicy, warm: Warm) -> list[Any]:
    """``pick.lua``'s affinity arguments (after its first four); empty when off.

    Weights go as ``m:<engine key>``, ``p:<prefix key>``, ``q:<precision>`` and
    ``r:<bound>@<precision>`` pairs (namespaces: a model may be named like a key), ridge points as
    ``z:<precision>`` pairs (not weights), sent only with a bound's weight."""
    if not policy.enabled or not warm:
        return []
    args: list[Any] = [policy.window, repr(float(policy.priority_ratio)),
                       repr(float(policy.max_skip_s))]
    for space, weights in (("m:", warm.models), ("p:", warm.prefixes),
                           ("q:", warm.precisions), ("r:", warm.bounds),
                           ("z:", warm.ridges if warm.bounds else {})):
        for name, w in sorted(weights.items()):
            args += [space + name, repr(float(w))]
    return args


# -- the worker's warm set, for the transport (process-wide: one worker per process) ------

WarmSource = Callable[[], Warm]
_source: list[WarmSource] = []


def set_warm_source(source: WarmSource | None) -> None:
    """The worker's main process registers where its children's warm set is read
    (``workers.warmreader.WarmReader``); None unregisters it."""
    _source.clear()
    if source is not None:
        _source.append(source)


#: What a consumer without a warm source holds (one object, so callers can cache on it).
NOTHING_WARM = Warm()


def warm_now() -> Warm:
    """The registered source's weights (the same object until it reads again); empty
    without one (producers, plain consumers), and where the source fails: affinity is an
    optimisation, and an error here, raised in the pick, stopped the worker's intake."""
    if not _source:
        return NOTHING_WARM
    try:
        warm = _source[0]()
    except Exception:
        # (with its traceback, once: every pick would meet it again)
        _unreadable.failed("warm set unreadable; picking without affinity", exc_info=True)
        return NOTHING_WARM
    _unreadable.over()
    return warm


#: The warm source's failures, said once a spell.
_unreadable = Spell(logger, logging.ERROR)


def invalidate() -> None:
    """A task finished (acked): its child has just published what it now holds."""
    if _source:
        stale = getattr(_source[0], "invalidate", None)
        if stale is not None:
            stale()
