"""Flower's Broker page and ``/api/queues/length`` for the sorted-set queues.

Flower chooses its broker reader by the URL's scheme and, for ``redis://``, counts the
Redis *lists* named like each queue (``LLEN``): a SITS queue is a sorted set under other
keys, so every queue read as empty. Flower has no plug-in point for this, so
:func:`install` wraps its ``Broker`` factory: for an app whose broker options carry a
SITS config (every :class:`~sits_queue.app.SitsCelery` app's do) it returns
:class:`SitsQueues`, which reads each queue's waiting and held sets; any other app gets
Flower's own reader, unchanged.

``SitsCelery`` installs it when Flower is loaded (``celery ... flower`` imports Flower
before it loads the app); a program that builds Flower itself calls :func:`install`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from redis import asyncio as aioredis
from redis.exceptions import RedisError

from sits_queue.broker.keys import QueueKeys, queues_registry, registered_queues
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidQueueName
from sits_queue.options import CONTROL_QUEUE
from sits_queue.settings import config_from_options

logger = logging.getLogger(__name__)

#: Flower's module holding the factory; present once Flower is imported.
FLOWER_BROKER_MODULE = "flower.utils.broker"
#: Seconds a Broker page read may wait on Redis (Flower's own reader waits 1 s / 2 s).
CONNECT_TIMEOUT_S = 1.0
READ_TIMEOUT_S = 2.0


class SitsQueues:
    """Flower's broker reader for SITS queues, with Flower's RabbitMQ fields (its page
    shows them): ``messages`` (waiting and held), ``messages_ready`` (waiting) and
    ``messages_unacknowledged`` (held by workers: running or reserved)."""

    def __init__(self, config: SitsConfig) -> None:
        self.config = config

    async def queues(self, names: Iterable[str]) -> list[dict[str, Any]]:
        client = aioredis.Redis.from_url(self.config.redis_url,
                                         socket_connect_timeout=CONNECT_TIMEOUT_S,
                                         socket_timeout=READ_TIMEOUT_S)
        try:
            return await self._queues(client, list(names))
        finally:
            await client.aclose()

    async def _queues(self, client: Any, names: list[str]) -> list[dict[str, Any]]:
        prefix = self.config.global_keyprefix
        try:
            # Every queue ever declared, not only those of the workers Flower knows: a
            # backlog no worker consumes, when it matters most, was not shown at all
            names += [q for q in registered_queues(await client.smembers(
                queues_registry(prefix))) if q not in names]
        except (RedisError, OSError) as exc:
            logger.warning("SITS queue registry unreadable (the workers' queues shown): %s",
                           exc)
        rows: list[dict[str, Any]] = []
        readable: list[tuple[dict[str, Any], QueueKeys]] = []
        for name in names:
            row: dict[str, Any] = {"name": name}
            rows.append(row)
            try:
                readable.append((row, QueueKeys.for_queue(name, self.config.global_keyprefix)))
            except InvalidQueueName:
                row["messages"] = None  # no SITS queue can have this name: shown as missing
        if not readable:
            return rows
        if CONTROL_QUEUE not in {row["name"] for row in rows}:
            # Flower asks for the workers' queues, or with none up for the app's default:
            # the beat's passes would wait unseen in the control queue when none runs
            rows.append({"name": CONTROL_QUEUE})
            readable.append((rows[-1], QueueKeys.for_queue(CONTROL_QUEUE,
                                                           self.config.global_keyprefix)))
        try:
            async with client.pipeline(transaction=False) as pipe:
                for _, keys in readable:
                    pipe.zcard(keys.waiting)
                    pipe.zcard(keys.unacked)
                # (one queue's key of another type failed the whole read: every row,
                # the healthy queues' too, vanished from the page)
                counts = iter(await pipe.execute(raise_on_error=False))
        except (RedisError, OSError) as exc:
            # Flower shows an empty table and logs; the page must not fail on it.
            logger.error("SITS queue depths unreadable from %s: %s",
                         self.config.redis_url.split("@")[-1], exc)
            return []
        for row, _ in readable:
            waiting, held = next(counts), next(counts)
            if isinstance(waiting, Exception) or isinstance(held, Exception):
                # that queue shown as missing, as one no SITS queue can be; said once a read
                logger.warning("SITS queue %r depth unreadable: %s", row["name"],
                               waiting if isinstance(waiting, Exception) else held)
                row["messages"] = None
                continue
            row.update(messages=int(waiting) + int(held), messages_ready=int(waiting),
                       messages_unacknowledged=int(held))
        return rows


def reader_for(broker_options: Mapping[str, Any] | None) -> SitsQueues | None:
    """The SITS reader for these broker options, or None when they are not a SITS app's.
    Options without a SITS config (an app that replaced ``broker_transport_options``,
    whose connections get it back in ``SitsCelery._connection``) are the current app's
    when that is a SITS one: Flower serves the app it loaded, the current one."""
    raw = (broker_options or {}).get("sits_config")
    if isinstance(raw, Mapping):
        return SitsQueues(config_from_options(raw, "broker_transport_options"))
    from celery import current_app  # (late: the app module installs this one)

    from sits_queue.app import SitsCelery, sits_config
    app = current_app._get_current_object()
    return SitsQueues(sits_config(app)) if isinstance(app, SitsCelery) else None


def install() -> bool:
    """Route Flower's ``Broker`` factory to :class:`SitsQueues` for SITS apps. Returns
    whether Flower is loaded (nothing is imported otherwise); calling it again is a no-op."""
    module = sys.modules.get(FLOWER_BROKER_MODULE)
    if module is None:
        return False
    factory = module.Broker
    if getattr(factory, "_sits_installed", False):
        return True
    flowers_new = factory.__new__

    def __new__(cls: type, broker_url: str, *args: Any, **kwargs: Any) -> Any:
        reader = reader_for(kwargs.get("broker_options"))
        if reader is not None:
            return reader
        return flowers_new(cls, broker_url, *args, **kwargs)

    factory.__new__ = staticmethod(__new__)
    factory._sits_installed = True
    return True
