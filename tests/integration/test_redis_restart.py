"""A Redis restart mid-run (with persistence on) loses no task and kills no worker."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from sits_queue.app import make_app
from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from sits_queue.embedded import EmbeddedRedis
from sits_queue.procs import CeleryProcess, start_worker, wait_ready
from tests.integration.conftest import APP_MODULE, ROOT, worker_env
from tests.integration.worker_app import register
from tests.waiting import wait_for


def start_server(tmp_path: Path, appendonly: bool = True,
                 port: int | None = None) -> EmbeddedRedis:
    """The test's own Redis; with its AOF written at every command (the test must not
    depend on fsync timing)."""
    server = EmbeddedRedis(tmp_path / "redis", port=port, appendonly=appendonly)
    server.start()
    if appendonly:
        redis.Redis.from_url(server.url).config_set("appendfsync", "always")
    return server


def restart(server: EmbeddedRedis, tmp_path: Path) -> EmbeddedRedis:
    """Redis away for a moment, back on the same port with its data (AOF)."""
    port = server.port
    server.stop()
    time.sleep(1.0)  # the outage: the worker sees connection errors meanwhile
    return start_server(tmp_path, port=port)


@contextmanager
def worker_on(url: str, tmp_path: Path, name: str, concurrency: int,
              **settings: int) -> Iterator[tuple[Celery, dict[str, Any], CeleryProcess]]:
    """A client app with the worker tasks, and a ready worker, both with ``settings``."""
    app = make_app(SitsConfig(redis_url=url, **settings), main=name)
    tasks = register(app)
    env = worker_env(url, **{key: str(value) for key, value in settings.items()})
    worker = start_worker(APP_MODULE, env, tmp_path / "logs", concurrency=concurrency,
                          cwd=ROOT)
    try:
        wait_ready(app, [worker])
        yield app, tasks, worker
    finally:
        worker.stop()
        app.close()


def test_restart_mid_run_loses_nothing(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        with worker_on(server.url, tmp_path, "restart", 2,
                       visibility_timeout_s=5) as (_, tasks, worker):
            n = 60
            marks = tmp_path / "marks"
            marks.mkdir()
            for i in range(n):
                tasks["mark"].delay(f"t{i}", 0.1, str(marks))
            deadline = time.monotonic() + 30
            while len(list(marks.iterdir())) < 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            # When Redis goes away mid-run and comes back on the same port with its AOF
            server = restart(server, tmp_path)
            # Then every task still completes (at least once) and the worker lives on
            deadline = time.monotonic() + 120
            while len(list(marks.iterdir())) < n and time.monotonic() < deadline:
                assert worker.alive(), worker.log()[-3000:]
                time.sleep(0.2)
            assert {p.name for p in marks.iterdir()} == {f"t{i}" for i in range(n)}
            assert worker.alive()
    finally:
        server.stop()


def test_restarts_neither_poison_held_tasks_nor_rerun_a_running_one(tmp_path: Path) -> None:
    """A worker holding ETA tasks (never started) and running a long one while Redis
    restarts twice, with its data: the channel closes while Redis is away, so nothing
    can be given back then. The held tasks must not be counted as redelivered (twice,
    over a limit of one, made them poison: dead-lettered unrun) and the running task's
    message must stay its own (unbeaten, the sweep restored it and it ran again beside
    itself)."""
    server = start_server(tmp_path)
    client = redis.Redis.from_url(server.url)
    try:
        with worker_on(server.url, tmp_path, "restart-held", 2, visibility_timeout_s=5,
                       max_redeliveries=1) as (_, tasks, worker):
            long = tasks["slow"].delay("long", 16)
            deadline = time.monotonic() + 30
            while client.get("test:started:long") is None and time.monotonic() < deadline:
                time.sleep(0.05)
            held = [tasks["record"].apply_async((f"eta{i}",), countdown=35)
                    for i in range(2)]
            keys = QueueKeys.for_queue("celery")
            while client.zcard(keys.unacked) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)  # the worker holds all three
            # When Redis restarts twice, further apart than the visibility timeout
            server = restart(server, tmp_path)
            time.sleep(5 + 3)  # a sweep's worth past the timeout, before the second
            server = restart(server, tmp_path)
            client = redis.Redis.from_url(server.url)
            # Then the long task ran once, and each held task runs, once
            assert long.get(timeout=60) == "long"
            assert [r.get(timeout=90) for r in held] == ["eta0", "eta1"]
            assert int(client.get("test:started:long") or 0) == 1
            assert int(client.get("test:runs") or 0) == 2
            assert client.hlen(keys.dead) == 0
            assert worker.alive()
    finally:
        server.stop()


def test_a_redis_stall_past_the_timeout_does_not_rerun_what_the_worker_runs(
        tmp_path: Path) -> None:
    """Redis frozen (SIGSTOP) longer than the visibility timeout while two tasks run: the
    worker's heartbeats are missed meanwhile, and its own first sweep after the stall
    restored (and ran again, beside themselves) the very tasks it was running."""
    server = start_server(tmp_path, appendonly=False)
    client = redis.Redis.from_url(server.url)
    try:
        # a free slot: a restored message would run again at once, beside its original
        with worker_on(server.url, tmp_path, "stall", 3,
                       visibility_timeout_s=5) as (_, tasks, worker):
            running = [tasks["slow"].delay(f"st{i}", 14) for i in range(2)]
            deadline = time.monotonic() + 30
            while (client.get("test:started:st0") is None
                   or client.get("test:started:st1") is None) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            # When Redis stalls for longer than the timeout
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
            time.sleep(7)  # the stall: 5 s visibility timeout + 2
            os.kill(server.pid, signal.SIGCONT)
            # Then each task ran once
            assert [r.get(timeout=60) for r in running] == ["st0", "st1"]
            assert [int(client.get(f"test:started:st{i}") or 0)
                    for i in range(2)] == [1, 1]
            assert "restored" not in worker.log()
            assert worker.alive()
    finally:
        server.stop()


def test_a_lost_connection_does_not_rerun_what_the_worker_runs(tmp_path: Path) -> None:
    """The worker's connections killed while Redis stays up (``CLIENT KILL``: a proxy or
    a server ``timeout`` dropping them, a network blip): Celery reconnects and its running
    task goes on, to ack through the closed channel. The close gave that task's message
    back, counted, and a free slot ran it again beside itself."""
    server = start_server(tmp_path, appendonly=False)
    client = redis.Redis.from_url(server.url)
    try:
        with worker_on(server.url, tmp_path, "killed", 3,
                       visibility_timeout_s=5) as (_, tasks, worker):
            running = tasks["slow"].delay("ck", 8)
            held = tasks["record"].apply_async(("eta",), countdown=6)
            deadline = time.monotonic() + 30
            keys = QueueKeys.for_queue("celery")
            while (client.get("test:started:ck") is None or client.zcard(keys.unacked) < 2) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            # When every connection but ours is killed
            assert client.client_kill_filter(_type="normal", skipme=True) > 0
            # Then the running task ran once, the held one ran, and nothing was counted
            assert running.get(timeout=60) == "ck"
            assert held.get(timeout=60) == "eta"
            assert int(client.get("test:started:ck") or 0) == 1
            assert int(client.get("test:runs") or 0) == 1
            assert client.hlen(keys.dead) == 0
            wait_for(lambda: client.zcard(keys.unacked) == 0, 10, "the acks")
            assert "still running" in worker.log()
            assert worker.alive()
    finally:
        server.stop()


@pytest.mark.parametrize("swept", [True, False], ids=["swept", "before-any-sweep"])
def test_a_redis_stall_past_the_timeout_does_not_rerun_what_another_worker_picked(
        tmp_path: Path, swept: bool) -> None:
    """Two workers draining a burst, Redis frozen longer than the visibility timeout: a
    pick in flight ran once Redis woke, recording the pick time of before the stall, and
    the other worker's first sweep found that message silent past the timeout and ran it
    again (a probe: 2 of 3,000 tasks twice, in 3 runs of 3). Every holder's beats were
    missed alike: the sweeps now hold off after such a gap until the holders beat."""
    from sits_queue.broker.bulk import enqueue_many

    burst = 3000
    server = start_server(tmp_path, appendonly=False)
    client = redis.Redis.from_url(server.url)
    try:
        with worker_on(server.url, tmp_path, "stall-two", 2,
                       visibility_timeout_s=5) as (app, tasks, first):
            env = worker_env(server.url, visibility_timeout_s="5")
            second = start_worker(APP_MODULE, env, tmp_path / "logs", concurrency=2,
                                  cwd=ROOT)
            try:
                wait_ready(app, [second])
                enqueue_many(tasks["record"], [(f"b{i}",) for i in range(burst)])
                wait_for(lambda: int(client.get("test:runs") or 0) >= 200, 60,
                         "the burst to be under way")
                # (the queue's record of being served, or none yet: a stall before the
                # first sweep or beat, as a probe met 2 s into a burst from fresh workers)
                sweep_record = QueueKeys.for_queue("celery").sweep
                if swept:
                    wait_for(lambda: client.exists(sweep_record), 30, "a sweep or a beat")
                else:
                    client.delete(sweep_record)
                # When Redis stalls past the timeout while both pick
                assert server.pid is not None
                os.kill(server.pid, signal.SIGSTOP)
                time.sleep(8)  # the stall: 5 s visibility timeout + 3
                os.kill(server.pid, signal.SIGCONT)
                # Then every task ran, each once, and no sweep restored anything
                wait_for(lambda: client.scard("test:done") == burst, 120,
                         "every task to run", seen=lambda: client.scard("test:done"))
                wait_for(lambda: client.zcard(QueueKeys.for_queue("celery").unacked) == 0,
                         30, "the last acks")
                assert int(client.get("test:runs") or 0) == burst, \
                    [line for w in (first, second) for line in w.log().splitlines()
                     if "restored" in line]
                assert first.alive() and second.alive()
            finally:
                second.stop()
    finally:
        server.stop()
