"""Remote control over the sorted-set transport: replies to calls made one after another.

kombu collects a call's replies until its timeout, so every call ends with the blocking
wait of its reply consumer still in flight; each call consumes a reply queue of its own
name (kombu names it after the mailbox object). These tests make calls back to back,
each with a short timeout, as ``wait_ready``, Flower and monitoring scripts do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from kombu import Connection, Consumer, Exchange, Message, Queue

from sits_queue.broker.keys import QueueKeys
from sits_queue.procs import CeleryProcess
from tests.integration.conftest import ROOT
from tests.waiting import wait_for

Spawn = Callable[..., CeleryProcess]
#: Short enough that each call ends with the previous wait (1 s) still in flight.
SHORT_TIMEOUT_S = 0.5
CALLS = 8


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_consecutive_short_pings_each_get_the_reply(spawn: Spawn, client_app: Celery,
                                                    pool: str) -> None:
    worker = spawn(pool=pool)
    # When a client pings the live worker again and again, each call with a short timeout
    answered = [[name for reply in client_app.control.ping(timeout=SHORT_TIMEOUT_S)
                 for name in reply] for _ in range(CALLS)]
    # Then every call gets the worker's reply (every other one came back empty: the wait
    # the previous call left in flight watched that call's reply queue, not this one's)
    assert answered == [[worker.hostname]] * CALLS


def test_inspect_with_short_timeouts_answers_every_call(spawn: Spawn,
                                                        client_app: Celery) -> None:
    worker = spawn()
    inspect = client_app.control.inspect(timeout=SHORT_TIMEOUT_S)
    for round_ in range(3):
        # When stats, active and ping are asked one after the other
        stats, active, ping = inspect.stats(), inspect.active(), inspect.ping()
        # Then each comes back with the worker's answer
        assert stats is not None and worker.hostname in stats, round_
        assert active == {worker.hostname: []}, round_
        assert ping == {worker.hostname: {"ok": "pong"}}, round_


def test_a_time_limit_set_remotely_is_refused_saying_where_limits_are_set(
        spawn: Spawn, client_app: Celery) -> None:
    """(Celery's command set the worker's copy of the task, which every SITS message's own
    limits override: it answered "time limits set successfully" and changed nothing)"""
    worker = spawn()
    (reply,) = client_app.control.time_limit("w.slow", soft=1, hard=2, reply=True,
                                             timeout=5)
    error = reply[worker.hostname]["error"]
    assert "carry their time limits on each message" in error and "'w.slow'" in error
    assert client_app.tasks["w.slow"].apply_async(("x", 0.1)).get(timeout=30) == "x"


def test_a_workers_own_time_limit_flags_are_said_to_apply_to_no_sits_task(
        spawn: Spawn, client_app: Celery) -> None:
    """(ignored unsaid: every message carries its own limits)"""
    worker = spawn(extra_args=("--time-limit=5", "--soft-time-limit=4"))
    assert client_app.tasks["w.add"].delay(1, 1).get(timeout=30) == 2
    log = worker.log()
    assert "--time-limit=5.0 applies to no SITS task" in log, log[-2000:]
    assert "--soft-time-limit=4.0 applies to no SITS task" in log


def test_no_remote_control_reply_holds_the_redis_password(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis, redis_url: str) -> None:
    """(the transport options carried the whole SITS config, and Celery sends them whole in
    ``inspect stats``; ``inspect conf`` held ``redbeat_redis_url``: Flower's worker page
    showed the Redis password)"""
    secret = uuid.uuid4().hex
    redis_client.acl_setuser("sits-ctl", enabled=True, passwords=[f"+{secret}"], keys=["*"],
                             channels=["*"], commands=["+@all"])
    try:
        # (spawn's settings are SITS_* variables: this one names the worker's Redis)
        worker = spawn(**{"REDIS_URL": redis_url.replace("redis://",
                                                         f"redis://sits-ctl:{secret}@")})
        inspect = client_app.control.inspect(timeout=5)
        stats, conf, report = inspect.stats(), inspect.conf(), inspect.report()
        assert stats is not None and worker.hostname in stats and conf is not None
        assert report is not None and "redbeat_redis_url" in str(report)  # (Celery's)
        shown = json.dumps([stats, conf, report], default=str)
        assert secret not in shown  # (the user name is in Celery's own broker line)
        assert "redis://***@127.0.0.1" in shown  # the server is still named
        assert client_app.tasks["w.add"].delay(2, 2).get(timeout=30) == 4  # it serves
    finally:
        redis_client.acl_deluser("sits-ctl")


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_queue_added_to_a_running_worker_is_served(spawn: Spawn, client_app: Celery,
                                                     pool: str) -> None:
    worker = spawn(pool=pool)
    add = client_app.tasks["w.add"]
    # Given an idle worker, its wait on its queues in flight
    assert add.delay(1, 1).get(timeout=30) == 2
    # When it is told to consume one more queue (its wait is given up for one that
    # watches that queue too) and tasks arrive there and on its first queue
    (reply,) = client_app.control.add_consumer("ctl-added", reply=True, timeout=5)
    assert "ok" in reply[worker.hostname]
    added, first = add.apply_async((2, 3), queue="ctl-added"), add.delay(4, 5)
    # Then both run, and the worker serves on
    assert (added.get(timeout=30), first.get(timeout=30)) == (5, 9)
    assert worker.alive()


def test_a_queue_added_after_a_pool_child_was_replaced_is_served(
        spawn: Spawn, client_app: Celery) -> None:
    """A child forked while the parent's wait was open holds that socket too: giving the
    wait up must take it out of the event loop before closing it, or the loop keeps
    hearing the dead socket (shut down, readable for ever) under the fd number the new
    connection gets, and the worker blocks reading the new one (a worker that stops
    serving and answering pings)."""
    worker = spawn(concurrency=2, extra_args=("--max-tasks-per-child=1",))
    add = client_app.tasks["w.add"]
    for round_ in range(3):  # the old dead socket is heard only by chance: several rounds
        # Given children replaced after each task, each forked with the parent's wait open
        assert [add.delay(n, n).get(timeout=60) for n in range(4)] == [0, 2, 4, 6]
        assert client_app.control.ping([worker.hostname], timeout=2), round_
        # When a queue is added and a task arrives on it
        (reply,) = client_app.control.add_consumer(
            f"ctl-after-fork-{round_}", reply=True, timeout=5, destination=[worker.hostname])
        assert "ok" in reply[worker.hostname]
        assert add.apply_async((2, 3), queue=f"ctl-after-fork-{round_}").get(timeout=60) == 5
        # Then the worker goes on answering and serving its first queue
        assert client_app.control.ping([worker.hostname], timeout=2), round_
        assert add.delay(round_, 10).get(timeout=30) == round_ + 10
    assert worker.alive()


@pytest.fixture
def conn(redis_url: str) -> Iterator[Connection]:
    with Connection(redis_url, transport="sits_queue.broker.transport:Transport") as c:
        yield c


def consume(conn: Connection, names: list[str], got: list[str],
            no_ack: bool = True) -> Consumer:
    exchange = Exchange("ctl-test", type="direct", durable=False)
    queues = [Queue(name, exchange, routing_key=name, durable=False) for name in names]

    def on_message(body: str, message: Message) -> None:
        got.append(body)

    return Consumer(conn.default_channel, queues, callbacks=[on_message], no_ack=no_ack)


def publish(conn: Connection, name: str, body: str) -> None:
    with conn.Producer() as producer:
        producer.publish(body, exchange="ctl-test", routing_key=name)


def test_a_queue_consumed_while_a_wait_is_in_flight_is_watched_at_once(
        conn: Connection, redis_client: redis.Redis) -> None:
    got: list[str] = []
    # Given a consumer whose drain ended by its timeout, its wait on queue a in flight
    with consume(conn, ["ctl-a"], got), pytest.raises(TimeoutError):
        conn.drain_events(timeout=0.1)
    # When the channel then consumes queue b and a message arrives there
    with consume(conn, ["ctl-b"], got):
        publish(conn, "ctl-b", "to b")
        started = time.monotonic()
        conn.drain_events(timeout=SHORT_TIMEOUT_S)
        # Then the drain returns it, without waiting out the old wait
        assert got == ["to b"]
        assert time.monotonic() - started < SHORT_TIMEOUT_S


def test_a_wait_that_outlived_its_consumer_leaves_the_message_waiting(
        conn: Connection, redis_client: redis.Redis) -> None:
    got: list[str] = []
    keys = QueueKeys.for_queue("ctl-c")
    with consume(conn, ["ctl-c", "ctl-e"], got, no_ack=False) as consumer:
        # Given a wait on queues c and e in flight, then c's consumer cancelled
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.1)
        consumer.cancel_by_queue("ctl-c")
        # When a message for c arrives and wakes that wait, and the channel reads its reply
        publish(conn, "ctl-c", "to c")
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.2)
    # Then nobody took it: it still waits in c, whose marker is set for the next consumer
    assert got == []
    assert redis_client.zcard(keys.waiting) == 1
    assert redis_client.zcard(keys.unacked) == 0
    assert redis_client.zcard(keys.marker) == 1


def test_a_wait_left_on_a_pooled_connection_takes_no_wake_up_from_the_next_call(
        redis_url: str, redis_client: redis.Redis) -> None:
    got: list[str] = []
    transport = "sits_queue.broker.transport:Transport"
    with Connection(redis_url, transport=transport) as idle, \
            Connection(redis_url, transport=transport) as busy:
        # Given a call's reply consumer that ended by its timeout and was cancelled, its
        # connection back in a pool and idle (a ping without destinations always ends so)
        with consume(idle, ["ctl-reply"], got), pytest.raises(TimeoutError):
            idle.drain_events(timeout=0.1)
        # When the next call, on another connection, consumes a reply queue of the same
        # name (kombu names it after the id() of a copy of the mailbox: Python reuses
        # ids) and its reply arrives
        with consume(busy, ["ctl-reply"], got):
            publish(busy, "ctl-reply", "the reply")
            # Then that call gets it before its own wait times out (the old wait, first
            # in Redis's line, took the wake-up and the reply was never picked: the bench
            # holds' add_consumer got no reply in 60 s)
            busy.drain_events(timeout=SHORT_TIMEOUT_S)
    assert got == ["the reply"]


def test_a_wake_up_another_client_took_delays_a_message_by_one_wait_at_most(
        conn: Connection, redis_url: str, redis_client: redis.Redis) -> None:
    got: list[str] = []
    marker = QueueKeys.for_queue("ctl-g").marker
    # Given another client blocked on queue g's marker first, its answer never read (a
    # process killed mid-wait, a connection nobody reads)
    thief = redis.Redis.from_url(redis_url).connection_pool.make_connection()
    try:
        thief.send_command("BZPOPMIN", marker, 30)
        with consume(conn, ["ctl-g"], got):
            wait_for(lambda: any(c.get("cmd") == "bzpopmin"
                                 for c in redis_client.client_list()),
                     5, "the other client to block")
            # When a message arrives, its wake-up going to that client
            publish(conn, "ctl-g", "to g")
            # Then the consumer picks it once its own wait times out (1 s): it never did
            conn.drain_events(timeout=3)
    finally:
        thief.disconnect()
    assert got == ["to g"]


def test_closing_gives_up_the_wait_and_leaves_its_wake_up(
        redis_url: str, redis_client: redis.Redis) -> None:
    got: list[str] = []
    keys = QueueKeys.for_queue("ctl-f")
    conn = Connection(redis_url, transport="sits_queue.broker.transport:Transport")
    consumer = consume(conn, ["ctl-f"], got, no_ack=False)
    consumer.consume()
    # Given a wait on queue f in flight that a message's arrival wakes
    with pytest.raises(TimeoutError):
        conn.drain_events(timeout=0.1)
    publish(conn, "ctl-f", "to f")
    wait_for(lambda: redis_client.zcard(keys.marker) == 0, 5, "the wait to take the marker")
    # When the connection closes before reading the wait's answer
    conn.close()
    # Then nothing was picked for the closing consumer (kombu would read the answer and
    # pick), and the message waits with its marker set for the queue's other consumers
    assert got == [] and consumer.channel.closed
    assert redis_client.zcard(keys.waiting) == 1
    assert redis_client.zcard(keys.unacked) == 0
    assert redis_client.zcard(keys.marker) == 1


def test_control_clients_leave_nothing_behind(spawn: Spawn, redis_url: str,
                                              redis_client: redis.Redis) -> None:
    """Each control client has a reply queue of its own; the worker that replies to it
    did not declare it. Its put listed the queue in the registry for good (the rescoring
    pass, ``sitsq status`` and the metrics walk every entry: a liveness probe running
    ``celery inspect ping`` grew it by one per run), and a reply that came after the
    client stopped waiting left the queue's keys with no expiry."""
    from sits_queue.app import make_app
    from sits_queue.broker.keys import queues_registry
    from sits_queue.config import SitsConfig

    worker = spawn()
    registry = queues_registry("")
    for i in range(6):  # one client each, as probes are; the last ones too hasty to wait
        client = make_app(SitsConfig(redis_url=redis_url), main=f"probe-{i}")
        try:
            replies = client.control.ping(timeout=1.0 if i < 3 else 0.001)
            assert i >= 3 or replies == [{worker.hostname: {"ok": "pong"}}]
        finally:
            client.close()
    time.sleep(1.0)  # the hasty clients' replies land after they left
    listed = [m.decode() for m in redis_client.smembers(registry)]
    assert not [q for q in listed if "pidbox" in q], listed
    left = [k for k in redis_client.scan_iter(match="*pidbox*")
            if redis_client.type(k) != b"set" and redis_client.ttl(k) == -1]
    assert left == [], left


