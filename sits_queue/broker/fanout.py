"""Redis commands whose replies nobody waits for: fanout publishes and acks.

A fanout message (worker events for Flower, ``celery control`` broadcasts) is a Redis
``PUBLISH`` whose reply, the number of subscribers, nobody reads. kombu waits for it
anyway, and in a worker that wait sits on the path of every task: Celery's event loop
flushes the buffered task events *before* its transport tick picks the next message, so
each dispatch paid one extra round trip to Redis (~0.1-0.3 ms on a busy host). An ack
(``ack.lua``) is the same: with late acks it runs when a task's result comes back from
the pool, and only after it does the worker pick the task for the freed slot, while the
child waits.

Here a command is written to a connection of its own and the replies are read later,
when they have already arrived (before the next command) or, past ``MAX_PENDING``
unread, by waiting for the oldest; the transport also reads them on its periodic sweep.
What was written has reached Redis when :meth:`DeferredCommands.send` returns, as
before; a send that fails raises, as before. An error reply goes to the command's
``on_error``, and so does a connection lost while its reply was owed (it may or may not
have run): an ack is idempotent and runs again (after ``NOSCRIPT`` from a restarted
Redis too); a publish is logged.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import redis

logger = logging.getLogger(__name__)

#: Unread replies allowed before a command waits for the oldest one.
MAX_PENDING = 256

#: Told why a command's reply was not a success: an error reply (``redis.ResponseError``)
#: or its connection lost before the reply came (``redis.ConnectionError``).
OnError = Callable[[redis.RedisError], None]
_Failed = list[tuple[OnError, redis.RedisError]]


def _refused_publish(exc: redis.RedisError) -> None:
    if isinstance(exc, redis.ResponseError):
        logger.warning("Redis refused a fanout publish: %s", exc)
    # lost with its connection: like any publish, delivered at most once


class DeferredCommands:
    """Commands on one held connection of a redis-py pool, replies read lazily."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pool: Any = None
        self._pid = 0
        self._owed: deque[OnError] = deque()

    @property
    def pending(self) -> int:
        """Replies not read yet."""
        return len(self._owed)

    def publish(self, pool: Any, topics: Sequence[str], payload: bytes | str) -> None:
        self.send(pool, [("PUBLISH", topic, payload) for topic in topics], _refused_publish)

    def send(self, pool: Any, commands: Sequence[tuple[Any, ...]], on_error: OnError) -> None:
        """Write ``commands`` in one packet; their replies are read later. Raises what
        the write raises (then nothing of ``commands`` is owed)."""
        self._send(pool, commands, [on_error] * len(commands))

    def _send(self, pool: Any, commands: Sequence[tuple[Any, ...]],
              handlers: Sequence[OnError]) -> None:
        failed: _Failed = []
        try:
            with self._lock:
                conn = self._connection(pool, failed)
                try:
                    self._drain(conn, wait=len(self._owed) >= MAX_PENDING, failed=failed)
                    conn.send_packed_command(conn.pack_commands(commands))
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    self._drop(failed)
                    raise
                self._owed.extend(handlers)
        finally:
            self._report(failed)

    def send_or_run(self, pool: Any, command: tuple[Any, ...], run: Callable[[], object],
                    on_error: OnError | None = None) -> None:
        """``command`` sent as :meth:`send` sends it; ``run``, the same command awaited on
        a pooled connection, instead when it cannot be sent, and later when its reply is
        an error or lost (``on_error`` then, when given). Idempotent commands only: one
        lost with its connection may have run."""
        def again(_exc: redis.RedisError) -> None:
            run()

        try:
            self.send(pool, [command], on_error or again)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            run()

    def send_each_or_run(self, pool: Any,
                         commands: Sequence[tuple[tuple[Any, ...], Callable[[], object]]]
                         ) -> None:
        """Each ``(command, run)`` as :meth:`send_or_run` treats one, all written in one
        packet: every ``run`` when the packet cannot be sent, and a command's own ``run``
        when its reply is an error or lost."""
        def again(run: Callable[[], object]) -> OnError:
            def on_error(_exc: redis.RedisError) -> None:
                run()
            return on_error

        try:
            self._send(pool, [command for command, _ in commands],
                       [again(run) for _, run in commands])
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            for _, run in commands:
                run()

    def poll(self) -> None:
        """Read the replies that have arrived (an idle worker's owed errors surface)."""
        failed: _Failed = []
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                try:
                    self._drain(self._conn, wait=False, failed=failed)
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    self._drop(failed)
        self._report(failed)

    def settle(self) -> None:
        """Wait for every owed reply (their handlers run): what was sent has taken effect,
        or been run again, before the caller's next command."""
        self._settle(release=False)

    def close(self) -> None:
        """Read what is still owed and give the connection back to its pool."""
        self._settle(release=True)

    # -- internals ---------------------------------------------------------------------
    def _connection(self, pool: Any, failed: _Failed) -> Any:
        if self._conn is not None and self._pid != os.getpid():
            self._forget()
        if self._conn is not None and self._pool is not pool:
            self._drop(failed)  # the channel reconnected with a new pool
        if self._conn is None:
            self._conn = pool.get_connection()
            self._pool, self._pid = pool, os.getpid()
        return self._conn

    def _settle(self, release: bool) -> None:
        failed: _Failed = []
        with self._lock:
            if self._conn is not None and self._pid != os.getpid():
                self._forget()
            if self._conn is not None:
                try:
                    while self._owed:
                        self._drain(self._conn, wait=True, failed=failed)
                    if release:
                        self._pool.release(self._conn)
                        self._conn = self._pool = None
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    self._drop(failed)
        self._report(failed)

    def _forget(self) -> None:
        """Forked: the socket and what it owes are the parent's; leave them alone."""
        self._conn = self._pool = None
        self._owed.clear()

    def _drain(self, conn: Any, wait: bool, failed: _Failed) -> None:
        """Read the replies that have arrived; with ``wait``, at least one."""
        while self._owed and (wait or conn.can_read(timeout=0)):
            wait = False
            try:
                conn.read_response()
            except redis.ResponseError as exc:
                failed.append((self._owed[0], exc))
            self._owed.popleft()

    def _report(self, failed: _Failed) -> None:
        """Failures, outside the lock: a handler may run commands of its own."""
        for on_error, exc in failed:
            on_error(exc)

    def _drop(self, failed: _Failed) -> None:
        """Forget a connection in an unknown state (unread replies): disconnect it; what
        it owed goes to the commands' handlers."""
        conn, pool = self._conn, self._pool
        lost = redis.ConnectionError("connection lost before Redis replied")
        failed.extend((on_error, lost) for on_error in self._owed)
        self._conn = self._pool = None
        self._owed.clear()
        if conn is not None:
            try:
                conn.disconnect()
            finally:
                pool.release(conn)
