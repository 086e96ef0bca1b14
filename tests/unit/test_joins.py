"""Continuous batching (``workers/joins.py``, ``batchgen.py``): the pure rules, and rows
joining a running generation batch on a tiny real model, each decoding exactly what it
would alone. (The Redis list and the worker around it: tests/integration/test_joins.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from sits_queue.broker.keys import DELIVERY_HEADER, QueueKeys
from sits_queue.config import SitsConfig
from sits_queue.errors import ConfigError, InvalidInput
from sits_queue.options import HEADER
from sits_queue.workers import batchmain, decoding, inference, joins
from sits_queue.workers import runtime as rt
from sits_queue.workers.batched import Call
from sits_queue.workers.batchgen import generate_calls

# -- pure -------------------------------------------------------------------------------------


def test_a_row_joins_only_if_it_ends_well_before_the_soft_limit() -> None:
    # 10 tokens at 0.1 s a step = 1 s: within half of the 3 s left, not of the 1.5 s left
    assert joins.fits(100.0, 103.0, 10, 0.1)
    assert not joins.fits(100.0, 101.5, 10, 0.1)
    assert not joins.fits(100.0, 99.0, 1, 0.001)  # the limit has passed
    assert joins.fits(100.0, None, 10_000, 1.0)  # no soft limit: only batch_join_s bounds


def test_room_is_the_capacity_left() -> None:
    assert joins.room(8, 3) == 5
    assert joins.room(8, 8) == joins.room(8, 9) == 0


@pytest.mark.parametrize(("call_most", "capacity"), [(2, 2), (None, 32), (64, 32)])
def test_a_call_s_max_batch_bounds_the_rows_its_batch_takes_in(
        monkeypatch: pytest.MonkeyPatch, call_most: int | None, capacity: int) -> None:
    """(joins refilled a batch up to the task's max_batch, 32, past the max_batch=2 of
    the call leading it)"""
    monkeypatch.setattr(batchmain, "_joins", batchmain.JoinSetup(None, "", 5.0, print))
    task = SimpleNamespace(joins=True, max_batch=32)
    header = {"batch": "k", **({"batch_max": call_most} if call_most else {})}
    first = SimpleNamespace(task=task, id="t1", request_dict={
        DELIVERY_HEADER: ["celery", 1], HEADER: header})
    spec = batchmain._join_spec([first], 30.0)
    assert spec is not None and spec["capacity"] == capacity


def test_a_batch_offers_its_rows_only_once_it_would_take_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(a row free of eight was offered, the main process picked a task for it, and the
    batch, taking joins only once a quarter is free, held that task unrun, unacked and
    out of every other slot's reach until it ended)"""
    calls: list[tuple[Any, ...]] = []

    def script(client: Any, keys: list[str], op: str, *args: Any) -> Any:
        calls.append((op, *args))
        return 1 if op == "room" else []

    monkeypatch.setattr(joins, "_join_script", script)
    feed = joins.Feed(client=None, keys=["l", "s"], capacity=8, until=float("inf"),
                      add=lambda job: (0, Call("x", (), {})))
    assert feed.least == 2
    for live in (8, 7, 6):
        feed.take(live)
    offered = [c[-1] for c in calls if c[0] == "room"]
    assert offered == [0, 2]  # nothing while one row was free; two once two were
    assert [c for c in calls if c[0] == "take"] == [("take", 2)]


