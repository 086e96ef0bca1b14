"""The pure two-tier warm-pool policy (MISSION §4.3)."""

from __future__ import annotations

import random

import pytest

from sits_queue.cache.policy import (
    DEFAULT_HALF_LIFE_S,
    MAX_USES,
    Action,
    Entry,
    IllegalAction,
    InvariantViolation,
    Plan,
    PoolState,
    Tier,
    activity_score,
    apply,
    check,
    mark_dirty,
    plan_admit,
    plan_expire,
    plan_resize,
    plan_shrink_host,
    plan_sync,
    victim_order,
)

HALF_LIFE_S = 100.0


def entry(key: str, size: int, tier: Tier, uses: tuple[float, ...] = (0.0,),
          dirty: bool = False) -> Entry:
    return Entry(key, size, tier, last_used_s=max(uses, default=0.0), uses=uses, dirty=dirty)


def state(device: int, host: int, *entries: Entry) -> PoolState:
    return PoolState(device, host, {e.key: e for e in entries})


def admit(s: PoolState, key: str, size: int, now: float) -> tuple[Plan, PoolState]:
    plan = plan_admit(s, key, size, now, HALF_LIFE_S)
    return plan, apply(s, plan, now)


# -- budgets and scores -----------------------------------------------------------------------

@pytest.mark.parametrize(("uses", "now", "score"), [
    ((), 50.0, 0.0),
    ((50.0,), 50.0, 1.0),
    ((0.0,), 100.0, 0.5),                 # one half-life ago
    ((0.0,), 200.0, 0.25),
    ((0.0,) * 8, 100.0, 4.0),             # eight uses a half-life ago weigh four fresh ones
    ((0.0, 100.0), 100.0, 1.5),
    ((150.0,), 100.0, 1.0),               # a stamp from the future counts as now
])
def test_activity_score(uses: tuple[float, ...], now: float, score: float) -> None:
    e = Entry("m", 1, "device", last_used_s=max(uses, default=0.0), uses=uses)
    assert activity_score(e, now, HALF_LIFE_S) == pytest.approx(score)


@pytest.mark.parametrize("half_life_s", [0.0, -1.0, float("nan")])
def test_activity_score_rejects_bad_half_life(half_life_s: float) -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        activity_score(entry("m", 1, "device"), 0.0, half_life_s)


def test_victim_order_breaks_score_ties_by_older_use_then_key() -> None:
    # Same score (no uses), different last_used_s, then same last_used_s.
    a = Entry("a", 1, "device", last_used_s=5.0)
    b = Entry("b", 1, "device", last_used_s=3.0)
    c = Entry("c", 1, "device", last_used_s=5.0)
    busy = entry("z", 1, "device", uses=(9.0, 9.0))
    assert [e.key for e in victim_order([busy, c, a, b], 10.0)] == ["b", "a", "c", "z"]


def test_uses_are_bounded() -> None:
    e = entry("m", 1, "device")
    for t in range(100):
        e = e.used_at(float(t))
    assert len(e.uses) == MAX_USES and e.uses[-1] == 99.0 and e.last_used_s == 99.0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"key": ""}, "non-empty"),
    ({"size_bytes": -1}, "size_bytes"),
    ({"tier": "disk"}, "tier"),
    ({"uses": (0.0,) * (MAX_USES + 1)}, "uses"),
])
def test_entry_rejects_nonsense(kwargs: dict[str, object], match: str) -> None:
    fields: dict[str, object] = {"key": "m", "size_bytes": 1, "tier": "device",
                                 "last_used_s": 0.0}
    with pytest.raises(ValueError, match=match):
        Entry(**{**fields, **kwargs})  # type: ignore[arg-type]


def test_state_is_a_snapshot_of_the_callers_dict() -> None:
    entries = {"a": entry("a", 1, "device")}
    s = PoolState(10, 10, entries)
    entries["b"] = entry("b", 1, "device")
    assert list(s.entries) == ["a"]


