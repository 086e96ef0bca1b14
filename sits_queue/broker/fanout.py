"""Fanout publishes that do not wait for Redis's reply.

A fanout message (worker events for Flower, ``celery control`` broadcasts) is a Redis
``PUBLISH`` whose reply, the number of subscribers, nobody reads. kombu waits for it
anyway, and in a worker that wait sits on the path of every task: Celery's event loop
flushes the buffered task events *before* its transport tick picks the next message, so
each dispatch paid one extra round trip to Redis (~0.1-0.3 ms on a busy host).

Here the command is written to a connection of its own and the replies are read later,
when they have already arrived (before the next publish) or, past ``MAX_PENDING``
unread, by waiting for the oldest. What was written has reached Redis when ``publish``
returns, as before; a send that fails raises, as before (kombu's retry policy applies);
an error reply, which kombu would have raised, is logged.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import redis

logger = logging.getLogger(__name__)

#: Unread replies allowed before a publish waits for the oldest one.
MAX_PENDING = 256


class DeferredPublisher:
    """PUBLISH on one held connection of a redis-py pool, replies read lazily."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pool: Any = None
        self._pid = 0
        self.pending = 0

    def publish(self, pool: Any, topics: Sequence[str], payload: bytes | str) -> None:
        with self._lock:
            conn = self._connection(pool)
            try:
                self._drain(conn, wait=self.pending >= MAX_PENDING)
                conn.send_packed_command(conn.pack_commands(
                    [("PUBLISH", topic, payload) for topic in topics]))
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                self._drop()
                raise
            self.pending += len(topics)

    def close(self) -> None:
        """Read what is still owed and give the connection back to its pool."""
        with self._lock:
            if self._conn is None:
                return
            try:
                while self.pending:
                    self._drain(self._conn, wait=True)
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                self._drop()
                return
            self._pool.release(self._conn)
            self._conn = self._pool = None

    # -- internals ---------------------------------------------------------------------
    def _connection(self, pool: Any) -> Any:
        if self._conn is not None and self._pid != os.getpid():
            # Forked: the socket is the parent's; leave it alone and start afresh.
            self._conn = self._pool = None
            self.pending = 0
        if self._conn is not None and self._pool is not pool:
            self._drop()  # the channel reconnected with a new pool
        if self._conn is None:
            self._conn = pool.get_connection()
            self._pool, self._pid = pool, os.getpid()
        return self._conn

    def _drain(self, conn: Any, wait: bool) -> None:
        """Read the replies that have arrived; with ``wait``, at least one."""
        while self.pending and (wait or conn.can_read(timeout=0)):
            wait = False
            try:
                conn.read_response()
            except redis.ResponseError as exc:
                logger.warning("Redis refused a fanout publish: %s", exc)
            self.pending -= 1

    def _drop(self) -> None:
        """Forget a connection in an unknown state (unread replies): disconnect it."""
        conn, pool = self._conn, self._pool
        self._conn = self._pool = None
        self.pending = 0
        if conn is not None:
            try:
                conn.disconnect()
            finally:
                pool.release(conn)