def test_a_joined_call_reports_its_own_warm_run_not_the_batch_s_cold_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(joined calls carried the batch's sits block: a cold start they never paid, its
    load_ms, and the first token of the batch's own run; the metrics counted one first
    token for the batch, none for the calls that joined it)"""
    monkeypatch.setattr(joins, "_join_script",
                        lambda client, keys, op, *args: 1 if op == "room" else [b"job"])
    monkeypatch.setattr(joins, "decode_job", lambda raw: raw)
    clock = iter([10.0, 10.25, 10.5, 11.0])
    monkeypatch.setattr(joins.time, "perf_counter", lambda: next(clock))
    feed = joins.Feed(client=None, keys=["l", "s"], capacity=4, until=float("inf"),
                      add=lambda job: (3, Call("x", (), {})))
    assert [i for i, _ in feed.take(1)] == [3]  # taken at 10.0
    feed.first_token(3)  # 10.25
    feed.first_token(3)  # (once: a later call changes nothing)
    batch = {"cold": True, "source": "disk", "cuda_ctx_ms": 3.0, "load_ms": 145.7,
             "promote_ms": 2.0, "warmup_ms": 9.0, "evicted": ["a"], "demoted": ["b"],
             "run_ms": 900.0, "first_token_ms": 455.2, "device": "cpu", "slot": 0,
             "sla_class": "low", "precision": None}
    own = feed.own_meta(3, batch)  # it leaves at 10.5
    assert own == {**batch, "cold": False, "source": "device", "cuda_ctx_ms": 0.0,
                   "load_ms": 0.0, "promote_ms": 0.0, "warmup_ms": 0.0, "evicted": [],
                   "demoted": [], "run_ms": 500.0, "first_token_ms": 250.0}
    assert feed.first_tokens_ms() == [250.0]
    # one that left with no first token said (failed at its parse): none made up
    assert feed.own_meta(7, batch)["first_token_ms"] is None


def test_join_keys_share_the_queue_hash_tag() -> None:
    keys = joins.join_keys("gen", "task-1", "p:")
    assert keys == ["p:sits:{gen}:join:task-1", "p:sits:{gen}:join:task-1:state"]
    assert all(k.startswith(QueueKeys.for_queue("gen", "p:").waiting[:-1]) for k in keys)
    with pytest.raises(ValueError, match="braces"):
        joins.join_keys("a{b}", "x")


def test_a_pool_job_crosses_redis_as_json_and_back() -> None:
    job = ("sits.generate_batched", "id-1", {"sits": {"batch": "k"}, "n": [1, 2]},
           b'[["a"], {}, {}]\xff', "application/json", "utf-8")
    raw = joins.encode_job(job)
    assert "__type__" in raw and b"\xff" not in raw.encode()  # bytes as base64, not pickle
    assert joins.decode_job(raw) == (job[0], job[1], {"sits": {"batch": "k"}, "n": [1, 2]},
                                     job[3], job[4], job[5])
    for bad in ("[1, 2]", '{"a": 1}', "[1, 2, 3, 4, 5, 6]"):
        with pytest.raises(ValueError, match="not a pool job"):
            joins.decode_job(bad)


def test_joins_are_on_by_default_where_children_decode_on_gpus() -> None:
    assert SitsConfig().batch_join == "auto" and SitsConfig().batch_join_s == 10.0
    assert joins.wanted("auto", gpus=True) and not joins.wanted("auto", gpus=False)
    assert joins.wanted("on", gpus=False) and not joins.wanted("off", gpus=True)
    assert SitsConfig.from_env({"SITS_BATCH_JOIN": "on"}).batch_join == "on"
    with pytest.raises(ConfigError, match="batch_join must be auto, on or off"):
        SitsConfig(batch_join="yes")
    for bad in (0.0, -1.0, float("nan"), 1e9):
        with pytest.raises(ConfigError, match="batch_join_s"):
            SitsConfig(batch_join_s=bad)


# -- rows joining a running batch, on a tiny real model ---------------------------------------

@dataclass
class ListFeed:
    """``joins.Feed``'s contract over a list: what joins, when the batch has room."""

    waiting: list[Call]
    capacity: int
    first: int  # the call index of the first joining one
    taken: list[int] = field(default_factory=list)
    rooms: list[int] = field(default_factory=list)
    declined: set[int] = field(default_factory=set)
    fit: bool = True
    firsts: list[int] = field(default_factory=list)  # joined rows with a first token

    def take(self, live: int) -> list[tuple[int, Call]]:
        free = joins.room(self.capacity, live)
        self.rooms.append(free)
        out = []
        while free and self.waiting:
            index = self.first + len(self.taken)
            self.taken.append(index)
            out.append((index, self.waiting.pop(0)))
            free -= 1
        return out

    def fits(self, most: int, step_s: float) -> bool:
        assert step_s > 0
        return self.fit

    def decline(self, index: int) -> None:
        self.declined.add(index)

    def first_token(self, index: int) -> None:
        self.firsts.append(index)


