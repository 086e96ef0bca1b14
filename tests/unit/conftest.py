"""Fixtures of the unit tests that run a tiny real model."""

from __future__ import annotations

import time
from typing import Any

import pytest

from sits_queue.cache.engines import engine_from_path
from sits_queue.models import tiny
from sits_queue.workers import signals


@pytest.fixture(autouse=True)
def no_statistics_sent(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Unit tests use no services: the statistics of tasks they run in-process (eager
    calls, ``apply()``) are kept here, not flushed to the app's Redis, which for an app
    built on the defaults is someone's on localhost:6379."""
    written: list[Any] = []
    monkeypatch.setattr(signals, "_write", written.extend)
    # (and their end is taken on this host's clock: Redis's is read over the same client)
    monkeypatch.setattr(signals, "finished_at", lambda config: time.time())
    return written


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny causal LM (built locally, 256 positions) through the engine loader, one per
    test module (a module that needs another shape defines its own ``lm``)."""
    path = tiny.build_tiny_causal_lm(tmp_path_factory.mktemp("lm") / "lm", seed=2,
                                     n_positions=256)
    engine = engine_from_path("lm", path, "cpu")
    engine.to_device("cpu")
    return engine
