"""Predictive pre-warming (MISSION §4.2), the Redis edge: demand per model per interval
in, the forecasters' state kept, pre-warm tasks out to the chosen workers.

* demand: every finished task counts one for its model in ``sits:demand:<bucket>``
  (``workers/signals.py``), ``bucket = floor(t / prewarm_interval_s)``;
* state: one JSON per model in ``sits:forecast`` (``forecast.to_json``) and the last
  bucket folded in, so a beat restart resumes;
* cold-start cost and service time per model: the workers' counters
  (``model_cold_ms:<m>`` / ``model_cold:<m>``, ``model_run_ms:<m>`` / ``model_runs:<m>``);
* a pre-warm is the built-in inference task ``sits.prewarm`` sent to the chosen worker's
  own queue (Celery's ``worker_direct``): the worker's child loads the engine as for any
  task, so the cost is counted, limited and traced like any cold start.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import redis

from sits_queue.broker import affinity
from sits_queue.checks import text
from sits_queue.config import SitsConfig
from sits_queue.priority import forecast
from sits_queue.workers import advertise, metrics
from sits_queue.workers.advertise import as_mapping, json_object

logger = logging.getLogger(__name__)

#: Intervals a beat that was down catches up on (older ones are skipped: their demand keys
#: have expired; the forecast resumes from the state it had).
MAX_CATCH_UP = 12


def demand_key(config: SitsConfig, bucket: int) -> str:
    return f"{config.global_keyprefix}sits:demand:{bucket}"


def state_key(config: SitsConfig) -> str:
    return f"{config.global_keyprefix}sits:forecast"


def misses_key(config: SitsConfig) -> str:
    """The last pass: its pre-warms, the models' misses (``forecast.missed``), and for
    ``sitsq status`` its time and each model's outlook (:func:`last_pass`)."""
    return f"{config.global_keyprefix}sits:prewarm-misses"


def last_pass(client: redis.Redis, config: SitsConfig) -> dict[str, Any] | None:
    """The last planning pass as recorded (``at``, ``outlooks``, ``sent``, ``misses``,
    ``held_off``); None before any, or for a record of another shape."""
    record = json_object(client.get(misses_key(config)))  # (WRONGTYPE raises: said)
    if record is None or not isinstance(record.get("outlooks"), list):
        return None
    return record


