"""The result backend (``sits_queue.broker.results``) on a real Redis: one round trip per
stored state, a SUCCESS never overwritten (the guarantee Celery's GET-then-SET gives,
now atomic), Celery's expiries, results read by waiting clients, and Celery's own path
where the stored value is not plain JSON."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery, states

from sits_queue.app import make_app
from sits_queue.broker.results import SitsRedisBackend, backend_url, expiry_ms
from sits_queue.config import SitsConfig
from tests.integration.commands import sent_commands


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    application = make_app(SitsConfig(redis_url=redis_url), main="test_result_backend")
    yield application
    application.close()


def calls(client: redis.Redis, command: str) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def stored(client: redis.Redis, app: Celery, task_id: str) -> dict[str, Any]:
    raw = client.get(app.backend.get_key_for_task(task_id))
    assert raw is not None
    meta: dict[str, Any] = json.loads(raw)
    return meta


def test_the_app_uses_it_with_the_configured_redis(app: Celery, redis_url: str) -> None:
    assert isinstance(app.backend, SitsRedisBackend)
    assert app.conf.result_backend == backend_url(redis_url)
    assert app.backend.connparams["port"] == int(redis_url.rsplit(":", 1)[1].split("/")[0])


def test_a_state_is_one_round_trip(app: Celery, redis_client: redis.Redis,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    app.backend.store_result("t-1", None, states.STARTED)  # loads the script once
    app.backend.mark_as_done("t-1", None)
    sent: list[Any] = []
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        sent.append(command)  # then sent for real
        send(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    app.backend.store_result("t-2", {"pid": 1}, states.STARTED)
    # STARTED is not waited for: its reply is owed until the task's next state
    assert app.backend._deferred.pending == 1
    ours = len(sent)
    assert stored(redis_client, app, "t-2")["status"] == "STARTED"  # (the test's own GET)
    del sent[ours:]
    app.backend.mark_as_done("t-2", [1.0, 2.0])
    assert app.backend._deferred.pending == 0
    monkeypatch.undo()
    # one EVALSHA per state; Celery's own backend sends a GET and a SET/PUBLISH pipeline
    assert len(sent) == 2
    assert all(b"EVALSHA" in b"".join(c) if isinstance(c, list) else b"EVALSHA" in c
               for c in sent)
    meta = stored(redis_client, app, "t-2")
    assert (meta["status"], meta["result"], meta["task_id"]) == ("SUCCESS", [1.0, 2.0], "t-2")
    assert app.AsyncResult("t-2").get(timeout=5) == [1.0, 2.0]


def test_a_success_is_never_overwritten(app: Celery, redis_client: redis.Redis) -> None:
    app.backend.mark_as_done("t-3", "first")
    # a second delivery of the same task (its worker lost, the message redelivered)
    app.backend.store_result("t-3", {"pid": 2}, states.STARTED)
    app.backend.mark_as_failure("t-3", RuntimeError("late failure"))
    app.backend.mark_as_done("t-3", "second")
    assert stored(redis_client, app, "t-3")["result"] == "first"
    assert app.AsyncResult("t-3").get(timeout=5) == "first"


@pytest.mark.parametrize("first", ["a\udcffb", {"path": "\ud800", "ok": "\N{GRINNING FACE}"},
                                   ["\\udcff", "\\\udcff"]])
def test_a_success_redis_cannot_decode_as_it_stands_is_never_overwritten(
        first: Any, app: Celery, redis_client: redis.Redis) -> None:
    """(Python's JSON writes a lone surrogate as a \\udcxx escape, which Redis's cjson
    refuses: the record read as no SUCCESS, and a redelivery's STARTED and FAILURE
    replaced it)"""
    app.backend.mark_as_done("t-s", first)
    app.backend.store_result("t-s", {"pid": 2}, states.STARTED)
    app.backend.mark_as_failure("t-s", RuntimeError("late failure"))
    assert stored(redis_client, app, "t-s")["status"] == "SUCCESS"
    assert app.AsyncResult("t-s").get(timeout=5) == first


def test_a_success_nested_past_what_redis_decodes_is_never_overwritten(
        app: Celery, redis_client: redis.Redis) -> None:
    # (written by a client whose recursion limit is above the 1,000 levels cjson reads)
    nested = "[" * 1100 + "0" + "]" * 1100
    key = app.backend.get_key_for_task("t-n")
    redis_client.set(key, f'{{"status": "SUCCESS", "result": {nested}, "task_id": "t-n"}}')
    app.backend.mark_as_failure("t-n", RuntimeError("late failure"))
    assert redis_client.get(key).startswith(b'{"status": "SUCCESS"')


def test_a_state_redis_cannot_decode_as_it_stands_is_replaced(
        app: Celery, redis_client: redis.Redis) -> None:
    app.backend.store_result("t-u", {"pid": "\udcff", "note": '"status": "SUCCESS"'},
                             states.STARTED)
    app.backend.mark_as_failure("t-u", RuntimeError("failed"))
    assert stored(redis_client, app, "t-u")["status"] == "FAILURE"


def test_a_state_is_read_from_where_celery_writes_it_not_decoded_whole(
        app: Celery, redis_client: redis.Redis) -> None:
    """(a record was decoded whole to read its status: with result_extended it holds the
    task's arguments, 100 MB of which held all of Redis ~0.9 s at each state write; and
    arguments nested past what cjson reads, holding a SUCCESS record (a chain passes
    results on), made a STARTED read as one: the task's outcome was never stored)"""
    nested = "[" * 1100 + '{"status": "SUCCESS"}' + "]" * 1100
    key = app.backend.get_key_for_task("t-d")
    redis_client.set(key, f'{{"status": "STARTED", "args": {nested}, "task_id": "t-d"}}')
    app.backend.mark_as_done("t-d", "done")
    assert stored(redis_client, app, "t-d")["result"] == "done"
    # (and a SUCCESS written so is kept)
    app.backend.mark_as_failure("t-d", RuntimeError("late failure"))
    assert stored(redis_client, app, "t-d")["status"] == "SUCCESS"


def test_other_states_replace_each_other(app: Celery, redis_client: redis.Redis) -> None:
    app.backend.store_result("t-4", {"pid": 3}, states.STARTED)
    app.backend.mark_as_retry("t-4", RuntimeError("flaky"))
    assert stored(redis_client, app, "t-4")["status"] == "RETRY"
    app.backend.mark_as_failure("t-4", ValueError("bad input"))
    result = app.AsyncResult("t-4")
    with pytest.raises(ValueError, match="bad input"):
        result.get(timeout=5)
    assert result.state == "FAILURE"


def test_expiries_follow_celerys_settings(app: Celery, redis_client: redis.Redis) -> None:
    app.conf.result_failure_expires = 60
    backend = SitsRedisBackend(app=app, url=app.conf.result_backend.split("+", 1)[1])
    backend.mark_as_done("t-5", 1)
    backend.mark_as_failure("t-6", RuntimeError("x"))
    key = backend.get_key_for_task
    assert 86_000 < redis_client.ttl(key("t-5")) <= 86_400  # result_expires: one day
    assert 0 < redis_client.ttl(key("t-6")) <= 60
    app.conf.result_expires = None
    forever = SitsRedisBackend(app=app, url=app.conf.result_backend.split("+", 1)[1])
    forever.mark_as_done("t-7", 1)
    assert redis_client.ttl(key("t-7")) == -1


def test_a_waiting_client_gets_the_result(app: Celery) -> None:
    result = app.AsyncResult("t-8")
    app.backend.on_task_call(None, "t-8")  # as apply_async calls it (subscribes to nothing)
    app.backend.mark_as_done("t-8", {"ok": True})
    assert result.get(timeout=5) == {"ok": True}


def test_a_flushed_script_cache_is_reloaded(app: Celery, redis_client: redis.Redis) -> None:
    app.backend.mark_as_done("t-9", 1)
    redis_client.script_flush()
    app.backend.mark_as_done("t-10", 2)
    assert stored(redis_client, app, "t-10")["result"] == 2


def test_a_refused_started_is_written_before_the_outcome(app: Celery,
                                                         redis_client: redis.Redis) -> None:
    app.backend.mark_as_done("t-12", 1)
    key = app.backend.get_key_for_task("t-13")
    watch = redis_client.pubsub(ignore_subscribe_messages=True)
    watch.subscribe(key)
    # Given a STARTED refused with NOSCRIPT (its reply not read yet)
    redis_client.script_flush()
    app.backend.store_result("t-13", {"pid": 4}, states.STARTED)
    assert redis_client.get(key) is None
    # When the task's outcome is written, the STARTED is written again first, then it
    app.backend.mark_as_failure("t-13", RuntimeError("boom"))
    assert stored(redis_client, app, "t-13")["status"] == "FAILURE"
    published: list[str] = []
    deadline = time.monotonic() + 5
    while len(published) < 2 and time.monotonic() < deadline:
        message = watch.get_message(timeout=0.1)  # None for the subscription's own reply
        if message is not None:
            published.append(json.loads(message["data"])["status"])
    watch.close()
    assert published == ["STARTED", "FAILURE"]
    # And a STARTED that is read back before any other state is there too
    app.backend.store_result("t-14", {"pid": 5}, states.STARTED)
    app.backend._deferred.settle()
    assert stored(redis_client, app, "t-14")["status"] == "STARTED"


def test_a_started_lost_with_its_connection_is_written_again(
        app: Celery, redis_client: redis.Redis) -> None:
    app.backend.mark_as_done("t-15", 1)
    app.backend.store_result("t-16", {"pid": 6}, states.STARTED)
    app.backend._deferred.settle()
    held = app.backend._deferred._conn
    host, port = held._sock.getsockname()[:2]
    # Given a STARTED sent while Redis holds writes back, its connection then killed
    redis_client.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
    try:
        app.backend.store_result("t-17", {"pid": 7}, states.STARTED)
        assert redis_client.client_kill(f"{host}:{port}")
    finally:
        redis_client.client_unpause()
    # Then the next state's write finds it lost, writes it again, then its own
    app.backend.store_result("t-18", {"pid": 8}, states.STARTED)
    app.backend._deferred.settle()
    assert stored(redis_client, app, "t-17")["status"] == "STARTED"
    assert stored(redis_client, app, "t-18")["status"] == "STARTED"


def test_a_batch_s_members_are_started_in_one_packet_but_a_revoke_stands(
        app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """(a batch's members stayed PENDING while it ran: workers/batched.py marks them
    STARTED at its start; one revoked since its worker sent it to the pool keeps that)"""
    from celery.app.task import Context

    app.backend.mark_as_done("b-warm", 1)  # loads the script
    app.backend.mark_as_revoked("b-revoked", "revoked")
    app.backend.mark_as_done("b-done", "first")
    app.backend.mark_as_failure("b-failed", RuntimeError("x"))
    app.backend.mark_as_retry("b-retry", RuntimeError("flaky"))
    ids = ["b-new", "b-retry", "b-revoked", "b-done", "b-failed"]
    with sent_commands(monkeypatch) as sent:
        app.backend.store_started([(i, {"pid": 9, "hostname": "w@h"},
                                    Context({"id": i, "hostname": "w@h"})) for i in ids])
    assert len(sent) == 1 and app.backend._deferred.pending == len(ids)  # one packet
    app.backend._deferred.settle()
    assert {i: stored(redis_client, app, i)["status"] for i in ids} == {
        "b-new": "STARTED", "b-retry": "STARTED", "b-revoked": "REVOKED",
        "b-done": "SUCCESS", "b-failed": "FAILURE"}
    assert stored(redis_client, app, "b-new")["result"] == {"pid": 9, "hostname": "w@h"}
    assert app.AsyncResult("b-new").state == "STARTED"
    # A plain task's STARTED replaces a FAILURE as before (a retried delivery runs again)
    app.backend.store_result("b-failed", {"pid": 9}, states.STARTED)
    assert stored(redis_client, app, "b-failed")["status"] == "STARTED"


def test_a_refused_batch_started_is_written_again_awaited(
        app: Celery, redis_client: redis.Redis) -> None:
    from celery.app.task import Context

    app.backend.mark_as_done("b-warm2", 1)
    app.backend.mark_as_revoked("b-r2", "revoked")
    redis_client.script_flush()  # the packet's EVALSHAs meet NOSCRIPT
    app.backend.store_started([(i, {"pid": 1}, Context({"id": i})) for i in ("b-n2", "b-r2")])
    app.backend._deferred.settle()
    assert stored(redis_client, app, "b-n2")["status"] == "STARTED"
    assert stored(redis_client, app, "b-r2")["status"] == "REVOKED"


def test_compressed_results_keep_celerys_path(app: Celery, redis_client: redis.Redis) -> None:
    app.conf.result_compression = "zlib"
    backend = SitsRedisBackend(app=app, url=app.conf.result_backend.split("+", 1)[1])
    before = calls(redis_client, "evalsha")
    backend.mark_as_done("t-11", "x" * 1000)
    backend.store_result("t-11", None, states.STARTED)
    backend.mark_as_revoked("t-11r", "revoked")
    backend.store_started([(i, {"pid": 1}, None) for i in ("t-11", "t-11r", "t-11s")])
    assert calls(redis_client, "evalsha") == before
    assert backend.get_task_meta("t-11")["result"] == "x" * 1000
    assert [backend.get_state(i) for i in ("t-11r", "t-11s")] == ["REVOKED", "STARTED"]


def test_expiry_ms() -> None:
    assert expiry_ms(None) == 0
    assert expiry_ms(0) == 0
    assert expiry_ms(86400) == 86_400_000
    assert expiry_ms(timedelta(minutes=30)) == 1_800_000
    assert expiry_ms(0.0001) == 1  # a positive expiry never becomes "keep forever"


@pytest.mark.parametrize("junk", ['{"foo": 1}', "[1, 2]", '"done"'])
def test_a_result_record_celery_did_not_write_is_said_at_once(
        junk: str, app: Celery, redis_client: redis.Redis) -> None:
    """(a record without a status raised KeyError, which kombu counts as a lost
    connection: get(timeout=3) retried for ~70 s, then failed)"""
    from sits_queue.errors import UnreadableResult

    result = app.AsyncResult("junk-task")
    redis_client.set(app.backend.get_key_for_task("junk-task"), junk)
    with pytest.raises(UnreadableResult, match="not one Celery writes"):
        result.get(timeout=3)  # (not BackendGetMetaError, after ~70 s of retries)


def test_a_result_keeps_no_copy_of_the_task_s_arguments(
        client_app: Celery, spawn: Any, redis_client: redis.Redis) -> None:
    """(results were extended: each stored state kept the arguments for a day, 112 MB of
    Redis for one 100 MB prompt batch, and published them to the caller's subscription)"""
    spawn()
    result = client_app.tasks["w.add"].delay(2, 40)
    assert result.get(timeout=60) == 42
    meta = json.loads(redis_client.get(client_app.backend.get_key_for_task(result.id)))
    assert meta["status"] == "SUCCESS" and meta["result"] == 42
    assert "args" not in meta and "kwargs" not in meta