# -- admission --------------------------------------------------------------------------------

def test_first_admit_loads_and_second_is_a_hit() -> None:
    # Given an empty pool
    s = state(30, 70)
    # When an engine is admitted twice
    first, s = admit(s, "a", 10, now=1.0)
    second, s = admit(s, "a", 10, now=2.0)
    # Then the first call loads it (cold), the second finds it on the device
    assert first.actions == (("load", "a"),) and first.cold and not first.hit
    assert second.actions == () and second.hit and not second.cold
    assert s.entries["a"].tier == "device" and s.entries["a"].uses == (1.0, 2.0)


def test_eviction_follows_activity_not_plain_recency() -> None:
    # Given a full device: "busy" used 8 times until t=100, "once" used at t=150
    s = state(20, 70, entry("busy", 10, "device", uses=(93.0, 94, 95, 96, 97, 98, 99, 100)),
              entry("once", 10, "device", uses=(150.0,)))
    # When a new engine needs room at t=160 (plain LRU would pick "busy")
    plan = plan_admit(s, "new", 10, 160.0, HALF_LIFE_S)
    # Then the less active one is demoted
    assert plan.actions == (("demote", "once"), ("load", "new"))


def test_an_engine_whose_room_a_larger_victim_made_needless_stays() -> None:
    """(the probe's sequence on 3 MB tiers: big1, big2, big3, big1, big2, small, big3;
    big3 demoted "small", the engine just used, and big1, which alone was enough)"""
    # Given a device holding two large engines used twice and a small one used once
    s = state(30, 70, entry("big1", 12, "device", uses=(1.0, 4.0)),
              entry("big2", 12, "device", uses=(2.0, 5.0)),
              entry("small", 1, "device", uses=(6.0,)))
    # When a large engine needs 12 with 5 free: "small" is the coldest, too small alone
    plan = plan_admit(s, "big3", 12, 7.0, HALF_LIFE_S)
    # Then only the larger victim goes: the small one's room was not needed after all
    assert plan.actions == (("demote", "big1"), ("load", "big3"))


def test_every_victim_stays_needed_when_each_frees_part_of_the_room() -> None:
    s = state(30, 70, entry("a", 10, "device", uses=(1.0,)),
              entry("b", 10, "device", uses=(2.0,)), entry("c", 10, "device", uses=(3.0,)))
    plan = plan_admit(s, "new", 20, 4.0, HALF_LIFE_S)
    assert plan.actions == (("demote", "a"), ("demote", "b"), ("load", "new"))


def test_demotion_keeps_the_engine_in_host_memory() -> None:
    s = state(10, 70, entry("old", 10, "device"))
    _, s = admit(s, "new", 10, now=5.0)
    assert s.entries["old"].tier == "host" and s.entries["old"].size_bytes == 10
    assert (s.device_used, s.host_used) == (10, 10)


def test_promotion_from_host_skips_the_disk() -> None:
    # Given an engine demoted to the host earlier
    s = state(10, 70, entry("warm", 10, "host", uses=(1.0,)), entry("other", 10, "device"))
    # When it is needed again
    plan, s = admit(s, "warm", 999, now=5.0)
    # Then it is promoted (no load) at its recorded size, and the device user demoted
    assert plan.actions == (("demote", "other"), ("promote", "warm"))
    assert not plan.cold and plan.size_bytes == 10
    assert s.entries["warm"].tier == "device" and s.entries["other"].tier == "host"


def test_demotion_evicts_colder_host_entries_to_make_room() -> None:
    s = state(10, 20, entry("dev", 10, "device", uses=(50.0,)),
              entry("h_cold", 10, "host", uses=(1.0,)), entry("h_warm", 10, "host", uses=(40.0,)))
    plan, s = admit(s, "new", 10, now=60.0)
    assert plan.actions == (("evict", "h_cold"), ("demote", "dev"), ("load", "new"))
    assert set(s.entries) == {"dev", "h_warm", "new"}


