"""The worker runtime's decisions, without Redis, a GPU or a worker: pinning, budgets,
caps, admission, the request guard, the registry and the advertisement records."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest
from celery.worker.request import Request

from sits_queue.app import ENGINE_ARG, make_app
from sits_queue.cache import budgets as cache_budgets
from sits_queue.config import DEFAULT_CLASSES, ClassQuota, SitsConfig
from sits_queue.errors import ConfigError, ModelLoadError, UnknownModel, VramLimitExceeded
from sits_queue.options import HEADER
from sits_queue.registry import ModelRegistry, load_engine
from sits_queue.workers import advertise, freemem, gpu, limits, request, taskheader
from sits_queue.workers import runtime as rt
from sits_queue.workers.devices import Device, Discovery
from sits_queue.workers.limits import BYTES_PER_GIB

GIB = BYTES_PER_GIB
HIGH, MEDIUM, LOW = DEFAULT_CLASSES


def gpu_device(index: int, total_gib: float = 80, free_gib: float = 70) -> Device:
    return Device(index=index, kind="cuda", name="NVIDIA A100-SXM4-80GB",
                  uuid=f"GPU-{index:04d}-uuid", total_vram_bytes=int(total_gib * GIB),
                  free_vram_bytes=int(free_gib * GIB))


CPU = Device(index=0, kind="cpu", name="x86_64", uuid="cpu", total_vram_bytes=64 * GIB,
             free_vram_bytes=32 * GIB)
FOUR_GPUS = Discovery(devices=tuple(gpu_device(i) for i in range(4)))
CPU_ONLY = Discovery(devices=(CPU,), notice="no GPU")


def quota(vram_gib: float = 8, cpu_cores: int = 4) -> ClassQuota:
    return ClassQuota("q", cpu_cores=cpu_cores, vram_gib=vram_gib, max_run_s=10, weight=1.0,
                      latency_sla_ms=1000, loss_sensitivity=0.5)


# -- device per child ---------------------------------------------------------------------------

@pytest.mark.parametrize(("discovery", "slot", "expected"), [
    (FOUR_GPUS, 0, 0), (FOUR_GPUS, 3, 3),
    (FOUR_GPUS, 5, 1),   # more children than GPUs: round-robin
    (CPU_ONLY, 0, 0), (CPU_ONLY, 2, 0),
])
def test_device_for_slot(discovery: Discovery, slot: int, expected: int) -> None:
    assert rt.device_for_slot(discovery, slot).index == expected


@pytest.mark.parametrize(("discovery", "slots", "expected"), [
    (FOUR_GPUS, 0, [0, 1, 2, 3]),   # the pool's size not known yet: every device
    (FOUR_GPUS, 4, [0, 1, 2, 3]), (FOUR_GPUS, 6, [0, 1, 2, 3]),
    (FOUR_GPUS, 1, [0]), (FOUR_GPUS, 3, [0, 1, 2]),  # fewer children: theirs only
    (CPU_ONLY, 1, [0]), (CPU_ONLY, 3, [0]),
])
def test_a_worker_uses_the_devices_its_children_are_pinned_to(
        discovery: Discovery, slots: int, expected: list[int]) -> None:
    assert [d.index for d in rt.used_devices(discovery, slots)] == expected
    assert [d.index for d in rt.WorkerPlan("h", discovery, (0,), slots).devices] == expected


def test_gpus_without_a_child_are_said_once() -> None:
    assert rt.unused_notice(FOUR_GPUS, 4) is None and rt.unused_notice(CPU_ONLY, 1) is None
    notice = rt.unused_notice(FOUR_GPUS, 3)
    assert notice is not None and "GPU 3 (NVIDIA A100-SXM4-80GB, GPU-0003-uuid) has no " \
        "pool child (3 for 4 GPUs)" in notice and "advertises it;" in notice
    assert "GPU 1 (" in (rt.unused_notice(FOUR_GPUS, 1) or "") and "them;" in (
        rt.unused_notice(FOUR_GPUS, 1) or "")


def test_pin_env_names_the_gpu_by_uuid_and_leaves_cpu_alone() -> None:
    # The UUID: CUDA orders devices fastest-first, NVML by PCI bus; an index could mismatch.
    assert rt.pin_env(gpu_device(2)) == {"CUDA_VISIBLE_DEVICES": "GPU-0002-uuid"}
    assert rt.pin_env(CPU) == {}


def test_a_replaced_child_gets_the_same_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # billiard gives a replacement the free index of the child it replaces.
    adverts: list[dict[str, Any]] = []
    monkeypatch.setattr(advertise, "publish_child",  # no Redis in unit tests
                        lambda _config, _host, _slot, record, _counts: not adverts.append(record))

    def asked() -> bool:
        raise AssertionError("a child's start-up asked torch about CUDA")

    # Start-up never imports torch nor starts the driver: Celery kills a child that does
    # not report in within its alive timeout, and a CUDA torch's import can take that long
    monkeypatch.setattr(gpu, "cuda_available", asked)
    monkeypatch.setattr(gpu, "_available", None)
    env: dict[str, str] = {}
    app = make_app(SitsConfig(), main="pin-test")
    assert app.conf.worker_proc_alive_timeout >= 30
    saved_plan, saved_child = rt._plan, rt._child
    try:
        rt._plan = rt.WorkerPlan("w@h", FOUR_GPUS, (0, 1, 2, 3), slots=4)
        first = rt.init_child(app, 2, env)
        assert env == {"CUDA_VISIBLE_DEVICES": "GPU-0002-uuid"} and first.pool_child
        assert adverts[-1]["device"] == "cuda:2"  # NVML's word until torch is asked
        env.clear()
        rt.init_child(app, 2, env)
        assert env == {"CUDA_VISIBLE_DEVICES": "GPU-0002-uuid"}
        # Once torch has said it has no CUDA (a CPU build on a GPU host), the label says so
        monkeypatch.setattr(gpu, "_available", False)
        assert first.device_label == "cpu"
    finally:
        rt._plan, rt._child = saved_plan, saved_child


@pytest.mark.parametrize(("discovery", "slots", "sharing"), [
    (FOUR_GPUS, 4, 1), (FOUR_GPUS, 8, 2), (FOUR_GPUS, 5, 2), (CPU_ONLY, 3, 3),
])
def test_children_per_device(discovery: Discovery, slots: int, sharing: int) -> None:
    assert cache_budgets.children_per_device(discovery, slots) == sharing


def test_each_child_splits_its_own_devices_tier_by_the_children_pinned_there() -> None:
    """(3 children on 2 GPUs: 0 and 2 share GPU 0, 1 is alone on GPU 1, and every child
    got half a device's tier, the busiest device's split)"""
    two_gpus = Discovery(devices=FOUR_GPUS.devices[:2])
    assert [cache_budgets.children_per_device(two_gpus, 3, slot)
            for slot in range(3)] == [2, 1, 2]
    assert [cache_budgets.children_per_device(FOUR_GPUS, 5, slot)
            for slot in range(5)] == [2, 1, 1, 1, 2]
    assert cache_budgets.children_per_device(CPU_ONLY, 3, 1) == 3  # host RAM, shared
    # and a child's own tier is its device's share split that way
    app = make_app(SitsConfig(), main="budgets")
    plan = rt.WorkerPlan("w@h", two_gpus, (0,), 3)
    tiers = [rt.ChildRuntime(app=app, plan=plan, slot=slot,
                             device=rt.device_for_slot(two_gpus, slot))._budgets()[0]
             for slot in range(3)]
    whole = int(two_gpus.devices[0].total_vram_bytes * 0.30)
    assert tiers == [whole // 2, whole, whole // 2]


# -- cache budgets ------------------------------------------------------------------------------

def test_budgets_default_to_the_4_3_shares() -> None:
    dev, host = cache_budgets.CacheBudgets().resolve(gpu_device(0, total_gib=80), 512 * GIB,
                                                     slots=4)
    assert dev == int(80 * GIB * 0.30)
    assert host == int(512 * GIB * 0.5 / 4 * 0.70)


def test_budgets_split_a_shared_gpu_and_use_host_ram_on_cpu() -> None:
    dev, _ = cache_budgets.CacheBudgets().resolve(gpu_device(0, total_gib=80), 64 * GIB, slots=2,
                                       sharing=2)
    assert dev == int(80 * GIB * 0.30 / 2)
    cpu_dev, cpu_host = cache_budgets.CacheBudgets().resolve(CPU, 64 * GIB, slots=1)
    assert cpu_dev + cpu_host <= 64 * GIB * 0.5  # both tiers are host RAM on a CPU host


def test_budgets_from_env_override() -> None:
    budgets = cache_budgets.CacheBudgets.from_env({"SITS_DEVICE_CACHE_BYTES": "1e6",
                                        "SITS_HOST_CACHE_BYTES": "2000"})
    assert budgets.resolve(CPU, 64 * GIB, slots=1) == (1_000_000, 2000)
    assert cache_budgets.CacheBudgets.from_env({}).device_bytes is None
    with pytest.raises(ConfigError, match="SITS_HOST_CACHE_BYTES"):
        cache_budgets.CacheBudgets.from_env({"SITS_HOST_CACHE_BYTES": "lots"})
    with pytest.raises(ConfigError):
        cache_budgets.CacheBudgets(device_bytes=-1)


@pytest.mark.parametrize(("raw", "want"), [
    ("65536", 65536), ("1e6", 1_000_000), ("8GiB", 8 * GIB), ("8 gib", 8 * GIB),
    ("512MB", 512_000_000), ("1.5 KiB", 1536), ("0", 0), (" 2kb ", 2000), ("3b", 3)])
def test_cache_bytes_take_units(raw: str, want: int) -> None:
    assert cache_budgets.parse_bytes("SITS_HOST_CACHE_BYTES", raw) == want


@pytest.mark.parametrize("raw", ["inf", "nan", "-1GiB", "1e30", "8 parsecs", "GiB", "1GiBs"])
def test_bad_cache_bytes_are_named_not_raised_as_overflow(raw: str) -> None:
    with pytest.raises(ConfigError, match="SITS_DEVICE_CACHE_BYTES"):
        cache_budgets.CacheBudgets.from_env({"SITS_DEVICE_CACHE_BYTES": raw})


# -- VRAM caps ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("q", "allocated", "engine", "total", "fraction"), [
    # Nothing cached: the class limit over the device (§1.4 on an A100-80G)
    (LOW, 0, 0, 80 * GIB, 0.1),
    (HIGH, 0, 0, 80 * GIB, 0.8),
    # Other engines resident (allocated) are not this task's: the cap sits on top of them
    (LOW, 10 * GIB, 0, 80 * GIB, 18 / 80),
    # The task's own engine counts against its class
    (LOW, 10 * GIB, 3 * GIB, 80 * GIB, 15 / 80),
    # An engine larger than the class leaves no headroom (and is refused before running)
    (LOW, 10 * GIB, 9 * GIB, 80 * GIB, 10 / 80),
    # Never more than the device
    (HIGH, 40 * GIB, 0, 80 * GIB, 1.0),
])
def test_memory_cap_fraction(q: ClassQuota, allocated: int, engine: int, total: int,
                             fraction: float) -> None:
    assert limits.memory_cap_fraction(q, allocated, engine, total) == pytest.approx(fraction)


def test_memory_cap_fraction_rejects_an_empty_device() -> None:
    with pytest.raises(ValueError):
        limits.memory_cap_fraction(LOW, 0, 0, 0)


def test_engine_over_the_class_limit_is_refused_with_the_numbers() -> None:
    limits.check_engine_fits_class("m", quota(vram_gib=1), GIB)  # exactly fits
    with pytest.raises(VramLimitExceeded, match=r"model 'm' needs 2 GiB of weights, over "
                                                r"the 1 GiB VRAM limit of class 'q'"):
        limits.check_engine_fits_class("m", quota(vram_gib=1), 2 * GIB)
    with pytest.raises(VramLimitExceeded, match="estimated working memory"):
        limits.check_engine_fits_class("m", quota(vram_gib=1), GIB // 2, GIB)


def test_cpu_estimate_is_checked_only_without_cuda() -> None:
    on_cpu = rt.ActiveTask("m", quota(vram_gib=1), GIB // 2, "cpu", on_cuda=False)
    on_gpu = replace(on_cpu, on_cuda=True)
    with pytest.raises(VramLimitExceeded):
        on_cpu.check_vram(GIB)
    on_gpu.check_vram(GIB)  # CUDA's allocator cap enforces the real limit there


def test_soft_deadline_is_checked_between_steps() -> None:
    from celery.exceptions import SoftTimeLimitExceeded

    task = rt.ActiveTask("m", LOW, 0, "cpu", soft_deadline=0.0)
    with pytest.raises(SoftTimeLimitExceeded, match="after 3 of 10 steps"):
        task.check_time(3, 10)
    rt.ActiveTask("m", LOW, 0, "cpu", soft_deadline=None).check_time(3, 10)


# -- reading the task's options ---------------------------------------------------------------

def test_task_class_from_header_then_declaration_then_default() -> None:
    config = SitsConfig()
    assert taskheader.task_class(config, SimpleNamespace(sits={"sla_class": "high"}), "low") is HIGH
    assert taskheader.task_class(config, SimpleNamespace(sits=None), "low") is LOW
    assert taskheader.task_class(config, SimpleNamespace(), None).name == config.default_class
    unknown = SimpleNamespace(sits={"sla_class": "nope"})
    assert taskheader.task_class(config, unknown, None) is MEDIUM


def test_task_model_from_header_or_declaration() -> None:
    assert taskheader.task_model(SimpleNamespace(sits={"model": "a"}), "b") == "a"
    assert taskheader.task_model(SimpleNamespace(sits={"model": None}), "b") == "b"
    with pytest.raises(UnknownModel, match="names no model"):
        taskheader.task_model(SimpleNamespace(), None)


# -- CPU confinement in a child (affinity faked) -------------------------------------------------

def fake_affinity(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The sets applied, and the affinity read back as the last one applied."""
    calls: list[tuple[int, ...]] = []
    # (raising=False: macOS has neither, and the test stands them in there too)
    monkeypatch.setattr(rt.os, "sched_setaffinity", lambda pid, cpus: calls.append(cpus),
                        raising=False)
    monkeypatch.setattr(rt.os, "sched_getaffinity",
                        lambda pid: set(calls[-1]) if calls else {0, 1}, raising=False)
    monkeypatch.setattr(rt, "_threads", lambda: [0])  # (one call a change, not a thread)
    return calls


