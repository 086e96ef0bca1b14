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

Celery picks it from the backend URL: ``sits_queue.broker.results:SitsRedisBackend+redis://...``
(:func:`backend_url`).
"""

from __future__ import annotations

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
        meta = self._get_result_meta(result=result, state=state, traceback=traceback,
                                     request=request)
        meta["task_id"] = bytes_to_str(task_id)  # type: ignore[no-untyped-call]
        value = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state,
                                    task_id=task_id)
        expires = self.failure_expires if state == states.FAILURE else self.expires
        key, ttl_ms = self.get_key_for_task(task_id), expiry_ms(expires)
        self._deferred.settle()  # an earlier STARTED is in Redis before this is written
        if state == states.STARTED:
            self._store_later(key, value, ttl_ms)
        else:
            self.ensure(self._store, (key, value, ttl_ms))
        return result

    def _script(self) -> Any:
        if self._store_script is None:
            # redis-py's Script: EVALSHA, loading the source once after NOSCRIPT.
            source = resources.files("sits_queue.broker").joinpath(
                "lua/store_result.lua").read_text()
            script = self.client.register_script(source)
            # Loaded now: a deferred STARTED sent before the first load would meet NOSCRIPT.
            self.client.script_load(source)
            self._store_script = script
        return self._store_script

    def _store(self, key: Any, value: Any, ttl_ms: int) -> Any:
        return self._script()(keys=[key], args=[value, ttl_ms])

    def _store_later(self, key: Any, value: Any, ttl_ms: int) -> None:
        self._deferred.send_or_run(self.client.connection_pool,
                                   ("EVALSHA", self._script().sha, 1, key, value, ttl_ms),
                                   lambda: self.ensure(self._store, (key, value, ttl_ms)))
