"""Task events flushed on a timer of the event loop: one flush per while, not per turn."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from sits_queue.workers import eventflush
from sits_queue.workers.eventflush import EVENTS_FLUSH_S, LOST_AFTER_S, CoalescedEvents


class Hub:
    """The kombu hub's part the mixin uses: its loop thread and its timer."""

    def __init__(self) -> None:
        self._loop_thread = threading.get_ident()
        self.timers: list[tuple[float, Any]] = []
        self.soon: list[Any] = []

    def call_later(self, delay: float, callback: Any) -> None:
        self.timers.append((delay, callback))

    def fire(self) -> None:
        timers, self.timers = self.timers, []
        for _, callback in timers:
            callback()


class Celerys:
    """Stand-in for Celery's consumer: what the mixin calls on it."""

    def __init__(self) -> None:
        self.flushed = 0
        self.stopped = self.shut = False
        self.fail_flush: Exception | None = None

    def on_send_event_buffered(self) -> None:  # Celery's: flush at the next loop turn
        hub = self.hub  # type: ignore[attr-defined]
        if hub:
            hub.soon.append(self._flush_events)

    def _flush_events(self) -> None:
        if self.fail_flush is not None:
            raise self.fail_flush
        self.flushed += 1

    def stop(self) -> None:
        self.stopped = True

    def shutdown(self) -> None:
        self.shut = True


class Consumer(CoalescedEvents, Celerys):
    def __init__(self, hub: Hub | None) -> None:
        super().__init__()
        self.hub = hub


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(eventflush.time, "monotonic", lambda: now[0])
    return now


def test_the_events_of_a_while_are_flushed_once_after_it(clock: list[float]) -> None:
    hub = Hub()
    consumer = Consumer(hub)
    for _ in range(5):  # a task's received, started, succeeded, and the next's
        consumer.on_send_event_buffered()
        clock[0] += 0.01
    assert [delay for delay, _ in hub.timers] == [EVENTS_FLUSH_S]
    assert consumer.flushed == 0 and hub.soon == []
    hub.fire()
    assert consumer.flushed == 1
    consumer.on_send_event_buffered()  # the next while has a flush of its own
    assert len(hub.timers) == 1


def test_a_flush_whose_timer_was_lost_is_scheduled_again(clock: list[float]) -> None:
    """(a reconnect cancels the timers set while the loop started: events were held until
    Celery's buffer limit)"""
    hub = Hub()
    consumer = Consumer(hub)
    consumer.on_send_event_buffered()
    hub.timers.clear()  # lost
    clock[0] += EVENTS_FLUSH_S + LOST_AFTER_S / 2
    consumer.on_send_event_buffered()
    assert hub.timers == []  # not yet taken for lost
    clock[0] += LOST_AFTER_S
    consumer.on_send_event_buffered()
    assert len(hub.timers) == 1
    hub.fire()
    assert consumer.flushed == 1


def test_an_event_from_another_thread_is_flushed_the_celery_way() -> None:
    """(the hub's timer is not thread-safe; Celery's call_soon is)"""
    hub = Hub()
    consumer = Consumer(hub)
    thread = threading.Thread(target=consumer.on_send_event_buffered)
    thread.start()
    thread.join()
    assert hub.timers == [] and len(hub.soon) == 1


def test_without_a_hub_celery_decides() -> None:
    """(a worker without an event loop: Celery publishes each event as it is sent)"""
    consumer = Consumer(None)
    consumer.on_send_event_buffered()
    assert consumer.flushed == 0


@pytest.mark.parametrize("ending", ["stop", "shutdown"])
def test_a_stopping_consumer_publishes_what_it_holds_first(ending: str) -> None:
    hub = Hub()
    consumer = Consumer(hub)
    consumer.on_send_event_buffered()
    getattr(consumer, ending)()
    assert consumer.flushed == 1
    assert consumer.stopped or consumer.shut
    consumer.on_send_event_buffered()  # a later event schedules a flush of its own
    assert len(hub.timers) == 2


def test_a_flush_that_fails_at_the_stop_is_logged_and_the_stop_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    consumer = Consumer(Hub())
    consumer.fail_flush = ConnectionError("Redis went away")
    with caplog.at_level(logging.WARNING, logger=eventflush.__name__):
        consumer.shutdown()
    assert consumer.shut
    assert "could not publish the task events held" in caplog.text
    assert "Redis went away" in caplog.text
