"""An origin site whose Redis lost data takes its replicated tasks back from its peers.

A site's replicas at a peer are the copies of its tasks kept for the day the site is
lost (``sites.py``). But a site whose Redis restarts empty, or from a snapshot older
than its last writes, or fails over to a replica that had not caught up, is not lost:
its pass carries on within ``site_dead_after_s``, so no peer takes its replicas over,
and its digest found them to be of tasks it no longer holds and deleted them. The
tasks the restart lost went with them.

So each pass tells every live peer which server it writes from (:func:`epoch`: the
local Redis's ``run_id``, new on every start and every failover), recorded at the peer
next to the replicas, with the number of the pass. A peer whose record names another
server of this site holds replicas written before this site's Redis restarted. If,
besides, the record was written at or after this site's last pass as this site counts
them now (a count kept in its own Redis: it goes back with the data), the data went
back, and the pass puts back into this site's queues,
with their priorities, the replicated tasks this site no longer holds and has no
delete queued for in its outbox (a task finished before the restart), once a pass
``site_dead_after_s`` later has found the record, which it rewrote, still its own (a
second deployment under this site's name rewrites it meanwhile: :func:`restore`); only
then may the digest and hand-over delete anything there. A
record of an earlier pass is the peer's own data gone back (restarted from an older
snapshot: its replicas include tasks finished since, no loss of this site's): nothing
is put back.

At least once, never lost: a task finished just before a restart that also lost its
outbox entry runs again; so does one finished after the restart whose replica sat at a
peer that was unreachable then (its delete went to the replica peer of the time), once
that peer is back; so would one put after the restart and acked in the moment
between :func:`restore`'s read of this site's ids and its put; and one finished in the
pass before a peer's snapshot that the peer restarts from while this site restarts too.
A task running when the data was lost is put back while it runs (its unacked record
went with the data), and runs again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from sits_queue.broker.keys import (
    SEQ_SPAN,
    QueueKeys,
    epoch_key,
    held_restore_key,
    outbox_key,
    queues_registry,
    registered_queues,
    replica_keys,
    replica_queues_key,
    replicated,
    shared_name_key,
    taken_key,
)
from sits_queue.broker.meta import sla_class_of
from sits_queue.broker.scripts import Scripts
from sits_queue.checks import text

logger = logging.getLogger(__name__)

#: This site's count of its sync passes (:func:`next_pass`), in its own Redis.
PASS_COUNT = "sits:site:passes"
#: The local key of this site's own epoch where INFO is not allowed (a managed Redis
#: that renames or forbids it): set once, it changes only when the data is lost.
FALLBACK_EPOCH = "sits:site:epoch"
#: Replicas read, or put back, per Redis call: one put.lua of a whole queue's replicas
#: held Redis for ~0.9 s at 100k tasks (as a take-over's did: takeover.PROMOTE_CHUNK).
RESTORE_CHUNK = 5000
#: How long, in confirmation times (``site_dead_after_s``), a peer stays refused after
#: another server was last seen writing there under this site's name.
SHARED_HOLD_PASSES = 10


def epoch(local: redis.Redis, prefix: str) -> str:
    """Which server, and which of its starts, this site's queues live on now."""
    with contextlib.suppress(redis.exceptions.ResponseError):
        run_id = local.info("server").get("run_id")
        if run_id:
            return str(run_id)
    key = f"{prefix}{FALLBACK_EPOCH}"
    local.set(key, f"key:{uuid.uuid4().hex}", nx=True)
    return text(local.get(key) or b"")


def pending_deletes(local: redis.Redis, prefix: str) -> set[tuple[str, str]]:
    """(queue, id) of the replica deletes still queued here (the outbox and the batch a
    pass is sending): tasks done, whose replicas are no work to take back."""
    out: set[tuple[str, str]] = set()
    for raw in [*local.lrange(outbox_key(prefix), 0, -1),
                *local.lrange(taken_key(prefix), 1, -1)]:  # the taken list's token first
        with contextlib.suppress(ValueError, TypeError):
            op, queue, task_id = json.loads(raw)
            if op == "del":
                out.add((str(queue), str(task_id)))
    return out


def put_back_args(entries: Iterable[tuple[str, float, Any, Any]], default_class: str
                  ) -> list[Any]:
    """``put.lua`` arguments for replicas (id, score, payload, meta): each keeps its
    priority level and gets a new arrival number; a replica missing its payload or
    metadata is skipped."""
    args: list[Any] = []
    for task_id, score, payload, meta in entries:
        if payload is None or meta is None:
            continue
        base = int(score) - int(score) % SEQ_SPAN
        args += [task_id, payload, meta, base, sla_class_of(meta) or default_class]
    return args


