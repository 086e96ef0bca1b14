"""Each worker advertises itself in Redis with a TTL heartbeat (``sitsq status`` reads it).

Keys (``prefix`` is the app's ``global_keyprefix``):

* ``{prefix}sits:worker:<hostname>``: JSON written by the worker's main process every
  :data:`REFRESH_S` with a :data:`TTL_S` expiry: host, pid, pool size, devices (NVML:
  name, total/free VRAM, utilisation, alpha), counters and the cold-start share;
* ``{prefix}sits:worker:<hostname>:child:<slot>``: JSON each pool child writes after
  every inference task (its warm engines, memory, counters);
* ``{prefix}sits:worker:<hostname>:counters``: HASH the children increment (tasks,
  cold, cold_ms), so the counts survive a replaced child.

The main process refreshes from a thread of its own (not the consumer's event loop, which
a task of the solo pool holds for as long as it runs) and re-arms the TTL of the child
keys with its own, so a worker that dies disappears from ``sitsq status`` within
:data:`TTL_S`, while an idle child's warm set stays visible. The counters are Prometheus
counters: they must not restart while the worker lives, so they expire only after
:data:`COUNTERS_TTL_S` (re-armed by every refresh and child publish) and are deleted when
the worker withdraws. Writing never fails a task or the worker: Redis errors are logged.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import redis
from celery import bootsteps

from sits_queue.broker import affinity
from sits_queue.broker.keys import site_local
from sits_queue.checks import stored_number, text
from sits_queue.config import SitsConfig
from sits_queue.periodic import Periodic
from sits_queue.workers import fleet, steer
from sits_queue.workers.devices import Device, live

if TYPE_CHECKING:
    from sits_queue.workers.warmreader import WarmReader

logger = logging.getLogger(__name__)

#: A worker silent this long is gone from ``sitsq status``, s.
TTL_S = 15
#: Refresh period, s: a third of the TTL, so two lost refreshes are survivable.
REFRESH_S = 5.0
#: Expiry of a worker's counters, s: a day, far past any task or stalled refresh (a
#: worker killed without withdrawing leaves them that long; one that stops deletes them).
COUNTERS_TTL_S = 86_400
#: Longest a stopping worker waits for a refresh in flight before it withdraws, s (Redis
#: calls time out after 2 s): a refresh after the withdrawal would advertise it again.
_STOP_WAIT_S = 10.0
#: Most child slots a record is read for (a larger count is another writer's junk).
MAX_SLOTS = 4096
_CHILD = ":child:"
_COUNTERS = ":counters"

_clients: dict[tuple[int, str], redis.Redis] = {}
_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # A fork copies the lock as the refresh (or scrape) thread held it, for ever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def worker_key(prefix: str, hostname: str) -> str:
    return f"{prefix}sits:worker:{hostname}"


def workers_key(prefix: str) -> str:
    """ZSET hostname -> its last refresh (unix s): the workers there are, found without
    a SCAN of every key (result-backend keys can be millions)."""
    return f"{prefix}sits:workers"


def queues_version_key(prefix: str) -> str:
    """A count bumped whenever a worker advertises other queues than before (a start,
    remote control's ``add_consumer``/``cancel_consumer``): its peers' placement weights
    (``workers/fleet.py``) are read again when it moves, not at their next full read."""
    return f"{prefix}sits:workers:queues"


def child_key(prefix: str, hostname: str, slot: int) -> str:
    return f"{worker_key(prefix, hostname)}{_CHILD}{slot}"


def counters_key(prefix: str, hostname: str) -> str:
    return f"{worker_key(prefix, hostname)}{_COUNTERS}"


def client_for(config: SitsConfig) -> redis.Redis:
    # Per pid: a forked child must not share its parent's sockets. Per URL: a process
    # with two configurations (two apps) got the first one's Redis for both.
    key = (os.getpid(), config.redis_url)
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = redis.Redis.from_url(config.redis_url, socket_timeout=2,
                                          socket_connect_timeout=2)
            _clients[key] = client
        return client


# -- pure ----------------------------------------------------------------------------------

def cold_share(values: Mapping[str, float]) -> float:
    """Share of inference task runs that paid a cold start (MISSION §4.4), 0 with none;
    from a counters hash (:func:`counter_values`)."""
    runs, cold = values.get("runs", 0.0), values.get("cold_runs", 0.0)
    return cold / runs if runs > 0 else 0.0


def device_record(device: Device) -> dict[str, Any]:
    return {"index": device.index, "kind": device.kind, "name": device.name,
            "uuid": device.uuid, "total_vram_bytes": device.total_vram_bytes,
            "free_vram_bytes": device.free_vram_bytes,
            "utilisation_pct": device.utilisation_pct, "numa_node": device.numa_node,
            "alpha": device.alpha,
            # Peak throughput per precision and bandwidth (datasheet), for precision
            # matching (§3.2) and the roofline (§3.1): workers/fleet.py.
            "peak_tflops": {p: round(v / 1e12, 3) for p, v in device.peak_flops.items()},
            "bandwidth_gb_s": None if device.memory_bandwidth_bytes_per_s is None
            else round(device.memory_bandwidth_bytes_per_s / 1e9, 3),
            # (False: NVML could not read it now; its free memory is an earlier reading)
            "readable": device.readable}


def largest_device_bytes(records: Iterable[Mapping[str, Any]]) -> int | None:
    """The memory of the largest device any of the worker ``records`` advertises, bytes;
    None when none advertises one."""
    sizes: list[int] = []
    for record in records:
        devices = record.get("devices")
        for device in devices if isinstance(devices, list) else []:
            size = device.get("total_vram_bytes") if isinstance(device, Mapping) else None
            if isinstance(size, int) and not isinstance(size, bool):
                sizes.append(size)
    return max(sizes) if sizes else None


def counter_values(raw: Mapping[Any, Any]) -> dict[str, float]:
    """A counters hash, as ``HGETALL`` returns it (bytes), as names to numbers. A field
    that is no finite number (another program's, or corrupt: "inf" parses, and a count
    of it failed every scrape and rescoring pass) is left out, not fatal."""
    values: dict[str, float] = {}
    for key, value in raw.items():
        number = stored_number(value)
        if number is not None:
            values[text(key, "replace")] = number
    return values


def as_mapping(value: Any) -> Mapping[Any, Any]:
    """A field of a worker's record read as an object; an empty one for what is not (an
    older, newer or foreign writer's), so that its readers walk past it."""
    return value if isinstance(value, Mapping) else {}


def counter_group(values: Mapping[str, float], prefix: str) -> dict[str, float]:
    """The fields named ``<prefix><rest>`` (``phase_ms:load``...), by ``rest``, sorted."""
    return {k[len(prefix):]: v for k, v in sorted(values.items()) if k.startswith(prefix)}


def counters_from(raw: Mapping[Any, Any]) -> dict[str, Any]:
    """The counters hash as numbers: totals, cold-start share, ms per phase, first tokens,
    failures."""
    values = counter_values(raw)

    def group(prefix: str) -> dict[str, float]:
        return {k: round(v, 3) for k, v in counter_group(values, prefix).items()}

    tasks, cold = int(values.get("tasks", 0)), int(values.get("cold", 0))
    cold_ms = values.get("cold_ms", 0.0)
    firsts = int(values.get("ftt", 0))
    return {"tasks": tasks, "cold": cold, "cold_ms": round(cold_ms, 3),
            "cold_share": round(cold_share(values), 6),
            "cold_ms_mean": round(cold_ms / cold, 3) if cold else 0.0,
            # generations that made a first token, and the mean ms to it (§4.4)
            "first_tokens": firsts,
            "first_token_ms_mean": round(values.get("ftt_ms", 0.0) / firsts, 3)
            if firsts else 0.0,
            "affinity_picks": int(values.get("affinity", 0)),
            "phases_ms": group("phase_ms:"), "by_source": group("cold:"),
            "failed": {k: int(v) for k, v in group("failed:").items()}}


def pool_children(pool: Any) -> dict[int, Any]:
    """Slot -> pid of a pool's live children: a prefork child's slot is its process
    index, and the children a ``pool_shrink`` leaves keep theirs (billiard stops the
    first idle one: a pool of three shrunk by one holds slots 1 and 2). None for a pool
    without processes of its own (solo, threads) or none yet."""
    processes = getattr(getattr(pool, "_pool", None), "_pool", None)
    try:
        return {int(p.index): getattr(p, "pid", None) for p in processes or ()}
    except (TypeError, ValueError, AttributeError):
        return {}


def pool_slots(pool: Any, size: int) -> list[int]:
    """Where the records of a pool's live children are kept (:func:`pool_children`);
    0..size-1 for a pool without processes of its own or none yet; none for a size of
    0 (a pool shrunk to no child)."""
    return sorted(pool_children(pool)) or list(range(max(0, size)))


def record_slots(record: Mapping[str, Any]) -> list[int]:
    """The child slots a worker record names (its ``slots``; 0..concurrency-1 from a
    writer that named none); none for a record that names neither sensibly."""
    slots = record.get("slots")
    if isinstance(slots, list) and slots and all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < MAX_SLOTS
            for s in slots):
        return sorted(set(slots))
    concurrency = record.get("concurrency")
    if isinstance(concurrency, int) and 0 < concurrency <= MAX_SLOTS:
        return list(range(concurrency))
    return []


