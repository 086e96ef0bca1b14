"""The held messages' heartbeat thread (``broker/heartbeat.py``) when its beat fails."""

from __future__ import annotations

import logging
import threading

import pytest
import redis

from sits_queue.broker.heartbeat import RETRY_S, Heartbeat
from tests.waiting import wait_for


def test_a_failing_beat_is_retried_at_its_retry_pace_and_said_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """(the warning named the beat period, 20 s at the default timeout, where the
    retries come every second)"""
    caplog.set_level(logging.INFO, logger="sits_queue.broker.heartbeat")
    calls: list[float] = []
    recovered = threading.Event()

    def beat(client: redis.Redis) -> None:
        calls.append(1)
        if len(calls) < 3:
            raise redis.ConnectionError("Redis away")
        recovered.set()

    period = RETRY_S * 1.5  # (a beat period longer than the retries' pace)
    heart = Heartbeat(lambda: beat, {"host": "127.0.0.1", "port": 1}, period_s=period,
                      name="test-heartbeat")
    heart.start()
    try:
        wait_for(recovered.is_set, 10, "the beat to work again")
    finally:
        heart.stop()
    warnings = [r.getMessage() for r in caplog.records if "could not heartbeat" in r.getMessage()]
    assert warnings == [f"could not heartbeat held messages (Redis away); retrying every "
                        f"{RETRY_S:.1f} s"]
    assert "heartbeat of held messages works again" in caplog.text
