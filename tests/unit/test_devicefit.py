"""A pool child's own check of a declared ``vram_gib`` (``workers/devicefit.py``), and the
main process's give-back when it says no: without Redis, a GPU or a worker."""

from __future__ import annotations

import logging
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import Reject

from sits_queue.app import make_app
from sits_queue.broker.keys import DELIVERY_HEADER
from sits_queue.config import SitsConfig
from sits_queue.options import HEADER
from sits_queue.workers import devicefit, freemem, gpu, request
from sits_queue.workers import runtime as rt
from sits_queue.workers.devices import Device, Discovery
from sits_queue.workers.limits import BYTES_PER_GIB as GIB
from sits_queue.workers.slices import Preempted
from tests.unit.test_worker_runtime import FakeQoS


def gpu_device(index: int) -> Device:
    return Device(index=index, kind="cuda", name="NVIDIA H100 80GB HBM3",
                  uuid=f"GPU-{index:04d}-uuid", total_vram_bytes=80 * GIB,
                  free_vram_bytes=70 * GIB)


TWO_GPUS = Discovery(devices=(gpu_device(0), gpu_device(1)))
ONE_GPU = Discovery(devices=(gpu_device(0),))
app = make_app(SitsConfig(), main="devicefit-test")


@app.task(name="t.big")
def big() -> str:
    return "ran"


def child(discovery: Discovery = TWO_GPUS, slot: int = 0,
          pool_child: bool = True) -> rt.ChildRuntime:
    plan = rt.WorkerPlan("w@h", discovery, (0, 1), slots=len(discovery.devices))
    return rt.ChildRuntime(app=app, plan=plan, slot=slot,
                           device=rt.device_for_slot(discovery, slot), pool_child=pool_child)


def delivered(vram_gib: Any, sla_class: str = "high", **request: Any) -> dict[str, Any]:
    """A worker request's fields, as the SITS transport delivers a task."""
    return {"id": "task-1", HEADER: {"vram_gib": vram_gib, "sla_class": sla_class},
            DELIVERY_HEADER: ["q", "task-1"], "delivery_info": {}, **request}


def free(monkeypatch: pytest.MonkeyPatch, gib: float) -> list[str]:
    """This child's device reads ``gib`` free; returns the devices read."""
    read: list[str] = []

    def own_free_bytes(runtime: rt.ChildRuntime) -> int:
        read.append(runtime.device.uuid)
        return int(gib * GIB)

    monkeypatch.setattr(devicefit, "own_free_bytes", own_free_bytes)
    return read


def run(task: Any, fields: dict[str, Any]) -> Any:
    task.push_request(**fields)
    try:
        return task()
    finally:
        task.pop_request()