def worker_record(hostname: str, pid: int, concurrency: int, devices: list[Device],
                  counters: Mapping[Any, Any], now_s: float,
                  slots: list[int] | None = None) -> dict[str, Any]:
    return {"hostname": hostname, "host": socket.gethostname(), "pid": pid,
            "concurrency": concurrency,
            "slots": slots if slots is not None else list(range(max(1, concurrency))),
            "devices": [device_record(d) for d in devices],
            "cold_start": counters_from(counters), "updated_at": now_s, "ttl_s": TTL_S,
            # (its release keeps holder entries: broker/holders.py, older_release)
            "holders": 1}


# -- writing -----------------------------------------------------------------------------

def publish_child(config: SitsConfig, hostname: str, slot: int, record: Mapping[str, Any],
                  increments: Mapping[str, float] | None = None) -> bool:
    """Child side, one round trip: this child's record, and its new counts in the counters;
    False when Redis could not take them (the caller keeps the counts for next time).

    The counters live in the worker's hash (not the child record) so they survive a
    child that is replaced after a hard time limit. Field names: :mod:`.metrics`.
    All or nothing (MULTI/EXEC), so counts kept after a failure are never added twice.
    """
    prefix = config.global_keyprefix
    counters = counters_key(prefix, hostname)
    try:
        pipe = client_for(config).pipeline(transaction=True)
        pipe.set(child_key(prefix, hostname, slot),
                 json.dumps({**record, "updated_at": time.time()}, default=str), ex=TTL_S)
        for name, value in (increments or {}).items():
            if name.split(":", 1)[0].endswith("_ms"):  # cold_ms, phase_ms:<phase>
                pipe.hincrbyfloat(counters, name, round(value, 3))
            else:
                pipe.hincrby(counters, name, int(value))
        if increments:
            pipe.expire(counters, COUNTERS_TTL_S)
        pipe.execute()
    except redis.RedisError as exc:
        logger.warning("could not publish the child's warm set and counters (kept for "
                       "the next try): %s", exc)
        return False
    return True


