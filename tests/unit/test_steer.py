"""Which pool child gets a task (steer.py): one on a GPU that can hold it, one that holds
its engine warm."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from sits_queue.broker import affinity
from sits_queue.workers import freemem, request, steer
from tests.unit.test_worker_runtime import CeleryGenerated, fake_nvml, fake_request

GIB = 2**30


@pytest.fixture(autouse=True)
def _forget(monkeypatch: pytest.MonkeyPatch) -> Any:
    steer._wanted.clear()
    steer._children.clear()
    monkeypatch.setattr(steer, "_steered", steer._Steered(None, lambda slot: None))
    yield
    steer._wanted.clear()
    steer._children.clear()


@pytest.mark.parametrize(("ready", "busy", "chosen"), [
    ([10, 11], set(), [11]),          # the idle child on a device that holds it
    ([10, 11, 12], set(), [11]),      # the first of those, in the pool's order
    ([10, 11, 12], {11}, [12]),       # one busy: the next that fits
    ([10, 11], {11}, None),           # none idle that fits: the pool chooses
    ([10], set(), None),              # not writable now: likewise
])
def test_the_head_task_goes_to_an_idle_child_whose_device_holds_it(
        ready: list[int], busy: set[int], chosen: list[int] | None) -> None:
    device = {10: "GPU-small", 11: "GPU-big", 12: "GPU-big2"}
    want = steer.Wanted(devices=frozenset({"GPU-big", "GPU-big2"}))
    idle = [fd for fd in ready if fd not in busy]
    assert steer.choose(idle, want, device.get, lambda fd: None) == chosen


def fake_pool(slots: dict[int, int]) -> Any:
    """An ``AsynPool``'s parts steering reads: inqueue fd -> process (its slot), and its
    write scheduling as Celery's (``schedule_writes``: one job per writable idle child,
    in the order given, that child then busy), each write noted in ``hub.written``."""
    pool = SimpleNamespace(
        outbound_buffer=deque(), _busy_workers=set(), _active_writes=set(),
        _fileno_to_inq={fd: SimpleNamespace(index=slot) for fd, slot in slots.items()})

    def create_write_handlers(hub: Any) -> None:
        def schedule_writes(fds: list[int]) -> None:
            hub.calls.append(list(fds))
            for fd in fds:
                if fd in pool._busy_workers or fd not in pool._fileno_to_inq or \
                        not pool.outbound_buffer:
                    continue
                hub.written.append((pool.outbound_buffer.popleft().correlation_id, fd))
                pool._busy_workers.add(fd)
        hub.consolidate_callback = schedule_writes

    pool._create_write_handlers = create_write_handlers
    return pool


def job(task_id: str) -> Any:
    return SimpleNamespace(correlation_id=task_id)


def installed(slots: dict[int, int], device: dict[int, str] | None = None
              ) -> tuple[Any, Any]:
    pool = fake_pool(slots)
    assert steer.install(pool, (device or {}).get)
    hub = SimpleNamespace(written=[], calls=[])
    pool._create_write_handlers(hub)
    return pool, hub


def test_an_installed_pool_writes_a_wanted_task_to_a_child_of_its_device() -> None:
    pool, hub = installed({10: 0, 11: 1}, {0: "GPU-big", 1: "GPU-small"})
    # Given the pool's writable children in its order, the small GPU's first
    pool.outbound_buffer.append(job("t-big"))
    steer.want("t-big", frozenset({"GPU-big"}))
    hub.consolidate_callback([11, 10])
    # Then the task that fits the big GPU only is written to its child, once
    assert hub.written == [("t-big", 10)] and steer.wanted("t-big") is None
    # and a task that declares nothing goes where the pool says
    pool._busy_workers.clear()
    pool.outbound_buffer.append(job("t-any"))
    hub.consolidate_callback([11, 10])
    assert hub.calls[-1] == [11, 10] and hub.written[-1] == ("t-any", 11)
    # A pool without those parts (solo, threads) is left alone
    assert not steer.install(SimpleNamespace(), lambda slot: None)
    assert not steer.install(None, lambda slot: None)


def test_jobs_behind_the_head_are_steered_too() -> None:
    """(Celery writes one job per writable child in one call: the wrapper steered the
    head only, and the next job went to the child left, cold, while the head, warm
    nowhere, took the child that held the next one's model)"""
    pool, hub = installed({10: 0, 11: 1})
    steer.note_children({0: affinity.Warm({"lm-a": 1.0}), 1: affinity.Warm({"gpt": 1.0})})
    # Given a task of a model warm nowhere, then one of lm-a (warm in slot 0), and a
    # plain task first in the next call
    pool.outbound_buffer.extend([job("t-cold"), job("t-lm-a")])
    steer.want_warm("t-cold", "lm-b", None, None)
    steer.want_warm("t-lm-a", "lm-a", None, None)
    hub.consolidate_callback([10, 11])
    # Then lm-a goes to the child that holds it, the other to the child left
    assert sorted(hub.written) == [("t-cold", 11), ("t-lm-a", 10)]
    assert steer.wanted("t-cold") is None and steer.wanted("t-lm-a") is None
    # And likewise behind a plain task
    pool._busy_workers.clear()
    pool.outbound_buffer.extend([job("t-plain"), job("t-gpt")])
    steer.want_warm("t-gpt", "gpt", None, None)
    hub.consolidate_callback([11, 10])
    assert sorted(hub.written[2:]) == [("t-gpt", 11), ("t-plain", 10)]
    # and a job the pool does not write (its child gone meanwhile) stays at the head:
    # the call ends, the pool writes it on a later turn
    pool._busy_workers.clear()
    pool.outbound_buffer.append(job("t-later"))
    steer.want_warm("t-later", "gpt", None, None)
    hub.consolidate_callback([13])
    assert list(pool.outbound_buffer) == [job("t-later")] and hub.calls[-1] == [13]


def test_a_child_a_waiting_job_will_take_is_not_idle_for_the_pick() -> None:
    """(the transport picks several messages in one turn of the loop: weighed by every
    idle child, a burst took two gpt tasks for two idle children, one holding gpt, the
    other lm-a, and the second loaded gpt cold there while lm-a tasks waited)"""
    pool, _ = installed({10: 0, 11: 1, 12: 2})
    steer.note_children({0: affinity.Warm({"lm-a": 1.0}), 1: affinity.Warm({"gpt": 1.0})})
    assert steer.idle_slots() == {0, 1, 2}
    pool.outbound_buffer.append(job("t-gpt"))
    steer.want_warm("t-gpt", "gpt", None, None)
    assert steer.idle_slots() == {0, 2}  # slot 1 is the gpt task's
    pool.outbound_buffer.append(job("t-plain"))
    assert steer.idle_slots() == {2}  # (a plain job takes the first child left)
    pool._busy_workers.add(12)
    assert steer.idle_slots() == frozenset()  # none left: the pick weighs them all


def test_admission_notes_the_devices_that_hold_the_task() -> None:
    nvml = fake_nvml({"GPU-big": SimpleNamespace(free=70 * GIB, total=80 * GIB),
                      "GPU-small": SimpleNamespace(free=35 * GIB, total=40 * GIB)})
    request.configure(freemem.NvmlProbe(["GPU-big", "GPU-small"], nvml))
    try:
        CeleryGenerated.ran.clear()
        big, _ = fake_request(50)
        assert big.execute_using_pool(None) == "sent to the pool"
        assert (w := steer.wanted("task-1")) is not None and w.devices == {"GPU-big"}
        steer.forget("task-1")
        both, _ = fake_request(20)
        assert both.execute_using_pool(None) == "sent to the pool"
        assert steer.wanted("task-1") is None  # every device holds it: any child may
    finally:
        request.configure(None)


class Lost:
    """A GPU fallen off the bus: NVML's reads of it fail."""

    @property
    def free(self) -> int:
        raise RuntimeError("GPU is lost")

    total = free


def test_a_gpu_whose_memory_cannot_be_read_admits_nothing_the_others_still_do(
        caplog: pytest.LogCaptureFixture) -> None:
    """(read as a failure of all, every device's check was skipped: tasks of 50 GiB
    ran on a 24 GB L4 whose NVML read failed, while the H200 had 10 GiB free)"""
    memory: dict[str, Any] = {"GPU-big": SimpleNamespace(free=10 * GIB, total=141 * GIB),
                              "GPU-small": Lost()}
    request.configure(freemem.NvmlProbe(["GPU-big", "GPU-small"], fake_nvml(memory)))
    try:
        CeleryGenerated.ran.clear()
        with caplog.at_level("INFO", logger=freemem.logger.name):
            # Then a 50 GiB task is held off (no device it can be known to fit)
            big, qos = fake_request(50)
            with pytest.raises(request.NotStartedHere):
                big.execute_using_pool(None)
            assert CeleryGenerated.ran == [] and [r[0] for r in qos.released] == ["tag-1"]
            # and one that fits the readable GPU goes to its child, not the lost one's
            small, _ = fake_request(5)
            assert small.execute_using_pool(None) == "sent to the pool"
            assert (w := steer.wanted("task-1")) is not None and w.devices == {"GPU-big"}
            steer.forget("task-1")
            # the lost GPU said once, and once more when it reads again
            memory["GPU-small"] = SimpleNamespace(free=22 * GIB, total=24 * GIB)
            again, _ = fake_request(5)
            assert again.execute_using_pool(None) == "sent to the pool"
        said = [r.getMessage() for r in caplog.records if r.name == freemem.logger.name]
        assert len(said) == 2 and "GPU is lost" in said[0] and "reads again" in said[1], said
        # With no device readable, the check is skipped as before (the class cap holds)
        memory.update({"GPU-big": Lost(), "GPU-small": Lost()})
        none, _ = fake_request(50)
        assert none.execute_using_pool(None) == "sent to the pool"
    finally:
        steer.forget("task-1")
        request.configure(None)


def test_admission_weighs_only_the_gpus_of_live_children() -> None:
    """(an autoscaled pool below its planned size: a 50 GiB task admitted for an unused
    80 GB GPU's room went to a child on the 40 GB one and was given back at every take)"""
    nvml = fake_nvml({"GPU-big": SimpleNamespace(free=70 * GIB, total=80 * GIB),
                      "GPU-small": SimpleNamespace(free=35 * GIB, total=40 * GIB)})
    request.configure(freemem.NvmlProbe(["GPU-big", "GPU-small"], nvml))
    try:
        request.admit_on(frozenset({"GPU-small"}))  # the big GPU's child not forked yet
        CeleryGenerated.ran.clear()
        big, qos = fake_request(50)
        with pytest.raises(request.NotStartedHere):  # refused here, held off a while
            big.execute_using_pool(None)
        assert CeleryGenerated.ran == [] and [r[0] for r in qos.released] == ["tag-1"]
        assert steer.wanted("task-1") is None
        fits, _ = fake_request(30)
        assert fits.execute_using_pool(None) == "sent to the pool"
        # Once the pool has grown, both count again
        request.admit_on(frozenset({"GPU-small", "GPU-big"}))
        again, _ = fake_request(50)
        assert again.execute_using_pool(None) == "sent to the pool"
        assert (w := steer.wanted("task-1")) is not None and w.devices == {"GPU-big"}
        steer.forget("task-1")
    finally:
        request.admit_on(frozenset())
        request.configure(None)


def test_a_pools_live_slots_name_their_devices_in_discovery_order() -> None:
    from sits_queue.workers.devices import Device, Discovery
    from sits_queue.workers.placement import slot_devices

    gpus = tuple(Device(index=i, kind="cuda", name="H100", uuid=f"GPU-{i}",
                        total_vram_bytes=80 * GIB, free_vram_bytes=80 * GIB) for i in range(8))
    eight = Discovery(devices=gpus)
    assert [d.uuid for d in slot_devices(eight, [1, 0])] == ["GPU-0", "GPU-1"]
    assert [d.uuid for d in slot_devices(eight, [9])] == ["GPU-1"]  # (round-robin)
    assert slot_devices(eight, []) == gpus


def test_remembered_tasks_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steer, "MOST_REMEMBERED", 3)
    for n in range(5):
        steer.want(f"t{n}", frozenset({"GPU-a"}))
    assert list(steer._wanted) == ["t2", "t3", "t4"]


