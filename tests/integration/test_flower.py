"""Flower, the monitoring UI users expect, against a worker on the sorted-set transport."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery

from sits_queue.procs import CeleryProcess
from tests.integration.conftest import APP_MODULE, ROOT, worker_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def test_flower_sees_the_worker_and_the_task_events(
        spawn: Callable[..., CeleryProcess], client_app: Celery, redis_url: str,
        tmp_path: Path) -> None:
    worker = spawn()
    port = _free_port()
    env = {**os.environ, **worker_env(redis_url), "FLOWER_UNAUTHENTICATED_API": "true"}
    with open(tmp_path / "flower.log", "wb") as log:
        flower = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", APP_MODULE, "flower", f"--port={port}",
             "--address=127.0.0.1"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
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
        seen: dict[str, Any] = {}
        while seen.get("state") != "SUCCESS" and time.monotonic() < deadline:
            try:
                seen = _get(f"{base}/api/task/info/{task_id}")
            except OSError:
                time.sleep(0.3)
        assert seen["state"] == "SUCCESS"
        assert seen["name"] == "w.add"
        # Tasks run in a batch (one pool job) are each a task to Flower: own events
        batch = [client_app.tasks["w.lengths"].delay("x" * n) for n in range(1, 6)]
        assert [b.get(timeout=60)["output"] for b in batch] == [1, 2, 3, 4, 5]
        for b in batch:
            info: dict[str, Any] = {}
            while info.get("state") != "SUCCESS" and time.monotonic() < deadline + 60:
                try:
                    info = _get(f"{base}/api/task/info/{b.id}")
                except OSError:
                    time.sleep(0.3)
            assert info["state"] == "SUCCESS" and info["name"] == "w.lengths"
            assert info["received"] and info["started"] and info["succeeded"]
    finally:
        flower.terminate()
        flower.wait(10)
