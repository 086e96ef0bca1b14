"""The GPU worker runtime in a real ``celery worker`` subprocess, with tiny real models.

One worker serves the whole module (starting one costs seconds: torch and transformers
load in its child). It runs on CPU here, exactly as on a GPU host minus the pinning and
the CUDA cap; the class table comes from a TOML file with two extra classes that make the
limits observable on a two-core machine: ``one`` (a single core) and ``tiny`` / ``small``
(VRAM limits below and just above a tiny model's weights). The engine cache budgets
hold exactly one model per tier, so a third model evicts.

The tests run in file order; each leaves the worker serving (checked by the next).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from sits_queue.broker import deadletters
from sits_queue.broker.keys import QueueKeys
from sits_queue.errors import (
    ContextTooLong,
    DeadLettered,
    InvalidInput,
    ModelLoadError,
    UnknownModel,
    VramLimitExceeded,
)
from sits_queue.procs import CeleryProcess
from sits_queue.workers import advertise, cores
from sits_queue.workers.advertise import read_workers
from sits_queue.workers.limits import BYTES_PER_GIB
from sits_queue.workers.request import HEADROOM_BYTES
from tests.integration.counting import counters_once
from tests.integration.inference_app import CALL_S, FIRST_CALL_S, call, serving
from tests.waiting import wait_for

WAITING = QueueKeys.for_queue("celery")




@pytest.fixture(scope="module")
def model_bytes(models_dir: Path) -> int:
    """Weights of one tiny LM, bytes (the safetensors payload; the header is noise)."""
    return (models_dir / "gpt" / "model.safetensors").stat().st_size


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_url: str, config_path: Path,
           models_dir: Path, model_bytes: int, app: Celery, r: redis.Redis
           ) -> Iterator[CeleryProcess]:
    """One worker, started without ``-c``: its pool size is the runtime's default."""
    budget = str(int(model_bytes * 1.5))  # one model per tier, never two
    with serving(redis_url, config_path, models_dir, tmp_path_factory.mktemp("worker-logs"),
                 app, {"SITS_DEVICE_CACHE_BYTES": budget, "SITS_HOST_CACHE_BYTES": budget}
                 ) as proc:
        yield proc




def assert_serving(app: Celery, worker: CeleryProcess) -> None:
    assert worker.alive(), worker.log()[-3000:]
    assert call(app, "t.describe", "still-serving")["output"]["tag"] == "still-serving"


# -- warm engines and cold-start accounting ---------------------------------------------------

def test_default_pool_is_one_child_per_device(worker: CeleryProcess) -> None:
    # Celery alone would start one child per core (two here); a CPU host has one device.
    children = psutil.Process(worker.pid).children()
    assert len(children) == 1, worker.log()[-2000:]


def test_the_child_was_forked_with_the_inference_stack_imported(
        app: Celery, worker: CeleryProcess) -> None:
    """(each child imported torch and transformers at its first model load: 4.6-5.4 s of
    a tiny model's 5 s cold start, paid again by a replacement child after a kill)"""
    assert app.send_task("x.forked_with").get(timeout=CALL_S) == [
        "torch", "transformers.modeling_utils"]


def test_second_call_is_warm(app: Celery, worker: CeleryProcess) -> None:
    first = call(app, "t.describe", "first", timeout=FIRST_CALL_S)
    second = call(app, "t.describe", "second")
    # The first call paid a cold start, each phase timed; the second found the engine ready.
    assert first["sits"]["cold"] is True and first["sits"]["source"] in ("disk", "host")
    assert second["output"] == {**first["output"], "tag": "second"}
    assert second["sits"]["cold"] is False
    assert second["sits"]["source"] == "device"
    assert second["sits"]["load_ms"] == 0 and second["sits"]["warmup_ms"] == 0
    assert second["sits"]["run_ms"] > 0
    meta = second["sits"]
    assert set(meta) >= {"cold", "source", "cuda_ctx_ms", "load_ms", "promote_ms",
                         "warmup_ms", "run_ms", "device", "sla_class", "limits"}
    assert meta["device"] == "cpu" and meta["cuda_ctx_ms"] == 0
    assert second["output"]["key"] == "gpt" and second["output"]["tokenizer"] is True