def replicas(client: redis.Redis, prefix: str, origin: str, queue: str,
             most: int | None = None) -> list[tuple[str, float, Any, Any]]:
    """The replicas ``client`` holds of ``origin``'s ``queue``: (id, score, payload, meta);
    the first ``most`` of them in score order (None: all)."""
    z, p, m = replica_keys(prefix, origin, queue)
    entries: list[Any] = list(client.zrange(z, 0, -1 if most is None else most - 1,
                                            withscores=True))
    if not entries:
        return []
    ids = [text(e[0]) for e in entries]
    payloads: list[Any] = []
    metas: list[Any] = []
    for at in range(0, len(ids), RESTORE_CHUNK):  # (one HMGET of 100k ids holds Redis)
        payloads += client.hmget(p, ids[at:at + RESTORE_CHUNK])
        metas += client.hmget(m, ids[at:at + RESTORE_CHUNK])
    return list(zip(ids, (float(e[1]) for e in entries), payloads, metas, strict=True))


def _put_back(local: redis.Redis, peer: redis.Redis, scripts: Scripts, prefix: str,
              site: str, queue: str, done: set[tuple[str, str]], default_class: str,
              at_peer: str) -> int:
    """Put back into this site's ``queue`` the replicas at ``peer`` (its keys under
    ``at_peer``) of tasks it no longer holds and did not finish (``done``), a chunk per
    call; how many."""
    entries = [e for e in replicas(peer, at_peer, site, queue) if (queue, e[0]) not in done]
    k = QueueKeys.for_queue(queue, prefix)
    restored = 0
    for at in range(0, len(entries), RESTORE_CHUNK):
        chunk = entries[at:at + RESTORE_CHUNK]
        held = local.hmget(k.meta, [e[0] for e in chunk])
        args = put_back_args((e for e, h in zip(chunk, held, strict=True) if h is None),
                             default_class)
        if args:
            scripts.run("put", k, args, local)
            restored += len(args) // 5
    if restored:
        local.sadd(queues_registry(prefix), queue)
    return restored


def next_pass(local: redis.Redis, prefix: str) -> int:
    """Count this site's sync passes in its own Redis: the count goes back when its data
    does (an empty restart, a failover to a replica that had not caught up)."""
    return int(local.incr(f"{prefix}{PASS_COUNT}"))


def _not_before(recorded_pass: str, last_pass: int) -> bool:
    """Whether a peer's record was written at or after this site's last pass as this
    site counts them now: its data went back (True), rather than the peer's (a peer
    back from an older snapshot holds a record of an earlier pass, and replicas of tasks
    finished since, which are no loss of this site's). A record of an older version,
    with no count, is trusted as before."""
    try:
        return int(recorded_pass) >= last_pass
    except ValueError:
        return True


_said_same: set[str] = set()


#: What a peer URL leading back to this site's own Redis server is told.
SAME_SERVER = ("is this site's own Redis server (same run_id): nothing is replicated there; "
               "point site_peers at the peer's own server")


class SamePeer(redis.RedisError):
    """A peer URL that names this site's own Redis server."""


def check_another_server(server: Any, current: str, peer: redis.Redis) -> None:
    """Raises :class:`SamePeer` when ``server`` (the peer's ``INFO server`` reply) is this
    site's own server (``current``, its run id): a peer URL pointing back here, under
    another name, took the replicas into this site's own Redis and nothing said so. (A
    peer that forbids INFO, whose reply is an error, is not told apart.) The pass reports
    the peer as failed and syncs nothing there."""
    if isinstance(server, redis.exceptions.ResponseError):
        return
    if isinstance(server, Exception):
        raise server
    theirs = server.get("run_id")
    if theirs and str(theirs) == current:
        said = SAME_SERVER
        if current not in _said_same:  # (once a process: the pass says it each second)
            _said_same.add(current)
            logger.error("site peer %s %s", peer.get_connection_kwargs().get("host"), said)
        raise SamePeer(said)


class RestoreHeld(redis.RedisError):
    """This site's Redis changed since its last pass: what it lost comes back from the
    peer once the peer's record has stayed this site's for the confirmation time (see
    :func:`restore`); until then nothing is drained to, digested at or handed over from
    that peer (its replicas are what comes back)."""


class SiteNameShared(redis.RedisError):
    """Another server writes the peer's record of this site: a second deployment under
    this site's name (or a split brain of its Redis)."""


_said_shared: set[tuple[str, str]] = set()


