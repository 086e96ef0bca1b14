"""A channel's blocking wait on its queues' markers (``BZPOPMIN``), and giving up one
that can no longer serve.

kombu sends a channel's next wait only when none is in flight (``_register_BRPOP``), and
a wait watches the queues consumed when it was sent. A queue consumed while one was in
flight went unwatched until that wait returned, up to ``brpop_timeout`` (1 s) after it
was sent. Celery's remote control met this on every other call: kombu collects a call's
replies until its timeout, so each call ends with its reply consumer's wait in flight,
and the next call consumes a reply queue of another name (``Mailbox.oid`` hashes the
mailbox object's ``id()``, and Celery makes a mailbox per call). That call's reply
landed in a queue no wait watched, and the call timed out a few ms before the old wait's
empty answer came (Redis times blocked clients out on its 100 ms clock). kombu 5.7's own
Redis transport has the same gap.

Such a wait is given up by closing its connection: cancelling a command in flight
otherwise takes ``CLIENT UNBLOCK``, an admin command that managed Redis services often
refuse. The channel reconnects for its next wait, which costs a connection set-up only
when the consumed queues change or the channel closes, never per message. A wait takes a
marker, never a message, so all that giving one up can lose is the wake-up it may have
taken already: ``arm.lua`` sets each watched queue's marker again where messages wait.
Redis sees the close before our next command, sent afterwards on another connection,
in practice; were a put to slip in between, its wake-up would go to the closed wait and
the queue's other consumers would find the message at their next wake-up.

A wait that watches a queue its channel stops consuming is given up too. Left in flight
it could take a wake-up meant for another consumer of that queue (Redis serves the
client that blocked first), and nobody would pick what woke it: a plain consumer reads a
wait's answer at its next drain only, and its connection may sit idle in a pool
meanwhile. A remote-control call ended by its timeout left one so (a ping without
destinations always ends so); the next call, on another pooled connection, consumed a
reply queue of the same name (kombu names it after the ``id()`` of a copy of the
mailbox, which Python reuses), and the old wait took its reply's wake-up: no reply for
the whole timeout. A wake-up taken anyway (a process killed mid-wait) costs a message a
second at most: a worker picks every queue once a second, a plain consumer when its wait
times out empty (``transport.py``).

A socket is taken out of the event loop's poller before it is closed
(:func:`unpolled_on_disconnect`): epoll keeps a registration while any process holds the
socket, and a pool child forked while the wait was open holds it. Closed first, the dead
socket (shut down: readable for ever) went on being reported under its fd number, which
the reconnect reuses, and the worker blocked reading its new connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from kombu.transport.virtual import Empty

logger = logging.getLogger(__name__)


def misses(watched: Sequence[str], queue: str, consumed: Sequence[str]) -> bool:
    """Whether a wait in flight on ``watched`` cannot wake for ``queue``, which the
    channel now consumes (``consumed``: its non-fanout queues)."""
    return bool(watched) and queue in consumed and queue not in watched


def give_up(connection: Any, watched: Sequence[str], arm: Callable[[str], object],
            errors: tuple[type[BaseException], ...]) -> None:
    """Close ``connection``, whose wait on ``watched`` is in flight, then re-arm those
    queues' markers (``arm``: ``arm.lua`` for one queue).

    With Redis unreachable the markers stay as they are: the channel's reconnect for its
    next wait meets the error and kombu's recovery takes over, as on any lost connection.
    """
    connection.disconnect()
    for queue in watched:
        try:
            arm(queue)
        except errors as exc:
            logger.debug("queue %r: marker not re-armed after giving up a wait: %s",
                         queue, exc)
            return


def marked(client: Any, markers: Sequence[str]) -> list[bool]:
    """Whether each of ``markers`` is set, in one round trip; one that cannot be read
    (another type of key) counts as set: the pick that follows says why."""
    return marked_and(client, markers, None)[0]


def marked_and(client: Any, markers: Sequence[str], command: Sequence[Any] | None
               ) -> tuple[list[bool], Any]:
    """:func:`marked`, and ``command``'s reply (an error as its exception, unraised) from
    the same round trip; None without a command."""
    with client.pipeline(transaction=False) as pipe:
        for key in markers:
            pipe.zcard(key)
        if command is not None:
            pipe.execute_command(*command)
        replies = pipe.execute(raise_on_error=False)
    reply = replies.pop() if command is not None else None
    return [isinstance(n, Exception) or bool(n) for n in replies], reply


def unpolled_on_disconnect(connection_class: type, poller: Callable[[], Any]) -> type:
    """``connection_class`` whose ``disconnect`` first unregisters its socket from
    ``poller()`` (the event loop's; None: not polled), while its fd still names it. Only
    in the process that opened it: a forked child shares the parent's epoll instance."""

    class UnpolledOnDisconnect(connection_class):  # type: ignore[misc]
        def disconnect(self, *args: Any, **kwargs: Any) -> None:
            sock, polling = getattr(self, "_sock", None), poller()
            if sock is not None and polling is not None and os.getpid() == self.pid:
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    polling.unregister(sock)
            super().disconnect(*args, **kwargs)

    return UnpolledOnDisconnect


def stray_readable(connection: Any, connection_errors: tuple[type[BaseException], ...]
                   ) -> None:
    """The wait's socket fired with no wait in flight (intake paused, say): Redis closed
    it (a restart, ``CLIENT KILL``, an idle timeout), or sent nothing. Closed: the
    connection error, as a read would raise, so the worker reconnects (ignored, the
    closed socket would fire at every turn of the loop); else nothing to read (Empty)."""
    if connection is not None and connection._sock is not None:
        try:
            connection.can_read(timeout=0)
        except connection_errors:
            connection.disconnect()
            raise
    raise Empty()
