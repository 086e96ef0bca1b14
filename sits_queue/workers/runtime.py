"""The GPU worker runtime: one pool child per device, each pinned, capped and kept warm.

Pool choice: **prefork**, one child per GPU. A CUDA context belongs to a process and
cannot survive ``fork`` (celery#6036), and threads would share one context, one
allocator cap (``set_per_process_memory_fraction`` is per *process*) and the GIL.
Prefork is fork-safe here because the parent never touches CUDA: it discovers devices
through NVML (plain numbers, no context), then each child pins itself to its own GPU by
setting ``CUDA_VISIBLE_DEVICES`` in ``worker_process_init``, before anything in it
initialises CUDA. The child's slot is billiard's process *index*, which a replacement
child (after a hard time-limit kill or a crash) inherits, so it lands on the same GPU.

What runs where:

* parent, ``celeryd_init``: NVML discovery; default ``--concurrency`` = number of GPUs
  (1 on a CPU host) unless ``-c`` is given; the admission probe for ``SitsRequest``;
* parent, worker step :class:`PlanStep`: records the final pool size (after ``-c``,
  ``auto``) before the pool forks;
* child, ``worker_process_init``: pinning, and one :class:`ChildRuntime`;
* child, ``task_prerun``: the class's CPU confinement and VRAM cap for every task;
* child, :meth:`ChildRuntime.infer`: the warm engine, cold-start accounting and the
  error mapping for inference tasks.

Pure decisions (which device, which budgets, which cap) are plain functions at the top;
the I/O (``os``, torch via :mod:`gpu`, Redis via :mod:`advertise`) is below them.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import psutil
from billiard.process import current_process
from celery import Celery, current_app, signals
from celery.exceptions import SoftTimeLimitExceeded

from sits_queue.broker import eviction, grants, intake
from sits_queue.broker.affinity import DEVICE_TIER
from sits_queue.cache.budgets import CacheBudgets, children_per_device
from sits_queue.config import ClassQuota, SitsConfig
from sits_queue.errors import ConfigError
from sits_queue.workers import (
    advertise,
    childgc,
    cores,
    deferred,
    devices,
    etaorder,
    freemem,
    gpu,
    latelimit,
    metrics,
    profile,
    ratelimits,
    reap,
    routingversions,
    sitebeat,
    softsignal,
    stacks,
    steer,
)
from sits_queue.workers import request as admission
from sits_queue.workers.devices import Device, Discovery, default_concurrency, discover
from sits_queue.workers.limits import check_engine_fits_class, memory_cap_fraction
from sits_queue.workers.placement import PROCESS_POOLS as PROCESS_POOLS
from sits_queue.workers.placement import WorkerPlan as WorkerPlan
from sits_queue.workers.placement import device_for_slot as device_for_slot
from sits_queue.workers.placement import pin_env as pin_env
from sits_queue.workers.placement import pool_name as pool_name
from sits_queue.workers.placement import pool_problem as pool_problem
from sits_queue.workers.placement import slot_devices as slot_devices
from sits_queue.workers.placement import unused_notice as unused_notice
from sits_queue.workers.placement import used_devices as used_devices
from sits_queue.workers.taskheader import say_foreign_class, task_class

logger = logging.getLogger(__name__)

# -- the active task (read by the built-in inference functions) ------------------------------

@dataclass
class ActiveTask:
    """Limits of the inference task running in this process right now."""

    model: str
    quota: ClassQuota
    engine_bytes: int
    device: str
    soft_deadline: float | None = None
    on_cuda: bool = False
    #: The running task's ``yield_point`` (time slices) and the state it saved at its
    #: last yield (None on a first run), for loops that step: generation, batches.
    yielder: Callable[[Any, float | None], None] | None = None
    checkpoint: Any = None
    #: This child's KV-prefix store (``cache/prefix.py``) and its counter, if any, and
    #: the task's ``prefix_key`` (advertised with the prefix it stores or reuses).
    prefixes: Any = None
    count: Callable[[Mapping[str, float]], None] | None = None
    prefix_key: str | None = None
    #: This child's embedding cache (``cache/embeddings.py``), if any, and the batch
    #: size controller of the task's model (``batching.py``).
    embeddings: Any = None
    batcher: Any = None
    #: In a batch run (``batched.py``), what stores call ``i``'s result at once while the
    #: batch's other calls go on; None elsewhere.
    early: Callable[[int, Any], bool] | None = None
    #: ...and where calls that join it on the way come from (``joins.Feed``), if any.
    joins: Any = None

    def deliver(self, index: int, output: Any) -> bool:
        """Call ``index`` of the running batch is done: its result is stored now, not
        when the batch ends; False where nothing took it (outside a batch; a call
        delivered already), and the batch returns it with the others as always."""
        return self.early is not None and self.early(index, output)

    def yield_point(self, state: Any, remaining_s: float | None = None) -> None:
        """Let the slot go to more urgent work if it is time to (raises ``Preempted``)."""
        if self.yielder is not None:
            self.yielder(state, remaining_s)

    def check_vram(self, extra_bytes: int) -> None:
        """Enforce the class VRAM limit against an estimate where CUDA cannot enforce it.

        On CUDA the allocator cap raises the real out-of-memory error, so this is a
        no-op; elsewhere weights plus ``extra_bytes`` must fit the class limit.
        """
        if not self.on_cuda:
            check_engine_fits_class(self.model, self.quota, self.engine_bytes, extra_bytes)

    def check_time(self, done: int, total: int) -> None:
        """Cooperative soft-limit check between decode steps (the signal may come late)."""
        if self.soft_deadline is not None and time.monotonic() >= self.soft_deadline:
            softsignal.mute()  # the pool's signal, due now, must not cut what follows
            raise SoftTimeLimitExceeded(f"soft time limit reached after {done} of {total} "
                                        "steps; stopped")


_active: ActiveTask | None = None


def active() -> ActiveTask | None:
    return _active


@contextmanager
def activated(task: ActiveTask) -> Iterator[ActiveTask]:
    global _active
    _active, previous = task, _active
    try:
        yield task
    finally:
        _active = previous


# -- per-process state --------------------------------------------------------------------------

@dataclass
class ChildRuntime:
    """One pool child: its slot, device, warm cache and counters."""

    app: Celery
    plan: WorkerPlan
    slot: int
    device: Device
    budgets: CacheBudgets = field(default_factory=CacheBudgets)
    #: A prefork pool child confines itself per task; a direct call in some other
    #: process (a script, a test, ``task.apply()``) must not re-pin its caller.
    pool_child: bool = False
    #: This child's counts since it started (field names: :mod:`.metrics`).
    counters: dict[str, float] = field(default_factory=dict)
    cache_factory: Callable[..., Any] | None = None
    _cache: Any = None
    _prefixes: Any = None
    _embeddings: Any = None
    _batchers: dict[str, Any] = field(default_factory=dict)
    _unsent: dict[str, float] = field(default_factory=dict)
    _cpus: tuple[int, ...] = ()
    _pending_ctx_ms: float = 0.0
    _ager: Any = None
    #: Which warm-cache entry serves each precision request (``cache/precision.py``).
    serving: Any = field(default_factory=lambda: _serving())
    #: The host pool's ager publishes from its thread too (counts, the warm set).
    _publishing: threading.Lock = field(default_factory=threading.Lock)
    #: The routing part of the last record Redis took (:func:`deferred.routing`).
    _sent_routing: dict[str, Any] | None = None
    _deferred: deferred.Deferred = field(init=False)
    _resolved_budgets: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self._deferred = deferred.Deferred(lambda: self.publish(at_once=True), name="advert",
                                           what="publish the child's advert")

    @property
    def config(self) -> SitsConfig:
        config: SitsConfig = self.app.sits
        return config

    @property
    def on_cuda(self) -> bool:
        return self.device.kind == "cuda" and gpu.cuda_available()

    @property
    def torch_device(self) -> str:
        return "cuda:0" if self.on_cuda else "cpu"

    @property
    def device_label(self) -> str:
        """The device the child's tasks run on, for results and its advert. Until torch
        has been asked (the first task does), NVML's word: a child's start-up publishes
        this, and importing a CUDA build of torch and starting the driver there could
        outlast the seconds Celery gives a new child to report in before it kills it."""
        known = gpu.cuda_known()
        on_cuda = self.device.kind == "cuda" and known is not False
        return devices.label("cuda", self.device.index, self.device.uuid) if on_cuda else "cpu"

    def _budgets(self) -> tuple[int, int]:
        # (once: every publish asks, for the room left, and reading the host's memory
        # from /proc was a quarter of a publish's time)
        if self._resolved_budgets is None:
            slots = max(1, self.plan.slots)
            self._resolved_budgets = self.budgets.resolve(
                self.device, int(psutil.virtual_memory().total), slots,
                children_per_device(self.plan.discovery, slots, self.slot))
        return self._resolved_budgets

    def cache(self) -> Any:
        if self._cache is None:
            factory = self.cache_factory or _engine_cache
            dev, host = self._budgets()
            self._cache = factory(self.torch_device, dev, host, context=gpu.create_context)
            self._start_ager()
        return self._cache

    def _start_ager(self) -> None:
        """Age the host tier by time and memory pressure (``cache/aging.py``): in a pool
        child, whose cache lives as long as it does."""
        config = self.config
        if not self.pool_child or not (config.host_pool_ttl_s > 0
                                       or config.host_pool_pressure_share > 0):
            return
        from sits_queue.cache.aging import HostPoolAger, period_for

        def memory() -> tuple[int, int]:
            vm = psutil.virtual_memory()
            return int(vm.available), int(vm.total)

        self._ager = HostPoolAger(self._cache, config.host_pool_ttl_s,
                                  config.host_pool_pressure_share, max(1, self.plan.slots),
                                  memory, self.publish,
                                  period_for(config.host_pool_ttl_s)).start()

    def embeddings(self) -> Any:
        """This child's embedding cache; None when ``embed_cache_entries`` is 0."""
        if self._embeddings is None and self.config.embed_cache_entries > 0:
            from sits_queue.cache.embeddings import EmbeddingCache

            self._embeddings = EmbeddingCache(self.config.embed_cache_entries,
                                              self.config.embed_cache_ttl_s)
        return self._embeddings

    def batcher(self, model: str) -> Any:
        """The batch size controller for ``model`` in this child (§1.2)."""
        if model not in self._batchers:
            from sits_queue.workers.batching import Batcher, BatchPolicy

            self._batchers[model] = Batcher(BatchPolicy(
                target_p95_ms=self.config.batch_target_p95_ms))
        return self._batchers[model]

    def prefixes(self) -> Any:
        """This child's KV-prefix store (generations reuse shared prompt prefixes)."""
        if self._prefixes is None:
            from sits_queue.cache.prefix import PrefixStore

            self._prefixes = PrefixStore(self.budgets.prefix_budget(self._budgets()[0]))
        return self._prefixes

    # -- limits (task_prerun) --------------------------------------------------------------
    def confine(self, quota: ClassQuota) -> tuple[int, ...]:
        """Pin this child to its class's cores; torch's intra-op pool to as many threads.

        Returns the cores; outside a pool child, the process's own, untouched.
        """
        if not self.pool_child:
            return cores.usable()
        cpus = self.plan.child_cpus(quota, self.slot)
        # Against what this thread runs on now, not only what was last set: a task that
        # changed its own affinity left it to the tasks after it, whatever their class
        if cpus != self._cpus or not cores.pinned_to(cpus):
            # sched_setaffinity(0) pins the calling thread only: torch's OpenMP workers,
            # started under an earlier class's cores, would keep those
            cores.pin(_threads(), cpus)
            self._cpus = cpus
        threads = cores.threads_within_quota(len(cpus), self.plan.cpu_quota,
                                             max(1, self.plan.slots))
        torch = sys.modules.get("torch")
        if torch is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return cpus

    def cap_for_class(self, quota: ClassQuota, engine_bytes: int = 0) -> float | None:
        """Cap the allocator for a task of this class; the fraction, or None off CUDA."""
        if not self.on_cuda:
            return None
        self._pending_ctx_ms += gpu.create_context()
        total = gpu.total_memory_bytes() or self.device.total_vram_bytes
        allocated = gpu.memory_stats()["allocated_bytes"]
        fraction = memory_cap_fraction(quota, allocated, engine_bytes, total)
        gpu.cap_memory(fraction)
        return fraction

    def lift_cap(self) -> None:
        """The cache loads under its own budget, not the previous task's class cap."""
        if gpu.context_created() and self.on_cuda:
            gpu.cap_memory(1.0)

    def before_task(self, request: Any, declared_class: str | None = None) -> None:
        if _active is not None:
            # A batch's call traced while the batch runs on (its result stored early,
            # ``batched.py``): the batch's confinement and cap stay as they are.
            return
        say_foreign_class(self.config, request, declared_class)
        quota = task_class(self.config, request, declared_class)
        self.confine(quota)
        # A plain task gets its class cap too, but only once the child has a context:
        # creating one for a task that may never use CUDA would cost every child VRAM.
        if gpu.context_created() and self.on_cuda:
            self.cap_for_class(quota)

    def take_ctx_ms(self) -> float:
        ms, self._pending_ctx_ms = self._pending_ctx_ms, 0.0
        return ms

    # -- accounting ------------------------------------------------------------------------
    def count(self, fields: Mapping[str, float]) -> None:
        """Add counts (``metrics.task_fields`` / ``failure_fields``); sent by :meth:`publish`."""
        with self._publishing:
            metrics.merge(self.counters, fields)
            metrics.merge(self._unsent, fields)

    def publish(self, at_once: bool = False) -> None:
        """Write this child's warm set and memory, and its new counts, for the advert: at
        once when what routes work to it changed since the last write (or ``at_once``),
        else from the deferred writer within ``deferred.DEFER_S`` (``workers/deferred.py``)."""
        with self._publishing:
            record = self._record()
            routing = deferred.routing(record)
            changed = routing != self._sent_routing
            if at_once or changed:
                self._deferred.disarm()
                self._send(record, routing, changed)
            else:
                self._deferred.arm()

    def flush_advert(self) -> None:
        """Write what the deferred writer holds (a child's clean exit)."""
        self._deferred.flush()

    def _record(self) -> dict[str, Any]:
        warm = self._cache.warm() if self._cache is not None else {}
        sizes = self._cache.warm_bytes() if self._cache is not None else {}
        device = self.device_label
        return {
            "slot": self.slot, "slots": self.plan.slots, "pid": os.getpid(),
            "device": device, "warm": dict(warm), "cpus": list(self._cpus),
            "warm_bytes": sizes,
            # (where a model warm nowhere loads with the fewest evictions: steer.py)
            "device_room": _room(self._budgets()[0], warm, sizes),
            # (what a task asking for another key runs warm on: affinity's)
            "serves": self.serving.served_keys(warm, device),
            "kv_prefixes": self._prefixes.models() if self._prefixes is not None else {},
            "kv_keys": self._prefixes.tags() if self._prefixes is not None else [],
            "tasks": int(self.counters.get("tasks", 0)),
            "cold": int(self.counters.get("cold", 0)),
            "memory": gpu.memory_stats()}

    def _send(self, record: dict[str, Any], routing: dict[str, Any], changed: bool) -> None:
        """Write ``record`` (its routing part ``routing``, ``changed`` since the last
        write Redis took) and the counts not sent yet."""
        unsent, self._unsent = self._unsent, {}
        sent = False
        try:
            sent = advertise.publish_child(self.config, self.plan.hostname, self.slot,
                                           record, unsent)
        finally:
            if sent:
                if changed:  # (the main process reads its children again)
                    routingversions.bump(self.slot)
                self._sent_routing = routing
            else:  # Redis away for now (or a signal cut it short): the counts go
                metrics.merge(self._unsent, unsent)  # with the next publish


