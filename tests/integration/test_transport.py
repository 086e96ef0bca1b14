"""The sorted-set transport against a real Redis, in-process (no worker)."""

from __future__ import annotations

import base64
import json
import math
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis
from celery import Celery, Task

from sits_queue.app import make_app
from sits_queue.broker import deadletters
from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from sits_queue.errors import DeadLettered, InvalidTaskOptions, Unroutable
from sits_queue.priority.model import starvation_bound_s
from sits_queue.priority.rescore import Rescorer, hot_key, latency_key
from tests.integration.conftest import served


def build_app(redis_url: str, **overrides: Any) -> Celery:
    config = replace(SitsConfig(redis_url=redis_url), **overrides)
    app = make_app(config, main="transport_test")

    @app.task(name="t.echo", sla_class="low", shared=False)
    def echo(tag: str) -> str:
        return tag

    return app


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    app = build_app(redis_url)
    yield app
    app.close()


def drain(app: Celery, queue: str = "celery", limit: int = 10_000) -> list[str]:
    """Pick and ack every waiting message; return each task's first argument, in order."""
    out: list[str] = []
    with app.connection_for_write() as conn:
        q = conn.SimpleQueue(queue)
        for _ in range(limit):
            try:
                msg = q.get(block=False)
            except q.Empty:
                break
            out.append(msg.payload[0][0])
            msg.ack()
        q.close()
    return out


def test_a_task_sent_to_a_route_that_reaches_no_queue_is_refused(
        app: Celery, redis_client: redis.Redis) -> None:
    """(kombu dropped it, unsaid: its caller's get() waited for good; enqueue_many
    refused the same route)"""
    from kombu import Exchange, Queue

    with pytest.raises(Unroutable, match=r"t\.echo\[.*\]: exchange 'nosuch' with routing "
                                         r"key 'zzz' reaches no queue, so it was not sent"):
        app.tasks["t.echo"].apply_async(("lost",), exchange="nosuch", routing_key="zzz")
    assert not [k for k in redis_client.scan_iter() if b"waiting" in k and
                redis_client.zcard(k)]
    # a bound key reaches its queue, as before (declared here as a worker consuming it
    # would, on a connection of its own: its binding in Redis is what routes the task)
    with app.connection_for_write() as conn:
        Queue("feed", Exchange("feeds"), routing_key="f.one")(conn.default_channel).declare()
        Queue("topical", Exchange("topics", type="topic"), routing_key="t.#")(
            conn.default_channel).declare()
    app.tasks["t.echo"].apply_async(("fed",), exchange="feeds", routing_key="f.one")
    app.tasks["t.echo"].apply_async(("plain",), exchange="celery", routing_key="celery")
    assert drain(app, "feed") == ["fed"] and drain(app) == ["plain"]
    # a topic exchange this producer never declared is a direct one to kombu (it keeps
    # exchange types in the connection's memory): its pattern matched nothing, and the
    # task was dropped; now refused, saying why
    with pytest.raises(Unroutable, match=r"exchange 'topics' .* this producer has not "
                                         r"declared that exchange"):
        app.tasks["t.echo"].apply_async(("t",), exchange="topics", routing_key="t.one")


def test_strict_priority_order_with_fifo_ties(app: Celery) -> None:
    echo = app.tasks["t.echo"]
    # Given interleaved submissions across classes, several per class
    plan = [("low", "l1"), ("high", "h1"), ("medium", "m1"), ("low", "l2"), ("high", "h2"),
            ("medium", "m2"), ("low", "l3"), ("high", "h3")]
    for cls, tag in plan:
        echo.apply_async((tag,), sla_class=cls)
    # Then the queue hands them out class by class, FIFO inside each class
    assert drain(app) == ["h1", "h2", "h3", "m1", "m2", "l1", "l2", "l3"]


def test_equal_priorities_leave_in_arrival_order_at_scale(app: Celery) -> None:
    echo = app.tasks["t.echo"]
    tags = [f"t{i:04d}" for i in range(500)]
    for tag in tags:
        # Entropy is computed from the text argument; pin it so priorities are equal.
        echo.apply_async((tag,), input_entropy=0.5)
    assert drain(app) == tags


def test_context_decay_orders_within_a_class(app: Celery) -> None:
    echo = app.tasks["t.echo"]
    echo.apply_async(("long",), sla_class="medium", context_tokens=32_000)
    echo.apply_async(("short",), sla_class="medium", context_tokens=100)
    assert drain(app) == ["short", "long"]


def test_rescoring_moves_a_waiting_task_ahead(app: Celery, redis_client: redis.Redis) -> None:
    echo = app.tasks["t.echo"]
    # Given two equal low-class tasks for different models, "cold" first
    echo.apply_async(("cold",), sla_class="low", model="cold-model")
    echo.apply_async(("hot",), sla_class="low", model="hot-model")
    # When the hot model gets many calls and a rescoring pass runs
    redis_client.hincrbyfloat(hot_key(app.sits), "hot-model", 50.0)
    report = Rescorer(app.sits, redis_client).rescore_all()
    # Then the later task now leaves first
    # (the cold task's score may change too: the class's bandwidth compliance moved)
    assert report is not None and report.seen == 2 and report.rewritten >= 1
    assert drain(app) == ["hot", "cold"]