def test_victim_colder_than_every_host_entry_is_dropped_not_demoted() -> None:
    s = state(10, 10, entry("dev", 10, "device", uses=(1.0,)),
              entry("host_hot", 10, "host", uses=(50.0, 51.0)))
    plan = plan_admit(s, "new", 10, 60.0, HALF_LIFE_S)
    assert plan.actions == (("evict", "dev"), ("load", "new"))


def test_victim_too_big_for_the_host_pool_is_dropped() -> None:
    s = state(20, 5, entry("big", 20, "device"))
    plan = plan_admit(s, "new", 10, 1.0, HALF_LIFE_S)
    assert plan.actions == (("evict", "big"), ("load", "new"))


def test_promoted_engine_is_never_evicted_to_make_room_for_its_own_swap() -> None:
    # Host holds only the engine being promoted, and the device victim is bigger than
    # the room its promotion frees: the victim has nowhere to go.
    s = state(20, 10, entry("dev", 20, "device", uses=(9.0,)), entry("h", 10, "host", uses=(1.0,)))
    plan, s = admit(s, "h", 10, now=10.0)
    assert plan.actions == (("evict", "dev"), ("promote", "h"))
    assert set(s.entries) == {"h"}


def test_a_device_engine_trades_places_with_the_promoted_one() -> None:
    # Both tiers full: the victim goes into the room the promotion frees, not to disk
    s = state(10, 10, entry("dev", 10, "device", uses=(9.0,)), entry("h", 10, "host", uses=(1.0,)))
    plan, s = admit(s, "h", 10, now=10.0)
    assert plan.actions == (("demote", "dev"), ("promote", "h")) and plan.swap == "h"
    assert (s.entries["dev"].tier, s.entries["h"].tier) == ("host", "device")
    # The host held both for the moment between, never more than the promoted one's size
    with pytest.raises(InvariantViolation, match="host pool over budget by 1 bytes"):
        apply(state(10, 9, entry("dev", 10, "device"), entry("h", 10, "host")),
              Plan(actions=(("demote", "dev"), ("promote", "h")), key="h", swap="h",
                   size_bytes=10), 10.0)


def test_a_working_set_that_fits_both_tiers_goes_to_disk_once_per_model() -> None:
    s, loads = state(30, 70), 0
    for i in range(12):  # A, B, C, A, B, ...: 90 bytes, the two tiers hold 100
        key = "ABC"[i % 3]
        plan, s = admit(s, key, 30, now=10.0 * i)
        loads += plan.cold
    assert loads == 3 and {e.tier for e in s.entries.values()} == {"device", "host"}


def test_a_swap_lends_no_room_after_its_promotion() -> None:
    s = state(10, 10, entry("dev", 10, "device"), entry("h", 10, "host"))
    # the demoted engine may overfill the host only while the promoted one is still there
    late = Plan(actions=(("promote", "h"), ("demote", "dev")), key="h", swap="h",
                size_bytes=10)
    with pytest.raises(InvariantViolation, match="device pool over budget"):
        apply(s, late, 1.0)
    lent = Plan(actions=(("demote", "dev"),), swap="h")
    over = apply(s, lent, 1.0)  # mid-swap, as the engine cache applies it action by action
    with pytest.raises(InvariantViolation, match="host pool over budget by 10"):
        check(over)


def test_dirty_entry_is_synced_before_it_is_dropped() -> None:
    s = state(10, 0, entry("kv", 10, "device", dirty=True))
    plan = plan_admit(s, "new", 10, 1.0, HALF_LIFE_S)
    assert plan.actions == (("sync", "kv"), ("evict", "kv"), ("load", "new"))