def run_with(lm: Any, own: list[Call], feed: ListFeed
             ) -> tuple[list[Any], dict[int, Any], list[int]]:
    """The batch's own outputs, what was delivered by call index, and each forward's
    batch size."""
    delivered: dict[int, Any] = {}
    sizes: list[int] = []
    handle = lm.module.register_forward_pre_hook(
        lambda _m, _a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True)

    def early(i: int, out: Any) -> bool:
        assert i not in delivered
        delivered[i] = out
        return True

    active = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu",
                           early=early, joins=feed)
    try:
        with rt.activated(active):
            return generate_calls(lm, own), delivered, sizes
    finally:
        handle.remove()


def alone(lm: Any, call: Call) -> dict[str, Any]:
    return {**inference.generate(lm, *call.args, **call.kwargs), "shared_tokens": 0}


LONG = "a much longer prompt than any row of the batch has, " * 3


def test_rows_join_freed_slots_and_decode_exactly_as_alone(lm: Any) -> None:
    own = [Call("a", ("the cache warms", 2), {"stop_at_eos": False}),
           Call("b", ("a queue of work", 9), {"stop_at_eos": False, "temperature": 1.5,
                                               "seed": 2})]
    joining = [Call("c", ("the worker loads", 5), {"stop_at_eos": False, "seed": 3,
                                                   "temperature": 1.2}),
               Call("d", (LONG, 4), {"stop_at_eos": False}),  # wider than the batch
               Call("e", ("one token only", 1), {"stop_at_eos": False}),
               Call("f", ("", 3), {"stop_at_eos": False}),  # bad: fails at once
               Call("g", ("stops otherwise", 3), {"stop_at_eos": True}),  # declined
               Call("h", ("last of them", 3), {"stop_at_eos": False})]
    feed = ListFeed(list(joining), capacity=3, first=len(own))
    got, delivered, sizes = run_with(lm, own, feed)
    # the batch's own rows decode as alone; "a" left after 2 steps and was delivered then
    assert got == [alone(lm, c) for c in own] and delivered[0] == got[0]
    calls = {i: c for i, c in enumerate(own + joining)}
    assert feed.declined == {6}  # "g" stops at end-of-sequence, the batch does not
    assert isinstance(delivered[5], InvalidInput)
    for i in (2, 3, 4, 7):  # each joined row: exactly its tokens alone
        assert delivered[i] == alone(lm, calls[i]), calls[i].id
    assert set(delivered) == {0, 2, 3, 4, 5, 7}  # "b" ends the batch: returned, not sent
    # forwards: a one-row prefill per joining row (P) between the batch's steps. Step 1
    # runs a, b; c joins (P); step 2 runs 3 and a leaves; d joins (P); steps 3-5 run 3
    # rows, then c and d leave; e joins (P) and is done at its first token, f fails; step
    # 6 runs b alone; h joins (P) (g was declined); steps 7-8 run b, h; step 9 b alone.
    assert sizes == [2, 1, 3, 1, 3, 3, 3, 1, 1, 1, 2, 2, 1]
    assert feed.taken == [2, 3, 4, 5, 6, 7]
    # each joined row's first token is its own, said as its prefill gives it ("e"'s
    # too, done at it; not the failed "f"'s nor the declined "g"'s)
    assert feed.firsts == [2, 3, 4, 7]


def test_no_room_no_joins_and_joins_end_with_the_batch(lm: Any) -> None:
    own = [Call(str(i), ("a queue of work", 4), {"stop_at_eos": False}) for i in range(3)]
    feed = ListFeed([Call("x", ("late", 2), {"stop_at_eos": False})], capacity=3, first=3)
    got, delivered, sizes = run_with(lm, own, feed)
    # a full batch offers no room; when all its rows end together, nothing joins
    assert feed.taken == [] and set(feed.rooms) == {0} and sizes == [3, 3, 3, 3]
    assert len(got) == 3 and delivered == {}


def test_a_row_that_would_not_finish_in_time_is_declined(lm: Any) -> None:
    own = [Call("a", ("the cache warms", 1), {"stop_at_eos": False}),
           Call("b", ("a queue of work", 4), {"stop_at_eos": False})]
    feed = ListFeed([Call("c", ("late", 3), {"stop_at_eos": False})], capacity=2, first=2,
                    fit=False)
    got, delivered, _ = run_with(lm, own, feed)
    assert feed.taken == [2] and feed.declined == {2} and 2 not in delivered
    assert got == [alone(lm, c) for c in own]


