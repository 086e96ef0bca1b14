"""Each pool child's cores come from its GPU's NUMA node on a host of several nodes (a
dual-socket 8-GPU server): the worker split the host's cores by slot number alone, so
the child of a GPU on socket 1 ran its host-side work on socket 0's cores."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from sits_queue.app import make_app
from sits_queue.config import ClassQuota, SitsConfig
from sits_queue.workers import cores
from sits_queue.workers import runtime as rt
from sits_queue.workers.devices import Device, Discovery
from sits_queue.workers.limits import cpu_set, numa_cpu_set
from sits_queue.workers.placement import WorkerPlan

GIB = 2**30
WIDE = ClassQuota("wide", cpu_cores=64, vram_gib=1, max_run_s=10, weight=10,
                  latency_sla_ms=1000, loss_sensitivity=0.5)
TWO = ClassQuota("two", cpu_cores=2, vram_gib=1, max_run_s=10, weight=1,
                 latency_sla_ms=1000, loss_sensitivity=0.5)
#: Two sockets of 16 cores, node 1's numbered first half of the ids up (as many BIOSes do).
NODES = {0: tuple(range(0, 16)), 1: tuple(range(16, 32))}


def gpu(index: int, node: int | None) -> Device:
    return Device(index=index, kind="cuda", name="NVIDIA H100 80GB HBM3",
                  uuid=f"GPU-{index}", total_vram_bytes=80 * GIB, free_vram_bytes=70 * GIB,
                  numa_node=node)


@pytest.mark.parametrize(("text", "cpus"), [
    ("0-3,8-11\n", (0, 1, 2, 3, 8, 9, 10, 11)), ("5", (5,)), ("", ()), ("\n", ()),
    ("2,0-1", (0, 1, 2)),
])
def test_parse_cpulist(text: str, cpus: tuple[int, ...]) -> None:
    assert cores.parse_cpulist(text) == cpus


def test_numa_nodes_from_sysfs(tmp_path: Path) -> None:
    for node, cpulist in (("node0", "0-3"), ("node1", "4-7"), ("node2", "")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpulist + "\n")
    (tmp_path / "possible").write_text("0-2\n")  # (not a node)
    (tmp_path / "node3").mkdir()  # (no cpulist: left out)
    # Only the usable cores count, and a node left with none is left out
    assert cores.numa_nodes(range(2, 6), tmp_path) == {0: (2, 3), 1: (4, 5)}
    assert cores.numa_nodes(range(8), tmp_path / "absent") == {}  # not Linux


def test_each_child_takes_its_share_of_its_gpus_node() -> None:
    # Eight GPUs, four on each socket, in an order that interleaves the nodes
    nodes = [0, 1, 0, 1, 0, 1, 0, 1]
    shares = [numa_cpu_set(WIDE, NODES, nodes, slot) for slot in range(8)]
    assert shares[0] == (0, 1, 2, 3) and shares[2] == (4, 5, 6, 7)
    assert shares[1] == (16, 17, 18, 19) and shares[7] == (28, 29, 30, 31)
    # disjoint, and each within its GPU's node
    assert len({c for s in shares if s for c in s}) == 32
    assert all(set(s or ()) <= set(NODES[nodes[i]]) for i, s in enumerate(shares))
    # by slot number alone, slot 1 (a socket-1 GPU) got socket 0's cores 4..7
    assert cpu_set(WIDE, range(32), 1, 8) == (4, 5, 6, 7)
    # the class's core count still applies within the share
    assert numa_cpu_set(TWO, NODES, nodes, 3) == (20, 21)


@pytest.mark.parametrize(("case", "node_cpus", "nodes"), [
    ("one node", {0: tuple(range(32))}, [0, 0]),
    ("a GPU whose node is unknown", NODES, [0, None]),
    ("a node with no usable core", {0: tuple(range(16)), 1: ()}, [0, 1]),
    ("a node NVML names that has no cores listed", NODES, [0, 2]),
])
def test_no_numa_split_where_it_does_not_apply(case: str, node_cpus: dict[int, Any],
                                               nodes: list[int | None]) -> None:
    assert numa_cpu_set(WIDE, node_cpus, nodes, 0) is None, case


def test_more_children_than_a_nodes_cores_share_them() -> None:
    assert [numa_cpu_set(WIDE, {0: (0,), 1: (1, 2)}, [0, 0, 1], s) for s in range(3)] == [
        (0,), (0,), (1, 2)]


def test_the_plan_and_the_child_use_the_gpus_node(monkeypatch: pytest.MonkeyPatch) -> None:
    discovery = Discovery(devices=tuple(gpu(i, i % 2) for i in range(4)))
    plan = WorkerPlan("w@h", discovery, tuple(range(32)), slots=4,
                      node_cpus=tuple(sorted(NODES.items())))
    assert plan.child_cpus(WIDE, 1) == tuple(range(16, 24))  # GPU 1: socket 1
    assert plan.child_cpus(WIDE, 5) == tuple(range(16, 24))  # (slot 5: GPU 1 again)
    # Without the nodes (not Linux, or one node), the slot-number split as before
    assert WorkerPlan("w@h", discovery, tuple(range(32)), slots=4).child_cpus(WIDE, 1) == \
        tuple(range(8, 16))
    # The child pins itself there
    pinned: list[tuple[int, ...]] = []
    monkeypatch.setattr(cores, "pin", lambda tids, cpus: pinned.append(tuple(cpus)))
    monkeypatch.setattr(cores, "pinned_to", lambda cpus: False)
    child = rt.ChildRuntime(app=make_app(SitsConfig(), main="numa-test"), plan=plan, slot=3,
                            device=discovery.devices[3], pool_child=True)
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    try:
        assert child.confine(WIDE) == tuple(range(24, 32))
        assert pinned == [tuple(range(24, 32))]
    finally:
        if torch is not None:
            torch.set_num_threads(before)
