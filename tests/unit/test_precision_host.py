"""Precision placement (MISSION §3.2) on a host of unlike GPUs: each device of a worker
is weighed at each precision against the fleet's kinds of device (its picks, while only
its children are idle), and a task that asks for a precision goes to the sibling whose
device is relatively strong at it (the pool's choice of child, ``steer.py``)."""

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


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    steer._wanted.clear()
    steer._children.clear()
    yield
    steer._wanted.clear()
    steer._children.clear()


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
    line = status._placement_text(placed)
    gpu0, _, gpu1 = line.partition("on GPU-0: ")[2].partition("on GPU-1: ")
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


#: Slot -> the device its child is pinned to: slot 0 on the T4 (first in the pool's
#: order, where an unsteered write goes), slot 1 on the A100.
ON = {0: "GPU-1", 1: "GPU-0"}


def steered_host() -> tuple[Any, Any]:
    """A steered pool of two children on a host of a T4 (fd 10) and an A100 (fd 11)."""
    pool, hub = installed({10: 0, 11: 1}, ON)
    assert steer._steered is not None
    object.__setattr__(steer._steered, "precisions",
                       fleet.host_precisions(record("A100", "T4")["devices"], 0.5))
    return pool, hub


@pytest.mark.parametrize(("precision", "child"), [("bf16", 11), ("fp32", 10)])
def test_a_precision_goes_to_the_child_whose_gpu_is_strong_at_it(
        precision: str, child: int) -> None:
    pool, hub = steered_host()
    # (the A100's child first in the pool's order too: the choice is the steering's)
    for first in ([10, 11], [11, 10]):
        steer._wanted.clear()
        pool._busy_workers.clear()
        pool.outbound_buffer.append(job("t"))
        steer.want_bound("t", None, precision)
        hub.consolidate_callback(first)
        assert hub.written[-1] == ("t", child), first


def test_a_warm_engine_outweighs_the_precision() -> None:
    pool, hub = steered_host()
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
    steered_host()
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
    steered_host()
    req = SimpleNamespace(id="t", name="w.device", request_dict={HEADER: header},
                          task=SimpleNamespace())
    request._want_child(req)  # type: ignore[arg-type]
    wanted = steer.wanted("t")
    assert (wanted.precision if wanted is not None else None) == noted
