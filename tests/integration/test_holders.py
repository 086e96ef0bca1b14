"""A consumer process of this host that died holding messages: the next sweep tick of
any consumer here puts them back (``broker/holders.py``), without waiting for the
visibility timeout; a live one's, and one another version's pick left under a dead
one's name, stay. Real Redis, a real holder process killed with SIGKILL.
Real workers: ``test_redelivery.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from sits_queue.app import make_app
from sits_queue.broker import holders
from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from tests.integration.conftest import ROOT, served
from tests.waiting import wait_for

KEYS = QueueKeys.for_queue("celery")
TIMEOUT_S = 60.0  # the visibility timeout: no restore here may be the timeout's

#: A consumer that takes ``argv[2]`` messages, acks ``argv[3]`` of them, says its
#: consumer id, then sleeps until killed (or closes its channel cleanly, given "close").
HOLDER = textwrap.dedent("""
    import sys, time
    from dataclasses import replace
    from sits_queue.app import make_app
    from sits_queue.config import SitsConfig

    app = make_app(replace(SitsConfig(redis_url=sys.argv[1]), visibility_timeout_s=60.0),
                   main="holder")
    conn = app.connection_for_write()
    channel = conn.channel()
    channel.basic_consume("celery", no_ack=False, callback=lambda m: None, consumer_tag="c")
    held = [channel.basic_get("celery") for _ in range(int(sys.argv[2]))]
    assert all(m is not None for m in held), held
    for message in held[:int(sys.argv[3])]:
        message.ack()
    if sys.argv[4:] == ["close"]:
        channel.close()
    print(channel.consumer_id, flush=True)
    time.sleep(600)
