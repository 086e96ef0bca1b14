"""The affinity pick policy (pure): what a worker takes from near a queue's head."""

from __future__ import annotations

import math

import pytest

from sits_queue.broker import affinity
from sits_queue.broker.affinity import (
    AffinityPolicy,
    Candidate,
    Warm,
    choose,
    lua_args,
    min_level,
)
from sits_queue.broker.keys import priority_level
from sits_queue.config import SitsConfig
from sits_queue.errors import ConfigError

NOW = 1_000.0
POLICY = AffinityPolicy(window=4, priority_ratio=2.0, max_skip_s=1.0, host_weight=0.5)


def cand(i: str, priority: float, model: str | None, skipped_s: float | None = None,
         held: bool = False) -> Candidate:
    """A waiting task; ``skipped_s``: how long ago a pick first passed it over."""
    since = None if skipped_s is None else NOW - skipped_s
    return Candidate(i, priority_level(priority), model, since, held)


@pytest.mark.parametrize(("queue", "warm", "expected"), [
    # nothing warm, or affinity has nothing to add: the head
    ([cand("a", 100, "x"), cand("b", 100, "y")], {}, 0),
    ([cand("a", 100, "x"), cand("b", 100, "y")], {"x": 1.0, "y": 1.0}, 0),
    # the warm one just behind the head
    ([cand("a", 100, "x"), cand("b", 100, "y")], {"y": 1.0}, 1),
    # the first of equally warm ones
    ([cand("a", 100, "x"), cand("b", 90, "y"), cand("c", 80, "y")], {"y": 1.0}, 1),
    # on the device beats in the host tier, even further back
    ([cand("a", 100, "x"), cand("b", 90, "y"), cand("c", 80, "z")],
     {"y": 0.5, "z": 1.0}, 2),
    # the head in the host tier, a device-warm one behind it
    ([cand("a", 100, "x"), cand("b", 90, "y")], {"x": 0.5, "y": 1.0}, 1),
    ([cand("a", 100, "x"), cand("b", 90, "y")], {"x": 1.0, "y": 1.0}, 0),
    # beyond the priority ratio (a lower class): never ahead of the head
    ([cand("a", 100, "x"), cand("b", 49, "y")], {"y": 1.0}, 0),
    ([cand("a", 100, "x"), cand("b", 51, "y")], {"y": 1.0}, 1),
    # beyond the window
    ([cand("a", 100, "x"), cand("b", 100, "q"), cand("c", 100, "q"), cand("d", 100, "q"),
      cand("e", 100, "y")], {"y": 1.0}, 0),
    # the head was passed over for max_skip_s: it goes first
    ([cand("a", 100, "x", skipped_s=1.0), cand("b", 100, "y")], {"y": 1.0}, 0),
    ([cand("a", 100, "x", skipped_s=0.99), cand("b", 100, "y")], {"y": 1.0}, 1),
    # only the head's skips count
    ([cand("a", 100, "x"), cand("b", 100, "y", skipped_s=9.0)], {"y": 1.0}, 1),
    # held by this consumer: not taken, the next warm one is
    ([cand("a", 100, "x"), cand("b", 100, "y", held=True), cand("c", 100, "y")],
     {"y": 1.0}, 2),
    ([cand("a", 100, "x", held=True), cand("b", 100, "y")], {"y": 1.0}, 0),
    # a task with no model is never warm
    ([cand("a", 100, None), cand("b", 100, None)], {"y": 1.0}, 0),
])
def test_choose(queue: list[Candidate], warm: dict[str, float], expected: int) -> None:
    assert choose(queue, Warm(warm), POLICY, NOW) == expected


def pcand(i: str, model: str, prefix: str | None) -> Candidate:
    return Candidate(i, priority_level(100), model, None, False, prefix)


@pytest.mark.parametrize(("queue", "warm", "expected"), [
    # the same model warm everywhere: the held prefix decides
    ([pcand("a", "x", "p1"), pcand("b", "x", "p2")], Warm({"x": 1.0}, {"p2": 0.5}), 1),
    ([pcand("a", "x", "p2"), pcand("b", "x", "p2")], Warm({"x": 1.0}, {"p2": 0.5}), 0),
    # model on the device + prefix beats a model alone, further back
    ([pcand("a", "y", None), pcand("b", "x", None), pcand("c", "x", "p2")],
     Warm({"x": 1.0}, {"p2": 0.5}), 2),
    # a prefix alone (its model's engine just demoted to the host tier) still counts
    ([pcand("a", "y", None), pcand("b", "x", "p2")], Warm({"x": 0.5}, {"p2": 0.5}), 1),
    # a task with no prefix key gets no prefix weight
    ([pcand("a", "x", None), pcand("b", "x", None)], Warm({"x": 1.0}, {"p2": 0.5}), 0),
])
def test_choose_with_prefixes(queue: list[Candidate], warm: Warm, expected: int) -> None:
    assert choose(queue, warm, POLICY, NOW) == expected


def test_warm_keeps_positive_weights_and_knows_its_top() -> None:
    warm = Warm({"x": 1.0, "y": 0.0}, {"p": 0.5, "q": 0.0})
    assert warm.models == {"x": 1.0} and warm.prefixes == {"p": 0.5}
    assert warm.top == 1.5 and warm.weight("x", "p") == 1.5
    # a prompt prefix's KV serves the engine that holds it: nothing for a model not warm
    # here (a template shared by several models pulled tasks to a cold start)
    assert warm.weight(None, "p") == 0.0 and warm.weight("y", "p") == 0.0
    assert not Warm() and not Warm({"x": 0.0}) and Warm({}, {"p": 0.1})


