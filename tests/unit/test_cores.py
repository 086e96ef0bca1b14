"""A worker on a platform without CPU affinity (macOS: no ``os.sched_getaffinity`` nor
``os.sched_setaffinity``): it starts, its children run their tasks unpinned, its profile
samples, and it says once that confinement is off. The functions are deleted here, as
macOS lacks them (they made the worker die at start with an AttributeError)."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from sits_queue.app import make_app
from sits_queue.config import SitsConfig
from sits_queue.workers import cores
from sits_queue.workers import profile as prof
from sits_queue.workers import runtime as rt
from sits_queue.workers.devices import Discovery, cpu_device
from sits_queue.workers.limits import cpu_set

CPU_ONLY = Discovery(devices=(cpu_device(),))
EVERY_CORE = tuple(range(os.cpu_count() or 1))


@pytest.fixture
def macos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)


def test_linux_reads_and_pins_through_the_affinity_calls() -> None:
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("a platform without CPU affinity")
    assert cores.can_pin() and cores.usable() == tuple(sorted(os.sched_getaffinity(0)))


@pytest.mark.usefixtures("macos")
def test_without_affinity_every_core_is_usable_and_nothing_is_pinned() -> None:
    assert not cores.can_pin()
    assert cores.usable() == EVERY_CORE
    cores.pin([0], (0,))  # (no AttributeError: nothing to do)
    assert cores.pinned_to((0,))


@pytest.mark.usefixtures("macos")
def test_a_child_without_affinity_plans_and_confines_unpinned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rt, "_plan", None)
    plan = rt.plan()  # (the worker's first step read it: the worker died at start)
    assert plan.available_cpus == EVERY_CORE
    app = make_app(SitsConfig(), main="cores-test")
    quota = app.sits.quota("low")
    child = rt.ChildRuntime(app=app, plan=rt.WorkerPlan("w@h", CPU_ONLY, EVERY_CORE, 1),
                            slot=0, device=cpu_device(), pool_child=True)
    # (torch's threads still follow the class: the one confinement left)
    assert child.confine(quota) == cpu_set(quota, EVERY_CORE, 0, 1)
    assert child.confine(quota) == cpu_set(quota, EVERY_CORE, 0, 1)


@pytest.mark.usefixtures("macos")
def test_a_worker_without_affinity_says_once_that_confinement_is_off(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(rt, "_plan", None)
    monkeypatch.setattr(rt.intake, "in_worker", lambda: None)
    monkeypatch.setattr(rt, "discover", lambda **_: CPU_ONLY)
    monkeypatch.setattr(rt.admission, "configure", lambda *_: None)
    app = make_app(SitsConfig(), main="cores-parent")
    conf: Any = type("Conf", (), {"worker_concurrency": 1})()
    with caplog.at_level(logging.WARNING, logger=rt.__name__):
        rt.init_parent(app, "w@h", conf, {"concurrency": 1})
    assert rt.plan().available_cpus == EVERY_CORE
    said = [r.getMessage() for r in caplog.records if "confinement" in r.getMessage()]
    assert said == [cores.UNPINNED_NOTICE]


@pytest.mark.usefixtures("macos")
def test_the_profile_samples_without_affinity(caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prof, "current", [])
    step = prof.ProfileStep.__new__(prof.ProfileStep)
    step.failures = 0
    consumer = type("Consumer", (), {"app": type("App", (), {"sits": SitsConfig()})()})()
    with caplog.at_level(logging.WARNING, logger=prof.__name__):
        step.tick(consumer)
    # (it warned at every sample, and lifted any throttle as unconfirmed)
    assert step.failures == 0, caplog.text
