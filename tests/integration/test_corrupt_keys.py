"""Queue keys that another program wrote: a key of another type than SITS keeps there,
or a count or score that is no number. A script touching them either runs whole or
writes nothing (``lua/queue_types.lua``): no message is lost or enqueued twice, and a
worker leaves the queue for a while instead of stopping. Real Redis, real workers."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from sits_queue.broker.keys import QueueKeys
from sits_queue.broker.scripts import Scripts
from sits_queue.procs import CeleryProcess
from tests.integration.conftest import served
from tests.waiting import wait_for

KEYS = QueueKeys.for_queue("celery")
SCRIPTS = Scripts.register()


def waiting_ids(client: redis.Redis) -> list[bytes]:
    return list(client.zrange(KEYS.waiting, 0, -1))


@pytest.mark.parametrize("key", ["payloads", "meta", "marker", "waiting", "arrivals"])
def test_a_put_onto_a_key_of_another_type_writes_nothing_and_says_which(
        key: str, client_app: Celery, redis_client: redis.Redis) -> None:
    """(it wrote the message, then failed on the arrivals counter or the marker: the
    producer's retry wrote it again, and the task ran twice)"""
    client_app.tasks["w.add"].apply_async((1, 1))
    before = {name: redis_client.dump(getattr(KEYS, name))
              for name in ("waiting", "payloads", "meta", "arrivals", "marker", "seq")}
    if key == "arrivals":  # (read after the sequence is taken: that one moves on)
        del before["seq"]
    redis_client.delete(getattr(KEYS, key))
    redis_client.set(getattr(KEYS, key), "junk")
    # (the arrivals counter is read before anything is written: Redis's own refusal)
    said = "WRONGTYPE" if key == "arrivals" else \
        f"SITS_WRONGTYPE key {getattr(KEYS, key)} holds a string.*nothing was done"
    with pytest.raises(Exception, match=said):
        client_app.tasks["w.add"].apply_async((2, 2), retry=False)
    for name, dumped in before.items():
        if name != key:
            assert redis_client.dump(getattr(KEYS, name)) == dumped


@pytest.mark.parametrize("key", ["payloads", "meta", "waiting"])
def test_a_put_of_many_slices_onto_a_key_of_another_type_leaves_the_queue_as_it_was(
        key: str, client_app: Celery, redis_client: redis.Redis) -> None:
    """A put of 1,200 messages is written in three slices: the key's refusal comes in the
    first, and what that slice wrote before it is undone."""
    client_app.tasks["w.add"].apply_async((1, 1))
    before = {name: redis_client.dump(getattr(KEYS, name))
              for name in ("waiting", "payloads", "meta", "arrivals")}
    redis_client.delete(getattr(KEYS, key))
    redis_client.set(getattr(KEYS, key), "junk")
    args: list[object] = []
    for i in range(1200):
        args += [f"many-{i}", "{}", "{}", 2 ** 32, "medium"]
    with pytest.raises(redis.ResponseError, match=f"SITS_WRONGTYPE key {getattr(KEYS, key)}"):
        SCRIPTS.run("put", KEYS, args, redis_client)
    for name, dumped in before.items():
        if name != key:
            assert redis_client.dump(getattr(KEYS, name)) == dumped, name


def test_a_refused_put_of_a_waiting_messages_id_leaves_that_message_waiting(
        client_app: Celery, redis_client: redis.Redis) -> None:
    """(a put that undid its writes on a refusal took the earlier message's payload and
    place with them: it could not tell a field it overwrote from one it added)"""
    client_app.tasks["w.add"].apply_async((1, 1))
    (msg_id,) = waiting_ids(redis_client)
    payload = redis_client.hget(KEYS.payloads, msg_id)
    redis_client.delete(KEYS.meta)
    redis_client.set(KEYS.meta, "junk")
    with pytest.raises(redis.ResponseError, match="SITS_WRONGTYPE"):
        SCRIPTS.run("put", KEYS, [msg_id, "{}", "{}", 2 ** 32, "medium"], redis_client)
    assert waiting_ids(redis_client) == [msg_id]
    assert redis_client.hget(KEYS.payloads, msg_id) == payload


@pytest.mark.parametrize("key", ["redelivered", "dead", "payloads"])
def test_a_requeue_onto_a_key_of_another_type_writes_nothing_and_keeps_the_letter(
        key: str, client_app: Celery, redis_client: redis.Redis) -> None:
    """(requeue.lua puts the letter back and drops its record in one step: a refusal
    half-way would leave it queued and dead both, or nowhere)"""
    from sits_queue.broker import deadletters

    client_app.tasks["w.add"].apply_async((1, 1))
    (msg_id,) = waiting_ids(redis_client)
    with client_app.connection_for_write() as conn:
        channel = conn.default_channel
        channel._run("dead", "celery", [time.time(), "test: parked", msg_id.decode()])
        redis_client.hset(KEYS.redelivered, msg_id, 3)
        before = {name: redis_client.dump(getattr(KEYS, name))
                  for name in ("waiting", "payloads", "meta", "dead", "redelivered", "seq")}
        if key != "dead":  # (the record must be read first: a hash)
            redis_client.delete(getattr(KEYS, key))
            redis_client.set(getattr(KEYS, key), "junk")
        else:
            record = redis_client.hget(KEYS.dead, msg_id)

            def dead_key_replaced(name: str, queue: str, args: list[object]) -> object:
                if name == "requeue":
                    redis_client.delete(KEYS.dead)
                    redis_client.set(KEYS.dead, "junk")
                return run(name, queue, args)

            run, channel._run = channel._run, dead_key_replaced
        with pytest.raises(redis.ResponseError,
                           match=f"SITS_WRONGTYPE key {getattr(KEYS, key)}"):
            deadletters.requeue(channel, "celery", [msg_id.decode()])
    if key == "dead":
        redis_client.delete(KEYS.dead)
        redis_client.hset(KEYS.dead, msg_id, record or b"")
    elif (dumped := before[key]) is None:  # (the payloads: none left once dead)
        redis_client.delete(getattr(KEYS, key))
    else:
        redis_client.restore(getattr(KEYS, key), 0, dumped, replace=True)
    for name, dumped in before.items():
        assert redis_client.dump(getattr(KEYS, name)) == dumped, name


def test_a_junk_arrival_count_or_sequence_starts_again_instead_of_failing_the_put(
        client_app: Celery, redis_client: redis.Redis) -> None:
    redis_client.hset(KEYS.arrivals, "medium", "abc")
    redis_client.set(KEYS.seq, "xyz")
    client_app.tasks["w.add"].apply_async((1, 1), retry=False)
    assert len(waiting_ids(redis_client)) == 1
    assert redis_client.hget(KEYS.arrivals, "medium") == b"1"
    client_app.tasks["w.add"].apply_async((2, 2), retry=False)
    assert redis_client.hget(KEYS.arrivals, "medium") == b"2"
    assert len(waiting_ids(redis_client)) == 2


def test_a_pick_reads_a_junk_redelivery_count_as_none(
        client_app: Celery, redis_client: redis.Redis) -> None:
    """(compared as a number, it stopped pick.lua after the message left the queue: lost,
    and the worker stopped with it)"""
    client_app.tasks["w.add"].apply_async((1, 1))
    (msg_id,) = waiting_ids(redis_client)
    redis_client.hset(KEYS.redelivered, msg_id, "junk")
    picked = SCRIPTS.run("pick", KEYS, [time.time(), 5, "me", 0], redis_client)
    assert picked[0] == msg_id and picked[2] == 0
    assert redis_client.zscore(KEYS.unacked, msg_id) is not None


@pytest.mark.parametrize("saved", [b"abc", b"nan", None])
def test_a_restore_puts_a_message_with_a_junk_saved_score_at_the_front(
        saved: bytes | None, client_app: Celery, redis_client: redis.Redis) -> None:
    """(ZADD of "abc" failed after the ZREM from the unacked set: the message was lost)"""
    client_app.tasks["w.add"].apply_async((1, 1))
    (msg_id,) = waiting_ids(redis_client)
    SCRIPTS.run("pick", KEYS, [time.time(), 5, "me", 0], redis_client)
    if saved is None:
        redis_client.hdel(KEYS.saved, msg_id)
    else:
        redis_client.hset(KEYS.saved, msg_id, saved)
    redis_client.hset(KEYS.redelivered, msg_id, "1e300")  # HINCRBY refused it
    assert SCRIPTS.run("restore", KEYS, ["-", 0, msg_id], redis_client) == 1
    assert redis_client.zscore(KEYS.waiting, msg_id) == 0.0
    assert redis_client.hget(KEYS.redelivered, msg_id) == b"1"


def test_a_restore_onto_a_key_of_another_type_keeps_the_message_unacked(
        client_app: Celery, redis_client: redis.Redis) -> None:
    client_app.tasks["w.add"].apply_async((1, 1))
    (msg_id,) = waiting_ids(redis_client)
    SCRIPTS.run("pick", KEYS, [time.time(), 5, "me", 0], redis_client)
    redis_client.set(KEYS.redelivered, "junk")
    with pytest.raises(redis.ResponseError, match="SITS_WRONGTYPE"):
        SCRIPTS.run("restore", KEYS, ["-", 0, msg_id], redis_client)
    assert redis_client.zscore(KEYS.unacked, msg_id) is not None


@pytest.mark.parametrize("ahead", [float("inf"), 1e12])
def test_a_held_message_whose_deadline_is_far_ahead_is_restored_by_the_sweep(
        ahead: float, client_app: Celery, redis_client: redis.Redis) -> None:
    """(a deadline of +inf, which no worker writes, held its message unacked for good:
    the sweep's range ended at its ceiling)"""
    client_app.tasks["w.add"].apply_async((1, 1))
    client_app.tasks["w.add"].apply_async((2, 2))
    far, skewed = waiting_ids(redis_client)
    for _ in range(2):
        SCRIPTS.run("pick", KEYS, [time.time(), 5, "me", 0], redis_client)
    now = time.time()
    redis_client.zadd(KEYS.unacked, {far: ahead, skewed: now + 600})  # a fast clock's
    assert SCRIPTS.run("restore", KEYS, [now - 60, 10, now + 86_400], redis_client) == 1
    assert waiting_ids(redis_client) == [far]
    assert redis_client.zscore(KEYS.unacked, skewed) == now + 600


def test_a_worker_runs_a_message_another_program_held_with_an_endless_deadline(
        spawn: Callable[..., CeleryProcess], client_app: Celery,
        redis_client: redis.Redis) -> None:
    held = client_app.tasks["w.add"].apply_async((5, 6))
    (msg_id,) = waiting_ids(redis_client)
    SCRIPTS.run("pick", KEYS, [time.time(), 5, "another", 0], redis_client)
    redis_client.zadd(KEYS.unacked, {msg_id: float("inf")})
    assert waiting_ids(redis_client) == []
    spawn(concurrency=1, visibility_timeout_s="4")  # (its sweep: every 4/3 s)
    assert held.get(timeout=60) == 11


def test_a_worker_leaves_a_queue_whose_pick_redis_refuses_and_serves_the_others(
        spawn: Callable[..., CeleryProcess], client_app: Celery,
        redis_client: redis.Redis) -> None:
    """(a key of another type made the pick raise ResponseError: the worker stopped with
    "Unrecoverable error", and the message it was taking was lost)"""
    waiting = client_app.tasks["w.add"].apply_async((1, 2))
    ids = waiting_ids(redis_client)
    redis_client.set(KEYS.unacked, "junk")  # another program's, on the queue's key
    worker = spawn(extra_args=("-Q", "celery,other"), concurrency=1)
    other = client_app.tasks["w.add"].apply_async((3, 4), queue="other")
    assert other.get(timeout=60) == 7
    assert worker.alive()
    assert waiting_ids(redis_client) == ids and len(ids) == 1  # where it was
    assert worker.log().count("Redis refused its pick") == 1  # said once, not per try
    # Once the key is put right, the queue is served again, without a new put to wake it
    redis_client.delete(KEYS.unacked)
    assert waiting.get(timeout=60) == 3
    wait_for(lambda: "Redis takes its picks again" in worker.log(), 30,
             "the worker to say the queue is served again")


@pytest.mark.parametrize("key", ["latency", "done", "retried", "hot", "totals", "arrivals"])
def test_a_statistics_key_of_another_type_is_read_as_empty_and_the_pass_goes_on(
        key: str, client_app: Celery, redis_client: redis.Redis) -> None:
    """(a key of another type failed the pass for every queue, every pass: priorities no
    longer updated)"""
    from sits_queue.priority.rescore import (
        Rescorer,
        _state_key,
        counter_key,
        hot_key,
        latency_key,
    )

    config = client_app.sits
    client_app.tasks["w.add"].apply_async((1, 1), sla_class="low")
    name = {"latency": latency_key(config, "medium"), "done": counter_key(config, "done"),
            "retried": counter_key(config, "retried"), "hot": hot_key(config),
            "totals": _state_key(config, "totals"), "arrivals": KEYS.arrivals}[key]
    redis_client.delete(name)
    redis_client.sadd(name, "junk")  # a set: no command the pass sends takes it
    report = Rescorer(config, redis_client).rescore_all()
    assert report is not None and report.seen == 1


@pytest.mark.parametrize("record", [
    '{"done": {"high": "x"}, "arrived": {}, "rates": {}, "at": 1}',
    '{"done": {}, "arrived": {}, "rates": {"done": 5}, "at": 1}',
    '{"done": {"high": 1e999}, "arrived": {"low": true}, "rates": {"done": {"high": []}},'
    ' "at": 1e999}'])
def test_a_totals_record_of_another_shape_is_read_for_what_it_holds_and_rewritten(
        record: str, client_app: Celery, redis_client: redis.Redis) -> None:
    """(JSON of the right top-level types with values of others stopped every pass, and
    every trigger check, until someone deleted the key: it raised before the rewrite)"""
    from sits_queue.priority.rescore import Rescorer, _state_key, counter_key

    config = client_app.sits
    client_app.tasks["w.add"].apply_async((1, 1), sla_class="low")
    redis_client.hset(counter_key(config, "done"), "high", 1)
    redis_client.set(_state_key(config, "totals"), record)
    for _ in range(2):
        report = Rescorer(config, redis_client).rescore_all()
        assert report is not None and report.seen == 1
    saved = json.loads(redis_client.get(_state_key(config, "totals")))
    assert saved["done"] == {"high": 1.0} and math.isfinite(saved["at"])


@pytest.mark.parametrize("key", ["dead", "unacked", "waiting"])
def test_a_queue_key_of_another_type_is_said_on_its_row_and_the_others_still_shown(
        key: str, client_app: Celery, redis_client: redis.Redis, redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(one foreign key took sitsq status, sitsq dead list and the fleet's metrics down
    for every queue: the scrape read as Redis down)"""
    from click.testing import CliRunner

    from sits_queue.cli import main
    from sits_queue.status import format_status, queue_status
    from sits_queue.workers.metrics import queue_families

    client_app.tasks["w.add"].apply_async((1, 1), queue="other")
    client_app.tasks["w.add"].apply_async((2, 2))
    redis_client.delete(getattr(KEYS, key))
    redis_client.set(getattr(KEYS, key), "another program's")
    rows = {q["queue"]: q for q in queue_status(redis_client, client_app.sits, time.time())}
    assert rows["other"]["waiting"] == 1 and "error" not in rows["other"]
    mine = {"dead": "dead", "unacked": "unacked", "waiting": "waiting"}[key]
    assert rows["celery"][mine] is None and "WRONGTYPE" in rows["celery"]["error"]
    shown = format_status({"queues": list(rows.values()), "workers": []})
    assert f"queue celery: {'?' if key == 'waiting' else 1} waiting" in shown
    assert "queue other: 1 waiting" in shown and "not all of it readable" in shown
    gauges = {f.name: {s.labels["queue"]: s.value for s in f.samples}
              for f in queue_families(rows.values())}
    assert gauges["sits_queue_waiting"]["other"] == 1
    assert "celery" not in gauges[f"sits_queue_{mine}"]  # unknown, not 0
    monkeypatch.setenv("SITS_REDIS_URL", redis_url)
    listed = CliRunner().invoke(main, ["dead", "list"])
    assert listed.exit_code == 0, listed.output
    if key == "dead":
        assert "celery: dead letters not readable" in listed.output


def test_a_pre_warm_record_of_another_type_is_said_and_the_next_pass_replaces_it(
        client_app: Celery, redis_client: redis.Redis, redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(read with GET, it failed every planning pass for good, and `sitsq status`)"""
    from click.testing import CliRunner

    from sits_queue.cli import main
    from sits_queue.priority import prewarm
    from sits_queue.priority.tasks import prewarmer

    client_app.tasks["w.add"].apply_async((1, 1))
    key = prewarm.misses_key(client_app.sits)
    redis_client.delete(key)
    redis_client.rpush(key, "another program's")
    monkeypatch.setenv("SITS_REDIS_URL", redis_url)
    shown = CliRunner().invoke(main, ["status"])
    assert shown.exit_code == 0, shown.output
    assert "pre-warm: last pass record not readable here (WRONGTYPE" in shown.output
    assert "queue celery: 1 waiting" in shown.output
    report = prewarmer(client_app).run(time.time())
    assert report["sent"] == [] and prewarm.last_pass(redis_client, client_app.sits) \
        is not None
    shown = CliRunner().invoke(main, ["status"])
    assert re.search(r"^pre-warm: last pass -?[0-9.]+ s ago, [0-9]+ model\(s\) forecast, "
                     r"0 pre-warm\(s\) sent$", shown.output, re.M), shown.output


def test_a_worker_registry_of_another_type_shows_no_workers_and_fails_nothing(
        client_app: Celery, redis_client: redis.Redis) -> None:
    from sits_queue.workers.advertise import read_workers, workers_key

    redis_client.set(workers_key(""), "another program's")
    assert read_workers(redis_client) == []


@pytest.mark.parametrize("junk", ["hash", "not a number"])
def test_a_count_of_queue_moves_no_count_reads_as_none_and_a_move_starts_it_again(
        redis_client: redis.Redis, junk: str) -> None:
    """(a key of another type there failed every probe of the fleet: its placement
    weights never read again, and every refresh of a worker moving queues)"""
    from sits_queue.workers.advertise import fleet_members, queues_version_key, refresh

    key = queues_version_key("")
    if junk == "hash":
        redis_client.hset(key, "x", "1")
    else:
        redis_client.set(key, junk)
    members, count = fleet_members(redis_client)
    assert members == () and count == (None if junk == "hash" else junk.encode())
    refresh(redis_client, "", "w@h", 1, 1, [], time.time(), {"queues": ["a"]},
            queues_moved=True)
    assert redis_client.get(key) == b"1" and fleet_members(redis_client) == (("w@h",), b"1")
    refresh(redis_client, "", "w@h", 1, 1, [], time.time(), {"queues": ["b"]},
            queues_moved=True)
    assert redis_client.get(key) == b"2"


def test_a_dead_letter_key_of_another_type_is_left_and_the_sweep_expires_the_rest(
        client_app: Celery, redis_client: redis.Redis) -> None:
    """(it failed the sweep, every period, for every queue: no dead letter expired)"""
    import json

    from sits_queue.priority.rescore import Rescorer

    other = QueueKeys.for_queue("other")
    client_app.tasks["w.add"].apply_async((1, 1), queue="other")
    client_app.tasks["w.add"].apply_async((2, 2))
    redis_client.hset(other.dead, "old", json.dumps({"at": 1.0, "reason": "test"}))
    redis_client.set(KEYS.dead, "another program's")
    redis_client.delete(KEYS.waiting)
    redis_client.set(KEYS.waiting, "another program's")
    rescorer = Rescorer(client_app.sits, redis_client)
    assert rescorer.expire_dead_letters(["celery", "other"], time.time()) == 1
    assert not redis_client.hexists(other.dead, "old")
    # and the trigger check reads the other queues' backlogs
    assert rescorer.oldest_top_class_wait_ms(time.time()) is None


def test_a_queue_key_of_another_type_leaves_that_queue_and_the_pass_rescores_the_rest(
        client_app: Celery, redis_client: redis.Redis) -> None:
    from sits_queue.priority.rescore import Rescorer

    client_app.tasks["w.add"].apply_async((1, 1), queue="other")
    client_app.tasks["w.add"].apply_async((2, 2))
    redis_client.delete(KEYS.meta)
    redis_client.set(KEYS.meta, "junk")
    report = Rescorer(client_app.sits, redis_client).rescore_all()
    assert report is not None and report.queues == 2 and report.seen == 1


def test_a_priority_snapshot_of_another_type_does_not_stop_submission(
        client_app: Celery, redis_client: redis.Redis) -> None:
    """(every put failed on it, the rescoring pass's own message too: the key that
    would have put it right was never sent)"""
    from sits_queue.broker.keys import stats_key

    redis_client.hset(stats_key(""), "a", "b")
    client_app.tasks["w.add"].apply_async((1, 1), retry=False)
    assert len(waiting_ids(redis_client)) == 1


def test_a_rescoring_lock_without_an_expiry_is_no_passs_and_is_taken_over(
        client_app: Celery, redis_client: redis.Redis) -> None:
    """(every pass skipped for good, silently, behind it)"""
    from sits_queue.priority.rescore import Rescorer, _state_key

    key = _state_key(client_app.sits, "rescore-lock")
    redis_client.set(key, "x")
    assert Rescorer(client_app.sits, redis_client).rescore_all() is not None
    # while a pass's own lock (with its expiry) still keeps a second pass out
    redis_client.set(key, "held", ex=30)
    assert Rescorer(client_app.sits, redis_client).rescore_all() is None


@pytest.mark.parametrize("record", [{"end": "now", "took_s": 1e12},
                                    {"end": 1e300, "took_s": 0.001}])
def test_a_last_pass_record_no_pass_writes_spaces_no_pass_and_is_deleted(
        record: dict[str, Any], client_app: Celery, redis_client: redis.Redis) -> None:
    """(kept without an expiry, a record ahead of Redis's clock or of a pass of 1e12 s
    stopped every spaced pass, the beat's and the triggers', for good, unsaid)"""
    from sits_queue.priority.rescore import Rescorer, _state_key

    key = _state_key(client_app.sits, "last-pass")
    now = float(redis_client.time()[0])
    redis_client.set(key, json.dumps({**record, "end": now} if record["end"] == "now"
                                     else record))
    rescorer = Rescorer(client_app.sits, redis_client)
    assert rescorer.rescore_all(spaced=True) is not None
    # and the pass's own record, written after it, spaces the next one as it should
    assert 0 < redis_client.ttl(key) <= 3600
    assert json.loads(redis_client.get(key))["took_s"] < 60


def test_a_queue_registry_of_another_type_fails_no_remote_control_call(
        spawn: Callable[..., CeleryProcess], client_app: Celery,
        redis_client: redis.Redis) -> None:
    """(kombu deletes each reply queue after use, and the delete's SREM from the registry
    raised: every ping and inspect of every client failed)"""
    from sits_queue.broker.keys import queues_registry

    worker = spawn()
    redis_client.delete(queues_registry(""))
    redis_client.set(queues_registry(""), "junk")
    replies = client_app.control.ping(timeout=1)
    assert [name for reply in replies for name in reply] == [worker.hostname]
    assert redis_client.get(queues_registry("")) == b"junk"  # left as it was
    redis_client.delete(queues_registry(""))  # (tests after this one do not all flush)


def test_a_queue_registry_of_another_type_neither_doubles_a_put_nor_stops_a_restore(
        client_app: Celery, redis_client: redis.Redis) -> None:
    """(the registry's SADD after a put raised: the producer retried the put, and the task
    ran twice; in a consumer's sweep it came before the restores, which never ran)"""
    from sits_queue.broker.keys import queues_registry

    redis_client.set(queues_registry(""), "junk")
    client_app.tasks["w.add"].apply_async((1, 1))
    (msg_id,) = waiting_ids(redis_client)  # once
    SCRIPTS.run("pick", KEYS, [time.time() - 60, 5, "dead-worker", 0], redis_client)
    assert waiting_ids(redis_client) == []
    with client_app.connection_for_write() as conn:
        channel = conn.default_channel
        channel.basic_consume("celery", no_ack=False, callback=lambda *a: None,
                              consumer_tag="s")
        channel.qos._last_sweep = -1e9
        served(redis_client)  # (the queue's live workers sweep it: no gap holds this one)
        channel.qos.restore_visible()
    assert waiting_ids(redis_client) == [msg_id]  # the dead worker's message is back
    redis_client.delete(queues_registry(""))  # (tests after this one do not all flush)
