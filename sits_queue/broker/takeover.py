"""Take-overs between sites (``sites.py``'s pass): a peer that has itself heard nothing
from an origin for ``site_dead_after_s`` puts the origin's replicas into its own queues
and records their ids; the origin, back, dead-letters its copies of them.

Both sides go in chunks: one ``put.lua`` of a whole replica held the peer's Redis for
most of a second at 100k tasks, and a round trip per task to settle a take-over is
minutes over a WAN link (past the pass lock, so passes overlapped).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import redis
from celery import states
from celery.app.task import Context

from sits_queue.broker import deadletters, recovery, results
from sits_queue.broker.keys import (
    QueueKeys,
    alive_key,
    mirror_chords_key,
    mirror_key,
    missing_since_key,
    origins_key,
    queues_registry,
    replica_keys,
    replica_queues_key,
    site_local,
    takenover_key,
)
from sits_queue.checks import stored_number, text

if TYPE_CHECKING:
    from sits_queue.broker.sites import PassReport, SiteSync

logger = logging.getLogger(__name__)

#: How long a take-over record is kept for its origin to read, s.
TAKEOVER_TTL_S = 7 * 86400
#: Take-over records read and settled per round trip.
TAKEOVER_CHUNK = 1000
#: Replicas one put.lua call takes over.
PROMOTE_CHUNK = 5000


def take_over(sync: SiteSync, report: PassReport) -> None:
    """Replicas held here of origins whose heartbeat here expired: into this site's
    own queues, their ids recorded for the origin."""
    for raw in sync.local.smembers(origins_key(sync.prefix)):
        origin = text(raw)
        if origin == sync.site or not silent(sync, origin):
            continue
        for qraw in sync.local.smembers(replica_queues_key(sync.prefix, origin)):
            queue = text(qraw)
            if site_local(queue):
                # (an older digest replicated them: the origin's maintenance and its
                # workers' own queues, which no worker here serves)
                sync.local.delete(*replica_keys(sync.prefix, origin, queue))
                continue
            report.taken_over += promote(sync, origin, queue)
        sync.local.delete(replica_queues_key(sync.prefix, origin),
                          missing_since_key(sync.prefix, origin))
        sync.local.srem(origins_key(sync.prefix), origin)
        logger.warning("site %s: site %s missed its heartbeats for %.0f s; took over "
                       "its replicated tasks", sync.site, origin,
                       sync.config.site_dead_after_s)


def silent(sync: SiteSync, origin: str) -> bool:
    """True once this site has itself seen no heartbeat from ``origin`` for
    ``site_dead_after_s``: an expired heartbeat alone is not enough (this site may
    just have come back from its own outage, before the origin's next pass)."""
    since_key = missing_since_key(sync.prefix, origin)
    if sync.local.exists(alive_key(sync.prefix, origin)):
        sync.local.delete(since_key)
        return False
    # This Redis's clock: the pass runs on any of this site's hosts. The count expires
    # unless renewed: a gap in this site's own watching (its outage) starts it again.
    sec, usec = sync.local.time()
    now = sec + usec / 1e6
    ttl_ms = int(sync.config.site_dead_after_s * 1000)
    sync.local.set(since_key, now, nx=True, px=ttl_ms)
    since = stored_number(sync.local.get(since_key))
    if since is None:  # not ours to read: counting starts again (NaN never ended it)
        since = now
        sync.local.set(since_key, now, px=ttl_ms)
    sync.local.pexpire(since_key, ttl_ms)
    return now - since >= sync.config.site_dead_after_s


def promote(sync: SiteSync, origin: str, queue: str) -> int:
    """In chunks: one put.lua of a whole replica blocks this Redis for seconds. A
    chunk leaves the replica once it is in the queue: a pass that dies midway leaves
    the rest to the next."""
    z, p, m = replica_keys(sync.prefix, origin, queue)
    marker = takenover_key(sync.prefix, origin)
    total = 0
    while entries := recovery.replicas(sync.local, sync.prefix, origin, queue,
                                       PROMOTE_CHUNK):
        ids = [e[0] for e in entries]
        args = recovery.put_back_args(entries, sync.config.default_class)
        if args:
            sync.scripts.run("put", QueueKeys.for_queue(queue, sync.prefix), args,
                             sync.local)
            sync.local.sadd(queues_registry(sync.prefix), queue)
        # (with the task's id: an origin back without its data has no copy to read it
        # from, and its callers wait for the result all the same)
        sync.local.sadd(marker, *(json.dumps([queue, e[0], t] if (t := _task_id(e[2]))
                                             else [queue, e[0]]) for e in entries))
        sync.local.expire(marker, TAKEOVER_TTL_S)
        with sync.local.pipeline(transaction=True) as pipe:
            pipe.zrem(z, *ids)
            pipe.hdel(p, *ids)
            pipe.hdel(m, *ids)
            pipe.execute()
        total += len(args) // 5
    sync.local.unlink(z, p, m)
    return total


def drop_taken_over(sync: SiteSync, peer: str, report: PassReport) -> None:
    """This site's tasks a peer took over while this site was unreachable: the copies
    still waiting here go to the dead letters (they run at the peer). A copy picked
    here keeps its record until it is acked or back in the waiting set (a worker
    that died, a requeue), which a later pass then dead-letters. In chunks: a
    round trip per id is minutes over a WAN."""
    client = sync.clients[peer]
    marker = takenover_key(sync.at(peer), sync.site)
    now = sync.clock()
    entries = list(client.sscan_iter(marker, count=TAKEOVER_CHUNK))
    for at in range(0, len(entries), TAKEOVER_CHUNK):
        by_queue: dict[str, list[tuple[bytes, str, str | None]]] = {}
        settled: list[bytes] = []
        for raw in entries[at:at + TAKEOVER_CHUNK]:
            entry = _entry(raw)
            if entry is None:  # not ours to read: left, it failed every pass after it
                logger.error("site %s: taken-over entry at %s not understood, dropped: "
                             "%.200r", sync.site, peer, raw)
                settled.append(raw)
                continue
            by_queue.setdefault(entry[0], []).append((raw, entry[1], entry[2]))
        for queue, items in by_queue.items():
            k = QueueKeys.for_queue(queue, sync.prefix)
            with sync.local.pipeline(transaction=False) as pipe:
                for _, message_id, _ in items:
                    pipe.zscore(k.waiting, message_id)
                    pipe.zscore(k.unacked, message_id)
                    pipe.hget(k.payloads, message_id)
                found = pipe.execute()
            waiting = [i for n, (_, i, _) in enumerate(items) if found[3 * n] is not None]
            if waiting:
                report.dropped += int(sync.scripts.run("dead", k, [
                    now, f"taken over by site {peer} while site {sync.site} was "
                         "unreachable; it runs there", *waiting], sync.local))
                # A replica of it anywhere would be taken over again: it runs at peer.
                sync.on_ack(queue, waiting)
            # (a chord's member dropped here: its result, copied home, counts in the
            # chord here, whose count and body are here; one picked here counts itself.
            # Written before the entries below: a pass that reads those finds it.)
            members: dict[Any, Any] = {}
            for n, (_, _, named) in enumerate(items):
                if found[3 * n] is not None and (payload := found[3 * n + 2]):
                    members.update(_chord_records(named or _task_id(payload), payload))
            if members:
                chords = mirror_chords_key(sync.prefix, sync.site)
                sync.local.hset(chords, mapping=members)
                sync.local.expire(chords, TAKEOVER_TTL_S)
            # Its callers wait here: the result of a copy dropped here, or not here at all
            # (this site's Redis lost it), is copied from the peer's backend. (A copy
            # acked here ran here too: its SUCCESS here is never overwritten.)
            mirrored = {json.dumps([peer, t]) for n, (_, _, named) in enumerate(items)
                        if found[3 * n + 1] is None
                        and (t := named or _task_id(found[3 * n + 2])) is not None}
            if mirrored:
                mirror = mirror_key(sync.prefix, sync.site)
                sync.local.sadd(mirror, *mirrored)
                sync.local.expire(mirror, TAKEOVER_TTL_S)
            settled += [raw for n, (raw, _, _) in enumerate(items)
                        if found[3 * n] is not None or found[3 * n + 1] is None]
        if settled:
            client.srem(marker, *settled)


def mirror_results(sync: SiteSync, peer: str, report: PassReport,
                   backend: Any = None) -> None:
    """The results, at ``peer``'s backend, of this site's tasks it took over (recorded
    by :func:`drop_taken_over`), stored in this site's backend once they are ready
    there (a state of Celery's ``READY_STATES``), with the time to live they have there:
    a caller's ``get()`` here waited for ever on the copy dead-lettered here. One that
    is not ready yet is looked for again at the next pass, for up to
    :data:`TAKEOVER_TTL_S` (a task that stores no result, ``ignore_result``, is no more
    looked for once the record expires). Results of the backend a peer's URL leads to,
    under its key prefix: a peer with a result backend elsewhere is not read.

    A chord's member counts in its chord here, through ``backend`` (this site's app's:
    the pass the beat schedules has it), as the worker that ran it would have counted
    it: the chord's count and body are here, and the peer's worker counted it at the
    peer's backend, which knows no such chord. A pass without a backend leaves such a
    result to be copied and counted by one that has (:func:`_count_in_chords`)."""
    mirror = mirror_key(sync.prefix, sync.site)
    wanted: list[tuple[bytes, str]] = []
    known: set[str] = set()
    for raw in sync.local.sscan_iter(mirror, count=TAKEOVER_CHUNK):
        entry = _entry(raw)
        if entry is None:
            sync.local.srem(mirror, raw)  # (not ours to read)
        elif entry[0] == peer and entry[2] is None:
            wanted.append((raw, entry[1]))
            known.add(entry[1])
    client, prefix = sync.clients[peer], sync.at(peer)
    followed = 0
    while wanted:
        chunk, wanted = wanted[:TAKEOVER_CHUNK], wanted[TAKEOVER_CHUNK:]
        with client.pipeline(transaction=False) as pipe:
            for _, task_id in chunk:
                pipe.get(f"{prefix}{results.RESULT_KEY}{task_id}")
                pipe.pttl(f"{prefix}{results.RESULT_KEY}{task_id}")
            found = pipe.execute()
        ready: list[tuple[bytes, str, bytes]] = []
        for n, (raw, task_id) in enumerate(chunk):
            value, ttl_ms = found[2 * n], found[2 * n + 1]
            if value is None or _state(value) not in states.READY_STATES:
                continue
            if results.store_encoded(
                    sync.local, f"{sync.prefix}{results.RESULT_KEY}{task_id}", value,
                    int(ttl_ms) if isinstance(ttl_ms, int) and ttl_ms > 0 else 0):
                report.results_mirrored += 1
            ready.append((raw, task_id, value))
        # What those tasks sent on at the peer (a chain's next step, callbacks: their
        # result's children) ran there too, their results there alone: copied home
        # alike, in this pass as they are found ready (a chain's caller here waits on
        # its last step).
        children: list[tuple[bytes, str]] = []
        for _, _, value in ready:
            for child in _children_ids(value):
                if child not in known and followed + len(children) < MOST_FOLLOWED:
                    known.add(child)
                    children.append((json.dumps([peer, child]).encode(), child))
        if children:
            followed += len(children)
            sync.local.sadd(mirror, *(entry for entry, _ in children))
            sync.local.expire(mirror, TAKEOVER_TTL_S)
            wanted += children
        kept = _count_in_chords(sync, backend, ready, report)
        if done := [raw for raw, _, _ in ready if raw not in kept]:
            sync.local.srem(mirror, *done)


#: Tasks sent on at a peer that one pass adds to those whose results come home.
MOST_FOLLOWED = 10_000


def _children_ids(value: bytes | str) -> list[str]:
    """The ids of the tasks a stored result says its task sent on (Celery's
    ``children``: a chain's next step, callbacks; a group's members, a group having no
    result of its own); none for a result not in JSON."""
    try:
        meta = json.loads(value)
    except (ValueError, TypeError):
        return []
    todo = list(meta.get("children") or []) if isinstance(meta, dict) else []
    ids: list[str] = []
    while todo and len(ids) < MOST_FOLLOWED:
        item = todo.pop()
        if not (isinstance(item, list) and len(item) == 2):
            continue
        head, members = item
        if isinstance(members, list):
            todo.extend(members)
        elif isinstance(head, list) and head and isinstance(head[0], str) and head[0]:
            ids.append(head[0])
    return ids


def _count_in_chords(sync: SiteSync, backend: Any, ready: list[tuple[bytes, str, bytes]],
                     report: PassReport) -> set[bytes]:
    """Count each of ``ready`` (mirror entry, task id, result meta as stored) that is a
    chord's member dropped here in its chord (Celery's ``on_chord_part_return``: the
    last one sends the body, or fails it). Returns the mirror entries to keep for a
    later pass: all such members without a ``backend``, and one whose count failed on
    Redis. (Counted twice, a member is counted once: Celery's chord script keeps each
    task id and index once.)"""
    chords = mirror_chords_key(sync.prefix, sync.site)
    payloads = sync.local.hmget(chords, [task_id for _, task_id, _ in ready]) if ready else []
    members = [(raw, task_id, value, payload) for (raw, task_id, value), payload
               in zip(ready, payloads, strict=True) if payload is not None]
    if backend is None or not members:
        return {raw for raw, _, _, _ in members}
    accept = deadletters.accepted(backend)
    kept: set[bytes] = set()
    settled: list[str] = []
    for raw, task_id, value, payload in members:
        request = _chord_request(payload, accept)
        if request is None:
            logger.error("site %s: task %s, taken over, not counted in its chord: its "
                         "message does not decode here", sync.site, task_id)
        elif getattr(request, "chord", None):
            try:
                meta = backend.decode_result(value)
                backend.on_chord_part_return(request, meta["status"], meta["result"])
            except redis.RedisError as exc:
                logger.warning("site %s: task %s, taken over, counted in its chord at a "
                               "later pass: %r", sync.site, task_id, exc)
                kept.add(raw)
                continue
            except Exception as exc:  # (a result or chord Celery cannot read)
                logger.error("site %s: task %s, taken over, not counted in its chord: %r",
                             sync.site, task_id, exc)
            else:
                report.chord_parts += 1
        settled.append(task_id)
    if settled:
        sync.local.hdel(chords, *settled)
    return kept


def _chord_request(stored: bytes | str, accept: list[str]) -> Context | None:
    """A chord member's request as kept here: its message, or, for a chain's step sent
    on at the peer, the request its chain named (:func:`_chord_records`)."""
    try:
        parsed = json.loads(stored)
    except (ValueError, TypeError):
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("request"), dict):
        return Context(parsed["request"])
    return deadletters.request_of_payload(stored, accept)


