"""The batch size controller (§1.2) and the Pareto frontier (§2.4), pure."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

from sits_queue.config import SitsConfig
from sits_queue.errors import ConfigError
from sits_queue.workers import batching
from sits_queue.workers.batching import BatchPolicy, BatchState, Point, Sample

POLICY = BatchPolicy(target_p95_ms=120.0, window=64, start=8)


def test_recency_weights_are_the_sources_exp_linspace() -> None:
    w = batching.recency_weights(5)
    assert w[0] == pytest.approx(math.exp(-1)) and w[-1] == pytest.approx(1.0)
    assert all(a < b for a, b in itertools.pairwise(w))
    assert batching.recency_weights(1) == [1.0]
    # the newest sample counts most in the average
    assert 15.0 < batching.ewma_latency([Sample(8, 10.0), Sample(8, 20.0)]) < 20.0
    assert batching.ewma_latency([]) == 0.0


def latency(size: int) -> float:
    """A device whose items get slower past 64 per batch (the working set spills)."""
    return 4.0 + 0.5 * size + (0.01 * (size - 64) ** 2 if size > 64 else 0.0)


def run(policy: BatchPolicy, batches: int, device: Any = latency,
        free_bytes: int | None = None) -> list[int]:
    """The sizes the controller picks on a device of this latency curve."""
    state, sizes = BatchState(), []
    for _ in range(batches):
        size = batching.next_batch(state, free_bytes, policy)
        sizes.append(size)
        state = batching.observe(state, Sample(size, device(size), 100.0), policy)
    return sizes


def test_it_probes_upward_and_settles_on_the_fastest_size_under_the_target() -> None:
    sizes = run(POLICY, 30)
    # 8, then one probe per size while each meets the target; 128 (p95 108 ms) meets it
    # but is slower per item than 64 (0.5625 vs 0.5625 + spill): it settles on 64
    assert sizes[:6] == [8, 16, 32, 64, 128, 64]
    assert set(sizes[6:]) == {64}


def test_a_tighter_target_settles_lower_and_nothing_exceeds_it_after_probing() -> None:
    sizes = run(BatchPolicy(target_p95_ms=30.0), 20)
    assert sizes[-1] == 32  # 4 + 16 = 20 ms; 64 takes 36 ms
    assert all(latency(s) <= 30.0 for s in sizes[5:])


def test_it_steps_down_from_a_start_that_is_too_slow() -> None:
    sizes = run(BatchPolicy(target_p95_ms=8.0, start=64), 8)
    assert sizes[:4] == [64, 32, 16, 8] and set(sizes[3:]) == {8}  # 4 + 4 = 8 ms: fits
    # one item takes 4.5 ms: a 1 ms target cannot be met, and it keeps within 1.5x that
    hopeless = run(BatchPolicy(target_p95_ms=1.0), 12)
    assert hopeless[:4] == [8, 4, 2, 1] and hopeless[-1] == 4  # 6 ms; 8 takes 8 ms


def test_a_target_one_item_misses_keeps_batches_within_relax_of_one_item() -> None:
    """An encoder whose one item takes 150 ms (a target no size meets) ran one item a
    batch for good: 6.6 items/s where 16 give 88."""
    def encoder(size: int) -> float:
        return 150.0 + 2.0 * size

    sizes = run(POLICY, 40, encoder)
    assert sizes[:4] == [8, 4, 2, 1]
    assert set(sizes[5:]) == {16}  # 182 ms <= 1.5 x 152; 32 would take 214
    assert all(encoder(n) <= batching.RELAX * encoder(1) for n in sizes[4:])


def test_the_floor_is_measured_again_and_a_reachable_target_met_again() -> None:
    slow = {"on": True}

    def device(size: int) -> float:
        return (150.0 if slow["on"] else 40.0) + 2.0 * size

    state = BatchState()
    for _ in range(20):
        state = batching.observe(state, Sample(n := batching.next_batch(state, None, POLICY),
                                               device(n)), POLICY)
    assert state.floor_ms == 152.0 and batching.next_batch(state, None, POLICY) == 16
    slow["on"] = False  # now one item takes 42 ms: the target can be met
    sizes = []
    for _ in range(batching.FLOOR_TTL_BATCHES + 40):
        sizes.append(n := batching.next_batch(state, None, POLICY))
        state = batching.observe(state, Sample(n, device(n)), POLICY)
    assert state.floor_ms is None and device(sizes[-1]) <= POLICY.target_p95_ms
    assert sizes[-1] == 32  # 104 ms; 64 takes 168


def test_memory_caps_the_choice() -> None:
    # 100 bytes per item, 3,000 free: at most 30 items
    sizes = run(POLICY, 12, free_bytes=3_000)
    assert max(sizes[1:]) <= 30 and sizes[-1] == 16
    reserved = BatchPolicy(reserved_bytes=2_000)
    assert batching.memory_cap([Sample(4, 1.0, 100.0)], 3_000, reserved) == 10
    assert batching.memory_cap([Sample(4, 1.0, 0.0)], 3_000, reserved) == batching.MAX_BATCH


def test_it_re_probes_once_a_slow_spell_leaves_the_window() -> None:
    slow = {"on": True}

    def device(size: int) -> float:
        return latency(size) * (6.0 if slow["on"] else 1.0)

    policy = BatchPolicy(window=8)
    state = BatchState()
    for _ in range(10):  # under a 6x slowdown it settles lower (32: 120 ms)
        state = batching.observe(state, Sample(n := batching.next_batch(state, None, policy),
                                               device(n)), policy)
    assert batching.next_batch(state, None, policy) == 32
    slow["on"] = False
    sizes = []
    for _ in range(20):
        n = batching.next_batch(state, None, policy)
        sizes.append(n)
        state = batching.observe(state, Sample(n, device(n)), policy)
    assert sizes[-1] == 64


def test_size_stats_bucket_and_weigh() -> None:
    stats = batching.size_stats([Sample(8, 10.0), Sample(8, 30.0), Sample(12, 40.0)])
    assert set(stats) == {8} and stats[8].n == 3 and stats[8].p95_ms == 40.0
    assert batching.size_stats([]) == {}


def test_batcher_shell() -> None:
    b = batching.Batcher(POLICY)
    assert b.size(None) == 8
    b.record(Sample(8, 10.0))
    assert b.size(None) == 16 and b.state.samples == (Sample(8, 10.0),)


@pytest.mark.parametrize("kwargs", [{"target_p95_ms": 0}, {"window": 1}, {"start": 0},
                                    {"start": 12}, {"reserved_bytes": -1}])
def test_policy_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        BatchPolicy(**kwargs)


def test_config_target() -> None:
    assert SitsConfig().batch_target_p95_ms == 120.0
    with pytest.raises(ConfigError, match="batch_target_p95_ms"):
        SitsConfig(batch_target_p95_ms=0)


def test_pareto_marks_the_points_nothing_beats_on_both() -> None:
    # the source's three cluster figures are all on the frontier
    points = batching.pareto([Point(1, 1.2e3, 8.3), Point(32, 28.7e3, 42.1),
                              Point(128, 41.5e3, 107.6)])
    assert all(p.pareto for p in points)
    marked = batching.pareto([Point(1, 100.0, 10.0), Point(2, 90.0, 12.0),
                              Point(4, 200.0, 10.0), Point(8, 200.0, 10.0)])
    assert [p.pareto for p in marked] == [False, False, True, True]  # ties both stay
