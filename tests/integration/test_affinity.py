"""Affinity-aware pulling against a real Redis: ``pick.lua`` agrees with the reference
policy, keeps the delivery guarantees, and a real worker takes what it holds warm first."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from sits_queue.broker import affinity
from sits_queue.broker.affinity import AffinityPolicy, Candidate, Warm, choose, lua_args
from sits_queue.broker.keys import QueueKeys, priority_level, score_base
from sits_queue.broker.scripts import Scripts
from sits_queue.config import SitsConfig
from sits_queue.procs import wait_ready
from sits_queue.workers import advertise, steer, warmreader
from tests.integration.inference_app import (
    CALL_S,
    FIRST_CALL_S,
    client_app,
    spawn_worker,
    write_config,
)
from tests.waiting import wait_for

KEYS = QueueKeys.for_queue("affinity-test")
CELERY = QueueKeys.for_queue("celery")
ME = "consumer-1"
NOW = 1_700_000_000.0


@pytest.fixture
def r(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    yield redis_client
    redis_client.delete(*KEYS.all())


@pytest.fixture(scope="module")
def scripts() -> Scripts:
    return Scripts.register()


def enqueue(client: redis.Redis, tasks: list[Candidate], held_until: float = NOW + 60
            ) -> None:
    """Waiting tasks in this order (arrival counter = position), as put.lua leaves them."""
    for seq, t in enumerate(tasks):
        priority = float(str(t.id).split("@")[1])
        client.zadd(KEYS.waiting, {t.id: score_base(priority) + seq})
        client.hset(KEYS.payloads, t.id, json.dumps({"id": t.id}))
        client.hset(KEYS.meta, t.id, json.dumps({"c": "high", "m": t.model, "t": NOW - 9,
                                                 "px": t.prefix, "q": t.precision,
                                                 "ai": t.intensity}))
        if t.skipped_since_s is not None:
            client.hset(KEYS.skipped, t.id, repr(t.skipped_since_s))
        if t.held:
            client.hset(KEYS.held, t.id, f"{ME} {held_until} 1")


def task(name: str, priority: float, model: str | None, skipped_s: float | None = None,
         held: bool = False, prefix: str | None = None,
         precision: str | None = None, intensity: float | None = None) -> Candidate:
    tid = f"{name}@{priority}"
    since = None if skipped_s is None else NOW - skipped_s
    return Candidate(tid, priority_level(priority), model, since, held, prefix, precision,
                     intensity)


def pick(scripts: Scripts, client: redis.Redis, policy: AffinityPolicy, warm: Warm) -> Any:
    return scripts.run("pick", KEYS, [NOW, 5, ME, 0, *lua_args(policy, warm)], client)


def expected(tasks: list[Candidate], policy: AffinityPolicy, warm: Warm) -> tuple[str, int]:
    ordered = sorted(tasks, key=lambda t: (-t.level, tasks.index(t)))
    i = choose(ordered, warm, policy, NOW)
    if i > 0:
        return ordered[i].id, 1
    return next(t.id for t in ordered if not t.held), 0


def test_pick_lua_agrees_with_the_reference_policy(r: redis.Redis, scripts: Scripts) -> None:
    rng = random.Random(11)
    models = ["x", "y", "z", None]
    checked = ahead = 0
    for _ in range(300):
        n = rng.randint(1, 14)
        tasks = [task(f"t{i}", rng.choice([300, 100, 100, 100, 90, 60, 45, 10]),
                      rng.choice(models),
                      # (a negative one: a stamp ahead of now, a clock running ahead)
                      rng.choice([None, None, 0.0, 0.3, 0.9, 1.5, 5.0, -30.0]),
                      held=rng.random() < 0.1, prefix=rng.choice([None, "p1", "p2"]),
                      precision=rng.choice([None, None, "int8", "fp16"]),
                      # (at a ridge point exactly: compute-bound, in both)
                      intensity=rng.choice([None, None, 0.0, 8.0, 200.0, 300.0, 4000.0]))
                 for i in range(n)]
        if all(t.held for t in tasks):
            continue
        policy = AffinityPolicy(window=rng.choice([0, 2, 3, 5, 16]),
                                priority_ratio=rng.choice([1.0, 2.0, 4.0]),
                                max_skip_s=rng.choice([0.5, 1.0, 10.0]))
        # engines as held: plain, or at a precision (x@int8 serves x asked at int8 only)
        warm = Warm({m: rng.choice([0.0, 0.5, 1.0]) for m in ("x", "y", "z", "x@int8", "y@fp16")
                     if rng.random() < 0.6},
                    {p: rng.choice([0.0, 0.5, 0.75]) for p in ("p1", "p2") if rng.random() < 0.4},
                    {q: rng.choice([0.0, 0.25, 0.5]) for q in ("int8", "fp16")
                     if rng.random() < 0.4},
                    # roofline bounds, with the ridge points that tell a task's bound
                    {f"{b}@{q}": rng.choice([0.0, 0.2, 0.5]) for b in ("memory", "compute")
                     for q in ("fp16", "int8") if rng.random() < 0.4},
                    {q: ridge for q, ridge in (("fp16", 200.0), ("int8", 400.0))
                     if rng.random() < 0.7})
        r.delete(*KEYS.all())
        enqueue(r, tasks)
        want_id, want_ahead = expected(tasks, policy, warm)
        head = max(tasks, key=lambda t: (t.level, -tasks.index(t)))
        got = pick(scripts, r, policy, warm)
        assert [got[0].decode(), got[4]] == [want_id, want_ahead], (tasks, policy, warm)
        # a head passed over is stamped once, with the first skip's time (afresh where
        # its stamp was ahead of now)
        stamp = r.hget(KEYS.skipped, head.id)
        since = head.skipped_since_s
        if want_ahead:
            assert float(stamp or 0) == (since if since is not None and since <= NOW
                                         else NOW)
        assert not r.hexists(KEYS.skipped, want_id)  # delivered: its skips are forgotten
        # the delivery guarantees hold either way: unacked, its score saved, gone from
        # the queue, every other task still waiting with its own score
        assert r.zscore(KEYS.unacked, want_id) == NOW
        assert r.hget(KEYS.saved, want_id) is not None
        assert r.zcard(KEYS.waiting) == n - 1
        checked += 1
        ahead += want_ahead
    # the random cases exercised both outcomes
    assert checked > 250 and 30 < ahead < checked - 30


@pytest.mark.parametrize("priority", [0.0333, 0.0412, 0.5, 1.0, 1.7, 10.0])
def test_at_a_ratio_of_one_a_warm_task_level_with_the_head_is_taken_by_both(
        r: redis.Redis, scripts: Scripts, priority: float) -> None:
    """(pick.lua's floor, without log1p and expm1, came out a hair above the head's own
    level below a priority of ~1.7: it refused what the reference took)"""
    policy = AffinityPolicy(window=4, priority_ratio=1.0, max_skip_s=10.0)
    tasks = [task("head", priority, "y"), task("warm", priority, "x")]
    enqueue(r, tasks)
    assert expected(tasks, policy, Warm({"x": 1.0}, {}, {})) == (tasks[1].id, 1)
    got = pick(scripts, r, policy, Warm({"x": 1.0}, {}, {}))
    assert [got[0].decode(), got[4]] == [tasks[1].id, 1]


@pytest.mark.parametrize("stamp", ["inf", "nan", repr(NOW + 3600)])
def test_a_skip_stamp_no_pick_wrote_does_not_pass_the_head_over_for_good(
        r: redis.Redis, scripts: Scripts, stamp: str) -> None:
    """(a head stamped inf, nan or an hour ahead, by hand or by a worker whose clock
    ran ahead, was passed over by every pick while warm tasks came behind it)"""
    policy = AffinityPolicy(max_skip_s=1.0)
    enqueue(r, [task("head", 100, "b"), *(task(f"a{i}", 100, "a") for i in range(5))])
    r.hset(KEYS.skipped, "head@100", stamp)
    args = [*lua_args(policy, Warm({"a": 1.0}))]
    # The first pick passes it over, stamping it afresh with now...
    first = scripts.run("pick", KEYS, [NOW, 5, ME, 0, *args], r)
    assert (first[0], first[4]) == (b"a0@100", 1)
    assert float(r.hget(KEYS.skipped, "head@100") or 0) == NOW
    # ... so a pick past the longest skip takes it
    later = scripts.run("pick", KEYS, [NOW + 1.5, 5, ME, 0, *args], r)
    assert (later[0], later[4]) == (b"head@100", 0)


def test_a_prompt_prefix_pulls_only_tasks_whose_engine_is_warm(
        r: redis.Redis, scripts: Scripts) -> None:
    """(the KV of a template held for one model pulled a task for another model, which
    this worker does not hold, ahead of the head: to a cold start, "by affinity")"""
    enqueue(r, [task("head", 100, "c"), task("other", 100, "b", prefix="tpl"),
                task("same", 100, "a", prefix="tpl")])
    got = pick(scripts, r, AffinityPolicy(), Warm({"a": 1.0}, {"tpl": 0.5}))
    assert (got[0], got[4]) == (b"same@100", 1)
    r.delete(*KEYS.all())
    enqueue(r, [task("head", 100, "c"), task("other", 100, "b", prefix="tpl")])
    got = pick(scripts, r, AffinityPolicy(), Warm({"a": 1.0}, {"tpl": 0.5}))
    assert (got[0], got[4]) == (b"head@100", 0)


def test_a_poison_message_chosen_by_affinity_is_parked_and_the_pick_goes_on(
        r: redis.Redis, scripts: Scripts) -> None:
    # Given a warm task behind the head that has crashed workers too often
    enqueue(r, [task("a", 100, "x"), task("b", 100, "y"), task("c", 100, "y")])
    r.hset(KEYS.redelivered, "b@100", 9)
    # When the consumer holding "y" warm picks
    got = pick(scripts, r, AffinityPolicy(), Warm({"y": 1.0}))
    # Then "b" is dead-lettered and the pick delivers the queue's head, not by affinity
    assert r.hexists(KEYS.dead, "b@100")
    assert (got[0], got[4]) == (b"a@100", 0)
    assert got[5:] == [[b"b@100"]]  # named last, for its replicas at a peer site
    assert r.zrange(KEYS.waiting, 0, -1) == [b"c@100"]


def test_a_malformed_meta_record_just_is_not_warm(r: redis.Redis, scripts: Scripts) -> None:
    enqueue(r, [task("a", 100, "x"), task("b", 100, "y"), task("c", 100, "y")])
    r.hset(KEYS.meta, "b@100", "not json")
    got = pick(scripts, r, AffinityPolicy(), Warm({"y": 1.0}))
    assert (got[0], got[4]) == (b"c@100", 1)


def test_warm_reader_reads_the_children_and_rereads_after_an_ack(
        r: redis.Redis, redis_url: str) -> None:
    config = SitsConfig(redis_url=redis_url, global_keyprefix="aff-test:")
    clock = [0.0]
    reader = warmreader.WarmReader(config, "w1@host", range(2), clock=lambda: clock[0])
    prefix = config.global_keyprefix
    try:
        # Given no child has published yet: an ack does not make the next pick read again
        assert reader() == Warm()
        r.set(advertise.child_key(prefix, "w1@host", 0), json.dumps({"warm": {"x": "host"}}))
        reader.invalidate()
        assert reader() == Warm()
        clock[0] += warmreader.WarmReader.WARM_MAX_AGE_S
        assert reader() == Warm({"x": 0.5})
        # Given two children, one with an unreadable record
        r.set(advertise.child_key(prefix, "w1@host", 0),
              json.dumps({"warm": {"x": "device", "y": "host"}, "kv_keys": ["k1"]}))
        r.set(advertise.child_key(prefix, "w1@host", 1), "garbage")
        reader.invalidate()  # a child holds an engine now: an ack means read again
        assert reader() == Warm({"x": 1.0, "y": 0.5}, {"k1": 0.5})
        # When a child's cache changes, the set is reused until an ack (or it ages out)
        r.set(advertise.child_key(prefix, "w1@host", 1), json.dumps({"warm": {"y": "device"}}))
        assert reader() == Warm({"x": 1.0, "y": 0.5}, {"k1": 0.5})
        reader.invalidate()
        assert reader() == Warm({"x": 1.0, "y": 1.0}, {"k1": 0.5})
        r.delete(advertise.child_key(prefix, "w1@host", 0))
        clock[0] += warmreader.WarmReader.WARM_MAX_AGE_S
        assert reader() == Warm({"y": 1.0})
    finally:
        r.delete(*(advertise.child_key(prefix, "w1@host", s) for s in (0, 1)))


def test_warm_reader_reads_again_after_an_ack_only_when_a_child_counted_a_change(
        r: redis.Redis, redis_url: str) -> None:
    """(a worker's main process: its children count the writes that change what routes
    work, workers/routingversions.py; a warm run's ack cost a read on every pick)"""
    from sits_queue.workers import routingversions

    config = SitsConfig(redis_url=redis_url, global_keyprefix="aff-count:")
    prefix = config.global_keyprefix
    clock = [0.0]
    routingversions.create(2)
    try:
        reader = warmreader.WarmReader(config, "w1@host", range(2), clock=lambda: clock[0])
        r.set(advertise.child_key(prefix, "w1@host", 0), json.dumps({"warm": {"x": "host"}}))
        routingversions.bump(0)
        assert reader() == Warm({"x": 0.5})
        # a warm run: the record changed (its counts), nothing that routes work did
        r.set(advertise.child_key(prefix, "w1@host", 0),
              json.dumps({"warm": {"x": "host"}, "tasks": 9}))
        reader.invalidate()
        r.set(advertise.child_key(prefix, "w1@host", 1), json.dumps({"warm": {"y": "host"}}))
        assert reader() == Warm({"x": 0.5})  # not read again
        routingversions.bump(1)  # child 1 wrote a change before its task returned
        assert reader() == Warm({"x": 0.5})  # nothing acked yet: reused until its age
        reader.invalidate()
        assert reader() == Warm({"x": 0.5, "y": 0.5})
        r.set(advertise.child_key(prefix, "w1@host", 1), json.dumps({"warm": {}}))
        clock[0] += warmreader.WarmReader.WARM_MAX_AGE_S  # counted or not, age re-reads
        assert reader() == Warm({"x": 0.5})
    finally:
        routingversions.forget()
        r.delete(*(advertise.child_key(prefix, "w1@host", s) for s in (0, 1)))


def test_warm_reader_weighs_precisions_by_the_fleets_devices(
        r: redis.Redis, redis_url: str) -> None:
    config = SitsConfig(redis_url=redis_url, global_keyprefix="prec-test:")
    prefix = config.global_keyprefix

    def worker(host: str, peaks: dict[str, float], children: int = 1) -> None:
        r.set(advertise.worker_key(prefix, host), json.dumps(
            {"hostname": host, "concurrency": children,
             "devices": [{"name": "x", "peak_tflops": peaks}]}))
        r.zadd(advertise.workers_key(prefix), {host: 1.0})  # as refresh() registers it

    try:
        # Given a T4 worker, two V100 workers, and one with a corrupt child record
        worker("t4@h", {"fp32": 8.1, "fp16": 65, "int8": 130})
        worker("v100a@h", {"fp32": 15.7, "fp16": 125})
        worker("v100b@h", {"fp32": 15.7, "fp16": 125}, children=2)
        r.set(advertise.child_key(prefix, "v100b@h", 0), "garbage")
        r.set(advertise.child_key(prefix, "v100b@h", 1), "[1, 2]")
        # Then the T4 pulls int8 tasks (and only those); the V100s fp16 (and fp32)
        assert warmreader.WarmReader(config, "t4@h", range(1))().precisions == {"int8": 0.5}
        v100 = warmreader.WarmReader(config, "v100a@h", range(1))().precisions
        assert set(v100) == {"fp16", "fp32"} and "int8" not in v100
        # And a corrupt record is left out, not fatal (status reads the same records)
        assert advertise.read_worker(r, prefix, "v100b@h")["children"] == {}
        assert len(advertise.read_workers(r, prefix)) == 3
    finally:
        r.delete(*r.keys(f"{prefix}*"))


def test_warm_reader_weighs_roofline_bounds_by_the_fleets_devices(
        r: redis.Redis, redis_url: str, scripts: Scripts) -> None:
    config = SitsConfig(redis_url=redis_url, global_keyprefix="roof-test:")
    prefix = config.global_keyprefix

    def worker(host: str, fp16_tflops: float, bandwidth_gb_s: float | None) -> None:
        r.set(advertise.worker_key(prefix, host), json.dumps(
            {"hostname": host, "concurrency": 1,
             "devices": [{"name": host, "peak_tflops": {"fp16": fp16_tflops},
                          "bandwidth_gb_s": bandwidth_gb_s}]}))
        r.zadd(advertise.workers_key(prefix), {host: 1.0})

    try:
        # Given an H200-like worker (ridge ~206 FLOP/byte) and an L4-like one (~403)
        worker("h200@h", 989.5, 4800.0)
        worker("l4@h", 121.0, 300.0)
        h200 = warmreader.WarmReader(config, "h200@h", range(1))()
        l4 = warmreader.WarmReader(config, "l4@h", range(1))()
        # Then the H200 weighs memory-bound work, the L4 compute-bound work
        assert set(h200.bounds) == {"memory@fp16"} and set(l4.bounds) == {"compute@fp16"}
        assert h200.ridges["fp16"] == pytest.approx(206.146, rel=1e-4)
        # And its pick takes a decoding task (8 FLOP/byte) from behind a prefill (5000)
        enqueue(r, [task("prefill", 100, None, intensity=5000.0),
                    task("decode", 100, None, intensity=8.0)])
        assert pick(scripts, r, config.affinity, h200)[0] == b"decode@100"
        # And a worker with no bandwidth figure (a GPU the table lacks) weighs neither
        worker("odd@h", 100.0, None)
        assert not warmreader.WarmReader(config, "odd@h", range(1))().bounds
    finally:
        r.delete(*r.keys(f"{prefix}*"))


def test_warm_reader_without_redis_means_no_affinity() -> None:
    config = SitsConfig(redis_url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    assert warmreader.WarmReader(config, "w@h", range(1))() == Warm()


# -- a real worker --------------------------------------------------------------------------

def behind_a_long_task(app: Any, r: redis.Redis, send: Callable[[], list[Any]]
                       ) -> tuple[list[Any], list[int]]:
    """Occupy the worker's one slot with a long generation, then ``send`` tasks so they
    queue behind it; their results, and the order they ran in (indices)."""
    busy = app.tasks["t.generate_slow"].apply_async(("busy", 60), sla_class="medium")
    wait_for(lambda: r.zcard(CELERY.unacked) == 1 and r.zcard(CELERY.waiting) == 0,
             FIRST_CALL_S, "the worker to start the long task")
    tasks = send()
    results = [t.get(timeout=CALL_S) for t in tasks]
    busy.get(timeout=CALL_S)
    done = [app.AsyncResult(t.id).date_done for t in tasks]
    return results, sorted(range(len(tasks)), key=lambda i: done[i])


@pytest.mark.parametrize("window", ["16", "0"])
def test_a_worker_takes_the_task_it_holds_warm_first(
        tmp_path: Path, redis_url: str, models_dir: Path, redis_client: redis.Redis,
        window: str) -> None:
    redis_client.flushall()  # earlier modules may leave messages in the celery queue
    config_path = write_config(tmp_path / "sits.toml")
    app = client_app(redis_url, config_path, f"affinity-client-{window}")
    one_model = str(int((models_dir / "gpt" / "model.safetensors").stat().st_size * 1.5))
    worker = spawn_worker(redis_url, config_path, models_dir, tmp_path, {
        "SITS_AFFINITY_WINDOW": window, "SITS_AFFINITY_MAX_SKIP_MS": "60000",
        "SITS_DEVICE_CACHE_BYTES": one_model, "SITS_HOST_CACHE_BYTES": one_model},
        concurrency=1, name=f"affinity-{window}")
    generate = app.tasks["sits.generate"]
    try:
        wait_ready(app, [worker])
        # Given a worker that used lm-a and is now busy with a long task of another model
        generate.apply_async(("warm",), model="lm-a").get(timeout=FIRST_CALL_S)
        # When two lm-b tasks and then an lm-a task queue behind a long task, at one
        # priority
        results, order = behind_a_long_task(app, redis_client, lambda: [
            generate.apply_async((prompt,), model=m, sla_class="medium")
            for prompt, m in [("ab", "lm-b"), ("cd", "lm-b"), ("ef", "lm-a")]])
        metas = [r["sits"] for r in results]
        if window == "16":
            # And a batch: lm-b, last used, waits in the host tier now (the long task's
            # model took the device); its first call is taken ahead by affinity, the
            # other gathered with it, and only the first says so (each said true)
            embed = app.tasks["sits.embed"]
            batch, batch_order = behind_a_long_task(app, redis_client, lambda: [
                embed.apply_async((text,), model=m, sla_class="medium")
                for text, m in [("x", "lm-a"), ("y1", "lm-b"), ("y2", "lm-b")]])
            assert batch_order[2] == 0, worker.log()[-3000:]
            assert [r["sits"]["batch"]["size"] for r in batch] == [1, 2, 2]
            assert [r["sits"]["affinity"] for r in batch] == [False, True, False]
    finally:
        worker.stop(timeout_s=20)
        app.close()
    if window == "16":
        # Then the worker took lm-a first: its engine was still in the host tier
        assert order == [2, 0, 1], worker.log()[-3000:]
        assert [m["source"] for m in metas] == ["disk", "device", "host"]
        assert [m["affinity"] for m in metas] == [False, False, True]
    else:
        # Then without affinity it went in queue order, lm-a last
        assert order == [0, 1, 2], worker.log()[-3000:]
        assert not any(m["affinity"] for m in metas)


@pytest.mark.parametrize("prefix_weight", ["0.5", "0"])
def test_a_worker_takes_the_task_whose_prompt_prefix_it_holds_first(
        tmp_path: Path, redis_url: str, models_dir: Path, redis_client: redis.Redis,
        prefix_weight: str) -> None:
    redis_client.flushall()
    config_path = write_config(tmp_path / "sits.toml")
    app = client_app(redis_url, config_path, f"prefix-affinity-client-{prefix_weight}")
    worker = spawn_worker(redis_url, config_path, models_dir, tmp_path, {
        "SITS_AFFINITY_MAX_SKIP_MS": "60000", "SITS_AFFINITY_PREFIX_WEIGHT": prefix_weight},
        concurrency=1, name=f"prefix-affinity-{prefix_weight}")
    template_a = "Rules A: summarise the log line, keep every number. " * 6  # 312 chars
    template_b = "Rules B: classify the ticket by team and urgency now. " * 6
    generate = app.tasks["sits.generate"]
    options = {"model": "gpt", "sla_class": "medium", "input_entropy": 0.5}
    try:
        wait_ready(app, [worker])
        # Given a worker that ran a template-A prompt (its KV kept)
        generate.apply_async((template_a + "first",), **options).get(timeout=FIRST_CALL_S)
        # When two template-B prompts and then a template-A one queue behind a long task
        results, order = behind_a_long_task(app, redis_client, lambda: [
            generate.apply_async((text,), **options)
            for text in (template_b + "one", template_b + "two", template_a + "three")])
        outputs = [r["output"] for r in results]
    finally:
        worker.stop(timeout_s=20)
        app.close()
    if prefix_weight == "0":  # no prefix affinity: queue order
        assert order == [0, 1, 2], worker.log()[-3000:]
        return
    # Then it took the template-A task first, whose prefill started after the template
    assert order[0] == 2, worker.log()[-3000:]
    assert outputs[2]["cached_tokens"] >= 48
    # and the second template-B prompt reused the first one's prefix
    assert outputs[0]["cached_tokens"] == 0 and outputs[1]["cached_tokens"] >= 48


def test_warm_reader_reads_the_slots_it_is_given(r: redis.Redis, redis_url: str) -> None:
    """(a pool shrunk by one keeps slots 1 and 2: the reader read 0 and 1, and missed
    what slot 2's child held)"""
    config = SitsConfig(redis_url=redis_url, global_keyprefix="aff-slots:")
    prefix = config.global_keyprefix
    reader = warmreader.WarmReader(config, "w@host", range(2))
    try:
        r.set(advertise.child_key(prefix, "w@host", 2), json.dumps({"warm": {"z": "device"}}))
        assert reader() == Warm()
        reader.resize([1, 2])
        assert reader.slots == (1, 2)
        assert reader() == Warm({"z": 1.0})
    finally:
        r.delete(advertise.child_key(prefix, "w@host", 2))


def test_a_steered_worker_picks_by_what_its_idle_children_hold(
        r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """(the pick weighed the union of all children's warm sets: under a backlog the one
    idle child took a task warm only in a busy one, and loaded it cold)"""
    config = SitsConfig(redis_url=redis_url, global_keyprefix="aff-idle:")
    prefix = config.global_keyprefix
    reader = warmreader.WarmReader(config, "w@host", range(2))
    pool = SimpleNamespace(_busy_workers={10}, _active_writes=set(),
                           _fileno_to_inq={10: SimpleNamespace(index=0),
                                           11: SimpleNamespace(index=1)})
    monkeypatch.setattr(steer, "_steered", steer._Steered(pool, lambda slot: None))
    try:
        for slot, model in ((0, "a"), (1, "b")):
            r.set(advertise.child_key(prefix, "w@host", slot),
                  json.dumps({"slot": slot, "warm": {model: "device"}}))
        # slot 0 busy: the pick is for slot 1, and weighs what it holds
        assert reader() == Warm({"b": 1.0})
        assert reader() is reader()  # (one object while nothing changes: picks cache on it)
        pool._busy_workers = {11}
        assert reader() == Warm({"a": 1.0})
        pool._busy_workers = set()  # both idle: either may take it
        assert reader() == Warm({"a": 1.0, "b": 1.0})
        monkeypatch.setattr(steer, "_steered", None)  # a pool not steered: the union
        assert reader() == Warm({"a": 1.0, "b": 1.0})
    finally:
        r.delete(*(advertise.child_key(prefix, "w@host", s) for s in (0, 1)))


def test_a_failing_warm_source_means_no_affinity_not_a_stopped_worker(
        caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> Warm:
        raise TypeError("a bug in the reader")

    affinity.set_warm_source(broken)
    try:
        with caplog.at_level(logging.DEBUG, logger=affinity.__name__):
            assert affinity.warm_now() is affinity.NOTHING_WARM
            assert affinity.warm_now() is affinity.NOTHING_WARM
        assert caplog.text.count("Traceback") == 1  # said once per spell
    finally:
        affinity.set_warm_source(None)
        affinity._unreadable.over()
