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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

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
