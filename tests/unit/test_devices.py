"""Device discovery against a fake NVML module; no GPU needed."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from sits_queue.workers.devices import (
    KNOWN_GPUS,
    NVLINK,
    TOPOLOGY_WEIGHTS,
    Device,
    Discovery,
    cpu_device,
    default_concurrency,
    discover,
    live,
    lookup_spec,
    topology,
    topology_weight,
    visible_devices,
)

GIB = 2**30
H100_NAME = "NVIDIA H100 80GB HBM3"
#: NVML's max memory clock and bus width on an H100 SXM: 3.35 TB/s on the datasheet.
H100_MEM_CLOCK_MHZ = 2619
H100_BUS_BITS = 5120


class FakeNVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    name: str | bytes
    uuid: str
    total: int = 80 * GIB
    free: int = 79 * GIB
    util: int = 7
    numa: int | None = 0
    mem_clock_mhz: int | None = H100_MEM_CLOCK_MHZ
    bus_bits: int | None = H100_BUS_BITS


@dataclass
class FakeNvml:
    """The handful of pynvml calls devices.py makes; handles are plain indices."""

    gpus: list[FakeGpu]
    levels: dict[tuple[int, int], int] = field(default_factory=dict)
    nvlinks: set[tuple[int, int]] = field(default_factory=set)
    init_error: str | None = None
    broken_call: str | None = None
    shutdowns: int = 0
    #: GPU index -> its MIG devices (the GPU is in MIG mode); their handles are "i/k".
    migs: dict[int, list[FakeGpu]] = field(default_factory=dict)

    NVMLError = FakeNVMLError
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_CLOCK_MEM = 2
    NVML_TOPOLOGY_INTERNAL = 0
    NVML_TOPOLOGY_SINGLE = 10
    NVML_TOPOLOGY_MULTIPLE = 20
    NVML_TOPOLOGY_HOSTBRIDGE = 30
    NVML_TOPOLOGY_NODE = 40
    NVML_TOPOLOGY_SYSTEM = 50
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0

    def _maybe_fail(self, call: str) -> None:
        if self.broken_call == call:
            raise FakeNVMLError(f"{call}: Unknown Error")

    def nvmlInit(self) -> None:
        if self.init_error:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        self._maybe_fail("nvmlDeviceGetHandleByUUID")
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return i
        for i, migs in self.migs.items():
            for k, mig in enumerate(migs):
                if mig.uuid == uuid:
                    return f"{i}/{k}"
        raise FakeNVMLError(f"{uuid}: Not Found")

    def _g(self, h: Any) -> FakeGpu:
        if isinstance(h, str):
            i, k = (int(x) for x in h.split("/"))
            return self.migs[i][k]
        return self.gpus[h]

    def nvmlDeviceGetMigMode(self, h: Any) -> list[int]:
        if isinstance(h, str) or h not in self.migs:
            raise FakeNVMLError("Not Supported")
        return [1, 1]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: int) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: int, k: int) -> str:
        if k >= len(self.migs[h]):
            raise FakeNVMLError("Not Found")
        return f"{h}/{k}"

    def nvmlDeviceGetName(self, h: Any) -> str | bytes:
        return self._g(h).name

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        return self._g(h).uuid

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> SimpleNamespace:
        self._maybe_fail("nvmlDeviceGetMemoryInfo")
        g = self._g(h)
        return SimpleNamespace(total=g.total, free=g.free, used=g.total - g.free)

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> SimpleNamespace:
        if isinstance(h, str):
            raise FakeNVMLError("Not Supported")  # (NVML: not on a MIG device)
        return SimpleNamespace(gpu=self.gpus[h].util, memory=3)

    def nvmlDeviceGetNumaNodeId(self, h: Any) -> int:
        numa = self._g(h).numa
        if numa is None:
            raise FakeNVMLError("Not Supported")
        return numa

    def nvmlDeviceGetMaxClockInfo(self, h: Any, clock_type: int) -> int:
        assert clock_type == self.NVML_CLOCK_MEM
        clock = self._g(h).mem_clock_mhz
        if clock is None:
            raise FakeNVMLError("Not Supported")
        return clock

    def nvmlDeviceGetMemoryBusWidth(self, h: Any) -> int:
        bits = self._g(h).bus_bits
        if bits is None:
            raise FakeNVMLError("Not Supported")
        return bits

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        self._maybe_fail("nvmlDeviceGetTopologyCommonAncestor")
        return self.levels[(min(a, b), max(a, b))]

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        assert index == self.NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if (min(a, b), max(a, b)) in self.nvlinks else 5


def two_h100s(**kwargs: Any) -> FakeNvml:
    gpus = [FakeGpu(H100_NAME, "GPU-aaaa-0000"),
            FakeGpu(H100_NAME.encode(), "GPU-bbbb-1111", free=40 * GIB, util=93, numa=1)]
    return FakeNvml(gpus, levels={(0, 1): 50}, **kwargs)


# -- discovery ------------------------------------------------------------------------------

def test_two_h100s_are_discovered_with_nvml_figures_and_table_flops() -> None:
    # Given NVML reporting two H100s on different sockets
    nvml = two_h100s()
    # When the worker's parent discovers devices
    found = discover(nvml)
    # Then both are CUDA devices with NVML's numbers and the datasheet's FLOPs
    assert [d.kind for d in found.devices] == ["cuda", "cuda"]
    first, second = found.devices
    assert (first.index, first.name, first.uuid) == (0, H100_NAME, "GPU-aaaa-0000")
    assert second.name == H100_NAME  # bytes from older bindings are decoded
    assert (second.total_vram_bytes, second.free_vram_bytes) == (80 * GIB, 40 * GIB)
    assert (second.utilisation_pct, second.numa_node) == (93.0, 1)
    assert first.memory_bandwidth_bytes_per_s == pytest.approx(3.352e12, rel=1e-3)
    assert first.peak_flops["fp16"] == pytest.approx(989.5e12)
    assert dict(found.topology) == {(0, 1): "SYSTEM"}
    assert found.notice is None
    assert nvml.shutdowns == 1
    assert default_concurrency(found) == 2


def test_nvlink_overrides_the_pcie_ancestor() -> None:
    found = discover(two_h100s(nvlinks={(0, 1)}))
    assert found.topology[(0, 1)] == NVLINK
    assert found.pair_weight(1, 0) == 1.0
    # advertised per pair of the devices a worker uses (sitsq status: "links")
    assert found.links(found.devices) == [{"a": 0, "b": 1, "level": NVLINK, "weight": 1.0}]
    assert found.links(found.devices[:1]) == []


@pytest.mark.parametrize("fake", [
    two_h100s(init_error="Driver Not Loaded"),
    two_h100s(broken_call="nvmlDeviceGetMemoryInfo"),
    FakeNvml(gpus=[]),
], ids=["init-fails", "query-fails", "no-gpus"])
def test_no_usable_gpu_falls_back_to_one_cpu_device_with_a_notice(fake: FakeNvml) -> None:
    found = discover(fake)
    assert len(found.devices) == 1
    cpu = found.devices[0]
    assert (cpu.kind, cpu.index, cpu.alpha) == ("cpu", 0, None)
    assert cpu.total_vram_bytes == psutil.virtual_memory().total
    assert found.notice is not None and "\n" not in found.notice
    assert found.notice.startswith("sits-queue: no NVIDIA GPU visible (NVML: ")
    assert found.notice.endswith("); running on CPU")
    assert default_concurrency(found) == 1


def test_init_failure_reason_is_in_the_notice() -> None:
    found = discover(two_h100s(init_error="Driver Not Loaded"))
    assert found.notice == ("sits-queue: no NVIDIA GPU visible (NVML: Driver Not Loaded); "
                            "running on CPU")


def test_query_failure_after_init_still_shuts_nvml_down() -> None:
    nvml = two_h100s(broken_call="nvmlDeviceGetMemoryInfo")
    discover(nvml)
    assert nvml.shutdowns == 1


def test_real_pynvml_never_raises() -> None:
    # On this CPU host the real library is missing; on a GPU host it finds GPUs.
    found = discover()
    assert found.devices
    if found.devices[0].kind == "cpu":
        assert found.notice is not None and found.notice.endswith("running on CPU")


def test_discovery_never_imports_torch() -> None:
    code = ("import sys; import sits_queue.workers.devices as d; d.discover(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unsupported_optional_queries_fall_back_to_the_table() -> None:
    gpu = FakeGpu("NVIDIA A100-SXM4-80GB", "GPU-cccc", numa=None, mem_clock_mhz=None)
    (device,) = discover(FakeNvml([gpu])).devices
    assert device.numa_node is None
    assert device.memory_bandwidth_bytes_per_s == KNOWN_GPUS["A100"].memory_bandwidth_bytes_per_s


def test_unknown_gpu_has_no_roofline_and_a_notice() -> None:
    found = discover(FakeNvml([FakeGpu("NVIDIA Mystery 9000", "GPU-dddd")]))
    (device,) = found.devices
    assert device.memory_bandwidth_bytes_per_s is not None  # NVML still knows the memory
    assert device.peak_flops == {} and device.alpha is None
    assert found.notice == ("sits-queue: no published specs for NVIDIA Mystery 9000; "
                            "roofline unknown")


@pytest.mark.parametrize(("visible", "uuids"), [
    (None, ["GPU-aaaa-0000", "GPU-bbbb-1111"]),
    ("1", ["GPU-bbbb-1111"]),
    ("1,0", ["GPU-bbbb-1111", "GPU-aaaa-0000"]),
    ("GPU-bbbb", ["GPU-bbbb-1111"]),
    ("0,7,1", ["GPU-aaaa-0000"]),   # CUDA stops at the first invalid entry
    ("GPU-", []),                   # ambiguous prefix is invalid
    ("", []),
])
def test_cuda_visible_devices_filters(visible: str | None, uuids: list[str]) -> None:
    everything = discover(two_h100s()).devices
    assert [d.uuid for d in visible_devices(everything, visible)] == uuids


@pytest.mark.parametrize(("visible", "order", "said"), [
    ("1", None, True),               # mixed models, by index, CUDA's own order
    ("1", "FASTEST_FIRST", True),
    ("1", "PCI_BUS_ID", False),      # CUDA reads indices in NVML's order then
    ("GPU-bbbb", None, False),       # by UUID: the same GPU to both
    (None, None, False),
])
def test_indices_of_mixed_models_say_cuda_may_number_them_otherwise(
        visible: str | None, order: str | None, said: bool) -> None:
    mixed = FakeNvml([FakeGpu(H100_NAME, "GPU-aaaa-0000"),
                      FakeGpu("NVIDIA A100-SXM4-80GB", "GPU-bbbb-1111")], levels={(0, 1): 50})
    notice = discover(mixed, visible=visible, order=order).notice or ""
    assert ("CUDA_DEVICE_ORDER=PCI_BUS_ID" in notice) is said
    # one model: CUDA breaks its ties by bus, the same order
    assert discover(two_h100s(), visible="1", order=None).notice is None


def mig_host() -> FakeNvml:
    """GPU 0 whole; GPU 1 in MIG mode with two MIG devices."""
    gpus = [FakeGpu(H100_NAME, "GPU-aaaa-0000"), FakeGpu(H100_NAME, "GPU-bbbb-1111")]
    migs = {1: [FakeGpu(f"{H100_NAME} MIG 3g.40gb", "MIG-cccc-2222", total=40 * GIB,
                        free=39 * GIB, numa=None, mem_clock_mhz=None, bus_bits=None),
                FakeGpu(f"{H100_NAME} MIG 3g.40gb", "MIG-dddd-3333", total=40 * GIB,
                        free=20 * GIB, numa=None, mem_clock_mhz=None, bus_bits=None)]}
    return FakeNvml(gpus, levels={(0, 1): 50}, migs=migs)


def test_a_gpu_in_mig_mode_is_its_mig_devices() -> None:
    """(only whole GPUs were listed: a worker given a MIG slice found no GPU and ran on
    the CPU, and on a GPU in MIG mode it counted the whole GPU's memory)"""
    found = discover(mig_host())
    assert [(d.index, d.uuid, d.total_vram_bytes // GIB) for d in found.devices] == [
        (0, "GPU-aaaa-0000", 80), (1, "MIG-cccc-2222", 40), (1, "MIG-dddd-3333", 40)]
    sliced = found.devices[1]
    assert sliced.name.endswith("MIG 3g.40gb") and sliced.utilisation_pct is None
    assert sliced.alpha == pytest.approx(found.devices[0].alpha, rel=0.01)  # the board's ratio
    assert found.pair_weight(1, 1) == 1.0 and default_concurrency(found) == 3
    # a worker given one slice, by its UUID, as Kubernetes or Slurm hand them out
    (only,) = discover(mig_host(), visible="MIG-dddd-3333").devices
    assert (only.uuid, only.free_vram_bytes) == ("MIG-dddd-3333", 20 * GIB)
    # live readings of a slice: its own memory, by its UUID
    (again,) = live((only,), mig_host())
    assert again.free_vram_bytes == 20 * GIB


def test_hidden_gpus_fall_back_to_cpu_and_restrict_topology() -> None:
    assert discover(two_h100s(), visible="").devices[0].kind == "cpu"
    found = discover(two_h100s(), visible="1")
    assert [d.index for d in found.devices] == [1] and dict(found.topology) == {}


# -- specs, alpha, roofline -------------------------------------------------------------------

@pytest.mark.parametrize(("name", "key"), [
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA L4", "L4"),
    ("Tesla V100-SXM2-16GB", "V100"),
    ("Tesla T4", "T4"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA L40S", None),   # "L4" is a whole-word key
    ("NVIDIA GeForce GTX 1080", None),
])
def test_spec_lookup(name: str, key: str | None) -> None:
    expected = None if key is None else KNOWN_GPUS[key]
    assert lookup_spec(name) is expected


@pytest.mark.parametrize("key", sorted(KNOWN_GPUS))
def test_every_spec_has_bandwidth_and_fp32_fp16(key: str) -> None:
    spec = KNOWN_GPUS[key]
    assert spec.memory_bandwidth_bytes_per_s > 100e9
    assert 0 < spec.peak_flops["fp32"] < spec.peak_flops["fp16"]


def spec_device(key: str) -> Device:
    spec = KNOWN_GPUS[key]
    return Device(index=0, kind="cuda", name=key, uuid="GPU-x", total_vram_bytes=80 * GIB,
                  free_vram_bytes=80 * GIB,
                  memory_bandwidth_bytes_per_s=spec.memory_bandwidth_bytes_per_s,
                  peak_flops=spec.peak_flops)


@pytest.mark.parametrize(("key", "alpha"), [("V100", 0.23), ("A100", 0.42)])
def test_source_alpha_examples_are_fp32_with_4_byte_words(key: str, alpha: float) -> None:
    assert spec_device(key).alpha_at("fp32") == pytest.approx(alpha, abs=0.005)


def test_alpha_is_fp16_bandwidth_over_flops_per_word() -> None:
    h100 = spec_device("H100")
    assert h100.alpha == pytest.approx(3.35e12 / (989.5e12 / 2))
    ridge = h100.ridge_point()
    assert ridge is not None and h100.alpha == pytest.approx(2 / ridge)


@pytest.mark.parametrize(("intensity", "bound"), [
    (0.0, "memory"),
    (1.0, "memory"),      # LLM decode: ~1 FLOP per byte of weights
    (295.0, "memory"),    # just under the H100 fp16 ridge (989.5e12 / 3.35e12 = 295.4)
    (295.4, "compute"),
    (1000.0, "compute"),  # large-batch prefill GEMMs
])
def test_roofline_bound_on_h100(intensity: float, bound: str) -> None:
    assert spec_device("H100").bound(intensity) == bound


def test_roofline_at_another_precision_moves_the_ridge() -> None:
    assert spec_device("H100").bound(100.0, precision="fp32") == "compute"


@pytest.mark.parametrize("intensity", [-1.0, float("nan"), float("inf")])
def test_bad_intensity_raises(intensity: float) -> None:
    with pytest.raises(ValueError, match="arithmetic intensity"):
        spec_device("H100").bound(intensity)


def test_unknown_roofline_raises() -> None:
    with pytest.raises(ValueError, match="unknown"):
        cpu_device().bound(10.0)
    with pytest.raises(ValueError, match="unknown"):
        spec_device("V100").bound(10.0, precision="bf16")  # Volta has no BF16


# -- topology ---------------------------------------------------------------------------------

def four_gpus(levels: dict[tuple[int, int], int]) -> FakeNvml:
    return FakeNvml([FakeGpu(H100_NAME, f"GPU-{i}") for i in range(4)], levels=levels)


def test_topology_names_every_level_pair() -> None:
    levels = {(0, 1): 0, (0, 2): 10, (0, 3): 20, (1, 2): 30, (1, 3): 40, (2, 3): 50}
    nvml = four_gpus(levels)
    names = topology({i: i for i in range(4)}, nvml)
    assert names == {(0, 1): "INTERNAL", (0, 2): "SINGLE", (0, 3): "MULTIPLE",
                     (1, 2): "HOSTBRIDGE", (1, 3): "NODE", (2, 3): "SYSTEM"}


def test_unknown_or_failing_level_is_assumed_farthest() -> None:
    assert topology({0: 0, 1: 1}, four_gpus({(0, 1): 60})) == {(0, 1): "SYSTEM"}
    broken = four_gpus({})
    broken.broken_call = "nvmlDeviceGetTopologyCommonAncestor"
    assert topology({0: 0, 1: 1}, broken) == {(0, 1): "SYSTEM"}


@pytest.mark.parametrize(("level", "weight"), [
    (NVLINK, 1.0), ("INTERNAL", 1.0), ("SINGLE", 0.8), ("MULTIPLE", 0.7),
    ("HOSTBRIDGE", 0.5), ("NODE", 0.3), ("SYSTEM", 0.1),
])
def test_topology_weight_table(level: str, weight: float) -> None:
    assert topology_weight(level) == weight


def test_topology_weights_fall_with_distance_and_stay_in_unit_interval() -> None:
    order = [NVLINK, "INTERNAL", "SINGLE", "MULTIPLE", "HOSTBRIDGE", "NODE", "SYSTEM"]
    weights = [topology_weight(level) for level in order]
    assert weights == sorted(weights, reverse=True)
    assert all(0 < w <= 1 for w in TOPOLOGY_WEIGHTS.values())
    assert set(order) == set(TOPOLOGY_WEIGHTS)


def test_unknown_topology_level_raises() -> None:
    with pytest.raises(ValueError, match="unknown topology level"):
        topology_weight("PIX")


def test_pair_weight_of_a_device_with_itself_is_one() -> None:
    found = Discovery(devices=(cpu_device(),))
    assert found.pair_weight(0, 0) == 1.0


# -- live readings ----------------------------------------------------------------------------

def test_live_reads_free_memory_and_utilisation_and_nothing_else() -> None:
    fake = two_h100s()
    found = discover(nvml=fake).devices
    fake.gpus[0].free, fake.gpus[0].util = 12 * GIB, 55
    fake.gpus[1].free, fake.gpus[1].util = 3 * GIB, 0
    fake.gpus[1].name = "renamed"  # (static fields are not read again)
    now = live(found, nvml=fake)
    assert [(d.free_vram_bytes, d.utilisation_pct) for d in now] == [(12 * GIB, 55.0),
                                                                      (3 * GIB, 0.0)]
    assert [d.name for d in now] == [d.name for d in found]
    assert [d.memory_bandwidth_bytes_per_s for d in now] == [
        d.memory_bandwidth_bytes_per_s for d in found]
    assert fake.shutdowns == 2  # discovery's session, then one for both readings


def test_a_gpu_nvml_cannot_read_now_keeps_its_last_reading(
        caplog: pytest.LogCaptureFixture) -> None:
    fake = two_h100s()
    found = discover(nvml=fake).devices
    fake.gpus[0].free = 1 * GIB
    fake.gpus[1].uuid = "GPU-gone"  # fallen off the bus, say
    now = live(found, nvml=fake)
    assert now[0].free_vram_bytes == 1 * GIB and now[0].readable
    # (its reading kept, said to be an earlier one)
    assert now[1] == replace(found[1], readable=False)
    assert "NVML could not be read" not in caplog.text  # (one GPU lost: not NVML)
    fake.init_error = "Driver Not Loaded"
    with caplog.at_level("WARNING"):
        assert live(now, nvml=fake) == tuple(replace(d, readable=False) for d in now)
    # (said, with NVML's reason: it was let go unsaid)
    assert "NVML could not be read (" in caplog.text and "Driver Not Loaded" in caplog.text
    fake.init_error = None
    with caplog.at_level("INFO"):
        assert live(now, nvml=fake)[0].readable


def test_a_failure_nvml_does_not_name_is_a_reading_kept_not_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """(a ValueError out of NVML's init stopped the worker's advertisement: its record
    expired, and a 50 GiB task that its H200 could hold was dead-lettered as fitting no
    worker)"""
    fake = two_h100s()
    found = discover(nvml=fake).devices

    def odd() -> None:
        raise ValueError("Expecting value: line 1 column 1 (char 0)")

    fake.nvmlInit = odd
    with caplog.at_level("WARNING"):
        assert live(found, nvml=fake) == tuple(replace(d, readable=False) for d in found)
        live(found, nvml=fake)
    assert caplog.text.count("NVML could not be read (Expecting value") == 1


def test_live_reads_the_cpu_device_from_psutil() -> None:
    stale = cpu_device()
    (now,) = live([stale], nvml=two_h100s(init_error="never asked"))
    assert now.kind == "cpu" and now.total_vram_bytes == stale.total_vram_bytes
    assert 0 < now.free_vram_bytes <= now.total_vram_bytes
