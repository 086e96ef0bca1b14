"""Configuration as frozen, validated data.

Environment is read only in :meth:`SitsConfig.from_env`; a TOML file only in
:meth:`SitsConfig.from_file`. Everything else receives a ``SitsConfig``.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from sits_queue import checks, envnames, redisurl
from sits_queue.broker.affinity import AffinityPolicy
from sits_queue.checks import MAX_DURATION_S as MAX_DURATION_S
from sits_queue.errors import ConfigError
from sits_queue.redisurl import check_redis_url as check_redis_url
from sits_queue.redisurl import redacted as redacted
from sits_queue.redisurl import without_credentials as without_credentials

#: Used by ``celery -A sits_queue worker`` when nothing is configured, as Celery users expect.
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
#: The cache byte budgets' variables (``cache/budgets.py`` reads them in the worker): no
#: SitsConfig fields, but settings all the same, so a near miss of one is warned about.
CACHE_BYTES_VARS = ("SITS_DEVICE_CACHE_BYTES", "SITS_HOST_CACHE_BYTES",
                    "SITS_KV_PREFIX_CACHE_BYTES")


#: Most tasks one batch may take: bounds one pick's Lua work and one pool job's inputs.
MAX_BATCH_TASKS = 1024

#: An SLA longer than a day is not a latency SLA (a task's, or its class's), ms; nor is
#: one under a microsecond (the score divides by it).
MIN_LATENCY_SLA_MS, MAX_LATENCY_SLA_MS = 1e-3, 86_400_000.0
#: §2.2: a task type's loss sensitivity is a preset in this range (a task's, or its class's).
MIN_LOSS_SENSITIVITY, MAX_LOSS_SENSITIVITY = 0.1, 0.9


@dataclass(frozen=True)
class ClassQuota:
    """One business SLA class: its share of a node and its place in the priority model."""

    name: str
    #: CPU cores a task of this class may use (affinity and torch threads).
    cpu_cores: int
    #: Hard VRAM limit for one task of this class, GiB.
    vram_gib: float
    #: Celery hard time limit for one run, seconds (MISSION §1.4 "max single run s").
    max_run_s: float
    #: Multiplier on the §2.1 latency priority; ranks classes against each other.
    weight: float
    #: Default latency SLA for the class, ms (§2.1 ``latency_sla_ms``).
    latency_sla_ms: float
    #: Default loss sensitivity for the class, in [0.1, 0.9] (§2.2).
    loss_sensitivity: float
    #: The class's time-slice quota (§1.4), ms: a task of it runs at least this long
    #: before it yields to a heavier class at a yield point; 0: the global ``slice_ms``.
    slice_ms: float = 0.0

    def __post_init__(self) -> None:
        checks.check_types(self, f"class {self.name!r}: ")
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"class name {self.name!r} must be a non-empty identifier")
        checks.positive(f"class {self.name}: cpu_cores", self.cpu_cores)
        checks.positive(f"class {self.name}: vram_gib", self.vram_gib)
        checks.positive(f"class {self.name}: max_run_s", self.max_run_s)
        checks.positive(f"class {self.name}: weight", self.weight)
        # the range a task's own latency_sla_ms must be in: a class past it made every
        # task of the class (the default one: every foreign message) refused
        checks.interval(f"class {self.name}: latency_sla_ms", self.latency_sla_ms,
                        MIN_LATENCY_SLA_MS, MAX_LATENCY_SLA_MS)
        checks.interval(f"class {self.name}: loss_sensitivity", self.loss_sensitivity,
                        MIN_LOSS_SENSITIVITY, MAX_LOSS_SENSITIVITY)
        # (as the global one's: 1e12 was taken, where SITS_SLICE_MS=1e12 was refused)
        checks.interval(f"class {self.name}: slice_ms", self.slice_ms, 0, 3_600_000,
                        open_hi=True, note=" ms (0: the global slice_ms)")


#: MISSION §1.4 defaults for an A100-80G node. Weights and SLAs are ours: the source gives
#: an ordering (risk control outranks summaries), not numbers.
DEFAULT_CLASSES: tuple[ClassQuota, ...] = (
    ClassQuota("high", cpu_cores=16, vram_gib=64, max_run_s=45, weight=100.0,
               latency_sla_ms=800, loss_sensitivity=0.9),
    ClassQuota("medium", cpu_cores=8, vram_gib=32, max_run_s=30, weight=10.0,
               latency_sla_ms=2000, loss_sensitivity=0.5),
    ClassQuota("low", cpu_cores=4, vram_gib=8, max_run_s=10, weight=1.0,
               latency_sla_ms=5000, loss_sensitivity=0.2),
)


@dataclass(frozen=True)
class PriorityWeights:
    """Weights of the combined priority score (see ``sits_queue.priority.model``)."""

    #: §2.2 QoS weights: jitter, bandwidth non-compliance, loss sensitivity. Sum to 1.
    qos_jitter: float = 0.4
    qos_bandwidth: float = 0.35
    qos_loss: float = 0.25
    #: How much a QoS score of 1 multiplies priority: ``1 + qos_gain * qos``.
    qos_gain: float = 0.5
    #: How much the hottest model multiplies priority: ``1 + hotness_gain * hotness``.
    hotness_gain: float = 0.5
    #: How much a maximal-entropy input divides priority: ``1 - entropy_gain * entropy``.
    entropy_gain: float = 0.2
    #: Cap on §2.1 ``risk`` so one bad p95 cannot swamp the class weights.
    risk_cap: float = 4.0
    #: A task gains no aging boost before it has waited this long, s: short-term order stays
    #: strictly by class, so a burst of old low tasks cannot push fresh mid-class work back.
    aging_start_s: float = 20.0
    #: A task that has waited this long outranks a fresh top-class task at nominal priority
    #: (no starvation; see ``sits_queue.priority.model.starvation_bound_s`` for boosts).
    aging_bound_s: float = 60.0

    def __post_init__(self) -> None:
        checks.check_types(self, "priority weight ")
        total = self.qos_jitter + self.qos_bandwidth + self.qos_loss
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ConfigError(f"QoS weights must sum to 1, got {total:.4f}")
        for f in fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"priority weight {f.name} must be finite and >= 0, got {value}")
        if self.entropy_gain >= 1:
            raise ConfigError("entropy_gain must be < 1 so priority stays positive")
        if self.risk_cap < 1:
            raise ConfigError("risk_cap must be >= 1 (risk is never below 1)")
        checks.positive("aging_bound_s", self.aging_bound_s)
        if not 0 <= self.aging_start_s < self.aging_bound_s:
            raise ConfigError(f"aging_start_s must be in [0, aging_bound_s), got "
                              f"{self.aging_start_s} (bound {self.aging_bound_s})")


@dataclass(frozen=True)
class SitsConfig:
    """Everything the app, broker, beat and CLI need."""

    #: Broker, result backend and beat scheduler state.
    redis_url: str = DEFAULT_REDIS_URL
    classes: tuple[ClassQuota, ...] = DEFAULT_CLASSES
    #: Class of a task that names none.
    default_class: str = "medium"
    #: Soft time limit = ``soft_limit_fraction * max_run_s`` (the hard limit).
    soft_limit_fraction: float = 0.8
    #: Beat period of the full rescoring pass, seconds.
    rescore_interval_s: float = 5.0
    #: Beat period of the cheap §2.2 trigger check, seconds.
    trigger_check_interval_s: float = 1.0
    #: Waiting tasks rescored per ZSCAN/ZADD round: bounds how long one call holds Redis.
    rescore_chunk: int = 256
    #: Completed-task latencies kept per class for the observed p95.
    stats_window: int = 512
    #: Unacked message is redelivered after this long without a heartbeat, seconds.
    #: Workers refresh the deadline of every message they hold every third of it.
    visibility_timeout_s: float = 60.0
    #: A message redelivered more often than this is dead-lettered (it keeps killing workers).
    max_redeliveries: int = 5
    #: A worker process on this host (and pid namespace) that died holding messages has
    #: them restored by the next sweep tick of a worker here, not after the visibility
    #: timeout (``broker/holders.py``). Off: this worker neither says which process it
    #: is nor looks for dead neighbours; what it held waits for the timeout, as for a
    #: worker on another host.
    reclaim_dead_holders: bool = True
    #: A dead letter is deleted this long after it was dead-lettered, s (0: kept until
    #: ``sitsq dead drop``). Its task's result says FAILURE already; the record keeps the
    #: whole payload (a prompt, a batch of texts) for a person to look at, and a producer
    #: of poison messages left alone would fill Redis. 14 days, as SQS keeps them at most.
    dead_letter_ttl_s: float = 1_209_600.0
    #: A queue no live worker consumes, holding nothing, with no put for this long, s, is
    #: forgotten by the rescoring pass, with its counters (0: kept): a queue per job left
    #: its keys and registry entry for good. A put, or a worker consuming it, brings it
    #: back.
    idle_queue_forget_s: float = 86_400.0
    #: Publish a task-sent event per submission (Flower's SENT state). Off, as in stock
    #: Celery: it is one more PUBLISH on every ``delay()``; Flower still sees every task
    #: from the worker's received/started/succeeded events.
    send_sent_events: bool = False
    #: A worker for plain (non-inference) tasks only, on any pool: an inference task that
    #: reaches it is left in its queue for another worker. It may run a pool that runs
    #: several tasks in one process (``--pool threads|gevent|eventlet -c N``), whose tasks
    #: go without per-class CPU confinement or VRAM caps (one process cannot give each
    #: task its own).
    plain_tasks_only: bool = False
    #: A worker of an app that registers models imports torch and transformers before its
    #: pool forks, so each child, a replacement after a kill too, starts with them (a
    #: tiny model's first load in a child: ~5 s, nearly all imports, down to ~0.25 s).
    #: Off for a worker that would rather start at once and without them in its parent.
    preimport: bool = True
    #: A worker of several pool children hands each task to a child that fits it: one
    #: on a device that can hold its declared VRAM, the one holding its engine warm
    #: (``workers/steer.py``). Off: Celery's prefork pool chooses, as stock.
    steer_pool: bool = True
    #: Prefix on every Redis key the broker writes (kombu ``global_keyprefix``).
    global_keyprefix: str = ""
    #: Time slices (§1.4), for tasks that call ``self.yield_point()``: a running task
    #: gives its slot to a task of a higher-weight class once it has run this long, ms
    #: (measured: 10 cut ``bench ab``'s high p99 from ~28 to ~19 ms against 20, with no
    #: loss of throughput; 5 gained no more, for ~5% more yields)...
    slice_ms: float = 10.0
    #: ...and that task has waited this long (a slot freeing on its own gets it first), ms,
    yield_wait_ms: float = 2.0
    #: plus this much per class below the running task's own, ms, so that the lowest
    #: running class yields first (off: the urgent task would wait that much longer
    #: whenever only a higher class's task can yield; README, "Time slices");
    yield_rank_wait_ms: float = 0.0
    #: but not when the task says it will finish within this long anyway, ms: a yield and
    #: the later resumption cost about two task dispatches of the pool.
    yield_min_remaining_ms: float = 15.0
    #: Subscribe to a result's channel at every submission, as Celery does, not when it
    #: is first waited on (``broker/resultwait.py``, which says what that changes).
    result_subscribe_on_send: bool = False
    #: Port of the worker's Prometheus endpoint (``/metrics``, served by its main
    #: process); 0: none. Each worker on one host needs its own.
    metrics_port: int = 0
    #: Address it listens on.
    metrics_addr: str = "0.0.0.0"
    #: Affinity-aware pulling (``broker/affinity.py``): a worker looks at this many
    #: waiting tasks from the head for one whose model it holds warm; below 2: off...
    affinity_window: int = 16
    #: ...taking it ahead of the head only if its priority >= the head's / this...
    affinity_priority_ratio: float = 2.0
    #: ...and never once the head has waited this long, ms (bounds what affinity costs
    #: a task that is warm nowhere: about one cold start of a mid-size engine);
    affinity_max_skip_ms: float = 1000.0
    #: an engine in the host tier counts this much of one on the device;
    affinity_host_weight: float = 0.5
    #: a task whose prompt prefix's KV the worker holds adds this much;
    affinity_prefix_weight: float = 0.5
    #: a task's precision adds up to this much on a device relatively strong at it;
    affinity_precision_weight: float = 0.5
    #: a task's roofline bound (its declared ``arithmetic_intensity`` against the
    #: device's ridge point) adds up to this much on a device relatively rich in the
    #: resource that bounds it (§3.1).
    affinity_roofline_weight: float = 0.5
    #: Characters of a prompt the automatic ``prefix_key`` covers (0: derive none).
    prefix_key_chars: int = 256
    #: Same-model batching (``workers/batched.py``): a pick that takes a batchable task
    #: (``sits.embed``, ``@app.batch_inference_task``) also takes the waiting tasks of the
    #: same batch key (task, model, class, precision, time limits) among this many from
    #: the queue's head, up to the task's ``max_batch``, and the worker runs them as one
    #: batch; 0: one at a time...
    batch_window: int = 256
    #: ...and ``max_batch`` of the built-in ``sits.embed`` and of batch tasks that do
    #: not set one (1: no batching).
    batch_max_tasks: int = 32
    #: Continuous batching (``workers/joins.py``): a generation batch takes waiting tasks
    #: of its key into its freed rows: ``auto`` on a worker with GPUs (a decode step
    #: costs about as much for a few rows as for a full batch there), ``on``, ``off``...
    batch_join: str = "auto"
    #: ...during the first this many s of its run.
    batch_join_s: float = 10.0
    #: A batch's time budget (``workers/batchtime.py``): a gathered batch runs only the
    #: calls expected to finish within this share of its time limit, from what its key's
    #: last batches took; the rest go back to their queue for the next batch (0: no cut).
    batch_time_share: float = 0.8
    #: Sites (§2.3, ``priority/sites.py``): this site's name ("" = one site, no sync)...
    site: str = ""
    #: ...its peers, ``name=redis://...`` separated by spaces (``?hops=N&rtt_ms=X`` in a
    #: URL's query: hops away, and an RTT to use instead of measuring one)...
    site_peers: str = ""
    #: ...the link RTT up to which the top class is replicated in the enqueue itself, ms
    #: (the source's 5 ms)...
    site_strong_rtt_ms: float = 5.0
    #: ...the sync pass's period (asynchronous replicas, digests, heartbeats), s...
    site_sync_interval_s: float = 1.0
    #: ...and how long a site may miss heartbeats before its peer takes its work over, s.
    site_dead_after_s: float = 30.0
    #: Quantisation gate (§3.2): a model is served at int8 only when the KL divergence of
    #: its activations, int8 against full precision, stays below this.
    int8_max_kl: float = 0.05
    #: Runtime profile (§3.3): a worker stops taking new tasks while a process of it
    #: holds this share of its file-descriptor limit, or the host has this share of its
    #: memory available or less (it resumes 0.10 below / at twice that).
    throttle_fd_share: float = 0.85
    throttle_mem_share: float = 0.05
    #: Predictive pre-warming (§4.2): the forecast's interval and the beat period of the
    #: planner, s (the source's 5 minutes); 0: off.
    prewarm_interval_s: float = 300.0
    #: Time limit of a pre-warm (``sits.prewarm``), s: it pays a model's load, which can
    #: take minutes (a large TensorRT plan), past any class's ``max_run_s``; its soft
    #: limit is ``soft_limit_fraction`` of it.
    prewarm_time_limit_s: float = 600.0
    #: Dynamic batch size (§1.2): the p95 latency one batch of a large ``sits.embed``
    #: call may take, ms; the controller sizes batches to it.
    batch_target_p95_ms: float = 120.0
    #: Embedding cache of each pool child (§4.4): entries (0: off) and their TTL, s.
    embed_cache_entries: int = 10_000
    embed_cache_ttl_s: float = 1800.0
    #: Host shadow pool aging (§4.3): an engine unused this long leaves it, s (0: never),
    #: and while the host has less than this share of its memory available the children
    #: give back their coldest host-tier engines (0: never).
    host_pool_ttl_s: float = 1800.0
    host_pool_pressure_share: float = 0.10
    #: OpenTelemetry traces (``sits_queue/tracing.py``): auto (on when an OTLP endpoint
    #: is set in ``OTEL_EXPORTER_OTLP_ENDPOINT``), otlp, console or off.
    otel_traces: str = "auto"
    weights: PriorityWeights = field(default_factory=PriorityWeights)

    def __post_init__(self) -> None:
        checks.check_types(self)
        if not isinstance(self.classes, tuple) or not all(
                isinstance(c, ClassQuota) for c in self.classes):
            raise ConfigError(f"classes must be a list of class tables, got {self.classes!r}")
        if not isinstance(self.weights, PriorityWeights):
            raise ConfigError(f"weights must be a table, got {self.weights!r}")
        names = [c.name for c in self.classes]
        if not names:
            raise ConfigError("at least one SLA class is required")
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate SLA class names in {names}")
        if self.default_class not in names:
            raise ConfigError(f"default_class {self.default_class!r} is not one of {names} "
                              "(a [[classes]] list is the whole set of classes)")
        self._check_priority_range()
        check_redis_url(self.redis_url)
        redisurl.check_key_prefix(self.global_keyprefix)
        checks.interval("soft_limit_fraction", self.soft_limit_fraction, 0, 1, open_lo=True,
                        open_hi=True)
        checks.positive("rescore_interval_s", self.rescore_interval_s)
        checks.positive("trigger_check_interval_s", self.trigger_check_interval_s)
        # (past 2^63 Redis refuses the ZSCAN count or LTRIM bound at every pass; long
        # before that a chunk holds Redis, and a window is sorted, for seconds)
        checks.integer("rescore_chunk", self.rescore_chunk, 1_000_000, least=1)
        checks.integer("stats_window", self.stats_window, 1_000_000, least=1)
        checks.integer("max_redeliveries", self.max_redeliveries, 1_000_000, least=1)
        checks.non_negative("dead_letter_ttl_s", self.dead_letter_ttl_s, " s (0: kept)")
        checks.non_negative("idle_queue_forget_s", self.idle_queue_forget_s, " s (0: kept)")
        for name in ("slice_ms", "yield_wait_ms", "yield_rank_wait_ms",
                     "yield_min_remaining_ms", "affinity_max_skip_ms"):
            checks.interval(name, getattr(self, name), 0, 3_600_000, open_hi=True, note=" ms")
        checks.integer("metrics_port", self.metrics_port, 65535, " (0: no endpoint)")
        checks.integer("prefix_key_chars", self.prefix_key_chars, 1_000_000)
        checks.integer("batch_window", self.batch_window, 100_000, " (0: no batching)")
        checks.integer("batch_max_tasks", self.batch_max_tasks, MAX_BATCH_TASKS,
                       " (1: no batching)", least=1)
        if self.batch_join not in ("auto", "on", "off"):
            raise ConfigError(f"batch_join must be auto, on or off, got {self.batch_join!r}")
        checks.interval("batch_join_s", self.batch_join_s, 0, 86_400, open_lo=True,
                        open_hi=True, note=" s")
        checks.interval("batch_time_share", self.batch_time_share, 0, 1, note=" (0: no cut)")
        checks.positive("int8_max_kl", self.int8_max_kl)
        self._check_sites()
        checks.integer("embed_cache_entries", self.embed_cache_entries, 10_000_000, " (0: off)")
        checks.positive("embed_cache_ttl_s", self.embed_cache_ttl_s)
        checks.non_negative("host_pool_ttl_s", self.host_pool_ttl_s, " s (0: never)")
        checks.interval("host_pool_pressure_share", self.host_pool_pressure_share, 0, 1,
                        open_hi=True, note=" (0: never)")
        checks.positive("batch_target_p95_ms", self.batch_target_p95_ms)
        checks.interval("throttle_fd_share", self.throttle_fd_share, 0, 1, open_lo=True)
        # 1 would pause intake for good: no host has all of its memory available
        checks.interval("throttle_mem_share", self.throttle_mem_share, 0, 1, open_lo=True,
                        open_hi=True, note=" (1 would pause intake for good)")
        checks.non_negative("prewarm_interval_s", self.prewarm_interval_s, " (0: off)")
        checks.positive("prewarm_time_limit_s", self.prewarm_time_limit_s)
        if self.otel_traces not in ("auto", "otlp", "console", "off"):
            raise ConfigError(f"otel_traces must be auto, otlp, console or off, got "
                              f"{self.otel_traces!r}")
        try:
            self.affinity  # noqa: B018 - validates the other affinity settings
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        # No bound against the longest run time: workers heartbeat the messages they hold.
        if self.visibility_timeout_s <= 3:
            raise ConfigError(f"visibility_timeout_s must be > 3 s (heartbeat every third), "
                              f"got {self.visibility_timeout_s:g}")

    def _check_priority_range(self) -> None:
        """Queue scores hold a priority up to ``PRIORITY_CEILING`` (~8.9e6): past it every
        priority is one level, served first come first served. Class weights (and the
        boosts' gains) whose fresh priorities, aged up to the starvation bound (as much
        again), would pass it are refused: with weights of 200000 and 100000 a critical
        task queued after a high one ran after it."""
        from sits_queue.broker.keys import PRIORITY_CEILING, PRIORITY_FLOOR
        from sits_queue.priority.model import PRIORITY_SCALE, max_fresh_priority

        highest = 2 * max_fresh_priority(self)
        if highest >= PRIORITY_CEILING:
            raise ConfigError(
                f"class weights up to {max(c.weight for c in self.classes):g} make "
                f"priorities up to {highest:.3g}, past what a queue score orders "
                f"({PRIORITY_CEILING:.3g}): scale the weights down (only their ratios "
                "matter), or the risk_cap / qos_gain / hotness_gain boosts")
        # ...and below the floor, where a score's levels are as far apart as the
        # priorities themselves: weights of 1e-12 .. 1e-14 put every task at level 0,
        # a high task queued after a low one ran after it
        least = min(c.weight for c in self.classes)
        if (lowest := least * PRIORITY_SCALE) < PRIORITY_FLOOR:
            raise ConfigError(
                f"class weights down to {least:g} make "
                f"priorities from {lowest:.3g}, under what a queue score tells apart "
                f"({PRIORITY_FLOOR:g}): scale the weights up (only their ratios matter)")

    def _check_sites(self) -> None:
        from sits_queue.priority import sites

        for name in ("site_strong_rtt_ms", "site_sync_interval_s", "site_dead_after_s"):
            checks.positive(name, getattr(self, name))
        if self.site_dead_after_s <= 2 * self.site_sync_interval_s:
            raise ConfigError(f"site_dead_after_s ({self.site_dead_after_s:g} s) must exceed "
                              f"two site_sync_interval_s ({self.site_sync_interval_s:g} s): a "
                              "site heartbeats once per interval")
        peers = sites.parse_peers(self.site_peers)
        if not self.site:
            if peers:
                raise ConfigError("site_peers needs site (this site's own name)")
            return
        sites.check_site_name(self.site)
        if self.site in {p.name for p in peers}:
            raise ConfigError(f"site_peers lists this site ({self.site!r}) itself")

    # -- lookups -----------------------------------------------------------------------------
    @property
    def affinity(self) -> AffinityPolicy:
        return AffinityPolicy(window=self.affinity_window,
                              priority_ratio=self.affinity_priority_ratio,
                              max_skip_s=self.affinity_max_skip_ms / 1000.0,
                              host_weight=self.affinity_host_weight,
                              prefix_weight=self.affinity_prefix_weight,
                              precision_weight=self.affinity_precision_weight,
                              roofline_weight=self.affinity_roofline_weight)

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    @property
    def top_class(self) -> str:
        """The class with the largest weight (maintenance tasks and backlog triggers use it)."""
        return max(self.classes, key=lambda c: c.weight).name

    def outranking(self, name: str) -> tuple[str, ...]:
        """Classes whose tasks a running task of class ``name`` yields its slot to."""
        weight = self.quota(name).weight
        return tuple(c.name for c in self.classes if c.weight > weight)

    def find_class(self, name: str) -> ClassQuota | None:
        """Class ``name``, or None when this table has none of that name."""
        return next((c for c in self.classes if c.name == name), None)

    def quota(self, name: str) -> ClassQuota:
        if (c := self.find_class(name)) is not None:
            return c
        raise ConfigError(f"unknown SLA class {name!r}; known classes: {list(self.class_names)}")

    def slice_s(self, name: str) -> float:
        """The time-slice quota of class ``name``, s (its own, else ``slice_ms``; a class
        this configuration does not know, from a producer's other table: ``slice_ms``)."""
        own = self.find_class(name)
        return ((own.slice_ms if own is not None else 0.0) or self.slice_ms) / 1000

    def time_limits(self, name: str) -> tuple[float, float]:
        """(soft, hard) Celery time limits for a class, seconds."""
        hard = self.quota(name).max_run_s
        return hard * self.soft_limit_fraction, hard

    # -- sources -----------------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SitsConfig:
        """Build from ``SITS_*`` variables, on top of ``SITS_CONFIG`` (a TOML file) if set."""
        env = os.environ if env is None else env
        envnames.warn_near_misses(env, {"SITS_CONFIG", *CACHE_BYTES_VARS,
                                *("SITS_" + f.name.upper() for f in fields(cls)
                                  if f.name not in ("classes", "weights"))})
        overrides: dict[str, Any] = {}
        for f in fields(cls):
            key = "SITS_" + f.name.upper()
            if key not in env or f.name in ("classes", "weights"):
                continue
            value = env[key]
            if f.name == "redis_url":  # read as sitsq reads it: trimmed, and blank is unset
                # (" redis://..." was refused here and taken by `sitsq redis-url`; " "
                # started the embedded server there and was refused here)
                value = value.strip()
                if not value:
                    continue
            # the field's declared type, not the loaded value's: a file's
            # ``visibility_timeout_s = 60`` must not make "90.5" an invalid int
            kind = checks.KINDS.get(str(f.type), (str, ""))[0]
            overrides[f.name] = checks.coerce(f.name, value, kind)
        try:
            # The file and the variables are checked together: a file invalid on its own
            # that a variable makes whole (a class table without "medium" and
            # SITS_DEFAULT_CLASS) is what the user asked for.
            if env.get("SITS_CONFIG"):
                return cls.from_file(env["SITS_CONFIG"], overrides)
            return cls(**overrides)
        except ConfigError as exc:
            # A range refused names the setting; say which variable set it (the user set
            # SITS_SOFT_LIMIT_FRACTION, and read "soft_limit_fraction must be ...")
            # (by the names with an underscore: "site" is a word of messages too)
            named = [f"SITS_{n.upper()}" for n in overrides
                     if "_" in n and re.search(rf"\b{n}\b", str(exc))]
            if not named:
                raise
            raise ConfigError(f"{exc} (set by {', '.join(named)})") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str],
                  overrides: Mapping[str, Any] | None = None) -> SitsConfig:
        """Build from a TOML file: top-level scalars, ``[weights]``, ``[[classes]]``;
        ``overrides`` (settings by field name) on top."""
        return cls.from_mapping(_read_toml(path), source=str(path), overrides=overrides)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "mapping",
                     overrides: Mapping[str, Any] | None = None) -> SitsConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"{source}: unknown settings {sorted(unknown)}")
        kwargs = dict(data)
        try:
            if "classes" in kwargs:
                if not isinstance(kwargs["classes"], list):
                    raise ConfigError(f"classes must be a list of [[classes]] tables, got "
                                      f"{kwargs['classes']!r}")
                kwargs["classes"] = tuple(_class_from(c) for c in kwargs["classes"])
            if "weights" in kwargs:
                if not isinstance(kwargs["weights"], Mapping):
                    raise ConfigError(f"weights must be a [weights] table, got "
                                      f"{kwargs['weights']!r}")
                _no_unknown(kwargs["weights"], PriorityWeights, "weights")
                kwargs["weights"] = PriorityWeights(**kwargs["weights"])
            return cls(**{**kwargs, **(overrides or {})})
        except (TypeError, ConfigError) as exc:
            raise ConfigError(f"{source}: {exc}") from exc


