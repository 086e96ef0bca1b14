"""The runtime two-tier engine cache (MISSION §4.1, §4.3): policy plans applied to engines.

:mod:`sits_queue.cache.policy` decides (pure, snapshot in, plan out); this module carries
each planned action out on real :class:`~sits_queue.cache.contract.Engine` objects, one
action at a time, and advances the policy state after each one. So the bookkeeping always
matches what the engines really did, and neither budget is exceeded at any step, even
when an action fails halfway through a plan.

Every :meth:`EngineCache.get` returns a :class:`ColdStart` record: whether the engine was
already on the device, and the milliseconds spent on each cold-start phase of §4.1
(CUDA context, load from disk, host-to-device promotion, warm-up inference).

Loading happens under the cache's lock: a pool child runs one task at a time, and two
concurrent misses on one key must not load it twice.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, NoReturn

from sits_queue.cache.contract import Engine
from sits_queue.cache.policy import (
    DEFAULT_HALF_LIFE_S,
    Action,
    Plan,
    PoolState,
    Tier,
    apply,
    plan_admit,
    plan_expire,
    plan_resize,
    plan_shrink_host,
)
from sits_queue.errors import SitsError

Source = Literal["device", "host", "disk"]
#: How long an engine found larger than the whole device budget is refused again without
#: being loaded, s: a task for it paid the whole load from disk each time, only to be
#: refused. Looked at again after this (the model on disk may have changed).
TOO_LARGE_KEPT_S = 300.0


class EngineTooLarge(SitsError, ValueError):
    """An engine needs more bytes than the whole device pool holds."""

    def __init__(self, key: str, size_bytes: int, budget_bytes: int) -> None:
        # args are the constructor's, so Celery's json and pickle result encodings can
        # rebuild the exception (they call ``cls(*args)``).
        super().__init__(key, size_bytes, budget_bytes)
        self.key, self.size_bytes, self.budget_bytes = key, size_bytes, budget_bytes

    def __str__(self) -> str:
        return (f"engine {self.key!r} needs {self.size_bytes} bytes on the device; the device "
                f"pool holds {self.budget_bytes}: raise the budget (SITS_DEVICE_CACHE_BYTES, "
                "each worker child's) or use a smaller model")


class EngineInUse(EngineTooLarge):
    """Making room for an engine would push out one that a running task uses."""

    def __init__(self, key: str, busy: str) -> None:
        ValueError.__init__(self, key, busy)  # (rebuilt by ``cls(*args)``, as above)
        self.key, self.busy = key, busy
        self.size_bytes = self.budget_bytes = 0

    def __str__(self) -> str:
        return (f"engine {self.key!r} cannot be placed on the device now: making room for "
                f"it would push out {self.busy!r}, which a running task uses (one task "
                "calling another model's task in its process: give the device room for "
                "both, or submit the inner task to run on its own)")


class ModelLoadError(SitsError, RuntimeError):
    """Loading, promoting or warming up a model failed.

    ``cause`` is the original error (also chained as ``__cause__``). Rebuilt from its
    ``args`` by a result backend, it is a ``RuntimeError`` carrying the original's
    description (``reason``).
    """

    def __init__(self, key: str, cause: BaseException | str) -> None:
        reason = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(key, reason)  # plain data: see EngineTooLarge
        self.key, self.reason = key, reason
        self.cause: BaseException = cause if isinstance(cause, BaseException) \
            else RuntimeError(cause)

    def __str__(self) -> str:
        return f"loading model {self.key!r} failed: {self.reason}"


#: A cold start's phases, ms: ColdStart's fields, and the keys the result metadata
#: gives them under.
COLD_PHASES = ("cuda_ctx_ms", "load_ms", "promote_ms", "warmup_ms")


@dataclass(frozen=True)
class ColdStart:
    """What one :meth:`EngineCache.get` cost (MISSION §4.1); all times in ms."""

    #: False only for a hit on the device pool.
    cold: bool
    #: Where the engine came from: already on the device, the host pool, or the disk.
    source: Source
    #: CUDA context creation: paid by the first get in the process only.
    cuda_ctx_ms: float = 0.0
    #: Reading the engine from disk into host memory (``loader()``).
    load_ms: float = 0.0
    #: Host memory to device (for TensorRT: deserialise and create the execution context).
    promote_ms: float = 0.0
    #: The warm-up inference.
    warmup_ms: float = 0.0
    #: Engines dropped from the cache to make room.
    evicted: tuple[str, ...] = ()
    #: Engines moved from the device to the host pool to make room.
    demoted: tuple[str, ...] = ()

    @property
    def total_ms(self) -> float:
        return sum(float(getattr(self, phase)) for phase in COLD_PHASES)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, for task result metadata."""
        return {**asdict(self), "evicted": list(self.evicted), "demoted": list(self.demoted),
                "total_ms": self.total_ms}