WARM = {10: affinity.Warm({"gpt": 1.0}), 11: affinity.Warm({"bert": 1.0, "gpt": 0.5}),
        12: affinity.Warm({"bert": 1.0}, {"tmpl": 0.5})}


@pytest.mark.parametrize(("want", "busy", "chosen"), [
    (steer.Wanted(model="gpt"), set(), [10]),            # warm on the device beats host
    (steer.Wanted(model="gpt"), {10}, [11]),             # ... the host tier beats cold
    (steer.Wanted(model="bert"), set(), [11]),
    (steer.Wanted(model="bert", prefix="tmpl"), set(), [12]),  # its prompt's KV too
    (steer.Wanted(model="t5"), set(), None),             # warm nowhere: the pool chooses
    (steer.Wanted(model="gpt"), {10, 11}, None),
    # a device it must run on comes first, warm or not
    (steer.Wanted(model="gpt", devices=frozenset({"GPU-c"})), set(), [12]),
])
def test_the_head_task_goes_to_the_idle_child_holding_its_engine(
        want: steer.Wanted, busy: set[int], chosen: list[int] | None) -> None:
    device = {10: "GPU-a", 11: "GPU-b", 12: "GPU-c"}
    idle = [fd for fd in [10, 11, 12] if fd not in busy]
    assert steer.choose(idle, want, device.get, WARM.get) == chosen