def test_the_pass_forgets_empty_direct_queues_of_departed_workers(
        app: Celery, redis_client: redis.Redis) -> None:
    """One ``<hostname>.dq2`` per worker ever started (per deploy, with containers):
    once its worker's advertisement is gone and it is empty, it leaves the registry."""
    from sits_queue.broker.keys import queues_registry
    from sits_queue.workers.advertise import worker_key, workers_key

    echo = app.tasks["t.echo"]
    registry = queues_registry("")
    names = ("live@h.dq2", "gone@h.dq2", "gone-busy@h.dq2")
    redis_client.sadd(registry, *names)
    redis_client.set(worker_key("", "live@h"), "{}", ex=60)  # advertised
    redis_client.zadd(workers_key(""), {"live@h": 1.0, "gone@h": 1.0})  # (gone expired)
    echo.apply_async(("left",), queue="gone-busy@h.dq2")      # a departed one's task
    # the departed one got a task once (its counters stay) and is bound to Celery's C.dq2
    echo.apply_async(("ran",), queue="gone@h.dq2")
    gone = QueueKeys.for_queue("gone@h.dq2")
    drain(app, queue="gone@h.dq2")
    bindings = ("_kombu.binding.C.dq2", "_kombu.binding_permanent.C.dq2")
    for key in bindings:
        redis_client.sadd(key, "gone@h\x06\x16\x06\x16gone@h.dq2",
                          "live@h\x06\x16\x06\x16live@h.dq2")
    assert redis_client.exists(gone.seq, gone.arrivals) == 2
    report = Rescorer(app.sits, redis_client).rescore_all()
    assert report is not None
    members = {m.decode() for m in redis_client.smembers(registry)}
    assert {"live@h.dq2", "gone-busy@h.dq2"} <= members and "gone@h.dq2" not in members
    # with its keys and its bindings (kept: the live worker's, and the busy queue)
    assert redis_client.exists(*gone.all()) == 0
    for key in bindings:
        assert redis_client.smembers(key) == {b"live@h\x06\x16\x06\x16live@h.dq2"}
    assert redis_client.zcard(QueueKeys.for_queue("gone-busy@h.dq2").waiting) == 1
    # a put to it registers it again
    echo.apply_async(("again",), queue="gone@h.dq2")
    assert redis_client.sismember(registry, "gone@h.dq2")


def test_the_pass_takes_control_reply_queues_out_of_the_registry(
        app: Celery, redis_client: redis.Redis) -> None:
    # (an older version listed those a worker replied to; a stray reply had no expiry)
    from sits_queue.broker.keys import queues_registry

    reply = "0b5e-42.reply.celery.pidbox"
    keys = QueueKeys.for_queue(reply)
    redis_client.sadd(queues_registry(""), reply, "celery")
    redis_client.zadd(keys.waiting, {"late-reply": 1.0})
    redis_client.hset(keys.payloads, "late-reply", "{}")
    assert Rescorer(app.sits, redis_client).rescore_all() is not None
    assert redis_client.smembers(queues_registry("")) == {b"celery"}
    assert 0 < redis_client.ttl(keys.waiting) <= 60 and redis_client.ttl(keys.payloads) > 0


@pytest.mark.parametrize("odd", [
    {"sla": 0},  # a latency SLA of 0 (a foreign writer): the score divided by it
    # (each of these was scored past every other task, or to the bottom, and rewritten)
    {"ls": math.inf}, {"n": -999}, {"n": 2.5}, {"e": 5.0}, {"sla": "fast"}, {"t": math.nan},
])
def test_a_record_that_cannot_be_scored_keeps_its_score_and_the_pass_goes_on(
        odd: dict[str, Any], app: Celery, redis_client: redis.Redis) -> None:
    echo = app.tasks["t.echo"]
    echo.apply_async(("bad",), sla_class="low")
    echo.apply_async(("good",), sla_class="low", model="hot-model")
    keys = QueueKeys.for_queue("celery")
    (bad_id,) = [i for i, raw in redis_client.hgetall(keys.meta).items() if b"hot" not in raw]
    record = json.loads(redis_client.hget(keys.meta, bad_id))
    redis_client.hset(keys.meta, bad_id, json.dumps({**record, **odd}))
    before = redis_client.zscore(keys.waiting, bad_id)
    redis_client.hincrbyfloat(hot_key(app.sits), "hot-model", 50.0)
    redis_client.lpush(latency_key(app.sits, "low"), 900.0)  # a p95 for the risk term
    report = Rescorer(app.sits, redis_client).rescore_all()
    assert report is not None and report.seen == 2 and report.rewritten == 1
    assert redis_client.zscore(keys.waiting, bad_id) == before
    assert drain(app) == ["good", "bad"]


def test_records_no_producer_writes_stop_neither_the_pass_nor_the_trigger_check(
        app: Celery, redis_client: redis.Redis) -> None:
    """(JSON nested 100k deep raised RecursionError out of the pass, for every queue at
    every pass; a top-class record put at -1e308 s waited an infinite time, which failed
    every trigger check)"""
    echo = app.tasks["t.echo"]
    for tag in ("deep", "ancient", "good"):
        echo.apply_async((tag,), sla_class="high", model=tag)
    keys = QueueKeys.for_queue("celery")
    ids = {json.loads(raw)["m"]: i for i, raw in redis_client.hgetall(keys.meta).items()}
    redis_client.hset(keys.meta, ids["deep"], "[" * 100_000 + "]" * 100_000)
    ancient = json.loads(redis_client.hget(keys.meta, ids["ancient"]))
    redis_client.hset(keys.meta, ids["ancient"], json.dumps({**ancient, "t": -1e308}))
    rescorer = Rescorer(app.sits, redis_client)
    report = rescorer.rescore_all()
    assert report is not None and report.seen == 3
    now = time.time()
    wait = rescorer.oldest_top_class_wait_ms(now + 1.0)
    assert wait is not None and 1000.0 <= wait < 60_000.0  # the good one's
    assert "backlog" not in rescorer.check_triggers(now)  # (it raised)
    assert sorted(drain(app)) == ["ancient", "deep", "good"]


