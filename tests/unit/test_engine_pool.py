"""The runtime two-tier engine cache (MISSION §4.1, §4.3) over fake engines: no torch."""

from __future__ import annotations

import functools
import json
import pickle
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from sits_queue.cache.contract import Engine, EngineReleased
from sits_queue.cache.pool import (
    ColdStart,
    EngineCache,
    EngineInUse,
    EngineTooLarge,
    ModelLoadError,
)
from sits_queue.errors import SitsError

DEVICE = "cpu"
CTX_MS = 150.0


class FakeEngine(Engine):
    """Counts every primitive; ``fail`` names one to raise from."""

    backend = "torch"

    def __init__(self, key: str, size: int, fail: str | None = None) -> None:
        super().__init__(key, sample_inputs=(1,), artifacts={"tokenizer": "tok"})
        self.size = size
        self.fail = fail
        self.calls: dict[str, int] = dict.fromkeys(("promote", "demote", "run", "release"), 0)
        #: Stands for the weights: kept across demotion, dropped only by release.
        self.weights: list[int] | None = list(range(4))

    def size_bytes(self) -> int:
        return self.size

    def _count(self, name: str) -> None:
        self.calls[name] += 1
        if self.fail == name:
            raise RuntimeError(f"{name} broke")

    def _promote(self, device: str) -> None:
        assert self.weights is not None, "promotion must start from host weights"
        self._count("promote")

    def _demote(self) -> None:
        self._count("demote")

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._count("run")
        return sum(args)

    def _release(self) -> None:
        self.weights = None
        self._count("release")


class RewarmingEngine(FakeEngine):
    rewarm_on_promote = True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class Loaders:
    """Builds fake engines on demand and remembers every one, with per-key load counts."""

    def __init__(self, sizes: dict[str, int], cls: type[FakeEngine] = FakeEngine) -> None:
        self.sizes = sizes
        self.cls = cls
        self.loads: dict[str, int] = dict.fromkeys(sizes, 0)
        self.built: list[FakeEngine] = []

    @staticmethod
    def merged(*many: Loaders) -> Loaders:
        """One view of several loaders' engines (for :func:`assert_consistent`)."""
        out = Loaders({})
        out.built = [e for loaders in many for e in loaders.built]
        return out

    def __call__(self, key: str, fail: str | None = None) -> Callable[[], Engine]:
        def load() -> Engine:
            self.loads[key] += 1
            engine = self.cls(key, self.sizes[key], fail)
            self.built.append(engine)
            return engine
        return load


def make_cache(device_budget: int = 200, host_budget: int = 300, **kwargs: Any
               ) -> tuple[EngineCache, list[int]]:
    ctx_calls: list[int] = []

    def context() -> float:
        ctx_calls.append(1)
        return CTX_MS

    cache = EngineCache(DEVICE, device_budget, host_budget, context=context, clock=Clock(),
                        half_life_s=50.0, **kwargs)
    return cache, ctx_calls


def assert_consistent(cache: EngineCache, loaders: Loaders) -> None:
    """Budgets hold, and the cache's view of each engine matches the engine itself."""
    s = cache.state
    assert s.device_used <= s.device_budget_bytes
    assert s.host_used <= s.host_budget_bytes
    warm = cache.warm()
    live = {e.key: e for e in loaders.built if not e.released}
    assert set(live) == set(warm), "an engine is live outside the cache, or released inside it"
    for key, tier in warm.items():
        assert live[key].tier == tier
    on_device = sum(e.size for e in live.values() if e.tier == "device")
    assert on_device <= s.device_budget_bytes


# -- the three paths --------------------------------------------------------------------------

def test_disk_then_device_hit() -> None:
    cache, ctx = make_cache()
    loaders = Loaders({"a": 100})

    engine, first = cache.get("a", loaders("a"))
    assert (first.cold, first.source) == (True, "disk")
    assert first.cuda_ctx_ms == CTX_MS and first.load_ms >= 0 and first.warmup_ms > 0
    assert first.total_ms == pytest.approx(first.cuda_ctx_ms + first.load_ms +
                                           first.promote_ms + first.warmup_ms)
    assert engine.tier == "device" and engine.artifacts == {"tokenizer": "tok"}
    assert engine(2, 3) == 5

    again, second = cache.get("a", loaders("a"))
    assert again is engine
    assert second == ColdStart(cold=False, source="device")
    assert second.total_ms == 0.0
    assert loaders.loads["a"] == 1 and ctx == [1]  # context created once per process
    assert_consistent(cache, loaders)


