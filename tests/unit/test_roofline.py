"""Roofline placement (MISSION §3.1): the ``arithmetic_intensity`` option, each device's
ridge points, the fleet's bound weights, and the pick's use of them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import redis

from sits_queue.broker.affinity import (
    COMPUTE,
    MEMORY,
    AffinityPolicy,
    Candidate,
    Roofline,
    Warm,
    choose,
    lua_args,
    ridge_points,
    roofline_weights,
    warm_of,
)
from sits_queue.broker.keys import priority_level
from sits_queue.broker.meta import WaitingMeta
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidTaskOptions
from sits_queue.options import from_header, resolve
from sits_queue.workers import fleet
from sits_queue.workers.advertise import device_record
from sits_queue.workers.devices import KNOWN_GPUS, Device

CONFIG = SitsConfig()
POLICY = AffinityPolicy()


def record(*names: str) -> dict[str, Any]:
    """A worker record advertising devices of the datasheet table, as a worker writes it."""
    devices = [device_record(Device(i, "cuda", f"NVIDIA {n}", f"GPU-{i}", 1, 1,
                                    memory_bandwidth_bytes_per_s=KNOWN_GPUS[n]
                                    .memory_bandwidth_bytes_per_s,
                                    peak_flops=KNOWN_GPUS[n].peak_flops))
               for i, n in enumerate(names)]
    return {"hostname": "w", "devices": devices}


def ridge(name: str, precision: str = "fp16") -> float:
    spec = KNOWN_GPUS[name]
    return spec.peak_flops[precision] / spec.memory_bandwidth_bytes_per_s


# -- the option ----------------------------------------------------------------------------

def test_arithmetic_intensity_is_a_validated_option_that_reaches_the_broker_record() -> None:
    opts = resolve(CONFIG, {"arithmetic_intensity": 2}, {})
    assert opts.arithmetic_intensity == 2.0
    # per call over the decorator's, and back from the header as it was sent
    opts = resolve(CONFIG, {"arithmetic_intensity": 2}, {"arithmetic_intensity": 900.5})
    assert from_header(CONFIG, opts.to_header()).arithmetic_intensity == 900.5
    meta = WaitingMeta(options=opts, enqueued_at_s=1.0, task="t")
    assert b'"ai":900.5' in meta.to_json()
    assert WaitingMeta.from_json(meta.to_json()).options.arithmetic_intensity == 900.5
    assert resolve(CONFIG, {}, {}).arithmetic_intensity is None


@pytest.mark.parametrize("bad", [-1, math.inf, math.nan, 1e7, "high", True, [1.0]])
def test_a_bad_arithmetic_intensity_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(InvalidTaskOptions, match="arithmetic_intensity"):
        resolve(CONFIG, {}, {"arithmetic_intensity": bad})


# -- ridge points and the fleet's weights ---------------------------------------------------

def test_ridge_points_come_from_the_datasheet_peaks_and_bandwidth() -> None:
    h200 = fleet.device_ridges(record("H200"))
    assert h200["fp16"] == pytest.approx(ridge("H200"), rel=1e-4)  # ~206 FLOP/byte
    assert h200["fp32"] == pytest.approx(ridge("H200", "fp32"), rel=1e-4)
    # a GPU serves int8 requests at fp16 (cache/precision.py): their ridge is fp16's
    assert h200["int8"] == h200["fp16"]
    cpu_like = {"devices": [{"kind": "cpu", "peak_tflops": {"fp16": 4.0, "int8": 8.0},
                             "bandwidth_gb_s": 100.0}]}
    assert fleet.device_ridges(cpu_like)["int8"] == pytest.approx(80.0)
    # a host of unlike GPUs: one device's ridge, its best's (the highest fp16 peak), not
    # one's peak over the other's bandwidth (H100 PCIe's 756.5 over an A100's 2039 GB/s)
    mixed = fleet.device_ridges(record("A100", "H100 PCIe"))
    assert mixed["fp16"] == pytest.approx(ridge("H100 PCIe"), rel=1e-4)
    assert mixed["fp32"] == pytest.approx(ridge("H100 PCIe", "fp32"), rel=1e-4)
    # a device without a bandwidth (a CPU's record, one from the table's gaps) has none
    assert ridge_points({"fp16": 100.0}, None) == {}
    assert ridge_points({"fp16": 100.0}, 0.0) == {}
    assert fleet.device_ridges({"devices": [{"peak_tflops": {"fp16": 9.0},
                                             "bandwidth_gb_s": "fast"}, "junk"]}) == {}


def test_the_device_record_advertises_its_bandwidth() -> None:
    assert record("H200")["devices"][0]["bandwidth_gb_s"] == 4800.0
    assert device_record(Device(0, "cpu", "cpu", "cpu", 1, 1))["bandwidth_gb_s"] is None


def test_a_bandwidth_rich_device_weighs_memory_bound_work_a_compute_rich_one_compute() -> None:
    fleet_ridges = [ridge("H200"), ridge("L4")]  # ~206 and ~403 FLOP/byte
    h200 = roofline_weights(ridge("H200"), fleet_ridges, 0.5)
    l4 = roofline_weights(ridge("L4"), fleet_ridges, 0.5)
    assert set(h200) == {MEMORY} and set(l4) == {COMPUTE}
    # by how far each stands from the fleet's (geometric) mean: here as far both ways
    assert h200[MEMORY] == pytest.approx(l4[COMPUTE], abs=1e-6)
    assert 0 < h200[MEMORY] < 0.5
    # a fleet of one kind matches nothing, nor does a device without figures
    assert roofline_weights(ridge("H200"), [ridge("H200")] * 3, 0.5) == {}
    assert roofline_weights(None, fleet_ridges, 0.5) == {}
    # workers without figures (CPUs) are no devices to compare against
    assert roofline_weights(ridge("L4"), [ridge("L4"), None, None], 0.5) == {}
    # twice the mean and beyond: the whole weight; 0: off
    assert roofline_weights(1.0, [1.0, 16.0], 0.5) == {MEMORY: 0.5}
    assert roofline_weights(16.0, [1.0, 16.0], 0.0) == {}


def test_the_standing_weighs_each_bound_at_each_precision() -> None:
    own, other = record("H200"), record("L4")
    got = fleet.standing(own, [own, other], POLICY)
    # at fp16/bf16 (and int8, served at fp16) the H200 has more bandwidth per FLOP; at
    # fp32 (CUDA-core peaks: H200 ~14, L4 ~101 FLOP/byte) too
    assert set(got.roofline.bounds) == {f"memory@{p}" for p in ("fp32", "fp16", "bf16",
                                                                  "int8")}
    assert got.roofline.ridges["fp16"] == pytest.approx(ridge("H200"), rel=1e-4)
    # where the ranking turns at a precision, so do the bounds: a V100 beside an A100
    # is bandwidth-rich at fp16 (139 against 153) but not at fp32 (17 against 10)
    v100 = fleet.standing(record("V100"), [record("V100"), record("A100")], POLICY)
    assert "memory@fp32" not in v100.roofline.bounds
    assert "compute@fp32" in v100.roofline.bounds
    # the setting at 0 turns the roofline's weights off
    off = fleet.standing(own, [own, other], AffinityPolicy(roofline_weight=0.0))
    assert off.roofline.bounds == {}
    # alone in its fleet: no bounds; its ridges still said (sitsq status --json)
    alone = fleet.standing(own, [own], POLICY)
    assert alone.roofline.bounds == {} and alone.roofline.ridges["fp16"] > 0
    assert lua_args(POLICY, warm_of([], POLICY, roofline=alone.roofline)) == []


def on(queues: Sequence[str] | None, *names: str) -> dict[str, Any]:
    """A worker record of ``names``' devices that says it consumes ``queues``."""
    own = record(*names)
    if queues is not None:
        own["queues"] = list(queues)
    return own