def test_demoted_dirty_entry_stays_dirty() -> None:
    s = state(10, 10, entry("kv", 10, "device", dirty=True))
    plan, s = admit(s, "new", 10, now=1.0)
    assert plan.actions == (("demote", "kv"), ("load", "new"))
    assert s.entries["kv"].dirty


def test_engine_larger_than_the_device_pool_is_refused_with_a_reason() -> None:
    s = state(30, 70, entry("a", 10, "device"))
    plan, after = admit(s, "huge", 31, now=1.0)
    assert not plan.fits and plan.actions == () and not plan.hit
    assert plan.reason is not None and "31 bytes" in plan.reason and "30" in plan.reason
    assert after == s


def test_engine_exactly_the_device_pool_fits() -> None:
    plan, s = admit(state(30, 70, entry("a", 10, "device")), "whole", 30, now=1.0)
    assert plan.fits and s.device_used == 30 and s.entries["a"].tier == "host"


def test_negative_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="size_bytes"):
        plan_admit(state(10, 10), "a", -1, 0.0)


# -- an engine's size known once it is on the device ---------------------------------------

def test_an_engine_that_grew_on_the_device_pushes_the_coldest_others_off() -> None:
    # Given a TensorRT-like engine admitted at its plan's 10 bytes next to two others
    s = state(30, 70, entry("cold", 10, "device", uses=(1.0,)),
              entry("hot", 5, "device", uses=(8.0, 9.0)), entry("trt", 10, "device"))
    # When it turns out to take 18 there (its execution context's activation memory)
    plan = plan_resize(s, "trt", 18, 10.0, HALF_LIFE_S)
    after = apply(s, plan, 10.0)
    # Then the coldest other engine makes room (to the host), never the engine itself
    assert plan.actions == (("demote", "cold"), ("resize", "trt"))
    assert after.entries["trt"].size_bytes == 18 and after.entries["trt"].tier == "device"
    assert after.entries["hot"].tier == "device" and after.entries["cold"].tier == "host"
    # and the resize records no extra use (the admission did)
    assert after.entries["trt"].uses == s.entries["trt"].uses


def test_an_engine_that_grew_within_the_free_room_moves_nothing() -> None:
    s = state(30, 70, entry("a", 10, "device"), entry("trt", 10, "device"))
    plan = plan_resize(s, "trt", 20, 5.0, HALF_LIFE_S)
    assert plan.actions == (("resize", "trt"),)
    assert apply(s, plan, 5.0).device_used == 30


def test_an_engine_that_shrank_frees_its_room() -> None:
    s = state(30, 70, entry("trt", 20, "device"))
    assert apply(s, plan_resize(s, "trt", 12, 5.0, HALF_LIFE_S), 5.0).free("device") == 18


def test_an_engine_that_grew_past_the_device_pool_is_refused_with_a_reason() -> None:
    s = state(30, 70, entry("a", 10, "device"), entry("trt", 10, "device"))
    plan = plan_resize(s, "trt", 31, 5.0, HALF_LIFE_S)
    assert not plan.fits and plan.actions == ()
    assert plan.reason is not None and "31 bytes" in plan.reason and "30" in plan.reason
    assert apply(s, plan, 5.0) == s


@pytest.mark.parametrize("key", ["absent", "on_host"])
def test_only_a_device_entry_can_be_resized(key: str) -> None:
    s = state(30, 70, entry("on_host", 10, "host"))
    with pytest.raises(IllegalAction, match=f"cannot resize {key!r}"):
        plan_resize(s, key, 5, 1.0)


def test_a_negative_resize_is_rejected() -> None:
    with pytest.raises(ValueError, match="size_bytes"):
        plan_resize(state(30, 70, entry("d", 1, "device")), "d", -1, 1.0)


# -- aging out of the host pool ---------------------------------------------------------------

