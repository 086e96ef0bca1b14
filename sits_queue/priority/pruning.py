"""What the rescoring pass takes out of Redis that nothing else would: queues and kombu
bindings that only ever accumulate, one set per worker ever started or per queue name
ever used.

* **Departed workers' direct queues** (``<hostname>.dq2``, one per worker ever started:
  with containers, per deploy), once nothing is left in them (dead letters included),
  with their binding to Celery's ``C.dq2`` exchange; ``sitsq status``, the metrics and
  the pass would list them for ever, and every publish to the exchange reads its
  bindings. A put to one, or a consumer of it, registers it again.
* **Control reply queues** an older version listed (their keys are left to expire).
* **Idle queues**: a queue no live worker consumes (while some worker is live), that
  holds nothing (waiting, held,
  dead-lettered or checkpointed) and had no put for ``idle_queue_forget_s`` (1 day), with
  its counters. A queue per job, per tenant or per experiment left four keys and a
  registry entry for good, each walked by every pass (``sitsq status`` listed them all).
  kombu's own bindings of it stay: a producer that declared it once does not declare it
  again, and routes by them. A put registers it again; a worker consuming it keeps it.
* **Departed workers' remote-control and event bindings**: a worker killed (SIGKILL, an
  OOM kill) leaves its ``<hostname>.celery.pidbox`` member in the ``celery.pidbox``
  exchange's bindings and its gossip queue's in ``celeryev``'s (a clean stop removes
  them), kept by kombu while any consumer refreshes the table: one pair per crash, for
  good. Each worker records its event queues' names with its hostname and process
  (:func:`record_event_queues`); those of a process gone (its worker no longer
  advertised, or advertised by another process) are removed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import redis
from celery.utils.nodenames import WORKER_DIRECT_EXCHANGE

from sits_queue.broker import clock
from sits_queue.broker.keys import (
    BINDING_SEP,
    CONTROL_QUEUE,
    DIRECT_QUEUE_SUFFIX,
    REPLY_QUEUE_EXPIRES_MS,
    QueueKeys,
    is_reply_queue,
    queues_registry,
)
from sits_queue.broker.scripts import Scripts
from sits_queue.checks import text
from sits_queue.config import SitsConfig

logger = logging.getLogger(__name__)

#: Celery's remote-control exchange (``control_exchange`` + ``.pidbox``) and event
#: exchange (``event_exchange``), as Celery names them by default.
PIDBOX_EXCHANGE = "celery.pidbox"
EVENT_EXCHANGE = "celeryev"
PIDBOX_SUFFIX = ".celery.pidbox"


def puts_seen_key(prefix: str = "") -> str:
    """HASH: an unconsumed queue's put counter as the pruning passes last saw it change,
    and when (Redis's clock): ``<count>@<s>``."""
    return f"{prefix}sits:state:puts-seen"


def event_queues_key(prefix: str = "") -> str:
    """HASH: a worker's event (gossip) queue name -> its process, ``"<pid> <hostname>"``
    (:func:`record_event_queues`)."""
    return f"{prefix}sits:event-queues"


def record_event_queues(client: redis.Redis, prefix: str, hostname: str, pid: int,
                        names: Iterable[str]) -> None:
    """Say which event queues are the worker ``hostname``'s process ``pid``'s (its gossip
    receiver's, made afresh at each consumer start), for :func:`prune` to unbind them
    once that process is gone: the worker no longer advertised, or advertised by
    another process (restarted under its name, as systemd or Kubernetes do: by hostname
    alone, a crashed one's binding stayed for good)."""
    mapping: dict[Any, Any] = dict.fromkeys(names, f"{pid} {hostname}")
    if mapping:
        client.hset(event_queues_key(prefix), mapping=mapping)


def prune(client: redis.Redis, config: SitsConfig, scripts: Scripts, queues: Sequence[str],
          hosts: set[str], live: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """Take out what only accumulates (the module's text); ``hosts``: the live workers'
    hostnames; ``live``: their records, for the idle queues and the bindings (None: the
    direct and reply queues alone). The queues taken out of the registry."""
    gone = _departed_direct(client, config, scripts, queues, hosts)
    replies = [q for q in queues if is_reply_queue(q)]
    idle = [] if live is None else _idle(
        client, config, scripts, [q for q in queues if q not in gone and q not in replies],
        live)
    if gone or replies or idle:
        _unregister(client, config.global_keyprefix, gone, replies, idle)
    if live is not None and hosts:  # (none live: a fleet stopped, nothing to tell by)
        pids = {str(r.get("hostname")): r.get("pid") for r in live}
        _unbind_departed(client, config.global_keyprefix, hosts, pids)
    return [*gone, *replies, *idle]


def _departed_direct(client: redis.Redis, config: SitsConfig, scripts: Scripts,
                     queues: Sequence[str], hosts: set[str]) -> list[str]:
    direct = [q for q in queues if q.endswith(DIRECT_QUEUE_SUFFIX) and not is_reply_queue(q)]
    candidates = [q for q in direct if q[:-len(DIRECT_QUEUE_SUFFIX)] not in hosts]
    return [q for q in candidates if _forget(client, config, scripts, q)]


def _idle(client: redis.Redis, config: SitsConfig, scripts: Scripts, queues: Sequence[str],
          live: Sequence[Mapping[str, Any]]) -> list[str]:
    """The queues of ``queues`` forgotten as idle (the module's text)."""
    after_s = config.idle_queue_forget_s
    # (no live worker, a fleet stopped or restarting: none to say what is consumed)
    if after_s <= 0 or not queues or not live:
        return []
    consumed: set[str] = set()
    for record in live:
        said = record.get("queues")
        if not isinstance(said, list):
            return []  # (a record that does not say, an earlier release's: it may be any)
        consumed.update(q for q in said if isinstance(q, str))
    candidates = [q for q in queues if q not in consumed and q != CONTROL_QUEUE
                  and not q.endswith(DIRECT_QUEUE_SUFFIX)]
    if not candidates:
        return []
    return [q for q in _unchanged_for(client, config.global_keyprefix, candidates, after_s)
            if _forget(client, config, scripts, q)]


def _unchanged_for(client: redis.Redis, prefix: str, queues: Sequence[str], after_s: float
                   ) -> list[str]:
    """Those of ``queues`` whose put counter (``seq``, written by puts alone) has not
    moved for ``after_s``, by what the passes saw of it (:func:`puts_seen_key`: the count
    and the server time it was first seen at). ``OBJECT IDLETIME`` was no measure: Redis
    shares one object among keys holding a small integer, so the idle time was any such
    key's (a queue of 53 puts was forgotten 4 s after its last, one of 2 never)."""
    seen_key = puts_seen_key(prefix)
    with client.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.get(QueueKeys.for_queue(queue, prefix).seq)
        pipe.hgetall(seen_key)
        *counts, raw = pipe.execute()
    seen = {text(k, "replace"): text(v, "replace") for k, v in raw.items()}
    now = clock.now(client)
    fresh: dict[Any, Any] = {}
    stale: list[str] = []
    for queue, count in zip(queues, counts, strict=True):
        said = text(count, "replace") if count is not None else ""  # ("": never put to)
        was, _, since = seen.get(queue, "").partition("@")
        try:
            first = float(since) if was == said and since else None
        except ValueError:
            first = None
        if first is None:
            fresh[queue] = f"{said}@{now}"
        elif now - first >= after_s:
            stale.append(queue)
    gone = [q for q in seen if q not in queues or q in stale]
    with client.pipeline(transaction=False) as pipe:
        if fresh:
            pipe.hset(seen_key, mapping=fresh)
        if gone:  # (a queue consumed again, or forgotten: seen afresh next time)
            pipe.hdel(seen_key, *gone)
        pipe.execute()
    return stale


def _forget(client: redis.Redis, config: SitsConfig, scripts: Scripts, queue: str) -> bool:
    keys = QueueKeys.for_queue(queue, config.global_keyprefix)
    return bool(scripts.run("forget", keys, [], client))


def _unregister(client: redis.Redis, prefix: str, gone: Sequence[str],
                replies: Sequence[str], idle: Sequence[str]) -> None:
    exchange = WORKER_DIRECT_EXCHANGE.name
    with client.pipeline(transaction=False) as pipe:
        pipe.srem(queues_registry(prefix), *gone, *replies, *idle)
        for queue in gone:  # kombu's binding: routing key (the hostname), "", queue
            member = BINDING_SEP.join([queue[:-len(DIRECT_QUEUE_SUFFIX)], "", queue])
            pipe.srem(f"{prefix}_kombu.binding.{exchange}", member)
            pipe.srem(f"{prefix}_kombu.binding_permanent.{exchange}", member)
        for queue in replies:
            for key in QueueKeys.for_queue(queue, prefix).all():
                pipe.pexpire(key, REPLY_QUEUE_EXPIRES_MS)
        pipe.execute()
    # A put that landed between a queue's forgetting (forget.lua, atomic) and its leaving
    # the registry registered it again first: taken out after, it would hold a task no
    # pass or `sitsq status` sees. Such a one goes back in.
    forgotten = [*gone, *idle]
    with client.pipeline(transaction=False) as pipe:
        for queue in forgotten:
            pipe.exists(QueueKeys.for_queue(queue, prefix).seq)
        again = [q for q, n in zip(forgotten, pipe.execute(), strict=True) if n]
    if again:
        client.sadd(queues_registry(prefix), *again)
    if gone:
        logger.info("forgot the direct queues of departed workers: %s", list(gone))
    if replies:
        logger.info("took %d control reply queue(s) out of the registry", len(replies))
    if idle:
        logger.info("forgot %d idle queue(s) no worker consumes: %s", len(idle),
                    list(idle)[:10])


def _unbind_departed(client: redis.Redis, prefix: str, hosts: set[str],
                     pids: Mapping[str, Any]) -> None:
    """Remove the pidbox bindings of workers no longer advertised, and the event bindings
    of worker processes gone (``pids``: each live worker's process, by hostname)."""
    events = event_queues_key(prefix)
    owners = {text(k, "replace"): text(v, "replace") for k, v in client.hgetall(events).items()}
    departed_events = {q for q, owner in owners.items() if _gone(owner, hosts, pids)}
    removed = 0
    for exchange, departed in ((PIDBOX_EXCHANGE, _departed_pidbox(hosts)),
                               (EVENT_EXCHANGE, departed_events.__contains__)):
        for table in (f"{prefix}_kombu.binding.{exchange}",
                      f"{prefix}_kombu.binding_permanent.{exchange}"):
            stale = [m for m in client.smembers(table)
                     if departed(text(m, "replace").rpartition(BINDING_SEP)[2])]
            if stale:
                removed += int(client.srem(table, *stale))
    if departed_events:
        client.hdel(events, *departed_events)
    if removed:
        logger.info("removed %d remote-control and event binding(s) of departed workers",
                    removed)


def _gone(owner: str, hosts: set[str], pids: Mapping[str, Any]) -> bool:
    """Whether the process of an event queue's owner (``"<pid> <hostname>"``) is gone."""
    pid, _, host = owner.partition(" ")
    if host not in hosts:
        return True
    live = pids.get(host)
    return live is not None and str(live) != pid


def _departed_pidbox(hosts: set[str]) -> Callable[[str], bool]:
    """Whether a pidbox binding's queue is a worker's no longer advertised."""
    def departed(queue: str) -> bool:
        return queue.endswith(PIDBOX_SUFFIX) and queue[:-len(PIDBOX_SUFFIX)] not in hosts

    return departed
