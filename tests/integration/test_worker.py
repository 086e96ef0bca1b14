"""Real ``celery worker`` / ``beat`` / CLI subprocesses on the sorted-set transport."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from celery import Celery
from celery.exceptions import NotRegistered

from sits_queue.broker.keys import QueueKeys, stats_key
from sits_queue.errors import DeadLettered
from sits_queue.procs import CeleryProcess, start_worker, wait_ready
from tests.integration.conftest import APP_MODULE, ROOT, refusal, worker_env
from tests.integration.test_transport import kombu_message
from tests.waiting import wait_for

Spawn = Callable[..., CeleryProcess]
WAITING = QueueKeys.for_queue("celery")




def test_delay_from_a_separate_process(spawn: Spawn, client_app: Celery,
                                       redis_url: str) -> None:
    spawn()
    # Given a producer that is another OS process, using plain `delay()`
    code = ("from tests.integration.worker_app import tasks; "
            "print(tasks['add'].delay(2, 3).id)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ,
                         **worker_env(redis_url)}, cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    # Then the worker runs it and the result comes back through the result backend
    assert client_app.AsyncResult(out.stdout.strip()).get(timeout=30) == 5


@pytest.mark.parametrize("settings", [{"preimport": "0"}, {"plain_tasks_only": "1"}])
def test_a_worker_told_not_to_preimport_forks_its_children_without_torch(
        spawn: Spawn, client_app: Celery, settings: dict[str, str]) -> None:
    """(this app registers models: by default its parent imports the inference stack
    before the fork; not when told, nor on a worker of plain tasks only; and a child's
    own start-up imports none of it)"""
    spawn(**settings)
    assert client_app.send_task("x.forked_with").get(timeout=30) == []


def test_a_worker_of_an_app_with_models_forks_its_children_with_torch(
        spawn: Spawn, client_app: Celery) -> None:
    spawn(preimport="1")
    assert client_app.send_task("x.forked_with").get(timeout=60) == [
        "torch", "transformers.modeling_utils"]


@pytest.mark.parametrize("preimport", ["1", "0"])
def test_a_pool_childs_full_collection_walks_what_its_tasks_made_not_its_imports(
        spawn: Spawn, client_app: Celery, preimport: str) -> None:
    """(workers/childgc.py: the parent freezes before its first fork, the child after its
    start-up and after its first ``import torch``; a child's collection took 35-90 ms,
    run after each failed or yielded task every 10 s, its slot busy meanwhile)"""
    spawn(concurrency=1, preimport=preimport)
    # Given a child that has loaded a model: torch imported by its parent before the
    # fork, or by its own first load
    result = client_app.send_task("w.infer_steps", args=("gc", 1, 0.0)).get(timeout=60)
    assert result["output"] == 1 and result["sits"]["source"] == "disk"
    # Then what it imported is frozen, and a full collection walks a small part of it
    seen = client_app.send_task("x.collector").get(timeout=30)
    assert seen["torch"]
    assert seen["frozen"] > 100_000  # (torch alone is ~147k objects)
    assert seen["tracked"] < seen["frozen"] / 10


@pytest.mark.slow
def test_ten_thousand_in_ten_thousand_out_no_duplicates(spawn: Spawn, client_app: Celery,
                                                        redis_client: redis.Redis) -> None:
    n = 10_000
    record = client_app.tasks["w.record"]
    with client_app.producer_or_acquire() as producer:
        ids = [record.apply_async((f"t{i}",), producer=producer).id for i in range(n)]
    spawn(concurrency=2)
    spawn(concurrency=2)
    wait_for(lambda: int(redis_client.get("test:runs") or 0) >= n, 240, f"{n} executions")
    time.sleep(1.0)  # a duplicate would still be running now; give it the chance to show
    assert redis_client.scard("test:done") == n
    assert int(redis_client.get("test:runs") or 0) == n
    results = [client_app.AsyncResult(i) for i in ids[:: n // 100]]
    assert all(r.get(timeout=30).startswith("t") for r in results)
    assert redis_client.zcard(WAITING.waiting) == 0
    wait_for(lambda: redis_client.zcard(WAITING.unacked) == 0, 10, "the last acks")
    assert redis_client.hlen(WAITING.payloads) == 0


def test_a_task_out_of_memory_is_named_in_its_failed_event(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(the event, which Flower shows, said "ExceptionWithTraceback()")"""
    def out_of_memory() -> None:
        with pytest.raises(MemoryError):
            client_app.tasks["w.memerr"].delay("evented").get(timeout=30)

    _, failed = failed_events(spawn, client_app, redis_client, out_of_memory)
    assert "ran out of memory: MemoryError: simulated: evented" in failed[0]["exception"]


