"""Aging of the host shadow pool (§4.3): by time and by memory pressure."""

from __future__ import annotations

import pytest

from sits_queue.cache.aging import RELIEF, HostMemory, HostPoolAger, host_budget
from sits_queue.cache.pool import EngineCache
from tests.unit.test_engine_pool import DEVICE, Clock, Loaders

GIB = 2**30


def mem(available_gib: float, used: int = 300, budget: int = 300, less: int = 0
        ) -> HostMemory:
    return HostMemory(int(available_gib * GIB) - less, 100 * GIB, used, budget)


class FixedClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("m", "full", "sharers", "expected"), [
    (mem(50), 300, 1, None),                    # plenty: nothing to do
    (mem(10, used=300 * GIB, budget=300 * GIB, less=1000), 300 * GIB, 1,
     300 * GIB - 1000),                         # short by 1000 bytes: that much back
    (mem(4, used=40 * GIB, budget=50 * GIB), 50 * GIB, 2, 37 * GIB),  # its half of 6 GiB
    (mem(1, used=2 * GIB, budget=50 * GIB), 50 * GIB, 1, 0),         # all it holds, no less
    (mem(5, used=0, budget=0), 50 * GIB, 1, None),                    # nothing left to give
    (mem(12, budget=100), 300, 1, None),        # between the level and relief: hold
    (mem(10 * RELIEF, budget=100), 300, 1, 300),  # relieved: the full budget back
])
def test_host_budget(m: HostMemory, full: int, sharers: int, expected: int | None) -> None:
    assert host_budget(m, full, 0.10, sharers) == expected


def test_no_pressure_level_never_shrinks() -> None:
    assert host_budget(mem(0.1), 300, 0.0, 1) is None


def test_the_ager_releases_stale_engines_and_gives_memory_back_under_pressure() -> None:
    clock = FixedClock()
    cache = EngineCache(DEVICE, 100, 300, clock=clock)
    loaders = Loaders({"a": 100, "b": 100, "c": 100, "d": 100})
    for key in ("a", "b", "c", "d"):  # used at 0, 10, 20, 30: a, b, c go to the host
        cache.get(key, loaders(key))
        clock.now += 10.0
    available = [100 * GIB]
    changes: list[int] = []
    ager = HostPoolAger(cache, ttl_s=60.0, pressure_share=0.1, sharers=1,
                        memory=lambda: (available[0], 100 * GIB),
                        on_change=lambda: changes.append(1))
    # Nothing stale, plenty of memory: nothing happens
    assert ager.tick() == () and changes == []
    # a used again at 40 (d trades places with it); at 85 b and c are unused for over
    # 60 s, d not yet
    cache.get("a", loaders("a"))
    assert cache.warm() == {"a": "device", "b": "host", "c": "host", "d": "host"}
    clock.now = 85.0
    assert ager.tick() == ("b", "c")
    assert cache.warm() == {"a": "device", "d": "host"}
    # Under pressure (150 bytes short of 10%): the host tier gives back what it holds
    available[0] = 10 * GIB - 150
    assert ager.tick() == ("d",)
    assert cache.state.host_budget_bytes == 0 and cache.warm() == {"a": "device"}
    # Relieved: the full budget is back, and a demotion keeps its weights on the host again
    available[0] = 50 * GIB
    assert ager.tick() == ()
    assert cache.state.host_budget_bytes == 300
    cache.get("b", loaders("b"))
    assert cache.warm() == {"a": "host", "b": "device"}
    assert len(changes) == 3
    assert all(e.released for e in loaders.built if e.key in ("c", "d"))


def test_a_failing_pass_does_not_end_the_thread() -> None:
    cache = EngineCache(DEVICE, 100, 300, clock=Clock())
    calls: list[int] = []

    def memory() -> tuple[int, int]:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("no /proc/meminfo")
        ager.stop()
        return 100 * GIB, 100 * GIB

    ager = HostPoolAger(cache, 60.0, 0.1, 1, memory, lambda: None, period_s=0.01).start()
    ager._thread.join(timeout=10)
    assert not ager._thread.is_alive() and len(calls) == 2
