"""Topology-aware priority sync between sites (MISSION §2.3): the Redis edge.

The policy (tiers, the decision table, link weights) is ``priority/sites.py``. Here:

* **replicas** live at the chosen peer, per origin site and queue, never consumed by the
  peer's workers: ``sits:replica:{<origin>:<queue>}:z`` (id -> score), ``:p`` (payload),
  ``:m`` (scoring metadata), and the set of such queues ``sits:replica:{<origin>}:queues``;
* **strong** classes are written there by the producer's enqueue itself (the put returns
  once the peer has them); the others go through this site's **outbox** (``sits:site:
  {outbox}``, ``put``/``del`` entries), drained by the sync pass a batch at a time (kept
  aside in ``...:taken`` until the peer has it, so a pass that dies loses nothing),
  which also deletes the replicas of acked tasks (so a replica may outlive its task by
  one pass: a take-over in that window runs the task again: at least once, never lost);
* **digests**: every :data:`DIGEST_EVERY_S` the pass compares, per queue, the ids this
  site holds (waiting or running) in digest-checked classes with the replica's, and
  repairs a difference (a lost outbox entry, a peer restarted empty); and deletes the
  replicas, of any class, of tasks this site no longer holds (a delete sent elsewhere);
* **one replica peer**: the pass measures the links and publishes its choice
  (``sits:site:link``); producers re-read it every :func:`link_max_age_s` and write their
  strong replicas there, so that they go where the pass drains and deletes. Live peers
  that are not (or no longer) the replica peer get their replicas of this site handed
  over to it and deleted: acks' deletes go to the replica peer only;
* **heartbeats**: each pass, and each worker of the site from a thread of its own
  (:meth:`SiteSync.heartbeat_peers`, while the site's Redis answers), sets
  ``sits:site:{<origin>}:alive`` at every live peer (any may
  still hold replicas), expiring after ``site_dead_after_s``; a peer's pass **takes over**
  the replicas of an origin from
  which it has itself heard nothing for that long (an expired heartbeat alone is not
  enough: the peer may just be back from an outage of its own): each goes into the
  peer's own queue of the same name (``put.lua``) and its id into
  ``sits:site:{<origin>}:takenover`` there. When the origin is back, its
  pass reads that set first and dead-letters its own copies that still wait (reason:
  taken over), deleting their replicas, so the work runs once where it can.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from sits_queue.broker import clock as redis_clock
from sits_queue.broker import recovery, takeover
from sits_queue.broker.keys import (
    QueueKeys,
    alive_key,
    last_pass_key,
    link_key,
    origins_key,
    outbox_key,
    queues_registry,
    registered_queues,
    replica_keys,
    replica_queues_key,
    replicated,
    taken_key,
)
from sits_queue.broker.meta import sla_class_of
from sits_queue.broker.scripts import Scripts
from sits_queue.checks import text
from sits_queue.config import SitsConfig
from sits_queue.priority import sites
from sits_queue.priority.sites import Link, SyncMode, SyncPlan

logger = logging.getLogger(__name__)

#: Seconds between digest checks of one site's replica (a digest reads every id).
DIGEST_EVERY_S = 10.0
#: Seconds a measured link is reused before it is measured again (at most a third of
#: site_dead_after_s: a peer back from an outage must hear heartbeats before it could
#: count this site as dead), and a producer re-reads the pass's choice.
LINK_MAX_AGE_S = 10.0
#: Outbox entries one pass drains (the rest wait for the next).
DRAIN_BATCH = 5000
#: PINGs per RTT measurement (the median is kept).
PINGS = 3
#: Seconds a peer may take to answer before it counts as down for this pass.
PEER_TIMEOUT_S = 1.0
#: Seconds a peer whose strong (synchronous) write failed or timed out is written
#: asynchronously instead: a hung peer costs a producer one PEER_TIMEOUT_S per period, not
#: one per put.
STRONG_BACKOFF_S = 30.0
#: Seconds a peer that a worker's heartbeat could not reach is left alone (each try may
#: wait PEER_TIMEOUT_S, holding up the heartbeats of the peers after it).
HEARTBEAT_BACKOFF_S = 5.0
#: Replicas one pass moves off the live peers that no longer keep them (more next pass).
HANDOVER_BATCH = 5000
#: Outbox entries beyond which eventual-mode puts are no longer queued (a long peer
#: outage must not fill this site's memory; digest-checked classes are still queued, and
#: repaired by the digest anyway), and for how long, s, before looking again.
OUTBOX_MAX = 1_000_000
OUTBOX_FULL_BACKOFF_S = 10.0
#: How often a peer is told again which of this site's queues it holds replicas of, s.
REGISTER_EVERY_S = 10.0
#: Ids per HSCAN round trip of a digest.
SCAN_COUNT = 1000


def link_max_age_s(config: SitsConfig) -> float:
    return min(LINK_MAX_AGE_S, config.site_dead_after_s / 3)


@dataclass
class PassReport:
    """What one sync pass did."""

    peer: str | None = None
    rtt_ms: float | None = None
    modes: dict[str, str] = field(default_factory=dict)
    replicated: int = 0
    deleted: int = 0
    repaired: int = 0
    taken_over: int = 0
    dropped: int = 0
    handed_over: int = 0
    restored: int = 0
    results_mirrored: int = 0
    #: of those, chord members counted in their chord here
    chord_parts: int = 0
    errors: list[str] = field(default_factory=list)


class SiteSync:
    """This site's side of the sync: the hooks the transport calls on put and ack, and
    the pass the beat runs. One per process and config (:func:`for_config`)."""

    def __init__(self, config: SitsConfig, local: redis.Redis | None = None,
                 clock: Any = None) -> None:
        self.config = config
        self.site = config.site
        self.prefix = config.global_keyprefix
        self.peers = sites.parse_peers(config.site_peers)
        self.local = local or redis.Redis.from_url(config.redis_url)
        self.clients = {p.name: redis.Redis.from_url(p.redis_url,
                                                     socket_timeout=PEER_TIMEOUT_S,
                                                     socket_connect_timeout=PEER_TIMEOUT_S)
                        for p in self.peers}
        self.scripts = Scripts.register()
        # (this site's Redis's clock, as its other hosts read it: broker/clock.py)
        self.clock = clock or (lambda: redis_clock.now(self.local))
        self._links: list[Link] = []
        self._links_at = -math.inf
        self._measured = False  # whether _links are this process's own measurement
        self._max_age_s = link_max_age_s(config)
        self._replica_peer: str | None = None
        self._strong_off_until: dict[str, float] = {}
        self._digest_at = -DIGEST_EVERY_S
        self._weights = {c.name: c.weight for c in config.classes}
        self._tiers = sites.tiers(self._weights)
        self._registered: dict[tuple[str, str], float] = {}
        self._plan: tuple[list[Link], SyncPlan] | None = None
        self._outbox_full_until = 0.0
        self._beat_off_until: dict[str, float] = {}
        #: Peers whose URL leads back to this site's own Redis server, as last measured.
        self._own: set[str] = set()

    def at(self, peer: str) -> str:
        """The key prefix at ``peer``: its own (``?prefix=``), else this site's. Every key
        written or read there goes under it: under ours, a peer with another prefix saw
        no heartbeat and no replica, and took over nothing of a lost site."""
        for p in self.peers:
            if p.name == peer and p.key_prefix is not None:
                return p.key_prefix
        return self.prefix

    # -- links and the plan ------------------------------------------------------------------
    def links(self, refresh: bool = False) -> list[Link]:
        """The links as of at most :func:`link_max_age_s` ago. The pass (``refresh``)
        measures them itself; the enqueue path takes the pass's published choice (one
        local GET), so that every process of the site writes to the peer the pass
        heartbeats and drains, and measures by itself only while no pass publishes
        (bounded: one PEER_TIMEOUT_S per unreachable peer per STRONG_BACKOFF_S)."""
        now = time.monotonic()
        if now - self._links_at < self._max_age_s and (self._measured or not refresh):
            return self._links
        links = None if refresh else self._published()
        if links is None:
            # A peer a strong write just timed out on is not waited on again by a put.
            off = set() if refresh else {n for n, t in self._strong_off_until.items() if t > now}
            links = [Link(p, math.inf, False) if p.name in off else self._measure(p)
                     for p in self.peers]
            if not refresh:  # ...nor one its own PING just timed out on: ~1 s a try, it
                # was tried again every link_max_age_s (10 s), not once per backoff (30)
                for link in links:
                    if not link.alive and link.peer.name not in off:
                        self._strong_off_until[link.peer.name] = now + STRONG_BACKOFF_S
        self._links, self._links_at, self._measured = links, now, refresh
        return self._links

    def _published(self) -> list[Link] | None:
        raw = self.local.get(link_key(self.prefix))
        return None if raw is None else sites.decode_choice(raw, self.peers)

    def _measure(self, peer: sites.Peer) -> Link:
        client = self.clients[peer.name]
        samples = []
        try:
            for _ in range(PINGS):
                began = time.perf_counter()
                client.ping()
                samples.append((time.perf_counter() - began) * 1000)
        except redis.RedisError as exc:
            logger.warning("site %s: peer %s unreachable: %s", self.site, peer.name, exc)
            return Link(peer, peer.rtt_ms if peer.rtt_ms is not None else float("inf"), False)
        if self._own_server(client):
            self._own.add(peer.name)
            # No replica peer, no heartbeat: a producer's strong write went there though
            # the pass refused the peer, the replica of a task done here was never
            # deleted, and the "peer" took it over and ran it again once this site's
            # workers stopped.
            return Link(peer, float("inf"), False)
        self._own.discard(peer.name)
        rtt = peer.rtt_ms if peer.rtt_ms is not None else statistics.median(samples)
        return Link(peer, rtt, True)

    def _own_server(self, client: redis.Redis) -> bool:
        """Whether a peer's URL leads back to this site's own Redis server (same run id;
        said once, as an error, by ``recovery``). A server that forbids INFO, here or
        there, is not told apart."""
        try:
            recovery.check_another_server(client.info("server"),
                                          recovery.epoch(self.local, self.prefix), client)
        except recovery.SamePeer:
            return True
        except redis.RedisError:
            return False
        return False

    def plan(self, refresh: bool = False) -> SyncPlan:
        return self._plan_of(self.links(refresh))

    def _plan_of(self, links: list[Link]) -> SyncPlan:
        if self._plan is None or self._plan[0] is not links:  # once per measurement
            self._plan = (links, sites.plan(self._weights, links,
                                            self.config.site_strong_rtt_ms))
        return self._plan[1]

    # -- hooks on the hot path -----------------------------------------------------------------
    def on_put(self, queue: str, records: Sequence[Sequence[Any]]) -> None:
        """After ``put.lua`` stored ``records`` ([id, payload, meta, score base, class]):
        strong classes to the replica now, the other replicated ones to the outbox."""
        plan = self.plan()
        if plan.link is None:  # no live peer: keep them all; the pass decides when one is
            later = list(records)
            strong = []
        else:
            if self._strong_off_until.get(plan.link.peer.name, 0.0) > time.monotonic():
                plan = sites.without_strong(plan)
            strong = [r for r in records if plan.mode(str(r[4])) is SyncMode.STRONG]
            later = [r for r in records if plan.mode(str(r[4])) in
                     (SyncMode.ASYNC_DIGEST, SyncMode.EVENTUAL)]
        if strong and plan.link is not None:
            peer = plan.link.peer.name
            try:
                self._write_replicas(peer, queue,
                                     [(str(r[0]), r[1], r[2], float(r[3])) for r in strong])
            except redis.RedisError as exc:  # the put stands; the pass writes it
                self._strong_off_until[peer] = time.monotonic() + STRONG_BACKOFF_S
                logger.warning("site %s: strong replica to %s failed, queued; the next "
                               "%.0f s of strong replicas to it are asynchronous: %s",
                               self.site, peer, STRONG_BACKOFF_S, exc)
                later += strong
        if later and time.monotonic() < self._outbox_full_until:
            # By tier, not by the plan's mode: with no live peer every mode is SKIP, and
            # that is when the outbox fills. The bottom tier is never digest-checked.
            later = [r for r in later if self._tiers.get(str(r[4])) is not sites.Tier.P2]
        if later:
            self._queue([json.dumps(["put", queue, str(r[0])]) for r in later])

    def _queue(self, entries: list[str]) -> None:
        length = self.local.rpush(outbox_key(self.prefix), *entries)
        if int(length) > OUTBOX_MAX and time.monotonic() >= self._outbox_full_until:
            self._outbox_full_until = time.monotonic() + OUTBOX_FULL_BACKOFF_S
            logger.warning("site %s: outbox holds %d entries (peer unreachable?); "
                           "eventual-mode replicas and deletes are not queued for %.0f s",
                           self.site, length, OUTBOX_FULL_BACKOFF_S)

    def on_ack(self, queue: str, ids: Iterable[str]) -> None:
        """Acked (done or dead-lettered) tasks: their replicas go with the next pass."""
        entries = [json.dumps(["del", queue, i]) for i in ids]
        # past OUTBOX_MAX not queued: the digest deletes the replicas of tasks gone
        if entries and time.monotonic() >= self._outbox_full_until:
            self._queue(entries)

    # -- the pass ------------------------------------------------------------------------------
    def sync_pass_locked(self, backend: Any = None) -> PassReport | None:
        """:meth:`sync_pass` unless another worker of this site runs one now (two would
        drain the outbox twice); None when it was skipped."""
        lock = self.local.lock(f"{self.prefix}sits:site:sync-lock",
                               timeout=max(30.0, 10 * self.config.site_sync_interval_s))
        if not lock.acquire(blocking=False):
            # Another worker's pass, or one killed midway (its lock lives on until the
            # timeout, which may be past site_dead_after_s): the heartbeats still go, or a
            # live site would be taken over meanwhile. (Idempotent SETs.)
            self._guarded(PassReport(), [x.peer.name for x in self.links() if x.alive],
                          self._heartbeat)
            return None
        try:
            return self.sync_pass(backend)
        finally:
            # A lock that timed out meanwhile has nothing left to free.
            with contextlib.suppress(redis.exceptions.LockError):
                lock.release()

    def sync_pass(self, backend: Any = None) -> PassReport:
        """Honour take-overs, heartbeat, drain the outbox, check digests, hand over the
        replicas other peers hold, take over dead origins' replicas held here.
        ``backend``: this site's result backend, which counts a chord's member taken
        over in its chord here (``takeover.mirror_results``)."""
        links = self.links(refresh=True)
        plan = self._plan_of(links)
        self.local.set(link_key(self.prefix), sites.encode_choice(plan.link),
                       px=int(3 * self._max_age_s * 1000))  # gone with the beat
        report = PassReport(modes={c: m.value for c, m in plan.modes.items()})
        report.errors += [f"{peer}: {recovery.SAME_SERVER}" for peer in sorted(self._own)]
        # Every live peer: any may hold replicas (an earlier replica peer, one a producer
        # chose by an older measurement), and would take them over on hearing nothing.
        live = [x.peer.name for x in links if x.alive]
        self._guarded(report, live, self._heartbeat)
        # Before the drain or the digest: a task a peer took over leaves here, and its
        # replicas, or they would be replicated again.
        self._guarded(report, live, self._drop_taken_over)
        # (the results of what they took over, for the callers waiting here)
        self._guarded(report, live, lambda peer, rep: takeover.mirror_results(
            self, peer, rep, backend))
        # And the tasks this site's Redis lost come back from the replicas (recovery.py)
        # before anything there is deleted: a peer not reached for that does no more.
        current = recovery.epoch(self.local, self.prefix)
        pass_no = recovery.next_pass(self.local, self.prefix)
        confirmed = self._guarded(report, live, lambda peer, rep: self._recover(
            peer, current, pass_no, rep))
        link = plan.link
        if link is not None:
            report.peer, report.rtt_ms = link.peer.name, round(link.rtt_ms, 3)
            if link.peer.name != self._replica_peer:  # a new replica: fill it at once
                self._replica_peer, self._digest_at = link.peer.name, -math.inf
            self._guarded(report, [link.peer.name] if link.peer.name in confirmed else [],
                          lambda peer, rep: self._sync_to(peer, plan, rep))
            self._guarded(report, [p for p in sites.other_live_peers(links, plan)
                                   if p in confirmed],
                          lambda peer, rep: self._hand_over(peer, plan, rep))
        self._take_over(report)
        self.local.set(last_pass_key(self.prefix),
                       json.dumps({**asdict(report), "at": self.clock()}))
        return report

    def _guarded(self, report: PassReport, peers: Sequence[str],
                 step: Callable[[str, PassReport], None]) -> list[str]:
        """``step`` for each of ``peers``; one that fails is reported, the pass goes on.
        Returns the peers it went through for."""
        done = []
        for peer in peers:
            try:
                step(peer, report)
                done.append(peer)
            except redis.RedisError as exc:
                report.errors.append(f"{peer}: {exc}")
        return done

    def _recover(self, peer: str, current: str, pass_no: int, report: PassReport) -> None:
        restored = recovery.restore(self.local, self.clients[peer], self.scripts,
                                    self.prefix, self.site, current, pass_no,
                                    self.config.default_class, peer, self.clock(),
                                    self.config.site_dead_after_s, self.at(peer))
        if restored is not None:
            report.restored += restored
            # (the peer may be new, or back empty: register this site's queues there
            # with the next writes, not up to REGISTER_EVERY_S later)
            self._registered = {k: v for k, v in self._registered.items() if k[0] != peer}

    def heartbeat_peers(self) -> tuple[set[str], set[str]]:
        """Heartbeat each peer (but one that failed within :data:`HEARTBEAT_BACKOFF_S`),
        provided this site's own Redis answers: a site whose Redis is lost must read as
        lost. From a thread of each worker (``workers/sitebeat.py``), so that a site whose
        pool slots are all busy, or whose beat is down, is not taken over while it
        serves. Returns the peers it reached and those it could not."""
        self.local.ping()  # (raises: no heartbeat then)
        now = time.monotonic()
        reached, failed = set(), set()
        for peer in self.peers:
            if self._beat_off_until.get(peer.name, -math.inf) > now:
                continue
            try:
                self._heartbeat(peer.name, PassReport())
                reached.add(peer.name)
            except redis.RedisError:
                self._beat_off_until[peer.name] = now + HEARTBEAT_BACKOFF_S
                failed.add(peer.name)
        return reached, failed

    def _heartbeat(self, peer: str, report: PassReport) -> None:
        # Short-lived: a peer starts counting a few intervals after the last one, so it
        # takes over site_dead_after_s (plus those intervals) after it, not twice that.
        ttl_s = min(self.config.site_dead_after_s, 3 * self.config.site_sync_interval_s)
        self.clients[peer].set(alive_key(self.at(peer), self.site), self.clock(),
                               px=int(ttl_s * 1000))

    def _sync_to(self, peer: str, plan: SyncPlan, report: PassReport) -> None:
        self._drain(peer, plan, report)
        if time.monotonic() - self._digest_at >= DIGEST_EVERY_S:
            self._digest_at = time.monotonic()
            self._repair(peer, plan, report)

    def _drain(self, peer: str, plan: SyncPlan, report: PassReport) -> None:
        """Send the batch an earlier pass left taken, if any, then one new batch. A batch
        stays taken (take_outbox.lua) until the peer has it: a pass that fails or dies
        midway leaves it to the next, which sends it again (writes and deletes are
        idempotent) before anything newer, so nothing is lost or reordered."""
        keys = [outbox_key(self.prefix), taken_key(self.prefix)]
        for _ in range(2):
            taken: list[bytes] = self.scripts.run_on(
                "take_outbox", keys, [DRAIN_BATCH, uuid.uuid4().hex], self.local)
            if not taken:
                return
            kind, token, raw = taken[0], taken[1], taken[2:]
            self._apply(peer, plan, report, raw)
            self.scripts.run_on("done_outbox", keys[1:], [token], self.local)
            if kind == b"new":
                return

    def _apply(self, peer: str, plan: SyncPlan, report: PassReport,
               raw: Sequence[bytes]) -> None:
        # A task's last entry in the batch is what holds: a put then a delete (done
        # meanwhile) deletes; a delete then a put (a dead letter requeued with its id)
        # writes the replica again.
        last: dict[tuple[str, str], str] = {}
        for entry in raw:
            try:
                op, queue, task_id = json.loads(entry)
                if not all(isinstance(x, str) for x in (op, queue, task_id)):
                    raise TypeError("not three strings")  # (a list as a key raised below)
            except (ValueError, TypeError):
                logger.error("site %s: outbox entry not understood, dropped: %.200r",
                             self.site, entry)
                continue
            last[(queue, task_id)] = op
        puts: dict[str, list[str]] = {}
        dels: dict[str, list[str]] = {}
        for (queue, task_id), op in last.items():
            (puts if op == "put" else dels).setdefault(queue, []).append(task_id)
        for queue, ids in puts.items():
            records = [r for r in self._local_records(queue, ids)
                       if plan.mode(sla_class_of(r[2]) or "").replicated]
            report.replicated += self._write_replicas(peer, queue, records)
        for queue, ids in dels.items():
            # A del queued by an ack that then failed for good (the task is still held
            # here, redelivered later) would leave it without a replica: kept, and the
            # digest deletes it once the task is gone after all.
            gone = self._not_held(queue, ids)
            report.deleted += self._delete_replicas(peer, queue, gone)

    def _not_held(self, queue: str, ids: Sequence[str]) -> list[str]:
        """Those of ``ids`` no longer held here (ack and dead-letter drop the meta)."""
        k = QueueKeys.for_queue(queue, self.prefix)
        with self.local.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hexists(k.meta, i)
            held = pipe.execute()
        return [i for i, h in zip(ids, held, strict=True) if not h]

    def _local_records(self, queue: str, ids: Sequence[str]
                       ) -> list[tuple[str, Any, Any, float]]:
        """(id, payload, meta, score) of the ``ids`` still held here (waiting: its score;
        running: the score it was picked with)."""
        if not ids:
            return []
        k = QueueKeys.for_queue(queue, self.prefix)
        with self.local.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hget(k.payloads, i)
                pipe.hget(k.meta, i)
                pipe.zscore(k.waiting, i)
                pipe.hget(k.saved, i)
            raw = pipe.execute()
        out = []
        for n, i in enumerate(ids):
            payload, meta, waiting, saved = raw[4 * n:4 * n + 4]
            score = waiting if waiting is not None else saved
            if payload is not None and meta is not None and score is not None:
                out.append((i, payload, meta, float(score)))
        return out

    def _write_replicas(self, peer: str, queue: str,
                        records: Sequence[tuple[str, Any, Any, float]],
                        register: bool = False) -> int:
        if not records:
            return 0
        z, p, m = replica_keys(self.at(peer), self.site, queue)
        client = self.clients[peer]
        with client.pipeline(transaction=True) as pipe:  # one slot: {origin:queue}
            pipe.zadd(z, {r[0]: r[3] for r in records})
            pipe.hset(p, mapping={r[0]: r[1] for r in records})
            pipe.hset(m, mapping={r[0]: r[2] for r in records})
            pipe.execute()
        now = time.monotonic()
        if register or \
                now - self._registered.get((peer, queue), -REGISTER_EVERY_S) >= REGISTER_EVERY_S:
            # Idempotent; once in a while, not per put (a flushed peer heals within it, and
            # the digest pass rewrites the replicas themselves).
            client.sadd(replica_queues_key(self.at(peer), self.site), queue)
            client.sadd(origins_key(self.at(peer)), self.site)
            self._registered[(peer, queue)] = now
        return len(records)

    def _delete_replicas(self, peer: str, queue: str, ids: Sequence[str]) -> int:
        z, p, m = replica_keys(self.at(peer), self.site, queue)
        with self.clients[peer].pipeline(transaction=True) as pipe:
            pipe.zrem(z, *ids)
            pipe.hdel(p, *ids)
            pipe.hdel(m, *ids)
            removed = pipe.execute()[0]
        return int(removed)

    def _repair(self, peer: str, plan: SyncPlan, report: PassReport) -> None:
        """Per queue: the replica's ids against those held here. Those of digest-checked
        classes held here and missing there are written; replicas of tasks no longer here
        are deleted whatever their class: an eventual one could outlive its task at a
        peer that was replica peer before, missed the ack's delete (sent to the replica
        peer of the time) and is replica peer again, and its take-over would run the
        finished task again.

        The replica is read first: a task put between the two reads is then one held
        here (written again, idempotent), never one gone (its fresh strong replica
        deleted, the task without one until the next digest)."""
        checked = set(plan.classes(SyncMode.ASYNC_DIGEST, SyncMode.STRONG))
        client = self.clients[peer]
        for queue in replicated(self.local.smembers(queues_registry(self.prefix))):
            m = replica_keys(self.at(peer), self.site, queue)[2]
            theirs = {i.decode(): sla_class_of(v) for i, v in client.hscan_iter(
                m, count=SCAN_COUNT)}
            if not theirs and not checked:
                continue  # nothing to delete there, nothing this site must write
            held = self._held(queue)
            mine = {i for i, c in held.items() if c in checked}
            theirs_checked = {i for i, c in theirs.items() if c in checked}
            gone = sorted(set(theirs) - set(held))
            if not gone and sites.digest(mine) == sites.digest(theirs_checked):
                continue
            missing = sorted(mine - theirs_checked)
            # registered whatever the cache says: a peer restarted empty is why they
            # were missing, and without the registration it never takes them over
            report.repaired += self._write_replicas(peer, queue,
                                                    self._local_records(queue, missing),
                                                    register=True)
            if gone:
                report.repaired += self._delete_replicas(peer, queue, gone)
            logger.info("site %s: replica of %r at %s repaired (+%d, -%d)", self.site, queue,
                        peer, len(missing), len(gone))

    def _held(self, queue: str) -> dict[str, str | None]:
        """The ids of the tasks held here (waiting or running), with their classes."""
        k = QueueKeys.for_queue(queue, self.prefix)
        return {text(raw_id):
                sla_class_of(raw_meta)
                for raw_id, raw_meta in self.local.hscan_iter(k.meta, count=SCAN_COUNT)}

    def _hand_over(self, old: str, plan: SyncPlan, report: PassReport) -> None:
        """This site's replicas at ``old``, a live peer that does not keep the replica
        (any more): those of tasks still here go to the replica peer, and all leave
        ``old`` (which would otherwise hold replicas of finished tasks for good, acks'
        deletes going to the replica peer only, and take them over once this site is
        lost). Up to :data:`HANDOVER_BATCH` a pass."""
        assert plan.link is not None
        client = self.clients[old]
        # Its list of this site's queues may lag (a producer registers a queue with a
        # peer once in REGISTER_EVERY_S): this site's own list as well. The lists stay
        # there: a producer's late strong write, until the next hand-over, must remain
        # one that ``old`` would take over.
        queues = sorted(set(registered_queues(client.smembers(replica_queues_key(
            self.at(old), self.site)))) | set(replicated(
                self.local.smembers(queues_registry(self.prefix)))))
        with client.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.zrange(replica_keys(self.at(old), self.site, queue)[0], 0,
                            HANDOVER_BATCH - 1)
            held = dict(zip(queues, pipe.execute(), strict=True))
        budget = HANDOVER_BATCH
        for queue, raw_ids in held.items():
            ids = [i.decode() for i in raw_ids][:budget]
            if not ids:
                continue
            records = [r for r in self._local_records(queue, ids)
                       if plan.mode(sla_class_of(r[2]) or "").replicated]
            self._write_replicas(plan.link.peer.name, queue, records)  # first: never lost
            report.handed_over += self._delete_replicas(old, queue, ids)
            budget -= len(ids)
            if budget <= 0:
                return

    # -- take-overs (takeover.py) -------------------------------------------------------------
    def _take_over(self, report: PassReport) -> None:
        takeover.take_over(self, report)

    def _drop_taken_over(self, peer: str, report: PassReport) -> None:
        takeover.drop_taken_over(self, peer, report)


_syncs: dict[tuple[str, str, str, str], SiteSync] = {}


def has_peers(config: SitsConfig) -> bool:
    """Whether ``config`` is a site with peers to sync with (else a single site: no
    outbox, nothing to heartbeat)."""
    return bool(config.site and config.site_peers.split())


def for_config(config: SitsConfig) -> SiteSync | None:
    """The process's :class:`SiteSync` for ``config``; None for a single site."""
    if not has_peers(config):
        return None  # no peer: nothing would ever drain an outbox
    key = (config.site, config.site_peers, config.redis_url, config.global_keyprefix)
    sync = _syncs.get(key)
    if sync is None:
        sync = _syncs[key] = SiteSync(config)
    return sync