def test_a_model_load_leaves_no_progress_bar_in_the_log(app: Celery,
                                                      worker: CeleryProcess) -> None:
    # transformers' bar, on the child's redirected stderr, was two WARNING lines a load
    assert call(app, "t.describe", "loaded", timeout=FIRST_CALL_S)["output"]["key"] == "gpt"
    assert "Loading weights" not in worker.log()


def test_builtin_generate_and_embed(app: Celery, worker: CeleryProcess) -> None:
    text = call(app, "sits.generate", "the worker loads the prompt", model="gpt",
                kwargs={"max_new_tokens": 8, "stop_at_eos": False}, timeout=FIRST_CALL_S)
    assert text["output"]["tokens"] == 8 and text["output"]["prompt_tokens"] > 0
    assert isinstance(text["output"]["text"], str)
    again = call(app, "sits.generate", "the worker loads the prompt", model="gpt",
                 kwargs={"max_new_tokens": 8, "stop_at_eos": False})
    assert again["output"] == text["output"]  # greedy decoding is deterministic
    # The first token's time counts from the run's start: a cold start is in it
    cold = sum(text["sits"][f"{p}_ms"] for p in ("cuda_ctx", "load", "promote", "warmup"))
    if text["sits"]["cold"]:
        assert text["sits"]["first_token_ms"] > cold
    assert 0 < again["sits"]["first_token_ms"] <= again["sits"]["run_ms"]
    vectors = call(app, "sits.embed", ["a model serves", "the cache warms"], model="enc")
    assert vectors["sits"]["first_token_ms"] is None  # an embedding makes no tokens
    assert len(vectors["output"]) == 2 and len(vectors["output"][0]) == 64
    norm = sum(x * x for x in vectors["output"][0]) ** 0.5
    assert norm == pytest.approx(1.0, abs=1e-4)


def test_a_shared_prompt_prefix_is_prefilled_once_across_tasks(
        app: Celery, worker: CeleryProcess, r: redis.Redis) -> None:
    shared = "you summarise operations logs and keep every number. " * 3
    kwargs = {"max_new_tokens": 6, "stop_at_eos": False}
    # Given a generation whose prompt starts with a long instruction
    first = call(app, "sits.generate", shared + "disk 3 is full", model="gpt", kwargs=kwargs,
                 timeout=FIRST_CALL_S)["output"]
    # When another task's prompt starts the same way
    second = call(app, "sits.generate", shared + "node 7 is down", model="gpt",
                  kwargs=kwargs)["output"]
    # Then its prefill skipped the shared whole blocks, which the worker counts
    assert first["cached_tokens"] == 0
    assert 16 <= second["cached_tokens"] < second["prompt_tokens"]
    counters_once(r, worker.hostname, lambda c: c.get("kv_hits", 0) >= 1 and c.get(
        "kv_tokens", 0) >= second["cached_tokens"], "the KV-prefix hit to be counted")


def test_repeated_texts_are_embedded_once(app: Celery, worker: CeleryProcess,
                                          r: redis.Redis) -> None:
    texts = ["the queue is deep today", "a worker holds the encoder"]
    first = call(app, "sits.embed", texts, model="enc", timeout=FIRST_CALL_S)["output"]
    again = call(app, "sits.embed", list(reversed(texts)), model="enc")["output"]
    assert again == list(reversed(first))  # from the child's cache, the same floats
    counters_once(r, worker.hostname, lambda c: c.get("emb_cached", 0) >= 2 and c.get(
        "emb_texts", 0) >= 4, "the cached embeddings to be counted")


