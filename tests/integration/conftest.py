"""Helpers to run real worker and beat subprocesses against the session Redis."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from sits_queue.app import make_app
from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from sits_queue.procs import CeleryProcess, start_beat, start_worker, wait_ready
from tests.integration.worker_app import register

ROOT = Path(__file__).resolve().parents[2]
APP_MODULE = "tests.integration.worker_app"
#: How much of the end of each process log a failed test's report shows.
LOG_TAIL_CHARS = 6000


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    """A failed test's report ends with the logs of the workers and beats it started
    (every ``*.log`` under its ``tmp_path``): a race that only CI's load loses is then
    read from the one run that lost it."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when != "call" or not report.failed or tmp_path is None:
        return
    for log in sorted(Path(tmp_path).rglob("*.log")):
        text = log.read_text(errors="replace")
        report.sections.append((f"end of {log.relative_to(tmp_path)}",
                                text[-LOG_TAIL_CHARS:]))


def refusal(proc: CeleryProcess, what: str) -> str:
    """The log of a worker that refused ``what`` at start: it exited non-zero, saying why
    in one line, no traceback. The worker is stopped whatever happens."""
    from tests.waiting import wait_for

    try:
        wait_for(lambda: not proc.alive(), 60, f"the worker to refuse {what} and exit")
        assert proc.popen.returncode != 0
        log = proc.log()
        assert "Traceback" not in log, log[-2000:]
        return log
    finally:
        proc.stop(timeout_s=10)


def served(client: redis.Redis, queue: str = "celery", period_s: float = 1.0) -> None:
    """Record ``queue`` as served until now, by Redis's clock, as its live workers' sweeps
    and beats do (``sweeps.lua``): a test's own first sweep of a queue that holds messages
    and has no such record holds off, as after a Redis stall."""
    seconds, micros = client.time()
    client.hset(QueueKeys.for_queue(queue).sweep,
                mapping={"at": int(seconds) + int(micros) / 1e6, "every": period_s})


def worker_env(redis_url: str, **settings: str) -> dict[str, str]:
    # (SITS_PREIMPORT off unless a test says: these workers run plain tasks, and a
    # parent importing torch and transformers cost each start seconds; the inference
    # app's workers, inference_app.spawn_worker, keep the default)
    env = {"SITS_REDIS_URL": redis_url, "SITS_PREIMPORT": "0",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update({f"SITS_{k.upper()}": v for k, v in settings.items()})
    return env


@pytest.fixture(scope="module")
def r(redis_url: str) -> Iterator[redis.Redis]:
    """A client on the session server, emptied once per module: earlier modules leave
    messages and workers' records behind."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny models of ``inference_app``, built for the module's inference workers."""
    from tests.integration.inference_app import build_models

    return build_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``inference_app``'s class table, as the module's workers and clients read it."""
    from tests.integration.inference_app import write_config

    return write_config(tmp_path_factory.mktemp("config") / "sits.toml")


@pytest.fixture(scope="module")
def app(request: pytest.FixtureRequest, redis_url: str, config_path: Path,
        r: redis.Redis) -> Iterator[Celery]:
    """The submitting side of a module's ``inference_app`` workers: the same class table
    and tasks, no models (a module with other needs defines its own ``app``)."""
    from tests.integration.inference_app import client_app as inference_client

    client = inference_client(redis_url, config_path,
                              f"{request.module.__name__.rsplit('.', 1)[-1]}-client")
    yield client
    client.close()


@pytest.fixture
def client_app(redis_url: str) -> Iterator[Celery]:
    """The submitting side: the same app module the workers run, configured alike."""
    app = make_app(SitsConfig(redis_url=redis_url), main="client")
    register(app)
    yield app
    app.close()


@pytest.fixture
def spawn(tmp_path: Path, redis_url: str, client_app: Celery
          ) -> Iterator[Callable[..., CeleryProcess]]:
    """spawn("worker"|"beat", **settings) starts a process (a worker of ``pool``, prefork
    unless told); all are stopped at teardown."""
    started: list[CeleryProcess] = []

    def _spawn(kind: str = "worker", wait: bool = True, concurrency: int = 2,
               pool: str = "prefork", extra_args: tuple[str, ...] = (),
               **settings: str) -> CeleryProcess:
        env = worker_env(redis_url, **settings)
        if kind == "beat":
            proc = start_beat(APP_MODULE, env, tmp_path, cwd=ROOT)
        else:
            proc = start_worker(APP_MODULE, env, tmp_path, concurrency=concurrency, pool=pool,
                                cwd=ROOT, extra_args=extra_args)
        started.append(proc)
        if kind == "worker" and wait:
            wait_ready(client_app, [proc])
        return proc

    yield _spawn
    for proc in started:
        proc.stop(timeout_s=10)
