"""The beat's scheduler: redbeat (entries and a lock in Redis: one beat per deployment)
that keeps SITS's maintenance passes scheduled and lives through Redis outages.

* **Our entries stay.** An app module that assigns ``app.conf.beat_schedule = {...}``, as
  Celery's docs show, replaces the rescoring, trigger and pre-warm entries with its own:
  redbeat would then delete them from Redis, and the queues would stop being rescored with
  no word said. Missing ones are put back, with a warning.
* **Outages are waited out.** redbeat's tick extends its lock first; a connection error
  there, or a lock that Redis lost (restarted without persistence, flushed), ended the
  beat process for good (redbeat #218, #230), and with it rescoring and aging. Here a tick
  that cannot reach Redis is retried after :data:`RETRY_S`, and a lost lock is taken
  again when free (while another beat holds it, this one stands by, as at start).
* **A standby takes over in time.** redbeat takes the lock at start by blocking until it
  is free, looking again every ``max_interval`` (300 s): a second beat, or one restarted
  at once after a crash (its old lock held until it times out), stood idle for up to
  five minutes past the lock's expiry, with no rescoring, aging or trigger checks. Here
  the tick takes it without blocking, from the first one on, and a standby looks again
  each :data:`RETRY_S`. The lock's timeout follows the beat's longest sleep between
  ticks, each of which extends it (``settings.beat_lock_timeout_s``: 15 s), never
  shorter than that allows. (It was 6 x the rescoring interval: at 300 s a killed
  beat's lock lived 30 minutes, and a standby, looking every sixth of that, sent
  nothing all along.)
* **A bad entry is said once.** An app's entry whose SITS options (or the arguments they
  read) are refused was sent each period and refused each time, logged with a stack
  dump by Celery. Here it is left out of the schedule as the beat starts, in one error
  naming the entry and the problem; an entry put in Redis by other means (redbeat's own
  entries) is refused in one line, once.
* **The leader's schedule is its own.** redbeat writes a beat's entries into Redis as it
  starts, before any lock, pruning what its own schedule lacks: a standby started with
  another schedule (a rolling deploy, a host that does not load the user's tasks module)
  deleted the leader's periodic tasks, or changed its rescoring interval, while the
  leader went on reading its entries from Redis. Here a beat installs its entries once it
  holds the lock, at its first tick (so too a beat started while Redis is away: the
  install waited there and its error ended the beat; now the tick retries it).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import redis
from celery import beat
from celery.beat import BeatLazyFunc, SchedulingError
from celery.signals import beat_init
from redbeat.schedulers import (
    LUA_EXTEND_TO_SCRIPT,
    RedBeatScheduler,
    acquire_distributed_beat_lock,
    get_redis,
)

from sits_queue.broker.keys import QueueKeys
from sits_queue.broker.meta import WaitingMeta
from sits_queue.errors import InvalidTaskOptions
from sits_queue.options import CONTROL_QUEUE, MAINTENANCE_TASKS
from sits_queue.settings import beat_lock_timeout_s

logger = logging.getLogger(__name__)

# (redbeat's blocking take of the lock at start: see the module docstring)
beat_init.disconnect(acquire_distributed_beat_lock)

#: Seconds before a tick that met an unreachable Redis, or a lock held elsewhere, is tried
#: again.
RETRY_S = 1.0
#: Waiting messages of the control queue looked at for a maintenance pass's own.
WAITING_LOOKED_AT = 64


class SitsScheduler(RedBeatScheduler):  # type: ignore[misc]
    """``beat_scheduler`` of a SITS app (see the module docstring)."""

    #: Whether this beat's entries are in Redis since it last took the lock.
    _installed = False
    #: Seconds the lock outlives its last extension (redbeat's, set from the config).
    lock_timeout: int

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        #: (entry, reason) refused as sent, said once
        self._refused: set[tuple[str, str]] = set()
        #: Maintenance tasks not sent, one of theirs still waiting (said once a stretch).
        self._held_back: set[str] = set()
        super().__init__(app, *args, **kwargs)
        # A beat told to sleep longer (``--max-interval``, its own
        # ``beat_max_loop_interval``) keeps a lock that outlives its sleeps: shorter, a
        # healthy leader lost it between two ticks.
        self.lock_timeout = max(int(self.lock_timeout), beat_lock_timeout_s(self.max_interval))

    def setup_schedule(self) -> None:
        from sits_queue.app import beat_schedule, sits_config

        current = dict(self.app.conf.beat_schedule or {})
        ours = beat_schedule(sits_config(self.app))
        missing = {name: entry for name, entry in ours.items() if name not in current}
        if missing:
            logger.warning("beat: beat_schedule was replaced; SITS's maintenance entries %s "
                           "added back (update beat_schedule rather than assign it)",
                           sorted(missing))
            current = {**current, **missing}
        refused = {name: why for name, entry in current.items()
                   if name not in missing and (why := unsendable(self.app, entry))}
        for name, why in refused.items():
            # (one of SITS's own, changed by the app: its default, not none; left out,
            # the rescoring pass, and with it aging and pruning, stopped)
            instead = "SITS's default entry runs instead" if name in ours else \
                "left out of the schedule"
            logger.error("beat: entry %r (%s): its task would be refused: %s; %s (fix it "
                         "in beat_schedule)", name, current[name].get("task"), why, instead)
        if missing or refused:
            self.app.conf.beat_schedule = {
                name: ours[name] if name in refused else entry
                for name, entry in current.items() if name not in refused or name in ours}
        # Installed into Redis by the first tick that holds the lock (module docstring).
        self._installed = False

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True,
                    **kwargs: Any) -> Any:
        """Celery's, but a maintenance pass is not sent while one of the same task still
        waits in the control queue: with every pool slot busy, the passes queued up
        behind one another, each expired by the time a slot took it, and none ran. The
        one waiting runs the pass, on what is current when a slot frees (the transport
        picks the control queue first)."""
        if entry.task in MAINTENANCE_TASKS and self._waiting(entry.task):
            if advance:
                entry = self.reserve(entry)  # (the schedule keeps its rhythm)
            # (said once while it lasts: each second, with every slot busy or no worker
            # up, it was a line at info)
            level = logging.DEBUG if entry.task in self._held_back else logging.INFO
            self._held_back.add(entry.task)
            logger.log(level, "beat: %s not sent: the last one still waits for a slot "
                       "(said again once one is sent and another waits)", entry.task)
            return None
        self._held_back.discard(entry.task)
        try:
            return super().apply_async(entry, producer, advance, **kwargs)
        except SchedulingError as exc:
            # (an entry in Redis that is not the app's: those are checked as the beat
            # starts) refused in one line, once, not with a stack dump each period
            cause = exc.__context__
            if not isinstance(cause, InvalidTaskOptions):
                raise
            said = (entry.name, str(cause))
            if said not in self._refused:
                self._refused.add(said)
                logger.error("beat: %s (%s) not sent: %s", entry.name, entry.task, cause)
            return None

    def _waiting(self, task: str) -> bool:
        """Whether a message of ``task`` waits in the control queue (among its first
        :data:`WAITING_LOOKED_AT`: the maintenance tasks alone go there, a few at most)."""
        from sits_queue.app import sits_config

        keys = QueueKeys.for_queue(CONTROL_QUEUE, sits_config(self.app).global_keyprefix)
        client = get_redis(self.app)
        ids = client.zrange(keys.waiting, 0, WAITING_LOOKED_AT - 1)
        metas = client.hmget(keys.meta, ids) if ids else []
        return any((meta := WaitingMeta.read(raw)) is not None and meta.task == task
                   for raw in metas)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        try:
            if self.lock_key and not self._holds_lock():
                return RETRY_S
            if not self._installed:
                super().setup_schedule()
                self._installed = True
            return float(super().tick(*args, **kwargs))
        except redis.exceptions.LockError as exc:  # LockNotOwnedError: Redis lost it
            logger.warning("beat: lost its lock (%s); taking it again when free", exc)
            self.lock = None
            return RETRY_S
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            logger.warning("beat: Redis unreachable (%s); trying again in %g s", exc, RETRY_S)
            return RETRY_S
        except redis.exceptions.OutOfMemoryError as exc:  # (it exited 1 on a traceback,
            # and stayed down once the server had room: rescoring stopped till restarted)
            logger.warning("beat: Redis is full (%s); trying again in %g s", exc, RETRY_S)
            return RETRY_S

    def close(self) -> None:
        """redbeat's, with a Redis that cannot be reached said in one line and the stop
        going on: the lock, not released, expires by itself. (Called from Celery's SIGTERM
        handler: a beat stopped while its Redis was down exited 1 on ~1,400 lines of
        traceback; while it hung, the error surfaced in the next tick, which took it
        for an outage to wait out, and the beat went on leading for good.)"""
        try:
            super().close()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            logger.warning("beat: could not release its lock, Redis unreachable (%s); "
                           "it expires within %g s", exc, self.lock_timeout)
            self.lock = None
            with contextlib.suppress(Exception):  # (the rest of Celery's close)
                beat.Scheduler.close(self)

    def _holds_lock(self) -> bool:
        """Whether this beat holds the lock, taking it if it is free (redbeat takes it at
        start, blocking; here without blocking, so the beat loop goes on)."""
        if self.lock is not None:
            return True
        client = get_redis(self.app)
        lock = client.lock(self.lock_key, timeout=self.lock_timeout, sleep=self.max_interval)
        lock.lua_extend = client.register_script(LUA_EXTEND_TO_SCRIPT)  # as redbeat's
        if not lock.acquire(blocking=False):
            return False
        logger.info("beat: acquired lock")
        self.lock = lock
        # Installed by this tick: at start, or after the lock was lost with Redis's data
        # (a restart without persistence, a flush), which took the schedule entries with
        # it. Installing them again keeps the last runs of any that are still there.
        self._installed = False
        return True


def unsendable(app: Any, entry: Any) -> str | None:
    """Why a ``beat_schedule`` entry's task would be refused as it is sent (its SITS and
    delivery options, and the arguments they read), or None. Lazy arguments
    (``BeatLazyFunc``) are not called here: the options are checked without them."""
    from sits_queue.app import sits_config
    from sits_queue.calloptions import call_options, routed_options
    from sits_queue.delivery import check_delivery

    if not isinstance(entry, dict):
        return None  # (not ours to judge: Celery's own check of the schedule says)
    name, options = entry.get("task"), entry.get("options") or {}
    if not isinstance(name, str) or not isinstance(options, dict):
        return None
    args, kwargs = entry.get("args", ()), entry.get("kwargs", {})
    if isinstance(args, BeatLazyFunc) or isinstance(kwargs, BeatLazyFunc) or any(
            isinstance(v, BeatLazyFunc) for v in (*_items(args), *_items(kwargs))):
        args, kwargs = (), {}
    options = dict(options)
    try:
        check_delivery(name, options, app.timezone)
        routed_options(app, name, args, kwargs, options)
        call_options(app.tasks.get(name), sits_config(app), options, app.conf, args, kwargs,
                     name)
    except (InvalidTaskOptions, TypeError) as exc:
        return str(exc)
    return None


def _items(value: Any) -> tuple[Any, ...]:
    if isinstance(value, dict):
        return tuple(value.values())
    return tuple(value) if isinstance(value, list | tuple) else ()