def test_a_worker_is_weighed_against_the_workers_of_its_queues_alone() -> None:
    h200, l4 = on(["decode"], "H200"), on(["encode"], "L4")
    # two pools behind two queues: each alone in its own, nothing to match
    assert fleet.standing(h200, [h200, l4], POLICY) == fleet.Standing(
        {}, Roofline(fleet.device_ridges(h200), {}))
    assert fleet.standing(l4, [h200, l4], POLICY).roofline.bounds == {}
    # one queue in common is enough: they compete for its tasks
    both = on(["encode", "x"], "L4")
    assert "memory@fp16" in fleet.standing(h200 | {"queues": ["decode", "x"]},
                                           [h200, both], POLICY).roofline.bounds
    # a record that does not say (an earlier release's) is counted, as it was; and a
    # worker whose own record does not say is weighed against every one
    assert "memory@fp16" in fleet.standing(h200, [h200, record("L4")], POLICY).roofline.bounds
    assert "memory@fp16" in fleet.standing(record("H200"), [h200, l4], POLICY).roofline.bounds
    # the precisions too: a T4 (int8 twice fp16) beside V100s of another queue matches none
    t4 = on(["a"], "T4")
    assert fleet.standing(t4, [t4, on(["b"], "V100")], POLICY).precisions == {}
    assert fleet.standing(t4, [t4, on(["a"], "V100")], POLICY).precisions


def test_peers_are_read_from_the_record_and_junk_is_no_queue() -> None:
    assert fleet.consumed({"queues": ["a", 3, None, "b"]}) == {"a", "b"}
    assert fleet.consumed({"queues": "a"}) is None and fleet.consumed({}) is None
    # a worker consuming nothing (every consumer cancelled) competes with no one that says
    idle = {"queues": []}
    assert fleet.peers(idle, [idle, {"queues": ["a"]}, {}]) == [{}]


