"""The result backend: Celery's Redis backend, storing a state in one round trip.

Celery's key-value backends read a task's stored meta before every write, so that a
second delivery of a task cannot overwrite its ``SUCCESS`` (GET, then SET + PUBLISH: two
round trips). A SITS task is tracked as ``STARTED`` (``task_track_started``), so every
task paid four round trips in its pool child, the largest share of what a short task
costs there. :class:`SitsRedisBackend` runs the same check and write as one Lua call
(``lua/store_result.lua``): one round trip per state, and the check and the write can no
longer interleave with another writer's. Its result consumer subscribes to a result's
channel when the producer first waits on it, not at every ``delay()``
(``resultwait.py``). Everything else (reading results, groups, chords) is Celery's.

A task's ``STARTED`` is written without waiting for the reply (``fanout.py``), on the
path between a pool child taking the task and running it: the reply is read before the
next state of any task is written, so a ``STARTED`` is in Redis before its task's
outcome is, and one refused (``NOSCRIPT``) or lost with its connection is written again
then (idempotent), as Celery's retry policy would.

A batch's members (``workers/batched.py``) are marked ``STARTED`` together when their
batch starts, in one packet not waited for (:meth:`SitsRedisBackend.store_started`): one
revoked meanwhile stays ``REVOKED`` (Celery's tracer runs for each only after the batch).

Celery picks it from the backend URL: ``sits_queue.broker.results:SitsRedisBackend+redis://...``
(:func:`backend_url`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from importlib import resources
from typing import Any

from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str

from sits_queue.broker.fanout import DeferredCommands
from sits_queue.broker.resultwait import SitsResultConsumer
from sits_queue.checks import shown
from sits_queue.errors import UnreadableResult

#: The class as Celery's ``result_backend`` setting names it, before ``+<redis URL>``.
BACKEND_PATH = "sits_queue.broker.results:SitsRedisBackend"


def backend_url(redis_url: str) -> str:
    """``result_backend`` for a Redis URL (``redis://``, ``rediss://``, ``redis+socket://``)."""
    return f"{BACKEND_PATH}+{redis_url}"


def expiry_ms(expires: float | timedelta | None) -> int:
    """A result's time to live in ms as ``SET PX`` takes it; 0 keeps it forever."""
    if expires is None:
        return 0
    seconds = expires.total_seconds() if isinstance(expires, timedelta) else float(expires)
    return max(1, round(seconds * 1000)) if seconds > 0 else 0


#: The key of a task's result under a backend's global key prefix (Celery's layout).
RESULT_KEY = "celery-task-meta-"


def store_encoded(client: Any, key: str, value: bytes | str, ttl_ms: int) -> bool:
    """Store a result meta already encoded (another backend's record of the task) at
    ``key``, as a worker's store does (``store_result.lua``: never over a SUCCESS, and
    published to the key's channel, where a waiting ``get()`` hears it); whether it was
    stored."""
    script = client.register_script(store_result_source())
    return bool(script(keys=[key], args=[value, max(0, ttl_ms)]))


@functools.cache
def store_result_source() -> str:
    """``store_result.lua``'s source (read once a process)."""
    return resources.files("sits_queue.broker").joinpath("lua/store_result.lua").read_text()


class SitsRedisBackend(RedisBackend):  # type: ignore[misc]
    """Celery's Redis result backend with the state write done by ``store_result.lua``
    and the result consumer of ``resultwait.py``."""

    ResultConsumer = SitsResultConsumer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._store_script: Any = None
        self._subscribe_on_send: bool | None = None  # read from the app's config at first use
        self._deferred = DeferredCommands()
        # The script reads the stored status as JSON; other encodings keep Celery's path.
        self._scripted = self.serializer == "json" and not self.compression

    def on_task_call(self, producer: Any, task_id: str) -> None:
        """Celery subscribes to the result's channel here, at every submission;
        :class:`SitsResultConsumer` does when the result is first waited on, unless
        ``result_subscribe_on_send`` asks for Celery's way (``resultwait.py``)."""
        if self.subscribes_on_send:
            super().on_task_call(producer, task_id)

    @property
    def subscribes_on_send(self) -> bool:
        """``result_subscribe_on_send``, of the app's SITS config."""
        if self._subscribe_on_send is None:
            config = getattr(self.app, "sits", None)
            self._subscribe_on_send = bool(getattr(config, "result_subscribe_on_send", False))
        return self._subscribe_on_send

    def meta_from_decoded(self, meta: Any) -> Any:
        # A record without a status raised KeyError, which kombu counts as a lost
        # connection: with result_backend_always_retry, get(timeout=3) retried for ~70 s
        # before failing.
        if not isinstance(meta, dict) or "status" not in meta:
            raise UnreadableResult(f"result record is not one Celery writes (no status): "
                                   f"{shown(meta)}")
        return super().meta_from_decoded(meta)

    def _store_result(self, task_id: Any, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        if not self._scripted:
            return super()._store_result(task_id, result, state, traceback,
                                         request=request, **kwargs)
        key, value, ttl_ms = self._record(task_id, result, state, traceback, request)
        self._deferred.settle()  # an earlier STARTED is in Redis before this is written
        if state == states.STARTED:
            self._store_later(key, value, ttl_ms)
        else:
            self.ensure(self._store, (key, value, ttl_ms))
        return result

    def store_started(self, started: Sequence[tuple[str, Mapping[str, Any], Any]]) -> None:
        """``STARTED`` for tasks about to run together (a batch's members, before its
        function runs), each ``(task_id, result, request)`` as Celery's tracer stores it
        for one task, all in one packet not waited for. Not over a ready state: a task
        revoked since its worker sent it to the pool stays ``REVOKED``. A record too
        large to store is left out (the task's own trace stores it, or fails it)."""
        if not self._scripted:
            for task_id, result, request in started:
                if self.get_state(task_id) not in states.READY_STATES:
                    self.store_result(task_id, result, states.STARTED, request=request)
            return
        records = []
        for task_id, result, request in started:
            try:
                records.append(self._record(task_id, self.encode_result(result,
                                                                        states.STARTED),
                                            states.STARTED, None, request))
            except BackendStoreError:
                continue
        if not records:
            return
        self._deferred.settle()
        script = self._script()
        self._deferred.send_each_or_run(self.client.connection_pool, [
            (("EVALSHA", script.sha, 1, key, value, ttl_ms, 1), self._awaited(key, value, ttl_ms))
            for key, value, ttl_ms in records])

    def _awaited(self, key: Any, value: Any, ttl_ms: int) -> Callable[[], object]:
        """A STARTED ahead of its run, stored and waited for (Celery's retries)."""
        return lambda: self.ensure(self._store, (key, value, ttl_ms, True))

    def _record(self, task_id: Any, result: Any, state: str, traceback: Any,
                request: Any) -> tuple[Any, Any, int]:
        """The key, encoded meta and time to live, in ms, of a state as Celery stores it."""
        meta = self._get_result_meta(result=result, state=state, traceback=traceback,
                                     request=request)
        meta["task_id"] = bytes_to_str(task_id)  # type: ignore[no-untyped-call]
        value = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state,
                                    task_id=task_id)
        expires = self.failure_expires if state == states.FAILURE else self.expires
        return self.get_key_for_task(task_id), value, expiry_ms(expires)

    def _script(self) -> Any:
        if self._store_script is None:
            # redis-py's Script: EVALSHA, loading the source once after NOSCRIPT.
            source = store_result_source()
            script = self.client.register_script(source)
            # Loaded now: a deferred STARTED sent before the first load would meet NOSCRIPT.
            self.client.script_load(source)
            self._store_script = script
        return self._store_script

    def _store(self, key: Any, value: Any, ttl_ms: int, ahead: bool = False) -> Any:
        # ahead: a STARTED before its task runs, kept off any ended state
        return self._script()(keys=[key], args=[value, ttl_ms, 1] if ahead else [value, ttl_ms])

    def _store_later(self, key: Any, value: Any, ttl_ms: int) -> None:
        self._deferred.send_or_run(self.client.connection_pool,
                                   ("EVALSHA", self._script().sha, 1, key, value, ttl_ms),
                                   lambda: self.ensure(self._store, (key, value, ttl_ms)))