def test_a_task_of_a_class_the_table_lacks_ages_as_the_default_class(
        app: Celery, redis_client: redis.Redis) -> None:
    from sits_queue.broker.keys import decode_score

    echo = app.tasks["t.echo"]
    echo.apply_async(("known",), sla_class="low")
    echo.apply_async(("renamed",), sla_class="low")
    keys = QueueKeys.for_queue("celery")
    # Given both waiting an hour, one of a class the table no longer has (renamed while
    # it waited; a peer site's replica taken over, whose table differs)
    ids = {}
    for msg_id, raw in redis_client.hgetall(keys.meta).items():
        record = json.loads(raw)
        record["t"] -= 3600
        name = "renamed" if not ids else "known"
        if name == "renamed":
            record["c"] = "bulk"
        ids[name] = msg_id
        redis_client.hset(keys.meta, msg_id, json.dumps(record))
    # When a pass runs, both age (the unknown one kept its score for good: never aged,
    # it could wait forever behind newer work)
    report = Rescorer(app.sits, redis_client).rescore_all()
    assert report is not None and report.rewritten == 2
    known, _ = decode_score(redis_client.zscore(keys.waiting, ids["known"])) or (0.0, 0)
    renamed, _ = decode_score(redis_client.zscore(keys.waiting, ids["renamed"])) or (0.0, 0)
    # (scored in the default class, medium, which outranks low at the same wait)
    assert known > 800_000 and renamed >= known


def test_a_model_no_longer_called_fades_out_of_the_hotness_hash(
        app: Celery, redis_client: redis.Redis) -> None:
    rescorer = Rescorer(app.sits, redis_client)
    key = hot_key(app.sits)
    redis_client.hset(key, mapping={"old-model": 0.0105, "busy-model": 40.0})
    rescorer.gather_snapshot(time.time())
    # the faded one is gone (not kept at ~0 for ever); the busy one decays
    assert redis_client.hget(key, "old-model") is None
    assert float(redis_client.hget(key, "busy-model")) == pytest.approx(36.0)
    # a model called between the pass's read and its prune is kept
    redis_client.hset(key, "again-model", 0.0105)
    redis_client.hincrbyfloat(key, "again-model", 1.0)
    assert rescorer.scripts.run_on("prune_hot", [key], [0.01, "again-model"],
                                   redis_client) == 0
    assert redis_client.hget(key, "again-model") is not None


def test_hotness_ages_by_time_not_by_pass(app: Celery, redis_client: redis.Redis) -> None:
    """A standing top-class backlog fires the trigger every check (1 s), each a pass: by
    pass, hotness would fade five times faster than at the beat's 5 s exactly when it
    matters."""
    rescorer = Rescorer(app.sits, redis_client)
    key = hot_key(app.sits)
    redis_client.hset(key, "m", 100.0)
    rescorer.gather_snapshot(1000.0)  # no earlier pass: one interval's decay
    assert float(redis_client.hget(key, "m")) == pytest.approx(90.0)
    for k in range(1, 6):  # five triggered passes within one interval
        rescorer.gather_snapshot(1000.0 + k)
    assert float(redis_client.hget(key, "m")) == pytest.approx(81.0)
    rescorer.gather_snapshot(900.0)  # a clock gone back: one interval, as if unknown
    assert float(redis_client.hget(key, "m")) == pytest.approx(72.9)


def test_aging_lets_an_old_low_task_overtake_fresh_high_ones(app: Celery,
                                                             redis_client: redis.Redis) -> None:
    echo = app.tasks["t.echo"]
    keys = QueueKeys.for_queue("celery")
    echo.apply_async(("old-low",), sla_class="low")
    (low_id,) = redis_client.zrange(keys.waiting, 0, -1)
    echo.apply_async(("high",), sla_class="high")
    rescorer = Rescorer(app.sits, redis_client)
    # A pass now keeps class order...
    rescorer.rescore_all()
    assert redis_client.zrange(keys.waiting, 0, 0) != [low_id]
    # ...but once the low task has waited past the starvation bound, it goes first.
    meta = json.loads(redis_client.hget(keys.meta, low_id))
    meta["t"] -= starvation_bound_s(app.sits) * 1.01
    redis_client.hset(keys.meta, low_id, json.dumps(meta))
    rescorer.rescore_all()
    assert drain(app) == ["old-low", "high"]


