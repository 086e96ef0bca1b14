"""Dynamic batch size (MISSION §1.2) and the throughput/latency Pareto frontier (§2.4).

The source sketches ``ewma_latency = average(latency_history, weights=exp(linspace(-1, 0,
n)))`` over the last 64 batches and ``batch = clamp(int(available*1024 / (ewma_latency *
0.8)), 1, 256)`` with a p95 target of 120 ms. That formula mixes bytes and milliseconds;
what it asks for is a controller that keeps a batch's p95 latency under the target while
maximising throughput, within free memory. Throughput does not always grow with the
batch (past a size the working set falls out of cache and each item gets slower), so
"the largest batch under the target" is not the same thing. This controller:

* keeps the last :attr:`BatchPolicy.window` batches (size, latency, bytes per item),
  weighed by recency with the source's ``exp(linspace(-1, 0, n))``;
* for each power-of-two size in [1, 256] seen in the window: its recency-weighted p95
  latency and its throughput (items over weighted mean latency);
* runs the size with the most throughput among those whose p95 meets the target and
  whose items fit in ``free memory - reserved`` (bytes per item measured);
* explores one size up from there when that size is not in the window and would stay
  within 1.5x the target if latency grew in proportion (latency grows less than the
  batch while the device has spare parallelism, so "within the target" would never
  probe the sizes that pay; a probe costs one batch, the window forgets, so sizes are
  re-probed as conditions change), and steps down when even the chosen size no longer
  meets it;
* when even one item misses the target (a large model, long inputs, a CPU or a busy
  device), the target cannot be met at any size: it then keeps within :data:`RELAX`
  times one item's latency instead (the *floor*), which lets the batch grow while the
  device has spare parallelism; at size 1 for good, an encoder whose one item takes
  150 ms ran at 1/60 of its throughput. The floor is measured again (the controller
  steps down to it) every :data:`FLOOR_TTL_BATCHES` batches, so a target that becomes
  reachable is met again.

Pure functions over frozen dataclasses; the caller measures and applies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

MIN_BATCH = 1
MAX_BATCH = 256
#: The sizes the controller chooses among.
SIZES = tuple(2 ** i for i in range(9))
#: When one item alone misses the target: how much slower than one item a batch may be.
RELAX = 1.5
#: Batches a measured floor holds before it is measured again.
FLOOR_TTL_BATCHES = 256


@dataclass(frozen=True)
class BatchPolicy:
    #: The p95 latency one batch may take, ms (the source's default).
    target_p95_ms: float = 120.0
    #: Batches remembered (the source's 64).
    window: int = 64
    #: Memory kept free besides the batch, bytes.
    reserved_bytes: int = 0
    #: Size of the first batch, before anything is measured.
    start: int = 8

    def __post_init__(self) -> None:
        if not self.target_p95_ms > 0 or self.window < 2:
            raise ValueError("target_p95_ms must be > 0 and window >= 2")
        if self.start not in SIZES or self.reserved_bytes < 0:
            raise ValueError(f"start must be one of {SIZES}, reserved_bytes >= 0")


@dataclass(frozen=True)
class Sample:
    size: int
    latency_ms: float
    #: Memory one item of the batch took (peak over the batch / size), bytes; 0 unknown.
    bytes_per_item: float = 0.0


@dataclass(frozen=True)
class BatchState:
    samples: tuple[Sample, ...] = ()
    #: One item's p95 latency, ms, when it missed the target (None: it met it, or it is
    #: not measured), and the batches run since it was.
    floor_ms: float | None = None
    floor_age: int = 0


def recency_weights(n: int) -> list[float]:
    """The source's ``exp(linspace(-1, 0, n))``: the newest sample weighs e times the
    oldest."""
    if n == 1:
        return [1.0]
    return [math.exp(-1.0 + i / (n - 1)) for i in range(n)]


def ewma_latency(samples: Sequence[Sample]) -> float:
    """The source's recency-weighted mean batch latency, ms (0 with no samples)."""
    if not samples:
        return 0.0
    weights = recency_weights(len(samples))
    return sum(w * s.latency_ms for w, s in zip(weights, samples, strict=True)) / sum(weights)