def test_warm_of_children_records() -> None:
    children = [{"warm": {"x": "host"}, "kv_keys": ["k1"]},
                {"warm": {"x": "device", "y": "host"}, "kv_keys": ["k2", "k1"]},
                {"warm": "garbage", "kv_keys": "garbage"}, "not a record"]
    warm = affinity.warm_of(children, POLICY)  # type: ignore[arg-type]
    assert warm == Warm({"x": 1.0, "y": 0.5}, {"k1": 0.5, "k2": 0.5})


def test_off_below_a_window_of_two() -> None:
    queue = [cand("a", 100, "x"), cand("b", 100, "y")]
    assert choose(queue, Warm({"y": 1.0}), AffinityPolicy(window=1), NOW) == 0
    assert lua_args(AffinityPolicy(window=0), Warm({"y": 1.0})) == []


@pytest.mark.parametrize("head", [1.0, 37.7, 5_000.0, 2e6])
@pytest.mark.parametrize("ratio", [1.0, 2.0, 10.0])
def test_min_level_is_the_heads_priority_over_the_ratio(head: float, ratio: float) -> None:
    floor = min_level(priority_level(head), ratio)
    assert math.isclose(floor, math.log1p(head / ratio) * (1 << 17), rel_tol=1e-4)
    assert priority_level(head / ratio * 1.001) >= floor
    assert priority_level(head / ratio * 0.999) < floor


def test_warm_weights_take_the_best_child_and_ignore_unknown_tiers() -> None:
    weights = affinity.warm_weights(
        [{"x": "host", "y": "device"}, {"x": "device", "z": "host"}, {"w": "elsewhere"}],
        host_weight=0.25)
    assert weights == {"x": 1.0, "y": 1.0, "z": 0.25}


def test_lua_args_list_positive_weights_after_the_policy() -> None:
    args = lua_args(POLICY, Warm({"b": 0.5, "a": 1.0, "c": 0.0}, {"k": 0.5}))
    assert args == [4, "2.0", "1.0", "m:a", "1.0", "m:b", "0.5", "p:k", "0.5"]
    assert lua_args(POLICY, Warm({"c": 0.0})) == []  # only zero weights: nothing to prefer


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"window": -1}, "affinity_window"), ({"window": 2.5}, "affinity_window"),
    ({"window": True}, "affinity_window"), ({"priority_ratio": 0.9}, "priority_ratio"),
    ({"priority_ratio": math.inf}, "priority_ratio"), ({"max_skip_s": -1}, "max_skip_s"),
    ({"host_weight": 1.5}, "host_weight"), ({"host_weight": math.nan}, "host_weight"),
    ({"prefix_weight": -0.1}, "prefix_weight"), ({"prefix_weight": 11}, "prefix_weight"),
])
def test_policy_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AffinityPolicy(**kwargs)  # type: ignore[arg-type]


def test_config_builds_the_policy_and_names_bad_settings() -> None:
    config = SitsConfig.from_env({"SITS_AFFINITY_WINDOW": "8",
                                  "SITS_AFFINITY_MAX_SKIP_MS": "250"})
    assert config.affinity == AffinityPolicy(window=8, priority_ratio=2.0, max_skip_s=0.25,
                                             host_weight=0.5, prefix_weight=0.5)
    with pytest.raises(ConfigError, match="affinity_max_skip_ms"):
        SitsConfig(affinity_max_skip_ms=-5.0)
    with pytest.raises(ConfigError, match="affinity_priority_ratio"):
        SitsConfig.from_env({"SITS_AFFINITY_PRIORITY_RATIO": "0.5"})
    with pytest.raises(ConfigError, match="SITS_AFFINITY_WINDOW"):
        SitsConfig.from_env({"SITS_AFFINITY_WINDOW": "many"})


def test_warm_source_registry() -> None:
    calls: list[str] = []

    class Source:
        def __call__(self) -> Warm:
            calls.append("read")
            return Warm({"x": 1.0})

        def invalidate(self) -> None:
            calls.append("invalidate")

    try:
        assert affinity.warm_now() == Warm()
        affinity.invalidate()  # no source: nothing to do
        affinity.set_warm_source(Source())
        assert affinity.warm_now() == Warm({"x": 1.0})
        affinity.invalidate()
        assert calls == ["read", "invalidate"]
    finally:
        affinity.set_warm_source(None)
    assert affinity.warm_now() == Warm()


def test_a_task_served_by_another_entry_counts_it_warm() -> None:
    """(an fp32 request of an fp32 checkpoint runs on the model as loaded, an int8 one on
    a GPU on its fp16 entry: matched against their own keys, never held, they had no
    affinity where they ran warm)"""
    children = [{"warm": {"gpt": "device", "lm@fp16": "host"},
                 "serves": {"gpt@fp32": "gpt", "lm@int8": "lm@fp16", "x@int8": "x@fp16",
                            7: "gpt"}}]
    warm = affinity.warm_of(children, POLICY)  # type: ignore[arg-type]
    assert warm.weight("gpt", None, "fp32") == 1.0 and warm.weight("gpt", None) == 1.0
    assert warm.weight("lm", None, "int8") == 0.5  # at its entry's tier
    assert warm.weight("x", None, "int8") == 0.0  # the entry it names is not held