def test_warm_wishes_are_noted_only_where_the_pool_is_steered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    steer.want_warm("t1", "gpt", None, "fp16")
    assert steer.wanted("t1") == steer.Wanted(model="gpt", precision="fp16")
    steer.want("t1", frozenset({"GPU-a"}))  # (both wishes kept)
    assert steer.wanted("t1") == steer.Wanted(frozenset({"GPU-a"}), "gpt", None, "fp16")
    monkeypatch.setattr(steer, "_steered", None)
    steer.want_warm("t2", "gpt", None, None)
    steer.note_children({0: affinity.Warm({"gpt": 1.0})})
    assert steer.wanted("t2") is None and steer._children == {}


def test_an_engine_warm_nowhere_loads_where_it_evicts_least() -> None:
    """(it went to the first idle child, evicting what that one held, while another had
    room to spare)"""
    room = {10: 100, 11: 500, 12: None}.get
    device = {10: "GPU-a", 11: "GPU-b", 12: "GPU-c"}.get
    cold = steer.Wanted(model="t5")
    assert steer.choose([10, 11, 12], cold, device, WARM.get, room) == [11]
    # a warm child still comes first, whatever the rooms
    assert steer.choose([10, 11, 12], steer.Wanted(model="gpt"), device, WARM.get,
                        room) == [10]
    # rooms unknown (an older child's record): the pool chooses
    assert steer.choose([10, 11], cold, device, WARM.get, lambda fd: None) is None
    # among the devices it must run on only
    assert steer.choose([10, 11, 12], steer.Wanted(frozenset({"GPU-a", "GPU-c"}), "t5"),
                        device, WARM.get, room) == [10]


