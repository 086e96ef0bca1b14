"""A Redis restart mid-run (with persistence on) loses no task and kills no worker."""

from __future__ import annotations

import time
from pathlib import Path

import redis

from sits_queue.app import make_app
from sits_queue.config import SitsConfig
from sits_queue.embedded import EmbeddedRedis
from sits_queue.procs import start_worker, wait_ready
from tests.integration.conftest import APP_MODULE, ROOT, worker_env
from tests.integration.worker_app import register


def test_restart_mid_run_loses_nothing(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendonly=True)
    url = server.start()
    port = server.port
    client = redis.Redis.from_url(url)
    client.config_set("appendfsync", "always")  # the test must not depend on fsync timing
    app = make_app(SitsConfig(redis_url=url, visibility_timeout_s=5), main="restart")
    tasks = register(app)
    worker = start_worker(APP_MODULE, worker_env(url, visibility_timeout_s="5"),
                          tmp_path / "logs", concurrency=2, cwd=ROOT)
    try:
        wait_ready(app, [worker])
        n = 60
        marks = tmp_path / "marks"
        marks.mkdir()
        for i in range(n):
            tasks["mark"].delay(f"t{i}", 0.1, str(marks))
        deadline = time.monotonic() + 30
        while len(list(marks.iterdir())) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        # When Redis goes away mid-run and comes back on the same port with its AOF
        server.stop()
        time.sleep(1.0)  # the outage: the worker sees connection errors meanwhile
        server = EmbeddedRedis(tmp_path / "redis", port=port, appendonly=True)
        server.start()
        # Then every task still completes (at least once) and the worker lives on
        deadline = time.monotonic() + 120
        while len(list(marks.iterdir())) < n and time.monotonic() < deadline:
            assert worker.alive(), worker.log()[-3000:]
            time.sleep(0.2)
        assert {p.name for p in marks.iterdir()} == {f"t{i}" for i in range(n)}
        assert worker.alive()
    finally:
        worker.stop()
        app.close()
        server.stop()