def test_a_class_keeping_up_lumpily_is_not_read_as_falling_behind(
        app: Celery, redis_client: redis.Redis) -> None:
    from sits_queue.priority.rescore import counter_key

    rescorer = Rescorer(app.sits, redis_client)
    echo = app.tasks["t.echo"]
    now = time.time()
    rescorer.gather_snapshot(now)  # the baseline
    readings = []
    # Given passes a second apart (a standing backlog's triggers), in which a low class
    # finishes exactly what arrives, lumpily: 2 arrive and 1 finishes, then 0 and 1
    for second in range(1, 21):
        if second % 2:
            echo.apply_async(("a",), sla_class="low")
            echo.apply_async(("b",), sla_class="low")
        redis_client.hincrby(counter_key(app.sits, "done"), "low", 1)
        readings.append(rescorer.gather_snapshot(now + second).classes["low"]
                        .bandwidth_compliance)
    # Then it reads as keeping up once its counts have some history (pass by pass it
    # read 0.5 every other second)
    assert min(readings[10:]) > 0.9, readings


def test_the_beats_own_tasks_are_not_top_class_backlog_or_arrivals(
        app: Celery, redis_client: redis.Redis) -> None:
    rescorer = Rescorer(app.sits, redis_client)
    rescorer.gather_snapshot(time.time())  # the baseline the next pass diffs against
    # Given only low-class work waiting, and a beat period's maintenance tasks queued
    # (they are sent as the top class, to the control queue, and never counted done)
    app.tasks["t.echo"].delay("low work")
    for _ in range(5):
        app.tasks["sits.check_triggers"].apply_async()
    app.tasks["sits.rescore"].apply_async()
    # nor a pre-warm the planner sent (in the top class, to a worker's own queue)
    app.tasks["sits.prewarm"].apply_async((), model="m", sla_class=app.sits.top_class,
                                          queue="w1.dq2")
    later = time.time() + 5.0
    # Then no top-class backlog is seen, the 200 ms trigger does not fire ...
    assert rescorer.oldest_top_class_wait_ms(later) is None
    assert "backlog" not in rescorer.check_triggers(later)
    # ... and the top class is not read as falling behind its arrivals
    top = app.sits.top_class
    assert rescorer.gather_snapshot(later).classes[top].bandwidth_compliance == 1.0
    # while a real top-class task waiting is seen
    app.tasks["t.echo"].apply_async(("urgent",), sla_class=top)
    wait = rescorer.oldest_top_class_wait_ms(time.time() + 1.0)
    assert wait is not None and wait >= 900


def test_the_rtt_trigger_reads_the_least_of_a_checks_pings(
        app: Celery, redis_client: redis.Redis) -> None:
    """(one PING timed the process's scheduling too: a worker starting on a loaded host
    fired "rtt" at every check, a rescoring pass and a log line a second)"""
    class Stalled:
        """A client whose first PING of each check is held up (a busy host)."""

        def __init__(self) -> None:
            self.pings = 0

        def ping(self) -> bool:
            self.pings += 1
            if self.pings % 3 == 1:
                time.sleep(0.05)
            return bool(redis_client.ping())

        def __getattr__(self, name: str) -> Any:
            return getattr(redis_client, name)

    rescorer = Rescorer(app.sits, redis_client)
    rescorer.client = Stalled()  # type: ignore[assignment]
    for _ in range(3):
        assert "rtt" not in rescorer.check_triggers()
    state = json.loads(redis_client.get(f"{app.sits.global_keyprefix}sits:state:triggers")
                       or b"{}")
    assert state["state"]["rtt_baseline_ms"] < 40, state


def test_a_task_put_after_the_trigger_check_read_its_clock_has_waited_nothing(
        app: Celery, redis_client: redis.Redis) -> None:
    # (a producer's clock ahead of the beat's, or a put racing the check: the negative
    # wait raised, and the check, its state with it, was lost at every tick)
    rescorer = Rescorer(app.sits, redis_client)
    before = time.time() - 5.0
    app.tasks["t.echo"].apply_async(("urgent",), sla_class=app.sits.top_class)
    assert rescorer.oldest_top_class_wait_ms(before) == 0.0
    assert "backlog" not in rescorer.check_triggers(before)


def test_a_scheduling_record_with_an_unreadable_time_is_walked_past(
        app: Celery, redis_client: redis.Redis) -> None:
    # (a foreign writer's integer past float's range: OverflowError stopped the trigger
    # check and `sitsq status`)
    top = app.sits.top_class
    app.tasks["t.echo"].apply_async(("urgent",), sla_class=top)
    keys = QueueKeys.for_queue("celery")
    redis_client.hset(keys.meta, "foreign", f'{{"c": "{top}", "t": 1{"0" * 400}}}')
    redis_client.zadd(keys.waiting, {"foreign": 0})
    wait = Rescorer(app.sits, redis_client).oldest_top_class_wait_ms(time.time() + 1.0)
    assert wait is not None and wait >= 900


def test_a_corrupt_stored_snapshot_never_stops_submissions(
        app: Celery, redis_client: redis.Redis) -> None:
    # (a newer beat's extra field, a NaN: every enqueue raised while they stood)
    redis_client.set("sits:stats", b'{"classes": {"high": {"p95_ms": 10, "p99_ms": 20}},'
                                   b' "hotness": {"m": NaN}}')
    app.tasks["t.echo"].apply_async(("kept",), sla_class="high", model="m")
    redis_client.set("sits:stats", b"not json")
    app.tasks["t.echo"].apply_async(("also",), sla_class="low")
    assert drain(app) == ["kept", "also"]


