"""The heartbeat of a channel's held messages, from a daemon thread.

A consumer pushes the deadline of every message it holds (running or reserved) each
third of the visibility timeout; a message whose deadline is older than the timeout is
restored by any consumer's sweep and runs again elsewhere. Beating from the worker's
event loop was not enough: with ``--pool=solo`` the task runs *in* the loop (and in a
plain kombu consumer, between ``drain_events`` calls, nothing turns the loop), so a
task longer than the timeout lost its message to another worker and ran twice. A
thread beats whatever the loop is doing; it needs the GIL for a moment per beat.

The thread has a Redis connection pool of its own: it never waits for a connection
of the channel's pool, and a pool child forked from the worker never inherits that
pool's lock held by this thread (redis-py's after-fork check would wait for it).
Its sockets time out, so a silent Redis holds a beat (and the QoS lock it takes, see
``qos.py``) for a bounded time only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

logger = logging.getLogger(__name__)

#: Socket timeout of the thread's connections when the channel sets none, s: a beat
#: that waits longer than this on Redis is given up and retried next period.
SOCKET_TIMEOUT_S = 5.0
#: After a failed beat, the next is tried this soon (at most a period): a Redis back from
#: an outage hears from the holder soon; the sweeps hold off for two periods after such a
#: gap meanwhile (``restore.lua``).
RETRY_S = 1.0
#: How long closing the channel waits for a beat in flight, s (one pipeline; or, past
#: it, a look for dead holders, which a close that waits no longer leaves to finish).
STOP_WAIT_S = SOCKET_TIMEOUT_S + 1.0

#: Pushes the deadlines of what its channel holds, on the client given; returns nothing.
Beat = Callable[[redis.Redis], None]


class Heartbeat:
    """Calls a beat every ``period_s`` from a daemon thread, until :meth:`stop`.

    ``beat`` returns the beat to run, or None once its channel is gone (a weak
    reference: the thread must not keep a forgotten channel, and its messages, alive).
    """

    def __init__(self, beat: Callable[[], Beat | None], connparams: dict[str, Any],
                 period_s: float, name: str) -> None:
        self._beat = beat
        self._connparams = dict(connparams)
        for timeout in ("socket_timeout", "socket_connect_timeout"):
            if self._connparams.get(timeout) is None:
                self._connparams[timeout] = SOCKET_TIMEOUT_S
        self.period_s = period_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """No beat starts after this returns; one in flight is waited for (bounded)."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        pool = redis.ConnectionPool(**self._connparams)
        client = redis.Redis(connection_pool=pool)
        failing = False
        try:
            while not self._stopping.wait(min(RETRY_S, self.period_s) if failing
                                          else self.period_s):
                beat = self._beat()
                if beat is None:
                    return
                try:
                    beat(client)
                except Exception as exc:  # Redis away, or a bug: the next period retries
                    if not failing:  # (the retries' pace, not the beats')
                        logger.warning("could not heartbeat held messages (%s); retrying "
                                       "every %.1f s", exc, min(RETRY_S, self.period_s))
                    failing = True
                else:
                    if failing:
                        logger.info("heartbeat of held messages works again")
                    failing = False
                del beat  # between beats the thread holds no strong reference to its QoS
        finally:
            pool.disconnect()