# -- the pick ------------------------------------------------------------------------------

def cand(name: str, intensity: float | None, precision: str | None = None) -> Candidate:
    return Candidate(name, priority_level(100.0), None, precision=precision,
                     intensity=intensity)


def test_a_task_is_memory_bound_below_the_ridge_and_compute_bound_at_it() -> None:
    warm = Warm(bounds={"memory@fp16": 0.3, "compute@fp16": 0.1, "memory@int8": 0.2},
                ridges={"fp16": 200.0, "int8": 400.0})
    assert warm.bound(199.9) == MEMORY and warm.weight(None, None, None, 199.9) == 0.3
    assert warm.bound(200.0) == COMPUTE and warm.weight(None, None, None, 200.0) == 0.1
    # at its precision's ridge, with its precision's weight: int8 work of 300 FLOP/byte
    assert warm.bound(300.0, "int8") == MEMORY
    assert warm.weight(None, None, "int8", 300.0) == 0.2
    assert warm.weight(None, None, "int8", 500.0) == 0.0  # compute@int8: none here
    # no intensity, or no ridge at its precision: no bound, no weight
    assert warm.bound(None) is None and warm.weight(None, None, None, None) == 0.0
    assert warm.bound(10.0, "bf16") is None
    assert warm.top == 0.3


def test_bounds_without_ridges_weigh_nothing() -> None:
    warm = Warm(bounds={"memory@fp16": 0.3})
    assert not warm and warm.bounds == {} and lua_args(POLICY, warm) == []


def test_a_memory_rich_worker_takes_the_memory_bound_task_behind_the_head() -> None:
    rich = warm_of([], POLICY, roofline=Roofline({"fp16": 206.0}, {"memory@fp16": 0.2}))
    tasks = [cand("prefill", 5000.0), cand("other", None), cand("decode", 8.0)]
    assert choose(tasks, rich, POLICY, 0.0) == 2
    # and the ridge points go to pick.lua as figures, not weights
    assert lua_args(POLICY, rich)[3:] == ["r:memory@fp16", "0.2", "z:fp16", "206.0"]
    # a compute-rich one leaves the compute-bound head where it is
    dense = warm_of([], POLICY, roofline=Roofline({"fp16": 403.0}, {"compute@fp16": 0.2}))
    assert choose(tasks, dense, POLICY, 0.0) == 0


# -- reading the fleet ---------------------------------------------------------------------

class Reads:
    """A fleet to read, counting the reads; ``fail`` makes them raise as Redis would."""

    def __init__(self, own: Mapping[str, Any] | None, others: Sequence[Mapping[str, Any]]
                 ) -> None:
        self.own, self.others = own, list(others)
        self.reads = self.sizes = 0
        self.fail = False

    def read(self) -> tuple[Mapping[str, Any] | None, list[Mapping[str, Any]]]:
        self.reads += 1
        if self.fail:
            raise redis.ConnectionError("gone")
        return self.own, ([self.own] if self.own else []) + self.others

    def members(self) -> tuple[int, ...]:
        self.sizes += 1
        if self.fail:
            raise redis.ConnectionError("gone")
        return tuple(id(o) for o in self.others)


def test_the_fleet_is_read_again_when_a_worker_joins_not_on_every_pick() -> None:
    now = [0.0]
    reads = Reads(record("H200"), [])
    weights = fleet.FleetWeights(POLICY, reads.read, reads.members, lambda: now[0])
    assert weights().roofline.bounds == {} and reads.reads == 1  # alone: nothing to match
    now[0] = 1.0
    weights()
    assert reads.sizes == 1 and reads.reads == 1  # within the probe: nothing asked
    # an L4 worker registers: read at the next probe, not half a minute later
    reads.others.append(record("L4"))
    now[0] = 2.5
    assert "memory@fp16" in weights().roofline.bounds and reads.reads == 2
    now[0] = 5.0
    weights()
    assert reads.reads == 2  # the same fleet: probed, not read
    # Redis away: the last weights are kept, whichever read fails
    reads.fail = True
    now[0] = 7.5
    assert "memory@fp16" in weights().roofline.bounds
    now[0] = 40.0
    assert "memory@fp16" in weights().roofline.bounds


