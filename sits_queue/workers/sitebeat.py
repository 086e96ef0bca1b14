"""A worker keeps its site alive to its peers (MISSION §2.3, ``broker/sites.py``).

A peer takes a site's replicated tasks over once it has heard no heartbeat from it for
``site_dead_after_s``. The heartbeats came from the sync pass alone, a beat task run in
a pool slot: a site whose slots were all busy with long tasks (a ``high`` task may run
45 s, past the 30 s default), or whose beat had stopped, went silent while it served,
and its peers ran its tasks a second time. Each worker now heartbeats the peers from a
thread of its own, every ``site_sync_interval_s``, while its site's Redis answers it; a
site reads as lost when none of its workers can.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import bootsteps

from sits_queue.broker.sites import SiteSync, has_peers
from sits_queue.config import SitsConfig
from sits_queue.periodic import Periodic

logger = logging.getLogger(__name__)

#: Seconds :meth:`SiteHeartbeat.stop` waits for a heartbeat in flight.
_STOP_WAIT_S = 2.0


class SiteHeartbeat(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer step: heartbeat this site's peers from a daemon thread."""

    name = "SITS site heartbeat"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self._beating: Periodic | None = None
        self._silent = False  # this site's own Redis did not answer
        self._unreachable: set[str] = set()  # said once each, until reached again

    def start(self, c: Any) -> None:
        config: SitsConfig = c.app.sits
        if self._beating is not None or not has_peers(config):
            return
        # Its own clients: the thread shares nothing with the passes or the puts.
        sync = SiteSync(config)
        self._beating = Periodic("sits-site-heartbeat", config.site_sync_interval_s,
                                 lambda _: self._beat(sync),
                                 "could not heartbeat the site's peers").start()

    def _beat(self, sync: SiteSync) -> None:
        try:
            reached, failed = sync.heartbeat_peers()
        except redis.RedisError as exc:  # this site's own Redis: no heartbeat, rightly
            if not self._silent:
                logger.warning("site %s: its Redis does not answer (%s); no heartbeat to "
                               "its peers until it does", sync.site, exc)
            self._silent = True
            return
        if self._silent:
            logger.info("site %s: its Redis answers again; heartbeats go on", sync.site)
            self._silent = False
        for peer in sorted(failed - self._unreachable):
            logger.warning("site %s: could not heartbeat peer %s", sync.site, peer)
        self._unreachable = (self._unreachable | failed) - reached

    def stop(self, c: Any) -> None:
        beating, self._beating = self._beating, None
        if beating is not None:
            beating.stop(_STOP_WAIT_S)