def test_demoted_engine_is_promoted_from_host_without_the_loader() -> None:
    # Given a device pool for two engines, holding a (older) and b
    cache, _ = make_cache(device_budget=200, host_budget=300)
    loaders = Loaders({"a": 100, "b": 100, "c": 100})
    a, _ = cache.get("a", loaders("a"))
    cache.get("b", loaders("b"))

    # When c arrives, the coldest (a) is demoted, not dropped
    _, cold_c = cache.get("c", loaders("c"))
    assert cold_c.demoted == ("a",) and cold_c.evicted == ()
    assert cache.warm() == {"a": "host", "b": "device", "c": "device"}
    assert cache.warm_bytes() == {"a": 100, "b": 100, "c": 100}
    assert isinstance(a, FakeEngine) and a.weights is not None and not a.released

    # Then getting a again promotes it from host memory: no loader call, no warm-up
    again, cold_a = cache.get("a", loaders("a"))
    assert again is a
    assert (cold_a.cold, cold_a.source, cold_a.load_ms, cold_a.warmup_ms) == (
        True, "host", 0.0, 0.0)
    assert loaders.loads["a"] == 1
    assert a.calls["promote"] == 2 and a.calls["demote"] == 1
    assert cold_a.demoted == ("b",)
    assert_consistent(cache, loaders)


def test_rewarming_engine_warms_again_after_promotion() -> None:
    cache, _ = make_cache(device_budget=100, host_budget=100)
    loaders = Loaders({"a": 100, "b": 100}, cls=RewarmingEngine)
    cache.get("a", loaders("a"))
    cache.get("b", loaders("b"))
    engine, cold = cache.get("a", loaders("a"))
    assert cold.source == "host" and cold.warmup_ms > 0
    assert isinstance(engine, FakeEngine) and engine.calls["run"] == 2  # disk + promotion


def test_engine_without_sample_input_loads_without_warmup() -> None:
    cache, _ = make_cache()
    bare = FakeEngine("a", 10)
    bare._sample = None  # as built from a bare module with no sample input
    engine, cold = cache.get("a", lambda: bare)
    assert engine is bare and cold.source == "disk" and cold.warmup_ms == 0.0
    assert bare.calls["run"] == 0


def test_full_host_pool_evicts_and_reloads_from_disk() -> None:
    cache, _ = make_cache(device_budget=100, host_budget=100)
    loaders = Loaders({"a": 100, "b": 100, "c": 100})
    a, _ = cache.get("a", loaders("a"))
    cache.get("b", loaders("b"))          # a demoted to host
    _, cold = cache.get("c", loaders("c"))  # b demoted; a, colder, evicted to make room
    assert cold.evicted == ("a",) and cold.demoted == ("b",)
    assert a.released and isinstance(a, FakeEngine) and a.weights is None
    _, back = cache.get("a", loaders("a"))
    assert back.source == "disk" and loaders.loads["a"] == 2
    assert_consistent(cache, loaders)


@pytest.mark.parametrize("seed", range(5))
def test_budgets_hold_under_a_random_stream(seed: int) -> None:
    rng = random.Random(seed)
    sizes = {f"m{i}": rng.randint(10, 120) for i in range(8)}
    cache, _ = make_cache(device_budget=150, host_budget=260)
    loaders = Loaders(sizes)
    for _ in range(200):
        key = rng.choice(sorted(sizes))
        engine, cold = cache.get(key, loaders(key))
        assert engine.key == key and engine.tier == "device"
        assert cold.cold == (cold.source != "device")
        assert_consistent(cache, loaders)
    stats = cache.stats()
    assert stats["gets"] == 200
    assert stats["loads"] == sum(loaders.loads.values())
    assert stats["hits_device"] + stats["hits_host"] + stats["loads"] == 200


