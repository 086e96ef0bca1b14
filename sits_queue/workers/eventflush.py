"""Task events published together every :data:`EVENTS_FLUSH_S`, not once per loop turn.

Celery's worker buffers its task events (``task-received``, ``-started``,
``-succeeded``...) and has its event loop publish the buffer at the next turn, as one
``task.multi`` message. A task of a few milliseconds takes three turns (received,
started, done), so each paid three publishes in the worker's main process: a profile of
a one-at-a-time embedding burst (``bench coalesce``, py-spy, 2026-12-06) put 31% of the
main process's samples there, ~0.9 ms a task, most of it the socket write, on a host
whose two cores the model's threads share; with task events off that burst ran 12%
faster. Here the buffer goes :data:`EVENTS_FLUSH_S` after the first event put in it:
one message for what that while sent. Flower and ``celery events`` keep each event's
own timestamp; only its arrival is later, by that much at most. Celery's own bound (a
buffer of ``buffer_limit`` events is published at once) still holds, and a stopping
consumer publishes what is held first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: Longest a task event waits in the worker for the others of its while, s.
EVENTS_FLUSH_S = 0.1
#: A flush this late past its time was lost (a reconnect cancels the timers set while
#: the loop started): the next event schedules one again.
LOST_AFTER_S = 1.0


class CoalescedEvents:
    """Consumer mixin: Celery's ``on_send_event_buffered`` on a timer of the event loop."""

    hub: Any
    _flush_events: Callable[[], None]  # Celery's: publish the buffer now
    _events_flush_at: float | None = None

    def on_send_event_buffered(self) -> None:
        hub = self.hub
        if hub is None or threading.get_ident() != getattr(hub, "_loop_thread", None):
            # (the hub's timers are its loop thread's: from another thread, Celery's
            # own thread-safe way, at the loop's next turn)
            super().on_send_event_buffered()  # type: ignore[misc]
            return
        now = time.monotonic()
        due = self._events_flush_at
        if due is not None and now < due + LOST_AFTER_S:
            return  # a flush is on its way
        self._events_flush_at = now + EVENTS_FLUSH_S
        hub.call_later(EVENTS_FLUSH_S, self._flush_coalesced)

    def _flush_coalesced(self) -> None:
        self._events_flush_at = None
        self._flush_events()

    def flush_held_events(self) -> None:
        """Publish what the timer holds now (the consumer stops: the timer may not fire)."""
        self._events_flush_at = None
        try:
            self._flush_events()
        except Exception as exc:  # (a lost connection: Celery's close drops them as well)
            logger.warning("could not publish the task events held for the next flush: %s",
                           exc)

    def stop(self) -> None:
        self.flush_held_events()
        super().stop()  # type: ignore[misc]

    def shutdown(self) -> None:
        self.flush_held_events()
        super().shutdown()  # type: ignore[misc]
