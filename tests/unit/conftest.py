"""Fixtures of the unit tests that run a tiny real model."""

from __future__ import annotations

import atexit
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sits_queue.cache.engines import engine_from_path
from sits_queue.models import tiny
from sits_queue.workers import deferred, signals


@pytest.fixture(autouse=True)
def no_statistics_sent(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Unit tests use no services: the statistics of tasks they run in-process (eager
    calls, ``apply()``) are kept here, not flushed to the app's Redis, which for an app
    built on the defaults is someone's on localhost:6379."""
    written: list[Any] = []
    monkeypatch.setattr(signals, "_write", written.extend)
    monkeypatch.setattr(signals, "_records", [])  # (none of another test's)
    # (and their end is taken on this host's clock: Redis's is read over the same client)
    monkeypatch.setattr(signals, "finished_at", lambda config: time.time())
    return written


@pytest.fixture(autouse=True)
def no_advert_written_after_the_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A child runtime's deferred advert write (``workers/deferred.py``) must not outlive
    its test: once the test's stand-in for Redis is undone it would go to the default
    Redis, localhost:6379, someone's. (Asking for ``monkeypatch`` orders this teardown
    before the stand-in's.)"""
    yield
    deferred.drop_all()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No writer's exit flush after the unit tests: a background thread (a host pool's
    ager) may arm one after its test's teardown dropped it, and at exit, with the test's
    stand-in for Redis gone, ``deferred.flush_all`` sent it to the default Redis,
    localhost:6379, someone's (seen once: a run stopped by ``-x`` left a child's advert
    key there)."""
    atexit.unregister(deferred.flush_all)


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny causal LM (built locally, 256 positions) through the engine loader, one per
    test module (a module that needs another shape defines its own ``lm``)."""
    path = tiny.build_tiny_causal_lm(tmp_path_factory.mktemp("lm") / "lm", seed=2,
                                     n_positions=256)
    engine = engine_from_path("lm", path, "cpu")
    engine.to_device("cpu")
    return engine
