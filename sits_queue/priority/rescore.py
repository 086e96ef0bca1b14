"""The rescoring pass and the §2.2 trigger check: the Redis edge of the priority model.

Workers record each finished task (``sits_queue.workers.signals``); this module turns
those records into a :class:`PrioritySnapshot`, stores it for producers, and rewrites
the score of every waiting message in bounded chunks (ZSCAN, then ``ZADD XX``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from sits_queue.broker import clock, deadletters
from sits_queue.broker.keys import (
    DIRECT_QUEUE_SUFFIX,
    SEQ_SPAN,
    QueueKeys,
    is_reply_queue,
    queues_registry,
    registered_queues,
    score_base,
    stats_key,
)
from sits_queue.broker.meta import WaitingMeta, score_inputs
from sits_queue.broker.scripts import Scripts
from sits_queue.broker.snapshot import snapshot_to_json
from sits_queue.checks import finite, is_number, stored_number
from sits_queue.config import SitsConfig
from sits_queue.options import CONTROL_QUEUE, UNCOUNTED_TASKS
from sits_queue.priority import stats
from sits_queue.priority.model import ClassStats, PrioritySnapshot, Scorer
from sits_queue.workers.advertise import counter_values, json_object

logger = logging.getLogger(__name__)

#: Decay of model call counts per ``rescore_interval_s``, by time elapsed, not by
#: pass: hotness halves in ~6.6 intervals (~33 s at 5 s).
HOTNESS_DECAY = 0.9
#: Waiting messages read per queue when looking for the oldest top-class task.
HEAD_PEEK = 32
#: Half-life of the counts the bandwidth compliance compares, s: pass by pass (1 s apart
#: under a backlog) a class exactly keeping up read 0.74-0.95, and under 0.5 on one pass
#: in five, moving its whole class's score by up to 17% from one pass to the next.
COMPLIANCE_HALF_LIFE_S = 30.0
#: The beat's and the triggers' passes take at most this share of the time: the next
#: starts only once the last one's length, three times over, has passed since it ended.
#: Over 100k waiting tasks a pass takes ~2 s, past the trigger check's 1 s: while any
#: urgent task waited (the backlog trigger fired at every check), passes ran back to
#: back, and a one-slot worker, taking the control queue first, ran nothing else.
MOST_PASS_SHARE = 0.25
#: How long the last pass's record is kept, s (past it, nothing spaces the next one).
_LAST_PASS_TTL_S = 3600
#: Seconds between the fleet's prunings of idle queues and departed workers' bindings
#: (``pruning.py``; departed workers' direct queues: at every pass).
PRUNE_IDLE_EVERY_S = 60.0
#: The fleet's mark of the last such pruning (``_state_key``).
PRUNE_MARK = "prune"
#: PINGs per trigger check whose least round trip is the RTT sample (``_rtt_ms``).
RTT_PINGS = 3
#: How far ahead of Redis's clock a pass's end may read (it is Redis's time, read after
#: the pass: only another writer's record is ahead by more).
_CLOCK_SLACK_S = 1.0


def latency_key(config: SitsConfig, sla_class: str) -> str:
    return f"{config.global_keyprefix}sits:lat:{sla_class}"


def counter_key(config: SitsConfig, name: str) -> str:
    """HASH class -> count, for name in ("done", "failed", "retried")."""
    return f"{config.global_keyprefix}sits:{name}"


def hot_key(config: SitsConfig) -> str:
    return f"{config.global_keyprefix}sits:hot"


def sweep_period_s(dead_letter_ttl_s: float) -> float:
    """How often dead letters are swept: a 24th of their TTL (a letter outlives it by
    at most ~4%), between a second and an hour."""
    return min(3600.0, max(1.0, dead_letter_ttl_s / 24))


def _totals(raw: bytes | str | None) -> dict[str, Any]:
    """The last pass's counter totals and smoothed rates (fresh ones for a record of an
    older shape, or none)."""
    fresh: dict[str, Any] = {"done": {}, "arrived": {}, "rates": {}, "at": math.nan}
    saved = json_object(raw)
    if saved is None:
        return fresh
    out = {**fresh, **{k: v for k, v in saved.items() if k in fresh}}
    if not all(isinstance(out[k], dict) for k in ("done", "arrived", "rates")) \
            or not is_number(out["at"]):
        return fresh
    # Each count kept only as a finite number by a class's name (another writer's
    # {"done": {"high": "x"}} stopped every pass, before the record was rewritten)
    rates = out["rates"]
    return {"done": _counts(out["done"]), "arrived": _counts(out["arrived"]),
            "rates": {k: _counts(rates[k]) for k in ("done", "arrived")
                      if isinstance(rates.get(k), dict)},
            "at": out["at"] if finite(out["at"]) else math.nan}


def _counts(saved: Mapping[Any, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in saved.items()
            if isinstance(k, str) and is_number(v) and finite(v)}


def _state_key(config: SitsConfig, name: str) -> str:
    return f"{config.global_keyprefix}sits:state:{name}"


@dataclass(frozen=True)
class StatsReadings:
    """What a snapshot is made of, as the workers' records in Redis hold it now."""

    #: Per class, its recent task latencies, oldest first.
    latencies_ms: Mapping[str, Sequence[float]]
    #: Per class, the tasks handled (done, or ended in a retry) and arrived, ever.
    done: Mapping[str, float]
    arrived: Mapping[str, float]
    #: Per model, its decayed call count, as of ``hot_at`` (NaN: never decayed).
    hot: Mapping[str, float]
    hot_at: float
    #: The last pass's totals and smoothed rates (:func:`_totals`).
    last: Mapping[str, Any]


