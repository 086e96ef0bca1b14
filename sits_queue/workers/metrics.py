"""The worker's metrics: cold starts by phase, tasks, failures, devices (MISSION §4.1, §5).

Pool children count into the worker's counters hash in Redis (see
:mod:`sits_queue.workers.advertise`), which outlives a child replaced after a hard time
limit; with ``metrics_port`` set, the worker's main process serves them to Prometheus at
``http://<host>:<port>/metrics``, read from that hash and the worker's advertisement at
each scrape. Children never serve: a prefork child has no HTTP thread and would only
count what it ran itself.

Counter fields (``HINCRBY``/``HINCRBYFLOAT``; plain numbers, so the hash stays readable
with ``redis-cli``):

* ``tasks`` / ``tasks:<class>``: inference tasks that got their engine (a pre-warm,
  ``sits.prewarm``, is not one: it counts in ``prewarms``, so it neither inflates the
  cold-start share nor the model's service time; a task that yielded its slot counts
  once, on its first run, however many runs it takes);
* ``model_cold:<model>`` / ``model_cold_ms:<model>``: the model's loads from disk and
  their cost, pre-warms' too (the pre-warm planner's predicted cold start, §4.2: what a
  worker without the model pays; a promotion from the shadow pool is not that);
* ``cold`` / ``cold:<source>`` / ``cold_ms``: those that paid a cold start, by where the
  engine came from (``host``: promoted from the shadow pool; ``disk``: loaded);
* ``phase_ms:<phase>``: ms spent per cold-start phase (``cuda_ctx``, ``load``,
  ``promote``, ``warmup``);
* ``cold_le:<ms>``: cold starts per bucket of :data:`COLD_BUCKETS_MS` (not cumulative);
* ``failed:<reason>``: inference tasks that failed, by reason;
* ``ftt`` / ``ftt_ms`` / ``ftt_le:<ms>``: generations that made a first token, the ms
  from their run's start to it (``firsttoken.py``, §4.4), per bucket of the same bounds.

Labels are bounded (§5): classes come from the class table, sources and phases are
fixed, reasons are the names of our own errors plus ``SoftTimeLimitExceeded`` and
``other``; hostnames and pool slots are as many as the fleet has.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import redis
from celery import bootsteps
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded
from prometheus_client import start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from sits_queue.checks import stored_number
from sits_queue.config import SitsConfig
from sits_queue.errors import SitsError
from sits_queue.workers import advertise, devices
from sits_queue.workers.advertise import as_mapping

logger = logging.getLogger(__name__)

#: Phases of a cold start, as :class:`sits_queue.cache.pool.ColdStart` times them.
PHASES = ("cuda_ctx", "load", "promote", "warmup")
#: Where a cold task's engine came from.
SOURCES = ("host", "disk")
#: Upper bounds of the cold-start (and first-token) histograms, ms: a host-to-device
#: promotion of a small engine is ~1 ms, a first CUDA context 100-200 ms, a large engine
#: from disk seconds.
COLD_BUCKETS_MS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
_MS_PER_S = 1000.0
#: Control flow, not failure: a yield (``Preempted`` is a ``Reject``), a retry, an ignore.
_NOT_FAILURES = (Reject, Retry, Ignore)


# -- pure: what one task adds ------------------------------------------------------------------

def _bucket(ms: float) -> str:
    for bound in COLD_BUCKETS_MS:
        if ms <= bound:
            return str(bound)
    return "+Inf"


def task_fields(meta: Mapping[str, Any], sla_class: str, model: str | None = None,
                tasks: int = 1, prewarm: bool = False, resumed: bool = False
                ) -> dict[str, float]:
    """Counter increments for one inference run of ``tasks`` tasks (a batch: more than
    one) that got its engine; ``meta`` is the result's ``sits`` block (``cold``,
    ``source``, ``<phase>_ms``, ``affinity``). With the ``model``, its loads from disk
    and their cost per model too (the pre-warm planner's). A batch's cold start counts
    once: it is one load, however many tasks waited for it. A ``prewarm`` counts as one
    pre-warm, not a task: it is cold by design (its load cost still counts). A
    ``resumed`` run (of a task that yielded its slot, time slices) is the same task
    again: no new task, but a cold start it pays is one (its engine left meanwhile).

    The cold-start share is over task runs (``runs``, ``cold_runs``): each member of a
    batch waited for its one load, and each run of a resumed task is one that did or did
    not wait (over ``tasks``, a task resumed cold after a warm first run counted a cold
    start and no task, and the share passed 1)."""
    phases = {p: float(meta.get(f"{p}_ms") or 0.0) for p in PHASES}
    total = sum(phases.values())
    source = meta.get("source")
    fields: dict[str, float] = {}
    if meta.get("cold") and source == "disk" and model is not None:
        fields.update({f"model_cold:{model}": 1, f"model_cold_ms:{model}": total})
    if prewarm:
        return {**fields, "prewarms": 1}
    if not resumed:
        fields.update({"tasks": tasks, f"tasks:{sla_class}": tasks})
    fields["runs"] = tasks
    if meta.get("cold"):
        fields["cold_runs"] = tasks
    if meta.get("affinity"):
        fields["affinity"] = 1
    if not meta.get("cold"):
        return fields
    fields.update({"cold": 1, "cold_ms": total, f"cold_le:{_bucket(total)}": 1,
                   f"cold:{source if source in SOURCES else 'other'}": 1})
    fields.update({f"phase_ms:{p}": ms for p, ms in phases.items() if ms})
    return fields


def run_fields(model: str, run_ms: float, tasks: int = 1) -> dict[str, float]:
    """Counter increments for one finished run of ``tasks`` tasks: the model's service
    time (per task: a batch's run time is shared by its tasks). A run that yielded its
    slot (``tasks`` 0) adds its time to the task that finishes later."""
    fields = {f"model_run_ms:{model}": run_ms}
    if tasks:
        fields[f"model_runs:{model}"] = tasks
    return fields


def joined_fields(sla_class: str, joined: int) -> dict[str, float]:
    """Counter increments for tasks that joined a running batch (``joins.py``): served
    with the engine the batch held (never a cold start)."""
    return {**task_fields({}, sla_class, tasks=joined), "joined": joined}


def first_token_fields(ms: float, tasks: int = 1) -> dict[str, float]:
    """Counter increments for a run whose first new token came ``ms`` after it began;
    every task of a batch waited that long for its own."""
    return {"ftt": tasks, "ftt_ms": ms * tasks, f"ftt_le:{_bucket(ms)}": tasks}


def prefix_fields(cached_tokens: int) -> dict[str, float]:
    """Counter increments for one generation's KV-prefix lookup (``cache/prefix.py``):
    a hit and the prompt tokens whose prefill it skipped, or just the lookup."""
    if cached_tokens > 0:
        return {"kv_lookups": 1, "kv_hits": 1, "kv_tokens": cached_tokens}
    return {"kv_lookups": 1}


def embed_fields(texts: int, cached: int) -> dict[str, float]:
    """Counter increments for one embedding call: texts asked for, served from cache."""
    return {"emb_texts": texts, "emb_cached": cached}


def failure_reason(exc: BaseException) -> str | None:
    """The ``reason`` label of a failed inference task; None when it is not a failure."""
    if isinstance(exc, _NOT_FAILURES):
        return None
    if isinstance(exc, SitsError | SoftTimeLimitExceeded):
        return type(exc).__name__
    return "other"


def failure_fields(reason: str, tasks: int = 1) -> dict[str, float]:
    return {"failed": tasks, f"failed:{reason}": tasks}


def merge(into: dict[str, float], fields: Mapping[str, float]) -> None:
    for name, value in fields.items():
        into[name] = into.get(name, 0.0) + value


# -- pure: families from what Redis holds --------------------------------------------------

def families(workers: Iterable[Mapping[str, Any]], class_names: Iterable[str]
             ) -> list[Metric]:
    """Prometheus families for worker records (``advertise.read_workers`` shape, plus the
    raw counters hash under ``counters``)."""
    out = _Families(tuple(class_names))
    for w in workers:
        out.add(w)
    return out.all()


class _Families:
    """The worker families, filled one worker record at a time."""

    def __init__(self, classes: tuple[str, ...]) -> None:
        self.classes = classes
        self.info = GaugeMetricFamily("sits_worker_info", "A live SITS worker (value 1).",
                                      labels=["worker", "host", "pid"])
        self.slots = GaugeMetricFamily("sits_worker_slots", "Pool children (one per GPU by "
                                       "default).", labels=["worker"])
        self.tasks = CounterMetricFamily("sits_inference_tasks", "Inference tasks that got "
                                         "their engine, by SLA class.",
                                         labels=["worker", "sla_class"])
        self.cold = CounterMetricFamily("sits_cold_starts", "Inference tasks that paid a cold "
                                        "start, by where the engine came from.",
                                        labels=["worker", "source"])
        self.prewarms = CounterMetricFamily("sits_prewarms", "Pre-warms (sits.prewarm, "
                                            "MISSION 4.2) the worker ran; not counted as "
                                            "inference tasks or cold starts.",
                                            labels=["worker"])
        self.prewarm_failed = CounterMetricFamily(
            "sits_prewarm_failures", "Pre-warms that failed (the model did not load); not "
            "counted as failed inference tasks.", labels=["worker"])
        self.ahead = CounterMetricFamily("sits_affinity_picks", "Inference tasks taken ahead "
                                         "of their queue's head because the worker held "
                                         "their model warm.", labels=["worker"])
        self.joined = CounterMetricFamily("sits_batch_joined", "Generation tasks that joined "
                                          "a running batch's freed rows (continuous "
                                          "batching).", labels=["worker"])
        self.kv = CounterMetricFamily("sits_kv_prefix", "KV-prefix cache of generations: "
                                      "lookups, hits, and prompt tokens whose prefill a hit "
                                      "skipped.", labels=["worker", "kind"])
        self.emb = CounterMetricFamily("sits_embedding_texts", "Texts embedded, and those "
                                       "served from the embedding cache (MISSION 4.4).",
                                       labels=["worker", "kind"])
        self.share = GaugeMetricFamily("sits_cold_start_share", "Share of inference task "
                                       "runs that paid a cold start (MISSION 4.4); a "
                                       "batch's members, a resumed task's runs each count.",
                                       labels=["worker"])
        self.phase = CounterMetricFamily("sits_cold_start_phase_seconds", "Time spent per "
                                         "cold-start phase (MISSION 4.1).",
                                         labels=["worker", "phase"])
        self.hist = HistogramMetricFamily("sits_cold_start_seconds", "Cost of one cold "
                                          "start, all phases.", labels=["worker"])
        self.first = HistogramMetricFamily("sits_first_token_seconds", "Time from an "
                                           "inference run's start to its first new token, "
                                           "cold start included (MISSION 4.4).",
                                           labels=["worker"])
        self.failed = CounterMetricFamily("sits_inference_failures", "Inference tasks that "
                                          "failed, by reason.", labels=["worker", "reason"])
        self.vram = GaugeMetricFamily("sits_device_vram_bytes", "Device memory from NVML.",
                                      labels=["worker", "device", "state"])
        self.util = GaugeMetricFamily("sits_device_utilisation_ratio", "Device utilisation "
                                      "from NVML, 0-1.", labels=["worker", "device"])
        self.warm = GaugeMetricFamily("sits_warm_engines", "Engines in a pool child's warm "
                                      "cache, by tier.", labels=["worker", "slot", "tier"])
        self.allocated = GaugeMetricFamily("sits_child_allocated_bytes", "Device memory a "
                                           "pool child's allocator holds.",
                                           labels=["worker", "slot"])

    def all(self) -> list[Metric]:
        return [self.info, self.slots, self.tasks, self.cold, self.prewarms,
                self.prewarm_failed, self.ahead,
                self.joined, self.kv, self.emb, self.share, self.phase, self.hist,
                self.first, self.failed, self.vram, self.util, self.warm, self.allocated]

    def add(self, w: Mapping[str, Any]) -> None:
        name = str(w.get("hostname", "?"))
        self.info.add_metric([name, str(w.get("host", "")), str(w.get("pid", ""))], 1)
        self.slots.add_metric([name], _number(w.get("concurrency")) or 0.0)
        self._counters(name, advertise.counter_values(w.get("counters") or {}))
        listed = w.get("devices")
        for d in map(as_mapping, listed if isinstance(listed, list) else []):
            self._device(name, d)
        for slot, child in sorted(as_mapping(w.get("children")).items()):
            self._child(name, str(slot), as_mapping(child))

    def _counters(self, name: str, values: Mapping[str, float]) -> None:
        by_class = advertise.counter_group(values, "tasks:")
        for cls in sorted(set(self.classes) | set(by_class)):
            self.tasks.add_metric([name, cls], by_class.get(cls, 0.0))
        by_source = advertise.counter_group(values, "cold:")
        for source in sorted(set(SOURCES) | set(by_source)):
            self.cold.add_metric([name, source], by_source.get(source, 0.0))
        self.prewarms.add_metric([name], values.get("prewarms", 0.0))
        self.prewarm_failed.add_metric([name], values.get("prewarm_failures", 0.0))
        self.ahead.add_metric([name], values.get("affinity", 0.0))
        self.joined.add_metric([name], values.get("joined", 0.0))
        for kind in ("lookups", "hits", "tokens"):
            self.kv.add_metric([name, kind], values.get(f"kv_{kind}", 0.0))
        for kind in ("texts", "cached"):
            self.emb.add_metric([name, kind], values.get(f"emb_{kind}", 0.0))
        self.share.add_metric([name], advertise.cold_share(values))
        by_phase = advertise.counter_group(values, "phase_ms:")
        for p in PHASES:
            self.phase.add_metric([name, p], by_phase.get(p, 0.0) / _MS_PER_S)
        self.hist.add_metric([name], _buckets(values, "cold_le:"),
                             sum_value=values.get("cold_ms", 0.0) / _MS_PER_S)
        self.first.add_metric([name], _buckets(values, "ftt_le:"),
                              sum_value=values.get("ftt_ms", 0.0) / _MS_PER_S)
        for reason, count in advertise.counter_group(values, "failed:").items():
            self.failed.add_metric([name, reason], count)

    def _device(self, name: str, d: Mapping[str, Any]) -> None:
        label = devices.label(d.get("kind", "?"), d.get("index", 0), d.get("uuid"))
        for state, key in (("total", "total_vram_bytes"), ("free", "free_vram_bytes")):
            if (v := _number(d.get(key))) is not None:
                self.vram.add_metric([name, label, state], v)
        if (v := _number(d.get("utilisation_pct"))) is not None:
            self.util.add_metric([name, label], v / 100.0)

    def _child(self, name: str, slot: str, child: Mapping[str, Any]) -> None:
        tiers: dict[str, int] = {}
        for tier in as_mapping(child.get("warm")).values():
            tiers[str(tier)] = tiers.get(str(tier), 0) + 1
        for tier in sorted(set(tiers) | {"device", "host"}):
            self.warm.add_metric([name, slot, tier], tiers.get(tier, 0))
        memory = as_mapping(child.get("memory"))
        self.allocated.add_metric([name, slot], _number(memory.get("allocated_bytes")) or 0.0)


def _number(value: Any) -> float | None:
    """A record's number; None for what is not one (an older or foreign writer's)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    return stored_number(value)


def _buckets(values: Mapping[str, float], prefix: str) -> list[tuple[str, float]]:
    """Cumulative histogram buckets (seconds) from per-bucket counters ``<prefix><ms>``."""
    per_bucket = advertise.counter_group(values, prefix)
    running, buckets = 0.0, []
    for bound in (*map(str, COLD_BUCKETS_MS), "+Inf"):
        running += per_bucket.get(bound, 0.0)
        le = bound if bound == "+Inf" else repr(int(bound) / _MS_PER_S)
        buckets.append((le, running))
    return buckets


# -- the Redis edge ----------------------------------------------------------------------------

def read(client: redis.Redis, prefix: str, hostname: str | None = None
         ) -> list[dict[str, Any]]:
    """Live workers (or the one named) with their raw counters, for :func:`families`."""
    if hostname is None:
        records = advertise.read_workers(client, prefix)
    else:
        one = advertise.read_worker(client, prefix, hostname)
        records = [one] if one is not None else []
    for record in records:
        record["counters"] = client.hgetall(
            advertise.counters_key(prefix, str(record.get("hostname"))))
    return records


def queue_families(queues: Iterable[Mapping[str, Any]]) -> list[Metric]:
    """Per-queue gauges from ``sitsq status``'s queue rows (``status.queue_status``)."""
    out: list[Metric] = []
    for field, help_text in (("waiting", "Tasks waiting in the sorted set."),
                             ("unacked", "Tasks a worker holds (running or reserved)."),
                             ("dead", "Dead-lettered tasks (poison, malformed, unknown)."),
                             ("checkpointed", "Tasks with a yielded time slice's progress saved: "
                              "waiting to resume, or running a resumed slice."),
                             ("held", "Waiting tasks a worker released (for want of VRAM, a "
                              "rate limit's token) and holds off from itself for now.")):
        family = GaugeMetricFamily(f"sits_queue_{field}", help_text, labels=["queue"])
        for q in queues:
            if q.get(field) is not None:  # None: its key could not be read (not 0)
                family.add_metric([str(q["queue"])], float(q[field]))
        out.append(family)
    return out


#: Models given pre-warm gauges, the most predicted demand first (bounded labels, §5).
PREWARM_MODELS = 20


def prewarm_families(last: Mapping[str, Any] | None) -> list[Metric]:
    """Fleet gauges of the pre-warm planner's last pass (``status.prewarm_status``: the
    record with its ``age_s``); none before any pass or for a record not readable."""
    if not last or "error" in last or not isinstance(last.get("outlooks"), list):
        return []
    age = GaugeMetricFamily("sits_prewarm_last_pass_age_seconds",
                            "Seconds since the pre-warm planner's last pass (§4.2).")
    if (seconds := _number(last.get("age_s"))) is not None:
        age.add_metric([], seconds)
    gauges = {field: GaugeMetricFamily(f"sits_prewarm_{name}", text, labels=["model"])
              for field, name, text in (
                  ("predicted", "predicted_tasks", "Tasks the model's forecast expects in "
                   "the next interval, as of the last pass."),
                  ("instances", "instances_wanted", "Warm instances (pool children) the "
                   "last pass wanted: ceil(concurrency x 1.3), or 0."),
                  ("warm_now", "instances_warm", "Warm instances the last pass counted."))}
    sent = GaugeMetricFamily("sits_prewarm_sent", "Pre-warms the last pass sent.",
                             labels=["model"])
    outlooks = [o for o in last["outlooks"] if isinstance(o, Mapping)
                and isinstance(o.get("model"), str)]
    outlooks.sort(key=lambda o: -(_number(o.get("predicted")) or 0.0))
    shown = outlooks[:PREWARM_MODELS]
    for o in shown:
        for field, family in gauges.items():
            if (value := _number(o.get(field))) is not None:
                family.add_metric([o["model"]], value)
    counts = {o["model"]: 0 for o in shown}
    for s in last.get("sent") or []:
        if isinstance(s, Mapping) and s.get("model") in counts:
            counts[s["model"]] += 1
    for model, n in counts.items():
        sent.add_metric([model], n)
    return [age, *gauges.values(), sent]


class WorkerCollector(Collector):
    """What Prometheus scrapes: read from Redis at each scrape (a few round trips).

    ``hostname``: that worker only (its own endpoint); None: every live worker, and with
    ``queues`` (a function of the client giving ``status.queue_status`` rows) the queues too
    and with ``prewarm`` (one giving ``status.prewarm_status``) the last pre-warm pass
    (``sitsq metrics``, one endpoint for the fleet).
    """

    def __init__(self, config: SitsConfig, hostname: str | None = None,
                 queues: Callable[[redis.Redis], list[dict[str, Any]]] | None = None,
                 prewarm: Callable[[redis.Redis], dict[str, Any] | None] | None = None
                 ) -> None:
        self.config, self.hostname, self.queues = config, hostname, queues
        self.prewarm = prewarm

    def collect(self) -> Iterator[Metric]:
        client = advertise.client_for(self.config)
        up = GaugeMetricFamily("sits_redis_up", "1 when this scrape could read Redis; 0: "
                               "workers and queues unknown (not absent).")
        try:
            workers = read(client, self.config.global_keyprefix, self.hostname)
            queues = self.queues(client) if self.queues is not None else None
            last = self.prewarm(client) if self.prewarm is not None else None
            up.add_metric([], 1)
        except (redis.RedisError, ValueError) as exc:
            # A scrape answers with what it can: Prometheus shows the gap, the worker lives.
            logger.warning("metrics scrape could not read Redis: %s", exc)
            workers, queues, last = [], None, None
            up.add_metric([], 0)
        yield up
        yield from families(workers, self.config.class_names)
        if queues is not None:
            yield from queue_families(queues)
        yield from prewarm_families(last)


# -- serving, in the worker's main process -----------------------------------------------------

_server: Any = None


def serve(config: SitsConfig, hostname: str | None,
          queues: Callable[[redis.Redis], list[dict[str, Any]]] | None = None,
          strict: bool = False,
          prewarm: Callable[[redis.Redis], dict[str, Any] | None] | None = None) -> Any:
    """Start the ``/metrics`` endpoint (a daemon thread); None when the port is off or
    taken (``strict``: the OSError is raised, for a command whose only job this is)."""
    global _server
    if not config.metrics_port:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(config, hostname, queues, prewarm))
    try:
        _server, _ = start_http_server(config.metrics_port, addr=config.metrics_addr,
                                       registry=registry)
    except OSError as exc:
        if strict:
            raise
        # Serve tasks anyway, and say how to fix it: a port taken (most often by another
        # worker on this host) or an address this host does not have.
        hint = ("give each worker on a host its own SITS_METRICS_PORT"
                if exc.errno == errno.EADDRINUSE else
                # (a port under 1024 without the privilege: the address was blamed)
                "choose a SITS_METRICS_PORT of 1024 or more, or give the worker the "
                "privilege to bind it" if exc.errno in (errno.EACCES, errno.EPERM) else
                "check SITS_METRICS_ADDR: an address of this host, or 0.0.0.0")
        logger.error("metrics endpoint not started: cannot listen on %s:%d (%s); %s",
                     config.metrics_addr, config.metrics_port, exc, hint)
        return None
    addr = config.metrics_addr
    logger.info("metrics at http://%s:%d/metrics",
                f"[{addr}]" if ":" in addr else addr,  # (IPv6, as a URL writes it)
                _server.server_address[1])
    return _server


def stop() -> None:
    global _server
    if _server is not None:
        _server.shutdown()
        _server.server_close()
        _server = None


def forget_in_child() -> None:
    """A forked pool child closes its copy of the listening socket (it never accepts)."""
    global _server
    if _server is not None:
        _server.socket.close()
        _server = None


class MetricsServer(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker step: the Prometheus endpoint, when ``metrics_port`` is set."""

    requires = ("celery.worker.components:Pool",)
    name = "SITS metrics"

    def start(self, w: Any) -> None:
        serve(w.app.sits, w.hostname)

    def stop(self, w: Any) -> None:
        stop()
