"""Pure statistics behind the priority snapshot and the §2.2 recompute triggers.

Inputs are plain sequences and mappings read from Redis by a thin adapter. Samples that
are not finite numbers (NaN, inf), or past a year, are dropped rather than raised on:
one corrupt sample written by a dying worker must not stop every rescoring pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

#: Counts below this are dropped (``prune_hot.lua``; :func:`decay_counts` in tests):
#: keeps the table small.
MIN_COUNT = 0.01
#: Samples beyond this, ms (a year), are dropped as corrupt, like non-finite ones.
MAX_SAMPLE_MS = 365 * 86_400_000.0

#: §2.2: RTT off its baseline by more than this fraction fires "rtt".
RTT_TOLERANCE = 0.15
#: ...and by more than this much, ms: on loopback a 0.1 ms PING jitters by 15% every
#: sample, which is noise, not a route change.
RTT_FLOOR_MS = 1.0
#: §2.2: loss above its baseline by more than this (absolute fraction) counts as a rise.
LOSS_RISE = 0.05
#: §2.2: consecutive rising samples, samples, before "loss" fires.
LOSS_SAMPLES = 3
#: §2.2: the high queue's oldest task waiting longer than this, ms, fires "backlog".
BACKLOG_MS = 200.0
#: EWMA gain of the baselines, per sample: ~5 samples of memory, fast enough to follow a
#: route change, slow enough that one spike does not become the new normal.
BASELINE_ALPHA = 0.2

TRIGGER_RTT = "rtt"
TRIGGER_LOSS = "loss"
TRIGGER_BACKLOG = "backlog"


def _finite(values: Iterable[float]) -> list[float]:
    # A sample past a year is no latency (a foreign producer's submission time of -1e305
    # gives one of 1e308 ms: finite, but the jitter's sum of two overflowed to inf and
    # every pass failed until 512 newer samples pushed it out).
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)
            and abs(v) <= MAX_SAMPLE_MS]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank ``q``-th percentile (``q`` in [0, 100]); None when there are no samples."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    ordered = sorted(_finite(values))
    if not ordered:
        return None
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[max(rank, 1) - 1]


def p95(values: Sequence[float]) -> float | None:
    """95th percentile, nearest rank (the §2.1 ``observed_p95_ms`` when given latencies)."""
    return percentile(values, 95)


def jitter_ms(latencies: Sequence[float]) -> float:
    """Mean absolute difference of successive samples (RFC 3550 style, unsmoothed), ms."""
    samples = _finite(latencies)
    if len(samples) < 2:
        return 0.0
    return sum(abs(b - a) for a, b in pairwise(samples)) / (len(samples) - 1)


def smoothed_counts(previous: Mapping[str, float], deltas: Mapping[str, float],
                    factor: float) -> dict[str, float]:
    """Recency-weighted counts: ``previous`` faded by ``factor``, plus this window's
    ``deltas`` (a negative or non-finite one, a counter reset or misread, adds nothing);
    those under :data:`MIN_COUNT` are dropped."""
    def ok(value: float) -> float:
        return value if isinstance(value, (int, float)) and math.isfinite(value) \
            and value > 0 else 0.0

    out = {}
    for name in set(previous) | set(deltas):
        value = ok(previous.get(name, 0.0)) * factor + ok(deltas.get(name, 0.0))
        if value >= MIN_COUNT:
            out[name] = value
    return out


def bandwidth_compliance(completed: float, submitted: float) -> float:
    """Share of submitted work completed, ``min(1, completed / submitted)``; 1.0 if idle.

    Counts are window deltas of Redis counters; a negative or non-finite delta means a
    counter was reset or misread, which is no evidence of a shortfall, so it gives 1.0.
    """
    counts_ok = all(math.isfinite(v) and v >= 0 for v in (completed, submitted))
    if not counts_ok or submitted == 0:
        return 1.0
    return min(1.0, completed / submitted)


def hotness(counts: Mapping[str, float]) -> dict[str, float]:
    """§1.3 model hotness: each count over the largest, in [0, 1].

    Non-finite or negative counts score 0; all-zero counts give all-zero hotness.
    """
    clean = {m: c if math.isfinite(c) and c > 0 else 0.0 for m, c in counts.items()}
    top = max(clean.values(), default=0.0)
    if top <= 0:
        return dict.fromkeys(clean, 0.0)
    return {m: c / top for m, c in clean.items()}


def decay_factor(elapsed_s: float, period_s: float, per_period: float) -> float:
    """What ``per_period`` (the decay of one ``period_s``) comes to over ``elapsed_s``, in
    [0, 1]: passes come at the beat's pace and also whenever a trigger fires (every
    check, under a standing backlog), so counts age by time, not by passes. An elapsed
    time that cannot be read (no earlier pass, a clock gone back) counts one period."""
    if not (0 < per_period <= 1 and period_s > 0):
        raise ValueError(f"need 0 < per_period <= 1 and period_s > 0, got "
                         f"{per_period!r}, {period_s!r}")
    if not math.isfinite(elapsed_s) or elapsed_s < 0:
        elapsed_s = period_s
    return float(per_period ** (elapsed_s / period_s))


def decay_counts(counts: Mapping[str, float], factor: float) -> dict[str, float]:
    """Age call counts by ``factor`` in (0, 1]; drop those that fall below :data:`MIN_COUNT`."""
    if not 0 < factor <= 1:
        raise ValueError(f"factor must be in (0, 1], got {factor!r}")
    decayed = {m: c * factor for m, c in counts.items() if math.isfinite(c)}
    return {m: c for m, c in decayed.items() if c >= MIN_COUNT}


# -- §2.2 recompute triggers ---------------------------------------------------------------
@dataclass(frozen=True)
class TriggerState:
    """What the trigger check remembers between samples (stored by the beat adapter)."""

    #: EWMA of round-trip time, ms; None before the first sample.
    rtt_baseline_ms: float | None = None
    #: EWMA of loss rate, fraction; None before the first sample.
    loss_baseline: float | None = None
    #: Consecutive samples with loss above baseline + rise, samples.
    loss_streak: int = 0


@dataclass(frozen=True)
class TriggerSample:
    """One reading of the network and the high-priority queue."""

    #: Round-trip time to Redis / peer site, ms.
    rtt_ms: float
    #: Loss rate in [0, 1]; None when no task finished since the last sample (no reading:
    #: the loss streak and baseline stay as they were).
    loss_rate: float | None
    #: Age of the oldest task in the high-priority queue, ms; None when it is empty.
    oldest_high_wait_ms: float | None

    def __post_init__(self) -> None:
        if not math.isfinite(self.rtt_ms) or self.rtt_ms < 0:
            raise ValueError(f"rtt_ms must be finite and >= 0, got {self.rtt_ms!r}")
        if self.loss_rate is not None and not 0 <= self.loss_rate <= 1:  # NaN too
            raise ValueError(f"loss_rate must be in [0, 1], got {self.loss_rate!r}")
        wait = self.oldest_high_wait_ms
        if wait is not None and not (math.isfinite(wait) and wait >= 0):
            raise ValueError(f"oldest_high_wait_ms must be finite and >= 0, got {wait!r}")


def _ewma(baseline: float, sample: float, alpha: float) -> float:
    return (1 - alpha) * baseline + alpha * sample


def _names(**hits: bool) -> tuple[str, ...]:
    return tuple(name for name, hit in hits.items() if hit)


def evaluate_triggers(
    state: TriggerState,
    sample: TriggerSample,
    rtt_tolerance: float = RTT_TOLERANCE,
    rtt_floor_ms: float = RTT_FLOOR_MS,
    loss_rise: float = LOSS_RISE,
    loss_samples: int = LOSS_SAMPLES,
    backlog_ms: float = BACKLOG_MS,
    baseline_alpha: float = BASELINE_ALPHA,
) -> tuple[tuple[str, ...], TriggerState]:
    """Which §2.2 recompute triggers fire for ``sample`` (in the order rtt, loss, backlog),
    and the state to keep.

    The first sample only sets the baselines ("backlog" needs none and may still fire).
    "loss" fires after ``loss_samples`` consecutive rises, then its streak restarts. While
    a loss streak builds the loss baseline is held, so a sustained rise is measured
    against the level before it rather than absorbed by the EWMA before it can fire.
    """
    if not 0 < baseline_alpha <= 1:
        raise ValueError(f"baseline_alpha must be in (0, 1], got {baseline_alpha!r}")
    wait = sample.oldest_high_wait_ms
    backlog = wait is not None and wait > backlog_ms
    rtt_base, loss_base = state.rtt_baseline_ms, state.loss_baseline
    if rtt_base is None:
        first = TriggerState(rtt_baseline_ms=sample.rtt_ms, loss_baseline=sample.loss_rate)
        return _names(backlog=backlog), first
    # Multiplied out, not divided: a zero baseline (loopback) must not divide by zero.
    rtt = abs(sample.rtt_ms - rtt_base) > max(rtt_tolerance * rtt_base, rtt_floor_ms)
    rtt_next = _ewma(rtt_base, sample.rtt_ms, baseline_alpha)
    if sample.loss_rate is None:
        # No task finished since the last sample: no loss reading. (Read as "no loss",
        # it reset the streak: a 100% failure rate at fewer than one completion a check
        # never fired.)
        return _names(rtt=rtt, backlog=backlog), TriggerState(
            rtt_baseline_ms=rtt_next, loss_baseline=loss_base, loss_streak=state.loss_streak)
    if loss_base is None:  # the first loss reading only sets its baseline
        return _names(rtt=rtt, backlog=backlog), TriggerState(
            rtt_baseline_ms=rtt_next, loss_baseline=sample.loss_rate)
    rising = sample.loss_rate - loss_base > loss_rise
    streak = state.loss_streak + 1 if rising else 0
    loss = streak >= loss_samples
    held = rising and not loss
    new_state = TriggerState(
        rtt_baseline_ms=rtt_next,
        loss_baseline=loss_base if held else _ewma(loss_base, sample.loss_rate, baseline_alpha),
        loss_streak=0 if loss else streak,
    )
    return _names(rtt=rtt, loss=loss, backlog=backlog), new_state
