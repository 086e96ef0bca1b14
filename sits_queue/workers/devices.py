"""Device discovery through NVML only.

This module runs in the worker's *parent* process, before the pool forks its
children. It must never import torch or touch CUDA: a CUDA context created here
is inherited broken by every forked child ("Cannot re-initialize CUDA in forked
subprocess", celery#6036). vLLM's ``platforms/cuda.py`` keeps the same rule and
asks NVML instead; NVML answers with plain numbers and holds no GPU context.

With no driver, no GPU or any NVML error, :func:`discover` returns one CPU device
and a one-line notice; it never raises for a missing GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import platform
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

import psutil

from sits_queue.spells import Spell
from sits_queue.workers import nvmlfork

DeviceKind = Literal["cuda", "cpu"]
Bound = Literal["memory", "compute"]

#: Bytes per operand word of each precision, for MISSION §3.1 ``peak_flops / word_size``.
WORD_SIZE_BYTES: Mapping[str, int] = MappingProxyType({"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1})

_TERA = 1e12
_GIGA = 1e9
#: Double data rate: NVML's memory clock moves data on both edges (HBM and GDDR alike).
_TRANSFERS_PER_CLOCK = 2
_BITS_PER_BYTE = 8
_HZ_PER_MHZ = 1e6


def _empty_flops() -> Mapping[str, float]:
    return MappingProxyType({})


@dataclass(frozen=True)
class GpuSpec:
    """Published figures for one GPU model; used where NVML has no answer."""

    #: Peak memory bandwidth, bytes/s.
    memory_bandwidth_bytes_per_s: float
    #: Dense (no structured sparsity) peak FLOP/s per precision; tensor cores where present.
    peak_flops: Mapping[str, float] = field(default_factory=_empty_flops, hash=False)


def _spec(bandwidth_bytes_per_s: float, **tflops: float) -> GpuSpec:
    return GpuSpec(bandwidth_bytes_per_s,
                   MappingProxyType({k: v * _TERA for k, v in tflops.items()}))


#: Keyed by a whole-word substring of the NVML device name ("L4" does not match "L40S", nor
#: "A10" "A100"); :func:`lookup_spec` takes the longest match, so "H100 PCIe" wins over
#: "H100". NVIDIA datasheets quote tensor
#: figures *with* 2:4 sparsity (marked "*"); every figure below is the dense one (half).
KNOWN_GPUS: Mapping[str, GpuSpec] = MappingProxyType({
    # H200 datasheet, SXM: 4.8 TB/s; FP32 67 TF; FP16/BF16 1,979* TF; INT8 3,958* TOPS.
    "H200": _spec(4.8 * _TERA, fp32=67, fp16=989.5, bf16=989.5, int8=1979),
    # H200 datasheet, NVL: 4.8 TB/s; FP32 60 TF; FP16/BF16 1,671* TF; INT8 3,341* TOPS.
    "H200 NVL": _spec(4.8 * _TERA, fp32=60, fp16=835.5, bf16=835.5, int8=1670.5),
    # H100 datasheet, SXM: 3.35 TB/s; FP32 67 TF; FP16/BF16 1,979* TF; INT8 3,958* TOPS.
    "H100": _spec(3.35 * _TERA, fp32=67, fp16=989.5, bf16=989.5, int8=1979),
    # H100 datasheet, PCIe: 2 TB/s; FP32 51 TF; FP16/BF16 1,513* TF; INT8 3,026* TOPS.
    "H100 PCIe": _spec(2.0 * _TERA, fp32=51, fp16=756.5, bf16=756.5, int8=1513),
    # H100 datasheet, NVL: 3.9 TB/s; FP32 60 TF; FP16/BF16 1,671* TF; INT8 3,341* TOPS.
    "H100 NVL": _spec(3.9 * _TERA, fp32=60, fp16=835.5, bf16=835.5, int8=1670.5),
    # A100 datasheet, 80GB SXM: 2,039 GB/s; FP32 19.5 TF; FP16/BF16 312 TF; INT8 624 TOPS
    # (dense; 624*/1,248* with sparsity). The 40GB part has 1,555 GB/s: NVML reports it.
    "A100": _spec(2039 * _GIGA, fp32=19.5, fp16=312, bf16=312, int8=624),
    # A10 datasheet: 600 GB/s; FP32 31.2 TF; FP16/BF16 125 TF; INT8 250 TOPS (dense).
    "A10": _spec(600 * _GIGA, fp32=31.2, fp16=125, bf16=125, int8=250),
    # A10G is AWS's A10 variant; NVIDIA publishes no datasheet for it, so the A10's figures.
    "A10G": _spec(600 * _GIGA, fp32=31.2, fp16=125, bf16=125, int8=250),
    # L4 datasheet: 300 GB/s; FP32 30.3 TF; FP16/BF16 242* TF; INT8 485* TOPS.
    "L4": _spec(300 * _GIGA, fp32=30.3, fp16=121, bf16=121, int8=242.5),
    # V100 datasheet, SXM2: 900 GB/s; FP32 15.7 TF; tensor (FP16) 125 TF. No BF16/INT8 row.
    # (PCIe: 14 TF / 112 TF, within 12%; close enough for a placement hint.)
    "V100": _spec(900 * _GIGA, fp32=15.7, fp16=125),
    # T4 datasheet: 320 GB/s; FP32 8.1 TF; mixed FP16 65 TF; INT8 130 TOPS. No BF16.
    "T4": _spec(320 * _GIGA, fp32=8.1, fp16=65, int8=130),
    # Ada Lovelace whitepaper, RTX 4090: 1,008 GB/s; FP32 82.6 TF; FP16 and BF16 tensor with
    # FP32 accumulate 165.2 TF (what torch uses; FP16-accumulate is 330.3); INT8 660.6 TOPS.
    "RTX 4090": _spec(1008 * _GIGA, fp32=82.6, fp16=165.2, bf16=165.2, int8=660.6),
})


def _names_model(name: str, key: str) -> bool:
    pattern = rf"(?<![a-z0-9]){re.escape(key.casefold())}(?![a-z0-9])"
    return re.search(pattern, name.casefold()) is not None


def lookup_spec(name: str) -> GpuSpec | None:
    """The :data:`KNOWN_GPUS` entry whose key is the longest whole-word substring of ``name``."""
    matches = [key for key in KNOWN_GPUS if _names_model(name, key)]
    return KNOWN_GPUS[max(matches, key=len)] if matches else None


@dataclass(frozen=True)
class Device:
    """One compute device as NVML (or psutil, for the CPU fallback) reports it."""

    #: NVML index (physical order, not CUDA_VISIBLE_DEVICES order); 0 for the CPU device.
    index: int
    kind: DeviceKind
    name: str
    uuid: str
    #: Device memory, bytes; host RAM for the CPU device.
    total_vram_bytes: int
    free_vram_bytes: int
    #: GPU busy percentage over NVML's last sample period; None where unknown.
    utilisation_pct: float | None = None
    #: NUMA node nearest the device (for CPU affinity); None where unknown.
    numa_node: int | None = None
    #: Peak memory bandwidth, bytes/s; None where unknown.
    memory_bandwidth_bytes_per_s: float | None = None
    #: Dense peak FLOP/s per precision ("fp32", "fp16", "bf16", "int8"); may be empty.
    peak_flops: Mapping[str, float] = field(default_factory=_empty_flops, hash=False)
    #: False where NVML could not read it at the last :func:`live` reading (its free
    #: memory and utilisation are an earlier reading's).
    readable: bool = True

    def alpha_at(self, precision: str) -> float | None:
        """MISSION §3.1 ``alpha = bandwidth / (peak_flops / word_size)`` at one precision.

        Equals ``word_size / ridge_point``: the larger, the more bandwidth per FLOP. The
        source's examples (V100 ~0.23, A100 ~0.42) are this at "fp32" with 4-byte words
        on the CUDA-core FP32 peak; at "fp16" on tensor cores the values are ~30x smaller.
        """
        peak = self.peak_flops.get(precision)
        if not peak or not self.memory_bandwidth_bytes_per_s:
            return None
        return self.memory_bandwidth_bytes_per_s / (peak / WORD_SIZE_BYTES[precision])

    @property
    def alpha(self) -> float | None:
        """:meth:`alpha_at` for fp16 (the inference default), None when unknown."""
        return self.alpha_at("fp16")

    def ridge_point(self, precision: str = "fp16") -> float | None:
        """Roofline ridge, FLOP/byte: ``peak_flops / bandwidth``; None when unknown."""
        peak = self.peak_flops.get(precision)
        if not peak or not self.memory_bandwidth_bytes_per_s:
            return None
        return peak / self.memory_bandwidth_bytes_per_s

    def bound(self, arithmetic_intensity_flops_per_byte: float,
              precision: str = "fp16") -> Bound:
        """Roofline: "memory" below the ridge point, "compute" at or above it.

        Raises ValueError when the device's roofline is unknown (check :attr:`alpha`)
        or the intensity is negative or not finite.
        """
        ai = arithmetic_intensity_flops_per_byte
        if not math.isfinite(ai) or ai < 0:
            raise ValueError(f"arithmetic intensity must be finite and >= 0, got {ai!r}")
        ridge = self.ridge_point(precision)
        if ridge is None:
            raise ValueError(f"roofline of {self.name!r} at {precision} is unknown")
        return "memory" if ai < ridge else "compute"


# -- topology ---------------------------------------------------------------------------------

#: NVML ``nvmlGpuTopologyLevel_t`` values; the module's own constants win where present.
_TOPOLOGY_LEVELS: Mapping[str, int] = MappingProxyType({
    "INTERNAL": 0, "SINGLE": 10, "MULTIPLE": 20, "HOSTBRIDGE": 30, "NODE": 40, "SYSTEM": 50,
})
NVLINK = "NVLINK"
#: nvmlDeviceGetP2PStatus index and answer meaning "P2P over NVLink works".
_P2P_CAPS_INDEX_NVLINK = 2
_P2P_STATUS_OK = 0

#: Affinity weight per topology level, roughly the share of peer-to-peer bandwidth left.
#: Only the order and rough ratios matter. Advertised with each pair (``Discovery.links``,
#: ``sitsq status``); no pick weighs them: each pool child holds its engines in its own
#: process on its own GPU (pinned, no peer-to-peer path between children), and no task
#: runs across two GPUs, so a pair's link moves no bytes a task waits on.
TOPOLOGY_WEIGHTS: Mapping[str, float] = MappingProxyType({
    NVLINK: 1.0,        # direct GPU-GPU links, hundreds of GB/s
    "INTERNAL": 1.0,    # two GPUs on one board (on-board switch)
    "SINGLE": 0.8,      # one PCIe switch: P2P at full PCIe bandwidth
    "MULTIPLE": 0.7,    # a chain of PCIe switches, no host bridge
    "HOSTBRIDGE": 0.5,  # through one CPU's host bridge; P2P often disabled
    "NODE": 0.3,        # across host bridges within one NUMA node
    "SYSTEM": 0.1,      # across sockets over the SMP interconnect
})


def topology_weight(level: str) -> float:
    """Affinity in (0, 1] for a topology level name (see :data:`TOPOLOGY_WEIGHTS`).

    1.0 for NVLink or the same board, falling through PCIe switch, host bridge and
    NUMA node to 0.1 across sockets. Unknown names raise ValueError.
    """
    try:
        return TOPOLOGY_WEIGHTS[level]
    except KeyError:
        raise ValueError(f"unknown topology level {level!r}; "
                         f"known: {sorted(TOPOLOGY_WEIGHTS)}") from None


def _import_nvml() -> Any:
    return importlib.import_module("pynvml")


def _nvml_errors(nvml: Any) -> tuple[type[BaseException], ...]:
    # OSError: a broken libnvml; AttributeError: an older binding lacking a newer call.
    return (getattr(nvml, "NVMLError", OSError), OSError, AttributeError)


def _level_name(nvml: Any, value: int) -> str:
    for name, default in _TOPOLOGY_LEVELS.items():
        if value == getattr(nvml, f"NVML_TOPOLOGY_{name}", default):
            return name
    return "SYSTEM"  # a level NVML added later: assume the worst


def _pair_level(nvml: Any, a: Any, b: Any) -> str:
    errors = _nvml_errors(nvml)
    with contextlib.suppress(*errors):
        index = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", _P2P_CAPS_INDEX_NVLINK)
        if nvml.nvmlDeviceGetP2PStatus(a, b, index) == getattr(
                nvml, "NVML_P2P_STATUS_OK", _P2P_STATUS_OK):
            return NVLINK
    try:
        return _level_name(nvml, nvml.nvmlDeviceGetTopologyCommonAncestor(a, b))
    except errors:
        return "SYSTEM"  # unanswerable (e.g. MIG, vGPU): assume the farthest


def topology(handles: Mapping[int, Any], nvml: Any = None) -> dict[tuple[int, int], str]:
    """Level name for every pair ``(i, j)``, ``i < j``, of NVML device indices.

    ``handles`` maps device index -> NVML handle; NVML must be initialised. NVLink
    (one P2P status call per pair) overrides the PCIe common ancestor, since NVML
    reports the PCIe path even where an NVLink bridge exists.
    """
    nvml = _import_nvml() if nvml is None else nvml
    indices = sorted(handles)
    return {(i, j): _pair_level(nvml, handles[i], handles[j])
            for n, i in enumerate(indices) for j in indices[n + 1:]}


# -- discovery --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Discovery:
    """What one host offers: its devices, their pairwise topology, a notice for the log."""

    devices: tuple[Device, ...]
    #: ``(i, j) -> level name`` for device indices ``i < j``.
    topology: Mapping[tuple[int, int], str] = field(
        default_factory=lambda: MappingProxyType({}), hash=False)
    #: One line to print at worker start (CPU fallback, unknown specs), or None.
    notice: str | None = None

    @property
    def cuda_devices(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.kind == "cuda")

    def links(self, devices: Sequence[Device]) -> list[dict[str, Any]]:
        """The topology between each pair of ``devices`` (GPUs of different indices; MIG
        slices of one board share its index) as the advertisement carries it."""
        indices = sorted({d.index for d in devices if d.kind == "cuda"})
        return [{"a": i, "b": j, "level": level, "weight": TOPOLOGY_WEIGHTS[level]}
                for n, i in enumerate(indices) for j in indices[n + 1:]
                if (level := self.topology.get((i, j), "")) in TOPOLOGY_WEIGHTS]

    def pair_weight(self, a: int, b: int) -> float:
        """:func:`topology_weight` between two device indices; 1.0 for a device with itself."""
        if a == b:
            return 1.0
        return topology_weight(self.topology[(min(a, b), max(a, b))])


def label(kind: object, index: object, uuid: object) -> str:
    """A device's name in metrics and results: ``cuda:<NVML index>``, and for a MIG
    device ``cuda:<index>/<MIG UUID>``: the slices of one GPU share its index, and their
    series collided (Prometheus drops a scrape with two samples of one label set)."""
    mig = f"/{uuid}" if isinstance(uuid, str) and uuid.startswith("MIG-") else ""
    return f"{kind}:{index}{mig}"


def cpu_device() -> Device:
    """The fallback device: host RAM stands in for device memory."""
    memory = psutil.virtual_memory()
    return Device(index=0, kind="cpu", name=platform.processor() or platform.machine() or "cpu",
                  uuid="cpu", total_vram_bytes=int(memory.total),
                  free_vram_bytes=int(memory.available))


def cpu_discovery(reason: str) -> Discovery:
    one_line = " ".join(reason.split()) or "unknown error"
    return Discovery(devices=(cpu_device(),),
                     notice=f"sits-queue: no NVIDIA GPU visible (NVML: {one_line}); "
                            "running on CPU")


def _optional(nvml: Any, call: str, *args: Any) -> Any:
    """An NVML answer, or None where the call is unsupported on this device or binding."""
    try:
        return getattr(nvml, call)(*args)
    except _nvml_errors(nvml):
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _nvml_bandwidth(nvml: Any, handle: Any) -> float | None:
    """``max memory clock * bus width * 2 / 8``, bytes/s; None where NVML cannot tell."""
    clock_mhz = _optional(nvml, "nvmlDeviceGetMaxClockInfo", handle,
                          getattr(nvml, "NVML_CLOCK_MEM", 2))
    bus_bits = _optional(nvml, "nvmlDeviceGetMemoryBusWidth", handle)
    if not clock_mhz or not bus_bits:
        return None
    return float(clock_mhz * _HZ_PER_MHZ * bus_bits * _TRANSFERS_PER_CLOCK / _BITS_PER_BYTE)


def _read_device(nvml: Any, index: int, handle: Any, name: str | None = None) -> Device:
    name = _text(nvml.nvmlDeviceGetName(handle)) if name is None else name
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    rates = _optional(nvml, "nvmlDeviceGetUtilizationRates", handle)
    spec = lookup_spec(name)
    bandwidth = _nvml_bandwidth(nvml, handle)
    if bandwidth is None and spec is not None:
        bandwidth = spec.memory_bandwidth_bytes_per_s
    return Device(
        index=index, kind="cuda", name=name, uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        total_vram_bytes=int(memory.total), free_vram_bytes=int(memory.free),
        utilisation_pct=None if rates is None else float(rates.gpu),
        numa_node=_optional(nvml, "nvmlDeviceGetNumaNodeId", handle),
        memory_bandwidth_bytes_per_s=bandwidth,
        peak_flops=spec.peak_flops if spec is not None else _empty_flops())


def _mig_handles(nvml: Any, handle: Any) -> list[Any]:
    """The MIG devices of a GPU in MIG mode, in NVML's order (none when it is not in MIG
    mode or NVML cannot say: a GPU without MIG answers "not supported")."""
    mode = _optional(nvml, "nvmlDeviceGetMigMode", handle)
    if not mode or mode[0] != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return []
    found = []
    for k in range(int(_optional(nvml, "nvmlDeviceGetMaxMigDeviceCount", handle) or 0)):
        mig = _optional(nvml, "nvmlDeviceGetMigDeviceHandleByIndex", handle, k)
        if mig is not None:  # (an index no instance holds: "not found")
            found.append(mig)
    return found


def _read_gpu(nvml: Any, index: int, handle: Any) -> list[Device]:
    """A GPU as its devices: itself, or in MIG mode each of its MIG devices, which a
    child is pinned to by its ``MIG-`` UUID as to a whole GPU (a CUDA process sees one).
    A MIG device keeps its GPU's index (they share a board: topology weight 1) and its
    GPU's published specs (the FLOPs of the whole GPU: its roofline ratio, not its size);
    its memory is its own."""
    slices = _mig_handles(nvml, handle)
    if not slices:
        return [_read_device(nvml, index, handle)]
    board = _text(nvml.nvmlDeviceGetName(handle))
    return [_read_device(nvml, index, mig, _text(
        _optional(nvml, "nvmlDeviceGetName", mig) or f"{board} MIG")) for mig in slices]


def _match_visible(devices: tuple[Device, ...], token: str) -> Device | None:
    if token.isdigit():
        return next((d for d in devices if d.index == int(token)), None)
    found = [d for d in devices if token and d.uuid.startswith(token)]
    return found[0] if len(found) == 1 else None


def visible_devices(devices: tuple[Device, ...], spec: str | None) -> tuple[Device, ...]:
    """Apply a ``CUDA_VISIBLE_DEVICES`` value (indices, UUID prefixes, ``MIG-`` UUIDs;
    None = all; an index of a GPU in MIG mode names its first MIG device here: name MIG
    devices by their ``MIG-`` UUIDs).

    Like CUDA, an invalid entry hides it and every entry after it.
    """
    if spec is None:
        return devices
    chosen: list[Device] = []
    for token in spec.split(","):
        device = _match_visible(devices, token.strip())
        if device is None:
            break
        if device not in chosen:
            chosen.append(device)
    return tuple(chosen)


def _unknown_spec_notice(devices: tuple[Device, ...]) -> str | None:
    unknown = sorted({d.name for d in devices if d.alpha is None})
    if not unknown:
        return None
    return f"sits-queue: no published specs for {', '.join(unknown)}; roofline unknown"


def order_notice(everything: tuple[Device, ...], visible: str | None,
                 order: str | None) -> str | None:
    """Why ``CUDA_VISIBLE_DEVICES`` indices may name other GPUs here than in CUDA, or
    None: they are read in NVML's order (PCI bus), CUDA's is fastest first unless
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (the two agree where every GPU is one model: CUDA
    breaks its ties by bus)."""
    if visible is None or (order or "").strip().upper() == "PCI_BUS_ID":
        return None
    if not any(token.strip().isdigit() for token in visible.split(",")):
        return None
    if len({d.name for d in everything}) <= 1:
        return None
    return ("sits-queue: CUDA_VISIBLE_DEVICES names GPUs by index, read in NVML's (PCI "
            "bus) order, while CUDA numbers mixed models fastest first: set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID, or name them by UUID")


def _discover_gpus(nvml: Any, visible: str | None, order: str | None = None) -> Discovery:
    count = int(nvml.nvmlDeviceGetCount())
    handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)}
    everything = tuple(d for i, h in handles.items() for d in _read_gpu(nvml, i, h))
    devices = visible_devices(everything, visible)
    if not devices:
        hidden = f" of {count} hidden by CUDA_VISIBLE_DEVICES={visible!r}" if count else ""
        return cpu_discovery(f"0 devices{hidden}")
    pairs = topology({d.index: handles[d.index] for d in devices}, nvml)
    notices = [n for n in (_unknown_spec_notice(devices), order_notice(everything, visible,
                                                                         order)) if n]
    return Discovery(devices=devices, topology=MappingProxyType(pairs),
                     notice="; ".join(notices) or None)


def discover(nvml: Any = None, visible: str | None = None,
             order: str | None = None) -> Discovery:
    """Every NVIDIA GPU NVML can see, or one CPU device with a notice saying why not.

    ``nvml`` is the pynvml module (injectable for tests; imported lazily by default).
    ``visible`` is the ``CUDA_VISIBLE_DEVICES`` value and ``order`` the
    ``CUDA_DEVICE_ORDER`` one, passed in by the caller so that the environment is read
    at the edge. Never raises for a missing GPU or driver.
    """
    if nvml is None:
        try:
            nvml = _import_nvml()
        except ImportError:
            return cpu_discovery("nvidia-ml-py is not installed")
    try:
        with _opened(nvml):
            return _discover_gpus(nvml, visible, order)
    except _nvml_errors(nvml) as exc:
        return cpu_discovery(str(exc) or type(exc).__name__)


@contextlib.contextmanager
def _opened(nvml: Any) -> Iterator[None]:
    """One NVML session, init to shutdown (an init's error raised), with forks held off
    (:mod:`nvmlfork`: a child must not inherit it open)."""
    with nvmlfork.session():
        nvml.nvmlInit()
        try:
            yield
        finally:
            with contextlib.suppress(*_nvml_errors(nvml)):
                nvml.nvmlShutdown()


def live(devices: Sequence[Device], nvml: Any = None) -> tuple[Device, ...]:
    """``devices`` with their free memory and utilisation read now: the GPUs in one NVML
    session (by UUID), the CPU device from psutil. Names, bandwidth, FLOPs and topology do
    not change while a worker runs: not read again (a whole :func:`discover` every few
    seconds cost an NVML init and shutdown and every topology pair, each time). A GPU NVML
    cannot read now keeps its last reading, marked not ``readable``; any failure of
    NVML's, or of a driver odder than NVML's errors say, is one: the advertisement goes on
    (a ValueError out of NVML's init stopped the worker's refreshes, its record expired,
    and a 50 GiB task that its H200 could hold was dead-lettered as fitting no worker)."""
    gpus = [d for d in devices if d.kind == "cuda"]
    readings: dict[str, tuple[int, float | None]] = {}
    if gpus:
        try:
            readings = _live_readings(_import_nvml() if nvml is None else nvml, gpus)
        except ImportError:
            pass
        except Exception as exc:
            _unreadable.failed("NVML could not be read (%s): the GPUs keep their last "
                               "readings", exc)
        else:
            _unreadable.over()
    out = []
    for device in devices:
        if device.kind == "cpu":
            out.append(replace(device,
                               free_vram_bytes=int(psutil.virtual_memory().available)))
        elif device.uuid in readings:
            free, busy = readings[device.uuid]
            out.append(replace(device, free_vram_bytes=free, utilisation_pct=busy,
                               readable=True))
        else:
            out.append(replace(device, readable=False))
    return tuple(out)


#: NVML failing at every reading of :func:`live`, said once while it lasts.
_unreadable = Spell(logging.getLogger(__name__))


def _live_readings(nvml: Any, gpus: Sequence[Device]) -> dict[str, tuple[int, float | None]]:
    """Each GPU's (free bytes, utilisation) by UUID, one NVML session; a GPU it cannot read
    now is left out. A failure of the session itself is raised, for :func:`live` to say
    (an NVML error here was let go unsaid: a driver unloaded showed as GPUs unreadable, no
    reason given, where any other failure was said)."""
    found: dict[str, tuple[int, float | None]] = {}
    with _opened(nvml):
        for device in gpus:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(device.uuid)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception:  # (one GPU lost: the others are read)
                continue
            rates = _optional(nvml, "nvmlDeviceGetUtilizationRates", handle)
            found[device.uuid] = (int(memory.free),
                                  None if rates is None else float(rates.gpu))
    return found


def default_concurrency(discovery: Discovery) -> int:
    """One pool child per GPU; one on a CPU-only host."""
    return len(discovery.cuda_devices) or 1