def test_eviction_under_a_small_budget(app: Celery, worker: CeleryProcess) -> None:
    def use(model: str) -> dict[str, Any]:
        meta: dict[str, Any] = call(app, "t.describe", model, model=model)["sits"]
        return meta

    # Given budgets that hold one model on the "device" and one in the host pool, and
    # model a used often (eviction is LRU weighted by recent use: a is the hot one)
    a1 = use("lm-a")
    for _ in range(9):
        assert use("lm-a")["cold"] is False
    # When b arrives, a is demoted to host memory (evicting anything colder there)
    b1 = use("lm-b")
    assert a1["source"] == "disk" and a1["load_ms"] > 0
    assert b1["source"] == "disk" and "lm-a" in b1["demoted"]
    # Then a comes back from host memory, not disk, and b trades places with it
    a2 = use("lm-a")
    assert a2["cold"] is True and a2["source"] == "host"
    assert a2["load_ms"] == 0 and a2["promote_ms"] > 0 and a2["demoted"] == ["lm-b"]
    # And an evicted model is read from disk again (b, for the hot a's room in the host
    # pool, when c came); the cold newcomer c loses to hot a
    c1 = use("lm-c")
    b2 = use("lm-b")
    assert c1["source"] == "disk" and "lm-a" in c1["demoted"]
    assert b2["source"] == "disk" and b2["load_ms"] > 0 and "lm-c" in b2["evicted"]


def test_warm_set_and_cold_share_are_advertised(app: Celery, worker: CeleryProcess,
                                                r: redis.Redis) -> None:
    call(app, "t.describe", "adv")

    def advertised() -> dict[str, Any] | None:
        found = [w for w in read_workers(r) if w["hostname"] == worker.hostname]
        return found[0] if found and found[0]["cold_start"]["tasks"] > 0 else None

    wait_for(lambda: advertised() is not None, 15, "the worker's advertisement")
    record = advertised()
    assert record is not None
    assert record["pid"] == worker.pid and record["concurrency"] == 1
    assert record["devices"][0]["kind"] == "cpu"
    assert record["children"]["0"]["warm"]["gpt"] == "device"
    assert record["children"]["0"]["slots"] == 1  # the pool size reached the children
    assert "gpt" in record["warm"]
    share = record["cold_start"]
    assert 0 < share["cold"] <= share["tasks"]
    counters = {k.decode(): float(v) for k, v in
                r.hgetall(advertise.counters_key("", worker.hostname)).items()}
    assert 0 < counters["cold_runs"] <= counters["runs"]
    assert share["cold_share"] == pytest.approx(counters["cold_runs"] / counters["runs"],
                                                abs=1e-5)
    assert 0 < r.ttl(f"sits:worker:{worker.hostname}") <= 15


# -- limits -----------------------------------------------------------------------------------

def test_cpu_confinement_per_class(app: Celery, worker: CeleryProcess) -> None:
    if not cores.can_pin():
        pytest.skip("a platform without CPU affinity (macOS) pins nothing")
    everything = list(cores.usable())
    one = call(app, "t.describe", "one", sla_class="one")
    wide = call(app, "t.describe", "wide", sla_class="high")
    # A one-core class runs on one core with one torch thread; "high" gets the slot's cores
    assert len(one["output"]["affinity"]) == 1 and one["output"]["torch_threads"] == 1
    assert one["sits"]["limits"]["cpus"] == one["output"]["affinity"]
    assert wide["output"]["affinity"] == everything
    assert wide["output"]["torch_threads"] == len(everything)


def test_vram_limit_of_the_class(app: Celery, worker: CeleryProcess) -> None:
    # Weights alone exceed the "tiny" class's limit (on CPU: checked against the estimate)
    with pytest.raises(VramLimitExceeded, match="limit of class 'tiny'"):
        call(app, "t.describe", "tiny", sla_class="tiny")
    # "small" holds the weights and a short generation, not a long one
    ok = call(app, "sits.generate", "a model", model="gpt", sla_class="small",
              kwargs={"max_new_tokens": 4})
    assert ok["output"]["tokens"] >= 1
    with pytest.raises(VramLimitExceeded, match="estimated working memory"):
        call(app, "sits.generate", "a model", model="gpt", sla_class="small",
             kwargs={"max_new_tokens": 200})
    assert_serving(app, worker)


def delivery_tag(r: redis.Redis, task_id: str) -> str | None:
    """The broker's id (kombu delivery tag) of the message carrying ``task_id``."""
    for tag, payload in r.hscan_iter(WAITING.payloads):
        if task_id.encode() in payload:
            return str(tag.decode())
    return None