def test_invalid_options_enqueue_nothing(app: Celery, redis_client: redis.Redis) -> None:
    echo = app.tasks["t.echo"]
    bad: list[dict[str, Any]] = [{"sla_class": "urgent"}, {"context_tokens": -5},
                                 {"latency_sla_ms": float("nan")}, {"loss_sensitivity": 3},
                                 {"input_entropy": 1.5}, {"vram_gib": -1},
                                 {"context_tokens": 1.5}, {"model": ""},
                                 # past a float's range: float() of them overflows
                                 {"context_tokens": 10**400}, {"vram_gib": 10**400},
                                 {"latency_sla_ms": 10**400}, {"loss_sensitivity": -10**400}]
    for options in bad:
        with pytest.raises(InvalidTaskOptions) as info:
            echo.apply_async(("x",), **options)
        assert next(iter(options)) in str(info.value)
    assert redis_client.zcard(QueueKeys.for_queue("celery").waiting) == 0


def test_class_sets_time_limits_and_header(app: Celery, redis_client: redis.Redis) -> None:
    app.tasks["t.echo"].apply_async(("x",), sla_class="high", model="m", context_tokens=7)
    keys = QueueKeys.for_queue("celery")
    (msg_id,) = redis_client.zrange(keys.waiting, 0, -1)
    message = json.loads(redis_client.hget(keys.payloads, msg_id))
    assert message["headers"]["timelimit"] == [45, 36]
    assert message["headers"]["sits"]["sla_class"] == "high"
    assert message["headers"]["sits"]["context_tokens"] == 7


def stored_headers(redis_client: redis.Redis) -> list[dict[str, Any]]:
    keys = QueueKeys.for_queue("celery")
    return [json.loads(redis_client.hget(keys.payloads, i))["headers"]
            for i in redis_client.zrange(keys.waiting, 0, -1)]


def test_every_publish_path_carries_and_checks_the_sits_options(
        app: Celery, redis_client: redis.Redis) -> None:
    # send_task by name, a registered task's defaults or not, as `celery call` does
    app.send_task("t.echo", ("named",), sla_class="high", model="m")
    app.send_task("t.elsewhere", ("unknown here",))
    with pytest.raises(InvalidTaskOptions, match="unknown sla_class"):
        app.send_task("t.echo", ("x",), sla_class="nonexistent")
    # a header made by hand is checked too (it was trusted, and every worker met a
    # vram_gib no class admits, releasing the task for ever)
    for header, why in [({"sla_class": "bogus"}, "unknown sla_class"),
                        ({"vram_gib": "lots"}, "vram_gib must be a number"),
                        ({"vram_gib": 1e6}, "vram_gib must be in"),
                        ({"sla_class": "low", "vram_gib": 60}, "exceeds the 'low' class"),
                        # (one that is no object was replaced by the defaults, unsaid)
                        ("high", "header 'sits' must be an object, got str"),
                        ([1], "header 'sits' must be an object, got list")]:
        with pytest.raises(InvalidTaskOptions, match=why):
            app.send_task("t.echo", ("x",), headers={"sits": header})
    # ... and SITS options beside it are refused, not sent unchecked and unused
    with pytest.raises(InvalidTaskOptions, match=r"both in a hand-made 'sits' header and "
                       r"as keywords \(precision, vram_gib\)"):
        app.send_task("t.echo", ("x",), headers={"sits": {"sla_class": "high"}},
                      vram_gib=-5, precision="fp8")
    # ... and its class sets the time limits, as the keyword's would (none were sent)
    app.send_task("t.echo", ("by hand",), headers={"sits": {"sla_class": "low"}})
    # ... and a pair of limits given beside it is checked as the keywords' are (sent as
    # given: -5, "x", a soft limit past the hard one)
    for limits, why in [((-5, -10), "time_limit must be a positive number"),
                        (("x", "y"), "time_limit must be a positive number"),
                        ((5, 50), "soft_time_limit 50 s must not exceed")]:
        with pytest.raises(InvalidTaskOptions, match=why):
            app.send_task("t.echo", ("x",), headers={"sits": {"sla_class": "high"}},
                          time_limit=limits[0], soft_time_limit=limits[1])
    # apply_async takes a hand-made header send_task's way: checked, and honoured (it
    # was replaced by the task's defaults unsaid: "high" ran as medium, "nope" was taken)
    with pytest.raises(InvalidTaskOptions, match="unknown sla_class 'nope'"):
        app.tasks["t.echo"].apply_async(("x",), headers={"sits": {"sla_class": "nope"}})
    app.tasks["t.echo"].apply_async(("hand-made async",),
                                    headers={"sits": {"sla_class": "high"}})

    # a task on a plain celery.Task base (the Celery docs' DatabaseTask pattern)
    class PlainBase(Task):  # type: ignore[misc]
        pass

    @app.task(name="t.plain_base", base=PlainBase, sla_class="low", shared=False)
    def plain(x: str) -> str:
        return x

    plain.delay("plain base")
    with pytest.raises(InvalidTaskOptions):
        plain.apply_async(("x",), sla_class="bogus-class")
    got = {h["argsrepr"]: h for h in stored_headers(redis_client)}
    assert got["('named',)"]["sits"]["sla_class"] == "high"
    assert got["('named',)"]["sits"]["model"] == "m"
    assert got["('named',)"]["timelimit"] == [45, 36]
    assert got["('unknown here',)"]["sits"]["sla_class"] == "medium"  # the default class
    assert got["('plain base',)"]["sits"]["sla_class"] == "low"
    assert got["('plain base',)"]["timelimit"] == [10, 8]
    assert got["('by hand',)"]["sits"]["sla_class"] == "low"
    assert got["('by hand',)"]["timelimit"] == [10, 8]
    assert got["('hand-made async',)"]["sits"]["sla_class"] == "high"
    assert got["('hand-made async',)"]["timelimit"] == [45, 36]
    # every path stamps the submission time (the class stats' latency: a hand-made
    # header's tasks had none)
    assert all(isinstance(h.get("sits_submitted_at"), float) for h in got.values())
    assert len(got) == 5


