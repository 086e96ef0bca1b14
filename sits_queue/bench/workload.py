"""Seeded mixed workloads and the statistics the benchmarks report. Pure: no I/O."""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Class mix of the A/B workload (issue #2): 10% high, 20% medium, 70% low.
CLASS_MIX = (("high", 0.10), ("medium", 0.20), ("low", 0.70))
#: Service time distribution: lognormal around this median, ms, clipped to the bounds.
SERVICE_MEDIAN_MS = 40.0
SERVICE_SIGMA = 0.5
SERVICE_BOUNDS_MS = (5.0, 400.0)


@dataclass(frozen=True)
class Job:
    index: int
    sla_class: str
    arrival_s: float  # offset from the start of the run
    service_ms: float
    context_tokens: int


@dataclass(frozen=True)
class Workload:
    seed: int
    jobs: tuple[Job, ...]
    concurrency: int
    load_factor: float

    @property
    def duration_s(self) -> float:
        return self.jobs[-1].arrival_s if self.jobs else 0.0


def mean_service_ms(rng_seed: int = 0, samples: int = 20_000) -> float:
    """Mean of the clipped lognormal, by sampling (the clip makes the closed form messy)."""
    rng = random.Random(rng_seed)
    return sum(_service(rng) for _ in range(samples)) / samples


def _service(rng: random.Random) -> float:
    lo, hi = SERVICE_BOUNDS_MS
    return min(hi, max(lo, rng.lognormvariate(math.log(SERVICE_MEDIAN_MS), SERVICE_SIGMA)))


def mixed_workload(seed: int, n_jobs: int, concurrency: int, load_factor: float = 1.5
                   ) -> Workload:
    """Poisson arrivals at ``load_factor`` x what ``concurrency`` slots can serve."""
    rng = random.Random(seed)
    capacity_tps = concurrency / (mean_service_ms(seed) / 1000)
    rate = capacity_tps * load_factor
    names = [name for name, _ in CLASS_MIX]
    weights = [share for _, share in CLASS_MIX]
    t = 0.0
    jobs = []
    for i in range(n_jobs):
        t += rng.expovariate(rate)
        jobs.append(Job(index=i, sla_class=rng.choices(names, weights)[0], arrival_s=t,
                        service_ms=_service(rng), context_tokens=rng.choice((128, 512, 2048))))
    return Workload(seed=seed, jobs=tuple(jobs), concurrency=concurrency,
                    load_factor=load_factor)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True)
class Completion:
    sla_class: str
    wait_ms: float
    submitted_s: float
    finished_s: float


def summarise(completions: Iterable[Completion], classes: Sequence[str]) -> dict[str, object]:
    """Per-class wait statistics and overall throughput of one system's run."""
    done = list(completions)
    out: dict[str, object] = {}
    for name in classes:
        waits = [c.wait_ms for c in done if c.sla_class == name]
        out[name] = {"n": len(waits), "p50_wait_ms": round(percentile(waits, 50), 1),
                     "p99_wait_ms": round(percentile(waits, 99), 1),
                     "max_wait_ms": round(max(waits, default=0.0), 1)}
    if done:
        span = max(c.finished_s for c in done) - min(c.submitted_s for c in done)
        out["throughput_tps"] = round(len(done) / span, 2) if span > 0 else 0.0
    else:
        out["throughput_tps"] = 0.0
    return out


def ideal_priority_schedule(workload: Workload, class_order: Sequence[str]) -> list[Completion]:
    """The best non-preemptive schedule for the first class of ``class_order``: strict
    class priority, FIFO within a class, ``workload.concurrency`` slots that never idle
    while work waits, and zero dispatch cost.

    With the arrivals and service times fixed, no work-conserving scheduler that runs
    tasks to completion starts a top-class task sooner: each one starts the moment a slot
    frees after its arrival (or after the top-class tasks before it). Its waits are the
    floor for what a real broker can show on this workload; beating them takes
    preemption or keeping slots idle for the top class, at a cost in throughput.
    """
    rank = {name: i for i, name in enumerate(class_order)}
    free = [0.0] * workload.concurrency  # when each slot frees, a heap
    waiting: list[tuple[int, float, int, Job]] = []
    jobs = sorted(workload.jobs, key=lambda j: j.arrival_s)
    done: list[Completion] = []
    i, now = 0, 0.0
    while i < len(jobs) or waiting:
        # Slots are taken in the order they free; never before a moment already reached
        # (an idle slot's jump to the next arrival moved the clock for every slot).
        t = now = max(now, heapq.heappop(free))
        if not waiting:  # the slot idles until the next arrival
            t = now = max(t, jobs[i].arrival_s)
        while i < len(jobs) and jobs[i].arrival_s <= t:
            job = jobs[i]
            heapq.heappush(waiting, (rank[job.sla_class], job.arrival_s, job.index, job))
            i += 1
        *_, job = heapq.heappop(waiting)
        end = t + job.service_ms / 1000
        done.append(Completion(job.sla_class, (t - job.arrival_s) * 1000, job.arrival_s, end))
        heapq.heappush(free, end)
    return done