def test_confine_applies_the_class_share_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_affinity(monkeypatch)
    app = make_app(SitsConfig(), main="confine-test")
    plan = rt.WorkerPlan("w@h", FOUR_GPUS, tuple(range(32)), slots=4)
    child = rt.ChildRuntime(app=app, plan=plan, slot=1, device=gpu_device(1), pool_child=True)
    assert child.confine(LOW) == (8, 9, 10, 11)     # slot 1 of 4 owns cores 8..15
    assert child.confine(LOW) == (8, 9, 10, 11)
    assert child.confine(HIGH) == tuple(range(8, 16))
    assert calls == [(8, 9, 10, 11), tuple(range(8, 16))]  # unchanged sets are not re-applied
    # ... unless a task changed it meanwhile: the next task gets its class's back (it kept
    # what the task had set, whatever its class)
    calls.append((8,))
    assert child.confine(HIGH) == tuple(range(8, 16)) and calls[-1] == tuple(range(8, 16))


def test_a_task_traced_inside_a_running_batch_leaves_its_limits_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A batch call's result stored early is traced while the batch runs on: its
    # task_prerun must not re-pin the child or re-cap the device under the batch
    calls = fake_affinity(monkeypatch)
    app = make_app(SitsConfig(), main="confine-test-3")
    plan = rt.WorkerPlan("w@h", FOUR_GPUS, tuple(range(32)), slots=4)
    child = rt.ChildRuntime(app=app, plan=plan, slot=1, device=gpu_device(1), pool_child=True)
    task = SimpleNamespace(headers={"sits": {"sla_class": "low"}})
    with rt.activated(rt.ActiveTask("m", HIGH, 0, "cpu")):
        child.before_task(task, "low")
    assert calls == []
    child.before_task(task, "low")  # a task of its own: pinned to its class's share
    assert calls == [(8, 9, 10, 11)]