def test_a_pre_warm_goes_to_an_idle_child_without_the_model() -> None:
    """(steered by affinity, a pre-warm went to the child already holding its model and
    loaded nothing, so a worker of several children never had a second warm instance)"""
    room = {10: 100, 11: 500, 12: 900}.get
    device = {10: "GPU-a", 11: "GPU-b", 12: "GPU-c"}.get
    warm = {10: affinity.Warm({"gpt@bf16": 1.0}), 11: affinity.Warm({"gpt": 0.5}),
            12: affinity.Warm({"bert": 1.0})}.get
    prewarm = steer.Wanted(model="gpt", spread=True)
    # not 10 (gpt on its device, at a precision: warm for gpt's demand); of the others the
    # one with gpt in its host tier (a promotion, not a read from disk), whatever the rooms
    assert steer.choose([10, 11, 12], prewarm, device, warm, room) == [11]
    assert steer.choose([10, 12], prewarm, device, warm, room) == [12]
    # every idle child holds it: the pool chooses (a load of nothing)
    assert steer.choose([10], prewarm, device, warm, room) is None
    # rooms unknown (an older child's record): the first without it, not the pool's pick
    assert steer.choose([10, 12], prewarm, device, warm, lambda fd: None) == [12]
    # a task of the model itself still goes to the child holding it
    assert steer.choose([10, 11, 12], steer.Wanted(model="gpt", precision="bf16"), device,
                        warm, room) == [10]
    # two pre-warms waiting together take two children
    assert steer.share([10, 11, 12], [prewarm, prewarm], device, warm, room) == [11, 12]


