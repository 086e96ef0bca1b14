"""A Redis that may evict keys loses tasks: said when a worker starts.

A server with ``maxmemory`` set and a ``maxmemory-policy`` other than ``noeviction``
deletes keys when it is full. A queue's payload hash gone, its waiting ids are skipped
as orphans; its sorted set gone, its payloads are never picked; a result gone, its
caller's ``get()`` waits; every one of them unsaid. (``volatile-*`` policies take only
keys with a time to live: results, worker records, a queue declared with
``x-expires``.) Celery's own Redis transport is as exposed; Sidekiq warns alike. A
server that refuses ``CONFIG GET`` (a managed Redis, an ACL user without it) is not
known: nothing is said.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from sits_queue.checks import text

logger = logging.getLogger(__name__)


def eviction_risk(client: Any) -> str | None:
    """The server's eviction policy when it may evict keys (``maxmemory`` set, a policy
    other than ``noeviction``); None when it may not, or cannot be asked."""
    try:
        found = {**client.config_get("maxmemory"), **client.config_get("maxmemory-policy")}
        maxmemory = int(text(found.get("maxmemory", 0) or 0))
        policy = text(found.get("maxmemory-policy") or "noeviction")
    except (redis.RedisError, ValueError, TypeError):
        return None
    return None if maxmemory <= 0 or policy == "noeviction" else policy


def warn_if_evicting(url: str) -> None:
    """Warn, once at a worker's start, when the Redis of ``url`` may evict keys."""
    from sits_queue.config import redacted

    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        policy = eviction_risk(client)
    finally:
        client.close()
    if policy is not None:
        logger.warning("Redis at %s may evict keys when full (maxmemory-policy %s): "
                       "queued tasks and results can be lost unsaid; set "
                       "maxmemory-policy noeviction (a full server then refuses writes, "
                       "which producers and workers report)", redacted(url), policy)