PINS_EVERY_THREAD = """
import json, os, threading
from sits_queue.app import make_app
from sits_queue.config import ClassQuota, SitsConfig
from sits_queue.workers import runtime as rt
from sits_queue.workers.devices import Discovery, cpu_device

cores = tuple(sorted(os.sched_getaffinity(0)))
wide = ClassQuota("wide", cpu_cores=len(cores), vram_gib=1, max_run_s=10, weight=10,
                  latency_sla_ms=800, loss_sensitivity=0.5)
narrow = ClassQuota("narrow", cpu_cores=1, vram_gib=1, max_run_s=10, weight=1,
                    latency_sla_ms=800, loss_sensitivity=0.5)
app = make_app(SitsConfig(classes=(wide, narrow), default_class="narrow"), main="pin")
plan = rt.WorkerPlan("w@h", Discovery(devices=(cpu_device(),)), cores, 1)
child = rt.ChildRuntime(app=app, plan=plan, slot=0, device=plan.discovery.devices[0],
                        pool_child=True)
child.confine(wide)
started, done = threading.Event(), threading.Event()
worker = threading.Thread(target=lambda: (started.set(), done.wait()))  # as torch's OpenMP
worker.start()
started.wait()
narrowed = child.confine(narrow)
print(json.dumps([sorted(narrowed), sorted(os.sched_getaffinity(worker.native_id))]))
done.set()
"""


def test_confine_pins_every_thread_of_the_child_not_only_the_callers(tmp_path: Path) -> None:
    """(sched_setaffinity(0) pins the calling thread only: torch's OpenMP workers, started
    under an earlier class's cores, kept running there)"""
    import subprocess
    import sys

    if not rt.cores.can_pin():
        pytest.skip("a platform without CPU affinity (macOS) pins nothing")
    if len(rt.os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to tell two classes' core sets apart")
    out = subprocess.run([sys.executable, "-c", PINS_EVERY_THREAD], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, check=True)
    narrowed, worker = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(narrowed) == 1 and worker == narrowed


def test_confine_outside_a_pool_child_leaves_the_process_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rt.os, "sched_setaffinity", lambda *_: pytest.fail("re-pinned"),
                        raising=False)
    app = make_app(SitsConfig(), main="confine-test-2")
    child = rt.ChildRuntime(app=app, plan=rt.WorkerPlan("w", CPU_ONLY, (0,), 1), slot=0,
                            device=CPU)
    assert child.confine(LOW) == rt.cores.usable()


# -- admission in the main process ------------------------------------------------------------

