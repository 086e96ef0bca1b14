"""Bulk submission (``enqueue_many``) against a real Redis and a real worker."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery, signals
from kombu import Exchange, Queue
from kombu.exceptions import EncodeError

from sits_queue.app import make_app
from sits_queue.broker.bulk import BulkEnqueueError, enqueue_many
from sits_queue.broker.keys import SEQ_BITS, QueueKeys
from sits_queue.broker.scripts import Scripts
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidTaskOptions, SitsError
from sits_queue.procs import CeleryProcess
from tests.integration.test_transport import drain

Spawn = Callable[..., CeleryProcess]
KEYS = QueueKeys.for_queue("celery")


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    # Sent events on (they are opt-in), so the event tests below have something to see.
    app = make_app(SitsConfig(redis_url=redis_url, send_sent_events=True), main="bulk_test")

    @app.task(name="t.echo", sla_class="low", shared=False)
    def echo(tag: str, n: int = 0) -> str:
        return tag

    yield app
    app.close()


def payloads(client: redis.Redis) -> dict[str, dict[str, Any]]:
    """Waiting message id -> kombu message, from the payload hash."""
    return {k.decode(): json.loads(v) for k, v in client.hgetall(KEYS.payloads).items()}


def first_arg(message: dict[str, Any]) -> str:
    body = json.loads(base64.b64decode(message["body"]))
    return str(body[0][0])


def levels(client: redis.Redis) -> dict[str, int]:
    """Task tag -> priority level part of its score."""
    by_id = payloads(client)
    return {first_arg(by_id[m.decode()]): int(score) >> SEQ_BITS
            for m, score in client.zrange(KEYS.waiting, 0, -1, withscores=True)}


def normalised(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its per-submission ids and clock readings blanked out, and its body
    decoded: bulk submission may write the same JSON body without kombu's spaces."""
    m: dict[str, Any] = json.loads(json.dumps(message))
    m["body"] = json.loads(base64.b64decode(m["body"]))
    for key in ("id", "root_id", "sits_submitted_at"):
        m["headers"][key] = "-"
    m["properties"]["delivery_tag"] = m["properties"]["correlation_id"] = "-"
    return m


@pytest.mark.parametrize("prompt", ["hello world", "a long shared instruction. " * 12])
def test_bulk_message_is_the_message_apply_async_sends(app: Celery, redis_client: redis.Redis,
                                                      prompt: str) -> None:
    echo = app.tasks["t.echo"]
    options: dict[str, Any] = {"sla_class": "high", "model": "summarizer",
                               "context_tokens": 300, "headers": {"trace": "abc"}}
    # Given one task sent each way with the same arguments and options
    sent = echo.apply_async((prompt,), {"n": 3}, **options)
    (single,) = payloads(redis_client).values()
    single_meta = json.loads(next(iter(redis_client.hvals(KEYS.meta))))
    redis_client.flushall()
    (task_id,) = enqueue_many(echo, [(prompt,)], kwargs_list=[{"n": 3}], **options)
    (bulk,) = payloads(redis_client).values()
    bulk_meta = json.loads(next(iter(redis_client.hvals(KEYS.meta))))
    # Then the stored messages agree on everything but ids and clock readings
    assert normalised(bulk) == normalised(single)
    assert bulk["headers"]["id"] == task_id
    assert bulk["headers"]["timelimit"] == [45, 36.0]
    assert bulk["headers"]["trace"] == "abc"
    single_meta.pop("t")
    bulk_meta.pop("t")
    assert (single_meta.pop("id"), bulk_meta.pop("id")) == (sent.id, task_id)
    assert bulk_meta == single_meta
    # (a prompt of 256+ characters gets a prefix key, the same one both ways)
    assert (bulk_meta["px"] is not None) == (len(prompt) >= 256)