def test_rpc_result_queues_leave_nothing_behind(tmp_path: Path, redis_url: str,
                                                redis_client: redis.Redis) -> None:
    """With Celery's ``rpc://`` result backend each client reads its results from a
    queue named by its oid (a UUID), which the worker that puts results to it did not
    declare: that put listed the queue in the registry for good and left its keys with
    no expiry, one client process after another."""
    from sits_queue.app import make_app
    from sits_queue.broker.keys import RESULT_QUEUE_EXPIRES_MS, queues_registry
    from sits_queue.config import SitsConfig
    from sits_queue.procs import start_worker, wait_ready
    from tests.integration.conftest import APP_MODULE, ROOT, worker_env
    from tests.integration.worker_app import register

    env = {**worker_env(redis_url), "RESULT_BACKEND": "rpc://"}
    worker = start_worker(APP_MODULE, env, tmp_path, concurrency=1, cwd=ROOT)
    try:
        for i in range(3):  # one client process each
            client = make_app(SitsConfig(redis_url=redis_url), main=f"rpc-{i}")
            client.conf.result_backend = "rpc://"
            register(client)
            try:
                if i == 0:
                    wait_ready(client, [worker])
                assert client.tasks["w.add"].delay(i, 1).get(timeout=30) == i + 1
                oid = client.backend.oid
            finally:
                client.close()
            keys = QueueKeys.for_queue(oid).all()
            assert any(redis_client.exists(k) for k in keys)  # the worker's put was there
            ttls = [redis_client.pttl(k) for k in keys if redis_client.exists(k)]
            assert all(0 < ttl <= RESULT_QUEUE_EXPIRES_MS for ttl in ttls), ttls
        listed = {m.decode() for m in redis_client.smembers(queues_registry(""))}
        assert listed <= {"celery", "sits.control", f"{worker.hostname}.dq2"}, listed
        # A work queue may be named by a UUID too: its tasks are no results
        work = str(uuid.uuid4())
        client = make_app(SitsConfig(redis_url=redis_url), main="uuid-work")
        try:
            register(client)
            client.tasks["w.add"].apply_async((1, 1), queue=work)
        finally:
            client.close()
        assert redis_client.sismember(queues_registry(""), work)
        assert redis_client.pttl(QueueKeys.for_queue(work).waiting) == -1
    finally:
        worker.stop(timeout_s=10)