# -- failures ---------------------------------------------------------------------------------

def test_an_engine_found_too_large_is_refused_again_without_loading_for_a_while() -> None:
    """(each task for it paid the whole load from disk, only to be refused)"""
    from sits_queue.cache.pool import TOO_LARGE_KEPT_S

    cache, _ = make_cache(device_budget=200)
    loaders = Loaders({"huge": 201})
    for _ in range(3):
        with pytest.raises(EngineTooLarge, match=r"'huge' needs 201 bytes.*holds 200: "
                           r"raise the budget \(SITS_DEVICE_CACHE_BYTES"):
            cache.get("huge", loaders("huge"))
    assert loaders.loads["huge"] == 1 and cache.stats()["too_large"] == 3
    # Looked at again once the refusal is old (the model on disk may have changed)
    cache._clock.now += TOO_LARGE_KEPT_S  # type: ignore[attr-defined]
    with pytest.raises(EngineTooLarge):
        cache.get("huge", loaders("huge"))
    assert loaders.loads["huge"] == 2
    assert_consistent(cache, loaders)


def test_engine_larger_than_the_device_pool_is_refused_and_released() -> None:
    cache, _ = make_cache(device_budget=200)
    loaders = Loaders({"a": 100, "huge": 201})
    cache.get("a", loaders("a"))
    with pytest.raises(EngineTooLarge, match=r"'huge' needs 201 bytes.*holds 200") as info:
        cache.get("huge", loaders("huge"))
    assert isinstance(info.value, SitsError)
    assert loaders.built[-1].released
    assert cache.warm() == {"a": "device"} and cache.stats()["too_large"] == 1
    assert_consistent(cache, loaders)


def test_loader_failure_is_a_model_load_error_and_the_cache_stays_usable() -> None:
    cache, _ = make_cache()
    loaders = Loaders({"a": 100})
    cache.get("a", loaders("a"))
    cause = OSError("no such file: weights.safetensors")

    def broken() -> Engine:
        raise cause

    with pytest.raises(ModelLoadError, match=r"'bad'.*OSError.*weights") as info:
        cache.get("bad", broken)
    assert isinstance(info.value, SitsError)
    assert info.value.key == "bad" and info.value.cause is cause
    assert info.value.__cause__ is cause
    assert "bad" not in cache and cache.stats()["load_failures"] == 1
    _, hit = cache.get("a", loaders("a"))
    assert hit.source == "device"
    assert_consistent(cache, loaders)


@pytest.mark.parametrize("fail", ["promote", "run"])
def test_promotion_or_warmup_failure_on_load_leaves_nothing_behind(fail: str) -> None:
    cache, _ = make_cache(device_budget=100)
    loaders = Loaders({"a": 100, "b": 100})
    cache.get("a", loaders("a"))
    with pytest.raises(ModelLoadError, match=f"{fail} broke"):
        cache.get("b", loaders("b", fail=fail))
    broken = loaders.built[-1]
    assert broken.released and "b" not in cache
    assert cache.warm() == {"a": "host"}  # the demotion that made room did happen
    assert_consistent(cache, loaders)
    _, again = cache.get("b", loaders("b"))
    assert again.source == "disk"


def test_a_failure_making_room_names_the_engine_that_failed() -> None:
    cache, _ = make_cache(device_budget=100, host_budget=100)
    loaders = Loaders({"a": 100, "b": 100})
    a, _ = cache.get("a", loaders("a"))
    assert isinstance(a, FakeEngine)
    a.fail = "demote"
    with pytest.raises(ModelLoadError, match="making room for it failed: demote of 'a': "
                                             "RuntimeError: demote broke") as info:
        cache.get("b", loaders("b"))
    assert info.value.key == "b"
    assert "a" not in cache and "b" not in cache and loaders.built[-1].released
    assert_consistent(cache, loaders)
    _, again = cache.get("b", loaders("b"))  # the cache serves on
    assert again.source == "disk"