def refresh(client: redis.Redis, prefix: str, hostname: str, pid: int, concurrency: int,
            devices: list[Device], now_s: float,
            extra: Mapping[str, Any] | None = None,
            slots: list[int] | None = None, queues_moved: bool = False) -> dict[str, Any]:
    """Main process: rewrite the worker record (plus ``extra`` fields: its runtime
    profile, its queues), re-arm the TTLs of its children's records (``slots``,
    :func:`pool_slots`; 0..concurrency-1 if not given); ``queues_moved``: the queues it
    says are others than its last record's (:func:`queues_version_key`)."""
    counters = client.hgetall(counters_key(prefix, hostname))
    record = {**worker_record(hostname, pid, concurrency, devices, counters, now_s, slots),
              **(extra or {})}
    pipe = client.pipeline(transaction=False)
    pipe.set(worker_key(prefix, hostname), json.dumps(record), ex=TTL_S)
    pipe.zadd(workers_key(prefix), {hostname: now_s})
    for slot in record["slots"]:
        pipe.expire(child_key(prefix, hostname, slot), TTL_S)
    pipe.expire(counters_key(prefix, hostname), COUNTERS_TTL_S)
    if queues_moved:
        pipe.incr(queues_version_key(prefix))
    done = pipe.execute(raise_on_error=False)
    if queues_moved and isinstance(done[-1], redis.ResponseError):
        # (no count there: junk or a key of another type; a count started again is a
        # change to its peers as well)
        logger.warning("the count of queue moves %s was not a count (%s): started again",
                       queues_version_key(prefix), done[-1])
        client.set(queues_version_key(prefix), 1)
        done = done[:-1]
    for outcome in done:
        if isinstance(outcome, Exception):
            raise outcome
    return record