def test_unacked_messages_are_restored_never_lost(redis_url: str,
                                                  redis_client: redis.Redis) -> None:
    app = build_app(redis_url, visibility_timeout_s=4.0)
    for i in range(20):
        app.tasks["t.echo"].delay(f"m{i}")
    keys = QueueKeys.for_queue("celery")
    # Given a consumer that picks 5 messages, acks 2 and then vanishes without a word
    conn = app.connection_for_write()
    q = conn.SimpleQueue("celery")
    picked = [q.get(block=False) for _ in range(5)]
    for m in picked[:2]:
        m.ack()
    q.consumer.channel.qos.stop_heartbeat()  # as silent as a dead one (no thread beats)
    assert redis_client.zcard(keys.unacked) == 3
    assert redis_client.zcard(keys.waiting) == 15
    # When the visibility timeout passes and another consumer sweeps
    redis_client.zadd(keys.unacked, {m.delivery_tag: time.time() - 10 for m in picked[2:]})
    app2 = build_app(redis_url, visibility_timeout_s=4.0)
    with app2.connection_for_write() as conn2:
        ch = conn2.default_channel
        ch.basic_consume("celery", no_ack=False, callback=lambda *a: None, consumer_tag="t")
        ch.qos._last_sweep = -1e9
        served(redis_client)  # (the queue's other workers sweep it: no gap holds this one)
        ch.qos.restore_visible()
    # Then the three unacked ones are back, the two acked ones are gone, nothing else moved
    got = drain(app2)
    acked = {m.payload[0][0] for m in picked[:2]}
    assert sorted(got) == sorted({f"m{i}" for i in range(20)} - acked)
    assert redis_client.hlen(keys.payloads) == 0
    restored = [m.payload[0][0] for m in picked[2:]]
    assert got[:3] == restored  # they kept their old (earlier) place
    conn.release()
    app.close()
    app2.close()


def test_heartbeat_keeps_held_messages_from_being_restored(redis_url: str,
                                                          redis_client: redis.Redis) -> None:
    app = build_app(redis_url, visibility_timeout_s=4.0)
    app.tasks["t.echo"].delay("held")
    keys = QueueKeys.for_queue("celery")
    with app.connection_for_write() as conn:
        q = conn.SimpleQueue("celery")
        msg = q.get(block=False)
        redis_client.zadd(keys.unacked, {msg.delivery_tag: time.time() - 10})
        q.consumer.channel.qos.heartbeat()
        deadline = redis_client.zscore(keys.unacked, msg.delivery_tag)
        assert deadline is not None and deadline > time.time() - 2
        msg.ack()
    assert redis_client.zcard(keys.unacked) == 0


def test_a_late_ack_after_a_restore_leaves_nothing_waiting(app: Celery,
                                                           redis_client: redis.Redis) -> None:
    app.tasks["t.echo"].delay("slow heartbeat")
    keys = QueueKeys.for_queue("celery")
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        message = channel.basic_get("celery")  # its holder then looks silent to the sweep
        assert channel._run("restore", "celery", [time.time() + 1, 100]) == 1
        message.ack()  # the task had finished: its ack comes late
        assert redis_client.zcard(keys.waiting) == 0 and channel._size("celery") == 0
        assert channel._purge("celery") == 0
        assert not redis_client.hexists(keys.payloads, message.delivery_tag)


def test_requeue_and_reject(app: Celery, redis_client: redis.Redis) -> None:
    keys = QueueKeys.for_queue("celery")
    app.tasks["t.echo"].delay("a")
    app.tasks["t.echo"].delay("b")
    with app.connection_for_write() as conn:
        q = conn.SimpleQueue("celery")
        first = q.get(block=False)
        first.requeue()
        again = q.get(block=False)
        assert again.payload[0][0] == "a" and again.delivery_info.get("redelivered")
        again.reject()
        last = q.get(block=False)
        assert last.payload[0][0] == "b"
        last.ack()
    dead = redis_client.hgetall(keys.dead)
    assert len(dead) == 1
    assert json.loads(next(iter(dead.values())))["reason"] == "rejected by consumer"