def test_a_pool_grown_by_remote_control_is_advertised_at_its_size_up_to_the_plan(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(status, /metrics and the warm reader kept the start's size: the added child's
    record, its warm engines, were never read; and a pool grown past the size it planned
    at start put a child on another's cores and device, with "pool will grow")"""
    from sits_queue.workers import advertise

    worker = spawn(concurrency=2)

    def advertised() -> object:
        record = advertise.read_worker(redis_client, "", worker.hostname)
        return None if record is None else record["concurrency"]

    def control(command: str, n: int) -> dict[str, str]:
        (reply,) = getattr(client_app.control, command)(
            n, destination=[worker.hostname], reply=True, timeout=5)
        return dict(reply[worker.hostname])

    wait_for(lambda: advertised() == 2, 30, "the worker's advertisement")
    assert "ok" in control("pool_shrink", 1)
    wait_for(lambda: advertised() == 1, 30, "the shrunk pool's size advertised")
    grown = control("pool_grow", 3)
    assert grown.get("ok", "").endswith("by 1 of the 3 asked (this worker planned its "
                                        "devices, cores and caches for 2 processes at "
                                        "start)"), grown
    wait_for(lambda: advertised() == 2, 30, "the grown pool's size advertised")
    refused = control("pool_grow", 1)
    assert "pool not grown: it runs 2 processes" in refused.get("error", ""), refused
    assert client_app.tasks["w.add"].delay(1, 2).get(timeout=30) == 3
    assert advertised() == 2


def test_a_pool_shrunk_by_remote_control_is_advertised_by_its_childrens_slots(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(billiard stops the first idle child, so the two left hold slots 1 and 2; the
    advertisement read and kept alive 0 and 1: slot 2's record, and the engines its
    child held, were neither read for picks nor kept past its expiry)"""
    from sits_queue.workers import advertise

    worker = spawn(concurrency=3)

    def advertised() -> tuple[object, list[str]] | None:
        record = advertise.read_worker(redis_client, "", worker.hostname)
        return None if record is None else (record.get("slots"), sorted(record["children"]))

    def alive(pid: object) -> bool:
        try:
            os.kill(int(pid), 0)  # type: ignore[call-overload]
        except (OSError, TypeError, ValueError):
            return False
        return True

    def live_slots() -> list[int]:
        """The slots whose child records name a live process."""
        slots = []
        for slot in range(3):
            child = advertise.json_object(
                redis_client.get(advertise.child_key("", worker.hostname, slot)))
            if child is not None and alive(child.get("pid")):
                slots.append(slot)
        return slots

    wait_for(lambda: advertised() == ([0, 1, 2], ["0", "1", "2"]), 30,
             "the three children advertised")
    (reply,) = client_app.control.pool_shrink(1, destination=[worker.hostname], reply=True,
                                              timeout=5)
    assert "ok" in reply[worker.hostname], reply

    def state() -> dict[str, object]:
        """What a wait that never ends shows: the advertisement, the live slots, the
        child records' TTLs."""
        return {"advertised": advertised(), "live": live_slots(),
                "ttls": [redis_client.ttl(advertise.child_key("", worker.hostname, s))
                         for s in range(3)]}

    wait_for(lambda: len(live_slots()) == 2, 30, "a child stopped", seen=state)
    kept = live_slots()
    wait_for(lambda: advertised() == (kept, [str(s) for s in kept]), 30,
             f"the children left (slots {kept}) advertised", seen=state)
    assert client_app.tasks["w.add"].delay(2, 2).get(timeout=30) == 4


def test_a_pool_shrunk_to_no_child_advertises_no_slot_and_serves_once_grown(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(read as the planned size, it was advertised with one slot and the warm engines of
    the child it had stopped: `sitsq status`, /metrics, the picks' weights)"""
    from sits_queue.workers import advertise

    worker = spawn(concurrency=1)
    assert client_app.tasks["w.add"].delay(1, 1).get(timeout=30) == 2

    def advertised() -> tuple[object, object, list[str]] | None:
        record = advertise.read_worker(redis_client, "", worker.hostname)
        return None if record is None else (record.get("concurrency"), record.get("slots"),
                                            sorted(record["children"]))

    wait_for(lambda: advertised() == (1, [0], ["0"]), 30, "the child advertised")

    def shrunk() -> bool:  # (refused while billiard still counts the child busy)
        (reply,) = client_app.control.pool_shrink(1, destination=[worker.hostname],
                                                  reply=True, timeout=5)
        return "ok" in reply[worker.hostname]

    wait_for(shrunk, 30, "the pool shrunk")
    wait_for(lambda: advertised() == (0, [], []), 30, "no child advertised",
             seen=advertised)
    status = subprocess.run([sys.executable, "-m", "sits_queue.cli", "status"], cwd=ROOT,
                            env={**os.environ, "SITS_REDIS_URL": client_app.sits.redis_url},
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert f"  {worker.hostname}: pid {worker.pid}, concurrency 0," in status.stdout, \
        status.stdout
    # and grown again, it serves, advertised again
    (reply,) = client_app.control.pool_grow(1, destination=[worker.hostname], reply=True,
                                            timeout=5)
    assert "ok" in reply[worker.hostname], reply
    assert client_app.tasks["w.add"].delay(2, 2).get(timeout=30) == 4
    wait_for(lambda: (advertised() or (0,))[0] == 1, 30, "the child advertised again",
             seen=advertised)


def test_autoscale_set_remotely_is_followed_up_to_the_planned_pool(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(the intake followed the start's maximum, not the autoscaler's: a maximum raised
    by `control autoscale` was replied ok and never reached; and past the start's
    maximum more children would share the planned slots' devices and budgets)"""
    worker = spawn(concurrency=1, extra_args=("--autoscale=3,1",))

    def autoscale(most: int, least: int) -> str:
        (reply,) = client_app.control.autoscale(most, least, destination=[worker.hostname],
                                                reply=True, timeout=5)
        return str(reply[worker.hostname].get("ok", reply))

    def busy() -> int:
        (reply,) = client_app.control.inspect(destination=[worker.hostname],
                                              timeout=2).active().values()
        return len(reply)

    # Given its maximum lowered to 1: one task runs, the next waits in the queue (not
    # taken by a worker that cannot run it: exact priority order)
    assert autoscale(1, 1) == "autoscale now max=1 min=1"
    first = [client_app.tasks["w.slow"].delay(f"one{i}", 2.0) for i in range(2)]
    wait_for(lambda: busy() == 1, 30, "one task running")
    assert redis_client.zcard(QueueKeys.for_queue("celery").waiting) == 1
    assert [r.get(timeout=30) for r in first] == ["one0", "one1"]
    # and raised again to 3, the one it started with
    assert autoscale(3, 1) == "autoscale now max=3 min=1"
    # When 3 long tasks wait, the pool runs 3 at once
    slow = [client_app.tasks["w.slow"].delay(f"as{i}", 4.0) for i in range(3)]
    wait_for(lambda: busy() == 3, 30, "3 tasks running at once")
    assert [r.get(timeout=30) for r in slow] == ["as0", "as1", "as2"]
    # Asked past what it planned at start: it sets that much, and says why
    said = autoscale(6, 1)
    assert said.startswith("autoscale now max=3 min=1 (asked max=6: this worker planned")
    assert "--autoscale=6," in said
    # and so is a minimum past the plan (it grew the pool to it); one above the maximum
    # is refused
    said = autoscale(6, 5)
    assert said.startswith("autoscale now max=3 min=3 (asked max=6, min=5: this worker "
                           "planned")
    (reply,) = client_app.control.autoscale(2, 3, destination=[worker.hostname],
                                            reply=True, timeout=5)
    assert reply[worker.hostname] == {"error": "autoscale: min=3 is above max=2"}
