"""Byte budgets of a pool child's caches (MISSION §4.3): the device warm tier, the host
shadow tier and the KV-prefix store, from the device, the host's memory and the pool's
size, or from ``SITS_*_CACHE_BYTES`` overrides. Pure; the worker runtime applies them."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from sits_queue.config import CACHE_BYTES_VARS, SitsConfig
from sits_queue.errors import ConfigError
from sits_queue.workers.devices import Device, Discovery

#: Share of the device tier the KV-prefix cache may take besides it: prefixes are small
#: next to weights (a 2k-token prefix of a 7B fp16 model is ~1 GiB) but pay per hit.
PREFIX_CACHE_SHARE = 0.125
#: MISSION §4.3: the device warm pool takes about 30% of the device's memory.
DEVICE_CACHE_SHARE = 0.30
#: ... and the host shadow pool 70% of the child's share of host memory.
HOST_CACHE_SHARE = 0.70
#: Share of host RAM all children's caches may use together: the rest is for the tasks,
#: the OS, and (on a CPU host) the "device" tier, which is host RAM as well.
HOST_MEMORY_SHARE = 0.50


def children_per_device(discovery: Discovery, slots: int, slot: int | None = None) -> int:
    """How many children share the device of child ``slot`` (slot ``i`` is pinned to GPU
    ``i mod n``), for splitting its cache budget; without a slot, the busiest device.
    (With GPUs that get unequal numbers of children, 3 on 2 GPUs, every child's share was
    the busiest device's: the child alone on its GPU got half of its tier.)"""
    devices = len(discovery.cuda_devices) or 1
    slots = max(1, slots)
    if slot is None or not discovery.cuda_devices:
        return -(-slots // devices)  # ceil
    return len(range(slot % devices, slots, devices))


@dataclass(frozen=True)
class CacheBudgets:
    """Byte budgets of one child's two-tier engine cache; None = derive from the device."""

    #: Device (warm) tier, bytes. Env ``SITS_DEVICE_CACHE_BYTES``.
    device_bytes: int | None = None
    #: Host (shadow) tier, bytes. Env ``SITS_HOST_CACHE_BYTES``.
    host_bytes: int | None = None
    #: KV-prefix cache of generations, bytes (0: off); by default an eighth of the
    #: device tier. Env ``SITS_KV_PREFIX_CACHE_BYTES``.
    prefix_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "prefix_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 0):
                raise ConfigError(f"cache {name} must be >= 0, got {value!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CacheBudgets:
        env = os.environ if env is None else env
        device, host, prefix = CACHE_BYTES_VARS
        return cls(device_bytes=_env_bytes(env, device), host_bytes=_env_bytes(env, host),
                   prefix_bytes=_env_bytes(env, prefix))

    def prefix_budget(self, device_bytes: int) -> int:
        """The KV-prefix budget: the override, else :data:`PREFIX_CACHE_SHARE` of the
        device tier (prefixes live on the device, beside the engines)."""
        if self.prefix_bytes is not None:
            return self.prefix_bytes
        return int(device_bytes * PREFIX_CACHE_SHARE)

    def resolve(self, device: Device, host_total_bytes: int, slots: int,
                sharing: int = 1) -> tuple[int, int]:
        """``(device_bytes, host_bytes)``: the overrides, else the §4.3 shares.

        The device tier takes :data:`DEVICE_CACHE_SHARE` of the device, split between
        the ``sharing`` children pinned to it; on a CPU host the "device" is host RAM,
        so it comes out of the child's host share instead. The host tier takes
        :data:`HOST_CACHE_SHARE` of the child's share of host RAM.
        """
        host_share = host_total_bytes * HOST_MEMORY_SHARE / max(1, slots)
        if device.kind == "cuda":
            device_default = device.total_vram_bytes * DEVICE_CACHE_SHARE / max(1, sharing)
        else:
            device_default = host_share * DEVICE_CACHE_SHARE
        return (int(device_default) if self.device_bytes is None else self.device_bytes,
                int(host_share * HOST_CACHE_SHARE) if self.host_bytes is None
                else self.host_bytes)


#: Units a ``SITS_*_CACHE_BYTES`` value may carry ("8GiB", "512 MB"; none: bytes).
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(key: str, raw: str) -> int:
    """``raw`` as a whole number of bytes: a number, optionally with a unit (``8GiB``,
    ``1.5 GB``, ``65536``). Raises :class:`ConfigError` naming ``key``."""
    text = raw.strip().lower()
    number = text.rstrip("kmgtib ")
    unit = text[len(number):].strip()
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ConfigError(f"{key}={raw!r} is not a number of bytes (say 8GiB, 512MB or "
                          "65536)") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{key}={raw!r} must be a finite number of bytes >= 0")
    if value >= 2**63:
        raise ConfigError(f"{key}={raw!r} is too large: at most 8 EiB (2**63 - 1 bytes)")
    if _UNITS[unit] == 1 and not value.is_integer():
        # (1.5 was read as 1 byte: a unit forgotten, most likely, not a budget meant)
        raise ConfigError(f"{key}={raw!r} is a fraction of a byte: give a unit (1.5GB, "
                          "1.5GiB) or a whole number of bytes")
    return int(value)


def _env_bytes(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return None
    return parse_bytes(key, raw)


def settings_from_env() -> SitsConfig:
    """The settings from the environment, the cache sizes checked with them: each pool
    child reads those again, and a bad one is the same one-line error as a bad setting
    where the settings are read (the app, ``sitsq``), not two tracebacks in the worker's
    start (and ``sitsq status`` took ``SITS_DEVICE_CACHE_BYTES=lots``)."""
    config = SitsConfig.from_env()
    CacheBudgets.from_env()
    return config