def test_a_foreign_message_without_a_delivery_tag_is_requeued_from_the_dead_letters(
        app: Celery, redis_client: redis.Redis) -> None:
    """A producer that leaves properties.delivery_tag out: the pick tags the message in
    memory only, and its requeue raised KeyError, stopping at it."""
    keys = QueueKeys.for_queue("celery")
    app.tasks["t.echo"].delay("ours")
    with app.connection_for_write() as conn:
        q = conn.SimpleQueue("celery")
        ours = q.get(block=False)
        # its payload as a producer that sets no tag would have written it
        stored = json.loads(redis_client.hget(keys.payloads, ours.delivery_tag) or b"")
        del stored["properties"]["delivery_tag"]
        redis_client.hset(keys.payloads, ours.delivery_tag, json.dumps(stored))
        ours.reject()
        app.tasks["t.echo"].delay("second")
        second = q.get(block=False)
        second.reject()
        done, refused = deadletters.requeue(conn.default_channel, "celery",
                                            [ours.delivery_tag, second.delivery_tag])
        assert done == [ours.delivery_tag, second.delivery_tag] and refused == {}
        # back under their own ids, and they run
        again = [q.get(block=False) for _ in range(2)]
        assert {m.delivery_tag for m in again} == set(done)
        assert sorted(m.payload[0][0] for m in again) == ["ours", "second"]
        q.close()
    assert redis_client.hlen(keys.dead) == 0


def _before_the_requeue_script(channel: Any, meanwhile: Any) -> None:
    """Make ``channel``'s next requeue.lua call run ``meanwhile()`` first: after the
    requeue read its letters, before it puts them back."""
    run = channel._run

    def run_later(script: str, queue: str, args: list[Any]) -> Any:
        if script == "requeue":
            meanwhile()
        return run(script, queue, args)

    channel._run = run_later


def test_two_requeues_of_a_letter_at_once_put_it_back_once(
        app: Celery, redis_client: redis.Redis) -> None:
    """(both read the record, both put the message back: a worker that picked it between
    the two puts ran it twice)"""
    keys = QueueKeys.for_queue("celery")
    app.tasks["t.echo"].delay("x")
    with app.connection_for_write() as worker, app.connection_for_write() as cli, \
            app.connection_for_write() as other:
        got = worker.default_channel.basic_get("celery")
        got.reject()  # dead
        tag = got.delivery_tag

        def another_requeue_and_a_pick() -> None:
            assert deadletters.requeue(other.default_channel, "celery", [tag]) == ([tag], {})
            assert worker.default_channel.basic_get("celery").delivery_tag == tag

        _before_the_requeue_script(cli.default_channel, another_requeue_and_a_pick)
        done, refused = deadletters.requeue(cli.default_channel, "celery", [tag])
        assert done == [] and "requeued or dropped meanwhile" in refused[tag], refused
        # running once: held by the worker, not waiting a second time
        assert redis_client.zcard(keys.waiting) == 0
        assert redis_client.zscore(keys.unacked, tag) is not None
        assert redis_client.hlen(keys.dead) == 0


def test_a_letter_dead_lettered_anew_after_the_requeue_read_it_stays_dead(
        app: Celery, redis_client: redis.Redis) -> None:
    """(put back, then its record dropped: a worker that met it in between and rejected
    it again wrote a record the requeue deleted, leaving the message nowhere)"""
    keys = QueueKeys.for_queue("celery")
    app.tasks["t.echo"].delay("x")
    with app.connection_for_write() as worker, app.connection_for_write() as cli, \
            app.connection_for_write() as other:
        got = worker.default_channel.basic_get("celery")
        got.reject()
        tag = got.delivery_tag
        first = redis_client.hget(keys.dead, tag)

        def requeued_and_rejected_again() -> None:
            deadletters.requeue(other.default_channel, "celery", [tag])
            worker.default_channel.basic_get("celery").reject()  # dead again, anew

        _before_the_requeue_script(cli.default_channel, requeued_and_rejected_again)
        done, refused = deadletters.requeue(cli.default_channel, "celery", [tag])
    assert done == [] and tag in refused
    # the second dead letter stands, and nothing was put back: the message is somewhere
    again = redis_client.hget(keys.dead, tag)
    assert again is not None and again != first and redis_client.zcard(keys.waiting) == 0


def test_a_letter_whose_body_is_no_task_is_not_requeued(app: Celery,
                                                        redis_client: redis.Redis) -> None:
    keys = QueueKeys.for_queue("celery")
    app.tasks["t.echo"].delay("x")
    (tag,) = redis_client.hkeys(keys.payloads)
    stored = json.loads(redis_client.hget(keys.payloads, tag) or b"")
    stored["body"] = base64.b64encode(json.dumps("hello").encode()).decode()  # no [args..]
    redis_client.hset(keys.payloads, tag, json.dumps(stored))
    with app.connection_for_write() as conn:
        assert conn.default_channel.basic_get("celery") is None  # dead-lettered
        done, refused = deadletters.requeue(conn.default_channel, "celery", [tag])
    # (it was put back, to be dead-lettered again by the first worker to meet it)
    assert done == [] and "body is not a task's [args" in refused[tag.decode()]
    assert "drop it instead" in refused[tag.decode()]
    assert redis_client.hexists(keys.dead, tag) and redis_client.zcard(keys.waiting) == 0


def kombu_message(**changes: Any) -> bytes:
    """A stored payload shaped like kombu's, with ``changes`` at its top level."""
    message: dict[str, Any] = {"body": "", "content-type": "application/json",
                               "content-encoding": "utf-8", "properties": {}, "headers": {}}
    return json.dumps({**message, **changes}).encode()