@pytest.mark.parametrize(("headers", "needed"), [
    ({"sits": {"vram_gib": 12}}, 12.0), ({"sits": {"vram_gib": None}}, None),
    ({"sits": {}}, None), ({}, None), ({"sits": "junk"}, None),
    ({"sits": {"vram_gib": True}}, None), ({"sits": {"vram_gib": -1}}, None),
    # from a foreign producer: unreadable, so run it (fits() would raise on these)
    ({"sits": {"vram_gib": float("nan")}}, None), ({"sits": {"vram_gib": float("inf")}}, None),
    ({"sits": {"vram_gib": 10 ** 400}}, None),
])
def test_declared_vram(headers: dict[str, Any], needed: float | None) -> None:
    assert request.declared_vram_gib(headers) == needed


def test_admit() -> None:
    assert request.admit(None, 0) is None
    assert request.admit(8, 10 * GIB, headroom_bytes=GIB) is None
    verdict = request.admit(12, 10 * GIB, headroom_bytes=GIB)
    assert verdict is not None and "vram_gib=12" in verdict.reason()


class FakeQoS:
    def __init__(self) -> None:
        self.released: list[tuple[Any, ...]] = []

    def release(self, tag: str, *hold: float) -> float:
        self.released.append((tag, *hold))
        return hold[0] if hold else 0.0


class FakeProbe:
    def __init__(self, free_bytes: int, total_bytes: int = 80 * GIB) -> None:
        self.free_bytes, self.total_bytes = free_bytes, total_bytes

    def max_free_bytes(self, cached: Any = None) -> int:
        return self.free_bytes

    def max_total_bytes(self) -> int:
        return self.total_bytes


class CeleryGenerated(request.SitsRequest):
    """Like celery.worker.request.create_request_cls: its own method, no super() call."""

    ran: list[str] = []

    def execute_using_pool(self, pool: Any, **kwargs: Any) -> Any:
        self.ran.append(self.id)
        return "sent to the pool"


def fake_request(vram_gib: float | None) -> tuple[CeleryGenerated, FakeQoS]:
    qos = FakeQoS()
    req = CeleryGenerated.__new__(CeleryGenerated)
    req._message = SimpleNamespace(channel=SimpleNamespace(qos=qos), delivery_tag="tag-1",
                                   _state="RECEIVED")
    req._request_dict = {"id": "task-1", "task": "t", "sits": {"vram_gib": vram_gib}}
    req.id, req.name, req._eventer = "task-1", "t", None
    req._expires, req._already_revoked = None, False
    return req, qos


def test_generated_request_classes_are_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert getattr(CeleryGenerated.execute_using_pool, "__sits_guarded__", False)
    monkeypatch.setattr(request, "_probe", FakeProbe(40 * GIB))
    CeleryGenerated.ran.clear()
    # A task that fits goes to the pool
    fits, qos = fake_request(8)
    assert fits.execute_using_pool(None) == "sent to the pool"
    assert CeleryGenerated.ran == ["task-1"] and qos.released == []
    # One that does not is released (no redelivery), never run, and held off from this
    # worker (the broker doubles the hold on each repeat: tests/integration/test_scripts)
    big, qos = fake_request(60)
    with pytest.raises(request.NotStartedHere):
        big.execute_using_pool(None)
    assert CeleryGenerated.ran == ["task-1"]
    assert qos.released == [("tag-1", request.HOLD_FIRST_S, request.HOLD_LONGEST_S)]
    assert big.message._state == "REQUEUED" and big.acknowledged