def test_a_demotion_failing_half_way_through_a_swap_leaves_the_cache_consistent() -> None:
    """(the drop re-checked the host without the swap's lent room: InvariantViolation,
    the failed engine released but still cached, and every later get of it KeyError)"""
    # Given both tiers full: a on the host, b and c on the device
    cache, _ = make_cache(device_budget=100, host_budget=100)
    loaders = Loaders({"a": 100, "b": 50, "c": 50})
    cache.get("a", loaders("a"))
    cache.get("b", loaders("b"))
    c, _ = cache.get("c", loaders("c"))
    assert cache.warm() == {"a": "host", "b": "device", "c": "device"}
    assert isinstance(c, FakeEngine)
    c.fail = "demote"
    # When a's promotion demotes b into the room a frees, then c's demotion fails
    with pytest.raises(ModelLoadError, match="making room for it failed: demote of 'c'"):
        cache.get("a", loaders("a"))
    # Then c and a (whose lent room b holds) are gone, the budgets hold, and both load anew
    assert cache.warm() == {"b": "host"}
    assert_consistent(cache, loaders)
    _, again = cache.get("c", loaders("c"))
    assert again.source == "disk"
    _, again = cache.get("a", loaders("a"))
    assert again.source == "disk"
    assert_consistent(cache, loaders)


class Flaky(FakeEngine):
    """Fails each primitive at random, as a driver or an allocator might."""

    rng = random.Random(0)
    p = 0.0

    def _count(self, name: str) -> None:
        self.calls[name] += 1
        if name != "release" and self.rng.random() < self.p:
            raise RuntimeError(f"{name} broke")


@pytest.mark.parametrize("seed", range(200))
def test_budgets_and_engines_agree_under_random_failures(seed: int) -> None:
    rng = random.Random(seed)
    Flaky.rng, Flaky.p = rng, rng.choice([0.05, 0.2])
    sizes = {f"m{i}": rng.randint(5, 120) for i in range(8)}
    cache, _ = make_cache(device_budget=rng.randint(50, 200), host_budget=rng.randint(0, 300))
    loaders = Loaders(sizes, cls=Flaky)
    for _ in range(150):
        op = rng.random()
        try:
            if op < 0.85:
                key = rng.choice(sorted(sizes))
                engine, _ = cache.get(key, loaders(key))
                assert engine.tier == "device" and not engine.released
            elif op < 0.92:
                cache.expire(rng.random() * 300)
            elif op < 0.97:
                cache.shrink_host(rng.randint(0, 300))
            else:
                cache.drop(rng.choice(sorted(sizes)))
        except (ModelLoadError, EngineTooLarge, RuntimeError):
            pass
        assert_consistent(cache, loaders)


def test_failed_promotion_from_host_drops_the_engine() -> None:
    cache, _ = make_cache(device_budget=100, host_budget=100)
    loaders = Loaders({"a": 100, "b": 100})
    a, _ = cache.get("a", loaders("a"))
    cache.get("b", loaders("b"))
    assert isinstance(a, FakeEngine)
    a.fail = "promote"
    with pytest.raises(ModelLoadError, match="'a'"):
        cache.get("a", loaders("a"))
    assert a.released and "a" not in cache
    assert_consistent(cache, loaders)


def test_passthrough_errors_escape_unwrapped() -> None:
    class SoftTimeLimit(Exception):
        pass

    cache, _ = make_cache(passthrough=(SoftTimeLimit,))

    def slow() -> Engine:
        raise SoftTimeLimit()

    with pytest.raises(SoftTimeLimit):
        cache.get("a", slow)
    assert cache.stats()["load_failures"] == 0


def test_context_failure_propagates_and_is_retried() -> None:
    attempts: list[int] = []

    def context() -> float:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("CUDA driver not ready")
        return 5.0

    cache = EngineCache(DEVICE, 100, 100, context=context)
    loaders = Loaders({"a": 10})
    with pytest.raises(RuntimeError, match="driver"):
        cache.get("a", loaders("a"))
    _, cold = cache.get("a", loaders("a"))
    assert cold.cuda_ctx_ms == 5.0 and len(attempts) == 2


# -- loaders that hand back an engine the cache already had -------------------------------------