def failed_events(spawn: Spawn, client_app: Celery, redis_client: redis.Redis,
                  act: Callable[[], None]) -> tuple[CeleryProcess, list[dict[str, Any]]]:
    """A worker of one slot, and the task-failed events it sent while ``act()`` ran."""
    import threading

    failed: list[dict[str, Any]] = []
    receivers: list[Any] = []

    def listen() -> None:
        with client_app.connection_for_read() as conn:
            receiver = client_app.events.Receiver(
                conn, handlers={"task-failed": failed.append})
            receivers.append(receiver)
            # One subscription for the whole test (no timeout: consume() loops until
            # should_stop): one consume() a second, as before, left a gap between each
            # unsubscribe and the next subscribe, and an event published in it was lost
            # (pub/sub keeps nothing): the test waited 15 s for it under CI's load.
            for _ in receiver.consume(limit=None, timeout=None, wakeup=False):
                pass

    patterns = redis_client.pubsub_numpat()  # (kombu subscribes to events by pattern)
    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    try:
        # (subscribed before anything can be published)
        wait_for(lambda: redis_client.pubsub_numpat() > patterns, 15,
                 "the event receiver to subscribe")
        worker = spawn(concurrency=1)
        act()
        wait_for(lambda: bool(failed), 15, "the task-failed event")
    finally:
        for receiver in receivers:
            receiver.should_stop = True
        thread.join(5)
    return worker, failed


def test_a_task_out_of_memory_fails_alone_and_the_worker_serves_on(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(Celery re-raised the task's MemoryError in the worker's main process and stopped;
    the message, given back uncounted, stopped every worker that took it next)"""
    from sits_queue.errors import InferenceError, ModelLoadError

    # a batch whose function failed one call with a MemoryError and another with a
    # BaseException, submitted before the worker starts so that they run together
    texts = ["ab", "memerr", "base", "abcd"]
    batch = [client_app.tasks["w.lengths_odd"].delay(t) for t in texts]
    worker = spawn(concurrency=1)
    with pytest.raises(MemoryError, match="simulated: one"):
        client_app.tasks["w.memerr"].delay("one").get(timeout=30)
    assert client_app.tasks["w.add"].delay(2, 3).get(timeout=30) == 5
    # the log says so in the main process's words (it said only the child's "raised
    # unexpected: MemoryError"), as README promises
    wait_for(lambda: "TaskOutOfMemory: task w.memerr[" in worker.log(), 10, "the log line")
    got: list[Any] = []
    for one in batch:
        try:
            got.append(one.get(timeout=60))
        except Exception as exc:
            got.append(exc)
    # each call its own outcome (those after the BaseException failed with its error)
    assert got[0]["output"] == 2 and got[3]["output"] == 4, got
    assert got[0]["sits"]["batch"]["size"] == len(texts)
    assert isinstance(got[1], MemoryError)
    assert isinstance(got[2], InferenceError) and "failed this call with Quit" in str(got[2])
    # counted as it failed: an InferenceError (it was "other", its raw BaseException's)
    from tests.integration.counting import counters_once

    counters_once(redis_client, worker.hostname, lambda c: c.get("failed:InferenceError", 0)
                  >= 1, "the call's failure counted as an InferenceError")
    # a loader that raised SystemExit: said, on the first run (each run ended the pool
    # child, and the task was dead-lettered as poison after max_redeliveries)
    with pytest.raises(ModelLoadError, match=r"'w\.exiting' tried to end its process"):
        client_app.tasks["w.use_exiting"].delay().get(timeout=60)
    assert worker.popen.poll() is None and client_app.tasks["w.add"].delay(1, 1).get(
        timeout=30) == 2
    # nothing given back to run again
    wait_for(lambda: redis_client.zcard(WAITING.unacked) == 0, 10, "the acks")
    assert redis_client.zcard(WAITING.waiting) == 0


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_task_calling_sys_exit_fails_alone_and_its_process_serves_on(
        pool: str, spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(a task's SystemExit ended its pool child at every run, until the message was
    dead-lettered as poison with no word of why; in a solo pool it stopped the worker)"""
    from sits_queue.errors import TaskExited

    # a batch whose function calls sys.exit(), waiting before the worker starts
    batch = [client_app.tasks["w.lengths_exits"].delay(t) for t in ["ab", "exit", "abc"]]
    worker = spawn(concurrency=1, pool=pool)
    before = client_app.tasks["w.pid"].delay().get(timeout=30)
    with pytest.raises(TaskExited,
                       match=r"w\.exits\[.+\] tried to end its process: SystemExit\(3\)"):
        client_app.tasks["w.exits"].delay(3).get(timeout=30)
    with pytest.raises(TaskExited, match=r"w\.infer_exits\[.+\].*SystemExit\(5\)"):
        client_app.tasks["w.infer_exits"].delay(5).get(timeout=60)
    for one in batch:  # each call fails with it, as with any error of the batch's run
        with pytest.raises(TaskExited, match=r"SystemExit\(4\)"):
            one.get(timeout=60)
    # Then the same process ran them all and serves on; nothing is run again
    assert client_app.tasks["w.pid"].delay().get(timeout=30) == before
    assert worker.popen.poll() is None
    wait_for(lambda: redis_client.zcard(WAITING.unacked) == 0, 10, "the acks")
    assert redis_client.zcard(WAITING.waiting) == 0


def test_a_worker_and_beat_end_with_the_process_that_started_them(
        tmp_path: Path, redis_url: str) -> None:
    """(a starter killed outright, a `sitsq demo` say, left its worker and beat running
    for good: the next demo counted their work, and two beats ran at once)"""
    starter = ("import json, sys, time\n"
               "from pathlib import Path\n"
               "from sits_queue.procs import start_beat, start_worker\n"
               "env, logs = json.loads(sys.argv[1]), Path(sys.argv[2])\n"
               f"w = start_worker({APP_MODULE!r}, env, logs, concurrency=1)\n"
               f"b = start_beat({APP_MODULE!r}, env, logs)\n"
               "print(w.pid, b.pid, flush=True)\n"
               "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", starter, json.dumps(worker_env(redis_url)),
                             str(tmp_path)], stdout=subprocess.PIPE, cwd=ROOT, text=True)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    try:
        # (up: a watch that starts after the kill stops them at once all the same)
        def up() -> bool:
            logs = {f.name: f.read_text(errors="replace") for f in tmp_path.glob("*.log")}
            return "beat: Starting" in logs.get("beat.log", "") and any(
                " ready." in log for name, log in logs.items() if name != "beat.log")
        wait_for(up, 60, "the worker and beat to start")
        # When the starter is killed outright
        proc.kill()
        proc.wait()
        # Then its worker and beat stop too
        wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                 != psutil.STATUS_ZOMBIE for p in pids), 60,
                 "the orphaned worker and beat to stop")
    finally:
        proc.kill()
        proc.wait()
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def test_a_redis_url_with_connection_options_serves(tmp_path: Path, redis_url: str) -> None:
    """(the README's own ?socket_timeout=5&health_check_interval=30 stopped every
    producer, worker and beat: Celery's broker layer refused the query's keywords)"""
    from sits_queue.app import make_app
    from sits_queue.config import SitsConfig

    base, _, db = redis_url.rpartition("/")
    url = f"{base}/?db={db}&socket_timeout=5&health_check_interval=30&retry_on_timeout=true"
    app = make_app(SitsConfig(redis_url=url), main="url-options")
    assert app.conf.broker_transport_options["socket_timeout"] == 5.0
    assert app.conf.redis_backend_health_check_interval == 30
    worker = start_worker(APP_MODULE, worker_env(url), tmp_path, concurrency=1, cwd=ROOT)
    try:
        wait_ready(app, [worker])
        assert app.send_task("w.add", (2, 3)).get(timeout=30) == 5
    finally:
        worker.stop(timeout_s=20)
        app.close()


