"""Waiting for results: Celery's pub/sub result consumer, subscribing to a task's
result channel when its producer first waits on it rather than at every ``delay()``.

Celery's Redis backend subscribes in ``on_task_call``, on every submission, so that a
result published before anyone waits is buffered; dropping the ``AsyncResult``
unsubscribes. That is a SUBSCRIBE and an UNSUBSCRIBE per ``delay()`` (about a fifth of
what a ``delay()`` costs over loopback) for results most offline-inference producers
never wait on one by one, and a producer holding a million results held a million
channels on the server.

Here a channel is subscribed when something waits on its result (``get()``, ``then()``,
a group's ``join``), and the result's stored state is read after that, so nothing
published before the subscription is missed:

* a waiter reads it anyway (Celery's ``on_wait_for_pending`` reads the stored state of
  what it waits on, once subscribed);
* a ``then()`` callback's result is read at the next drain, where Celery would have
  handed over the message it buffered.

And while a producer waits, the stored states of what it waits on are read again after
every :data:`RECHECK_S` without a message: a result whose message never came (a dropped
pub/sub connection's, or one published between a reconnect's read and its
resubscription) is then picked up within that time instead of never.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from celery import states
from celery.backends.redis import ResultConsumer
from kombu.exceptions import SerializationError

logger = logging.getLogger(__name__)

#: While a producer waits and no result message comes, the stored states of what it
#: waits on are read this often, s (one MGET).
RECHECK_S = 1.0


def waited_ids(result: Any) -> list[str]:
    """The task ids whose stored states Celery's ``on_wait_for_pending`` reads for
    ``result``: its own, or a result set's members'."""
    members = getattr(result, "results", None)
    if members is None:
        return [result.id]
    return [member.id for member in members]


class SitsResultConsumer(ResultConsumer):  # type: ignore[misc]
    """Celery's Redis result consumer, subscribing on first wait (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Keys subscribed whose stored state nobody has read since.
        self._unread: set[Any] = set()
        self._quiet_since = time.monotonic()

    def on_after_fork(self) -> None:
        self._unread = set()
        super().on_after_fork()

    def consume_from(self, task_id: str) -> None:
        key = self._get_key_for_task(task_id)
        with self._locked():
            fresh = key not in self.subscribed_to
            super().consume_from(task_id)
            if fresh:
                self._unread.add(key)

    def on_wait_for_pending(self, result: Any, timeout: Any = None, **kwargs: Any) -> None:
        # Celery's step reads the stored states of what is waited on, which is
        # subscribed by now (add_pending_result came first): not read a second time here.
        own = {self._get_key_for_task(task_id) for task_id in waited_ids(result)}
        with self._locked():
            self._unread -= own
        super().on_wait_for_pending(result, timeout=timeout, **kwargs)
        self._read_ready(self._take_unread())
        self._quiet_since = time.monotonic()

    def drain_events(self, timeout: float | None = None) -> None:
        self._read_ready(self._take_unread())
        if time.monotonic() - self._quiet_since >= RECHECK_S:
            with self._locked():
                waited = list(self.subscribed_to)
            self._read_ready(waited)
            self._quiet_since = time.monotonic()
        super().drain_events(timeout)

    def on_state_change(self, meta: Any, message: Any) -> None:
        if message is not None:
            self._quiet_since = time.monotonic()
        super().on_state_change(meta, message)

    def _take_unread(self) -> list[Any]:
        if not self._unread:  # (the common case, read without the lock)
            return []
        with self._locked():
            keys = [key for key in self._unread if key in self.subscribed_to]
            self._unread = set()
        return keys

    def _read_ready(self, keys: Iterable[Any]) -> None:
        """Hand on the stored states of ``keys`` that are final, as if their messages
        had come. Not the others: a progress callback (``get(on_message=...)``) would
        see a state it was already told of again every quiet second."""
        keys = list(keys)
        if not keys:
            return
        raws: list[Any] | None = None
        # A lost connection is Celery's to handle, as on the pub/sub path: it reconnects,
        # reading every subscribed key's state then
        with self.reconnect_on_error():
            raws = self.backend.client.mget(keys)
        if raws is None:
            return
        for key, raw in zip(keys, raws, strict=True):
            if raw is None:
                continue
            try:
                meta = self._decode_result(raw)
            except (ValueError, TypeError, KeyError, SerializationError) as exc:
                # Its own waiter reads it too, and is told; a wait on another result must
                # not fail for it
                logger.debug("result %r not readable on a quiet-time read: %s", key, exc)
                continue
            if meta["status"] in states.READY_STATES:
                self.on_state_change(meta, None)
