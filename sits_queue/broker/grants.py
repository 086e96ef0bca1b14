"""What a Redis ACL user must be granted beyond its keys and channels under the key
prefix, checked when a worker starts.

kombu subscribes to Celery's fanout exchanges by pattern (``PSUBSCRIBE``): the remote
control's ``<prefix>/<db>.celery.pidbox`` and, for a worker that gossips, the workers'
events, ``<prefix>/<db>.celeryev/worker.*`` (gossip binds ``worker.#``; ``celery
events`` and Flower, binding ``#``, subscribe ``.../celeryev/*``). Redis matches a
subscribed *pattern* against the user's channel grants as written, not as a channel
name: ``&a:*`` allows ``SUBSCRIBE a:anything`` but not ``PSUBSCRIBE a:/0.celeryev/*``,
nor does ``&a:/0.celeryev/*`` allow ``PSUBSCRIBE a:/0.celeryev/worker.*`` (a worker
given the grants this check named then died at its first gossip). A user confined to its prefix
(``ACL SETUSER sits on >pw ~a:* &a:* +@all``, the usual multi-tenant set-up) started a
worker that died on its first connection with "Unrecoverable error: auth:
NoPermissionError" and ~50 lines of traceback naming no channel. The worker now stops
before that in one line naming the grants to add.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis


def fanout_patterns(app: Any, gossip: bool = True) -> list[str]:
    """The channel patterns a worker of ``app`` subscribes to (remote control, and the
    events when it gossips), as kombu writes them."""
    prefix = app.sits.global_keyprefix
    # (the database as kombu's channel reads it from the connection: the path's or ?db=)
    db = redis.ConnectionPool.from_url(app.sits.redis_url).connection_kwargs.get("db", 0)
    patterns = []
    if app.conf.worker_enable_remote_control:
        patterns.append(f"{prefix}/{db}.{app.control.mailbox.namespace}.pidbox")
    if gossip:  # (Celery's gossip binds "worker.#", kombu's pattern turns # into *)
        patterns.append(f"{prefix}/{db}.{app.conf.event_exchange}/worker.*")
    return patterns


def refused_patterns(client: redis.Redis, patterns: list[str]) -> list[str]:
    """Those of ``patterns`` the user of ``client`` may not subscribe to; none when Redis
    cannot be asked (the worker's own connection then says why, and retries)."""
    refused = []
    pubsub = client.pubsub()
    try:
        for pattern in patterns:
            try:
                pubsub.psubscribe(pattern)
                _await_reply(pubsub)  # (the refusal comes as the reply, read here)
                pubsub.punsubscribe(pattern)  # type: ignore[no-untyped-call, unused-ignore]
            except redis.exceptions.NoPermissionError:
                refused.append(pattern)
                pubsub.close()  # (the connection is reset; a new one for the next)
                pubsub = client.pubsub()
            except redis.RedisError:
                return refused
    finally:
        with contextlib.suppress(redis.RedisError):
            pubsub.close()
    return refused


def _await_reply(pubsub: Any, timeout_s: float = 5.0) -> None:
    """Read the subscription's reply (raising the refusal, if it is one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
        if message is not None and message.get("type") == "psubscribe":
            return


def check_database(client: redis.Redis, url: str) -> None:
    """Raise ``SystemExit`` when the server has no database of ``url``'s number: the
    worker logged "DB index is out of range" and tried again for good. Any other failure
    is left to the worker's own connection (Redis down at start: it waits)."""
    from sits_queue.config import redacted

    try:
        client.ping()
    except redis.ResponseError as exc:
        if "db index" not in str(exc).lower():  # ("ERR DB index is out of range")
            return
        raise SystemExit(f"Error: Redis at {redacted(url)} has no such database: {exc} "
                         "(its `databases` setting says how many it keeps)") from None
    except redis.RedisError:
        return


def check_worker_grants(app: Any, options: Any = None) -> None:
    """Raise ``SystemExit`` naming the channel grants a worker of ``app`` lacks."""
    gossip = not (options or {}).get("without_gossip")
    patterns = fanout_patterns(app, gossip)
    if not patterns:
        return
    client = redis.Redis.from_url(app.sits.redis_url, socket_timeout=5,
                                  socket_connect_timeout=5)
    try:
        check_database(client, app.sits.redis_url)
        refused = refused_patterns(client, patterns)
    finally:
        client.close()
    if refused:
        grants = " ".join(f"'&{p}'" for p in refused)
        raise SystemExit(
            f"Error: the Redis user of SITS_REDIS_URL may not subscribe to the channel "
            f"pattern(s) {', '.join(repr(p) for p in refused)} (Celery's remote control "
            f"and events); Redis matches a subscribed pattern against the grants as "
            f"written, so grant them as such: ACL SETUSER <user> {grants}")
