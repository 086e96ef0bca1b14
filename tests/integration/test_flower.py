"""Flower, the monitoring UI users expect, against a worker on the sorted-set transport."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from sits_queue.broker.keys import QueueKeys, queues_registry
from sits_queue.procs import CeleryProcess
from tests.integration.conftest import APP_MODULE, ROOT, worker_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _task_info(base: str, task_id: str, state: str, deadline: float) -> dict[str, Any]:
    """Flower's view of ``task_id`` once it shows ``state`` (or the last seen by
    ``deadline``, a ``time.monotonic()``)."""
    info: dict[str, Any] = {}
    while info.get("state") != state and time.monotonic() < deadline:
        try:
            info = _get(f"{base}/api/task/info/{task_id}")
        except OSError:
            time.sleep(0.3)
    return info


def _start_flower(redis_url: str, tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {**os.environ, **worker_env(redis_url), "FLOWER_UNAUTHENTICATED_API": "true"}
    with open(tmp_path / "flower.log", "wb") as log:
        flower = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", APP_MODULE, "flower", f"--port={port}",
             "--address=127.0.0.1"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    return flower, f"http://127.0.0.1:{port}"


def test_flower_sees_the_worker_and_the_task_events(
        spawn: Callable[..., CeleryProcess], client_app: Celery, redis_url: str,
        tmp_path: Path) -> None:
    worker = spawn()
    flower, base = _start_flower(redis_url, tmp_path)
    try:
        deadline = time.monotonic() + 60
        workers: dict[str, Any] = {}
        while worker.hostname not in workers and time.monotonic() < deadline:
            assert flower.poll() is None, (tmp_path / "flower.log").read_text()[-3000:]
            try:
                workers = _get(f"{base}/api/workers?refresh=1")
            except OSError:
                time.sleep(0.5)
        assert worker.hostname in workers
        task_id = client_app.tasks["w.add"].apply_async((20, 22), sla_class="high").id
        assert client_app.AsyncResult(task_id).get(timeout=30) == 42
        seen = _task_info(base, task_id, "SUCCESS", deadline)
        assert seen["state"] == "SUCCESS"
        assert seen["name"] == "w.add"
        # Tasks run in a batch (one pool job) are each a task to Flower: own events
        batch = [client_app.tasks["w.lengths"].delay("x" * n) for n in range(1, 6)]
        assert [b.get(timeout=60)["output"] for b in batch] == [1, 2, 3, 4, 5]
        for b in batch:
            info = _task_info(base, b.id, "SUCCESS", deadline + 60)
            assert info["state"] == "SUCCESS" and info["name"] == "w.lengths"
            assert info["received"] and info["started"] and info["succeeded"]
        # A dead-lettered task (a poison message: every run killed with its pool child)
        # fails to Flower too (it follows events: it showed such a task STARTED for ever)
        from sits_queue.broker import deadletters

        r = redis.Redis.from_url(redis_url)
        dead = QueueKeys.for_queue("celery").dead
        r.hset(dead, "m-dead", json.dumps({
            "reason": "redelivered 6 times (poison message)", "at": time.time(), "meta": None,
            "payload": json.dumps({"headers": {"id": "poison-1", "task": "w.add"},
                                   "body": ""})}))
        assert deadletters.fail_tasks(r, dead, ["m-dead"], client_app.backend) == 1
        poison = _task_info(base, "poison-1", "FAILURE", deadline + 90)
        assert poison["state"] == "FAILURE" and "dead-lettered" in poison["exception"]
    finally:
        flower.terminate()
        flower.wait(10)


def test_one_queue_key_of_another_type_leaves_the_other_queues_on_the_page(
        client_app: Celery, r: redis.Redis) -> None:
    """(one foreign key failed the whole read: the Broker page and /api/queues/length
    showed no queue at all)"""
    import asyncio

    from sits_queue.flower import SitsQueues

    client_app.tasks["w.add"].apply_async((1, 1), sla_class="low")
    other = QueueKeys.for_queue("other", client_app.sits.global_keyprefix)
    r.set(other.unacked, "another program's")
    rows = asyncio.run(SitsQueues(client_app.sits).queues(["celery", "other"]))
    by_name = {row["name"]: row for row in rows}
    assert by_name["other"] == {"name": "other", "messages": None}  # shown as missing
    assert by_name["celery"] == {"name": "celery", "messages": 1, "messages_ready": 1,
                                 "messages_unacknowledged": 0}
    assert by_name["sits.control"]["messages"] == 0


def test_flower_broker_api_counts_the_sorted_set_queues(
        client_app: Celery, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    """Flower's own Redis reader LLENs lists named like queues and saw every SITS queue
    empty; it now reads the sorted sets: waiting tasks are ready, held ones unacked."""
    client_app.control.purge()
    for n in range(3):
        client_app.tasks["w.add"].apply_async((n, n), sla_class="low")
    # One held as a worker holds it (picked: out of the waiting set, into the unacked one).
    keys = QueueKeys.for_queue("celery", client_app.sits.global_keyprefix)
    head, _ = r.zpopmin(keys.waiting)[0]
    r.zadd(keys.unacked, {head: time.time()})
    # and a queue no worker consumes nor the app declares (a backlog Flower did not show)
    idle = QueueKeys.for_queue("idle", client_app.sits.global_keyprefix)
    client_app.tasks["w.add"].apply_async((9, 9), queue="idle")
    flower, base = _start_flower(redis_url, tmp_path)
    try:
        deadline = time.monotonic() + 60
        rows: dict[str, Any] | None = None
        while rows is None and time.monotonic() < deadline:
            assert flower.poll() is None, (tmp_path / "flower.log").read_text()[-3000:]
            try:
                rows = {q["name"]: q for q in
                        _get(f"{base}/api/queues/length")["active_queues"]}
            except urllib.error.HTTPError:
                raise  # Flower is up and answered: no retrying an error
            except OSError:
                time.sleep(0.5)
        assert rows is not None, (tmp_path / "flower.log").read_text()[-3000:]
        # No worker is up: Flower lists the app's declared queues.
        assert rows["celery"] == {"name": "celery", "messages": 3, "messages_ready": 2,
                                  "messages_unacknowledged": 1}
        assert rows["sits.control"]["messages"] == 0
        assert rows["idle"]["messages"] == rows["idle"]["messages_ready"] == 1
        with urllib.request.urlopen(f"{base}/broker", timeout=5) as resp:
            page = resp.read().decode()
        row = page.split('<tr id="celery">', 1)[1].split("</tr>", 1)[0]
        cells = re.findall(r"<td[^>]*>\s*([^<]*?)\s*</td>", row)
        assert cells[:4] == ["celery", "3", "1", "2"]  # name, messages, unacked, ready
    finally:
        flower.terminate()
        flower.wait(10)
        r.zrem(keys.unacked, head)
        r.delete(*idle.all())
        r.srem(queues_registry(client_app.sits.global_keyprefix), "idle")
        client_app.control.purge()
