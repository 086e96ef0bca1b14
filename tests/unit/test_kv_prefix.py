"""The KV-prefix cache: block keys and the LRU store (pure), and generations on a tiny
real model that start from a cached prefix and decode exactly what a full prefill does."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from sits_queue.app import make_app
from sits_queue.cache import budgets as cache_budgets
from sits_queue.cache.pool import ColdStart, ModelLoadError
from sits_queue.cache.prefix import MAX_TAGS, Hit, PrefixStore, Slot, block_keys, plan_evictions
from sits_queue.config import SitsConfig
from sits_queue.workers import inference, kvreuse, metrics
from sits_queue.workers import runtime as rt

# -- pure -------------------------------------------------------------------------------------


def test_block_keys_chain_whole_blocks_only() -> None:
    a = block_keys(list(range(40)), block=16)
    assert len(a) == 2  # the last 8 tokens are not a whole block
    b = block_keys([*range(32), 99, 99], block=16)
    assert a == b[:2]  # same first 32 tokens: same keys
    c = block_keys([1, *range(1, 32)], block=16)
    assert c[0] != a[0] and c[1] != a[1]  # one token differs: every later key differs too
    assert block_keys([], 16) == [] and block_keys([1] * 15, 16) == []
    with pytest.raises(ValueError, match="block"):
        block_keys([1], 0)


@pytest.mark.parametrize(("slots", "budget", "incoming", "expected"), [
    ([], 100, 40, ()),
    ([Slot(1, 50, 1.0), Slot(2, 30, 2.0)], 100, 20, ()),
    ([Slot(1, 50, 2.0), Slot(2, 30, 1.0)], 100, 40, (2,)),  # least recently used first
    ([Slot(1, 50, 2.0), Slot(2, 30, 1.0)], 100, 90, (2, 1)),
    ([Slot(1, 50, 1.0)], 100, 101, None),  # never fits
])
def test_plan_evictions(slots: list[Slot], budget: int, incoming: int,
                        expected: tuple[int, ...] | None) -> None:
    assert plan_evictions(slots, budget, incoming) == expected


def ticking() -> Callable[[], float]:
    counter = itertools.count()
    return lambda: float(next(counter))


def test_store_finds_the_longest_cached_prefix_but_never_all_of_a_prompt() -> None:
    store = PrefixStore(1000, block=4, clock=ticking())
    assert store.store("m", list(range(8)), "kv-8", 10)
    assert store.lookup("m", list(range(12))) == Hit("kv-8", 8)
    assert store.lookup("m", [0, 1, 2, 3, 9, 9, 9]) == Hit("kv-8", 4)
    # exactly the stored tokens: the model must still see one, so one block less
    assert store.lookup("m", list(range(8))) == Hit("kv-8", 4)
    assert store.lookup("other-model", list(range(12))) is None
    assert store.lookup("m", [5, 5, 5, 5, 5]) is None
    assert (store.hits, store.misses) == (3, 2)
    assert store.covered("m", list(range(8))) == 8 and store.covered("m", [7] * 8) == 0


def test_store_evicts_the_least_recently_used_and_repoints_shared_blocks() -> None:
    store = PrefixStore(25, block=4, clock=ticking())
    store.store("m", [1, 2, 3, 4], "short", 10)
    store.store("m", [1, 2, 3, 4, 5, 6, 7, 8], "long", 10)
    assert store.lookup("m", [1, 2, 3, 4, 0]).value == "long"  # type: ignore[union-attr]
    # a third entry evicts the least recently used ("short")
    store.store("m", [9, 9, 9, 9], "other", 10)
    assert len(store) == 2 and store.evicted == 1
    # "long" still serves the shared first block
    assert store.lookup("m", [1, 2, 3, 4, 0]).value == "long"  # type: ignore[union-attr]
    assert store.used_bytes == 20 and store.models() == {"m": 2}


def test_evicting_an_entry_repoints_its_blocks_to_another_holding_them() -> None:
    store = PrefixStore(20, block=4, clock=ticking())
    store.store("m", [1, 2, 3, 4, 5, 6, 7, 8], "long", 10)
    store.store("m", [1, 2, 3, 4], "short", 10)  # now the newest for the first block
    assert store.lookup("m", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == Hit("long", 8)  # long: recent
    store.store("m", [9, 9, 9, 9], "other", 10)  # evicts "short", the least recent
    assert store.evicted == 1
    assert store.lookup("m", [1, 2, 3, 4, 0]) == Hit("long", 4)


def test_store_refuses_what_never_fits_and_partial_blocks() -> None:
    store = PrefixStore(5, block=4)
    assert store.store("m", [1, 2, 3, 4], "big", 6) is False and len(store) == 0
    with pytest.raises(ValueError, match="whole blocks"):
        store.store("m", [1, 2, 3], "x", 1)
    with pytest.raises(ValueError, match="budget"):
        PrefixStore(-1)


def test_drop_forgets_a_models_prefixes() -> None:
    store = PrefixStore(100, block=4)
    store.store("a", [1, 2, 3, 4], "x", 1)
    store.store("b", [1, 2, 3, 4], "y", 1)
    assert store.drop(["a"]) == 1 and store.models() == {"b": 1}
    assert store.lookup("a", [1, 2, 3, 4, 5]) is None


def test_prefix_fields() -> None:
    assert metrics.prefix_fields(0) == {"kv_lookups": 1}
    assert metrics.prefix_fields(32) == {"kv_lookups": 1, "kv_hits": 1, "kv_tokens": 32}


# -- generations on a tiny real model -----------------------------------------------------------

SHARED = ("you are a careful summariser of operations logs. keep every number. "
          "answer in one line. ") * 2


def with_store(lm: Any, store: PrefixStore, counts: dict[str, float], prompt: str,
               **kwargs: Any) -> dict[str, Any]:
    def count(fields: Any) -> None:
        metrics.merge(counts, fields)

    active = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu",
                           prefixes=store, count=count)
    with rt.activated(active):
        return inference.generate(lm, prompt, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.2])
def test_a_shared_prefix_is_prefilled_once_and_decodes_the_same(lm: Any,
                                                                temperature: float) -> None:
    store, counts = PrefixStore(2**26), {}
    kwargs = {"max_new_tokens": 8, "temperature": temperature, "seed": 4,
              "stop_at_eos": False}
    # Given a first generation with a long shared prefix: nothing cached, its prompt kept
    first = with_store(lm, store, counts, SHARED + "disk 3 is full", **kwargs)
    assert first["cached_tokens"] == 0 and len(store) == 1
    # When a second prompt shares that prefix
    prompt = SHARED + "node 7 rebooted twice"
    second = with_store(lm, store, counts, prompt, **kwargs)
    # Then its prefill starts after the shared whole blocks, and it decodes exactly what a
    # full prefill (no store at all) does
    assert 16 <= second["cached_tokens"] < second["prompt_tokens"]
    assert second["cached_tokens"] % store.block == 0
    plain = inference.generate(lm, prompt, **kwargs)
    assert plain["cached_tokens"] == 0
    assert {k: v for k, v in second.items() if k != "cached_tokens"} == \
        {k: v for k, v in plain.items() if k != "cached_tokens"}
    assert counts == {"kv_lookups": 2, "kv_hits": 1, "kv_tokens": second["cached_tokens"]}


def test_a_resumed_generation_counts_only_its_prompt_as_cached(lm: Any) -> None:
    """(a generation resumed after yields found its own earlier tokens in the store:
    its result said 176 cached tokens of a 2-token prompt)"""
    import json

    store, counts = PrefixStore(2**26), {}
    kwargs = {"max_new_tokens": 44, "stop_at_eos": False}
    cut_at, checkpoint, runs = {36, 39}, None, 0

    class Yielded(Exception):
        pass

    def yielder(state: Any, remaining_s: float | None) -> None:
        nonlocal checkpoint
        if len(state["new"]) in cut_at:
            cut_at.discard(len(state["new"]))
            checkpoint = json.loads(json.dumps(state))
            raise Yielded()

    while True:
        runs += 1
        active = rt.ActiveTask("lm", SitsConfig().quota("low"), lm.size_bytes(), "cpu",
                               prefixes=store, count=lambda f: metrics.merge(counts, f),
                               yielder=yielder, checkpoint=checkpoint)
        try:
            with rt.activated(active):
                result = inference.generate(lm, "hi", **kwargs)
            break
        except Yielded:
            continue
    assert runs == 3 and result["runs"] == 3
    # the third run found the second's 32 tokens (prompt and generated) in the store
    assert counts["kv_tokens"] >= store.block > result["prompt_tokens"]
    assert result["cached_tokens"] <= result["prompt_tokens"]
    assert result["text"] == inference.generate(lm, "hi", **kwargs)["text"]


def test_a_repeated_prompt_reuses_all_but_its_last_block(lm: Any) -> None:
    store: PrefixStore = PrefixStore(2**26)
    a = with_store(lm, store, {}, SHARED, max_new_tokens=4, stop_at_eos=False)
    b = with_store(lm, store, {}, SHARED, max_new_tokens=4, stop_at_eos=False)
    aligned = (a["prompt_tokens"] // store.block) * store.block
    assert b["cached_tokens"] in (aligned, aligned - store.block)
    assert b["cached_tokens"] < b["prompt_tokens"] and b["text"] == a["text"]
    assert len(store) == 1  # nothing new to keep the second time


def test_a_stored_prefix_is_a_private_compact_copy(lm: Any) -> None:
    store = PrefixStore(2**26)
    with_store(lm, store, {}, SHARED + "x", max_new_tokens=3, stop_at_eos=False)
    (entry,) = store._entries.values()
    assert kvreuse.reusable(entry.value)
    positions = {layer.keys.shape[-2] for layer in entry.value.layers}
    assert positions == {len(entry.keys) * store.block}
    assert entry.size_bytes == kvreuse.nbytes(entry.value)


def test_a_short_prompt_and_a_tiny_budget_store_nothing(lm: Any) -> None:
    store = PrefixStore(2**26)
    with_store(lm, store, {}, "hi", max_new_tokens=2, stop_at_eos=False)
    assert len(store) == 0
    tiny_store = PrefixStore(100)  # smaller than one block's KV
    out = with_store(lm, tiny_store, {}, SHARED, max_new_tokens=2, stop_at_eos=False)
    assert len(tiny_store) == 0 and out["tokens"] == 2


def test_prefix_copy_refuses_more_positions_than_held(lm: Any) -> None:
    import torch

    ids = lm.artifacts["tokenizer"](SHARED, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = lm.module(input_ids=ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    with pytest.raises(ValueError, match="positions"):
        kvreuse.prefix_copy(cache, ids.shape[1] + 1)
    assert not kvreuse.reusable(object()) and not kvreuse.reusable(None)


# -- the worker drops the prefixes of an engine that left the device ---------------------------

class FakeCache:
    """Serves ``key`` (or raises ``fails``) with ``kept`` left on the device and the
    engines the get pushed out (``cold``'s evicted and demoted) gone from it."""

    def __init__(self, cold: ColdStart, fails: Exception | None = None) -> None:
        self.cold, self.fails = cold, fails
        self.tiers = {"gone": "device", "host": "device", "kept": "device"}

    def get(self, key: str, loader: Callable[[], Any]) -> tuple[Any, ColdStart]:
        del self.tiers[self.cold.evicted[0]]
        self.tiers[self.cold.demoted[0]] = "host"
        if self.fails is not None:
            raise self.fails
        self.tiers[key] = "device"
        return type("E", (), {"key": key, "size_bytes": lambda self: 10})(), self.cold

    def warm(self) -> dict[str, str]:
        return dict(self.tiers)

    def warm_bytes(self) -> dict[str, int]:
        return dict.fromkeys(self.tiers, 10)


@pytest.mark.parametrize("fails", [False, True])
def test_a_demoted_or_evicted_engine_takes_its_prefixes_along(
        monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    """(``fails``: a get that failed after making room, its warm-up raising, left the
    prefixes of the engines it pushed out: on the device, and advertised)"""
    from types import SimpleNamespace

    from sits_queue.workers import advertise
    from sits_queue.workers.devices import Device, Discovery

    monkeypatch.setattr(advertise, "publish_child", lambda *a: True)
    app = make_app(SitsConfig(), main="kv-unit")
    app.register_model("m", lambda: None)
    cpu = Device(index=0, kind="cpu", name="cpu", uuid="cpu", total_vram_bytes=2**36,
                 free_vram_bytes=2**35)
    cold = ColdStart(True, "disk", 0.0, 1.0, 0.0, 0.0, evicted=("gone",), demoted=("host",))
    child = rt.ChildRuntime(app=app, plan=rt.WorkerPlan("w@h", Discovery(devices=(cpu,)),
                                                         (0,), 1),
                            slot=0, device=cpu, cache_factory=lambda *a, **k: FakeCache(
                                cold, ModelLoadError("m", "warm-up broke") if fails else None))
    for model in ("gone", "host", "kept"):
        child.prefixes().store(model, list(range(16)), model, 1)
    task = SimpleNamespace(request=SimpleNamespace(sits={"model": "m", "sla_class": "low"},
                                                   timelimit=(10, 8)),
                           model=None, sla_class=None,
                           run=lambda engine: rt.active().prefixes)  # type: ignore[union-attr]
    if fails:
        with pytest.raises(Exception, match="warm-up broke"):
            inference.run_inference(child, task, (), {})
    else:
        result = inference.run_inference(child, task, (), {})
        assert result["output"] is child.prefixes()
    assert child.prefixes().models() == {"kept": 1}


def test_prefix_budget_is_an_eighth_of_the_device_tier_unless_set() -> None:
    from sits_queue.errors import ConfigError

    assert cache_budgets.CacheBudgets().prefix_budget(800) == 100
    budgets = cache_budgets.CacheBudgets.from_env({"SITS_KV_PREFIX_CACHE_BYTES": "0"})
    assert budgets.prefix_budget(800) == 0  # off
    with pytest.raises(ConfigError, match="SITS_KV_PREFIX_CACHE_BYTES"):
        cache_budgets.CacheBudgets.from_env({"SITS_KV_PREFIX_CACHE_BYTES": "lots"})
    with pytest.raises(ConfigError, match="prefix_bytes"):
        cache_budgets.CacheBudgets(prefix_bytes=-1)


def test_tags_are_the_prefix_keys_of_held_prefixes_most_recent_first() -> None:
    store = PrefixStore(20, block=4, clock=ticking())
    store.store("m", [1, 2, 3, 4], "kv-a", 10, tag="ka")
    store.store("m", [5, 6, 7, 8], "kv-b", 10, tag="kb")
    assert store.tags() == ["kb", "ka"]
    # a task with another key that reuses kv-a tags it too, and makes it the most recent
    assert store.lookup("m", [1, 2, 3, 4, 9], tag="kc") == Hit("kv-a", 4)
    assert store.tags() == ["kc", "ka", "kb"]
    # evicting an entry takes its keys off the list
    store.store("m", [9, 9, 9, 9], "kv-c", 10)  # evicts kv-b, the least recent
    assert store.tags() == ["kc", "ka"]


def test_a_prefix_reused_by_many_tasks_keeps_only_the_newest_tags() -> None:
    store = PrefixStore(20, block=4, clock=ticking())
    store.store("m", [1, 2, 3, 4], "kv-a", 10, tag="k0")
    for i in range(1, 3 * MAX_TAGS):
        store.lookup("m", [1, 2, 3, 4, 9], tag=f"k{i}")
    tags = store.tags()
    assert len(tags) == MAX_TAGS and tags[0] == f"k{3 * MAX_TAGS - 1}"
    assert max(len(e.tags) for e in store._entries.values()) == MAX_TAGS


def test_generate_tags_what_it_stores_with_the_tasks_prefix_key(lm: Any) -> None:
    store = PrefixStore(2**26)
    active = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu",
                           prefixes=store, prefix_key="template-v1")
    with rt.activated(active):
        inference.generate(lm, SHARED + "a", max_new_tokens=2, stop_at_eos=False)
    assert store.tags() == ["template-v1"]