@pytest.mark.parametrize(("env", "said"), [
    ({"CELERY_BROKER_URL": "redis://127.0.0.1:1/0"}, "is not the SITS Redis URL"),
    ({"CELERY_BROKER_URL": "redis://127.0.0.1:1/0"}, "set SITS_REDIS_URL instead")])
def test_a_broker_url_other_than_the_sits_one_is_refused_in_one_line(
        tmp_path: Path, redis_url: str, env: dict[str, str], said: str) -> None:
    """(the queues went to the -b / CELERY_BROKER_URL server, worker records, results and
    rescoring to the SITS one, and `sitsq status` saw no queue)"""
    proc = start_worker(APP_MODULE, {**worker_env(redis_url), **env}, tmp_path,
                        concurrency=1, cwd=ROOT)
    assert said in refusal(proc, "a broker URL of its own")


def test_a_database_the_server_does_not_keep_is_refused_in_one_line(
        tmp_path: Path, redis_url: str) -> None:
    """(the worker logged "DB index is out of range" and tried again for good)"""
    base, _, _ = redis_url.rpartition("/")
    proc = start_worker(APP_MODULE, worker_env(f"{base}/9999"), tmp_path, concurrency=1,
                        cwd=ROOT)
    said = refusal(proc, "a database out of range")
    assert "has no such database: DB index is out of range" in said, said[-2000:]