def test_a_memoised_loader_is_refused_by_name_once_its_engine_was_released() -> None:
    # Given a loader memoised with functools.cache, and room for one engine, no host tier
    loaders = Loaders({"a": 100, "b": 100})
    load_a = functools.cache(loaders("a"))
    cache, _ = make_cache(device_budget=100, host_budget=0)
    a, _ = cache.get("a", load_a)
    cache.get("b", loaders("b"))  # a evicted: released
    assert a.released
    # When a is needed again, its loader hands back the engine the cache released: the
    # load fails saying why and what to do (it said "EngineReleased: engine 'a' was
    # released", and so on every load until the child restarted)
    with pytest.raises(ModelLoadError, match=r"'a'.*the loader returned an engine that "
                                             r"was already released.*new engine on every "
                                             r"call.*functools\.cache") as info:
        cache.get("a", load_a)
    assert info.value.key == "a" and "a" not in cache
    assert cache.stats()["load_failures"] == 1
    # Then a loader that builds a new engine serves it again
    again, cold = cache.get("a", loaders("a"))
    assert cold.source == "disk" and again is not a and not again.released
    assert_consistent(cache, loaders)


def test_a_loader_returning_an_engine_the_cache_holds_is_refused() -> None:
    # Given one engine object handed out by two models' loaders
    cache, _ = make_cache()
    loaders = Loaders({"a": 100})
    load = loaders("a")
    shared = load()
    cache.get("a", lambda: shared)
    # When the second model is loaded, it is refused: dropping either would release the
    # other's engine (and the budgets would count its bytes twice)
    with pytest.raises(ModelLoadError, match=r"'b'.*an engine the cache already holds "
                                             r"as 'a'.*new engine on every call"):
        cache.get("b", lambda: shared)
    assert cache.warm() == {"a": "device"} and not shared.released
    assert_consistent(cache, loaders)


def test_a_loader_returning_a_global_model_is_refused_for_a_second_key() -> None:
    import torch

    from sits_queue.cache import precision
    from sits_queue.cache.engines import TorchEngine

    # Given a loader that returns a model kept in a global, wrapped anew each call
    model = torch.nn.Linear(4, 4)

    def load() -> TorchEngine:
        return TorchEngine("m", model, None)

    cache = EngineCache("cpu", 10**6, 10**6, context=lambda: 0.0)
    served, _ = cache.get("m", load)
    # When the model is asked for at fp32, which it is already (nothing to convert), the
    # conversion wraps the same module under "m@fp32": the two would move as one, so
    # demoting either took the other's weights off the device beneath it. It is refused,
    # saying why and what to do
    with pytest.raises(ModelLoadError, match=r"'m@fp32'.*the model the cache already "
                                             r"holds as 'm'.*a model kept in a global"):
        cache.get("m@fp32", lambda: precision.convert(load(), "fp32", "cpu"))
    assert cache.warm() == {"m": "device"} and served.module is model
    # A conversion that copies the module (bf16) is a model of its own
    half, _ = cache.get("m@bf16", lambda: precision.convert(load(), "bf16", "cpu"))
    assert half.module is not model and half.module.weight.dtype == torch.bfloat16
    assert cache.warm() == {"m": "device", "m@bf16": "device"}


@pytest.mark.parametrize("tier", ["device", "host"])
def test_an_engine_released_behind_the_caches_back_is_loaded_again(tier: str) -> None:
    # Given a cached engine released by someone else (a loader shared with a precision
    # conversion, which releases the engine it converted)
    cache, _ = make_cache(device_budget=100, host_budget=100)
    loaders = Loaders({"a": 100, "b": 100})
    a, _ = cache.get("a", loaders("a"))
    if tier == "host":
        cache.get("b", loaders("b"))
    assert cache.warm()["a"] == tier
    a.release()
    # When it is needed, it is loaded again rather than handed out released (or failing
    # its promotion)
    again, cold = cache.get("a", loaders("a"))
    assert again is not a and not again.released and cold.source == "disk"
    assert again(2, 3) == 5 and loaders.loads["a"] == 2
    assert_consistent(cache, loaders)


