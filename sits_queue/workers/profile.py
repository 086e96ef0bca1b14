"""Runtime resource profiling with a feedback loop (MISSION §3.3): the worker samples its
processes every 5 s and stops taking work while a resource is about to run out.

The source profiles with eBPF and cgroups; psutil-level sampling is the portable
baseline it names, and what this is. Over the last minute of samples:

* **CPU burstiness**: coefficient of variation of the worker's CPU use (main process
  and pool children) per interval: steady work is near 0, bursts are above 1;
* **I/O latency skew**: the host's disks' mean latency per I/O in each interval, its
  p95 over its median (a skewed tail means some reads wait far longer than others; the
  median floored at :data:`IO_FLOOR_MS`: sub-millisecond disks read as 0 ms);
* **file-descriptor pressure**: the most open descriptors of any of its processes over
  its soft limit (``RLIMIT_NOFILE``);
* **memory**: the host's available share, and how much the worker's resident memory grew
  over the window (memory that is reused stays flat; a leak or a cache without a bound
  grows).

The feedback: the worker stops picking new tasks ("throttled") while descriptors or host
memory run short or the disk is slow now (the last interval's latency) and skewed over
the window, and picks again once all are back under their resume levels (hysteresis, so
it does not flap; for the disk, the last interval under half the slow level: one slow
interval in the window, kept in its p95 for a minute, must not pause intake that long).
Running tasks are never touched. It reports "headroom" when it is idle enough to take
more (for a scheduler or a person reading ``sitsq status``; the pool's size is the
devices', so nothing grows it).
Pure functions here; ``ProfileStep`` at the bottom is the Celery edge: it samples from a
thread of its own (a ``--pool=solo`` task holds the consumer's event loop for as long as
it runs) and hands the intake decision back to the event loop, whose transport reads it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from celery import bootsteps

from sits_queue.broker import intake
from sits_queue.periodic import Periodic
from sits_queue.workers import cores

logger = logging.getLogger(__name__)

#: The source's sampling period, s.
SAMPLE_S = 5.0
#: Samples kept: one minute.
WINDOW = 12
#: Least median disk latency the skew divides by, ms (the kernel counts whole ms).
IO_FLOOR_MS = 0.5

NORMAL, THROTTLED, HEADROOM = "normal", "throttled", "headroom"


@dataclass(frozen=True)
class Sample:
    t_s: float
    #: CPU seconds used so far by the worker's processes (user + system).
    cpu_s: float
    #: Cores the worker may use.
    cpus: float  # CPUs' worth of time the worker may use (cores, or a cgroup quota)
    #: Most open descriptors of one of its processes, and the soft limit.
    fds: int
    fd_limit: int
    #: Resident memory of its processes, bytes.
    rss_bytes: int
    #: Host: available memory share; disk busy ms and operations so far.
    mem_available: float
    io_ms: float
    io_ops: int


@dataclass(frozen=True)
class ProfilePolicy:
    fd_throttle: float = 0.85
    fd_resume: float = 0.75
    mem_throttle: float = 0.05
    mem_resume: float = 0.10
    #: Skewed *and* slow disks throttle: the window's p95/median ratio and the last
    #: interval's latency; intake resumes once that latency is under ``io_resume_ms``.
    io_skew_throttle: float = 5.0
    io_slow_ms: float = 50.0
    io_resume_ms: float = 25.0
    #: Idle enough to take more: CPU use under this share of its cores, nothing short.
    headroom_cpu: float = 0.25


@dataclass(frozen=True)
class Profile:
    cpu_util: float  # share of its cores used, last interval
    cpu_burstiness: float  # CV of per-interval CPU use
    io_latency_p95_ms: float
    io_skew: float  # p95 / median of per-interval disk latency
    io_latency_last_ms: float  # the last interval's (0: it did no I/O)
    fd_pressure: float
    mem_available: float
    rss_growth: float  # relative growth of resident memory over the window
    samples: int


def profile(samples: Sequence[Sample]) -> Profile | None:
    """The profile of a window of samples (oldest first); None under two samples."""
    if len(samples) < 2:
        return None
    utils, latencies = [], []
    last_latency = 0.0
    for a, b in itertools.pairwise(samples):
        dt = b.t_s - a.t_s
        if dt > 0:
            utils.append(max(0.0, b.cpu_s - a.cpu_s) / (dt * (b.cpus if b.cpus > 0 else 1.0)))
        ops = b.io_ops - a.io_ops
        last_latency = max(0.0, b.io_ms - a.io_ms) / ops if ops > 0 else 0.0
        if ops > 0:
            latencies.append(last_latency)
    mean_util = statistics.fmean(utils) if utils else 0.0
    burst = statistics.pstdev(utils) / mean_util if len(utils) > 1 and mean_util > 0 else 0.0
    p95 = _p95(latencies)
    median = statistics.median(latencies) if latencies else 0.0
    last, first = samples[-1], samples[0]
    return Profile(
        cpu_util=round(utils[-1] if utils else 0.0, 4), cpu_burstiness=round(burst, 4),
        io_latency_p95_ms=round(p95, 3),
        io_skew=round(p95 / max(median, IO_FLOOR_MS), 3) if latencies else 0.0,
        io_latency_last_ms=round(last_latency, 3),
        fd_pressure=round(last.fds / last.fd_limit, 4) if last.fd_limit > 0 else 0.0,
        mem_available=round(last.mem_available, 4),
        rss_growth=round((last.rss_bytes - first.rss_bytes) / first.rss_bytes, 4)
        if first.rss_bytes > 0 else 0.0,
        samples=len(samples))


def _p95(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def decide(p: Profile, state: str, policy: ProfilePolicy) -> tuple[str, str]:
    """(next state, why) from the profile and the current state (hysteresis)."""
    slow_io = p.io_skew >= policy.io_skew_throttle and p.io_latency_last_ms >= policy.io_slow_ms
    if p.fd_pressure >= policy.fd_throttle:
        return THROTTLED, f"file descriptors at {p.fd_pressure:.0%} of the limit"
    if p.mem_available <= policy.mem_throttle:
        return THROTTLED, f"host memory {p.mem_available:.0%} available"
    if slow_io:
        return THROTTLED, (f"disk latency {p.io_latency_last_ms:.0f} ms, skewed "
                           f"{p.io_skew:.1f}x")
    if state == THROTTLED and (p.fd_pressure > policy.fd_resume
                               or p.mem_available < policy.mem_resume
                               or p.io_latency_last_ms > policy.io_resume_ms):
        return THROTTLED, "not yet back under the resume levels"
    if p.cpu_util < policy.headroom_cpu and p.fd_pressure < policy.fd_resume \
            and p.mem_available >= policy.mem_resume:
        return HEADROOM, f"CPU {p.cpu_util:.0%} of its cores"
    return NORMAL, ""


# -- the edge: sampling and the consumer step ----------------------------------------------

def sample(pids: Sequence[int], cpus: float, now_s: float | None = None) -> Sample:
    """One sample of these processes (those gone meanwhile are skipped) and the host."""
    import psutil

    rss = fds = 0
    cpu_s = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                times = proc.cpu_times()
                cpu_s += times.user + times.system
                rss += proc.memory_info().rss
                fds = max(fds, proc.num_fds())
        except (psutil.Error, OSError):
            continue
    disk = psutil.disk_io_counters()
    io_ms = float(disk.read_time + disk.write_time) if disk is not None else 0.0
    io_ops = int(disk.read_count + disk.write_count) if disk is not None else 0
    vm = psutil.virtual_memory()
    return Sample(time.time() if now_s is None else now_s, cpu_s, cpus, fds,
                  resource.getrlimit(resource.RLIMIT_NOFILE)[0], rss,
                  vm.available / vm.total, io_ms, io_ops)


class Profiler:
    """The window and the state of one worker (its main process).

    The sampler thread adds, the advertisement's thread reports: the lock keeps a report
    of one sample's state, why and profile, never a mix of two."""

    def __init__(self, policy: ProfilePolicy | None = None) -> None:
        self.policy = policy or ProfilePolicy()
        self.samples: list[Sample] = []
        self.state, self.why = NORMAL, ""
        self.latest: Profile | None = None
        self._lock = threading.Lock()

    def add(self, s: Sample) -> str:
        with self._lock:
            self.samples = [*self.samples, s][-WINDOW:]
            self.latest = profile(self.samples)
            if self.latest is not None:
                state, why = decide(self.latest, self.state, self.policy)
                if state != self.state and THROTTLED in (state, self.state):
                    logger.warning("intake %s: %s",
                                   "paused" if state == THROTTLED else "resumed",
                                   why or "resources back under the resume levels")
                self.state, self.why = state, why
            return self.state

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {"state": self.state, "why": self.why,
                    **(asdict(self.latest) if self.latest is not None else {})}