def test_a_worker_gone_or_swapped_for_another_reads_the_fleet_again() -> None:
    """(the registry's size was probed: a killed worker stayed in it until the half
    minute's full read, weighed against all along, and one leaving as another joined
    left the size as it was)"""
    now = [0.0]
    reads = Reads(record("H200"), [record("L4")])
    weights = fleet.FleetWeights(POLICY, reads.read, reads.members, lambda: now[0])
    assert "memory@fp16" in weights().roofline.bounds
    reads.others = [record("A100")]  # the L4 gone, an A100 come, in one probe
    now[0] = 2.5
    assert weights().roofline.bounds != {} and reads.reads == 2
    reads.others = []  # the A100 killed: alone, nothing to match
    now[0] = 5.0
    assert weights().roofline.bounds == {} and reads.reads == 3


def test_a_worker_not_yet_advertised_reads_its_fleet_again_at_the_next_probe() -> None:
    now = [0.0]
    reads = Reads(None, [record("L4")])
    weights = fleet.FleetWeights(POLICY, reads.read, reads.members, lambda: now[0])
    assert not weights().roofline.bounds
    reads.own = record("H200")
    now[0] = 2.5
    assert "memory@fp16" in weights().roofline.bounds and reads.reads == 2


def test_a_worker_moving_queues_reads_the_fleet_again() -> None:
    now = [0.0]
    reads = Reads(on(["decode"], "H200"), [on(["encode"], "L4")])
    moves = [1]  # (advertise.queues_version_key: bumped by each worker that moves)
    weights = fleet.FleetWeights(POLICY, reads.read,
                                 lambda: (reads.members(), moves[0]), lambda: now[0])
    assert weights().roofline.bounds == {} and reads.reads == 1
    # `celery control add_consumer decode` to the L4's worker: the same workers live,
    # the count moved; read at the next probe, not half a minute later
    reads.others = [on(["decode", "encode"], "L4")]
    moves[0] += 1
    now[0] = 2.5
    assert "memory@fp16" in weights().roofline.bounds and reads.reads == 2


def test_a_worker_advertises_the_queues_its_consumer_takes_from_now() -> None:
    from types import SimpleNamespace

    from celery import Celery
    from kombu import Connection, Consumer, Queue

    from sits_queue.workers.advertise import consumed_queues

    app = Celery(set_as_current=False)
    app.conf.task_default_queue = "celery"
    with Connection("memory://") as conn:
        # (the control queue and its own direct queue are every worker's: not its work)
        consumer = Consumer(conn.channel(), [Queue("b"), Queue("a"), Queue("sits.control"),
                                             Queue("w@h.dq2")], auto_declare=False)
        c = SimpleNamespace(task_consumer=consumer, app=app)
        assert consumed_queues(c) == ["a", "b"]
        # remote control's add_consumer / cancel_consumer act on the kombu consumer
        consumer.add_queue(Queue("c"))
        consumer.cancel_by_queue("a")
        assert consumed_queues(c) == ["b", "c"]
    # before the consumer starts: the app's queues to consume (-Q), else all it knows
    assert consumed_queues(SimpleNamespace(task_consumer=None, app=app)) == ["celery"]
    assert consumed_queues(SimpleNamespace()) is None


def test_both_settings_off_reads_nothing() -> None:
    reads = Reads(record("H200"), [record("L4")])
    off = AffinityPolicy(precision_weight=0.0, roofline_weight=0.0)
    assert fleet.FleetWeights(off, reads.read, reads.members)() == fleet.Standing()
    assert reads.reads == reads.sizes == 0


@pytest.mark.parametrize("bad", [-0.1, 11.0, math.nan])
def test_a_bad_roofline_weight_is_refused_naming_the_setting(bad: float) -> None:
    with pytest.raises(ValueError, match="affinity_roofline_weight"):
        AffinityPolicy(roofline_weight=bad)


# -- the built-in tasks' declared intensities ------------------------------------------------

def test_built_in_decoding_is_declared_memory_bound_and_encoding_compute_bound() -> None:
    from sits_queue.app import make_app
    from sits_queue.calloptions import resolve_task_options

    app = make_app(CONFIG, main="roofline-unit")
    # on the parts of the datasheet table (fp16 ridge points ~139 to ~403 FLOP/byte)
    ridges = [spec.peak_flops["fp16"] / spec.memory_bandwidth_bytes_per_s
              for spec in KNOWN_GPUS.values() if "fp16" in spec.peak_flops]
    for name, bound in (("sits.generate", MEMORY), ("sits.generate_batched", MEMORY),
                        ("sits.embed", COMPUTE)):
        opts = resolve_task_options(app.tasks[name], CONFIG, {"model": "m"}, ("x",))
        assert opts.arithmetic_intensity is not None, name
        assert {MEMORY if opts.arithmetic_intensity < r else COMPUTE for r in ridges} \
            == {bound}, name
    # and a call's own figure wins (a generation of long prompts, a tiny embedding)
    own = resolve_task_options(app.tasks["sits.embed"], CONFIG,
                               {"model": "m", "arithmetic_intensity": 4.0}, ("x",))
    assert own.arithmetic_intensity == 4.0
