"""The runtime profile (§3.3), pure: what a window of samples says, and the feedback."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from sits_queue.broker import intake
from sits_queue.config import SitsConfig
from sits_queue.errors import ConfigError
from sits_queue.workers import profile as prof
from sits_queue.workers.profile import HEADROOM, NORMAL, THROTTLED, Profile, ProfilePolicy, Sample
from tests.waiting import wait_for

POLICY = ProfilePolicy()


def window(cpu_per_step: list[float], io: list[tuple[float, int]] | None = None,
           fds: int = 100, limit: int = 1000, mem: float = 0.5,
           rss: tuple[int, int] = (100, 100)) -> list[Sample]:
    """Samples 5 s apart on 2 cores: CPU seconds used per step, (io ms, ops) per step."""
    io = io or [(10.0, 10)] * len(cpu_per_step)
    out, cpu, io_ms, ops = [Sample(0.0, 0.0, 2, fds, limit, rss[0], mem, 0.0, 0)], 0.0, 0.0, 0
    for i, (c, (ms, n)) in enumerate(zip(cpu_per_step, io, strict=True), start=1):
        cpu, io_ms, ops = cpu + c, io_ms + ms, ops + n
        out.append(Sample(5.0 * i, cpu, 2, fds, limit,
                          rss[1] if i == len(cpu_per_step) else rss[0], mem, io_ms, ops))
    return out


def test_steady_work_is_not_bursty_and_bursts_are() -> None:
    steady = prof.profile(window([5.0] * 6))
    assert steady is not None
    assert steady.cpu_util == 0.5 and steady.cpu_burstiness == 0.0
    bursty = prof.profile(window([10.0, 0.0, 0.0, 10.0, 0.0, 0.0]))
    assert bursty is not None and bursty.cpu_burstiness > 1.0
    assert prof.profile(window([])) is None  # one sample: no interval


def test_disk_latency_skew_memory_and_descriptors() -> None:
    # 1 ms per I/O in most intervals, 20 ms in one: p95 / median = 20
    p = prof.profile(window([1.0] * 10, io=[(10.0, 10)] * 9 + [(200.0, 10)], fds=900,
                            rss=(100, 150)))
    assert p is not None
    assert (p.io_latency_p95_ms, p.io_skew, p.io_latency_last_ms) == (20.0, 20.0, 20.0)
    assert p.fd_pressure == 0.9 and p.rss_growth == 0.5 and p.mem_available == 0.5
    quiet = prof.profile(window([1.0, 1.0], io=[(0.0, 0), (0.0, 0)]))
    assert quiet is not None and quiet.io_skew == 0.0  # no I/O: nothing to skew
    # a sub-millisecond disk reads as 0 ms per I/O: the median is floored, not divided by
    fast = prof.profile(window([1.0] * 4, io=[(0.0, 10)] * 3 + [(30.0, 10)]))
    assert fast is not None and fast.io_skew == 3.0 / prof.IO_FLOOR_MS


def profile_of(**kw: Any) -> Profile:
    base = {"cpu_util": 0.5, "cpu_burstiness": 0.1, "io_latency_p95_ms": 2.0, "io_skew": 1.5,
            "io_latency_last_ms": 1.0,
            "fd_pressure": 0.1, "mem_available": 0.5, "rss_growth": 0.0, "samples": 12}
    return Profile(**{**base, **kw})


@pytest.mark.parametrize(("p", "state", "expected", "why"), [
    (profile_of(), NORMAL, NORMAL, ""),
    (profile_of(cpu_util=0.1), NORMAL, HEADROOM, "CPU"),
    (profile_of(fd_pressure=0.9), NORMAL, THROTTLED, "file descriptors"),
    (profile_of(mem_available=0.04), NORMAL, THROTTLED, "host memory"),
    (profile_of(io_skew=8.0, io_latency_last_ms=80.0), NORMAL, THROTTLED, "disk latency"),
    # skewed but fast now, or slow but even: not a reason to stop
    (profile_of(io_skew=8.0, io_latency_p95_ms=80.0, io_latency_last_ms=5.0), NORMAL, NORMAL,
     ""),
    (profile_of(io_skew=1.2, io_latency_last_ms=80.0), NORMAL, NORMAL, ""),
    # a slow disk resumes once under half the slow level, not at once below it
    (profile_of(io_skew=8.0, io_latency_last_ms=40.0), THROTTLED, THROTTLED, "resume"),
    (profile_of(io_skew=8.0, io_latency_last_ms=20.0), THROTTLED, NORMAL, ""),
    # hysteresis: throttled until back under the resume levels
    (profile_of(fd_pressure=0.8), THROTTLED, THROTTLED, "resume"),
    (profile_of(mem_available=0.08), THROTTLED, THROTTLED, "resume"),
    (profile_of(fd_pressure=0.7), THROTTLED, NORMAL, ""),
    (profile_of(fd_pressure=0.8), NORMAL, NORMAL, ""),
])
def test_decide(p: Profile, state: str, expected: str, why: str) -> None:
    got, reason = prof.decide(p, state, POLICY)
    assert got == expected and why in reason


def test_one_slow_disk_interval_pauses_intake_for_that_interval_only() -> None:
    # (its 60 ms was the window's p95 for a minute: intake paused for 55 s)
    p = prof.Profiler(POLICY)
    io_ms, ops, states = 0.0, 0, []
    for k in range(16):
        per_op = 60.0 if k in (3, 10, 11, 12) else 1.0  # one slow interval, then three
        io_ms, ops = io_ms + 10 * per_op, ops + 10
        states.append(p.add(Sample(5.0 * k, 0.5 * k, 4, 10, 1024, 100, 0.6, io_ms, ops)))
    assert [k for k, s in enumerate(states) if s == THROTTLED] == [3, 10, 11, 12]


def test_profiler_keeps_a_minute_and_reports(caplog: pytest.LogCaptureFixture) -> None:
    p = prof.Profiler(POLICY)
    for s in window([5.0] * 20, fds=950):
        state = p.add(s)
    assert state == THROTTLED and len(p.samples) == prof.WINDOW
    assert "intake paused: file descriptors at 95%" in caplog.text
    report = p.report()
    assert report["state"] == THROTTLED and report["samples"] == prof.WINDOW
    for s in window([5.0] * 20, fds=10):
        state = p.add(Sample(s.t_s + 1000, s.cpu_s, s.cpus, s.fds, s.fd_limit, s.rss_bytes,
                             s.mem_available, s.io_ms, s.io_ops))
    assert state == NORMAL and "intake resumed" in caplog.text


def test_a_real_sample_of_this_process() -> None:
    s = prof.sample([os.getpid(), 2**22 + 12345], cpus=1)  # the second pid does not exist
    assert s.fds > 0 and s.fd_limit > 0 and s.rss_bytes > 0 and s.cpu_s > 0
    assert 0 < s.mem_available <= 1 and s.io_ops >= 0


def test_policy_from_the_config_and_intake() -> None:
    policy = prof.policy_of(SitsConfig(throttle_fd_share=0.5, throttle_mem_share=0.2))
    assert (policy.fd_throttle, policy.fd_resume, policy.mem_throttle, policy.mem_resume) \
        == (0.5, 0.4, 0.2, 0.4)
    with pytest.raises(ConfigError, match="throttle_fd_share"):
        SitsConfig(throttle_fd_share=0)
    # a memory share of 1 is always reached: intake would stay paused for good
    with pytest.raises(ConfigError, match=r"throttle_mem_share must be in \(0, 1\)"):
        SitsConfig(throttle_mem_share=1.0)
    try:
        assert intake.paused() is None
        intake.pause("why not")
        assert intake.paused() == "why not"
    finally:
        intake.pause(None)
    assert intake.paused() is None


@pytest.mark.parametrize(("fd", "mem"), [(0.85, 0.05), (0.05, 0.6), (0.1, 0.99), (1.0, 0.34)])
def test_every_accepted_throttle_level_has_a_resume_level_a_healthy_host_reaches(
        fd: float, mem: float) -> None:
    policy = prof.policy_of(SitsConfig(throttle_fd_share=fd, throttle_mem_share=mem))
    assert 0 < policy.fd_resume < policy.fd_throttle
    assert policy.mem_throttle <= policy.mem_resume < 1
    healthy = profile_of(fd_pressure=policy.fd_resume / 2,
                         mem_available=(policy.mem_resume + 1) / 2)
    assert prof.decide(healthy, THROTTLED, policy)[0] != THROTTLED


class Failing:
    """A consumer whose sampling fails (the step reads only ``app.sits``)."""

    def __init__(self) -> None:
        self.app = type("App", (), {"sits": SitsConfig()})()


def test_samples_failing_in_a_row_lift_a_throttle(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any) -> Any:
        raise OSError("/proc is gone")

    monkeypatch.setattr(prof, "sample", broken)
    step = prof.ProfileStep.__new__(prof.ProfileStep)
    step.failures = 0

    def tick() -> None:  # (and what it hands the event loop, run there)
        if (apply := step.tick(Failing())) is not None:
            apply()

    try:
        intake.pause("host memory 3% available")
        for _ in range(prof.FAILED_SAMPLES_RESUME - 1):
            tick()
        assert intake.paused() is not None  # a failed sample or two change nothing
        tick()
        assert intake.paused() is None
    finally:
        intake.pause(None)


class Loop:
    """A consumer whose event loop runs only what the test runs (``call_soon`` queues)."""

    def __init__(self, config: SitsConfig) -> None:
        self.app = type("App", (), {"sits": config})()
        self.ready: list[Callable[[], None]] = []

    def call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        self.ready.append(lambda: fn(*args))


def test_the_sampler_thread_hands_its_intake_decision_to_the_event_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a step whose policy throttles on any open descriptor, sampling 20 times a second
    monkeypatch.setattr(prof, "SAMPLE_S", 0.05)
    monkeypatch.setattr(prof, "current", [])
    loop = Loop(SitsConfig(throttle_fd_share=0.000001))
    step = prof.ProfileStep.__new__(prof.ProfileStep)
    step.failures, step._sampler = 0, None
    try:
        # When it starts (one sample: no profile yet) and its thread samples again
        step.start(loop)
        wait_for(lambda: bool(loop.ready), 10, "a decision handed to the event loop")
        # Then the thread did not pause intake itself (the transport reads it on the loop)
        assert intake.paused() is None
        # the loop does, when it runs what was handed to it
        for apply in list(loop.ready):
            apply()
        assert "file descriptors" in (intake.paused() or "")
        # and a decision still queued when the step stops is dropped
        step.stop(loop)
        assert intake.paused() is None
        for apply in list(loop.ready):
            apply()
        assert intake.paused() is None
    finally:
        step.stop(loop)
        intake.pause(None)