def test_a_child_handed_a_task_holds_its_engine_until_the_adverts_are_read_again() -> None:
    """(a pre-warm written just after a task of its model went to that task's child,
    whose advert did not show the model yet: it loaded nothing, the other child stayed
    cold)"""
    pool, hub = installed({10: 0, 11: 1})
    steer.note_children({0: affinity.Warm({"gpt": 1.0}), 1: affinity.Warm({"gpt": 1.0})},
                        {0: 500, 1: 100})
    # Given a task of lm-b (warm nowhere) written to the roomiest child
    pool.outbound_buffer.append(job("t-lm-b"))
    steer.want_warm("t-lm-b", "lm-b", None, "bf16")
    hub.consolidate_callback([10, 11])
    assert hub.written == [("t-lm-b", 10)]
    assert steer._children[0] == affinity.Warm({"gpt": 1.0, "lm-b@bf16": 1.0})
    # When a pre-warm of lm-b follows, both children idle again, before any new reading
    pool._busy_workers.clear()
    pool.outbound_buffer.append(job("t-pre"))
    steer.want_warm("t-pre", "lm-b", None, None, spread=True)
    hub.consolidate_callback([10, 11])
    # Then it goes to the other child (and that one now counts as holding lm-b too)
    assert hub.written[-1] == ("t-pre", 11)
    assert steer._children[1] == affinity.Warm({"gpt": 1.0, "lm-b": 1.0})
    # and the next reading of the adverts is what counts again
    steer.note_children({0: affinity.Warm({"gpt": 1.0})})
    assert steer._children == {0: affinity.Warm({"gpt": 1.0})}


def test_a_pre_warm_is_noted_to_spread() -> None:
    from sits_queue.options import PREWARM_TASK

    for name, spread in ((PREWARM_TASK, True), ("sits.generate", False)):
        req = SimpleNamespace(id=f"id-{name}", name=name, request_dict={},
                              task=SimpleNamespace(model="gpt", precision=None,
                                                    runs_inference=True))
        request._want_child(req)  # type: ignore[arg-type]
        wanted = steer.wanted(req.id)
        assert wanted is not None and (wanted.model, wanted.spread) == ("gpt", spread)


def test_a_childs_device_room() -> None:
    from sits_queue.workers.runtime import _room

    warm = {"a": "device", "b": "host", "c": "device"}
    assert _room(1000, warm, {"a": 300, "b": 500, "c": 100}) == 600  # (host bytes not)
    assert _room(1000, warm, {"a": 900, "c": 400}) == 0
    assert _room(1000, {}, {}) == 1000