@pytest.mark.parametrize("garbage", [
    b"not json at all", b"[1, 2, 3]", b'{"body": "x"}',
    kombu_message(properties={"delivery_info": 5}),
    kombu_message(headers=["not", "an", "object"]),
    kombu_message(body={"not": "a string"}),
    kombu_message(headers={"task": ["unhashable"]}),
    # kombu's typed values that do not decode (TypeError, InvalidOperation, ValueError)
    kombu_message(headers={"x": {"__type__": "uuid", "__value__": 5}}),
    kombu_message(headers={"x": {"__type__": "decimal", "__value__": "abc"}}),
    kombu_message(headers={"x": {"__type__": "nosuchtype", "__value__": 1}}),
    # bodies kombu's Message() cannot decode: an unknown codec, bad base64
    kombu_message(body="eA==", properties={"body_encoding": "rot13"}),
    kombu_message(body="x", properties={"body_encoding": "base64"}),
    b'{"body": "", "properties": {}, "headers": {"x": NaN}, "content-type": 5}',
])
def test_malformed_payload_is_dead_lettered_and_the_queue_keeps_flowing(
        app: Celery, redis_client: redis.Redis, garbage: bytes) -> None:
    keys = QueueKeys.for_queue("celery")
    app.tasks["t.echo"].delay("good")
    # A foreign writer slips a bad payload in front of the good message
    redis_client.hset(keys.payloads, "bad-1", garbage)
    redis_client.zadd(keys.waiting, {"bad-1": 0})
    assert drain(app) == ["good"]
    record = json.loads(redis_client.hget(keys.dead, "bad-1"))
    assert "malformed payload" in record["reason"]
    assert record["payload"] == garbage.decode()


def test_orphan_id_without_payload_is_skipped(app: Celery, redis_client: redis.Redis) -> None:
    keys = QueueKeys.for_queue("celery")
    redis_client.zadd(keys.waiting, {"ghost": 0})
    app.tasks["t.echo"].delay("real")
    assert drain(app) == ["real"]


def test_poison_message_is_dead_lettered_after_max_redeliveries(
        redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    app = build_app(redis_url, max_redeliveries=2)
    keys = QueueKeys.for_queue("celery")
    result = app.tasks["t.echo"].delay("poison")
    with app.connection_for_write() as conn:
        q = conn.SimpleQueue("celery")
        for _ in range(3):  # delivered, then restored twice (as if it killed two workers)
            q.get(block=False).requeue()
        with pytest.raises(q.Empty):
            q.get(block=False)
    (message_id,) = redis_client.hkeys(keys.dead)
    record = json.loads(redis_client.hget(keys.dead, message_id))
    assert "poison" in record["reason"]
    # said in the log of the consumer whose pick met it
    assert (f"queue 'celery': 1 message(s) redelivered more than 2 times dead-lettered as "
            f"poison (sitsq dead list): {message_id.decode()}") in caplog.text
    # and its caller learns why instead of waiting for ever
    with pytest.raises(DeadLettered, match=r"redelivered 3 times \(poison message\)"):
        result.get(timeout=10)
    assert result.state == "FAILURE"


def test_size_purge_delete(app: Celery, redis_client: redis.Redis) -> None:
    for i in range(2500):
        app.tasks["t.echo"].delay(str(i))
    with app.connection_for_write() as conn:
        conn.SimpleQueue("celery")  # declares and binds, as a worker would
        ch = conn.default_channel
        assert ch._size("celery") == 2500
        assert ch.queue_purge("celery") == 2500
        assert ch._size("celery") == 0
        app.tasks["t.echo"].delay("again")
        ch.queue_delete("celery")
    assert not redis_client.keys("sits:{celery}:*")


def test_global_keyprefix_namespaces_every_key(redis_url: str, redis_client: redis.Redis) -> None:
    app = build_app(redis_url, global_keyprefix="tenant1:")
    app.tasks["t.echo"].delay("x")
    assert redis_client.zcard("tenant1:sits:{celery}:z") == 1
    assert not redis_client.exists("sits:{celery}:z")
    assert drain(app) == ["x"]
    assert redis_client.hlen("tenant1:sits:{celery}:p") == 0


@pytest.mark.parametrize("junk", [b"{not json", b"[1]", b'{"state": {"bogus": 1}}',
                                  b'{"done": "x"}'])
def test_a_trigger_record_no_check_wrote_is_replaced_by_the_next_check(
        junk: bytes, app: Celery, redis_client: redis.Redis) -> None:
    """(each failed every trigger check, once a second, before the write that would have
    replaced it)"""
    from sits_queue.priority.rescore import _state_key

    key = _state_key(app.sits, "triggers")
    redis_client.set(key, junk)
    rescorer = Rescorer(app.sits, redis_client)
    rescorer.check_triggers()
    assert set(json.loads(redis_client.get(key))) == {"done", "failed", "state"}


def test_a_submission_validates_its_options_once(app: Celery,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``apply_async`` validates them; ``send_task`` and the put read back the header it
    made (they validated it twice more: a sixth of what ``delay()`` cost)."""
    import sits_queue.calloptions
    import sits_queue.options

    resolved: list[Any] = []
    real = sits_queue.options.resolve

    def counted(*args: Any, **kwargs: Any) -> Any:
        resolved.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(sits_queue.options, "resolve", counted)
    monkeypatch.setattr(sits_queue.calloptions, "resolve", counted)
    for tag in ("a", "b", "c"):
        app.tasks["t.echo"].apply_async((tag,), sla_class="high")
    assert len(resolved) == 3
    app.send_task("t.echo", ("d",), sla_class="medium")
    assert len(resolved) == 4
    assert drain(app) == ["a", "b", "c", "d"]
