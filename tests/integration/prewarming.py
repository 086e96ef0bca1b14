"""What the pre-warm tests share: a worker of the inference test app whose planner runs
on a short interval, and a confident forecast of a costly model, as a fleet's workers
would have counted it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from sits_queue.priority import forecast as fc
from sits_queue.priority import prewarm
from sits_queue.procs import CeleryProcess
from sits_queue.workers import advertise
from tests.integration.inference_app import build_models, client_app, serving, write_config

#: The planning interval of these tests, s (the tests call the planner themselves).
INTERVAL_S = 2.0


@contextmanager
def prewarm_worker(tmp: Path, redis_url: str, concurrency: int, name: str
                   ) -> Iterator[tuple[Celery, CeleryProcess]]:
    """A submitting app and a ready worker of ``concurrency`` children, both planning
    every :data:`INTERVAL_S`."""
    models = build_models(tmp / "models")
    config_path = write_config(tmp / "sits.toml")
    env = {"SITS_PREWARM_INTERVAL_S": str(INTERVAL_S)}
    app = client_app(redis_url, config_path, f"{name}-client")
    app.sits = replace(app.sits, prewarm_interval_s=INTERVAL_S)
    try:
        with serving(redis_url, config_path, models, tmp, app, env, concurrency=concurrency,
                     name=name) as worker:
            yield app, worker
    finally:
        app.close()


def worker_fixture(name: str, concurrency: int) -> Any:
    """A module's ``setup`` fixture: :func:`prewarm_worker` for the module, on its emptied
    Redis (the integration conftest's ``r``)."""
    @pytest.fixture(scope="module")
    def setup(tmp_path_factory: pytest.TempPathFactory, redis_url: str, r: redis.Redis
              ) -> Iterator[tuple[Celery, CeleryProcess]]:
        with prewarm_worker(tmp_path_factory.mktemp(name), redis_url, concurrency,
                            name) as served:
            yield served

    return setup


def confident(app: Celery, r: redis.Redis, hostname: str, model: str) -> None:
    """A forecast of ``model`` right for a day (steady ~90 tasks an interval), and the
    worker ``hostname`` having counted its cold starts at 2 s and its tasks at 60 ms."""
    config = app.sits
    f = fc.Forecaster()
    start = (prewarm.bucket_of(config, time.time()) - 300) * INTERVAL_S
    for k in range(299):
        f = fc.update(f, start + k * INTERVAL_S, 90.0 + (k % 3))
    r.hset(prewarm.state_key(config), model, json.dumps(fc.to_json(f)))
    r.hset(prewarm.state_key(config), "__bucket__",
           json.dumps([prewarm.bucket_of(config, time.time()) - 1, INTERVAL_S]))
    r.hset(advertise.counters_key("", hostname),
           mapping={f"model_cold_ms:{model}": 2000.0, f"model_cold:{model}": 1,
                    f"model_run_ms:{model}": 60.0, f"model_runs:{model}": 1})
