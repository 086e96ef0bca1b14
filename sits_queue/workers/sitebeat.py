"""A worker keeps its site alive to its peers (MISSION §2.3, ``broker/sites.py``).

A peer takes a site's replicated tasks over once it has heard no heartbeat from it for
``site_dead_after_s``. The heartbeats came from the sync pass alone, a beat task run in
a pool slot: a site whose slots were all busy with long tasks (a ``high`` task may run
45 s, past the 30 s default), or whose beat had stopped, went silent while it served,
and its peers ran its tasks a second time. Each worker now heartbeats the peers from a
thread of its own, every ``site_sync_interval_s``, while its site's Redis answers it; a
site reads as lost when none of its workers can. The thread goes on while the consumer
reconnects (it was stopped with the consumer's connection and started again only after
Celery's reconnect backoff, seconds after the site's Redis was back: a peer took over a
site whose Redis had been away for less than ``site_dead_after_s``).

And before the worker takes a task (at its start, and again after a lost connection),
the tasks a peer took over while this site was away are settled, as the sync pass does:
the copies still waiting here go to the dead letters. Left to the beat's first pass
(up to 30 s after a beat's restart, its lock held by the dead one), a restarted worker
ran them first, at the top of its queue, and each ran at both sites.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import bootsteps
from celery.bootsteps import RUN

from sits_queue.broker import takeover
from sits_queue.broker.sites import PassReport, SiteSync, has_peers
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
        self._sync: SiteSync | None = None
        self._silent = False  # this site's own Redis did not answer
        self._unreachable: set[str] = set()  # said once each, until reached again

    def start(self, c: Any) -> None:
        config: SitsConfig = c.app.sits
        if not has_peers(config):
            return
        if self._sync is None:
            self._sync = SiteSync(config)  # its own clients: shares nothing with passes
        settle_take_overs(self._sync)
        if self._beating is None:
            sync = self._sync
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
        # A restart after a lost connection (the blueprint still runs): the worker lives
        # on, and so do its heartbeats, sent whenever the site's Redis answers
        if getattr(getattr(c, "blueprint", None), "state", None) == RUN:
            return
        self.shutdown(c)

    def shutdown(self, c: Any) -> None:
        beating, self._beating = self._beating, None
        if beating is not None:
            beating.stop(_STOP_WAIT_S)


def settle_take_overs(sync: SiteSync) -> int:
    """Settle, at each peer that answers, the tasks it took over from this site: their
    copies still waiting here go to the dead letters. Returns how many did."""
    report = PassReport()
    for peer in sync.peers:
        try:
            takeover.drop_taken_over(sync, peer.name, report)
        except redis.RedisError as exc:  # (that peer's are settled by the next pass)
            logger.warning("site %s: could not read what peer %s took over: %s",
                           sync.site, peer.name, exc)
    if report.dropped:
        logger.warning("site %s: %d of its tasks that its peers took over while it was "
                       "away went to the dead letters before this worker took any (they "
                       "run at the peers)", sync.site, report.dropped)
    return report.dropped