def observe(state: BatchState, sample: Sample, policy: BatchPolicy) -> BatchState:
    """The state after one measured batch."""
    samples = (*state.samples, sample)[-policy.window:]
    if sample.size <= MIN_BATCH:
        one = size_stats(samples)[MIN_BATCH].p95_ms
        return BatchState(samples, one if one > policy.target_p95_ms else None)
    if state.floor_ms is None or state.floor_age + 1 >= FLOOR_TTL_BATCHES:
        return BatchState(samples)
    return BatchState(samples, state.floor_ms, state.floor_age + 1)


@dataclass(frozen=True)
class SizeStats:
    size: int
    n: int
    p95_ms: float
    throughput: float  # items per second


def size_stats(samples: Sequence[Sample]) -> dict[int, SizeStats]:
    """Per power-of-two size (a batch counts for the largest one at or below it), the
    recency-weighted p95 latency and throughput over the window."""
    weights = recency_weights(len(samples)) if samples else []
    groups: dict[int, list[tuple[float, float, int]]] = {}
    for w, s in zip(weights, samples, strict=True):
        bucket = max(b for b in SIZES if b <= max(MIN_BATCH, s.size))
        groups.setdefault(bucket, []).append((s.latency_ms, w, s.size))
    out = {}
    for size, rows in groups.items():
        total = sum(w for _, w, _ in rows)
        mean = sum(lat * w for lat, w, _ in rows) / total
        items = sum(n * w for _, w, n in rows) / total
        out[size] = SizeStats(size, len(rows), _weighted_p95(rows, total),
                              items / (mean / 1000.0) if mean > 0 else math.inf)
    return out


def _weighted_p95(rows: list[tuple[float, float, int]], total: float) -> float:
    seen = 0.0
    for latency, w, _ in sorted(rows):
        seen += w
        if seen >= 0.95 * total:
            return latency
    return max(lat for lat, _, _ in rows)


def memory_cap(samples: Sequence[Sample], free_bytes: int | None, policy: BatchPolicy) -> int:
    """The most items that fit in ``free - reserved`` at the largest bytes per item seen
    recently; :data:`MAX_BATCH` when memory is unknown."""
    per_item = max((s.bytes_per_item for s in samples), default=0.0)
    if free_bytes is None or per_item <= 0:
        return MAX_BATCH
    available = free_bytes - policy.reserved_bytes
    return max(MIN_BATCH, min(MAX_BATCH, int(available // per_item)))


def next_batch(state: BatchState, free_bytes: int | None, policy: BatchPolicy) -> int:
    """The size of the next batch (see the module's description)."""
    cap = memory_cap(state.samples, free_bytes, policy)
    stats = size_stats(state.samples)
    if not stats:
        return min(cap, policy.start)
    target = policy.target_p95_ms
    if state.floor_ms is not None:  # even one item misses it: within RELAX of one item
        target = max(target, state.floor_ms * RELAX)
    feasible = [s for s in stats.values() if s.p95_ms <= target and s.size <= cap]
    if not feasible:  # step down from the smallest size measured
        return max(MIN_BATCH, min(cap, min(stats) // 2))
    best = max(feasible, key=lambda s: (s.throughput, -s.size))
    up = best.size * 2
    if up <= min(cap, MAX_BATCH) and up not in stats and best.p95_ms * 2 <= target * 1.5:
        return up  # a probe: it may fit, and it may be faster
    return min(best.size, cap)


# -- the Pareto frontier (§2.4) ------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    """One measured operating point."""

    batch: int
    throughput: float
    p99_ms: float
    pareto: bool = False


def pareto(points: Sequence[Point]) -> list[Point]:
    """The points, each marked Pareto-optimal when no other point has at least its
    throughput and at most its p99 with one of them strictly better: the brief's "no
    other point has both higher throughput and lower latency", with ties decided as
    Pareto dominance decides them (equal throughput at a higher p99 is dominated)."""
    out = []
    for p in points:
        dominated = any(q.throughput >= p.throughput and q.p99_ms <= p.p99_ms
                        and (q.throughput > p.throughput or q.p99_ms < p.p99_ms)
                        for q in points)
        out.append(replace(p, pareto=not dominated))
    return out


class Batcher:
    """The controller's state for one model in one pool child (the thin stateful shell
    around :func:`observe` / :func:`next_batch`)."""

    def __init__(self, policy: BatchPolicy | None = None) -> None:
        self.policy = policy or BatchPolicy()
        self.state = BatchState()

    def size(self, free_bytes: int | None) -> int:
        return next_batch(self.state, free_bytes, self.policy)

    def record(self, sample: Sample) -> None:
        self.state = observe(self.state, sample, self.policy)