def bucket_of(config: SitsConfig, now_s: float) -> int:
    return int(now_s // config.prewarm_interval_s)


def per_model(counters: Mapping[str, float], total: str, count: str) -> dict[str, float]:
    """Mean per model of ``<total>:<model>`` over ``<count>:<model>`` counters; a model
    whose mean is not a finite number >= 0 (a count of 1e-300, or sums past float's range
    across workers) is left out: unknown, as for a model never run."""
    sums = advertise.counter_group(counters, f"{total}:")
    counts = advertise.counter_group(counters, f"{count}:")
    means = {m: sums[m] / counts[m] for m in sums if counts.get(m, 0.0) > 0}
    return {m: v for m, v in means.items() if math.isfinite(v) and v >= 0}


class Prewarmer:
    """One planning pass per call of :meth:`run` (the beat task ``sits.prewarm_plan``)."""

    def __init__(self, config: SitsConfig, client: redis.Redis,
                 send: Callable[[str, str], None]) -> None:
        self.config, self.client, self.send = config, client, send

    def run(self, now_s: float) -> dict[str, Any]:
        """Fold the finished intervals' demand into the forecasts, plan, send; a report."""
        states = self._fold(bucket_of(self.config, now_s) - 1)
        workers = metrics.read(self.client, self.config.global_keyprefix)
        counters: dict[str, float] = {}
        for w in workers:
            for k, v in advertise.counter_values(w["counters"]).items():
                counters[k] = counters.get(k, 0.0) + v
        cold = per_model(counters, "model_cold_ms", "model_cold")
        service = per_model(counters, "model_run_ms", "model_runs")
        # (a worker of plain tasks only leaves every inference task, its pre-warms too:
        # sent there, they were released in its own queue for good, one more each pass)
        views = [_view(w) for w in workers if not w.get("plain_tasks_only")]
        start = (bucket_of(self.config, now_s)) * self.config.prewarm_interval_s
        outlooks = [forecast.outlook(m, f, start, self.config.prewarm_interval_s,
                                     service.get(m, 0.0), cold.get(m, 0.0),
                                     sum(v.instances(m) for v in views))
                    for m, f in sorted(states.items())]
        last_sent, misses = self._read_misses()
        misses = forecast.missed(last_sent, views, misses, now_s,
                                 self.config.prewarm_interval_s)
        held_off = frozenset(m for m, (_, until) in misses.items() if until > now_s)
        sent = []
        for p in forecast.plan(outlooks, views, held_off):
            try:
                self.send(p.model, p.hostname)
                sent.append(asdict(p))
            except Exception as exc:  # one unreachable worker must not stop the others
                logger.warning("could not send a pre-warm of %r to %s: %s", p.model,
                               p.hostname, exc)
        report = {"outlooks": [asdict(o) for o in outlooks], "sent": sent,
                  "workers": len(views), "held_off": sorted(held_off)}
        # (the beat's task keeps no result: what `sitsq status` says of pre-warming)
        self.client.set(misses_key(self.config), json.dumps(
            {**report, "misses": {m: list(v) for m, v in misses.items()}, "at": now_s}))
        return report

    def _read_misses(self) -> tuple[list[forecast.Prewarm], dict[str, tuple[int, float]]]:
        """The last pass's pre-warms and the misses so far (a record of another shape, or
        a key of another type, which this pass's record replaces: none)."""
        try:
            record = json_object(self.client.get(misses_key(self.config))) or {}
        except redis.ResponseError as exc:  # (raised, it failed every pass for good)
            logger.warning("the last pre-warm pass's record is not readable (%s): "
                           "replaced by this pass's", exc)
            record = {}
        sent, misses = [], {}
        try:
            for p in record.get("sent") or []:
                sent.append(forecast.Prewarm(str(p["model"]), str(p["hostname"])))
            for model, (count, until) in (record.get("misses") or {}).items():
                misses[str(model)] = (int(count), float(until))
        except (KeyError, TypeError, ValueError, AttributeError):
            return [], {}
        return sent, misses

    def _fold(self, last_done: int) -> dict[str, forecast.Forecaster]:
        key = state_key(self.config)
        decoded = {text(k, "replace"): v for k, v in self.client.hgetall(key).items()}
        meta = _json(decoded.pop("__bucket__", None))
        states = {m: forecast.from_json(json_object(v) or {}) for m, v in decoded.items()}
        interval = self.config.prewarm_interval_s
        # [last bucket folded, the interval it counts in]: a bucket index under another
        # interval (the setting changed) is no time here: raised 60 -> 300 s, the next
        # bucket to fold lay centuries ahead and the forecasts froze. Start afresh then.
        if isinstance(meta, list) and len(meta) == 2 and meta[1] != interval:
            logger.info("pre-warm interval changed from %s to %s s: forecasts start afresh",
                        meta[1], interval)
            meta, states = None, {}
            self.client.delete(key)
        done = meta[0] if isinstance(meta, list) and len(meta) == 2 else meta
        if isinstance(done, bool) or not isinstance(done, int):
            done = None  # not a bucket of ours: read what the demand keys still hold
        # the first pass (or one after a long stop) reads what the demand keys still hold
        first = last_done - MAX_CATCH_UP + 1 if done is None \
            else max(done + 1, last_done - MAX_CATCH_UP + 1)
        for bucket in range(first, last_done + 1):
            # (a count that no worker wrote, "abc" or -3, is no demand: it failed the pass)
            counted = advertise.counter_values(
                self.client.hgetall(demand_key(self.config, bucket)))
            demand = {m: v for m, v in counted.items() if v >= 0}
            for model in set(states) | set(demand):
                states[model] = forecast.update(states.get(model, forecast.Forecaster()),
                                                bucket * interval, demand.get(model, 0.0))
        if first <= last_done or meta is None:
            now = (last_done + 1) * interval
            gone = [m for m, f in states.items() if forecast.forgotten(f, now)]
            pipe = self.client.pipeline(transaction=False)
            for model in gone:
                del states[model]
            if gone:
                pipe.hdel(key, *gone)
            for model, f in states.items():
                pipe.hset(key, model, json.dumps(forecast.to_json(f)))
            pipe.hset(key, "__bucket__", json.dumps([last_done, interval]))
            pipe.execute()
        return states


def _view(worker: Mapping[str, Any]) -> forecast.WorkerView:
    """What the planner reads of a worker's record: engines warm on a device, in how many
    children, how many children a pre-warm can go to, free device memory. A field of
    another shape (an older, newer or foreign writer's) counts as none: raised on, it
    stopped the planning for every worker."""
    children = as_mapping(worker.get("children")).values()
    # A model warm at a precision is warm for its demand, which is counted by model: a
    # fleet whose traffic asks for bf16 holds gpt@bf16 only, and each pass took every
    # worker for cold and pre-warmed an as-loaded copy no task used
    holders: Counter[str] = Counter()
    for child in children:
        warm_map = as_mapping(as_mapping(child).get("warm"))
        holders.update({affinity.model_of(str(m)) for m, tier in warm_map.items()
                        if tier == "device"})
    devices = worker.get("devices")
    # A model loads on one device: the roomiest one's free memory, not the sum (a host
    # of eight nearly full GPUs outranked one roomy GPU that could hold the model)
    free = max((_bytes(as_mapping(d).get("free_vram_bytes"))
                for d in (devices if isinstance(devices, list) else [])), default=0)
    # Each child keeps its own engines, so each is an instance; pre-warms reach the
    # children without the model only where the pool is steered (workers/steer.py):
    # Celery's own choice of child can land every one on the same child
    slots = len(advertise.record_slots(worker)) if worker.get("steered") is True else 1
    return forecast.WorkerView(str(worker.get("hostname")), dict(holders), free,
                               max(1, slots))


def _bytes(value: Any) -> int:
    """A byte count from a record; 0 for what is not a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    return max(0, int(value)) if isinstance(value, int) or math.isfinite(value) else 0


def _json(raw: bytes | str | None) -> Any:
    """A stored JSON value; None for one that is not JSON (another program's, or corrupt:
    raised on, it failed every pass until someone deleted it)."""
    try:
        return None if raw is None else json.loads(raw)
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError of bytes
        return None