def test_an_autoscaled_pool_is_planned_at_its_largest(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(it was planned at its starting size: each child took a whole host's share of
    cores and memory, and the children it grew shared cores)"""
    from sits_queue.workers import advertise

    worker = spawn(concurrency=1, extra_args=("--autoscale=2,1",))
    client_app.tasks["w.pid"].delay().get(timeout=30)
    record = advertise.json_object(redis_client.get(
        advertise.child_key("", worker.hostname, 0))) or {}
    assert record.get("slots") == 2


def test_sigkilled_worker_task_is_redelivered_and_completes(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    # (as for a worker of another host: this one does not say which process it is, so
    # no worker here can see it die; test_a_sigkilled_workers_task_... below)
    first = spawn(visibility_timeout_s="4", reclaim_dead_holders="0")
    result = client_app.tasks["w.slow"].delay("k", 2.0)
    wait_for(lambda: redis_client.get("test:started:k") == b"1", 30, "the task to start")
    # When the whole worker (main process and pool) dies without a word
    first.kill()
    assert redis_client.zcard(WAITING.unacked) == 1
    # Then a surviving worker restores it after the visibility timeout and runs it
    spawn(visibility_timeout_s="4")
    assert result.get(timeout=60) == "k"
    assert redis_client.get("test:started:k") == b"2"
    # Late ack: the result is stored just before the ack, so wait for the ack itself.
    wait_for(lambda: redis_client.zcard(WAITING.unacked) == 0, 10, "the ack")


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_sigkilled_workers_task_is_restored_by_a_worker_of_its_host_within_a_tick(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis, pool: str) -> None:
    """(only the visibility timeout brought it back, a minute or more later: a worker of
    another host may be alive behind a slow network, but a dead one of this host is
    seen dead in /proc: broker/holders.py)"""
    timeout = "120"  # restored by the timeout, it would run again after 119 s or more
    # Given a worker running a task
    first = spawn(pool=pool, concurrency=1, visibility_timeout_s=timeout)
    result = client_app.tasks["w.slow"].delay("k", 3.0)
    wait_for(lambda: redis_client.get("test:started:k") == b"1", 30, "the task to start")
    children = psutil.Process(first.pid).children(recursive=True)
    # When its main process is killed (the OOM killer, a crash in an extension under
    # --pool=solo), alone: no shutdown, no give-back
    os.kill(first.pid, signal.SIGKILL)
    first.popen.wait(10)
    # and its supervisor starts a worker in its place
    spawn(pool=pool, concurrency=1, visibility_timeout_s=timeout)
    # Then the task runs again within a sweep tick of a consumer of this host (this
    # test's own control client among them), far sooner than the timeout
    assert result.get(timeout=60) == "k"
    assert redis_client.get("test:started:k") == b"2"
    # and not beside an orphan of itself: the pool child died with its parent (it would
    # have finished its 3 s by now)
    assert not any(child.is_running() for child in children)
    assert redis_client.lrange("test:finished", 0, -1) == [b"k"]


def test_a_busy_solo_worker_puts_back_a_dead_neighbours_task_while_its_own_runs(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(a --pool=solo worker runs its task in its event loop: busy, it looked for dead
    holders only between tasks, and so did its sweep: the neighbour's task waited for
    the busy one's end; now its heartbeat thread looks when the loop has not)"""
    timeout = "15"  # a beat every 5 s
    # Given a solo worker busy with a long task, no other consumer in the test
    busy = spawn(pool="solo", concurrency=1, visibility_timeout_s=timeout)
    client_app.tasks["w.slow"].delay("long", 25.0)
    wait_for(lambda: redis_client.get("test:started:long") == b"1", 30, "the long task")
    # and a neighbour running a task
    doomed = spawn(pool="solo", concurrency=1, visibility_timeout_s=timeout)
    short = client_app.tasks["w.slow"].delay("k", 1.0)
    wait_for(lambda: redis_client.get("test:started:k") == b"1", 30, "the task to start")
    # When the neighbour is killed outright
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.popen.wait(10)
    # Then its task is back in the queue while the busy worker's own still runs
    wait_for(lambda: redis_client.zcard(WAITING.unacked) == 1, 15,
             "the dead worker's task to go back")
    assert redis_client.zcard(WAITING.waiting) == 1
    assert redis_client.lrange("test:finished", 0, -1) == []
    # and runs once that one is done
    assert short.get(timeout=60) == "k"
    assert redis_client.get("test:started:k") == b"2"
    assert redis_client.lrange("test:finished", 0, -1) == [b"long", b"k"]
    assert busy.alive()


def test_a_hard_limit_overdue_after_its_task_ended_kills_no_idle_child(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(``workers/latelimit.py``: a parent whose loop was blocked past a task's hard
    limit ran the overdue timer before it read the child's result, and killed the
    child, idle by then, with its warm engines)"""
    worker = spawn(concurrency=1)
    (child,) = psutil.Process(worker.pid).children()
    # Given a task that runs past its soft limit (3.2 s) and ends before its hard one
    result = client_app.tasks["w.past_soft"].apply_async(("late", 3.8), time_limit=4.0)
    wait_for(lambda: redis_client.get("test:started:late") is not None, 30, "the start")
    started = float(redis_client.get("test:started:late") or 0)
    # When the worker's main process stalls past the hard limit, after the soft one
    # fired (a Redis outage holding its loop), the task ending meanwhile
    time.sleep(max(0.0, started + 3.45 - time.time()))
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        time.sleep(max(0.0, started + 5.5 - time.time()))
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    # Then its result is read, and the child lives on
    assert result.get(timeout=30) == "late"
    assert client_app.tasks["w.add"].delay(1, 1).get(timeout=30) == 2
    assert [p.pid for p in psutil.Process(worker.pid).children()] == [child.pid]
    assert "Hard time limit" not in worker.log()


def test_sigkilled_pool_child_requeues_its_task(spawn: Spawn, client_app: Celery,
                                                redis_client: redis.Redis) -> None:
    worker = spawn(concurrency=1)
    result = client_app.tasks["w.slow"].delay("c", 1.5)
    wait_for(lambda: redis_client.get("test:started:c") == b"1", 30, "the task to start")
    children = psutil.Process(worker.pid).children(recursive=True)
    assert children, "prefork worker has no pool child"
    for child in children:
        os.kill(child.pid, signal.SIGKILL)
    # task_reject_on_worker_lost: the message goes back and a fresh child runs it
    assert result.get(timeout=60) == "c"
    assert redis_client.get("test:started:c") == b"2"
    assert worker.alive()


def test_unknown_task_fails_clearly_and_the_worker_keeps_serving(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    worker = spawn()
    ghost = client_app.send_task("no.such.task", args=(1,))
    with pytest.raises(NotRegistered):
        ghost.get(timeout=30)
    assert client_app.tasks["w.add"].delay(1, 1).get(timeout=30) == 2
    assert worker.alive()
    (record,) = [json.loads(v) for v in redis_client.hvals(WAITING.dead)]
    assert record["reason"] == ("unknown task 'no.such.task': not registered in this worker "
                                "(NotRegistered)")


def test_a_task_that_rejects_itself_for_good_is_dead_lettered_with_its_reason(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(the dead letter read "rejected by consumer": ``sitsq dead list`` did not say why)"""
    spawn(concurrency=1)
    refused = client_app.tasks["w.refuse"].delay("abc")
    retried = client_app.tasks["w.retry_refused"].delay()
    for result in (refused, retried):
        with pytest.raises(Exception):  # noqa: B017 (the result's own failure: below)
            result.get(timeout=30)
    wait_for(lambda: redis_client.hlen(WAITING.dead) == 2, 10, "both dead letters")
    reasons = sorted(json.loads(v)["reason"] for v in redis_client.hvals(WAITING.dead))
    assert reasons == ["rejected by the task: InvalidTaskOptions: unknown sla_class 'nope'; "
                       "known classes: ['high', 'medium', 'low']",
                       "rejected by the task: input 'abc' is not valid"]
    assert client_app.tasks["w.add"].delay(1, 2).get(timeout=30) == 3


def plant(redis_client: redis.Redis, payloads: dict[str, str]) -> None:
    """Write ``payloads`` straight into the queue, as a foreign writer would, by tag."""
    for tag, payload in payloads.items():
        redis_client.hset(WAITING.payloads, tag, payload)
        redis_client.zadd(WAITING.waiting, {tag: 0})
    redis_client.zadd(WAITING.marker, {"ready": 0})


def test_malformed_messages_do_not_kill_the_worker(spawn: Spawn, client_app: Celery,
                                                   redis_client: redis.Redis) -> None:
    worker = spawn()
    # A foreign writer drops garbage straight into the queue while the worker waits: not
    # JSON, a body that is not a string, and messages that decode as JSON but not as
    # kombu messages (each one stopped the worker, and the next one after the
    # visibility timeout)
    bad = {"junk": "{{{ not json",
           "nobody": json.dumps({"body": {"no": "headers"}, "properties": {}, "headers": {}}),
           "info": kombu_message(properties={"delivery_info": 5}).decode(),
           "uuid": kombu_message(headers={"x": {"__type__": "uuid", "__value__": 5}}).decode(),
           "codec": kombu_message(body="eA==", properties={"body_encoding": "rot13"}).decode(),
           "task": kombu_message(headers={"task": ["unhashable"]}).decode()}
    plant(redis_client, bad)
    # Then it dead-letters each one and serves the next task
    assert client_app.tasks["w.add"].delay(2, 2).get(timeout=30) == 4
    assert worker.alive()
    assert sorted(k.decode() for k in redis_client.hkeys(WAITING.dead)) == sorted(bad)
    assert redis_client.zcard(WAITING.waiting) == 0
    wait_for(lambda: redis_client.zcard(WAITING.unacked) == 0, 10, "the last ack")


def celery_message(task_id: Any = "poison-id", body: Any = None, drop: tuple[str, ...] = (),
                   **headers: Any) -> str:
    """A task message as Celery's producer writes it (protocol 2), with ``headers``
    changed and ``drop`` left out, and ``body`` (JSON text) instead of its own."""
    h: dict[str, Any] = {"lang": "py", "task": "w.add", "id": task_id, "eta": None,
                         "expires": None, "retries": 0, "timelimit": [None, None],
                         "root_id": task_id, "parent_id": None, "group": None,
                         "origin": "elsewhere", "ignore_result": False, **headers}
    for name in drop:
        h.pop(name)
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    return json.dumps({"body": json.dumps([[1, 2], {}, embed]) if body is None else body,
                       "content-encoding": "utf-8", "content-type": "application/json",
                       "headers": h, "properties": {"correlation_id": task_id,
                                                    "delivery_info": {}, "priority": 0,
                                                    "body_encoding": "utf-8"}})


def test_messages_celery_cannot_take_do_not_kill_the_worker(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """Kombu-shaped messages that break Celery's own protocol: each one stopped the
    worker's main process ("Unrecoverable error", the next worker too after the
    visibility timeout, never counted, never dead-lettered), sent it into a reconnect
    loop (a KeyError reads as a lost connection), or was acked and lost with its caller
    waiting for ever."""
    bad = {"body-str": celery_message(body=json.dumps("hello")),
           "body-num": celery_message(body="5"),
           "body-pair": celery_message(body=json.dumps([[1, 2], {}])),
           "body-not-json": celery_message(task_id="not-json-id", body="{{{"),
           "kwargs-list": celery_message(task_id="kwargs-id",
                                         body=json.dumps([[1], [2], {}])),
           "id-list": celery_message(task_id=["a"]),
           "id-int": celery_message(task_id=5),
           "no-id": celery_message(drop=("id",)),
           # (ran; its result could not be stored, and the message was acked: lost)
           "id-surrogate": celery_message(task_id="\udcff-bad"),
           "limits-str": celery_message(task_id="limits-id", timelimit="abc"),
           "limits-strs": celery_message(timelimit=["a", "b"]),
           # JSON integers past a float's range: the pool's timer raised OverflowError
           # in the main process once the child took the job, and every worker after
           "limits-huge-soft": celery_message(timelimit=[None, 10**400]),
           "limits-huge-hard": celery_message(timelimit=[10**400, None]),
           # (a negative soft limit fired at once: failed or not, a race with the body)
           "limits-negative": celery_message(timelimit=[-5, -10]),
           # Celery walks the stamps after it took the pool's one slot for the task: it
           # raised there, and the slot was never given back (the worker served no more)
           "stamped-int": celery_message(task_id="stamped-id", stamped_headers=5),
           "stamps-str": celery_message(stamps="x", stamped_headers=["a"]),
           # kombu hands its body over as it is: "too many values to unpack"
           "no-content-type": json.dumps({k: v for k, v in json.loads(
               celery_message(task_id="ct-id")).items() if k != "content-type"})}
    worker = spawn(concurrency=1)
    plant(redis_client, bad)
    # Then each is dead-lettered with what is wrong, and the worker serves on
    assert client_app.tasks["w.add"].delay(2, 2).get(timeout=30) == 4
    assert worker.alive(), worker.log()[-3000:]
    dead = {k.decode(): json.loads(v)["reason"]
            for k, v in redis_client.hgetall(WAITING.dead).items()}
    assert sorted(dead) == sorted(bad)
    assert "body is not a task's [args" in dead["body-pair"]
    assert "body is not JSON" in dead["body-not-json"]
    assert "headers.id is not a task id" in dead["no-id"]
    assert "headers.id is not UTF-8 text: '\\udcff-bad'" in dead["id-surrogate"]
    assert dead["no-content-type"].endswith("no content-type: a task message says how its "
                                            "body is encoded (application/json, ...)")
    assert "headers.timelimit" in dead["limits-str"]
    assert "headers.timelimit" in dead["limits-huge-soft"]
    assert "headers.timelimit" in dead["limits-huge-hard"]
    assert "headers.timelimit is not [hard, soft] seconds" in dead["limits-negative"]
    assert "headers.stamped_headers is not a list of header names: 5" in dead["stamped-int"]
    assert "headers.stamps is not an object: 'x'" in dead["stamps-str"]
    assert "Connection to broker lost" not in worker.log()
    # and a message with a task id fails its task's result, so its caller does not wait
    for task_id in ("not-json-id", "kwargs-id", "limits-id", "stamped-id"):
        with pytest.raises(DeadLettered, match="malformed payload"):
            client_app.AsyncResult(task_id).get(timeout=10)
    wait_for(lambda: redis_client.zcard(WAITING.unacked) == 0, 10, "the last ack")


def test_a_request_celery_raises_on_after_taking_the_slot_frees_it_and_is_dead_lettered(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """Whatever Celery raises on between taking a pool slot for a request and handing
    it to the pool (no check here foresaw it): the slot comes back, the message is
    dead-lettered with the error, and its caller learns why."""
    worker = spawn(concurrency=1)
    # Given a worker of one pool slot and a task Celery cannot start
    refused = client_app.tasks["w.unstartable"].delay()
    # When it has been taken, twice over (each would have held the only slot)
    with pytest.raises(DeadLettered, match="consumer refused it: ValueError: this request "
                                           "cannot be started"):
        refused.get(timeout=30)
    with pytest.raises(DeadLettered):
        client_app.tasks["w.unstartable"].delay().get(timeout=30)
    # Then the worker serves on from its one slot
    assert client_app.tasks["w.add"].delay(2, 2).get(timeout=30) == 4
    assert worker.alive()
    assert redis_client.hlen(WAITING.dead) == 2
    wait_for(lambda: redis_client.zcard(WAITING.unacked) == 0, 10, "the last ack")


def test_a_batch_member_celery_raises_on_is_dead_lettered_and_its_batch_mates_run(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    lengths = client_app.tasks["w.lengths_unstartable"]
    # Given three calls of a batch task waiting together, one of which Celery cannot start
    calls = [lengths.delay(text) for text in ("ab", "unstartable", "abcd")]
    spawn(concurrency=1)
    # Then that one is dead-lettered with the error, the others run (a batch of two)
    with pytest.raises(DeadLettered, match="ValueError: this call cannot be started"):
        calls[1].get(timeout=60)
    done = [calls[0].get(timeout=60), calls[2].get(timeout=60)]
    assert [d["output"] for d in done] == [2, 4]
    assert {d["sits"]["batch"]["size"] for d in done} == {2}
    # and the worker's one slot serves on
    assert client_app.tasks["w.add"].delay(2, 2).get(timeout=30) == 4
    wait_for(lambda: redis_client.zcard(WAITING.unacked) == 0, 10, "the last ack")


def test_messages_celery_would_drop_or_reject_unexplained_are_dead_lettered_with_why(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """Stock Celery acks (loses) a message whose body does not decode, and rejects an
    invalid task message with the reason in its log only; the callers wait for ever."""
    gzip_garbage = base64.b64encode(b"not gzip at all").decode()
    pickled = base64.b64encode(pickle.dumps([[1, 2], {}, {}])).decode()

    def foreign(task_id: str, **changes: Any) -> str:
        message = json.loads(celery_message(task_id=task_id))
        for key, value in changes.items():
            if key == "headers":
                message["headers"].update(value)
            elif key == "drop_task":
                message["headers"].pop("task")
            else:
                message[key] = value
        return json.dumps(message)

    bad = {
        # a body that does not decompress: corrupt, or a codec kombu does not have
        "gzip": foreign("gzip-id", body=gzip_garbage,
                        properties={"body_encoding": "base64", "delivery_info": {}},
                        headers={"compression": "application/x-gzip"}),
        "codec": foreign("codec-id", headers={"compression": "application/x-lz5"}),
        # no task name in the headers (protocol 1) and a body that does not decode
        "v1-junk": foreign("v1-id", drop_task=True, body="{{{"),
        "v1-pickle": foreign("v1p-id", drop_task=True, body=pickled,
                             properties={"body_encoding": "base64", "delivery_info": {}},
                             **{"content-type": "application/x-python-serialize",
                                "content-encoding": "binary"}),
        # task messages Celery refuses: content it does not accept, an ETA it cannot read
        "pickle": foreign("pickle-id", body=pickled,
                          properties={"body_encoding": "base64", "delivery_info": {}},
                          **{"content-type": "application/x-python-serialize",
                             "content-encoding": "binary"}),
        "eta": foreign("eta-id", headers={"eta": "tomorrow-ish"}),
    }
    worker = spawn(concurrency=1)
    plant(redis_client, bad)
    assert client_app.tasks["w.add"].delay(2, 2).get(timeout=30) == 4
    wait_for(lambda: redis_client.hlen(WAITING.dead) == len(bad), 10, "every dead letter")
    assert worker.alive(), worker.log()[-3000:]
    dead = {k.decode(): json.loads(v)["reason"]
            for k, v in redis_client.hgetall(WAITING.dead).items()}
    assert "body does not decompress ('application/x-gzip')" in dead["gzip"]
    assert "body does not decompress ('application/x-lz5')" in dead["codec"]
    assert dead["v1-junk"].startswith("body does not decode: ")
    assert dead["v1-pickle"].startswith("body does not decode: ContentDisallowed: ")
    assert dead["pickle"].startswith("invalid task message: ContentDisallowed: ")
    assert dead["eta"].startswith("invalid task message: ") and "tomorrow-ish" in dead["eta"]
    # and each task's caller learns why instead of waiting
    for task_id, tag in (("gzip-id", "gzip"), ("pickle-id", "pickle"), ("eta-id", "eta")):
        with pytest.raises(DeadLettered, match=re.escape(dead[tag][:40])):
            client_app.AsyncResult(task_id).get(timeout=10)
    assert redis_client.zcard(WAITING.waiting) == 0
    wait_for(lambda: redis_client.zcard(WAITING.unacked) == 0, 10, "the last ack")


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_batch_key_made_by_hand_holds_no_task(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis, pool: str) -> None:
    """A ``sits`` header with a batch key on a task that is no batch task gathered them
    at the pick: the worker ran the first and held the others for ever (on solo it
    also stopped consuming). A key naming another task is dropped at the put."""
    from sits_queue.options import batch_key, from_header

    # (the class's limits, as the message carries them: the key must name them to stand)
    soft, hard = client_app.sits.time_limits("medium")
    key = batch_key("w.add", from_header(client_app.sits, {"sla_class": "medium"}),
                    [hard, soft])
    own = {"sla_class": "medium", "batch": key, "batch_max": 4}
    other = {"sla_class": "medium", "batch": "t.other|m|high", "batch_max": 4}
    sent = [client_app.send_task("w.add", (n, n), headers={"sits": own}) for n in range(4)]
    sent.append(client_app.send_task("w.add", (9, 9), headers={"sits": other}))
    metas = [json.loads(v) for v in redis_client.hvals(WAITING.meta)]
    assert sorted(m.get("b") or "" for m in metas) == ["", *[key] * 4]
    spawn(pool=pool, concurrency=1)
    assert [r.get(timeout=30) for r in sent] == [0, 2, 4, 6, 18]
    assert client_app.tasks["w.add"].delay(1, 2).get(timeout=30) == 3
    wait_for(lambda: redis_client.zcard(WAITING.unacked) == 0, 10, "the last ack")


@pytest.mark.parametrize("name", ["", "a{b}"])
def test_a_queue_name_the_broker_refuses_does_not_stop_the_worker(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis, name: str) -> None:
    worker = spawn()
    # When a client asks the worker to consume from a queue it cannot have
    (reply,) = client_app.control.add_consumer(name, reply=True, timeout=5)
    # Then the reply says why, and the worker serves on (the declare raised in its event
    # loop after an "ok" reply, which stopped it)
    assert "error" in reply[worker.hostname]
    assert client_app.tasks["w.add"].delay(1, 2).get(timeout=30) == 3
    assert worker.alive()


def test_beat_runs_the_rescoring_pass(spawn: Spawn, redis_client: redis.Redis) -> None:
    spawn(rescore_interval_s="1", trigger_check_interval_s="1")
    spawn("beat", rescore_interval_s="1", trigger_check_interval_s="1")
    wait_for(lambda: redis_client.exists(stats_key()) == 1, 60, "a rescoring pass")
    snapshot = json.loads(redis_client.get(stats_key()))
    assert set(snapshot["classes"]) == {"high", "medium", "low"}


def celery_cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery", "-A", APP_MODULE, *args],
                          env={**os.environ, **worker_env(redis_url)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=90)


def test_celery_inspect_ping(spawn: Spawn, redis_url: str) -> None:
    worker = spawn()
    out = celery_cli(redis_url, "inspect", "ping", "--timeout=5")
    assert out.returncode == 0, out.stderr
    assert "pong" in out.stdout and worker.hostname in out.stdout


def test_celery_purge(client_app: Celery, redis_client: redis.Redis, redis_url: str) -> None:
    for i in range(5):
        client_app.tasks["w.add"].delay(i, i)
    out = celery_cli(redis_url, "purge", "-f")
    assert out.returncode == 0, out.stderr
    assert "5 messages" in out.stdout
    assert redis_client.zcard(WAITING.waiting) == 0


def test_a_worker_for_its_own_queues_still_serves_the_control_queue(
        redis_url: str, client_app: Celery, redis_client: redis.Redis, tmp_path: Any) -> None:
    r = redis_client
    worker = start_worker(APP_MODULE, worker_env(redis_url), tmp_path, concurrency=1,
                          queues="custom", cwd=ROOT)
    try:
        wait_ready(client_app, [worker])
        queues = client_app.control.inspect(destination=[worker.hostname],
                                            timeout=5).active_queues()
        names = {q["name"] for q in (queues or {}).get(worker.hostname, [])}
        # -Q custom, and the beat's maintenance queue (else rescoring would pile up),
        # besides its own direct queue (pre-warms); not the default queue
        assert {"custom", "sits.control"} <= names and "celery" not in names
        control = QueueKeys.for_queue("sits.control")
        client_app.tasks["sits.rescore"].apply_async()
        wait_for(lambda: r.zcard(control.waiting) == r.zcard(control.unacked) == 0, 30,
                 "the worker to run the rescoring pass")
    finally:
        worker.stop(timeout_s=10)


def test_a_worker_consumes_the_default_queue_its_app_names(
        tmp_path: Path, redis_url: str, client_app: Celery, redis_client: redis.Redis) -> None:
    """(a fixed task_queues setting kept "celery": an app's own default queue got its
    tasks and no worker consumed it, silently)"""
    from tests.integration.own_default_queue_app import QUEUE

    proc = start_worker("tests.integration.own_default_queue_app", worker_env(redis_url),
                        tmp_path, concurrency=1, cwd=ROOT)
    try:
        wait_ready(client_app, [proc])
        # (sent as a producer of that app sends it: to its default queue)
        assert client_app.tasks["w.add"].apply_async((2, 3), queue=QUEUE).get(timeout=30) == 5
        # and the control queue still, whatever the app's default
        queues = {q["name"] for q in client_app.control.inspect(
            [proc.hostname], timeout=5).active_queues()[proc.hostname]}
        assert {QUEUE, "sits.control"} <= queues and "celery" not in queues
    finally:
        proc.stop()


@pytest.mark.parametrize(("queues", "said"), [
    ("jobs{1}", "queue name 'jobs{1}' must not contain braces"),
    # a byte that is no UTF-8 (the shell's $'bad\xff'; it ended in a traceback)
    ("ok,bad\udcff", "queue name 'bad\\udcff' is not UTF-8 text"),
])
def test_a_worker_told_to_consume_a_queue_no_sits_queue_can_be_says_so_in_one_line(
        tmp_path: Path, redis_url: str, queues: str, said: str) -> None:
    """(its consumer stopped on an "Unrecoverable error" traceback)"""
    log = refusal(start_worker(APP_MODULE, worker_env(redis_url), tmp_path, concurrency=1,
                               queues=queues, cwd=ROOT), "the queue")
    assert f"Error: {said}" in log and ": rename it" in log, log[-2000:]


def test_purging_a_queue_no_sits_queue_can_be_says_so_in_one_line(redis_url: str) -> None:
    """(``celery purge -Q 'b{r}'`` printed a full traceback ending in InvalidQueueName)"""
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP_MODULE, "purge", "-f", "-Q", "b{r}"],
        env={**os.environ, **worker_env(redis_url)}, cwd=ROOT, capture_output=True,
        text=True, timeout=120, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out, out
    assert "queue name 'b{r}' must not contain braces: no SITS queue has it" in out, out
    assert "No messages purged from 1 queue" in out, out


def test_a_soft_limit_overdue_after_its_task_ended_leaves_the_idle_child_alone(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(a parent whose loop was blocked past a task's soft limit, a Redis outage, fired
    the timer once it went on: the signal reached the child after its task had ended,
    and the idle child died of the SoftTimeLimitExceeded raised in the pool's loop)"""
    worker = spawn(concurrency=1)
    parent = psutil.Process(worker.pid)
    (child,) = parent.children()
    result = client_app.tasks["w.slow"].apply_async(("quick", 0.5), soft_time_limit=2,
                                                    time_limit=30)
    wait_for(lambda: redis_client.llen("test:started") == 1, 30, "the task to start")
    # Given the parent stopped while its child ends the task and stores the result...
    parent.suspend()
    try:
        assert result.get(timeout=30) == "quick"
        time.sleep(2.5)  # ...past the soft limit, whose timer is the parent's
    finally:
        parent.resume()
    # When the parent goes on (the overdue timer fires), the same child serves on
    assert client_app.tasks["w.add"].delay(2, 3).get(timeout=30) == 5
    assert child.is_running() and parent.children() == [child]
    assert "SoftTimeLimitExceeded" not in worker.log(), worker.log()[-3000:]


def test_a_message_whose_wake_up_was_taken_and_lost_is_still_served(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(a worker picks only from the queues whose marker is set, broker/transport.py; a
    marker taken by a wait whose worker then died announces nothing, so every queue is
    still picked once a second)"""
    spawn(concurrency=1)
    # Given the worker's one slot busy, and a message whose marker is gone meanwhile, as
    # when a worker that took its wake-up died before its pick
    busy = client_app.tasks["w.slow"].apply_async(("busy", 1.5))
    wait_for(lambda: redis_client.get("test:started:busy") is not None, 30,
             "the slow task to start")
    waiting = client_app.tasks["w.add"].apply_async((2, 3))
    redis_client.delete(WAITING.marker)
    # Then once the slot is free, the worker still finds it
    assert busy.get(timeout=30) == "busy"
    assert waiting.get(timeout=30) == 5