@dataclass(frozen=True)
class SnapshotPlan:
    """What one pass stores: the snapshot, the totals the next pass starts from, each
    model's hotness change (an increment: calls counted meanwhile are kept) and the
    models faded out."""

    snapshot: PrioritySnapshot
    totals: Mapping[str, Any]
    hot_changes: Mapping[str, float]
    faded: Sequence[str]


def plan_snapshot(readings: StatsReadings, now_s: float, class_names: Sequence[str],
                  rescore_interval_s: float) -> SnapshotPlan:
    """The §2.1-§2.2 statistics of every class, and the models' hotness, from
    ``readings``: p95 and jitter of the recent latencies, and bandwidth compliance from
    the handled and arrived rates, smoothed over :data:`COMPLIANCE_HALF_LIFE_S`."""
    last = readings.last
    fade = stats.decay_factor(now_s - last["at"], COMPLIANCE_HALF_LIFE_S, 0.5)
    rates = {kind: stats.smoothed_counts(
        last["rates"].get(kind, {}),
        {c: now.get(c, 0.0) - last[kind].get(c, 0.0) for c in now}, fade)
        for kind, now in (("done", readings.done), ("arrived", readings.arrived))}
    classes = {}
    for name in class_names:
        chrono = list(readings.latencies_ms.get(name, ()))
        classes[name] = ClassStats(
            p95_ms=stats.p95(chrono), jitter_ms=stats.jitter_ms(chrono),
            bandwidth_compliance=stats.bandwidth_compliance(
                rates["done"].get(name, 0.0), rates["arrived"].get(name, 0.0)))
    factor = stats.decay_factor(now_s - readings.hot_at, rescore_interval_s, HOTNESS_DECAY)
    return SnapshotPlan(
        snapshot=PrioritySnapshot(now_s=now_s, classes=classes,
                                  hotness=stats.hotness(dict(readings.hot))),
        totals={"done": dict(readings.done), "arrived": dict(readings.arrived),
                "rates": rates, "at": now_s},
        hot_changes={model: count * (factor - 1) for model, count in readings.hot.items()},
        faded=[m for m, count in readings.hot.items() if count * factor < stats.MIN_COUNT])


@dataclass(frozen=True)
class PassReport:
    queues: int
    seen: int
    rewritten: int
    calls: int
    max_call_ms: float
    duration_ms: float