def _room(budget: int, warm: Mapping[str, str], sizes: Mapping[str, int]) -> int:
    """Bytes a device tier of ``budget`` has left beside the engines it holds."""
    held = sum(size for key, size in sizes.items() if warm.get(key) == DEVICE_TIER)
    return max(0, budget - held)


def _serving() -> Any:
    from sits_queue.cache.precision import Serving  # (torch-free, but not for the parent)

    return Serving()


def _threads() -> list[int]:
    """This process's thread ids (Linux); just the calling thread where /proc is missing."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _engine_cache(device: str, device_bytes: int, host_bytes: int, *,
                  context: Callable[[], float]) -> Any:
    from sits_queue.cache.pool import EngineCache

    # A time limit hit while loading is the task's, not a broken model: let it through.
    return EngineCache(device, device_bytes, host_bytes, context=context,
                       passthrough=(SoftTimeLimitExceeded,))


# -- process-wide state and signal wiring ----------------------------------------------------

_plan: WorkerPlan | None = None
_child: ChildRuntime | None = None


def plan() -> WorkerPlan:
    """The worker plan; outside a worker, a one-slot plan for this process."""
    global _plan
    if _plan is None:
        _plan = WorkerPlan(hostname=os.uname().nodename,
                           discovery=discover(visible=os.environ.get("CUDA_VISIBLE_DEVICES")),
                           available_cpus=cores.usable(), slots=1)
    return _plan


def for_app(app: Celery) -> ChildRuntime:
    """This process's runtime; a one-slot runtime when called outside a pool child
    (``task.apply()``, a direct call in a script or test)."""
    global _child
    if _child is None or _child.app is not app:
        p = plan()
        _child = ChildRuntime(app=app, plan=p, slot=0, device=device_for_slot(p.discovery, 0),
                              budgets=CacheBudgets.from_env())
    return _child


def init_parent(app: Celery, hostname: str, conf: Any, options: Mapping[str, Any]) -> None:
    """``celeryd_init``: discover through NVML, size the pool, arm admission."""
    global _plan
    discovery = discover(visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                         order=os.environ.get("CUDA_DEVICE_ORDER"))
    if discovery.notice:
        logger.warning("%s", discovery.notice)
    if not cores.can_pin():
        logger.warning("%s", cores.UNPINNED_NOTICE)
    usable, quota = cores.usable(), cores.cpu_quota()
    if quota is not None and quota < len(usable):
        logger.warning("sits-queue: a CPU quota of %g CPUs (cgroup) for %d visible cores: "
                       "each child's torch threads are capped at its share of the quota",
                       quota, len(usable))
    if not options.get("concurrency") and not conf.worker_concurrency:
        conf.worker_concurrency = default_concurrency(discovery)
    intake.in_worker()
    from sits_queue.broker import deadletters

    deadletters.event_hostname = hostname  # (its dead-letter events: this worker's)
    _plan = WorkerPlan(hostname=hostname, discovery=discovery, available_cpus=usable,
                       cpu_quota=quota, node_cpus=tuple(sorted(cores.numa_nodes(usable).items())))
    _arm_admission(app, hostname, discovery, discovery.cuda_devices)


def _arm_admission(app: Celery, hostname: str, discovery: Discovery,
                   gpus: tuple[Device, ...]) -> None:
    """Admit tasks by ``gpus``' memory (NVML), by host memory where there are none."""
    global _armed
    _armed = (app, hostname)
    if not gpus:
        admission.configure(freemem.HostProbe())
        return
    config = app.sits  # (its children's records: what they hold cached, for admission)
    admission.configure(freemem.NvmlProbe([d.uuid for d in gpus]), lambda: (
        freemem.cached_by_device(advertise.read_children(
            advertise.client_for(config), config.global_keyprefix, hostname),
            lambda slot: device_for_slot(discovery, slot))))