def withdraw(client: redis.Redis, prefix: str, hostname: str, concurrency: int) -> None:
    keys = [worker_key(prefix, hostname), counters_key(prefix, hostname)]
    keys += [child_key(prefix, hostname, slot) for slot in range(concurrency)]
    client.delete(*keys)
    client.zrem(workers_key(prefix), hostname)


# -- reading -----------------------------------------------------------------------------

def json_object(raw: Any) -> dict[str, Any] | None:
    """A stored record as a dict; None when absent, not JSON or not an object."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, TypeError, RecursionError):  # (JSON nested thousands deep)
        return None
    return value if isinstance(value, dict) else None


def _record(client: redis.Redis, prefix: str, hostname: str) -> dict[str, Any] | None:
    """A live worker's own record; None if it is gone (or unreadable)."""
    try:
        return json_object(client.get(worker_key(prefix, hostname)))
    except redis.ResponseError:  # a key of another type there (another program's)
        return None


def read_worker(client: redis.Redis, prefix: str, hostname: str) -> dict[str, Any] | None:
    """One live worker's record with ``children`` (slot -> record) and ``warm``; None if
    it is gone (or its record is unreadable)."""
    record = _record(client, prefix, hostname)
    if record is None:
        return None
    # The counts as of now, as /metrics reads them: the record's copy is up to a
    # refresh (REFRESH_S) old.
    try:
        counters = client.hgetall(counters_key(prefix, hostname))
    except redis.ResponseError:  # another program's key there: the record's copy stands
        counters = {}
    if counters:
        record["cold_start"] = counters_from(counters)
    record["children"] = children = _children(client, prefix, hostname, record)
    record["warm"] = sorted({str(k) for c in children.values()
                             if isinstance(c.get("warm"), dict) for k in c["warm"]})
    return record


def read_children(client: redis.Redis, prefix: str, hostname: str) -> dict[str, Any]:
    """A live worker's children's records (slot -> record), without the rest
    :func:`read_worker` reads (its counters): what admission reads of its own."""
    record = _record(client, prefix, hostname)
    return {} if record is None else _children(client, prefix, hostname, record)


def _children(client: redis.Redis, prefix: str, hostname: str, record: Mapping[str, Any]
              ) -> dict[str, Any]:
    children: dict[str, Any] = {}
    if slots := record_slots(record):
        values = client.mget([child_key(prefix, hostname, s) for s in slots])
        for slot, value in zip(slots, values, strict=True):
            child = json_object(value)  # a corrupt child record is left out, not fatal
            if child is not None:
                children[str(slot)] = child
    return children


def live_hostnames(client: redis.Redis, prefix: str = "") -> list[str]:
    """Hostnames of the workers whose advertisement has not expired: those registered
    (:func:`workers_key`, a round trip) whose record is still there (another); one
    whose record expired (a worker killed) leaves the registry. (A SCAN for the records
    cost a round trip per 200 keys of the whole database: 43k a call beside a day's
    results at 100 tasks/s, on every status and fleet scrape.)"""
    try:
        listed = client.zrange(workers_key(prefix), 0, -1)
    except redis.ResponseError as exc:  # a key of another type there (another program's)
        logger.warning("the worker registry %s is not readable (%s): no workers shown",
                       workers_key(prefix), exc)
        return []
    names = [text(n, "replace") for n in listed]
    if not names:
        return []
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.exists(worker_key(prefix, name))
        alive = pipe.execute()
    gone = [n for n, up in zip(names, alive, strict=True) if not up]
    if gone:
        client.zrem(workers_key(prefix), *gone)
    return [n for n, up in zip(names, alive, strict=True) if up]


