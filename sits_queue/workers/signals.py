"""Worker signal handlers: record each finished task for the priority statistics.

Recording must never fail a task: Redis errors are logged and dropped.

Records are buffered per process and written in one pipeline: every
:data:`FLUSH_EVERY_RECORDS` records, by a daemon thread of the process within
:data:`FLUSH_EVERY_S` of the first record it buffers (an idle pool child's records
arrive too), and when a pool child exits (``worker_process_shutdown``: billiard ends a
child with ``os._exit``, so ``atexit`` runs only in a process that exits normally).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery, signals

from sits_queue import tracing
from sits_queue.app import sits_config
from sits_queue.broker import clock
from sits_queue.checks import finite, is_number
from sits_queue.config import SitsConfig
from sits_queue.errors import UnknownModel
from sits_queue.etas import due_s
from sits_queue.options import HEADER, MAX_NAME, UNCOUNTED_TASKS
from sits_queue.priority.prewarm import MAX_CATCH_UP, bucket_of, demand_key
from sits_queue.priority.rescore import counter_key, hot_key, latency_key
from sits_queue.workers import advertise, deferred

logger = logging.getLogger(__name__)

#: Completion records are flushed in batches: one round trip per task would sit on the
#: critical path between a task's end and the slot's next pick.
FLUSH_EVERY_RECORDS = 32
#: Longest a record waits in the buffer, s (the flusher thread's period while any wait).
FLUSH_EVERY_S = 0.5


@dataclass(frozen=True)
class _Record:
    #: The configuration it was recorded under (its keys' prefix, window, interval).
    config: SitsConfig
    sla_class: str
    model: str | None
    latency_ms: float | None
    failed: bool
    #: The pre-warm demand bucket the task finished in ("" with pre-warming off).
    demand: str
    #: It ended in a retry: its message was handled, and the retry is a new arrival.
    retried: bool = False


_records: list[_Record] = []
#: A worker of plain tasks only may run them in threads of one process (runtime.py).
_lock = threading.Lock()


def _write_buffered() -> None:
    with _lock:
        records, _records[:] = list(_records), []
    if records:
        _write(records)


#: Writes the records within FLUSH_EVERY_S of the first one buffered, from a thread of
#: the process; its write lock makes a child's exit flush wait for a write in flight
#: (else the process could end while that write is on the wire).
_flusher = deferred.Deferred(_write_buffered, FLUSH_EVERY_S, name="statistics",
                             what="record task statistics")


def _after_fork_in_child() -> None:
    # A fork copies the records (its parent's to write) and a lock another thread may
    # have held (as held for ever): the child starts with its own. (The flusher resets
    # itself: deferred.py.)
    global _lock
    _lock = threading.Lock()
    _records.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _due_at(request: Any) -> float | None:
    """When a task with an ``eta`` (a countdown's too: Celery sends it as one) was due,
    s since the epoch; None without one, or one that does not parse (read as the broker
    and Celery read it: ``etas.py``)."""
    return due_s(getattr(request, "eta", None))


def record_completion(config: SitsConfig, request: Any, failed: bool, now_s: float,
                      retried: bool = False, unknown_model: bool = False) -> None:
    """Buffer one finished task's statistics (``now_s``: when it finished); flushed every
    :data:`FLUSH_EVERY_RECORDS` records, else within :data:`FLUSH_EVERY_S`. A run that
    ended in a retry (``retried``) counts only as a handled message: each retry arrives
    again, and the task finishes once. One that failed naming a model no worker
    registers (``unknown_model``) counts for no model's demand or hotness."""
    header = getattr(request, HEADER, None)
    if not isinstance(header, dict) or request.task is None or request.task in UNCOUNTED_TASKS:
        return
    sla_class = header.get("sla_class")
    if sla_class not in config.class_names:
        return
    submitted = getattr(request, "sits_submitted_at", None)
    latency_ms = None
    # (a header written by hand may hold anything: an int past a float's range raised
    # in the post-run handler, and -1e308 wrote an infinite latency)
    if is_number(submitted) and finite(submitted):
        # From when it was due: a countdown, an eta or a retry's countdown is the
        # caller's wish, not lateness (it inflated the class's p95, jitter and priority)
        submitted = max(submitted, _due_at(request) or submitted)
        latency_ms = round(max(0.0, now_s - submitted) * 1000, 3)
        if not math.isfinite(latency_ms):
            latency_ms = None
    # A model named by anything but a name counts for no model's demand: the hash field
    # refused it, and with it the whole flush's statistics (up to 32 tasks') were lost
    model = header.get("model")
    if not isinstance(model, str) or not model or len(model) > MAX_NAME:
        model = None
    if unknown_model:  # (a name no worker registers: the pre-warm planner sent a doomed
        model = None   # load of it each interval, and its calls made it "hot")
    # The demand belongs to the interval the task finished in, whenever it is written.
    demand = demand_key(config, bucket_of(config, now_s)) \
        if config.prewarm_interval_s > 0 else ""
    with _lock:
        _records.append(_Record(config, sla_class, model, latency_ms, failed, demand,
                                retried))
        due = len(_records) >= FLUSH_EVERY_RECORDS
    _flusher.arm()  # (its thread starts at the first record after a fork)
    if due:
        flush()


def flush() -> None:
    """Write the buffered records, each to the Redis and under the keys of the
    configuration it was recorded with (a pipeline per Redis); Redis errors are logged,
    never raised. (A solo or threads worker's own exit flushes too: deferred.py.)"""
    _flusher.flush()


def _write(records: list[_Record]) -> None:
    """Each record to the Redis of the configuration it was recorded with: a process
    with two apps (two sites, a test's app beside the package's default one) wrote them
    all to the Redis of whichever configuration the flush was called with."""
    by_url: dict[str, list[_Record]] = {}
    for r in records:
        by_url.setdefault(r.config.redis_url, []).append(r)
    for group in by_url.values():
        _write_one(group[0].config, group)


def _write_one(config: SitsConfig, records: list[_Record]) -> None:
    # (per pid and URL: a child's own sockets, and each app's statistics to its own
    # Redis; a connect gives up after 2 s, so an exit flush cannot hang on a dead host)
    pipe = advertise.client_for(config).pipeline(transaction=False)
    trims: dict[str, int] = {}
    expiries: dict[str, int] = {}
    for r in records:
        if r.retried:  # for the bandwidth compliance only (rescore.py)
            pipe.hincrby(counter_key(r.config, "retried"), r.sla_class, 1)
            continue
        latencies = latency_key(r.config, r.sla_class)
        if r.latency_ms is not None:
            pipe.lpush(latencies, r.latency_ms)
        trims[latencies] = r.config.stats_window
        pipe.hincrby(counter_key(r.config, "done"), r.sla_class, 1)
        if r.failed:
            pipe.hincrby(counter_key(r.config, "failed"), r.sla_class, 1)
        if r.model:
            pipe.hincrbyfloat(hot_key(r.config), r.model, 1.0)
            if r.demand:  # demand per interval, for the forecast
                pipe.hincrby(r.demand, r.model, 1)
                # at least a second: a short interval rounded to EXPIRE 0 would delete it
                expiries[r.demand] = max(1, math.ceil(r.config.prewarm_interval_s
                                                      * (MAX_CATCH_UP + 2)))
    for key, window in trims.items():
        pipe.ltrim(key, 0, window - 1)
    for key, keep_s in expiries.items():  # after the increments: EXPIRE on a missing
        pipe.expire(key, keep_s)         # key does nothing
    # each command's name and arguments, to match a refusal to its command
    commands = [tuple(args) for args, _ in pipe.command_stack]
    try:
        replies = pipe.execute(raise_on_error=False)
    except redis.RedisError as exc:
        logger.warning("could not record %d task statistics: %s", len(records), exc)
        return
    _reset_refused_counters(config, commands, replies)


def _reset_refused_counters(config: SitsConfig, commands: list[tuple[Any, ...]],
                            replies: list[Any]) -> None:
    """A counter field another program left that is no number refuses every increment
    (its class's done count stopped growing, and each flush logged it): it starts again
    from this increment. Other refusals (a key of another type, a full server's OOM:
    reset then, the count went back to one once the server had room) are logged."""
    client = advertise.client_for(config)
    for command, reply in zip(commands, replies, strict=True):
        if not isinstance(reply, redis.ResponseError):
            continue
        name, *args = command
        if str(name).upper() in ("HINCRBY", "HINCRBYFLOAT") and _not_a_number(reply):
            key, field, amount = args
            logger.warning("statistics counter %s %s was no number (%s): starts again",
                           key, field, reply)
            try:
                client.hset(key, field, amount)
            except redis.RedisError as exc:  # (Redis gone meanwhile: the next flush)
                logger.warning("could not restart counter %s %s: %s", key, field, exc)
        else:
            logger.warning("could not record a task statistic (%s %s): %s", name,
                           args[0] if args else "", reply)


def _not_a_number(reply: redis.ResponseError) -> bool:
    """Whether Redis refused an increment because the field holds no number ("hash
    value is not an integer" / "... not a float")."""
    text = str(reply).lower()
    return "hash value is not" in text


def finished_at(config: SitsConfig) -> float:
    """Now on the clock of ``config``'s Redis, which the task's submission time is on
    (``broker/clock.py``): a worker's own clock an hour out was an hour of latency."""
    return clock.now(advertise.client_for(config))


def connect(app: Celery) -> None:
    def on_postrun(sender: Any = None, task: Any = None, state: str | None = None,
                   retval: Any = None, **_: Any) -> None:
        if task is None or getattr(task, "app", None) is not app:
            return
        if state not in ("SUCCESS", "FAILURE", "RETRY"):
            return  # a slot yielded (REJECTED): the same message runs on later
        config = sits_config(app)
        record_completion(config, task.request, failed=state == "FAILURE",
                          now_s=finished_at(config), retried=state == "RETRY",
                          unknown_model=isinstance(retval, UnknownModel))

    def on_process_shutdown(**_: Any) -> None:
        # A pool child's buffered records and spans would die with it (billiard ends it
        # with os._exit, so atexit never runs there).
        flush()
        tracing.flush()

    # weak=False: the closures would otherwise be collected at once.
    signals.task_postrun.connect(on_postrun, weak=False)
    signals.worker_process_shutdown.connect(on_process_shutdown, weak=False)