#: Samples failing in a row after which a throttled worker takes work again.
FAILED_SAMPLES_RESUME = 3
#: Longest a stopping worker waits for a sample in flight, s (psutil reads of /proc: far
#: less); one that finishes later changes nothing (its hand-back is dropped).
_STOP_WAIT_S = 5.0

#: This worker's profiler (one worker per process), for the advertisement.
current: list[Profiler] = []


def policy_of(config: Any) -> ProfilePolicy:
    """The policy from the configured throttle levels: resume 0.10 below the descriptor
    share (half of it, for a share under 0.20) and at twice the memory share (half-way to
    all memory free, for a share over a third): always a level a healthy host reaches,
    never 0 descriptors open nor 100% of memory free, which would pause intake for good."""
    fd, mem = config.throttle_fd_share, config.throttle_mem_share
    return ProfilePolicy(fd_throttle=fd, fd_resume=fd - min(0.10, fd / 2),
                         mem_throttle=mem, mem_resume=min(2 * mem, (1 + mem) / 2))


def _resume_unconfirmed(failures: int) -> None:
    # a throttle nothing can confirm any more must not pause intake for good
    if intake.paused() is not None:
        logger.warning("resuming intake: %d samples failed in a row", failures)
        intake.pause(None)


class ProfileStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer step: sample every :data:`SAMPLE_S`.

    From a daemon thread, not the consumer's timer: with ``--pool=solo`` a task runs on
    the event loop's thread, and a long task stopped the sampling (the profile, its
    throttle and what the advertisement publishes of it froze). The thread only reads
    ``/proc`` and updates the :class:`Profiler`; pausing or resuming intake, which the
    transport reads on the event loop, is handed back there (``Consumer.call_soon``: the
    hub's thread-safe ready queue, or the plain loop's pending operations).
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)
    name = "SITS runtime profile"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.failures = 0
        self._sampler: Periodic | None = None

    def tick(self, c: Any) -> Callable[[], None] | None:
        """Take one sample (on any thread); what it asks of intake, for the event loop's
        thread to run (None: nothing)."""
        policy = policy_of(c.app.sits)
        if not current or current[0].policy != policy:
            current[:] = [Profiler(policy)]
        try:
            import psutil

            # the pool's children are this process's children; the affinity is the main
            # thread's (what the event loop's thread read when it sampled), the quota its
            # container's (64 cores seen under --cpus=4: never CPU-bound at 4 CPUs busy)
            children = [p.pid for p in psutil.Process().children()]
            state = current[0].add(sample([os.getpid(), *children], cores.capacity()))
        except Exception as exc:  # a failed sample must never stop the worker
            self.failures += 1
            logger.warning("could not sample the worker's resources: %s", exc)
            if self.failures >= FAILED_SAMPLES_RESUME:
                return functools.partial(_resume_unconfirmed, self.failures)
            return None
        self.failures = 0
        # (only this thread changes the profiler's why: it is this sample's)
        return functools.partial(intake.pause, current[0].why if state == THROTTLED else None)

    def start(self, c: Any) -> None:
        if (apply := self.tick(c)) is not None:  # (on the event loop's thread)
            apply()
        self._sampler = Periodic("sits-profile", SAMPLE_S,
                                 lambda stopping: self._sample(c, stopping),
                                 "could not sample the worker's resources").start()

    def _sample(self, c: Any, stopping: threading.Event) -> None:
        if (apply := self.tick(c)) is not None:
            c.call_soon(_unless_stopped, stopping, apply)

    def stop(self, c: Any) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop(_STOP_WAIT_S)
        intake.pause(None)


def _unless_stopped(stopping: threading.Event, apply: Callable[[], None]) -> None:
    # On the event loop: a decision that arrives after the step stopped (and resumed
    # intake) is dropped, or it would pause a stopped or restarted consumer.
    if not stopping.is_set():
        apply()
