"""Per-class limit arithmetic (MISSION §1.4)."""

from __future__ import annotations

import pytest

from sits_queue.config import DEFAULT_CLASSES, ClassQuota
from sits_queue.workers.limits import BYTES_PER_GIB, cpu_set, fits, time_limits, vram_fraction

GIB = BYTES_PER_GIB
HIGH, MEDIUM, LOW = DEFAULT_CLASSES


def quota(cpu_cores: int = 4, vram_gib: float = 8, max_run_s: float = 10) -> ClassQuota:
    return ClassQuota("q", cpu_cores=cpu_cores, vram_gib=vram_gib, max_run_s=max_run_s,
                      weight=1.0, latency_sla_ms=1000, loss_sensitivity=0.5)


# -- VRAM fraction ----------------------------------------------------------------------------

@pytest.mark.parametrize(("q", "total_bytes", "fraction"), [
    (HIGH, 80 * GIB, 0.8),       # §1.4 on the A100-80G it was written for
    (MEDIUM, 80 * GIB, 0.4),
    (LOW, 80 * GIB, 0.1),
    (HIGH, 24 * GIB, 1.0),       # limit larger than the device: capped at the whole device
    (LOW, 8 * GIB, 1.0),         # exactly the device
    (quota(vram_gib=0.5), 141 * GIB, 0.5 / 141),
])
def test_vram_fraction(q: ClassQuota, total_bytes: int, fraction: float) -> None:
    assert vram_fraction(q, total_bytes) == pytest.approx(fraction)


@pytest.mark.parametrize("total_bytes", [0, -1])
def test_vram_fraction_rejects_empty_device(total_bytes: int) -> None:
    with pytest.raises(ValueError, match="device_total_bytes"):
        vram_fraction(LOW, total_bytes)


# -- fits -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("needed_gib", "free_bytes", "headroom_bytes", "expected"), [
    (None, 0, 0, True),                        # nothing declared: always fits
    (None, 0, GIB, True),
    (8, 8 * GIB, 0, True),                     # exactly enough
    (8, 8 * GIB, 1, False),                    # headroom tips it over
    (8, 9 * GIB, GIB, True),
    (8.5, 8 * GIB + GIB // 2 - 1, 0, False),   # one byte short
    (0, 0, 0, True),
])
def test_fits(needed_gib: float | None, free_bytes: int, headroom_bytes: int,
              expected: bool) -> None:
    assert fits(needed_gib, free_bytes, headroom_bytes) is expected


@pytest.mark.parametrize(("needed_gib", "headroom_bytes", "match"), [
    (-1.0, 0, "vram_gib_needed"),
    (float("nan"), 0, "vram_gib_needed"),
    (float("inf"), 0, "vram_gib_needed"),
    (1.0, -1, "headroom_bytes"),
])
def test_fits_rejects_nonsense(needed_gib: float, headroom_bytes: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fits(needed_gib, 10 * GIB, headroom_bytes)


# -- CPU sets ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("cores", "available", "slot", "slots", "expected"), [
    (4, range(16), 0, 1, (0, 1, 2, 3)),               # one child: first cores of all
    (16, range(8), 0, 1, tuple(range(8))),            # quota above the host: all it has
    (4, range(16), 1, 2, (8, 9, 10, 11)),             # second half for the second child
    (8, range(16), 3, 4, (12, 13, 14, 15)),           # share (4) caps the quota (8)
    (2, range(10), 0, 3, (0, 1)),                     # shares 4,3,3: uneven split
    (4, range(10), 0, 3, (0, 1, 2, 3)),
    (4, range(10), 1, 3, (4, 5, 6)),
    (4, range(10), 2, 3, (7, 8, 9)),
    (1, [7, 3, 5, 3, 1], 1, 2, (5,)),                 # sorted and de-duplicated: [1,3,5,7]
    (4, [0, 1], 3, 4, (1,)),                          # fewer cores than slots: wrap, shared
    (4, [0, 1], 2, 4, (0,)),
])
def test_cpu_set(cores: int, available: range | list[int], slot: int, slots: int,
                 expected: tuple[int, ...]) -> None:
    assert cpu_set(quota(cpu_cores=cores), list(available), slot, slots) == expected


@pytest.mark.parametrize("slots", [1, 2, 3, 5, 8, 16, 17, 40])
def test_cpu_sets_are_disjoint_nonempty_and_within_quota(slots: int) -> None:
    available = list(range(32))
    sets = [cpu_set(MEDIUM, available, s, slots) for s in range(slots)]
    assert all(1 <= len(s) <= MEDIUM.cpu_cores for s in sets)
    assert all(set(s) <= set(available) for s in sets)
    if slots <= len(available):
        flat = [c for s in sets for c in s]
        assert len(flat) == len(set(flat))


@pytest.mark.parametrize(("available", "slot", "slots", "match"), [
    ([], 0, 1, "available_cpus"),
    ([0, 1], 0, 0, "slots"),
    ([0, 1], -1, 2, "slot"),
    ([0, 1], 2, 2, "slot"),
])
def test_cpu_set_rejects_bad_arguments(available: list[int], slot: int, slots: int,
                                       match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cpu_set(LOW, available, slot, slots)


# -- time limits ------------------------------------------------------------------------------

@pytest.mark.parametrize(("q", "soft_fraction", "expected"), [
    (HIGH, 0.8, (36.0, 45.0)),
    (MEDIUM, 0.8, (24.0, 30.0)),
    (LOW, 0.5, (5.0, 10.0)),
])
def test_time_limits(q: ClassQuota, soft_fraction: float,
                     expected: tuple[float, float]) -> None:
    assert time_limits(q, soft_fraction) == pytest.approx(expected)


@pytest.mark.parametrize("soft_fraction", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_time_limits_reject_fraction_outside_open_unit_interval(soft_fraction: float) -> None:
    with pytest.raises(ValueError, match="soft_fraction"):
        time_limits(LOW, soft_fraction)