""")


@dataclass
class Holder:
    popen: subprocess.Popen[str]
    consumer: str

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    application = build_app(redis_url)
    yield application
    application.close()


def build_app(redis_url: str, **overrides: Any) -> Celery:
    application = make_app(replace(SitsConfig(redis_url=redis_url),
                                   visibility_timeout_s=TIMEOUT_S, **overrides),
                           main="holders_test")

    @application.task(name="t.echo", shared=False)
    def echo(tag: str) -> str:
        return tag

    return application


@pytest.fixture
def spawn(redis_url: str) -> Iterator[Any]:
    """spawn(take, ack=0, close=False): a holder process, once it holds its messages."""
    started: list[subprocess.Popen[str]] = []

    def _spawn(take: int, ack: int = 0, close: bool = False) -> Holder:
        popen = subprocess.Popen(
            [sys.executable, "-c", HOLDER, redis_url, str(take), str(ack),
             *(["close"] if close else [])],
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        started.append(popen)
        assert popen.stdout is not None
        consumer = popen.stdout.readline().strip()
        assert consumer, f"the holder exited ({popen.wait(10)}) without holding"
        return Holder(popen, consumer)

    yield _spawn
    for popen in started:
        if popen.poll() is None:
            popen.kill()
            popen.wait(10)


def sweep(app: Celery) -> Any:
    """One sweep tick of a consumer of this test's process (on ``app``'s connection)."""
    conn = app.connection_for_write()
    channel = conn.channel()
    channel.basic_consume("celery", no_ack=False, callback=lambda m: None, consumer_tag="s")
    channel.qos.restore_visible()
    channel.close()
    conn.release()


def host_records(client: redis.Redis) -> dict[Any, Any]:
    key = holders.host_key("", holders.this_process())
    assert key is not None, "this test needs /proc (Linux)"
    return dict(client.hgetall(key))


def test_a_dead_holders_messages_go_back_at_the_next_tick_counted(
        app: Celery, spawn: Any, redis_client: redis.Redis) -> None:
    for i in range(3):
        app.tasks["t.echo"].delay(f"m{i}")
    # Given a consumer process that holds two of three messages, recorded as their holder
    holder = spawn(take=2)
    assert redis_client.zcard(KEYS.unacked) == 2
    assert set(redis_client.hvals(KEYS.holders)) == {holder.consumer.encode()}
    assert holder.consumer.encode() in host_records(redis_client)
    # While it lives, a sweep of this host leaves them held
    sweep(app)
    assert redis_client.zcard(KEYS.unacked) == 2
    # When it is killed (SIGKILL: no close, no give-back) and reaped
    holder.kill()
    # Then the next sweep tick puts both back, long before the visibility timeout, each
    # counted as a redelivery (a task that kills its worker is poison the sooner)
    sweep(app)
    assert redis_client.zcard(KEYS.unacked) == 0
    assert redis_client.zcard(KEYS.waiting) == 3
    assert sorted(int(v) for v in redis_client.hvals(KEYS.redelivered)) == [1, 1]
    # and forgets the holder and its entries
    assert redis_client.hlen(KEYS.holders) == 0
    assert holder.consumer.encode() not in host_records(redis_client)


def test_a_holder_killed_and_not_yet_reaped_is_dead(
        app: Celery, spawn: Any, redis_client: redis.Redis) -> None:
    app.tasks["t.echo"].delay("m")
    holder = spawn(take=1)
    # Given a holder killed whose parent has not reaped it yet (a zombie: its pid still
    # names a process in /proc)
    holder.popen.send_signal(signal.SIGKILL)
    stat = Path(f"/proc/{holder.popen.pid}/stat")
    wait_for(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", 10, "the zombie")
    # Then the sweep puts its message back
    sweep(app)
    assert redis_client.zcard(KEYS.waiting) == 1
    holder.popen.wait(10)


def test_only_what_the_dead_holder_still_held_goes_back(
        app: Celery, spawn: Any, redis_client: redis.Redis) -> None:
    for i in range(3):
        app.tasks["t.echo"].delay(f"m{i}")
    # Given a holder that acked one of the two messages it took, then died
    holder = spawn(take=2, ack=1)
    holder.kill()
    # Then only the other goes back (the acked one is gone for good)
    sweep(app)
    assert redis_client.zcard(KEYS.waiting) == 2
    assert redis_client.hlen(KEYS.payloads) == 2
    assert redis_client.hlen(KEYS.redelivered) == 1


def test_a_later_holders_message_left_under_a_dead_ones_name_stays(
        app: Celery, spawn: Any, redis_client: redis.Redis) -> None:
    for i in range(2):
        app.tasks["t.echo"].delay(f"m{i}")
    holder = spawn(take=2)
    mine, other = [bytes(t) for t in redis_client.zrange(KEYS.unacked, 0, -1)]
    seen = last_record(redis_client, holder.consumer)
    # Given one message restored by a sweep of an earlier release (which drops no holder
    # entry) and taken again by a worker of one (which writes none), alive: at the
    # earliest, its deadline is that pick's, a timeout after the dead holder's last beat
    # of it, which came at most a beat period (a third of the timeout) before its record
    redis_client.zadd(KEYS.unacked, {other: seen + TIMEOUT_S * 2 / 3})
    # and the other picked by the holder a tick (a sixth) after its last record
    redis_client.zadd(KEYS.unacked, {mine: seen + TIMEOUT_S / 6})
    # When the holder dies
    holder.kill()
    # Then its own goes back, and the other stays with its live holder
    sweep(app)
    assert redis_client.zrange(KEYS.waiting, 0, -1) == [mine]
    assert redis_client.zrange(KEYS.unacked, 0, -1) == [other]


def last_record(client: redis.Redis, consumer: str) -> float:
    record = holders.Holder.decode(consumer, host_records(client)[consumer.encode()],
                                   holders.this_process())
    assert record is not None
    return record.seen


def test_a_holder_whose_loop_stalls_looks_from_its_heartbeat_thread(
        app: Celery, spawn: Any, redis_client: redis.Redis) -> None:
    """(a --pool=solo worker runs its task in its event loop, which ticks only between
    tasks: ``test_worker.py`` has the real worker)"""
    app.tasks["t.echo"].delay("own")
    app.tasks["t.echo"].delay("theirs")
    conn = app.connection_for_write()
    channel = conn.channel()
    try:
        # Given a consumer of this process holding a message, and a dead neighbour's
        channel.basic_consume("celery", no_ack=False, callback=lambda m: None,
                              consumer_tag="b")
        assert channel.basic_get("celery") is not None
        holder = spawn(take=1)
        holder.kill()
        thread_client = redis.Redis.from_url(app.conf.broker_url)
        qos = channel.qos
        # When the heartbeat thread beats while the event loop looked a moment ago: only
        # the beat (the loop's next tick looks)
        qos._last_reclaim = time.monotonic()
        qos._thread_beat(thread_client)
        assert redis_client.zcard(KEYS.unacked) == 2
        # but when the loop has not looked for a whole period (busy with a task), the
        # thread puts the dead one's back itself, counted, and keeps its own held
        qos._last_reclaim = time.monotonic() - qos.beat_period_s
        qos._thread_beat(thread_client)
        assert redis_client.zcard(KEYS.unacked) == 1
        assert redis_client.zcard(KEYS.waiting) == 1
        assert [int(v) for v in redis_client.hvals(KEYS.redelivered)] == [1]
        assert list(redis_client.hvals(KEYS.holders)) == [channel.consumer_id.encode()]
        thread_client.close()
    finally:
        channel.close()
        conn.release()


def test_a_consumer_told_not_to_leaves_a_dead_holder_to_the_timeout(
        redis_url: str, spawn: Any, redis_client: redis.Redis) -> None:
    off = build_app(redis_url, reclaim_dead_holders=False)
    try:
        off.tasks["t.echo"].delay("m")
        holder = spawn(take=1)
        holder.kill()
        # A consumer with reclaim_dead_holders off neither looks nor writes its record
        sweep(off)
        assert redis_client.zcard(KEYS.unacked) == 1
        assert list(host_records(redis_client)) == [holder.consumer.encode()]
    finally:
        off.close()


def test_a_consumer_that_closes_holding_nothing_drops_its_record(
        app: Celery, spawn: Any, redis_client: redis.Redis) -> None:
    """(left, each restart's record was read as a dead holder's by its neighbours, each
    costing a scan of its queues)"""
    app.tasks["t.echo"].delay("m")
    # Given a holder that closed its channel (giving its message back, uncounted)
    holder = spawn(take=1, close=True)
    # Then its record is gone, and nothing was counted
    assert redis_client.zcard(KEYS.waiting) == 1
    assert holder.consumer.encode() not in host_records(redis_client)
    assert redis_client.hlen(KEYS.redelivered) == 0


def test_junk_in_the_host_hash_stops_neither_the_put_back_nor_the_sweep(
        app: Celery, spawn: Any, redis_client: redis.Redis) -> None:
    """(a field no UTF-8, a record past a float's range raised out of the sweep tick:
    nothing was restored, by any path, while it stayed)"""
    key = holders.host_key("", holders.this_process())
    assert key is not None
    app.tasks["t.echo"].delay("m")
    holder = spawn(take=1)
    redis_client.hset(key, mapping={b"\xff\xfe": b"{}",
                                    "big": '{"pid": 1, "started": 1, "queues": [], '
                                           '"seen": 1' + "0" * 400 + ', "timeout": 60}'})
    holder.kill()
    sweep(app)
    assert redis_client.zcard(KEYS.waiting) == 1
    # and a host hash of another type (another program's) leaves the sweep whole: a
    # message whose holder went silent for the timeout is restored all the same
    redis_client.delete(key)
    redis_client.set(key, "not a hash")
    app.tasks["t.echo"].delay("n")
    silent = spawn(take=2)
    silent.kill()
    redis_client.zadd(KEYS.unacked, {t: 0 for t in redis_client.zrange(KEYS.unacked, 0, -1)})
    served(redis_client)
    sweep(app)
    assert redis_client.zcard(KEYS.waiting) == 2


def test_a_child_forked_with_the_channel_writes_no_record(
        app: Celery, redis_client: redis.Redis) -> None:
    """(it wrote its own pid under the channel's consumer: its end made the parent's
    held messages look a dead holder's)"""
    conn = app.connection_for_write()
    channel = conn.channel()
    channel.basic_consume("celery", no_ack=False, callback=lambda m: None, consumer_tag="c")
    pid = os.fork()
    if pid == 0:  # the child: a tick of its own, then gone
        try:
            channel.qos.record(redis.Redis.from_url(app.conf.broker_url), 1.0, ["celery"])
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    record = holders.Holder.decode(channel.consumer_id,
                                   host_records(redis_client)[channel.consumer_id.encode()],
                                   holders.this_process())
    assert record is not None and record.process.pid == os.getpid()
    channel.close()
    conn.release()


def test_a_live_worker_of_an_earlier_release_holds_the_put_back_off(
        app: Celery, spawn: Any, redis_client: redis.Redis) -> None:
    from sits_queue.workers import advertise

    app.tasks["t.echo"].delay("m")
    holder = spawn(take=1)
    # Given a live worker whose advertisement does not say it keeps holder entries (an
    # earlier release's)
    older = advertise.worker_record("old@vm", 1, 1, [], {}, 0.0)
    del older["holders"]
    redis_client.set(advertise.worker_key("", "old@vm"), json.dumps(older), ex=60)
    redis_client.zadd(advertise.workers_key(""), {"old@vm": time.time()})
    # When the holder dies
    holder.kill()
    # Then what it held is left to the visibility timeout while that worker is live
    sweep(app)
    assert redis_client.zcard(KEYS.unacked) == 1
    # and put back at the first tick after it is gone
    redis_client.delete(advertise.worker_key("", "old@vm"))
    sweep(app)
    assert redis_client.zcard(KEYS.waiting) == 1