#: The app and hostname admission was armed for by :func:`init_parent` (None elsewhere).
_armed: tuple[Celery, str] | None = None


def record_slots(slots: int) -> None:
    """The pool's size, known before it forks; admission then counts only the devices
    its children use (:func:`used_devices`)."""
    global _plan
    p = plan()
    _plan = replace(p, slots=slots)
    if (notice := unused_notice(p.discovery, slots)) is not None:
        logger.warning("%s", notice)
        if _armed is not None:
            _arm_admission(*_armed, p.discovery,
                           tuple(d for d in _plan.devices if d.kind == "cuda"))


def init_child(app: Celery, index: int, env: dict[str, str] | None = None) -> ChildRuntime:
    """``worker_process_init``: pin to the slot's device before CUDA is touched."""
    global _child
    p = plan()
    device = device_for_slot(p.discovery, index)
    (os.environ if env is None else env).update(pin_env(device))
    metrics.forget_in_child()
    stacks.install()  # kill -USR2 <pid>: where this child is, in the worker's log
    _child = ChildRuntime(app=app, plan=p, slot=index, device=device,
                          budgets=CacheBudgets.from_env(), pool_child=True)
    _child.publish(at_once=True)  # replaces a dead predecessor's record (its engines died)
    logger.info("pool child %d (pid %d) pinned to %s", index, os.getpid(),
                f"{device.name} ({device.uuid})" if device.kind == "cuda" else "CPU")
    return _child