def test_errors_survive_result_backends() -> None:
    # Celery's result backends rebuild a task's exception as cls(*args), after json or pickle.
    err = ModelLoadError("m", ValueError("bad config"))
    for again in (pickle.loads(pickle.dumps(err)), ModelLoadError(*json.loads(
            json.dumps(err.args)))):
        assert (again.key, again.reason) == ("m", "ValueError: bad config")
        assert str(again) == str(err) == "loading model 'm' failed: ValueError: bad config"
    big = EngineTooLarge("m", 10, 5)
    again_big = EngineTooLarge(*json.loads(json.dumps(big.args)))
    assert (again_big.key, again_big.size_bytes, again_big.budget_bytes) == ("m", 10, 5)
    assert str(pickle.loads(pickle.dumps(big))) == str(big)
    busy = EngineInUse("m", "outer")
    for again_busy in (pickle.loads(pickle.dumps(busy)),
                       EngineInUse(*json.loads(json.dumps(busy.args)))):
        assert str(again_busy) == str(busy) and "push out 'outer'" in str(busy)


def test_an_engine_a_task_uses_is_not_pushed_out_beneath_it() -> None:
    """(a task running another model's task in-process had its own engine demoted or
    released beneath it when the inner model needed the room)"""
    cache, _ = make_cache(device_budget=100, host_budget=100)
    loaders = Loaders({"a": 100, "b": 100})
    a, _ = cache.get("a", loaders("a"))
    # Given a task running on a, when it gets b, which needs a's room
    with cache.using("a"), cache.using("a"):
        with pytest.raises(EngineInUse, match=r"'b'.*would push out 'a'"):
            cache.get("b", loaders("b"))
        # Then b is refused (and released), a stays and runs
        assert loaders.built[-1].released and "b" not in cache
        assert cache.warm() == {"a": "device"} and a(1, 2) == 3
    assert_consistent(cache, loaders)
    # Once the task is done, b takes the room as usual
    _, cold = cache.get("b", loaders("b"))
    assert cold.demoted == ("a",) and cache.warm() == {"a": "host", "b": "device"}
    # and from the host too: a promotion that would demote an engine in use is refused
    with cache.using("b"), pytest.raises(EngineInUse):
        cache.get("a", loaders("a"))
    assert cache.warm() == {"a": "host", "b": "device"}
    assert_consistent(cache, loaders)
    # each refusal counted as what it was, not as an engine too large for the device
    assert cache.stats()["in_use"] == 2 and cache.stats()["too_large"] == 0


class Growing(FakeEngine):
    """Like a TensorRT plan: its execution context's activation memory (``GROWTH``
    bytes) is known, and counted, from its first promotion on."""

    GROWTH = 30

    def _promote(self, device: str) -> None:
        super()._promote(device)
        if self.calls["promote"] == 1:
            self.size += self.GROWTH


def test_an_engine_that_takes_more_on_the_device_is_counted_at_that_and_makes_room() -> None:
    cache, _ = make_cache(device_budget=100, host_budget=300)
    loaders = Loaders({"a": 50, "t": 40})
    growing = Loaders({"t": 40}, cls=Growing)
    cache.get("a", loaders("a"))
    # When an engine admitted at 40 bytes turns out to take 70 on the device
    _, cold = cache.get("t", growing("t"))
    # Then it is counted at 70, and the other engine moved to the host for the growth
    assert cache.state.entries["t"].size_bytes == 70 and cold.demoted == ("a",)
    assert cache.warm() == {"a": "host", "t": "device"} and cache.state.device_used == 70
    assert_consistent(cache, Loaders.merged(loaders, growing))
    # And from the host, its promotion makes room for all of it up front
    cache.get("a", loaders("a"))
    assert cache.warm() == {"a": "device", "t": "host"}
    engine, again = cache.get("t", growing("t"))
    assert again.source == "host" and again.demoted == ("a",) and engine.size == 70
    assert growing.loads["t"] == 1 and cache.state.device_used == 70
    assert_consistent(cache, Loaders.merged(loaders, growing))