_COUNTERS = ("gets", "hits_device", "hits_host", "loads", "promotions", "demotions",
             "evictions", "load_failures", "too_large", "in_use")
_TIMERS = ("cuda_ctx_ms", "load_ms_total", "promote_ms_total", "warmup_ms_total")


class EngineCache:
    """Engines for one device, in a device warm pool backed by a host shadow pool.

    ``context`` creates the CUDA context and returns the ms it took; it is injected by the
    worker runtime (the cache never touches CUDA itself) and called once, on the first get.
    ``clock`` (seconds) drives recency only; phases are timed with ``time.perf_counter``.
    Exceptions of a ``passthrough`` type (e.g. Celery's ``SoftTimeLimitExceeded``) escape
    unwrapped, so a time limit is not reported as a broken model; the cache stays
    consistent either way.
    """

    def __init__(self, device: str, device_budget_bytes: int, host_budget_bytes: int, *,
                 context: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.monotonic,
                 half_life_s: float = DEFAULT_HALF_LIFE_S,
                 passthrough: tuple[type[BaseException], ...] = ()) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s!r}")
        self.device = device
        self._state = PoolState(device_budget_bytes, host_budget_bytes)
        self._engines: dict[str, Engine] = {}
        self._context = context
        self._ctx_done = False
        self._clock = clock
        self._half_life_s = half_life_s
        self._passthrough = passthrough
        self._counts: Counter[str] = Counter()
        self._times: dict[str, float] = dict.fromkeys(_TIMERS, 0.0)
        self._lock = threading.RLock()
        #: Engines running tasks use (:meth:`using`), with how many use each.
        self._pins: Counter[str] = Counter()
        #: Engines refused as too large: their size, the budget then, and when.
        self._too_large: dict[str, tuple[int, int, float]] = {}

    # -- reading -------------------------------------------------------------------------------

    @property
    def state(self) -> PoolState:
        """The policy snapshot (immutable)."""
        return self._state

    def __contains__(self, key: object) -> bool:
        return key in self._state.entries

    def __len__(self) -> int:
        return len(self._state.entries)

    def warm(self) -> dict[str, Tier]:
        """Cached engines and their tiers (what the worker advertises)."""
        with self._lock:
            return {k: e.tier for k, e in sorted(self._state.entries.items())}

    def warm_bytes(self) -> dict[str, int]:
        """Cached engines and the bytes each takes in its tier."""
        with self._lock:
            return {k: e.size_bytes for k, e in sorted(self._state.entries.items())}

    def stats(self) -> dict[str, float]:
        """Counters, phase totals (ms), pool occupancy and the cold-start share.

        ``hits_host`` and ``promotions`` are equal: every host hit is a promotion.
        """
        with self._lock:
            out: dict[str, float] = {k: float(self._counts[k]) for k in _COUNTERS}
            out.update(self._times)
            served = self._counts["hits_device"] + self._counts["hits_host"] + \
                self._counts["loads"]
            cold = self._counts["hits_host"] + self._counts["loads"]
            out["cold_share"] = cold / served if served else 0.0
            s = self._state
            out.update(device_used_bytes=s.device_used, host_used_bytes=s.host_used,
                       device_budget_bytes=s.device_budget_bytes,
                       host_budget_bytes=s.host_budget_bytes,
                       engines_device=len(s.on("device")), engines_host=len(s.on("host")))
            return out

    # -- getting -------------------------------------------------------------------------------

    def get(self, key: str, loader: Callable[[], Engine]) -> tuple[Engine, ColdStart]:
        """The engine for ``key``, on the device, and what getting it cost.

        On the device: a hit, nothing spent. In the host pool: promoted (``cold``, source
        "host"), colder engines demoted or evicted to make room. Absent: ``loader()``
        builds it from disk (in the host tier), then it is promoted and warmed up.
        Raises :class:`EngineTooLarge` (the engine is released) or :class:`ModelLoadError`.
        """
        with self._lock:
            self._counts["gets"] += 1
            ctx_ms = self._ensure_context()
            now = self._clock()
            entry = self._state.entries.get(key)
            if entry is not None and (key not in self._engines or self._engines[key].released):
                # Released behind the cache's back (its loader handed the same engine to
                # a precision conversion, which releases what it converts): load anew.
                self._drop(key, now)
                entry = None
            if entry is None:
                self._refuse_known_too_large(key, now)
                return self._from_disk(key, loader, now, ctx_ms)
            plan = plan_admit(self._state, key, entry.size_bytes, now, self._half_life_s)
            if plan.hit:
                self._state = apply(self._state, plan, now)
                self._counts["hits_device"] += 1
                return self._engines[key], ColdStart(False, "device", cuda_ctx_ms=ctx_ms)
            self._refuse_in_use(key, plan)
            engine = self._engines[key]
            evicted, demoted, promote_ms = self._execute(key, plan, now)
            evicted, demoted = self._measured(key, engine, now, evicted, demoted)
            warmup_ms = self._warm(key, engine, now) if engine.rewarm_on_promote else 0.0
            self._admitted(key, plan, now)
            self._counts["hits_host"] += 1
            self._counts["promotions"] += 1
            return engine, ColdStart(True, "host", ctx_ms, 0.0, promote_ms, warmup_ms,
                                     evicted, demoted)

    @contextlib.contextmanager
    def using(self, key: str) -> Iterator[None]:
        """Hold ``key`` on the device while a task runs it: a get that would demote or
        evict it meanwhile (another model's task run in-process by this one) is refused
        with :class:`EngineInUse`, not served by pulling the engine from under it."""
        with self._lock:
            self._pins[key] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[key] -= 1
                if self._pins[key] <= 0:
                    del self._pins[key]

    def _refuse_in_use(self, key: str, plan: Plan, new: Engine | None = None) -> None:
        busy = next((target for kind, target in plan.actions
                     if kind in ("demote", "evict") and self._pins.get(target)), None)
        if busy is not None:
            if new is not None:
                new.release()
            # (its own count: the engine fits the budget, another task holds the room)
            self._counts["in_use"] += 1
            raise EngineInUse(key, busy)

    def _ensure_context(self) -> float:
        if self._ctx_done:
            return 0.0
        ms = float(self._context())  # a failure propagates and is retried on the next get
        self._ctx_done = True
        self._times["cuda_ctx_ms"] = ms
        return ms

    def _refuse_known_too_large(self, key: str, now: float) -> None:
        """Raise :class:`EngineTooLarge` for ``key`` without loading it when it was found
        too large for this device budget within :data:`TOO_LARGE_KEPT_S`."""
        known = self._too_large.get(key)
        if known is None:
            return
        size, budget, at = known
        if budget != self._state.device_budget_bytes or now - at >= TOO_LARGE_KEPT_S:
            del self._too_large[key]
            return
        self._counts["too_large"] += 1
        raise EngineTooLarge(key, size, budget)

    def _from_disk(self, key: str, loader: Callable[[], Engine], now: float,
                   ctx_ms: float) -> tuple[Engine, ColdStart]:
        start = time.perf_counter()
        try:
            engine = loader()
        except BaseException as exc:
            self._fail(key, exc)
        refused = self._not_new(engine)
        if refused is not None:
            self._counts["load_failures"] += 1
            raise ModelLoadError(key, refused)
        load_ms = (time.perf_counter() - start) * 1000.0
        self._times["load_ms_total"] += load_ms
        size = engine.size_bytes()
        plan = plan_admit(self._state, key, size, now, self._half_life_s)
        if not plan.fits:
            engine.release()
            self._counts["too_large"] += 1
            self._too_large[key] = (size, self._state.device_budget_bytes, now)
            raise EngineTooLarge(key, size, self._state.device_budget_bytes)
        self._refuse_in_use(key, plan, engine)
        evicted, demoted, promote_ms = self._execute(key, plan, now, engine)
        evicted, demoted = self._measured(key, engine, now, evicted, demoted)
        warmup_ms = self._warm(key, engine, now)
        self._admitted(key, plan, now)
        self._counts["loads"] += 1
        return engine, ColdStart(True, "disk", ctx_ms, load_ms, promote_ms, warmup_ms,
                                 evicted, demoted)

    def _measured(self, key: str, engine: Engine, now: float, evicted: tuple[str, ...],
                  demoted: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Count what ``engine`` takes now that it is on the device, when that differs from
        what it was admitted at (a TensorRT context's activation memory is known only
        once the plan is deserialised): the coldest other engines make room for the
        growth, and the host tier counts it at that size too once demoted. Past
        the device budget, when the room is held by a running task's engine, or when
        making it fails, ``key`` is dropped (its bytes must not go uncounted) and the get
        fails."""
        size = engine.size_bytes()
        if size == self._state.entries[key].size_bytes:
            return evicted, demoted
        plan = plan_resize(self._state, key, size, now, self._half_life_s)
        if not plan.fits:
            self._drop(key, now)
            self._counts["too_large"] += 1
            raise EngineTooLarge(key, size, self._state.device_budget_bytes)
        try:
            self._refuse_in_use(key, plan)
            more_evicted, more_demoted, _ = self._execute(key, plan, now)
        except BaseException:  # in use, or a move that failed: nothing left uncounted
            self._drop(key, now)
            raise
        return evicted + more_evicted, demoted + more_demoted

    def _not_new(self, engine: Engine) -> str | None:
        """Why an engine a loader just returned cannot be admitted: it is not a new one
        (None: it is). Admitting it would serve a released engine, or let dropping one
        key release another key's engine while the budgets count its bytes twice."""
        held = next((k for k, e in self._engines.items() if e is engine), None)
        # The same module under two keys (a loader that returns a model kept in a
        # global, wrapped anew each call; "m" and "m@fp32", which needs no conversion):
        # demoting one would move the other's weights off the device beneath it.
        shared = next((k for k, e in self._engines.items()
                       if e is not engine and e.holds() is engine.holds()), None)
        if engine.released:
            what = "an engine that was already released (the cache releases what it drops)"
        elif held is not None:
            what = f"an engine the cache already holds as {held!r}"
        elif shared is not None:
            what = f"the model the cache already holds as {shared!r}"
        else:
            return None
        return (f"the loader returned {what}: a loader must build a new engine on every "
                "call (one memoised with functools.cache, or returning a model kept in a "
                "global, returns the same one each time)")

    def _fail(self, key: str | None, exc: BaseException) -> NoReturn:
        """Re-raise ``exc`` from getting ``key``, as a :class:`ModelLoadError` when it is
        the model's fault (housekeeping, ``key`` None, re-raises as is)."""
        if (key is None or isinstance(exc, self._passthrough)
                or not isinstance(exc, Exception)  # KeyboardInterrupt, SystemExit
                or isinstance(exc, ModelLoadError | EngineTooLarge)):
            raise exc
        self._counts["load_failures"] += 1
        raise ModelLoadError(key, exc) from exc

    def _warm(self, key: str, engine: Engine, now: float) -> float:
        try:
            ms = engine.warmup()
        except BaseException as exc:
            self._drop(key, now)
            self._fail(key, exc)
        self._times["warmup_ms_total"] += ms
        return ms

    def _admitted(self, key: str, plan: Plan, now: float) -> None:
        """Record the use of ``key``, now on the device (an action-free plan does that)."""
        self._state = apply(self._state, Plan(key=key, size_bytes=plan.size_bytes), now)

    # -- carrying a plan out -------------------------------------------------------------------

    def _execute(self, key: str | None, plan: Plan, now: float, new: Engine | None = None
                 ) -> tuple[tuple[str, ...], tuple[str, ...], float]:
        """Carry out ``plan``'s actions; returns (evicted, demoted, promote ms).

        On a failed action the engine concerned is dropped (released, and removed from the
        state), the new engine too, and the error is raised: freeing memory never breaks
        a budget, so the cache is consistent and usable afterwards.
        """
        evicted: list[str] = []
        demoted: list[str] = []
        promote_ms = 0.0
        for action in plan.actions:
            kind, target = action
            try:
                if kind == "load":
                    assert new is not None
                    self._engines[target] = new
                    promote_ms = self._move(action, new)
                elif kind == "promote":
                    promote_ms = self._move(action, self._engines[target])
                else:
                    self._move(action, self._engines[target])
            except BaseException as exc:
                self._drop(target, now, plan.swap)
                if plan.swap is not None and self._state.free("host") < 0:
                    # A swap stopped half-way: an engine demoted into the room the
                    # promotion was to free holds the host over budget. The promoted
                    # engine goes instead (its get fails anyway): the room it lent.
                    self._drop(plan.swap, now)
                if new is not None and target != key:
                    new.release()
                if target != key and key is not None and isinstance(exc, Exception) \
                        and not isinstance(exc, self._passthrough):
                    # another engine's move failed while making room: say so, not that
                    # this model's load did
                    raise ModelLoadError(key, f"making room for it failed: {kind} of "
                                              f"{target!r}: {type(exc).__name__}: {exc}"
                                         ) from exc
                self._fail(key, exc)
            self._state = apply(self._state, Plan(actions=(action,), swap=plan.swap,
                                                  size_bytes=plan.size_bytes), now)
            evicted += [target] if kind == "evict" else []
            demoted += [target] if kind == "demote" else []
        return tuple(evicted), tuple(demoted), promote_ms

    def _move(self, action: Action, engine: Engine) -> float:
        kind, key = action
        if kind == "demote":
            self._counts["demotions"] += 1
            return engine.to_host()
        if kind == "evict":
            self._counts["evictions"] += 1
            del self._engines[key]
            engine.release()
            return 0.0
        if kind in ("promote", "load"):
            ms = engine.to_device(self.device)
            self._times["promote_ms_total"] += ms
            return ms
        # "sync": engines hold no write-back state yet (KV caches will); nothing to flush.
        # "resize": bookkeeping only (``_measured``).
        return 0.0

    def _drop(self, key: str, now: float, swap: str | None = None) -> None:
        """Forget ``key`` after a failure: release it (best effort) and free its bytes.
        ``swap``: the swap of the plan that failed, whose host room is still lent."""
        engine = self._engines.pop(key, None)
        if engine is not None:
            # Already failing: the original error is the one to report, not a release error.
            with contextlib.suppress(Exception):
                engine.release()
        if key in self._state.entries:
            self._state = apply(self._state, Plan(actions=(("evict", key),), swap=swap), now)

    # -- housekeeping --------------------------------------------------------------------------

    def _run_plan(self, plan: Plan) -> tuple[str, ...]:
        now = self._clock()
        evicted, _, _ = self._execute(None, plan, now)
        if plan.host_budget_bytes is not None:
            self._state = apply(self._state, Plan(host_budget_bytes=plan.host_budget_bytes),
                                now)
        return evicted

    def rekey(self, key: str, new: str, loader: Callable[[], Engine]
              ) -> tuple[Engine, ColdStart | None]:
        """Serve ``key``'s engine as ``new`` from now on: it is the same model (a
        precision conversion that changed nothing). When ``new`` is cached already,
        ``key``'s is a copy: dropped, and ``new``'s returned (on the device), with what
        getting it there cost (None when nothing moved)."""
        with self._lock:
            if key not in self._engines:
                raise KeyError(key)
            if new in self._state.entries:
                self.drop(key)
                return self.get(new, loader)
            engine = self._engines.pop(key)
            entries = dict(self._state.entries)
            entries[new] = replace(entries.pop(key), key=new)
            self._state = self._state.with_entries(entries)
            self._engines[new] = engine
            engine.key = new
            return engine, None

    def drop(self, key: str) -> bool:
        """Release ``key`` from whichever tier holds it (e.g. after it ran out of memory)."""
        with self._lock:
            if key not in self._engines:
                return False
            self._run_plan(Plan(actions=(("evict", key),)))
            return True

    def expire(self, host_ttl_s: float) -> tuple[str, ...]:
        """Release host-pool engines unused for ``host_ttl_s`` (aging by time)."""
        with self._lock:
            return self._run_plan(plan_expire(self._state, self._clock(), host_ttl_s))

    def shrink_host(self, new_budget_bytes: int) -> tuple[str, ...]:
        """Release the coldest host engines until the host pool fits the new budget
        (aging by memory pressure), then adopt that budget."""
        with self._lock:
            plan = plan_shrink_host(self._state, new_budget_bytes, self._clock(),
                                    self._half_life_s)
            return self._run_plan(plan)

    def clear(self) -> None:
        """Release every engine; budgets and counters are kept."""
        with self._lock:
            keys = sorted(self._engines)
            self._run_plan(Plan(actions=tuple(("evict", k) for k in keys)))