def _drop(r: redis.Redis, tag: str) -> None:
    """A released task gone for good, before the next test: its payload deleted (a pick
    skips an id without one), and it out of the queue, where the worker may have taken
    it again meanwhile (its hold ran out on a loaded host: it was left unacked, and the
    next tests found one message too many)."""
    r.hdel(WAITING.payloads, tag)

    def gone() -> bool:
        r.zrem(WAITING.waiting, tag)  # (back from the worker's hands: taken out here)
        return r.zscore(WAITING.unacked, tag) is None and r.zscore(WAITING.waiting, tag) is None

    wait_for(gone, 30, "the released task to be out of the queue")


def _largest_device_gib(r: redis.Redis, worker: CeleryProcess) -> float:
    """What a task may declare to fit the worker's largest device in all (its headroom
    taken off), GiB, from its advertised record (host RAM on a CPU; NVML's on a GPU)."""
    record = advertise.read_worker(r, "", worker.hostname) or {}
    total = max(d["total_vram_bytes"] for d in record["devices"])
    return math.floor((total - HEADROOM_BYTES) / BYTES_PER_GIB * 1000) / 1000


def test_task_that_does_not_fit_is_released_not_failed(app: Celery, worker: CeleryProcess,
                                                        r: redis.Redis) -> None:
    # Given a task declaring more memory than the host has free, but not more than its
    # largest device holds in all (something else always holds a little of it)
    needed = _largest_device_gib(r, worker)
    big = app.tasks["t.ping"].apply_async(("big",), vram_gib=needed, sla_class="vast")
    tag = delivery_tag(r, big.id)
    assert tag is not None
    wait_for(lambda: worker.log().count(f"[{big.id}] not started here") >= 2, 30,
             "the worker to release it twice")
    # Then it is back in its queue, never run, and not counted as a redelivery
    wait_for(lambda: r.zscore(WAITING.waiting, tag) is not None, 10, "it to be waiting")
    assert r.hget(WAITING.redelivered, tag) is None
    assert big.state == "PENDING"
    # And the worker keeps serving: the higher class ahead of it, and (no head-of-line
    # blocking) a task of its own class queued behind it, well within the 4 s longest hold
    assert call(app, "t.ping", "after", sla_class="high", timeout=30) == "after"
    behind = app.tasks["t.ping"].apply_async(("behind",), sla_class="vast")
    assert behind.get(timeout=3) == "behind"
    assert r.hget(WAITING.redelivered, tag) is None and big.state == "PENDING"
    _drop(r, tag)


def test_a_task_no_worker_could_ever_start_is_dead_lettered_with_the_reason(
        app: Celery, worker: CeleryProcess, r: redis.Redis) -> None:
    """(a task declaring more than any device holds was released by every worker for
    good, its caller waiting without a word)"""
    # Given a task declaring more than the largest device of any live worker holds
    needed = _largest_device_gib(r, worker) + 1
    never = app.tasks["t.ping"].apply_async(("never",), vram_gib=needed, sla_class="vast")
    # Then its caller is told why, at once, and its message waits in the dead letters
    with pytest.raises(DeadLettered, match=rf"declares vram_gib={needed:g} but the largest "
                       r"device of any live worker has .* GiB in all.*no worker can start it"):
        never.get(timeout=30)
    letters = deadletters.read(r, WAITING.dead)
    assert [d.task_id for d in letters] == [never.id]
    assert "NoDeviceLargeEnough" in letters[0].reason
    assert r.zscore(WAITING.waiting, letters[0].id) is None
    assert r.zscore(WAITING.unacked, letters[0].id) is None
    wait_for(lambda: f"NoDeviceLargeEnough: task t.ping[{never.id}]" in worker.log(), 10,
             "the log to say why")
    r.delete(WAITING.dead)
    assert_serving(app, worker)


