"""The Celery settings a SitsConfig gives: the production defaults, the broker transport
options, and the beat's schedule of SITS's maintenance passes."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from sits_queue import redisurl
from sits_queue.broker import results
from sits_queue.config import SitsConfig, without_credentials
from sits_queue.errors import ConfigError

TRANSPORT = "sits_queue.broker.transport:Transport"
DEFAULT_QUEUE = "celery"


#: The longest the beat sleeps between two ticks (Celery's ``beat_max_loop_interval``,
#: 300 s by default); an entry due sooner wakes it sooner (the trigger check, every
#: second by default). Each tick extends the beat's lock: its timeout follows from this.
BEAT_MAX_LOOP_S = 2.0
#: The beat's lock outlives its last extension by this many of the beat's longest sleeps,
LOCK_TIMEOUT_LOOPS = 5
#: and by this many seconds at least: the rest of a tick's time is its own work (the due
#: passes sent, a publish retried), which a loaded host slows.
MIN_LOCK_TIMEOUT_S = 15


def beat_lock_timeout_s(max_loop_s: float) -> int:
    """The beat's lock timeout (``redbeat_lock_timeout``) for a beat whose ticks sleep up
    to ``max_loop_s``: held by a leader that ticks, free soon after one that stopped
    (a standby looks each second). (It was 6 x the rescoring interval, which the beat
    does not tick by: at 300 s a killed beat's lock lived 30 minutes, and its standby
    sent no trigger check, rescoring or pre-warm plan all that time.)"""
    return max(MIN_LOCK_TIMEOUT_S, math.ceil(LOCK_TIMEOUT_LOOPS * max_loop_s))


#: Transport options the SITS config decides (what it holds, and the keys it names), and
#: the setting a user changes instead.
OWN_TRANSPORT_OPTIONS = {"global_keyprefix": "SITS_GLOBAL_KEYPREFIX",
                         "visibility_timeout": "SITS_VISIBILITY_TIMEOUT_S"}


def sits_transport_options(config: SitsConfig, *given: Mapping[str, Any] | None
                      ) -> dict[str, Any]:
    """The broker transport options: those ``given`` (the app's
    ``broker_transport_options``, a connection's own), with the SITS config's on top. A
    user who replaces ``broker_transport_options`` the usual Celery way keeps them; one
    who sets an option the SITS config decides to another value is told which setting
    to change (a producer and a worker would otherwise use different keys)."""
    ours = {"visibility_timeout": config.visibility_timeout_s,
            "global_keyprefix": config.global_keyprefix,
            "sits_config": shared_config(config)}
    merged: dict[str, Any] = {
        # The sweep restores messages of silent workers; ours throttles by time.
        "unacked_restore_interval": max(1.0, config.visibility_timeout_s / 6)}
    for options in given:
        merged.update(options or {})
    for name, setting in OWN_TRANSPORT_OPTIONS.items():
        if name in merged and merged[name] != ours[name]:
            raise ConfigError(f"broker_transport_options {name}={merged[name]!r} differs from "
                              f"the SITS config's {ours[name]!r}: set {setting} instead")
    return {**merged, **ours}


def celery_settings(config: SitsConfig) -> dict[str, Any]:
    """Celery configuration derived from a SitsConfig: the production defaults."""
    prefix = config.global_keyprefix
    # (the URL's connection options as settings: kombu refuses them in its query)
    url, connection = redisurl.celery_parts(config.redis_url)
    return {
        "broker_url": url,
        "broker_transport": TRANSPORT,
        "broker_transport_options": sits_transport_options(config, connection),
        "broker_connection_retry_on_startup": True,
        # Celery's Redis backend, storing each state in one atomic round trip.
        "result_backend": results.backend_url(url),
        **redisurl.backend_settings(connection),
        "result_backend_transport_options": {"global_keyprefix": prefix},
        "result_expires": timedelta(days=1),
        # Celery's default: results without the task's arguments. Extended ones kept a
        # copy of them with each state for result_expires (100 MB of arguments: 112 MB of
        # Redis for a day), published each to the caller's subscription past Redis's
        # pub/sub output limit. An app that wants AsyncResult.args sets it.
        "result_extended": False,
        # A result store that meets a Redis restart retries instead of failing a task
        # whose body already succeeded.
        "result_backend_always_retry": True,
        "result_backend_max_retries": 20,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # Late acks + requeue on worker loss: a SIGKILLed worker's task runs again.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # Reserve only what a free pool slot is about to run, so priority stays exact.
        "worker_prefetch_multiplier": 1,
        "worker_disable_prefetch": True,
        "task_track_started": True,
        # Celery's consumer acks (loses) a message whose body does not decode and rejects
        # an invalid one with its reason in the log only: dead-lettered with the reason,
        # and the task's result failed, instead.
        "worker_consumer": "sits_queue.workers.consumer:SitsConsumer",
        # Celery kills a new pool child that has not reported in within 4 s; a GPU host's
        # children may import a CUDA build of torch in their init handlers (the user's own
        # worker_process_init ones too), which alone can take that long.
        "worker_proc_alive_timeout": 30.0,
        "task_send_sent_event": config.send_sent_events,
        "worker_send_task_events": True,
        # Each worker also consumes its own queue (<hostname>.dq2): pre-warm tasks go to
        # the worker the planner chose (priority/prewarm.py).
        "worker_direct": True,
        # No task_queues: Celery builds the worker's queues from task_default_queue, which
        # an app may set (a fixed tuple kept "celery" and dropped the app's own default:
        # its tasks went to a queue no worker consumed); the control queue is declared
        # beside the app's (app.py, SitsAMQP) and selected at every worker's start
        # (workers/runtime.py), the maintenance tasks routed there as they are sent
        # (options.route_maintenance). No task_routes of SITS's own: an app's assigned
        # table replaced it, and an empty one spares every delay() a route lookup.
        "task_default_queue": DEFAULT_QUEUE,
        "beat_scheduler": "sits_queue.priority.beat:SitsScheduler",
        # its own (none): not the broker transport options, which redbeat would fall back on
        "redbeat_redis_options": {},
        "redbeat_redis_url": config.redis_url,
        "redbeat_key_prefix": f"{prefix}sits:redbeat:",
        "beat_max_loop_interval": BEAT_MAX_LOOP_S,
        # (raised by the scheduler where the beat sleeps longer: priority/beat.py)
        "redbeat_lock_timeout": beat_lock_timeout_s(BEAT_MAX_LOOP_S),
        "beat_schedule": beat_schedule(config),
    }


def beat_schedule(config: SitsConfig) -> dict[str, Any]:
    # No expiry: the beat sends none of these while one of them still waits
    # (priority/beat.py), so the one waiting, run late, is the pass. (Expiring after one
    # period, they were all discarded on a worker whose every slot was busy: a freed slot
    # took the oldest, expired, and the control queue only grew; no pass ran, no task aged.)
    return {
        "sits-rescore": {"task": "sits.rescore", "schedule": config.rescore_interval_s},
        "sits-check-triggers": {"task": "sits.check_triggers",
                                "schedule": config.trigger_check_interval_s},
        **({"sits-prewarm-plan": {"task": "sits.prewarm_plan",
                                  "schedule": prewarm_schedule(config.prewarm_interval_s)}}
           if config.prewarm_interval_s > 0 else {}),
        **({"sits-site-sync": {"task": "sits.site_sync",
                               "schedule": config.site_sync_interval_s}}
           if config.site else {}),
    }


def prewarm_schedule(interval_s: float) -> Any:
    """When the pre-warm plan runs: as each demand interval begins (UTC multiples of
    ``interval_s``), where a crontab can say so (intervals that divide an hour in whole
    minutes, or a day in whole hours), since the plan forecasts the interval it runs in;
    an interval from the beat's start otherwise, where a plan may land late in its own
    (the 300 s default, run from the beat's start, forecast an interval half gone on
    average, all of it at worst)."""
    from celery.schedules import crontab

    seconds = int(interval_s)
    if seconds == interval_s and seconds > 0:
        if seconds % 60 == 0 and 3600 % seconds == 0:
            return crontab(minute=f"*/{seconds // 60}")
        # (in the app's timezone: aligned to UTC's hours where its offset is whole hours)
        if seconds % 3600 == 0 and 86_400 % seconds == 0:
            return crontab(minute=0, hour=f"*/{seconds // 3600}")
    return interval_s


#: The fields of a SitsConfig that hold credentials: Redis URLs with their passwords.
CREDENTIAL_FIELDS = ("redis_url", "site_peers")
#: Where the config the transport options carry names its credentials in this process.
CREDENTIALS_REF = "credentials"
_credentials: dict[str, dict[str, Any]] = {}
_refs: dict[tuple[Any, ...], str] = {}


def shared_config(config: SitsConfig) -> dict[str, Any]:
    """The SITS config as the transport options carry it (each channel rebuilds it from
    there: :func:`config_from_options`), its credentials masked and kept in this process
    under a reference. Celery sends the transport options whole in ``inspect stats``,
    and Flower shows them on its worker page: the Redis password was there for anyone
    who could see Flower. (A pool child has them by the fork.)"""
    plain: dict[str, Any] = _plain(asdict(config))
    secret = tuple(plain[name] for name in CREDENTIAL_FIELDS)
    ref = _refs.setdefault(secret, uuid.uuid4().hex)
    _credentials[ref] = dict(zip(CREDENTIAL_FIELDS, secret, strict=True))
    masked: dict[str, Any] = without_credentials(plain)
    return {**masked, CREDENTIALS_REF: ref}


def config_from_options(raw: Mapping[str, Any], source: str) -> SitsConfig:
    """The SitsConfig that :func:`shared_config` carried, its credentials put back (masked
    ones stay where this process does not hold them: a connection then fails to
    authenticate, naming its server)."""
    data = dict(raw)
    data.update(_credentials.get(str(data.pop(CREDENTIALS_REF, "")), {}))
    return SitsConfig.from_mapping(data, source=source)


def _plain(value: Any) -> Any:
    """asdict() keeps tuples; transport options should be plain JSON-like data."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