def child() -> ChildRuntime | None:
    return _child


def connect(app: Celery) -> None:
    """Wire the runtime into ``app``'s workers (signals filter on the app)."""

    def on_celeryd_init(sender: Any = None, instance: Any = None, conf: Any = None,
                        options: Any = None, **_: Any) -> None:
        if getattr(instance, "app", None) is app:
            try:  # (met at the worker's first connection, they printed ~57 lines of
                # traceback: a broker URL of its own, a transport option SITS decides)
                instance.app.broker_options(instance.app.conf.broker_url)
            except ConfigError as exc:
                raise SystemExit(f"Error: {exc}") from None
            grants.check_worker_grants(app, options)  # (an ACL user's, likewise)
            eviction.warn_if_evicting(instance.app.sits.redis_url)
            init_parent(app, str(sender), conf, options or {})

    def on_process_init(**_: Any) -> None:
        if current_app._get_current_object() is app:
            init_child(app, int(getattr(current_process(), "index", 0) or 0))

    def on_postrun(**_: Any) -> None:
        # Between tasks the signal is ignored: a timer overdue in a parent whose loop was
        # blocked (a Redis outage) fired after its task ended, and the idle child died
        # of the SoftTimeLimitExceeded raised in the pool's own loop.
        softsignal.task_ended()

    def on_prerun(sender: Any = None, task: Any = None, **_: Any) -> None:
        softsignal.task_started()
        rt = _child
        ours = getattr(task, "app", None) is app
        if ours and rt is not None and rt.app is app:
            rt.before_task(task.request, getattr(task, "sla_class", None))
        elif ours:  # (a threads or gevent pool: no child runtime, the warning all the same)
            say_foreign_class(app.sits, task.request, getattr(task, "sla_class", None))

    def on_process_shutdown(**_: Any) -> None:
        rt = _child
        if rt is not None and rt.app is app:
            rt.flush_advert()

    def on_after_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
        # The beat's maintenance tasks go to the control queue: a worker started with
        # -Q for its own queues must consume it too, or rescoring and triggers pile up
        # unserved (Celery's documented way to always consume a queue despite -Q).
        if getattr(instance, "app", None) is app:
            from sits_queue.app import control_queue

            instance.app.amqp.queues.select_add(control_queue())

    signals.celeryd_init.connect(on_celeryd_init, weak=False)
    signals.celeryd_after_setup.connect(on_after_setup, weak=False)
    signals.worker_process_init.connect(on_process_init, weak=False)
    signals.task_prerun.connect(on_prerun, weak=False)
    signals.task_postrun.connect(on_postrun, weak=False)
    signals.worker_process_shutdown.connect(on_process_shutdown, weak=False)
    childgc.connect()
    from sits_queue.workers.planstep import PlanStep

    app.steps["worker"].add(PlanStep)
    app.steps["worker"].add(steer.SteerStep)
    app.steps["worker"].add(reap.ReapStep)
    app.steps["worker"].add(latelimit.LateLimitStep)
    app.steps["worker"].add(metrics.MetricsServer)
    app.steps["consumer"].add(advertise.Advertise)
    app.steps["consumer"].add(profile.ProfileStep)
    app.steps["consumer"].add(ratelimits.RateLimitHold)
    app.steps["consumer"].add(etaorder.EtaOrder)
    app.steps["consumer"].add(sitebeat.SiteHeartbeat)
    from sits_queue.workers import batchmain  # imports inference, which imports this module

    app.steps["consumer"].add(batchmain.Batches)