def fleet_members(client: redis.Redis, prefix: str = "") -> tuple[tuple[str, ...], Any]:
    """The workers whose last refresh is within the advertisement's TTL by their
    registry scores (a record's expiry is what :func:`live_hostnames` checks, dearer),
    and the count of changes of what they consume (:func:`queues_version_key`), in one
    round trip: who is live and on which queues, to tell a change of the fleet by."""
    with client.pipeline(transaction=False) as pipe:
        pipe.zrangebyscore(workers_key(prefix), time.time() - TTL_S, "+inf")
        pipe.get(queues_version_key(prefix))
        names, version = pipe.execute(raise_on_error=False)
    if isinstance(names, Exception):
        raise names
    # (a key of another type there: no count of moves, until a worker's move starts one)
    return tuple(sorted(text(n, "replace") for n in names)), \
        None if isinstance(version, Exception) else version


def older_release(client: redis.Redis, prefix: str = "") -> str | None:
    """A live worker of a release that keeps no holder entries (its record lacks
    ``holders``), if any: such a worker's sweep restores a message and its pick takes it
    again leaving the entry under the first holder's name, so what a dead holder held
    is left to the visibility timeout while one is live (``broker/holders.py``)."""
    names = live_hostnames(client, prefix)
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.get(worker_key(prefix, name))
        raws = pipe.execute(raise_on_error=False)
    for name, raw in zip(names, raws, strict=True):
        record = None if isinstance(raw, Exception) else json_object(raw)
        if record is not None and "holders" not in record:
            return name
    return None


def read_workers(client: redis.Redis, prefix: str = "") -> list[dict[str, Any]]:
    """Every live worker's record (see :func:`read_worker`), by hostname."""
    workers = [r for name in live_hostnames(client, prefix)
               if (r := read_worker(client, prefix, name)) is not None]
    return sorted(workers, key=lambda r: str(r.get("hostname", "")))


# -- the bootstep ------------------------------------------------------------------------

def event_queues(c: Any) -> list[str]:
    """The event queues a worker's consumer receives on (its gossip's, named afresh at
    each consumer start), for the rescoring pass to unbind once the worker is gone
    (``priority/pruning.py``)."""
    try:
        return sorted(q.name for consumer in (getattr(c.gossip, "consumers", None) or ())
                      for q in consumer.queues if isinstance(q.name, str))
    except (AttributeError, RuntimeError, TypeError):  # (no gossip: --without-gossip)
        return []


def consumed_queues(c: Any) -> list[str] | None:
    """The queues of work a worker's consumer takes from now, by name (remote control's
    ``add_consumer``/``cancel_consumer`` included); None where it cannot say. Not the
    control queue, which every worker consumes, nor its own direct queue
    (``keys.site_local``): by them, every worker competed with every other."""
    consumer = getattr(c, "task_consumer", None)
    try:
        if consumer is not None:
            names = {q.name for q in list(consumer.queues)}
        else:
            queues = c.app.amqp.queues
            names = set(queues.consume_from or queues)
    except (AttributeError, RuntimeError):  # (RuntimeError: changed under the copy)
        return None
    return sorted(n for n in names if isinstance(n, str) and not site_local(n))