def test_a_bulk_priority_is_noted_once_as_apply_async_s_is(
        app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    """(the README promises the producer is told once; enqueue_many said nothing)"""
    with caplog.at_level("WARNING", logger="sits_queue.app"):
        enqueue_many(app.tasks["t.echo"], [("a",)], priority=0)
        assert not caplog.records
        enqueue_many(app.tasks["t.echo"], [("a",), ("b",)], priority=7)
        enqueue_many(app.tasks["t.echo"], [("c",)], priority=7)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "priority=7 does not order SITS queues" in said[0]


@pytest.mark.parametrize("form", ["naive", "naive ISO string", "aware"])
def test_an_expiry_date_is_read_as_apply_async_reads_it(
        app: Celery, redis_client: redis.Redis, form: str) -> None:
    """(a naive datetime, which apply_async reads as UTC, raised TypeError here)"""
    due = datetime.now(timezone.utc) + timedelta(seconds=60)
    naive = due.replace(tzinfo=None)
    expires = {"naive": naive, "naive ISO string": naive.isoformat(), "aware": due}[form]
    enqueue_many(app.tasks["t.echo"], [("a",)], expires=expires)
    (message,) = payloads(redis_client).values()
    assert 55_000 <= int(message["properties"]["expiration"]) <= 60_000


@pytest.mark.parametrize("options", [
    {"sla_class": "urgent"}, {"context_tokens": -5}, {"latency_sla_ms": float("nan")},
    {"loss_sensitivity": 3}, {"input_entropy": 1.5}, {"vram_gib": -1}, {"model": ""},
    {"prefix_key": ""}, {"prefix_key": 7},
])
def test_invalid_options_raise_and_enqueue_nothing(app: Celery, redis_client: redis.Redis,
                                                   options: dict[str, Any]) -> None:
    items = [(f"t{i}",) for i in range(50)]
    with pytest.raises(InvalidTaskOptions) as info:
        enqueue_many(app.tasks["t.echo"], items, chunk=10, **options)
    assert next(iter(options)) in str(info.value)
    assert redis_client.zcard(KEYS.waiting) == 0
    assert redis_client.hlen(KEYS.payloads) == 0


def classes(client: redis.Redis, queue: str) -> list[str]:
    """The classes of ``queue``'s waiting tasks, as the broker records them."""
    meta = QueueKeys.for_queue(queue).meta
    return sorted(json.loads(v)["c"] for v in client.hvals(meta))


def test_a_route_s_sits_options_apply_as_they_do_to_delay(app: Celery,
                                                          redis_client: redis.Redis) -> None:
    """(enqueue_many took the route's queue and dropped its class: the README says a
    task_routes entry's options are checked and applied the same way on every path)"""
    app.conf.task_routes = {"t.echo": {"queue": "bulkq", "sla_class": "high"},
                            "t.bad": {"queue": "bulkq", "sla_class": "nope"}}

    @app.task(name="t.bad", shared=False)
    def bad(tag: str) -> str:
        return tag

    echo = app.tasks["t.echo"]
    echo.delay("one")
    enqueue_many(echo, [("two",), ("three",)])
    assert classes(redis_client, "bulkq") == ["high"] * 3
    with pytest.raises(InvalidTaskOptions, match="unknown sla_class 'nope'"):
        enqueue_many(bad, [("four",)])


def test_a_hand_made_header_is_checked_and_used_as_apply_async_uses_it(
        app: Celery, redis_client: redis.Redis) -> None:
    """(enqueue_many replaced a hand-made ``sits`` header with the task's defaults,
    unchecked: class "high" went as "low", "nope" was enqueued)"""
    echo = app.tasks["t.echo"]
    by_hand = {"sits": {"sla_class": "high"}}
    echo.apply_async(("async",), headers=by_hand)
    enqueue_many(echo, [("bulk",)], headers=by_hand)
    got = {first_arg(m): m["headers"] for m in payloads(redis_client).values()}
    assert got["bulk"]["sits"]["sla_class"] == got["async"]["sits"]["sla_class"] == "high"
    assert got["bulk"]["timelimit"] == got["async"]["timelimit"] == [45, 36]
    assert classes(redis_client, "celery") == ["high", "high"]
    with pytest.raises(InvalidTaskOptions, match="unknown sla_class 'nope'"):
        enqueue_many(echo, [("x",)], headers={"sits": {"sla_class": "nope"}})
    with pytest.raises(InvalidTaskOptions, match="both in a hand-made 'sits' header"):
        enqueue_many(echo, [("x",)], headers=by_hand, sla_class="low")
    assert redis_client.zcard(KEYS.waiting) == 2


def test_a_route_of_an_exchange_and_key_reaches_the_queue_delay_reaches(
        app: Celery, redis_client: redis.Redis) -> None:
    """(Celery's router names no queue for it, and enqueue_many failed on a bare
    KeyError('queue'); delay() lands in the queue bound to that exchange and key)"""
    bound = Queue("q1", Exchange("ex1"), routing_key="rk1")
    app.conf.task_queues = [Queue("celery"), bound]
    app.conf.task_routes = {"t.echo": {"exchange": "ex1", "routing_key": "rk1"}}
    echo = app.tasks["t.echo"]
    with pytest.raises(SitsError, match="exchange 'ex1' with routing key 'rk1' reaches none"):
        enqueue_many(echo, [("lost",)])  # bound by no worker yet: delay() drops it
    with app.connection_for_write() as conn:  # as a worker consuming q1 binds it
        bound.bind(conn.default_channel).declare()
    echo.delay("one")
    enqueue_many(echo, [("two",), ("three",)])
    assert redis_client.zcard(QueueKeys.for_queue("q1").waiting) == 3
    assert redis_client.zcard(KEYS.waiting) == 0
    with app.connection_for_write() as conn:  # a second queue on the same key
        Queue("q2", Exchange("ex1"), routing_key="rk1").bind(conn.default_channel).declare()
    with pytest.raises(SitsError, match=r"reaches \['q1', 'q2'\]"):
        enqueue_many(echo, [("four",)])


@pytest.mark.parametrize(("items", "kwargs_list", "options", "error"), [
    ([("a",), "b"], None, {}, TypeError),  # an item that is not an argument tuple
    ([("a",), ("b", 1, 2, 3)], None, {}, TypeError),  # does not fit the signature
    ([("a",)], [{"n": 1}, {"n": 2}], {}, ValueError),  # lengths differ
    ([("a",)], None, {"task_id": "x"}, TypeError),  # meaningless for a batch
])
def test_malformed_items_raise_before_anything_is_sent(
        app: Celery, redis_client: redis.Redis, items: list[Any],
        kwargs_list: list[dict[str, Any]] | None, options: dict[str, Any],
        error: type[Exception]) -> None:
    with pytest.raises(error):
        enqueue_many(app.tasks["t.echo"], items, kwargs_list=kwargs_list, **options)
    assert redis_client.zcard(KEYS.waiting) == 0


def test_items_from_any_iterable_are_taken_in_its_order(app: Celery,
                                                       redis_client: redis.Redis) -> None:
    """(a generator, a set or a dict's keys failed on len() or slicing, naming neither)"""
    echo = app.tasks["t.echo"]
    ids = enqueue_many(echo, ((f"g{i}",) for i in range(5)), chunk=2,
                       kwargs_list=iter([None] * 5))
    ids += enqueue_many(echo, {("s",)}) + enqueue_many(echo, {("k",): 1}.keys())
    by_task = {m["headers"]["id"]: first_arg(m) for m in payloads(redis_client).values()}
    assert len(ids) == 7 and set(by_task) == set(ids)
    assert [by_task[i] for i in ids] == ["g0", "g1", "g2", "g3", "g4", "s", "k"]
    for bad in ("abc", b"abc", {"a": 1}, 5):
        with pytest.raises(TypeError, match="arg_list must be an iterable of argument tuples"):
            enqueue_many(echo, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kwargs_list must be an iterable"):
        enqueue_many(echo, [("a",)], kwargs_list={"n": 1})  # type: ignore[arg-type]
    assert redis_client.zcard(KEYS.waiting) == 7


def test_a_failing_later_chunk_reports_what_was_enqueued(app: Celery,
                                                        redis_client: redis.Redis) -> None:
    echo = app.tasks["t.echo"]
    # Given a batch whose 25th item cannot be serialised, sent in chunks of 10
    items: list[tuple[Any, ...]] = [(f"t{i}",) for i in range(30)]
    items[24] = (object(),)
    with pytest.raises(BulkEnqueueError) as info:
        enqueue_many(echo, items, chunk=10)
    # Then the first two chunks are in the queue, whole, and the error says which
    assert len(info.value.task_ids) == 20
    assert redis_client.zcard(KEYS.waiting) == 20
    # And when the very first chunk fails, nothing is enqueued and the cause surfaces as is
    redis_client.flushall()
    with pytest.raises(EncodeError):
        enqueue_many(echo, [(object(),)], chunk=10)
    assert redis_client.zcard(KEYS.waiting) == 0


@pytest.mark.parametrize("ran", [True, False])
def test_a_chunk_whose_reply_is_lost_is_reported_as_enqueued_or_uncertain(
        app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
        ran: bool) -> None:
    start, calls = Scripts.start, []

    def losing(self: Scripts, name: str, keys: Any, args: Any, client: Any) -> Any:
        calls.append(name)
        if len(calls) != 2:
            return start(self, name, keys, args, client)
        reply = start(self, name, keys, args, client) if ran else None

        def lost() -> Any:  # the connection drops before the reply is read
            if reply is not None:
                reply()  # (Redis ran the chunk)
            raise redis.ConnectionError("Connection closed by server.")
        return lost

    monkeypatch.setattr(Scripts, "start", losing)
    with pytest.raises(BulkEnqueueError) as info:
        enqueue_many(app.tasks["t.echo"], [(f"t{i}",) for i in range(6)], chunk=2)
    waiting = redis_client.zcard(KEYS.waiting)
    if ran:  # it is in the queue, and said so: a retry of the rest will not duplicate it
        assert len(info.value.task_ids) == waiting == 4 and info.value.uncertain_ids == []
    else:  # nothing says it ran: the caller is told to check those two
        assert len(info.value.task_ids) == waiting == 2
        assert len(info.value.uncertain_ids) == 2 and "2 may have been" in str(info.value)


def test_a_chunk_ends_at_its_byte_bound_whatever_its_count(
        app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """(counted in messages alone, 200 large items were built in memory at once)"""
    from sits_queue.broker import bulk

    monkeypatch.setattr(bulk, "CHUNK_BYTES", 2_500_000)
    start, sizes = Scripts.start, []

    def counting(self: Scripts, name: str, keys: Any, args: Any, client: Any) -> Any:
        if name == "put":  # each message's bytes (five put.lua arguments per message)
            sizes.append([sum(len(x) for x in args[i:i + 5] if isinstance(x, (bytes, str)))
                          for i in range(0, len(args), 5)])
        return start(self, name, keys, args, client)

    monkeypatch.setattr(Scripts, "start", counting)
    # Given 7 items of 1 MB each, in chunks of up to 200 messages
    tags = [f"{i}" + "x" * 1_000_000 for i in range(7)]
    ids = enqueue_many(app.tasks["t.echo"], [(t,) for t in tags], input_entropy=0.5)
    # Then each chunk stopped at the message that took it to 2.5 MB (each ~1.3 MB
    # encoded), and the last one had the rest
    assert len(sizes) > 1 and sum(len(c) for c in sizes) == 7
    for chunk in sizes:
        assert sum(chunk[:-1]) < bulk.CHUNK_BYTES
    assert all(sum(chunk) >= bulk.CHUNK_BYTES for chunk in sizes[:-1])
    assert len(ids) == redis_client.zcard(KEYS.waiting) == 7
    assert drain(app) == tags


def test_chunks_larger_than_a_put_slice_keep_arrival_order(app: Celery,
                                                          redis_client: redis.Redis) -> None:
    # Given one chunk of 1,234 equal-priority tasks: put.lua writes it in several slices
    tags = [f"t{i:04d}" for i in range(1234)]
    ids = enqueue_many(app.tasks["t.echo"], [(t,) for t in tags], chunk=1234,
                       input_entropy=0.5)
    # Then all are stored, each once, and they leave in submission order
    assert len(ids) == redis_client.zcard(KEYS.waiting) == redis_client.hlen(KEYS.meta) == 1234
    assert drain(app) == tags


def test_unusual_scalars_arrive_as_submitted(app: Celery, redis_client: redis.Redis) -> None:
    # Given arguments the JSON fast path cannot write (an int beyond 64 bits, NaN, a lone
    # surrogate) next to plain ones: those bodies go through kombu's serializer instead
    values: list[Any] = [10**30, float("nan"), "\ud800", "plain", 7, -0.5]
    enqueue_many(app.tasks["t.echo"], [(v,) for v in values], input_entropy=0.5)
    bodies = [json.loads(base64.b64decode(m["body"])) for m in payloads(redis_client).values()]
    got = sorted(repr(b[0][0]) for b in bodies)
    assert got == sorted(repr(v) for v in values)


def test_publish_signals_fire_per_item_as_for_apply_async(app: Celery,
                                                         redis_client: redis.Redis) -> None:
    seen: list[tuple[str, str, Any]] = []

    def before(sender: str, body: Any, headers: dict[str, Any], **_: Any) -> None:
        seen.append(("before", headers["id"], body[0][0]))

    def after(sender: str, body: Any, headers: dict[str, Any], **_: Any) -> None:
        seen.append(("after", headers["id"], body[0][0]))

    signals.before_task_publish.connect(before, weak=False)
    signals.after_task_publish.connect(after, weak=False)
    try:
        ids = enqueue_many(app.tasks["t.echo"], [("a",), ("b",), ("c",)], chunk=2)
    finally:
        signals.before_task_publish.disconnect(before)
        signals.after_task_publish.disconnect(after)
    # Every item is announced before it is built and after its chunk is in Redis
    assert [s for s in seen if s[0] == "before"] == [("before", i, t)
                                                    for i, t in zip(ids, "abc", strict=True)]
    assert [s for s in seen if s[0] == "after"] == [("after", i, t)
                                                   for i, t in zip(ids, "abc", strict=True)]
    # and "after" for the first chunk comes only once it was sent, never before its build
    assert seen.index(("after", ids[0], "a")) > seen.index(("before", ids[1], "b"))


PLAN: list[tuple[dict[str, Any], list[str]]] = [
    ({"sla_class": "low"}, ["low-1", "low-2", "low-3"]),
    ({"sla_class": "high", "context_tokens": 4000}, ["long-high-1", "long-high-2"]),
    ({"sla_class": "medium", "model": "embedder"}, ["med-1", "med-2"]),
    # Texts of different entropy: the same class and options, yet different priorities.
    ({"sla_class": "high"}, ["aaaaaaaa", "zq8#kL!x@3vP", "high-1", "bbbbbbbb"]),
    ({"sla_class": "low", "input_entropy": 0.5}, ["low-fixed-1", "low-fixed-2"]),
]


def test_priority_order_equals_apply_async_order(app: Celery,
                                                 redis_client: redis.Redis) -> None:
    echo = app.tasks["t.echo"]
    # Given the same submissions once one by one, once in one bulk call per option set
    for options, tags in PLAN:
        for tag in tags:
            echo.apply_async((tag,), **options)
    single_levels = levels(redis_client)
    single_order = drain(app)
    redis_client.flushall()
    for options, tags in PLAN:
        enqueue_many(echo, [(tag,) for tag in tags], **options)
    # Then every task gets the same priority level and they leave in the same order
    assert levels(redis_client) == single_levels
    assert drain(app) == single_order
    assert len(set(single_levels.values())) > 4  # the plan really spans several levels


def test_sent_events_go_out_as_one_multi_event_per_chunk(app: Celery,
                                                         redis_client: redis.Redis) -> None:
    echo = app.tasks["t.echo"]
    echo.delay("declare")  # the first publish declares the event exchange
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe("*celeryev*")
    time.sleep(0.1)
    ids = enqueue_many(echo, [(f"t{i}",) for i in range(25)], chunk=10)
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 5
    while len(events) < 25 and time.monotonic() < deadline:
        got = pubsub.get_message(timeout=0.5)
        if got is None:
            continue
        message = json.loads(got["data"])
        assert message["properties"]["delivery_info"]["routing_key"] == "task.multi"
        events += json.loads(base64.b64decode(message["body"]))
    pubsub.close()
    assert [e["type"] for e in events] == ["task-sent"] * 25
    assert [e["uuid"] for e in events] == ids
    assert {e["queue"] for e in events} == {"celery"}


@pytest.mark.slow
def test_five_thousand_bulk_tasks_run_on_a_real_worker(spawn: Spawn, client_app: Celery,
                                                       redis_client: redis.Redis) -> None:
    n = 5000
    add = client_app.tasks["w.add"]
    # Given 5,000 additions submitted in one bulk call, positional and keyword arguments
    ids = enqueue_many(add, [(i,) for i in range(n)],
                       kwargs_list=[{"y": 2 * i} for i in range(n)], sla_class="low")
    assert len(set(ids)) == n
    assert redis_client.zcard(KEYS.waiting) == n
    # When real workers consume them
    spawn(concurrency=2)
    spawn(concurrency=2)
    backend = client_app.backend
    keys = [backend.get_key_for_task(task_id) for task_id in ids]
    deadline = time.monotonic() + 240
    metas: list[Any] = []
    while time.monotonic() < deadline:
        metas = redis_client.mget(keys)
        # task_track_started: a task still running has a STARTED record, not its result
        if all(m is not None and json.loads(m)["status"] not in ("STARTED", "PENDING")
               for m in metas):
            break
        time.sleep(0.5)
    # Then every task succeeded with its own result
    assert all(m is not None for m in metas), f"{metas.count(None)} results missing"
    results = [json.loads(m) for m in metas]
    failed = [(i, r["status"], r["result"]) for i, r in zip(ids, results, strict=True)
              if r["status"] != "SUCCESS"]
    assert not failed, failed[:5]
    assert [r["result"] for r in results] == [3 * i for i in range(n)]
    assert redis_client.zcard(KEYS.waiting) == 0


@pytest.mark.parametrize("measured", [True, False])
def test_options_a_publish_receiver_changes_are_the_ones_scheduled(
        measured: bool, app: Celery, redis_client: redis.Redis) -> None:
    """As for apply_async: a ``before_task_publish`` receiver that changes the class is
    followed by the stored record (the bulk path scored the item with the class it was
    given, while its message said another)."""
    def lower(sender: str, headers: dict[str, Any], **_: Any) -> None:
        headers["sits"]["sla_class"] = "low"

    options: dict[str, Any] = {"sla_class": "high"}
    if not measured:
        options["input_entropy"] = 0.5
    signals.before_task_publish.connect(lower, weak=False)
    try:
        ids = enqueue_many(app.tasks["t.echo"], [("a",), ("b",)], **options)
    finally:
        signals.before_task_publish.disconnect(lower)
    seen = {}
    for msg_id, message in payloads(redis_client).items():
        record = json.loads(redis_client.hget(KEYS.meta, msg_id) or "")
        seen[message["headers"]["id"]] = (record["c"], message["headers"]["sits"]["sla_class"])
    assert seen == {task_id: ("low", "low") for task_id in ids}
