"""A container's CPU quota (cgroup ``cpu.max``, v1's CFS quota) caps each pool child's torch
threads at its share: ``docker run --cpus=4`` on a 64-core host showed the worker all 64
cores, and each child of eight ran 8 threads, 64 threads throttled in turns on 4 CPUs'
time. Read from files laid out as the kernel lays them out, in a temporary directory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from sits_queue.app import make_app
from sits_queue.config import ClassQuota, SitsConfig
from sits_queue.workers import cores
from sits_queue.workers import runtime as rt
from sits_queue.workers.devices import Discovery, cpu_device
from sits_queue.workers.profile import Sample, profile

HIGH = ClassQuota("high", cpu_cores=16, vram_gib=1, max_run_s=10, weight=100,
                  latency_sla_ms=1000, loss_sensitivity=0.5)


@pytest.mark.parametrize(("text", "cpus"), [
    ("400000 100000", 4.0), ("150000 100000", 1.5), ("max 100000", None),
    ("", None), ("nonsense", None), ("0 100000", None), ("-1 100000", None),
])
def test_cgroup_v2_cpu_max(text: str, cpus: float | None) -> None:
    assert cores.quota_from_cpu_max(text) == cpus


@pytest.mark.parametrize(("quota", "period", "cpus"), [
    ("200000\n", "100000\n", 2.0), ("-1\n", "100000\n", None), ("x", "100000", None),
])
def test_cgroup_v1_cfs(quota: str, period: str, cpus: float | None) -> None:
    assert cores.quota_from_cfs(quota, period) == cpus


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_the_tightest_quota_on_the_path_up_to_the_root(tmp_path: Path) -> None:
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self_cgroup"
    write(self_cgroup, "0::/kubepods/pod1/worker\n")
    write(root / "cpu.max", "max 100000\n")
    write(root / "kubepods/pod1/cpu.max", "300000 100000\n")  # the pod: 3 CPUs
    write(root / "kubepods/pod1/worker/cpu.max", "max 100000\n")
    assert cores.cpu_quota(root, self_cgroup) == 3.0
    # Inside the container the mount's root is its own cgroup, whatever the path says
    write(self_cgroup, "0::/\n")
    write(root / "cpu.max", "200000 100000\n")
    assert cores.cpu_quota(root, self_cgroup) == 2.0


def test_v1_cpu_controller(tmp_path: Path) -> None:
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self_cgroup"
    write(self_cgroup, "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n")
    write(root / "cpu/docker/abc/cpu.cfs_quota_us", "150000\n")
    write(root / "cpu/docker/abc/cpu.cfs_period_us", "100000\n")
    write(root / "cpu/cpu.cfs_quota_us", "-1\n")
    write(root / "cpu/cpu.cfs_period_us", "100000\n")
    assert cores.cpu_quota(root, self_cgroup) == 1.5


def test_no_quota_or_no_cgroups(tmp_path: Path) -> None:
    assert cores.cpu_quota(tmp_path / "none", tmp_path / "no_self_cgroup") is None  # macOS
    write(tmp_path / "self_cgroup", "0::/\n")
    write(tmp_path / "cgroup/cpu.max", "max 100000\n")
    assert cores.cpu_quota(tmp_path / "cgroup", tmp_path / "self_cgroup") is None


@pytest.mark.parametrize(("threads", "quota", "slots", "capped"), [
    (16, None, 4, 16), (16, 4.0, 8, 1), (16, 4.0, 2, 2), (16, 3.0, 2, 1),
    (2, 64.0, 1, 2), (16, 0.5, 1, 1),
])
def test_threads_within_quota(threads: int, quota: float | None, slots: int,
                              capped: int) -> None:
    assert cores.threads_within_quota(threads, quota, slots) == capped


def test_a_child_under_a_quota_runs_its_share_of_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    pinned: list[Any] = []
    monkeypatch.setattr(cores, "pin", lambda tids, cpus: pinned.append(tuple(cpus)))
    monkeypatch.setattr(cores, "pinned_to", lambda cpus: False)
    plan = rt.WorkerPlan("w@h", Discovery(devices=(cpu_device(),)), tuple(range(64)),
                         slots=8, cpu_quota=4.0)
    child = rt.ChildRuntime(app=make_app(SitsConfig(), main="quota-test"), plan=plan,
                            slot=1, device=cpu_device(), pool_child=True)
    before = torch.get_num_threads()
    try:
        # its class's cores are pinned as ever (8 of the 64: slot 1's run)...
        assert child.confine(HIGH) == tuple(range(8, 16)) and pinned == [tuple(range(8, 16))]
        # ... but torch runs its share of the 4 CPUs' time: one thread, not 8
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_worker_says_its_quota_at_start(monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cores, "cpu_quota", lambda: 0.5)
    monkeypatch.setattr(rt, "_plan", None)
    # (the parent's other effects on this process stood in: it is no worker)
    monkeypatch.setattr(rt.intake, "in_worker", lambda: None)
    monkeypatch.setattr(rt, "discover", lambda **_: Discovery(devices=(cpu_device(),)))
    monkeypatch.setattr(rt.admission, "configure", lambda *_: None)
    app = make_app(SitsConfig(), main="quota-start")
    conf: Any = type("Conf", (), {"worker_concurrency": 1})()
    with caplog.at_level(logging.WARNING, logger=rt.__name__):
        rt.init_parent(app, "w@h", conf, {"concurrency": 1})
    assert rt.plan().cpu_quota == 0.5
    assert "a CPU quota of 0.5 CPUs (cgroup)" in caplog.text


def test_the_profile_measures_cpu_against_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 cores seen, 2 CPUs' time allowed: a worker busy at 2 CPUs is fully busy (read
    # against 64 cores it was 3% busy, never CPU-bound)
    monkeypatch.setattr(cores, "usable", lambda pid=0: tuple(range(64)))
    monkeypatch.setattr(cores, "cpu_quota", lambda: 2.0)
    assert cores.capacity() == 2.0
    samples = [Sample(t, 2.0 * t, cores.capacity(), 10, 1024, 100, 0.6, 0.0, 0)
               for t in (0.0, 5.0, 10.0)]
    measured = profile(samples)
    assert measured is not None and measured.cpu_util == pytest.approx(1.0)
    monkeypatch.setattr(cores, "cpu_quota", lambda: None)
    assert cores.capacity() == 64.0
    # a quota under one CPU is measured against itself too
    half = [Sample(t, 0.5 * t, 0.5, 10, 1024, 100, 0.6, 0.0, 0) for t in (0.0, 5.0)]
    assert (p := profile(half)) is not None and p.cpu_util == pytest.approx(1.0)