def test_outside_a_worker_feed_nothing_joins(lm: Any) -> None:
    own = [Call("a", ("the cache warms", 2), {"stop_at_eos": False}),
           Call("b", ("a queue of work", 3), {"stop_at_eos": False})]
    active = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu")
    with rt.activated(active):
        assert [g["tokens"] for g in generate_calls(lm, own)] == [2, 3]


def test_rows_join_a_lone_row_which_decodes_as_alone(lm: Any) -> None:
    own = [Call("a", ("the cache warms", 7), {"stop_at_eos": False, "temperature": 1.4,
                                              "seed": 9})]
    joining = [Call("b", ("a queue of work", 3), {"stop_at_eos": False}),
               Call("c", ("one token only", 1), {"stop_at_eos": False})]
    feed = ListFeed(list(joining), capacity=4, first=1)
    got, delivered, sizes = run_with(lm, own, feed)
    assert got == [alone(lm, own[0])]
    assert delivered == {1: alone(lm, joining[0]), 2: alone(lm, joining[1])}
    # a's prefill (its first token) and first step; b and c prefilled together as a
    # batch of two (c is done at its first token); two steps of a and b (b's last two
    # tokens); a's last three alone
    assert sizes == [1, 1, 2, 2, 2, 1, 1, 1]


def test_a_lone_row_with_nothing_to_join_it_decodes_as_alone(lm: Any) -> None:
    own = [Call("a", ("one token only", 1), {"stop_at_eos": False})]
    feed = ListFeed([Call("b", ("a queue of work", 3), {"stop_at_eos": False})],
                    capacity=4, first=1)
    got, delivered, sizes = run_with(lm, own, feed)
    # done at its first token: nothing had a step to join
    assert got == [alone(lm, own[0])] and delivered == {} and sizes == [1]


def test_a_row_joins_a_batch_sharing_a_template_prefill_and_decodes_as_alone(
        lm: Any) -> None:
    template = ("you are a careful summariser of operations logs. keep every number. "
                "answer in one line. ") * 2
    own = [Call("a", (template + "disk 3 is full", 2), {"stop_at_eos": False}),
           Call("b", (template + "node 7 rebooted twice", 6), {"stop_at_eos": False}),
           Call("c", (template + "ok", 5), {"stop_at_eos": False, "temperature": 1.1,
                                            "seed": 4})]
    joining = [Call("d", (template + "latency is up by a fifth", 3), {"stop_at_eos": False}),
               Call("e", ("short and plain", 2), {"stop_at_eos": False})]
    feed = ListFeed(list(joining), capacity=3, first=len(own))
    got, delivered, _ = run_with(lm, own, feed)
    shared = got[0]["shared_tokens"]
    assert shared >= 16  # the batch shared its template's prefill
    assert got[1:] == [{**alone(lm, c), "shared_tokens": shared} for c in own[1:]]
    assert delivered[0] == {**alone(lm, own[0]), "shared_tokens": shared}
    # joined rows prefill alone (nothing shared) and decode exactly as alone
    assert delivered[3] == alone(lm, joining[0]) and delivered[4] == alone(lm, joining[1])


def test_rows_the_device_memory_cannot_take_now_are_declined(
        lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from sits_queue.workers import gpu

    prompt = len(inference.tokenizer_of(lm, lm.key)("abc")["input_ids"])
    one_row = 2 * decoding.kv_cache_bytes(lm.module, prompt + 3)  # its KV, twice over
    monkeypatch.setattr(gpu, "free_bytes", lambda: int(2.5 * one_row))  # room for 2
    own = [Call("a", ("the cache warms", 1), {"stop_at_eos": False}),
           Call("b", ("a queue of work", 4), {"stop_at_eos": False})]
    joining = [Call(str(i), ("abc", 3), {"stop_at_eos": False}) for i in range(4)]
    feed = ListFeed(list(joining), capacity=8, first=2)
    got, delivered, _ = run_with(lm, own, feed)
    assert got == [alone(lm, c) for c in own]
    # the four come in one take: the first two fit, the other two are declined
    assert feed.taken == [2, 3, 4, 5] and feed.declined == {4, 5}
    assert delivered == {0: got[0], 2: alone(lm, joining[0]), 3: alone(lm, joining[1])}