class Advertise(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer step: refresh this worker's advertisement every :data:`REFRESH_S`.

    From a daemon thread, not the consumer's timer: with ``--pool=solo`` a task runs on
    the event loop's thread, and a task longer than :data:`TTL_S` took the worker out of
    ``sitsq status`` and its own ``/metrics``. Each refresh asks NVML afresh (free VRAM
    and utilisation change); never CUDA.
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)
    name = "SITS advertisement"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self._refresher: Periodic | None = None
        self._reader: WarmReader | None = None
        self._most = 0  # the most slots seen: withdrawn at the end, each child's record
        self._queues_said: list[str] | None = None  # (in its last record written)
        self._events_said: list[str] = []  # (its gossip queues, said: pruning.py)
        from sits_queue.workers.readvert import ChildRecords

        self._records = ChildRecords()  # (written back where Redis lost them)

    def _args(self, c: Any) -> tuple[SitsConfig, str, int, list[int]]:
        config: SitsConfig = c.app.sits
        # The pool's size now: `celery control pool_grow/pool_shrink` change it, not the
        # worker's --concurrency (status, /metrics and the warm reader kept the start's)
        # (0 is a prefork pool shrunk to no child: it runs nothing, and said the planned
        # size, it advertised a slot and the engines of the child it stopped)
        try:
            concurrency = int(c.pool.num_processes)
        except (AttributeError, TypeError, ValueError):
            concurrency = int(getattr(c.controller, "concurrency", 0) or 1)
        slots = pool_slots(getattr(c, "pool", None), concurrency)
        self._most = max(self._most, concurrency, max(slots, default=-1) + 1)
        return config, c.hostname, concurrency, slots

    def tick(self, c: Any) -> None:
        config, hostname, concurrency, slots = self._args(c)
        if self._reader is not None and self._reader.slots != tuple(slots):
            self._reader.resize(slots)
        from sits_queue.workers import profile, runtime
        from sits_queue.workers import request as admission
        from sits_queue.workers.readvert import live_pids

        # the devices its live children use (an autoscaled pool below its planned size:
        # not the plan's others, until it grows), their readings taken now; admission
        # weighs them alone (a task admitted for an unused GPU's room was given back by
        # the child that got it, at every take)
        used = runtime.slot_devices(runtime.plan().discovery, slots)
        admission.admit_on(frozenset(d.uuid for d in used if d.kind == "cuda"))
        devices = list(live(used))

        extra: dict[str, Any] = {}
        if profile.current:
            extra["profile"] = profile.current[0].report()
        if steer.steering():  # (the pre-warm planner: each child can be sent one)
            extra["steered"] = True
        if links := runtime.plan().discovery.links(used):  # (GPU pairs: `sitsq status`)
            extra["links"] = links
        if self._reader is not None:  # (`sitsq status`: what its picks weigh, and why)
            extra["placement"] = fleet.placement_record(self._reader.standing)
        if (pool := admission.plain_only_pool()) is not None:
            extra["plain_tasks_only"] = pool  # `sitsq status`: inference goes elsewhere
        if (queues := consumed_queues(c)) is not None:  # (its peers: workers/fleet.py)
            extra["queues"] = queues
        try:
            refresh(client_for(config), config.global_keyprefix, hostname, os.getpid(),
                    concurrency, devices, time.time(), extra, slots,
                    queues_moved=queues != self._queues_said)
            self._queues_said = queues
            self._records.keep(client_for(config), config.global_keyprefix, hostname,
                               live_pids(c.pool, slots))
            if (events := event_queues(c)) and events != self._events_said:
                from sits_queue.priority.pruning import record_event_queues

                record_event_queues(client_for(config), config.global_keyprefix, hostname,
                                    os.getpid(), events)
                self._events_said = events
        except redis.RedisError as exc:
            logger.warning("could not refresh the worker advertisement: %s", exc)

    def start(self, c: Any) -> None:
        config, hostname, _, slots = self._args(c)
        if config.affinity.enabled:
            from sits_queue.workers.warmreader import WarmReader

            self._reader = WarmReader(config, hostname, slots)
            affinity.set_warm_source(self._reader)
        self.tick(c)
        self._refresher = Periodic("sits-advertise", REFRESH_S, lambda _: self.tick(c),
                                   "could not refresh the worker advertisement").start()

    def stop(self, c: Any) -> None:
        refresher, self._refresher = self._refresher, None
        if refresher is not None:
            refresher.stop(_STOP_WAIT_S)

    def shutdown(self, c: Any) -> None:
        self.stop(c)
        affinity.set_warm_source(None)
        config, hostname, _, _ = self._args(c)
        try:  # (every child record it may have had: a pool shrunk keeps the higher ones)
            withdraw(client_for(config), config.global_keyprefix, hostname, self._most)
        except redis.RedisError as exc:
            logger.warning("could not withdraw the worker advertisement: %s", exc)