def _chord_records(task_id: str | None, payload: bytes | str) -> dict[str, Any]:
    """What to keep of a message dropped here for counting in chords (task id -> record,
    :func:`_chord_request` reads it back), its body decoded once, with JSON alone: the
    message itself, for a chord's member (a group's, whose request names a chord; or
    one whose body is not JSON, decoded at the count with the app's serializers); and
    the request, as its chain names it, of each later chain step that ends a chord's
    header member (the last step of a chain in a chord's header: Celery gives it the
    chord and its group, and it is sent on at the peer)."""
    try:
        grouped = bool(json.loads(payload)["headers"].get("group"))
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}  # (no message of kombu's: nothing in it to count)
    request = deadletters.request_of_payload(payload, deadletters.accepted(None))
    found: dict[str, Any] = {}
    if task_id is not None and grouped and (request is None
                                            or getattr(request, "chord", None)):
        found[task_id] = payload
    steps = getattr(request, "chain", None) if request is not None else None
    for sig in steps if isinstance(steps, list) else ():
        options = sig.get("options") if isinstance(sig, dict) else None
        if not isinstance(options, dict) or not options.get("chord"):
            continue
        step, group = options.get("task_id"), options.get("group_id")
        if isinstance(step, str) and step and isinstance(group, str) and group:
            found[step] = json.dumps({"request": {
                "id": step, "group": group, "group_index": options.get("group_index"),
                "chord": options["chord"]}})
    return found


def _task_id(payload: bytes | str | None) -> str | None:
    """A message's Celery task id (its ``headers.id``); None where it has none."""
    try:
        task_id = json.loads(payload or b"")["headers"]["id"]
    except (ValueError, TypeError, KeyError):
        return None
    return task_id if isinstance(task_id, str) and task_id else None


def _state(value: bytes | str) -> str | None:
    """A stored result meta's ``status``; None where it is no meta of Celery's."""
    try:
        meta = json.loads(value)
    except (ValueError, TypeError):
        return None
    status = meta.get("status") if isinstance(meta, dict) else None
    return status if isinstance(status, str) else None


def _entry(raw: bytes | str) -> tuple[str, str, str | None] | None:
    """A taken-over marker's ``[queue, message id, task id]`` (an earlier release's has
    no task id: None), or a mirror record's ``[peer, task id]`` (None third); None for
    anything else."""
    try:
        entry = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if isinstance(entry, list) and len(entry) in (2, 3) and all(
            isinstance(x, str) and x for x in entry):
        return entry[0], entry[1], entry[2] if len(entry) == 3 else None
    return None