def test_expiry_drops_only_stale_host_entries() -> None:
    s = state(10, 100, entry("dev_old", 10, "device", uses=(0.0,)),
              entry("stale", 10, "host", uses=(0.0,)),
              entry("stale_dirty", 10, "host", uses=(5.0,), dirty=True),
              entry("fresh", 10, "host", uses=(900.0,)))
    plan = plan_expire(s, now_s=1000.0, host_ttl_s=600.0)
    assert plan.actions == (("evict", "stale"), ("sync", "stale_dirty"), ("evict", "stale_dirty"))
    after = apply(s, plan, 1000.0)
    assert set(after.entries) == {"dev_old", "fresh"}


def test_expiry_at_exactly_the_ttl_keeps_the_entry() -> None:
    s = state(10, 100, entry("edge", 10, "host", uses=(400.0,)))
    assert plan_expire(s, now_s=1000.0, host_ttl_s=600.0).actions == ()


def test_expiry_rejects_bad_ttl() -> None:
    with pytest.raises(ValueError, match="host_ttl_s"):
        plan_expire(state(1, 1), 0.0, 0.0)


def test_shrink_drops_coldest_host_entries_until_the_new_budget_holds() -> None:
    s = state(10, 100, entry("cold", 30, "host", uses=(1.0,)),
              entry("warm", 30, "host", uses=(50.0,)), entry("hot", 30, "host", uses=(99.0, 99.0)))
    plan = plan_shrink_host(s, 50, now_s=100.0)
    assert plan.actions == (("evict", "cold"), ("evict", "warm"))
    after = apply(s, plan, 100.0)
    assert after.host_budget_bytes == 50 and set(after.entries) == {"hot"}


def test_growing_the_host_pool_drops_nothing() -> None:
    s = state(10, 100, entry("a", 30, "host"))
    after = apply(s, plan_shrink_host(s, 500, now_s=1.0), 1.0)
    assert after.host_budget_bytes == 500 and set(after.entries) == {"a"}


def test_shrink_rejects_negative_budget() -> None:
    with pytest.raises(ValueError, match="new_budget_bytes"):
        plan_shrink_host(state(1, 1), -1, 0.0)


# -- dirty batches ----------------------------------------------------------------------------

def test_sync_batches_least_recently_used_dirty_entries_first() -> None:
    s = state(100, 100, entry("a", 1, "device", uses=(3.0,)), entry("b", 1, "host", uses=(1.0,)),
              entry("c", 1, "device", uses=(2.0,)))
    s = mark_dirty(mark_dirty(mark_dirty(s, "a"), "b"), "c")
    plan = plan_sync(s, max_batch=2)
    assert plan.actions == (("sync", "b"), ("sync", "c"))
    after = apply(s, plan, 4.0)
    assert [k for k, e in after.entries.items() if e.dirty] == ["a"]
    with pytest.raises(ValueError, match="max_batch"):
        plan_sync(s, 0)
    with pytest.raises(IllegalAction):
        mark_dirty(s, "absent")


# -- apply and check --------------------------------------------------------------------------

@pytest.mark.parametrize("action", [
    ("promote", "absent"), ("promote", "on_device"), ("demote", "on_host"),
    ("evict", "absent"), ("sync", "absent"), ("load", "on_host"),
])
def test_illegal_actions_raise(action: Action) -> None:
    s = state(100, 100, entry("on_device", 1, "device"), entry("on_host", 1, "host"))
    with pytest.raises(IllegalAction):
        apply(s, Plan(actions=(action,)), 1.0)


def test_a_plan_that_overfills_a_tier_midway_is_caught() -> None:
    # Loading before demoting would hold 20 bytes on a 10-byte device for a moment.
    s = state(10, 10, entry("old", 10, "device"))
    bad = Plan(actions=(("load", "new"), ("demote", "old")), key="new", size_bytes=10)
    with pytest.raises(InvariantViolation, match="device pool over budget"):
        apply(s, bad, 1.0)