def test_a_task_only_another_worker_could_start_is_left_to_it(
        app: Celery, worker: CeleryProcess, r: redis.Redis) -> None:
    # Given another live worker advertising a device larger than any of this worker's
    # (its record, as that worker writes it), and a task only that device could hold
    record = advertise.read_worker(r, "", worker.hostname) or {}
    needed = _largest_device_gib(r, worker) + 1
    big = {**record["devices"][0], "total_vram_bytes": int((needed + 2) * BYTES_PER_GIB)}
    other = {**record, "hostname": "bigger@elsewhere", "devices": [big]}
    r.set(advertise.worker_key("", "bigger@elsewhere"), json.dumps(other), ex=60)
    r.zadd(advertise.workers_key(""), {"bigger@elsewhere": time.time()})
    try:
        task = app.tasks["t.ping"].apply_async(("big",), vram_gib=needed, sla_class="vast")
        # Then this worker leaves it to that one, at once for a long hold, and says why
        wait_for(lambda: f"[{task.id}] not started here" in worker.log(), 30, "the release")
        assert "the largest device of this worker has" in worker.log()
        assert "not taken back here for 60.00 s" in worker.log()
        tag = delivery_tag(r, task.id)
        wait_for(lambda: r.zscore(WAITING.waiting, tag) is not None, 10, "it to wait")
        assert r.hlen(WAITING.dead) == 0 and task.state == "PENDING"
        assert_serving(app, worker)
    finally:
        advertise.withdraw(r, "", "bigger@elsewhere", 1)
    _drop(r, tag)


def test_a_long_generation_yields_its_slot_to_a_high_task(app: Celery, worker: CeleryProcess,
                                                           r: redis.Redis) -> None:
    # Given a low-class generation of 80 steps at >= 20 ms each on the worker's one slot
    long = app.tasks["t.generate_slow"].apply_async(("the gpu", 80), sla_class="low")
    wait_for(lambda: r.zcard(WAITING.waiting) == 0 and r.zcard(WAITING.unacked) == 1, 30,
             "the generation to start")
    # When a high task arrives while it decodes, the high task is served...
    assert call(app, "t.describe", "urgent", sla_class="high",
                timeout=FIRST_CALL_S)["output"]["tag"] == "urgent"
    out = long.get(timeout=FIRST_CALL_S)["output"]
    # ...because the generation gave its slot up between steps and resumed afterwards,
    assert out["runs"] >= 2
    assert "yielded its slot" in worker.log()
    # to exactly the text an uncut run decodes ("slow" is "gpt" with a delay per step)
    uncut = app.tasks["sits.generate"].apply_async(
        ("the gpu",), {"max_new_tokens": 80, "stop_at_eos": False}, model="gpt",
    ).get(timeout=CALL_S)["output"]
    assert uncut["runs"] == 1
    assert (out["text"], out["tokens"]) == (uncut["text"], uncut["tokens"]) and out["tokens"] == 80
    assert r.hlen(WAITING.checkpoints) == 0  # the ack dropped it
    assert_serving(app, worker)


# -- failure paths: each a clear failure, the worker keeps serving -----------------------------