class Rescorer:
    """Holds one Redis client and the scripts; one instance per worker process."""

    def __init__(self, config: SitsConfig, client: redis.Redis | None = None) -> None:
        self.config = config
        self.client = client or redis.Redis.from_url(config.redis_url)
        self.scripts = Scripts.register()

    def queues(self) -> list[str]:
        return registered_queues(self.client.smembers(
            queues_registry(self.config.global_keyprefix)))

    def keys(self, queue: str) -> QueueKeys:
        return QueueKeys.for_queue(queue, self.config.global_keyprefix)

    # -- snapshot ----------------------------------------------------------------------------
    def gather_snapshot(self, now_s: float) -> PrioritySnapshot:
        """Build the snapshot from worker records and store it for producers."""
        plan = plan_snapshot(self._read_stats(), now_s, self.config.class_names,
                             self.config.rescore_interval_s)
        self._store(plan)
        return plan.snapshot

    def _read_stats(self) -> StatsReadings:
        c, cfg = self.client, self.config
        reads: list[tuple[str, str, Any]] = [  # (command, key, what an unreadable one gives)
            *(("lrange", latency_key(cfg, name), []) for name in cfg.class_names),
            ("hgetall", counter_key(cfg, "done"), {}),
            ("hgetall", counter_key(cfg, "retried"), {}),
            ("hgetall", hot_key(cfg), {}),
            ("get", _state_key(cfg, "totals"), None),
            ("get", _state_key(cfg, "hot-at"), None),
            # the beat's own tasks arrive as top class but are never counted done (they
            # stay out of the statistics): counting them would read as top-class work
            # falling behind, a standing QoS boost (§2.2 bandwidth compliance)
            *(("hgetall", self.keys(queue).arrivals, {}) for queue in self.queues()
              if queue != CONTROL_QUEUE)]
        with c.pipeline(transaction=False) as pipe:
            for command, key, _ in reads:
                if command == "lrange":
                    pipe.lrange(key, 0, -1)
                else:
                    getattr(pipe, command)(key)
            # (a key of another type, another program's, failed every pass: read as empty)
            replies = pipe.execute(raise_on_error=False)
        for i, ((_, key, empty), reply) in enumerate(zip(reads, replies, strict=True)):
            if isinstance(reply, redis.ResponseError):
                logger.warning("rescoring pass: %s unreadable (%s); read as empty", key, reply)
                replies[i] = empty
        n = len(cfg.class_names)
        latencies, done, retried, hot, totals, hot_at, arrivals = (
            replies[:n], replies[n], replies[n + 1], replies[n + 2], replies[n + 3],
            replies[n + 4], replies[n + 5:])
        # A run that ended in a retry handled its message; the retry arrives anew.
        done_now = counter_values(done)
        for name, count in counter_values(retried).items():
            done_now[name] = done_now.get(name, 0.0) + count
        arrived_now: dict[str, float] = {}
        for table in arrivals:
            for name, count in counter_values(table).items():
                arrived_now[name] = arrived_now.get(name, 0.0) + count
        return StatsReadings(
            # (workers write none below 0: a foreign one would fail the class's stats)
            latencies_ms={name: tuple(v for s in reversed(samples)  # LPUSH: newest first
                                      if (v := stored_number(s)) is not None and v >= 0)
                          for name, samples in zip(cfg.class_names, latencies, strict=True)},
            done=done_now, arrived=arrived_now, hot=counter_values(hot), last=_totals(totals),
            hot_at=_seconds(hot_at))

    def _store(self, plan: SnapshotPlan) -> None:
        c, cfg = self.client, self.config
        with c.pipeline(transaction=False) as pipe:
            pipe.set(stats_key(cfg.global_keyprefix), snapshot_to_json(plan.snapshot))
            pipe.set(_state_key(cfg, "totals"), json.dumps(plan.totals))
            # Decay by increment, so counts workers add meanwhile are never lost.
            for model, change in plan.hot_changes.items():
                pipe.hincrbyfloat(hot_key(cfg), model, change)
            pipe.set(_state_key(cfg, "hot-at"), repr(plan.snapshot.now_s))
            # (a hotness key of another type refuses its increments: the rest is stored)
            for reply in pipe.execute(raise_on_error=False):
                if isinstance(reply, redis.ResponseError):
                    logger.warning("rescoring pass: %s not updated (%s)", hot_key(cfg), reply)
                    break
        if plan.faded:  # a model not called for ~50 intervals: out of the hash (and the snapshot)
            self.scripts.run_on("prune_hot", [hot_key(cfg)], [stats.MIN_COUNT, *plan.faded], c)

    # -- the pass ----------------------------------------------------------------------------
    def rescore_all(self, now_s: float | None = None, spaced: bool = False
                    ) -> PassReport | None:
        """One full pass over every registered queue, or None if another pass holds the
        lock; ``spaced`` (the beat's and the triggers' passes): or None if the last pass
        ended less than its length over :data:`MOST_PASS_SHARE` ago."""
        if spaced and self._too_soon():
            return None
        key = _state_key(self.config, "rescore-lock")
        lock = self.client.lock(key, timeout=max(10.0, 6 * self.config.rescore_interval_s),
                                blocking=False)
        if not lock.acquire():
            if self.client.ttl(key) != -1:
                return None  # another pass holds it
            # A lock without an expiry is no pass's (each takes its lock with one): left,
            # every pass would skip, silently, for good.
            logger.warning("rescoring lock %s has no expiry (not a pass's): deleted", key)
            self.client.delete(key)
            if not lock.acquire():
                return None
        try:
            report = self._pass(clock.now(self.client) if now_s is None else now_s)
            self.client.set(_state_key(self.config, "last-pass"), json.dumps(
                {"end": clock.now(self.client), "took_s": report.duration_ms / 1000}),
                ex=_LAST_PASS_TTL_S)
            return report
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:
                logger.warning("rescoring pass outlived its lock")

    def _too_soon(self) -> bool:
        """Whether the last pass ended too recently for another (:data:`MOST_PASS_SHARE`).
        A record that is not one (another program's) leaves passes unspaced: one that
        does not read, and one no pass writes, which would space them past the record's
        own life or end ahead of Redis's clock ({"end": 1e300}, or a pass of 1e12 s,
        kept without an expiry, stopped every spaced pass for good, unsaid): deleted."""
        try:
            last = json.loads(self.client.get(_state_key(self.config, "last-pass")) or "{}")
            end, took = float(last["end"]), float(last["took_s"])
        except (ValueError, TypeError, KeyError, RecursionError):
            return False
        if not (math.isfinite(end) and math.isfinite(took)) or took <= 0:
            return False
        since, wait = clock.now(self.client) - end, took * (1 / MOST_PASS_SHARE - 1)
        if since < -_CLOCK_SLACK_S or wait > _LAST_PASS_TTL_S:
            key = _state_key(self.config, "last-pass")
            logger.warning("rescoring: the last-pass record %s is no pass's (%.200r): "
                           "deleted", key, last)
            self.client.delete(key)  # (as a lock without an expiry: the pass writes its own)
            return False
        return since < wait

    def _pass(self, now_s: float) -> PassReport:
        started = time.perf_counter()
        snapshot = self.gather_snapshot(now_s)
        queues = self.queues()
        if gone := self.prune_departed(queues):
            queues = [q for q in queues if q not in gone]
        self.expire_dead_letters(queues, now_s)
        seen = rewritten = calls = 0
        max_call = 0.0
        for queue in queues:
            try:
                s, r, k, m = self.rescore_queue(queue, snapshot)
            except redis.ResponseError as exc:
                # one queue's key of another type (another program's): the others are
                # rescored (raised, it stopped the pass for every queue, every pass)
                logger.warning("rescoring pass: queue %r not rescored (%s)", queue, exc)
                continue
            seen, rewritten, calls, max_call = seen + s, rewritten + r, calls + k, max(max_call, m)
        return PassReport(len(queues), seen, rewritten, calls, max_call * 1000,
                          (time.perf_counter() - started) * 1000)

    def prune_departed(self, queues: list[str]) -> list[str]:
        """Take out of the registry, and out of Redis, what only ever accumulates
        (``pruning.py``): departed workers' direct queues and bindings, stray reply
        queues and, at most every :data:`PRUNE_IDLE_EVERY_S`, idle queues no worker
        consumes. The queues taken out of the registry."""
        from sits_queue.priority import pruning
        from sits_queue.workers.advertise import live_hostnames, read_worker

        prefix = self.config.global_keyprefix
        due = self._sweep_due(PRUNE_IDLE_EVERY_S, PRUNE_MARK)  # (one pass of the fleet's)
        if not due and not any(is_reply_queue(q) or q.endswith(DIRECT_QUEUE_SUFFIX)
                               for q in queues):
            return []
        hosts = live_hostnames(self.client, prefix)
        live = None if not due else [  # (each live record: a read, once a minute)
            r for name in hosts if (r := read_worker(self.client, prefix, name)) is not None]
        return pruning.prune(self.client, self.config, self.scripts, queues, set(hosts), live)

    def expire_dead_letters(self, queues: list[str], now_s: float) -> int:
        """Delete dead letters older than ``dead_letter_ttl_s``, once per
        :func:`sweep_period_s` across every beat (a Redis key says when it last ran):
        between sweeps a pass reads nothing of them. How many went."""
        ttl = self.config.dead_letter_ttl_s
        if ttl <= 0 or not queues or not self._sweep_due(sweep_period_s(ttl)):
            return 0
        dead = {queue: self.keys(queue).dead for queue in queues}
        with self.client.pipeline(transaction=False) as pipe:
            for key in dead.values():
                pipe.hlen(key)
            # One queue's key of another type (another program's) is left out, said
            # once a sweep: it failed the sweep, every period, for every queue.
            held = pipe.execute(raise_on_error=False)
        expired: dict[str, int] = {}
        for (q, key), n in zip(dead.items(), held, strict=True):
            if isinstance(n, Exception):
                logger.warning("dead letters of queue %r not swept: %s", q, n)
            elif n:
                expired[q] = deadletters.expire(self.client, key, now_s - ttl)
        if total := sum(expired.values()):
            logger.info("deleted %d dead letter(s) older than %.0f s: %s", total, ttl,
                        {q: n for q, n in expired.items() if n})
        return total

    def _sweep_due(self, period_s: float, mark: str = "dead-sweep") -> bool:
        """Whether this pass sweeps (the dead letters; ``mark``: another sweep's): none of
        the fleet's passes did within ``period_s``. A mark set under a longer period (the
        TTL lowered since: its 24th, up to an hour) is no reason to wait: dropped, this
        pass sweeps (the lowered TTL took effect only once the old mark ran out)."""
        key, period_ms = _state_key(self.config, mark), max(1, int(period_s * 1000))
        with self.client.pipeline(transaction=False) as pipe:
            pipe.set(key, 1, nx=True, px=period_ms)
            pipe.pttl(key)
            taken, left = pipe.execute()
        if taken:
            return True
        if left == -1 or left > period_ms:  # (-1: no life at all, set by hand)
            self.client.delete(key)
            return bool(self.client.set(key, 1, nx=True, px=period_ms))
        return False

    def rescore_queue(self, queue: str, snapshot: PrioritySnapshot) -> tuple[int, int, int, float]:
        """Rewrite one queue's scores chunk by chunk; returns (seen, rewritten, calls, max s).

        Each chunk is one ``ZADD XX``: atomic, it only updates members still waiting (a
        message picked meanwhile is not re-added), and the new score keeps the arrival
        counter of the score ZSCAN returned (a message's counter never changes).
        """
        keys, chunk = self.keys(queue), self.config.rescore_chunk
        scorer = Scorer(snapshot, self.config)
        known = set(self.config.class_names)
        seen = rewritten = calls = 0
        max_call = 0.0
        cursor = 0
        while True:
            t0 = time.perf_counter()
            cursor, members = self.client.zscan(keys.waiting, cursor, count=chunk)
            metas = self.client.hmget(keys.meta, [m for m, _ in members]) if members else []
            max_call = max(max_call, time.perf_counter() - t0)
            calls += 2 if members else 1
            updates: dict[Any, int] = {}
            for (msg_id, old), raw in zip(members, metas, strict=True):
                if raw is None:
                    continue  # picked between ZSCAN and HMGET: nothing to rewrite
                try:
                    inputs = score_inputs(raw)
                    if inputs[0] not in known:
                        # a class this table lacks (renamed; a peer site's replica taken
                        # over): scored as the worker runs it, in the default class, so
                        # that it still ages
                        inputs = (self.config.default_class, *inputs[1:])
                    new = score_base(scorer.score(*inputs)) + (int(old) & (SEQ_SPAN - 1))
                except (ValueError, KeyError, TypeError, ArithmeticError,
                        RecursionError) as exc:
                    # (a record with an SLA of 0 divides by it; JSON nested thousands
                    # deep): one bad record must not stop the pass over every other message
                    logger.warning("queue %r message %r: unreadable scheduling record (%s); "
                                   "keeping its score", queue, msg_id, exc)
                    continue
                if new != int(old):
                    updates[msg_id] = new
            seen += len(members)
            if updates:
                t0 = time.perf_counter()
                rewritten += int(self.client.zadd(keys.waiting, updates, xx=True, ch=True) or 0)
                max_call = max(max_call, time.perf_counter() - t0)
                calls += 1
            if cursor == 0:
                return seen, rewritten, calls, max_call

    # -- triggers ----------------------------------------------------------------------------
    def check_triggers(self, now_s: float | None = None) -> tuple[str, ...]:
        """Sample RTT, loss and the top class's backlog; rescore now if a §2.2 trigger fires."""
        now_s = clock.now(self.client) if now_s is None else now_s
        rtt_ms = self._rtt_ms()
        saved_done, saved_failed, state = saved_triggers(
            self.client.get(_state_key(self.config, "triggers")))
        done = sum(counter_values(self.client.hgetall(counter_key(self.config, "done")))
                   .values())
        failed = sum(counter_values(self.client.hgetall(counter_key(self.config, "failed")))
                     .values())
        d_done, d_failed = done - saved_done, failed - saved_failed
        # none finished since the last check: no loss reading (not a loss of 0)
        loss = min(1.0, max(0.0, d_failed / d_done)) if d_done > 0 else None
        sample = stats.TriggerSample(rtt_ms=rtt_ms, loss_rate=loss,
                                     oldest_high_wait_ms=self.oldest_top_class_wait_ms(now_s))
        fired, state = stats.evaluate_triggers(state, sample)
        self.client.set(_state_key(self.config, "triggers"), json.dumps(
            {"done": done, "failed": failed, "state": state.__dict__}))
        if fired:
            report = self.rescore_all(now_s, spaced=True)
            logger.info("priority triggers %s fired; rescoring pass: %s", fired, report)
        return fired

    def _rtt_ms(self) -> float:
        """The round trip to Redis, ms: the least of :data:`RTT_PINGS` PINGs. One PING
        timed a process's scheduling too: on a loaded host (a worker starting beside
        others) it fired "rtt" at every check while the route was the same."""
        best = math.inf
        for _ in range(RTT_PINGS):
            t0 = time.perf_counter()
            self.client.ping()
            best = min(best, (time.perf_counter() - t0) * 1000)
        return best

    def oldest_top_class_wait_ms(self, now_s: float) -> float | None:
        top = self.config.top_class
        oldest: float | None = None
        for queue in self.queues():
            keys = self.keys(queue)
            try:
                ids: list[Any] = list(self.client.zrange(keys.waiting, 0, HEAD_PEEK - 1))
                metas = self.client.hmget(keys.meta, ids) if ids else []
            except redis.ResponseError:
                # A queue's key of another type (another program's; the pass says it)
                # is not this queue's backlog: it failed every check, every second.
                continue
            for raw in metas:
                meta = WaitingMeta.read(raw)
                if meta is None:  # gone meanwhile, or not a record: not the backlog
                    continue
                # a queued rescoring pass or pre-warm is not the top-class backlog §2.2
                # watches; a task put after now_s was read (or by a producer whose clock
                # runs ahead) has waited nothing yet
                if meta.options.sla_class == top and meta.task not in UNCOUNTED_TASKS:
                    wait = max(0.0, (now_s - meta.waiting_since_s) * 1000)
                    if not math.isfinite(wait):
                        # a time no producer writes (-1e308, nan): its wait is no wait
                        # (infinite, it failed every check while the record waited)
                        continue
                    oldest = wait if oldest is None else max(oldest, wait)
        return oldest


def saved_triggers(raw: bytes | str | None) -> tuple[float, float, stats.TriggerState]:
    """The trigger check's stored record: tasks done and failed at the last check, and the
    trigger state. A record of another shape (another program's, or an older version's)
    counts as none: raised on, it failed every check, each before the write that would
    have replaced it."""
    saved = json_object(raw) or {}
    done, failed = stored_number(saved.get("done", 0)), stored_number(saved.get("failed", 0))
    state = saved.get("state")
    try:
        kept = stats.TriggerState(**state) if isinstance(state, dict) else stats.TriggerState()
    except TypeError:  # fields it does not have
        kept = stats.TriggerState()
    baseline, loss, streak = kept.rtt_baseline_ms, kept.loss_baseline, kept.loss_streak
    if not ((baseline is None or (is_number(baseline) and finite(baseline) and baseline >= 0))
            and (loss is None or (is_number(loss) and finite(loss) and 0 <= loss <= 1))
            and type(streak) is int and streak >= 0):
        kept = stats.TriggerState()
    return done or 0.0, failed or 0.0, kept


def _seconds(raw: Any) -> float:
    """A stored time stamp; NaN when there is none or it is not a number."""
    try:
        return float(raw)
    except (TypeError, ValueError):
        return math.nan