def test_check_catches_over_budget_and_misfiled_entries() -> None:
    with pytest.raises(InvariantViolation, match="host pool over budget by 5"):
        check(state(10, 10, entry("a", 15, "host")))
    with pytest.raises(InvariantViolation, match="stored under key"):
        check(PoolState(10, 10, {"x": entry("a", 1, "device")}))


# -- property: budgets hold over random streams -----------------------------------------------

def replay_budgets_hold(s: PoolState, plan: Plan) -> None:
    """An oracle independent of ``check``: walk the actions on plain dicts."""
    tiers = {k: e.tier for k, e in s.entries.items()}
    sizes = {k: e.size_bytes for k, e in s.entries.items()}
    for kind, key in plan.actions:
        if kind == "load":
            tiers[key], sizes[key] = "device", plan.size_bytes
        elif kind == "evict":
            del tiers[key]
        elif kind in ("demote", "promote"):
            tiers[key] = "host" if kind == "demote" else "device"
        elif kind == "resize":
            sizes[key] = plan.size_bytes
        # a swap's promoted engine lends its host room until it leaves
        lent = sizes[plan.swap] if plan.swap is not None and tiers.get(plan.swap) == "host" else 0
        for tier, budget in (("device", s.device_budget_bytes),
                             ("host", s.host_budget_bytes + lent)):
            assert sum(sizes[k] for k, t in tiers.items() if t == tier) <= budget
    used_host = sum(sizes[k] for k, t in tiers.items() if t == "host")
    assert used_host <= s.host_budget_bytes  # and none after the plan


def random_step(s: PoolState, rng: random.Random, now: float,
                sizes: dict[str, int]) -> PoolState:
    roll = rng.random()
    if roll < 0.05:
        return apply(s, plan_expire(s, now, host_ttl_s=rng.uniform(50, 500)), now)
    if roll < 0.10:
        plan = plan_shrink_host(s, rng.randrange(0, 200), now, HALF_LIFE_S)
        return apply(s, plan, now)
    if roll < 0.15 and s.entries:
        return mark_dirty(s, rng.choice(sorted(s.entries)))
    if roll < 0.20 and s.on("device"):  # it took other than its admitted size there
        key, size = rng.choice(sorted(e.key for e in s.on("device"))), rng.randrange(1, 60)
        plan = plan_resize(s, key, size, now, HALF_LIFE_S)
        replay_budgets_hold(s, plan)
        after = apply(s, plan, now)
        if plan.fits:
            sizes[key] = size
            assert after.entries[key].tier == "device"
        else:
            assert size > s.device_budget_bytes and after == s
        return after
    key = f"m{min(int(rng.expovariate(0.3)), 11)}"  # skewed popularity, 12 models
    plan = plan_admit(s, key, sizes[key], now, HALF_LIFE_S)
    replay_budgets_hold(s, plan)
    after = apply(s, plan, now)
    if plan.fits:
        assert after.entries[key].tier == "device" and after.entries[key].last_used_s == now
    else:
        assert sizes[key] > s.device_budget_bytes and after == s
    assert plan.cold == (key not in s.entries and plan.fits)
    return after


@pytest.mark.parametrize("seed", range(25))
def test_budgets_are_never_exceeded_over_a_random_stream(seed: int) -> None:
    rng = random.Random(seed)
    sizes = {f"m{i}": rng.randrange(1, 60) for i in range(12)}
    s = state(rng.randrange(20, 120), rng.randrange(0, 200))
    now = 0.0
    for _ in range(400):
        now += rng.expovariate(1 / 10)
        s = random_step(s, rng, now, sizes)
        check(s)
        assert s.device_used <= s.device_budget_bytes and s.host_used <= s.host_budget_bytes
        assert all(e.size_bytes == sizes[k] for k, e in s.entries.items())


def test_default_half_life_is_minutes() -> None:
    assert 60.0 <= DEFAULT_HALF_LIFE_S <= 3600.0