def test_an_engine_that_grows_past_the_device_pool_is_refused_and_released() -> None:
    cache, _ = make_cache(device_budget=60, host_budget=300)
    growing = Loaders({"t": 40}, cls=Growing)
    with pytest.raises(EngineTooLarge, match=r"'t' needs 70 bytes.*holds 60"):
        cache.get("t", growing("t"))
    assert growing.built[0].released and "t" not in cache and cache.state.device_used == 0
    assert cache.stats()["too_large"] == 1 and cache.stats()["loads"] == 0


def test_an_engine_that_grows_into_the_room_of_one_in_use_is_refused_and_released() -> None:
    cache, _ = make_cache(device_budget=100, host_budget=300)
    loaders = Loaders({"a": 50})
    growing = Loaders({"t": 40}, cls=Growing)
    a, _ = cache.get("a", loaders("a"))
    with cache.using("a"), pytest.raises(EngineInUse, match=r"'t'.*would push out 'a'"):
        cache.get("t", growing("t"))
    # its 70 bytes are not left on the device uncounted: it is gone, a stays and runs
    assert growing.built[0].released and cache.warm() == {"a": "device"} and a(1, 2) == 3
    assert cache.stats()["in_use"] == 1
    assert_consistent(cache, Loaders.merged(loaders, growing))


def test_an_engine_whose_growth_cannot_be_made_room_for_is_released() -> None:
    cache, _ = make_cache(device_budget=100, host_budget=300)
    loaders = Loaders({"a": 50})
    growing = Loaders({"t": 40}, cls=Growing)
    cache.get("a", loaders("a", fail="demote"))
    with pytest.raises(ModelLoadError, match=r"'t'.*making room for it failed: demote of 'a'"):
        cache.get("t", growing("t"))
    # the engine that broke and the one that grew are both gone: nothing uncounted
    assert growing.built[0].released and cache.warm() == {} and cache.state.device_used == 0
    assert_consistent(cache, Loaders.merged(loaders, growing))


def test_rekey_serves_an_engine_under_the_key_of_what_it_is() -> None:
    """(a precision conversion that changed nothing kept a second copy of the weights)"""
    cache, _ = make_cache(device_budget=200, host_budget=300)
    loaders = Loaders({"m": 100, "m@fp32": 100, "n@fp32": 100})
    copy, _ = cache.get("m@fp32", loaders("m@fp32"))
    # Given no entry for what it is: the engine moves, nothing is loaded or released
    moved, cost = cache.rekey("m@fp32", "m", loaders("m"))
    assert moved is copy and moved.key == "m" and not copy.released and cost is None
    assert cache.warm() == {"m": "device"} and loaders.loads["m"] == 0
    assert_consistent(cache, loaders)
    _, hit = cache.get("m", loaders("m"))
    assert hit.source == "device"
    # Given one already: the copy is dropped and the entry served
    other, _ = cache.get("n@fp32", loaders("n@fp32"))
    again, cost = cache.rekey("n@fp32", "m", loaders("m"))
    assert again is moved and other.released and cost is not None
    assert cache.warm() == {"m": "device"}
    assert_consistent(cache, loaders)
    with pytest.raises(KeyError):
        cache.rekey("absent", "m", loaders("m"))


# -- housekeeping and stats -------------------------------------------------------------------

def test_stats_count_every_path() -> None:
    cache, _ = make_cache(device_budget=100, host_budget=200)
    loaders = Loaders({"a": 100, "b": 100})
    for key in ("a", "a", "b", "a", "a"):  # disk, hit, disk (a demoted), host, hit
        cache.get(key, loaders(key))
    s = cache.stats()
    assert (s["gets"], s["hits_device"], s["hits_host"], s["loads"]) == (5, 2, 1, 2)
    assert (s["promotions"], s["demotions"], s["evictions"]) == (1, 2, 0)
    assert s["cold_share"] == pytest.approx(3 / 5)
    assert s["cuda_ctx_ms"] == CTX_MS and s["warmup_ms_total"] > 0
    assert (s["device_used_bytes"], s["host_used_bytes"]) == (100, 100)
    assert (s["engines_device"], s["engines_host"]) == (1, 1)


