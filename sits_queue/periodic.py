"""A call repeated from a daemon thread until stopped: the worker's own housekeeping
(the advertisement, the runtime profile) must keep its pace while a ``--pool=solo``
task holds the consumer's event loop, which Celery's timer runs on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Periodic:
    """``every(stopping)`` every ``period_s`` from a daemon thread named ``name``, from
    :meth:`start` until :meth:`stop`; an exception is logged with ``failed`` and the next
    call comes as usual (the thread must outlive anything one call meets)."""

    def __init__(self, name: str, period_s: float,
                 every: Callable[[threading.Event], None], failed: str) -> None:
        self.stopping = threading.Event()
        self._period_s, self._every, self._failed = period_s, every, failed
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Periodic:
        self._thread.start()
        return self

    def stop(self, wait_s: float) -> None:
        """Stop, and wait up to ``wait_s`` for a call in flight (one after the stop would
        undo what the caller does next)."""
        self.stopping.set()
        self._thread.join(wait_s)

    def _run(self) -> None:
        while not self.stopping.wait(self._period_s):
            try:
                self._every(self.stopping)
            except Exception:
                logger.exception(self._failed)