def restore(local: redis.Redis, peer: redis.Redis, scripts: Scripts, prefix: str, site: str,
            current: str, pass_no: int, default_class: str, peer_name: str = "",
            now_s: float = 0.0, confirm_s: float = 0.0, peer_prefix: str | None = None
            ) -> int | None:
    """When ``peer`` holds replicas written before this site's server changed to
    ``current`` and this site's data went back: put back the tasks they are of that this
    site lost. Records ``current`` and this pass (``pass_no``, :func:`next_pass`) there.
    Returns how many were put back; None when the peer's record named ``current``
    already (nothing to check).

    Not at once: a second deployment under this site's name (its passes record its own
    server there) looks, at first sight, like this site's Redis having restarted, and
    putting back its replicas would run its tasks here too. So the first sight of another
    server's record is kept in this site's Redis with the time (``now_s``), and raises
    :class:`RestoreHeld`; the put-back comes with the first pass at least ``confirm_s``
    (``site_dead_after_s``) later that finds the record still this site's. A pass that
    finds that other server's record again, of a later pass of its own, raises
    :class:`SiteNameShared`, then and until :data:`SHARED_HOLD_PASSES` confirmation
    times after the last sight, and nothing is put back. (A record of an earlier pass
    is the peer's data gone back, not a second writer: nothing is put back from it.)
    ``peer_prefix``: the peer's key prefix, where it is not ``prefix``."""
    at_peer = prefix if peer_prefix is None else peer_prefix
    key = epoch_key(at_peer, site)
    # One round trip a pass for the check and the record, not one each
    with peer.pipeline(transaction=False) as pipe:
        pipe.info("server")
        pipe.get(key)
        server, recorded = pipe.execute(raise_on_error=False)
    check_another_server(server, current, peer)
    if isinstance(recorded, Exception):
        raise recorded
    was, _, at = text(recorded or b"").partition(" ")
    foreign = recorded is not None and was != current
    held_key, shared_key = held_restore_key(prefix, peer_name), shared_name_key(prefix, peer_name)
    with local.pipeline(transaction=False) as pipe:
        pipe.get(held_key)
        pipe.get(shared_key)
        raw_held, shared = pipe.execute()
    held = _Held.read(raw_held, current)
    again = held is not None and was == held.seen and _count(at) > held.seen_pass
    if foreign and (again or shared is not None):
        # its server wrote here again, after this site did (or still does, since)
        shared = was.encode()
        local.set(shared_key, was, px=max(1, int(SHARED_HOLD_PASSES * confirm_s * 1000)))
    peer.set(key, f"{current} {pass_no}")  # (also where the other writer is: it sees us)
    if shared is not None:
        local.delete(held_key)
        said = (f"another Redis server ({text(shared)}) writes here as site {site!r} too: "
                "two deployments must not share a site name; nothing is put back from, "
                "drained to or digested at this peer while it does")
        if (site, peer_name) not in _said_shared:
            _said_shared.add((site, peer_name))
            logger.error("site %s, peer %s: %s", site, peer_name, said)
        raise SiteNameShared(said)
    if foreign:
        if not _not_before(at, pass_no - 1):  # the peer's data went back: nothing to take
            local.delete(held_key)
            return 0
        if held is None or was != held.seen:
            local.set(held_key, json.dumps({"current": current, "since": now_s, "seen": was,
                                            "seen_pass": _count(at)}))
            raise RestoreHeld(f"its Redis changed (restarted or failed over) since its last "
                              f"pass: what it lost comes back from here after {confirm_s:g} "
                              "s in which no other server writes here under its name")
    if held is None:
        return 0 if recorded is None else None
    if now_s - held.since < confirm_s:
        raise RestoreHeld(f"its Redis changed since its last pass: what it lost comes back "
                          f"from here in {confirm_s - (now_s - held.since):.0f} s")
    restored = 0
    done = pending_deletes(local, prefix)
    # (the peer's list may lag a first write by REGISTER_EVERY_S: this site's too)
    queues = set(registered_queues(peer.smembers(replica_queues_key(at_peer, site)))) | \
        set(replicated(local.smembers(queues_registry(prefix))))
    for queue in sorted(queues):
        restored += _put_back(local, peer, scripts, prefix, site, queue, done, default_class,
                              at_peer)
    local.delete(held_key)
    logger.warning("site %s: its Redis changed (restarted or failed over) since its last "
                   "pass; put back %d replicated tasks it had lost", site, restored)
    return restored


def _count(recorded_pass: str) -> int:
    """A record's pass number (-1: none, an older version's record)."""
    try:
        return int(recorded_pass)
    except ValueError:
        return -1


@dataclass(frozen=True)
class _Held:
    """A put-back waiting to be confirmed: since when, and the other server's record
    that started it (its server, and the pass number it wrote)."""

    since: float
    seen: str
    seen_pass: int

    @classmethod
    def read(cls, raw: Any, current: str) -> _Held | None:
        """The hold, if it is the current server's (one kept by an earlier server of this
        site, restarted again since, is void: the record read decides afresh)."""
        try:
            record = json.loads(raw) if raw is not None else None
            if not isinstance(record, dict) or record.get("current") != current:
                return None
            return cls(float(record["since"]), str(record["seen"]), int(record["seen_pass"]))
        except (ValueError, TypeError, KeyError):  # not a record this module wrote
            return None