def _no_unknown(table: Mapping[str, Any], cls: type, where: str) -> None:
    unknown = sorted(set(table) - {f.name for f in fields(cls)})
    if unknown:
        raise ConfigError(f"{where}: unknown settings {unknown}; known: "
                          f"{sorted(f.name for f in fields(cls))}")


def _class_from(entry: Any) -> ClassQuota:
    """A ``[[classes]]`` entry: one named like a default class (high, medium, low) may
    give only the fields it changes; any other gives them all."""
    if not isinstance(entry, Mapping):
        raise ConfigError(f"each [[classes]] entry must be a table, got {entry!r}")
    _no_unknown(entry, ClassQuota, f"class {entry.get('name')!r}")
    base = next((c for c in DEFAULT_CLASSES if c.name == entry.get("name")), None)
    if base is None:
        missing = [f.name for f in fields(ClassQuota)
                   if f.name not in entry and f.default is MISSING]
        if missing:
            raise ConfigError(f"class {entry.get('name')!r} is not a default class, so it "
                              f"must give every field; missing {missing}")
        return ClassQuota(**entry)
    return ClassQuota(**{**asdict(base), **entry})


def _read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {p} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, not UTF-8
        raise ConfigError(f"config file {p} cannot be read: {exc}") from exc


def configured_redis_url(env: Mapping[str, str]) -> str | None:
    """The Redis the user configured: ``SITS_REDIS_URL``, else ``redis_url`` in the
    ``SITS_CONFIG`` file; None when neither says (then ``sitsq`` uses its embedded one)."""
    url = env.get("SITS_REDIS_URL", "").strip()
    if url:
        return check_redis_url(url)
    path = env.get("SITS_CONFIG")
    if not path:
        return None
    data = _read_toml(path)
    return SitsConfig.from_mapping(data, source=path).redis_url if "redis_url" in data \
        else None