def test_a_task_that_does_not_fit_this_childs_device_is_refused_before_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a worker of two GPUs whose main process admitted a 40 GiB task (by its
    # roomiest device), and the pool handed it to the child of GPU 0, 10 GiB free
    monkeypatch.setattr(rt, "_child", child(slot=0))
    read = free(monkeypatch, 10)
    with pytest.raises(request.NotOnThisDevice) as refused:
        run(big, delivered(40))
    # Then the task's code never ran and the reason names the device and the numbers
    assert read == ["GPU-0000-uuid"]
    assert "vram_gib=40 but this child's device 0 (GPU-0000-uuid) has 10.00 GiB free" \
        in refused.value.reason
    # It is a requeueing Reject to Celery's tracer, and crosses to the main process whole
    assert isinstance(refused.value, Reject | Preempted) and refused.value.requeue
    back = pickle.loads(pickle.dumps(refused.value))
    assert type(back) is request.NotOnThisDevice and back.reason == refused.value.reason
    # On a device with room it runs
    free(monkeypatch, 50)
    assert run(big, delivered(40)) == "ran"


@pytest.mark.parametrize(("case", "runtime", "fields"), [
    ("one GPU: the main process's check is the device's", child(ONE_GPU), delivered(40)),
    ("not a pool child (a script's direct call)", child(pool_child=False), delivered(40)),
    ("an eager call", child(), delivered(40, is_eager=True)),
    ("not delivered by the SITS transport", child(),
     {"id": "task-1", HEADER: {"vram_gib": 40}}),
    ("nothing declared", child(), delivered(None)),
    ("an unreadable declaration", child(), delivered("forty")),
    # (the main process started it under its class's cap, with a warning: refused here,
    # every child would refuse it for ever)
    ("over its class's cap (low: 8 GiB)", child(), delivered(40, sla_class="low")),
])
def test_the_check_applies_only_where_it_can_differ(
        monkeypatch: pytest.MonkeyPatch, case: str, runtime: rt.ChildRuntime,
        fields: dict[str, Any]) -> None:
    monkeypatch.setattr(rt, "_child", runtime)
    read = free(monkeypatch, 1)
    assert run(big, fields) == "ran", case
    assert read == [], case


def test_a_task_acked_before_it_runs_is_never_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its message is gone from the broker: given back, the task would be lost
    @app.task(name="t.early", acks_late=False)
    def early() -> str:
        return "ran"

    monkeypatch.setattr(rt, "_child", child())
    read = free(monkeypatch, 1)
    assert run(early, delivered(40)) == "ran" and read == []


def test_an_unreadable_device_lets_the_task_run(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    def broken(runtime: rt.ChildRuntime) -> int:
        raise RuntimeError("NVML: the driver went away")

    monkeypatch.setattr(rt, "_child", child())
    monkeypatch.setattr(devicefit, "own_free_bytes", broken)
    monkeypatch.setattr(devicefit._unreadable, "on", False)
    with caplog.at_level(logging.WARNING, logger=devicefit.__name__):
        assert run(big, delivered(40)) == "ran"
        assert run(big, delivered(40)) == "ran"
    # said once per child, not at every task
    assert caplog.text.count("could not read device GPU-0000-uuid's free memory") == 1
    # ...but a task larger than the whole device never fits it: refused, not run (a 50
    # GiB task ran on a 24 GB L4 whose memory read failed)
    small = Device(index=1, kind="cuda", name="NVIDIA L4", uuid="GPU-l4",
                   total_vram_bytes=24 * GIB, free_vram_bytes=22 * GIB)
    monkeypatch.setattr(rt, "_child", child(Discovery(devices=(gpu_device(0), small)), slot=1))
    with pytest.raises(Reject) as refused:
        run(big, delivered(50))
    assert "has 24.00 GiB in all (its free memory could not be read" in str(
        refused.value.reason)
    assert run(big, delivered(20)) == "ran"  # (it may fit: run, as before)


class FakeNvml:
    """pynvml's calls the probe makes, for one device."""

    def __init__(self, free_bytes: int) -> None:
        self.free_bytes, self.inits = free_bytes, 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        assert handle == "GPU-0001-uuid"
        return SimpleNamespace(free=self.free_bytes, total=80 * GIB)


def test_own_free_memory_counts_this_childs_cached_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML counts the allocator's cache used, yet the task reuses it
    nvml = FakeNvml(10 * GIB)
    monkeypatch.setattr(devicefit, "_probe", freemem.NvmlProbe(["GPU-0001-uuid"], nvml))
    monkeypatch.setattr(gpu, "memory_stats", lambda: {
        "allocated_bytes": 2 * GIB, "reserved_bytes": 32 * GIB, "peak_allocated_bytes": 0})
    assert devicefit.own_free_bytes(child(slot=1)) == 40 * GIB
    assert devicefit.own_free_bytes(child(slot=1)) == 40 * GIB
    assert nvml.inits == 1  # kept open between tasks


def test_the_main_process_gives_a_refused_task_back_uncounted_and_held_off(
        caplog: pytest.LogCaptureFixture) -> None:
    qos = FakeQoS()
    req = request.SitsRequest.__new__(request.SitsRequest)
    req._message = SimpleNamespace(channel=SimpleNamespace(qos=qos), delivery_tag="tag-1",
                                   _state="RECEIVED")
    req.id, req.name, req._eventer, req._request_dict = "task-1", "t.big", None, {}
    refused = request.NotOnThisDevice("declares vram_gib=40 but this child's device 0 ...")
    with caplog.at_level(logging.INFO, logger=request.__name__):
        assert req.on_failure(SimpleNamespace(exception=refused)) is None
    # released (release.lua: no redelivery counted), held off from this worker briefly:
    # another of its children may be the idle one by then
    assert qos.released == [("tag-1", *request.CHILD_HOLDS)]
    assert req.message._state == "REQUEUED" and req.acknowledged
    assert "t.big[task-1] not started here: declares vram_gib=40 but this child's " \
        "device 0" in caplog.text


def batch_calls(*declared: Any, **request: Any) -> list[Any]:
    """A batch's calls' requests, as ``run_batch`` builds them (attribute access)."""
    from celery.app.task import Context

    return [Context({**delivered(v, **request), "id": f"call-{n}"})
            for n, v in enumerate(declared)]


def test_a_batch_is_checked_once_by_the_most_any_call_declares(
        monkeypatch: pytest.MonkeyPatch) -> None:
    read = free(monkeypatch, 30)
    # The calls run on one engine: 40 GiB declared by one of them does not fit 30 free
    misfit = devicefit.batch_misfit(child(), big, batch_calls(8, None, 40, 20))
    assert isinstance(misfit, request.NotOnThisDevice)
    assert "vram_gib=40 but this child's device 0 (GPU-0000-uuid) has 30.00 GiB free" \
        in misfit.reason
    assert read == ["GPU-0000-uuid"]  # (one read for the batch)
    # 20 and less fit; a batch declaring nothing is not read for
    assert devicefit.batch_misfit(child(), big, batch_calls(8, 20)) is None
    assert devicefit.batch_misfit(child(), big, batch_calls(None, None)) is None
    assert len(read) == 2


def test_a_batch_the_check_does_not_apply_to_runs_unchecked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    read = free(monkeypatch, 1)
    # over its class's cap (64 GiB for "high"): it runs under the cap, as alone
    assert devicefit.batch_misfit(child(), big, batch_calls(200)) is None
    # one GPU, eager calls, no child: as for a task alone
    assert devicefit.batch_misfit(child(ONE_GPU), big, batch_calls(40)) is None
    assert devicefit.batch_misfit(child(), big, batch_calls(40, is_eager=True)) is None
    assert devicefit.batch_misfit(None, big, batch_calls(40)) is None
    assert devicefit.batch_misfit(child(), big, []) is None
    assert read == []
    # an unreadable device: run (its class cap still holds)

    def unreadable(runtime: rt.ChildRuntime) -> int:
        raise OSError("NVML refused")

    monkeypatch.setattr(devicefit, "own_free_bytes", unreadable)
    assert devicefit.batch_misfit(child(), big, batch_calls(40)) is None