def test_expire_shrink_drop_and_clear_release_engines() -> None:
    clock = Clock()
    cache = EngineCache(DEVICE, 100, 300, clock=clock)
    loaders = Loaders({"a": 100, "b": 100, "c": 100, "d": 100})
    for key in ("a", "b", "c", "d"):
        cache.get(key, loaders(key))           # a, b, c end up on the host
    assert cache.warm() == {"a": "host", "b": "host", "c": "host", "d": "device"}

    clock.now += 10.0
    assert cache.expire(host_ttl_s=13.5) == ("a",)   # only a is older than 13.5 s
    assert cache.shrink_host(100) == ("b",)          # the coldest of b, c goes
    assert cache.state.host_budget_bytes == 100
    assert cache.drop("c") and not cache.drop("c")
    assert_consistent(cache, loaders)
    cache.clear()
    assert cache.warm() == {} and len(cache) == 0
    assert all(e.released for e in loaders.built)
    with pytest.raises(EngineReleased):
        loaders.built[0](1)


def test_cold_start_as_dict() -> None:
    cold = ColdStart(True, "disk", 1.0, 2.0, 3.0, 4.0, ("x",), ("y",))
    assert cold.as_dict() == {"cold": True, "source": "disk", "cuda_ctx_ms": 1.0,
                              "load_ms": 2.0, "promote_ms": 3.0, "warmup_ms": 4.0,
                              "evicted": ["x"], "demoted": ["y"], "total_ms": 10.0}


def test_concurrent_misses_load_once() -> None:
    cache, _ = make_cache()
    loaders = Loaders({"a": 100})
    barrier = threading.Barrier(8)
    got: list[Engine] = []

    def worker() -> None:
        barrier.wait()
        got.append(cache.get("a", loaders("a"))[0])

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loaders.loads["a"] == 1 and len({id(e) for e in got}) == 1


def test_invalid_half_life() -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        EngineCache(DEVICE, 1, 1, half_life_s=0)


def test_importing_the_cache_starts_no_gpu_runtime() -> None:
    # The worker's parent imports these modules before forking: torch (and with it CUDA)
    # must load only in the children (STYLE habit 6).
    code = ("import sys, sits_queue.cache.pool, sits_queue.cache.engines, sits_queue.models; "
            "print(sorted(m for m in ('torch', 'onnxruntime', 'tensorrt', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_an_engine_dropped_for_a_warmer_one_is_not_demoted_first() -> None:
    """(the coldest was demoted, then evicted for the next victim's room: a copy to the
    host for nothing, and the result named it demoted as well as evicted)"""
    cache, _ = make_cache(device_budget=100, host_budget=50)
    loaders = Loaders({"a": 50, "b": 50, "c": 100})
    a, _ = cache.get("a", loaders("a"))
    cache.get("b", loaders("b"))
    _, cold = cache.get("c", loaders("c"))  # room for 100: a (colder) dropped, b demoted
    assert cold.evicted == ("a",) and cold.demoted == ("b",)
    assert isinstance(a, FakeEngine) and a.calls["demote"] == 0 and a.released
    assert cache.warm() == {"b": "host", "c": "device"}
    assert_consistent(cache, loaders)


def test_a_rekey_that_brings_the_entry_back_reports_the_final_moves() -> None:
    """(a precision request of what the model already is: its copy's load demoted the
    model, which then served the task from the device, and the result said demoted)"""
    from sits_queue.workers.acquire import merged_moves

    cache, _ = make_cache(device_budget=100, host_budget=200)
    loaders = Loaders({"m": 100, "m@fp32": 100, "x": 100})
    cache.get("m", loaders("m"))
    _, first = cache.get("m@fp32", loaders("m@fp32"))  # m demoted for the copy
    assert first.demoted == ("m",)
    _, then = cache.rekey("m@fp32", "m", loaders("m"))
    assert then is not None and then.source == "host"  # promoted back
    final = merged_moves(first, then, "m")
    assert "m" not in final.demoted and cache.warm() == {"m": "device"}
    assert final.evicted == (*first.evicted, *then.evicted)
    assert_consistent(cache, loaders)