def test_a_task_over_the_largest_device_here_is_held_off_long(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Given a worker whose largest device holds 80 GiB in all, and a task declaring 100
    # (the fleet unreadable here: no app; a worker with a larger device may take it)
    monkeypatch.setattr(request, "_probe", FakeProbe(40 * GIB, total_bytes=80 * GIB))
    CeleryGenerated.ran.clear()
    big, qos = fake_request(100)
    with caplog.at_level(logging.INFO, logger=request.__name__), \
            pytest.raises(request.NotStartedHere):
        big.execute_using_pool(None)
    # Then no memory coming free could start it here: held off at once for long
    assert qos.released == [("tag-1", request.NEVER_HERE_HOLD_S, request.NEVER_HERE_HOLD_S)]
    assert CeleryGenerated.ran == [] and big.acknowledged
    assert "the largest device of this worker has 80.00 GiB in all" in caplog.text
    assert "workers' devices could not be read" in caplog.text


class BrokenProbe:
    def max_free_bytes(self, cached: Any = None) -> int:
        raise RuntimeError("NVML: the driver went away")


def test_an_unreadable_declaration_or_device_starts_the_task(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # nothing here may raise in the main process: Celery would lose the pool slot
    CeleryGenerated.ran.clear()
    monkeypatch.setattr(request, "_probe", FakeProbe(40 * GIB))
    nan, qos = fake_request(float("nan"))
    assert nan.execute_using_pool(None) == "sent to the pool" and qos.released == []
    monkeypatch.setattr(request, "_probe", BrokenProbe())
    declared, qos = fake_request(8)
    assert declared.execute_using_pool(None) == "sent to the pool" and qos.released == []
    assert CeleryGenerated.ran == ["task-1", "task-1"]


def test_an_unreadable_device_is_said_once_per_spell(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # (a driver refusing the call refuses it at every task: a warning per task flooded
    # the log)
    monkeypatch.setattr(request._unreadable, "on", False)
    monkeypatch.setattr(request, "_probe", BrokenProbe())
    with caplog.at_level(logging.WARNING, logger=request.__name__):
        for _ in range(3):
            fake_request(8)[0].execute_using_pool(None)
        assert caplog.text.count("could not read free device memory") == 1
        # read again, then lost again: said again
        monkeypatch.setattr(request, "_probe", FakeProbe(40 * GIB))
        fake_request(8)[0].execute_using_pool(None)
        monkeypatch.setattr(request, "_probe", BrokenProbe())
        fake_request(8)[0].execute_using_pool(None)
    assert caplog.text.count("could not read free device memory") == 2


def test_a_declaration_over_its_class_limit_runs_under_the_cap_not_released_for_ever(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # (a producer that skipped the check: no worker could ever start it, and each one
    # released it again, every few seconds, for ever)
    CeleryGenerated.ran.clear()
    monkeypatch.setattr(request, "_probe", FakeProbe(40 * GIB))
    over, qos = fake_request(60)
    over._request_dict["sits"]["sla_class"] = "low"  # 8 GiB in the default table
    over._task = SimpleNamespace(app=SimpleNamespace(sits=SitsConfig()))
    with caplog.at_level("WARNING"):
        assert over.execute_using_pool(None) == "sent to the pool"
    assert qos.released == [] and "over what its class admits (8 GiB)" in caplog.text
    # A class this worker does not know runs in the default one (medium: 32 GiB), and
    # so under that cap (it read as no limit: released for ever)
    renamed, qos = fake_request(60)
    renamed._request_dict["sits"]["sla_class"] = "renamed"
    renamed._task = SimpleNamespace(app=SimpleNamespace(sits=SitsConfig()))
    assert renamed.execute_using_pool(None) == "sent to the pool" and qos.released == []
    assert "over what its class admits (32 GiB)" in caplog.text
    # With no class to read, past what any task may declare
    huge, qos = fake_request(5000)
    assert huge.execute_using_pool(None) == "sent to the pool" and qos.released == []


def test_a_worker_of_plain_tasks_only_leaves_inference_tasks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request, "_probe", FakeProbe(40 * GIB))
    monkeypatch.setattr(request, "_shared", None)
    CeleryGenerated.ran.clear()
    request.leave_inference("threads")
    # an inference task is released (held off from this worker, no redelivery)...
    inference_task, qos = fake_request(None)
    inference_task._task = SimpleNamespace(runs_inference=True)
    with pytest.raises(request.NotStartedHere):
        inference_task.execute_using_pool(None)
    assert qos.released == [("tag-1", request.HOLD_FIRST_S, request.HOLD_LONGEST_S)]
    assert request.SharedProcess("threads").reason().endswith(
        "this worker runs plain tasks only (its 'threads' pool runs several tasks in one "
        "process)")
    # ...a plain one runs, whatever it declares (no class caps in a shared process)
    plain, qos = fake_request(None)
    plain._task = SimpleNamespace()
    assert plain.execute_using_pool(None) == "sent to the pool" and qos.released == []
    # a worker whose tasks each have a process runs inference tasks again
    request.leave_inference(None)
    inference_task, qos = fake_request(None)
    inference_task._task = SimpleNamespace(runs_inference=True)
    assert inference_task.execute_using_pool(None) == "sent to the pool"
    assert CeleryGenerated.ran == ["task-1", "task-1"]


def test_a_pool_sharing_a_process_names_both_ways_out() -> None:
    assert rt.pool_problem("celery.concurrency.prefork", 8) is None
    assert rt.pool_problem("celery.concurrency.thread", 1) is None
    assert rt.pool_problem("celery.concurrency.solo", 4) is None
    problem = rt.pool_problem("celery.concurrency.thread", 4)
    assert problem is not None and "'threads' pool would run 4 tasks in one process" in problem
    assert "--pool=solo" in problem and "SITS_PLAIN_TASKS_ONLY=1" in problem
    assert SitsConfig.from_env({"SITS_PLAIN_TASKS_ONLY": "1"}).plain_tasks_only is True
    assert SitsConfig().plain_tasks_only is False


def test_sits_request_is_a_celery_request() -> None:
    assert issubclass(request.SitsRequest, Request)
    app = make_app(SitsConfig(), main="req-test")
    assert app.tasks["sits.generate"].Request == "sits_queue.workers.request:SitsRequest"


# -- registry and app API ---------------------------------------------------------------------

def test_registry_names_and_errors() -> None:
    registry = ModelRegistry()
    registry.register("a", lambda: 1)
    registry.register("dir", "/models/dir")
    assert registry.names() == ("a", "dir") and "a" in registry and len(registry) == 2
    with pytest.raises(UnknownModel, match=r"'b'.*known: a, dir"):
        registry.get("b")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a", lambda: 2)
    registry.register("a", lambda: 2, replace=True)
    with pytest.raises(ValueError, match="model name"):
        registry.register("has space", lambda: 1)
    with pytest.raises(TypeError):
        registry.register("x", 42)  # type: ignore[arg-type]


def test_a_raising_or_odd_loader_is_a_model_load_error() -> None:
    registry = ModelRegistry()

    def broken() -> Any:
        raise OSError("disk gone")

    with pytest.raises(ModelLoadError, match=r"loader for model 'x' failed: OSError: disk gone"):
        load_engine(registry.register("x", broken), "cpu")
    with pytest.raises(ModelLoadError, match="returned int"):
        load_engine(registry.register("y", lambda: 3), "cpu")
    with pytest.raises(ModelLoadError, match="model 'z': nothing at /no/such/dir"):
        load_engine(registry.register("z", "/no/such/dir"), "cpu")


def test_an_engine_file_registers_by_its_path(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript", reason="onnxscript (the inference extra) exports ONNX")
    from sits_queue.cache.engines import OnnxEngine, export_onnx

    # Given an ONNX file on disk, registered as the model by its path
    module = torch.nn.Linear(4, 2)
    path = export_onnx(module, (torch.ones(1, 4),), tmp_path / "head.onnx")
    registry = ModelRegistry()
    engine = load_engine(registry.register("head", path), "cpu")
    # Then it loads as the engine its suffix names (it was refused: "not a model
    # directory", though the backends behind the cache read it)
    assert isinstance(engine, OnnxEngine) and engine.key == "head"
    engine.to_device("cpu")
    x = torch.randn(1, 4)
    got = torch.as_tensor(engine(x))
    torch.testing.assert_close(got, module(x).detach(), atol=1e-5, rtol=0)
    # A file of no engine format is refused naming the formats
    (other := tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ModelLoadError, match=r"'w': .*weights\.bin is neither a model "
                                             r"directory nor an engine file \(\.onnx, "):
        load_engine(registry.register("w", other), "cpu")


def test_a_soft_time_limit_while_loading_is_the_tasks_not_the_models() -> None:
    from celery.exceptions import SoftTimeLimitExceeded

    def slow() -> Any:
        raise SoftTimeLimitExceeded()  # as Celery's signal handler raises it mid-load

    # Not "ModelLoadError": the model is fine, the task ran out of time
    with pytest.raises(SoftTimeLimitExceeded):
        load_engine(ModelRegistry().register("s", slow), "cpu")


def test_app_model_decorator_and_inference_task() -> None:
    app = make_app(SitsConfig(), main="api-test")

    @app.model("summarizer")
    def load() -> str:
        return "/models/summarizer"

    @app.inference_task(model="summarizer", sla_class="low")
    def summarize(engine: Any, text: str, words: int = 10) -> str:
        return text

    assert "summarizer" in app.models
    assert summarize.model == "summarizer" and summarize.sla_class == "low"
    assert getattr(summarize.run, ENGINE_ARG)
    # Callers check arguments without the engine: it is the worker's to supply
    summarize.__header__("some text")
    summarize.__header__("some text", words=3)
    with pytest.raises(TypeError):
        summarize.__header__()
    with pytest.raises(TypeError, match="bind"):
        app.inference_task(model="summarizer", bind=True)


def test_builtin_tasks_go_to_the_work_queue_and_maintenance_to_control() -> None:
    from sits_queue.options import route_maintenance

    app = make_app(SitsConfig(), main="route-test")
    route = app.amqp.router.route
    assert route({}, "sits.generate")["queue"].name == "celery"
    assert route({}, "sits.embed")["queue"].name == "celery"
    # (routed as sent, by send_task and enqueue_many: tests/integration/test_beat.py)
    route_maintenance("sits.rescore", options := {})
    assert route(options, "sits.rescore")["queue"].name == "sits.control"


# -- cold-start metadata and the advertisement ---------------------------------------------------

def test_cold_meta_shape() -> None:
    from sits_queue.cache.pool import ColdStart
    from sits_queue.workers.acquire import cold_meta as _cold_meta

    meta = _cold_meta(ColdStart(True, "host", 0.0, 0.0, 1.23456, 2.0, ("x",), ()), 150.0)
    assert meta == {"cold": True, "source": "host", "cuda_ctx_ms": 150.0, "load_ms": 0.0,
                    "promote_ms": 1.235, "warmup_ms": 2.0, "evicted": ["x"], "demoted": []}


@pytest.mark.parametrize(("runs", "cold", "share"), [(0, 0, 0.0), (10, 3, 0.3), (4, 4, 1.0)])
def test_cold_share(runs: int, cold: int, share: float) -> None:
    assert advertise.cold_share({"runs": runs, "cold_runs": cold}) == share


def test_worker_record() -> None:
    record = advertise.worker_record("w@h", 123, 4, [gpu_device(0)],
                                     {b"tasks": b"10", b"cold": b"2", b"cold_ms": b"500.5",
                                      b"runs": b"12", b"cold_runs": b"3",
                                      b"cold:disk": b"1", b"cold:host": b"1",
                                      b"phase_ms:load": b"480.25", b"phase_ms:warmup": b"20.25",
                                      b"failed": b"3", b"failed:UnknownModel": b"3",
                                      b"affinity": b"4", b"ftt": b"4", b"ftt_ms": b"50"},
                                     now_s=1.0)
    assert record["concurrency"] == 4 and record["pid"] == 123
    assert record["devices"][0]["uuid"] == "GPU-0000-uuid"
    assert record["devices"][0]["total_vram_bytes"] == 80 * GIB
    assert record["cold_start"] == {"tasks": 10, "cold": 2, "cold_ms": 500.5,
                                    "cold_share": 0.25, "cold_ms_mean": 250.25,
                                    "first_tokens": 4, "first_token_ms_mean": 12.5,
                                    "affinity_picks": 4,
                                    "phases_ms": {"load": 480.25, "warmup": 20.25},
                                    "by_source": {"disk": 1, "host": 1},
                                    "failed": {"UnknownModel": 3}}
    assert advertise.counters_from({})["cold_share"] == 0.0


def test_advertisement_keys() -> None:
    assert advertise.worker_key("p:", "w@h") == "p:sits:worker:w@h"
    assert advertise.child_key("p:", "w@h", 2) == "p:sits:worker:w@h:child:2"
    assert advertise.counters_key("", "w@h") == "sits:worker:w@h:counters"


# -- gpu helpers on a CPU host -----------------------------------------------------------------

def test_oom_mapping() -> None:
    import torch

    assert gpu.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert gpu.is_oom(RuntimeError("CUDA error: out of memory"))
    assert gpu.is_oom(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not gpu.is_oom(RuntimeError("shape mismatch"))
    assert not gpu.is_oom(ValueError("out of memory"))  # not a runtime failure


def test_gpu_helpers_are_no_ops_without_cuda() -> None:
    if gpu.cuda_available():
        pytest.skip("this host has CUDA; tests/gpu covers it")
    assert gpu.create_context() == 0.0
    assert gpu.cap_memory(0.5) is False
    assert gpu.total_memory_bytes() is None
    assert gpu.memory_stats() == {"allocated_bytes": 0, "reserved_bytes": 0,
                                  "peak_allocated_bytes": 0}
    gpu.release_memory()
    with pytest.raises(ValueError):
        gpu.cap_memory(0.0)


def test_allocatable_memory_is_capped_by_the_class_fraction() -> None:
    # An 80 GiB device, 70 GiB free to the driver; the allocator holds 6 GiB, 4 in use
    free, total, reserved, used = 70 * GIB, 80 * GIB, 6 * GIB, 4 * GIB
    assert gpu.allocatable(free, total, reserved, used, None) == 72 * GIB  # + its cache
    # Under a class capped at 10% (8 GiB): 4 more, whatever the driver has free
    assert gpu.allocatable(free, total, reserved, used, 0.1) == 4 * GIB
    # The driver is the limit when others took the device
    assert gpu.allocatable(GIB, total, reserved, used, 0.5) == 3 * GIB
    # Past the cap (a fraction lowered under live tensors): nothing, never negative
    assert gpu.allocatable(free, total, reserved, used, 0.04) == 0


def test_discovery_mapping_is_frozen() -> None:
    # The plan a parent hands its children must not change under them.
    plan = rt.WorkerPlan("w", FOUR_GPUS, (0, 1), 2)
    with pytest.raises(AttributeError):
        plan.slots = 3  # type: ignore[misc]
    assert isinstance(FOUR_GPUS.topology, MappingProxyType)


@pytest.mark.parametrize(("module", "concurrency"), [
    ("celery.concurrency.prefork", 8), ("celery.concurrency.solo", 1),
    ("celery.concurrency.thread", 1), ("celery.concurrency.gevent", 1),
])
def test_process_pools_and_one_task_at_a_time_are_allowed(module: str,
                                                          concurrency: int) -> None:
    assert rt.pool_problem(module, concurrency) is None


@pytest.mark.parametrize("module", ["celery.concurrency.thread", "celery.concurrency.gevent",
                                    "celery.concurrency.eventlet", "my.custom.pool"])
def test_tasks_side_by_side_in_one_process_are_refused_with_the_fix(module: str) -> None:
    problem = rt.pool_problem(module, 4)
    assert problem is not None and "would run 4 tasks in one process" in problem
    assert "--pool=solo" in problem and "--concurrency=1" in problem


@pytest.mark.parametrize(("request_", "key"), [
    ({HEADER: {"prefix_key": "tpl-a"}}, "tpl-a"),               # a batch job's request dict
    ({"headers": {HEADER: {"prefix_key": "tpl-b"}}}, "tpl-b"),  # an eager call's, as a dict
    (SimpleNamespace(**{HEADER: {"prefix_key": "tpl-c"}}), "tpl-c"),  # a delivered request
    ({HEADER: {"prefix_key": ""}}, None),
    ({HEADER: "not a header"}, None),
    ({}, None),
])
def test_a_tasks_prefix_key_is_read_from_a_request_or_a_request_dict(
        request_: Any, key: str | None) -> None:
    """A batch's calls are made from request dicts: read as objects, every call had none."""
    assert taskheader.task_prefix_key(request_) == key


class RefusingChannel:
    """The transport's channel as the guard uses it: ``refuse`` dead-letters, or says it
    did not (a lost connection, ``Channel.refuse``)."""

    def __init__(self, takes: bool = True) -> None:
        self.takes = takes
        self.refused: list[tuple[str, Any, Exception]] = []

    def refuse(self, queue: str, message: Any, exc: Exception) -> bool:
        if self.takes:
            self.refused.append((queue, message, exc))
        return self.takes


def unstartable_request(channel: RefusingChannel) -> CeleryGenerated:
    req, _ = fake_request(None)
    req._message = SimpleNamespace(channel=channel, delivery_tag="tag-1", _state="RECEIVED")
    req._request_dict = {"id": "task-1", "task": "t", "sits_delivery": ["celery", "tag-1"]}
    return req


def test_a_request_celery_cannot_check_is_dead_lettered_and_its_slot_freed() -> None:
    channel = RefusingChannel()
    req = unstartable_request(channel)
    req._request_dict["stamped_headers"] = 5  # Celery's revoke check raises on it
    CeleryGenerated.ran.clear()
    # (NotStartedHere is a TaskRevokedError: Celery gives the pool slot back for it)
    with pytest.raises(request.NotStartedHere):
        req.execute_using_pool(None)
    assert CeleryGenerated.ran == []
    ((queue, message, exc),) = channel.refused
    assert queue == "celery" and message is req.message and isinstance(exc, TypeError)
    assert req.acknowledged


def test_what_the_channel_does_not_dead_letter_is_raised_and_the_request_kept() -> None:
    req = unstartable_request(RefusingChannel(takes=False))
    assert not request.dead_letter_unstartable(req, ConnectionError("Redis went away"))
    assert not req.acknowledged


def test_a_message_of_another_transport_is_not_dead_lettered_here() -> None:
    req, _ = fake_request(None)  # its channel has no refuse(), its request no delivery
    assert not request.dead_letter_unstartable(req, ValueError("x"))


def _ranker() -> Any:
    return None


def test_the_same_registration_again_changes_nothing_and_another_is_refused(
        tmp_path: Path) -> None:
    """(README: "the same registration again, as a module imported twice makes, changes
    nothing": a path registered twice raised, a re-imported module's loader raised, and
    sample tensors raised "Boolean value of Tensor ... is ambiguous")"""
    import importlib.util

    import torch

    registry = ModelRegistry()
    registry.register("lm", tmp_path)
    registry.register("lm", str(tmp_path))
    registry.register("lm", tmp_path / ".." / tmp_path.name)  # the same place written
    registry.register("lm", f"{tmp_path}/./")                 # otherwise
    first = registry.register("ranker", _ranker, sample_inputs=(torch.randn(1, 8),))
    assert registry.register("ranker", _ranker, sample_inputs=(torch.randn(1, 8),)) is first
    # A module imported twice (as __main__ and by name): new loader objects, same source
    source = tmp_path / "mytasks.py"
    source.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(8, 2)\n")
    builds = []
    for name in ("mytasks_a", "mytasks_b"):
        spec = importlib.util.spec_from_file_location(name, source)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        builds.append(module.build)
    assert builds[0] is not builds[1]
    registry.register("linear", builds[0], sample_inputs={"x": torch.zeros(2, 8)})
    registry.register("linear", builds[1], sample_inputs={"x": torch.ones(2, 8)})
    assert registry.get("linear").loader is builds[0]
    # Another loader, another path, or samples of another shape or dtype: refused
    for loader, sample in [(lambda: None, (torch.randn(1, 8),)),
                           (_ranker, (torch.randn(2, 8),)),
                           (_ranker, (torch.randn(1, 8, dtype=torch.float64),)),
                           (_ranker, None)]:
        with pytest.raises(ValueError, match="already registered"):
            registry.register("ranker", loader, sample_inputs=sample)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("lm", tmp_path / "other")


def test_a_pools_slots_are_its_live_childrens_indexes() -> None:
    """(after ``pool_shrink`` billiard stops the first idle child: a pool of three keeps
    slots 1 and 2, and the advertisement read and re-armed 0 and 1)"""
    from types import SimpleNamespace

    def prefork(*indexes: int) -> object:
        return SimpleNamespace(_pool=SimpleNamespace(
            _pool=[SimpleNamespace(index=i) for i in indexes]))

    assert advertise.pool_slots(prefork(2, 1), 2) == [1, 2]
    assert advertise.pool_slots(prefork(0, 1, 2), 3) == [0, 1, 2]
    assert advertise.pool_slots(prefork(), 3) == [0, 1, 2]  # no child started yet
    assert advertise.pool_slots(SimpleNamespace(), 2) == [0, 1]  # solo, threads
    assert advertise.pool_slots(None, 0) == []  # a pool shrunk to no child
    assert advertise.pool_slots(prefork(*[None]), 2) == [0, 1]  # type: ignore[list-item]


@pytest.mark.parametrize(("record", "slots"), [
    ({"concurrency": 2, "slots": [2, 1]}, [1, 2]),
    ({"concurrency": 3}, [0, 1, 2]),  # an older writer's: none named
    ({"concurrency": 2, "slots": "1,2"}, [0, 1]),
    ({"concurrency": 2, "slots": [True, 1]}, [0, 1]),
    ({"concurrency": 2, "slots": [1, 5000]}, [0, 1]),
    ({"concurrency": 2, "slots": []}, [0, 1]),
    ({"concurrency": 10_000}, []), ({"concurrency": "2"}, []), ({}, []),
])
def test_a_records_slots_are_read_back_or_made_from_its_concurrency(
        record: dict[str, object], slots: list[int]) -> None:
    assert advertise.record_slots(record) == slots


def test_a_worker_record_names_its_slots() -> None:
    assert advertise.worker_record("w@h", 1, 2, [], {}, 1.0, [1, 2])["slots"] == [1, 2]
    assert advertise.worker_record("w@h", 1, 2, [], {}, 1.0)["slots"] == [0, 1]


def test_the_largest_device_is_read_off_every_worker_record() -> None:
    records = [{"devices": [{"total_vram_bytes": 24 * GIB}, {"total_vram_bytes": 80 * GIB}]},
               {"devices": [{"total_vram_bytes": 141 * GIB}]}]
    assert advertise.largest_device_bytes(records) == 141 * GIB
    # what no worker writes is passed over; nothing readable: None (not "0 bytes")
    odd: list[dict[str, Any]] = [
        {}, {"devices": None}, {"devices": ["x", {"total_vram_bytes": "80"}]},
        {"devices": [{"total_vram_bytes": True}, {"total_vram_bytes": 3.5}]}]
    assert advertise.largest_device_bytes(odd) is None
    assert advertise.largest_device_bytes([]) is None
    assert advertise.largest_device_bytes([*odd, records[0]]) == 80 * GIB


def fake_nvml(memory: dict[str, Any]) -> Any:
    return SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                           nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
                           nvmlDeviceGetMemoryInfo=lambda handle: memory[handle])


def test_what_a_child_holds_cached_counts_as_free_on_its_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(NVML counts torch's cache as used: after a task that used and freed 50 GiB on
    an 80 GB device, one declaring 40 was refused with ~26 GiB "free", released and
    held off for ever by the worker whose child could run it)"""
    nvml = fake_nvml({"GPU-a": SimpleNamespace(free=26 * GIB, total=80 * GIB)})
    cached = {"GPU-a": 50 * GIB}
    request.configure(freemem.NvmlProbe(["GPU-a"], nvml), lambda: cached)
    try:
        CeleryGenerated.ran.clear()
        fits, qos = fake_request(40)
        assert fits.execute_using_pool(None) == "sent to the pool" and qos.released == []
        # unreadable records (Redis away): NVML's figure alone, as before
        request.configure(freemem.NvmlProbe(["GPU-a"], nvml),
                          lambda: (_ for _ in ()).throw(ConnectionError("gone")))
        refused, qos = fake_request(40)
        with pytest.raises(request.NotStartedHere):
            refused.execute_using_pool(None)
        assert qos.released
    finally:
        request.configure(None)


def test_cached_memory_is_read_per_device_the_least_of_its_children() -> None:
    gpus = {0: SimpleNamespace(kind="cuda", uuid="GPU-a"),
            1: SimpleNamespace(kind="cuda", uuid="GPU-b"),
            2: SimpleNamespace(kind="cuda", uuid="GPU-a")}

    def child(reserved: Any, allocated: Any) -> dict[str, Any]:
        return {"memory": {"reserved_bytes": reserved, "allocated_bytes": allocated}}

    children = {"0": child(30, 10), "1": child(5, 5), "2": child(12, 2),
                "3": child("lots", 1), "4": child(True, 0), "x": child(9, 0), "5": "odd"}
    device_of = lambda slot: gpus.get(slot) or SimpleNamespace(kind="cpu", uuid="cpu")  # noqa: E731
    # the task goes to whichever child of the device is idle: the least any holds
    assert freemem.cached_by_device(children, device_of) == {"GPU-a": 10, "GPU-b": 0}
    assert freemem.cached_by_device({}, device_of) == {}


def test_a_probe_reads_the_largest_device_in_all() -> None:
    memory = {"a": SimpleNamespace(free=5, total=16), "b": SimpleNamespace(free=9, total=12)}
    probe = freemem.NvmlProbe(["a", "b"], fake_nvml(memory))
    assert (probe.max_free_bytes(), probe.max_total_bytes()) == (9, 16)
    assert probe.max_free_bytes({"a": 6}) == 11  # a's cached memory counted on a
    probe.close()
    host = freemem.HostProbe()
    assert 0 < host.max_free_bytes() <= host.max_total_bytes()


@pytest.mark.parametrize(("autoscale", "most"), [
    (None, 0), ("4,1", 4), ("3", 3), ([6, 2], 6), ((2, 0), 2), ("x,1", 0), ([], 0)])
def test_an_autoscaled_pools_largest_size(autoscale: Any, most: int) -> None:
    from sits_queue.workers.planstep import autoscale_max

    assert autoscale_max(autoscale) == most


def test_the_parent_imports_the_inference_stack_only_for_an_app_with_models(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:
    from sits_queue.workers import planstep

    broken = tmp_path / "sits_broken_stack.py"
    broken.write_text("raise RuntimeError('libcudart.so.12: cannot open shared object')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(planstep, "PREIMPORTS",
                        ("torch", "sits_not_installed_stack", "sits_broken_stack", "json"))
    app = make_app(SitsConfig(), main="preimport-unit")
    assert planstep.preimport(app) == []  # no models: nothing to import for
    app.register_model("m", lambda: None)
    with caplog.at_level("WARNING", logger="sits_queue.workers.planstep"):
        # one not installed is skipped, one that fails is said, the rest go on
        assert planstep.preimport(app) == ["torch", "json"]
    assert "importing sits_broken_stack ahead of the pool failed (RuntimeError: " \
           "libcudart.so.12" in caplog.text


def test_loaders_made_by_one_factory_for_two_models_are_two_registrations(
        tmp_path: Path) -> None:
    """(only the loaders' code was compared: a factory's loader for another path, or a
    default argument's, was taken for the first registration, and every task was served
    the first model; a partial registered twice raised)"""
    import functools

    def factory(path: str) -> Any:
        def load() -> str:
            return path
        return load

    registry = ModelRegistry()
    registry.register("summarizer", factory("lm-a"))
    registry.register("summarizer", factory("lm-a"))  # the same again: nothing changes
    with pytest.raises(ValueError, match="already registered"):
        registry.register("summarizer", factory("lm-b"))
    assert registry.get("summarizer").loader() == "lm-a"
    defaults = [lambda p=p: p for p in ("x", "y")]
    registry.register("by-default", defaults[0])
    with pytest.raises(ValueError, match="already registered"):
        registry.register("by-default", defaults[1])

    def build(path: str) -> str:
        return path

    registry.register("partial", functools.partial(build, "lm-a"))
    registry.register("partial", functools.partial(build, "lm-a"))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("partial", functools.partial(build, "lm-b"))
