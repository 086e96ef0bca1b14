"""Roofline and precision placement (MISSION §3.1, §3.2) on a host of unlike GPUs: each
device of a worker is weighed against the fleet's kinds of device (its picks, while only
its children are idle), and a task that declares its intensity, or asks for a precision,
goes to the sibling whose device suits it (the pool's choice of child, ``steer.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from sits_queue import status
from sits_queue.broker import affinity
from sits_queue.broker.affinity import AffinityPolicy
from sits_queue.options import HEADER
from sits_queue.workers import fleet, request, steer
from tests.unit.test_roofline import record
from tests.unit.test_steer import installed, job

POLICY = AffinityPolicy()
#: Intensities, FLOP/byte: a decode step's (memory-bound on both parts) and a long
#: prefill's (compute-bound on both: H200 ridge ~206 at fp16, L4 ~403).
DECODE, PREFILL = 8.0, 4000.0


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    steer._wanted.clear()
    steer._children.clear()
    yield
    steer._wanted.clear()
    steer._children.clear()


def status_by_device(placed: dict[str, Any]) -> tuple[str, str, str]:
    """`sitsq status`'s placement line for a worker record's ``placement``, and what it
    says on GPU-0 and on GPU-1."""
    line = status._placement_text(placed)
    gpu0, _, gpu1 = line.partition("on GPU-0: ")[2].partition("on GPU-1: ")
    return line, gpu0, gpu1


def test_each_device_of_a_host_of_unlike_gpus_is_weighed_on_its_own() -> None:
    host = record("H200", "L4")  # (GPU-0 the H200, GPU-1 the L4)
    got = fleet.standing(host, [host], POLICY)
    # Alone in its fleet, the host's two kinds are the fleet: the H200 is rich in
    # bandwidth, the L4 in FLOPs
    assert "memory@fp16" in got.devices["GPU-0"].bounds
    assert "compute@fp16" in got.devices["GPU-1"].bounds
    assert "memory@fp16" not in got.devices["GPU-1"].bounds
    # and the worker as a whole (its best device, the H200's) as before
    assert "memory@fp16" in got.roofline.bounds
    assert got.roofline.ridges == got.devices["GPU-0"].ridges
    # The advertisement and `sitsq status` say each device's
    placed = fleet.placement_record(got)
    assert set(placed["devices"]) == {"GPU-0", "GPU-1"}
    line, gpu0, gpu1 = status_by_device(placed)
    assert "memory@fp16" in gpu0 and "compute" not in gpu0, line
    assert "compute@fp16" in gpu1 and "memory" not in gpu1, line


def test_a_host_of_one_kind_has_no_device_weights_and_counts_once() -> None:
    two, l4 = record("H200", "H200"), record("L4")
    got = fleet.standing(two, [two, l4], POLICY)
    assert got.devices == {}
    # a worker of many GPUs of one kind is one kind of the fleet: weighed as one H200
    assert got.roofline == fleet.standing(record("H200"), [record("H200"), l4],
                                          POLICY).roofline
    assert fleet.kind_ridges(two) == [fleet.device_ridges(record("H200"))]
    assert fleet.kind_ridges({"devices": [{"kind": "cpu", "name": "cpu"}]}) == []
    # the roofline's setting at 0 weighs nothing, on any device
    off = fleet.standing(record("H200", "L4"), [record("H200", "L4")],
                         AffinityPolicy(roofline_weight=0.0))
    assert off.devices == {} and off.roofline.bounds == {}


def test_a_hosts_devices_are_weighed_against_each_other_for_its_children() -> None:
    got = fleet.host_rooflines(record("H200", "L4")["devices"], 0.5)
    assert set(got) == {"GPU-0", "GPU-1"}
    assert "memory@fp16" in got["GPU-0"].bounds and "compute@fp16" in got["GPU-1"].bounds
    assert fleet.host_rooflines(record("H200", "H200")["devices"], 0.5) == {}
    assert fleet.host_rooflines(record("H200", "L4")["devices"], 0.0) == {}
    # a device without datasheet figures weighs nothing, and is weighed against nothing
    unknown = {"uuid": "GPU-9", "kind": "cuda", "name": "NVIDIA Mystery"}
    assert fleet.host_rooflines([record("H200")["devices"][0], unknown], 0.5) == {}


#: Slot -> the device its child is pinned to: slot 0 on the L4 (first in the pool's
#: order, where an unsteered write goes), slot 1 on the H200.
ON = {0: "GPU-1", 1: "GPU-0"}


def steered_host() -> tuple[Any, Any]:
    """A steered pool of two children on a host of an L4 (fd 10) and an H200 (fd 11)."""
    pool, hub = installed({10: 0, 11: 1}, ON)
    assert steer._steered is not None
    object.__setattr__(steer._steered, "rooflines",
                       fleet.host_rooflines(record("H200", "L4")["devices"], 0.5))
    return pool, hub


def noted_for(header: dict[str, Any]) -> steer.Wanted | None:
    """What admission notes for the pool of a plain task ``t`` with this ``sits`` header."""
    req = SimpleNamespace(id="t", name="w.device", request_dict={HEADER: header},
                          task=SimpleNamespace())
    request._want_child(req)  # type: ignore[arg-type]
    return steer.wanted("t")


@pytest.mark.parametrize(("intensity", "child"), [(DECODE, 11), (PREFILL, 10)])
def test_a_declared_intensity_goes_to_the_child_whose_gpu_suits_it(
        intensity: float, child: int) -> None:
    pool, hub = steered_host()
    pool.outbound_buffer.append(job("t"))
    steer.want_bound("t", intensity, None)
    hub.consolidate_callback([10, 11])
    assert hub.written == [("t", child)]


def test_a_warm_engine_outweighs_the_bound_and_no_intensity_is_the_pools_choice() -> None:
    pool, hub = steered_host()
    # Given the L4's child holds gpt on its device
    steer.note_children({0: affinity.Warm({"gpt": 1.0})})
    # When a decode step of gpt is written: to the L4's child, warm (a load avoided
    # outweighs the bandwidth: the bound's weight is at most the setting's 0.5)
    pool.outbound_buffer.append(job("t-gpt"))
    steer.want_warm("t-gpt", "gpt", None, None, intensity=DECODE)
    hub.consolidate_callback([10, 11])
    assert hub.written == [("t-gpt", 10)]
    # and a decode step of an engine warm nowhere goes to the H200's
    pool._busy_workers.clear()
    pool.outbound_buffer.append(job("t-lm"))
    steer.want_warm("t-lm", "lm", None, None, intensity=DECODE)
    hub.consolidate_callback([10, 11])
    assert hub.written[-1] == ("t-lm", 11)
    # A task declaring nothing goes where the pool says
    pool._busy_workers.clear()
    pool.outbound_buffer.append(job("t-any"))
    hub.consolidate_callback([10, 11])
    assert hub.written[-1] == ("t-any", 10)


def test_an_intensity_is_noted_only_where_the_hosts_devices_differ() -> None:
    installed({10: 0, 11: 1}, {0: "GPU-0", 1: "GPU-2"})  # (no rooflines: one kind)
    steer.want_bound("t", DECODE, None)
    assert steer.wanted("t") is None
    steered_host()
    steer.want_bound("t", DECODE, "bf16")
    assert steer.wanted("t") == steer.Wanted(precision="bf16", intensity=DECODE)


@pytest.mark.parametrize(("header", "noted"), [
    ({"arithmetic_intensity": 8}, 8.0),
    ({"arithmetic_intensity": 8, "precision": "bf16"}, 8.0),
    ({}, None),
    ({"arithmetic_intensity": "lots"}, None),   # (junk steers nothing; the task still runs)
    ({"arithmetic_intensity": -1}, None),
    ({"arithmetic_intensity": float("nan")}, None),
])
def test_a_plain_tasks_declared_intensity_is_noted_for_the_pool(
        header: dict[str, Any], noted: float | None) -> None:
    steered_host()
    wanted = noted_for(header)
    assert (wanted.intensity if wanted is not None else None) == noted
    if wanted is not None:
        assert wanted.precision == header.get("precision") and wanted.model is None


# -- precisions (§3.2) ------------------------------------------------------------------

def test_each_device_of_a_host_of_unlike_gpus_has_its_own_precision_weights() -> None:
    host = record("A100", "T4")  # (GPU-0 the A100, GPU-1 the T4: no bf16 of its own)
    got = fleet.standing(host, [host], POLICY)
    # Alone in its fleet, the host's two kinds are the fleet: the A100 is the one for
    # bf16, the T4 (relatively) for fp32
    assert got.device_precisions["GPU-0"] == {"bf16": POLICY.precision_weight}
    assert set(got.device_precisions["GPU-1"]) == {"fp32"}
    # (the worker as a whole, its best device against itself, weighs nothing)
    assert got.precisions == {}
    # The advertisement and `sitsq status` say each device's
    placed = fleet.placement_record(got)
    assert placed["devices"]["GPU-0"]["precisions"] == {"bf16": POLICY.precision_weight}
    line, gpu0, gpu1 = status_by_device(placed)
    assert "precision bf16 +0.5" in gpu0 and "precision fp32" not in gpu0, line
    assert "precision fp32" in gpu1 and "precision bf16" not in gpu1, line


def test_a_host_of_one_kind_or_like_profiles_weighs_no_device_precision() -> None:
    two, t4 = record("A100", "A100"), record("T4")
    assert fleet.standing(two, [two, t4], POLICY).device_precisions == {}
    assert fleet.kind_peaks(two) == fleet.kind_peaks(record("A100"))
    assert fleet.kind_peaks({"devices": [{"kind": "cpu", "name": "cpu"}]}) == []
    # the setting at 0 weighs nothing, on any device
    off = fleet.standing(record("A100", "T4"), [record("A100", "T4")],
                         AffinityPolicy(precision_weight=0.0))
    assert off.device_precisions == {} and off.precisions == {}
    # Two kinds of one profile (an H100 and an A100: each twice as fast at int8 as at
    # fp16, bf16 as fp16): nothing to steer by, for the pool
    assert fleet.host_precisions(record("H100", "A100")["devices"], 0.5) == {}
    assert fleet.host_precisions(record("A100", "A100")["devices"], 0.5) == {}
    assert fleet.host_precisions(record("A100", "T4")["devices"], 0.0) == {}
    unknown = {"uuid": "GPU-9", "kind": "cuda", "name": "NVIDIA Mystery"}
    assert fleet.host_precisions([record("A100")["devices"][0], unknown], 0.5) == {}


def test_a_devices_weights_follow_the_fleet_it_competes_in() -> None:
    """(against the fleet's kinds: beside V100s, which have no bf16 either, the T4 is no
    longer the fp32 one, and the A100 stays the bf16 one)"""
    host, v100 = record("A100", "T4"), record("V100")
    got = fleet.standing(host, [host, v100], POLICY)
    assert "bf16" in got.device_precisions["GPU-0"]
    assert "bf16" not in got.device_precisions["GPU-1"]


def steered_a100_t4() -> tuple[Any, Any]:
    """A steered pool of two children on a host of a T4 (fd 10; slot 0, first in the
    pool's order, where an unsteered write goes) and an A100 (fd 11)."""
    pool, hub = installed({10: 0, 11: 1}, ON)
    assert steer._steered is not None
    object.__setattr__(steer._steered, "precisions",
                       fleet.host_precisions(record("A100", "T4")["devices"], 0.5))
    return pool, hub


@pytest.mark.parametrize(("precision", "child"), [("bf16", 11), ("fp32", 10)])
def test_a_precision_goes_to_the_child_whose_gpu_is_strong_at_it(
        precision: str, child: int) -> None:
    pool, hub = steered_a100_t4()
    # (the A100's child first in the pool's order too: the choice is the steering's)
    for first in ([10, 11], [11, 10]):
        steer._wanted.clear()
        pool._busy_workers.clear()
        pool.outbound_buffer.append(job("t"))
        steer.want_bound("t", None, precision)
        hub.consolidate_callback(first)
        assert hub.written[-1] == ("t", child), first


def test_a_warm_engine_outweighs_the_precision() -> None:
    pool, hub = steered_a100_t4()
    # Given the T4's child holds gpt, served at bf16 (as fp16 there), on its device
    steer.note_children({0: affinity.Warm({"gpt@bf16": 1.0})})
    pool.outbound_buffer.append(job("t-gpt"))
    steer.want_warm("t-gpt", "gpt", None, "bf16")
    hub.consolidate_callback([10, 11])
    assert hub.written == [("t-gpt", 10)]
    # and a bf16 task of an engine warm nowhere goes to the A100's
    pool._busy_workers.clear()
    pool.outbound_buffer.append(job("t-lm"))
    steer.want_warm("t-lm", "lm", None, "bf16")
    hub.consolidate_callback([10, 11])
    assert hub.written[-1] == ("t-lm", 11)


def test_a_precision_is_noted_only_where_the_hosts_devices_differ() -> None:
    installed({10: 0, 11: 1}, {0: "GPU-0", 1: "GPU-2"})  # (no weights: one kind)
    steer.want_bound("t", None, "bf16")
    assert steer.wanted("t") is None
    steered_a100_t4()
    steer.want_bound("t", None, "bf16")
    assert steer.wanted("t") == steer.Wanted(precision="bf16")


@pytest.mark.parametrize(("header", "noted"), [
    ({"precision": "bf16"}, "bf16"),
    ({}, None),
    ({"precision": "fp64"}, None),  # (none SITS serves: steers nothing; checked elsewhere)
    ({"precision": 16}, None),
])
def test_a_plain_tasks_precision_is_noted_for_the_pool(
        header: dict[str, Any], noted: str | None) -> None:
    steered_a100_t4()
    wanted = noted_for(header)
    assert (wanted.precision if wanted is not None else None) == noted