@pytest.mark.parametrize(("name", "args", "options", "error", "match"), [
    ("t.describe", ("x",), {"model": "no-such-model"}, UnknownModel, "no-such-model"),
    ("t.describe", ("x",), {"model": "broken"}, ModelLoadError, "weights file is corrupt"),
    ("t.describe", ("x",), {"model": "not-a-model"}, ModelLoadError, "returned int"),
    ("sits.generate", (42,), {"model": "gpt"}, InvalidInput, "prompt must be"),
    ("sits.embed", ([],), {"model": "enc"}, InvalidInput, "non-empty"),
    ("sits.generate", ("the queue " * 200,), {"model": "gpt"}, ContextTooLong, "positions"),
    ("sits.generate", ("hi",), {}, UnknownModel, "names no model"),
])
def test_failure_is_clear_and_the_worker_survives(app: Celery, worker: CeleryProcess,
                                                  name: str, args: tuple[Any, ...],
                                                  options: dict[str, Any],
                                                  error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call(app, name, *args, **options)
    assert_serving(app, worker)


def test_a_load_that_fails_once_is_retried_as_the_task_says(app: Celery, worker: CeleryProcess,
                                                             r: redis.Redis) -> None:
    """(Celery's ``autoretry_for`` wraps the task's function; the engine is fetched before
    it: a loader whose store timed out once failed the task at its first try)"""
    def counted(name: str) -> float:
        raw = r.hget(advertise.counters_key("", worker.hostname), name)
        return float(raw or 0)

    def settled() -> bool:  # (the earlier tests' counts reach Redis within half a second)
        seen = (counted("tasks"), counted("runs"))
        time.sleep(1.0)
        return seen == (counted("tasks"), counted("runs"))

    wait_for(settled, 30, "the worker's counts to settle")
    tasks, runs = counted("tasks"), counted("runs")
    out = app.tasks["t.describe_retried"].delay("again").get(timeout=FIRST_CALL_S)
    assert out["output"] == {"tag": "again", "key": "flaky"}
    assert out["sits"]["cold"] and out["sits"]["source"] == "disk"  # (loaded at the retry)
    assert "t.describe_retried[" in worker.log() and "retry: Retry in 0.1s: ModelLoadError(" \
        "\"loader for model 'flaky' failed: OSError" in worker.log()
    # counted as one task, of one run (the retry read as the same task again: it was
    # counted as no task at all)
    wait_for(lambda: (counted("tasks"), counted("runs")) == (tasks + 1, runs + 1), 15,
             "the task counted", seen=lambda: (counted("tasks"), counted("runs")))
    assert_serving(app, worker)


def test_a_model_no_worker_registers_counts_for_no_demand_or_hotness(
        app: Celery, worker: CeleryProcess, r: redis.Redis) -> None:
    """(each failed call counted for its name: the pre-warm planner sent a doomed load of
    it every interval, and the rescoring pass up-weighted it as a hot model)"""
    from sits_queue.priority.rescore import counter_key, hot_key

    def failed() -> int:
        return sum(int(v) for v in r.hvals(counter_key(app.sits, "failed")))

    before = failed()
    for model in ("nowhere-model", "gpt"):  # (a known one, failing on its input, counts)
        with pytest.raises((UnknownModel, InvalidInput)):
            call(app, "sits.generate" if model == "gpt" else "t.describe",
                 42 if model == "gpt" else "x", model=model)
    wait_for(lambda: failed() >= before + 2, 15, "the failures counted")
    hot = {k.decode() for k in r.hkeys(hot_key(app.sits))}
    demand = {k.decode() for key in r.keys("sits:demand:*") for k in r.hkeys(key)}
    assert "gpt" in hot and "gpt" in demand
    assert "nowhere-model" not in hot | demand


def test_soft_time_limit_mid_generation(app: Celery, worker: CeleryProcess) -> None:
    # Given the model loaded (a cold load can take the whole second: that case is the
    # next test's), a generation of 200 steps at >= 20 ms each, and a soft limit of 1 s
    app.tasks["t.generate_slow"].delay("warm", 1).get(timeout=FIRST_CALL_S)
    result = app.tasks["t.generate_slow"].apply_async(("the gpu", 200), soft_time_limit=1.0,
                                                      time_limit=30)
    # Then it stops between steps and says how far it got
    with pytest.raises(SoftTimeLimitExceeded, match=r"stopped after \d+ of 200"):
        result.get(timeout=FIRST_CALL_S)
    assert_serving(app, worker)


def test_a_soft_limit_hit_while_loading_keeps_the_engine_for_the_next_task(
        app: Celery, worker: CeleryProcess) -> None:
    # Given a model whose load takes past the task's soft limit
    cut = app.tasks["sits.generate"].apply_async(
        ("the gpu",), {"max_new_tokens": 2}, model="slow-load", soft_time_limit=1.0,
        time_limit=30)
    # Then the task fails at the end of the load, saying so (a load cut midway could
    # leave the child unable to import what loading needs, failing every later task)
    with pytest.raises(SoftTimeLimitExceeded, match="while loading model 'slow-load'"):
        cut.get(timeout=FIRST_CALL_S)
    # And the engine it loaded serves the next task warm
    again = app.tasks["sits.generate"].apply_async(
        ("the gpu",), {"max_new_tokens": 2}, model="slow-load").get(timeout=CALL_S)
    assert again["sits"]["cold"] is False
    assert_serving(app, worker)


def test_usr2_puts_a_childs_stacks_in_the_log_and_it_serves_on(
        app: Celery, worker: CeleryProcess) -> None:
    before = call(app, "t.describe", "usr2")["output"]["pid"]
    dumps = worker.log().count("(most recent call first)")
    # When a pool child gets SIGUSR2 (as an operator would, for a child that is stuck)
    os.kill(before, signal.SIGUSR2)
    # Then every thread's stack is in the worker's log, and the same child serves on
    # (faulthandler writes each thread's header line before its frames: wait for a frame of
    # the new dump, not only its first header, or a read between the two finds none)
    def new_frames() -> bool:
        log = worker.log()
        return (log.count("(most recent call first)") > dumps
                and "File " in log.split("(most recent call first)", dumps + 1)[-1])

    wait_for(new_frames, CALL_S, "the child's stacks in the worker's log")
    assert call(app, "t.describe", "after-usr2")["output"]["pid"] == before
    assert_serving(app, worker)


def test_hard_time_limit_replaces_the_child(app: Celery, worker: CeleryProcess,
                                           r: redis.Redis) -> None:
    from sits_queue.workers import advertise

    def failed_other() -> float:
        key = advertise.counters_key("", worker.hostname)
        return float(r.hget(key, "failed:other") or 0)

    before = call(app, "t.describe", "before")
    others = failed_other()
    # When a task ignores its soft limit and is killed at the hard one (in a class no other
    # inference task here runs in: its count is this task's alone, whenever the counts of
    # the tasks before it arrive)
    assert float(r.hget(advertise.counters_key("", worker.hostname), "tasks:vast") or 0) == 0
    hung = app.tasks["t.hang"].apply_async((60,), soft_time_limit=1, time_limit=3,
                                           sla_class="vast")
    with pytest.raises(TimeLimitExceeded):
        hung.get(timeout=CALL_S)
    # Its task is counted all the same (the child counted it once it had the engine, and
    # its deferred writer sent that while the task hung; it counted only when a run ended,
    # which a killed child never reaches)
    assert counters_once(r, worker.hostname, lambda c: "tasks:vast" in c,
                         "the killed task's count")["tasks:vast"] == 1
    # Then a new child takes the same slot (same device), starts cold, and serves
    # (limits past the class's: the new child's cold start counts against them)
    after = call(app, "t.describe", "after", timeout=FIRST_CALL_S, soft_time_limit=90,
                 time_limit=110)
    assert after["output"]["pid"] != before["output"]["pid"]
    assert after["sits"]["slot"] == before["sits"]["slot"] == 0
    assert after["sits"]["cold"] is True and after["sits"]["source"] == "disk"
    assert after["output"]["cuda_visible"] == before["output"]["cuda_visible"]
    assert worker.alive()
    assert "pinned to" in worker.log()
    # and the kill was no failure "other" of the task's (the pool's SystemExit, seen on
    # its way out: Celery counts the kill, as the README says)
    assert failed_other() == others


def test_a_failed_prewarm_counts_as_a_prewarm_failure_not_a_failed_task(
        app: Celery, worker: CeleryProcess, r: redis.Redis) -> None:
    """(a model that failed to load at a pre-warm was counted a failed inference task,
    once a pre-warm pass: the failure rate rose with no task failing)"""
    key = advertise.counters_key("", worker.hostname)

    def counted(field: str) -> float:
        return float(r.hget(key, field) or 0)

    failed, prewarm_failed = counted("failed:ModelLoadError"), counted("prewarm_failures")
    with pytest.raises(ModelLoadError):
        app.tasks["sits.prewarm"].apply_async((), model="broken").get(timeout=CALL_S)
    wait_for(lambda: counted("prewarm_failures") == prewarm_failed + 1, 30,
             "the failed pre-warm counted")
    assert counted("failed:ModelLoadError") == failed


def test_worker_record_disappears_on_shutdown(worker: CeleryProcess, r: redis.Redis) -> None:
    key = f"sits:worker:{worker.hostname}"
    assert r.exists(key)
    worker.stop(timeout_s=30)
    assert not r.exists(key)
