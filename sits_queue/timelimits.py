"""A task's Celery time limits: from the call, the task, the app's settings or its
SLA class, worked out into a pair that holds (:func:`apply_class_limits`), and fitted
again for a retry given one of them (:func:`fit_carried_limit`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import Task

from sits_queue.checks import finite, is_number, shown
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidTaskOptions


def apply_class_limits(task: Task | None, config: SitsConfig, sla_class: str,
                       options: dict[str, Any], conf: Mapping[str, Any] | None = None
                       ) -> None:
    """Set the Celery time limits the message carries. For each limit a call's setting
    wins, then the task's (None: not registered here, none), then the app's
    ``task_time_limit`` / ``task_soft_time_limit`` (``conf``; Celery also binds them to
    each task), then the class's: those are the defaults for what the caller did not set.

    A hard limit set and no soft one: the soft limit is ``soft_limit_fraction`` of it,
    above or below the class's (the class's soft limit would cut a task whose hard limit
    was raised short of it; and Celery's prefork pool enforces a hard limit only after
    the soft one has fired, so it would hold a task whose hard limit was lowered past
    it). A soft limit at or past the hard one: the limit set by the higher-ranked
    source moves the other (a soft limit raises the hard one so that it fires first; a
    hard limit brings the soft one to its fraction); both from one source is refused."""
    soft, hard = config.time_limits(sla_class)
    fraction = config.soft_limit_fraction
    own_hard = _ranked_limit(task, options, conf or {}, "time_limit")
    own_soft = _ranked_limit(task, options, conf or {}, "soft_time_limit")
    hard_rank = own_hard[0] if own_hard else len(_SOURCES)
    if own_hard:
        hard = own_hard[2]
    if not own_soft:
        soft = fraction * hard if own_hard else soft
    elif own_soft[2] < hard:
        soft = own_soft[2]
    elif own_soft[0] < hard_rank:
        soft, hard = own_soft[2], own_soft[2] / fraction
    elif own_soft[0] > hard_rank:
        soft = fraction * hard
    elif own_soft[2] > hard:
        raise InvalidTaskOptions(f"{own_soft[1]} {own_soft[2]:g} s must not exceed "
                                 f"{own_hard[1] if own_hard else 'time_limit'} {hard:g} s")
    else:
        soft = own_soft[2]
    # set on the call: they win over the task's own, which Celery would send otherwise
    options["time_limit"] = hard
    options["soft_time_limit"] = soft


#: Where a time limit may come from, highest rank first.
_SOURCES = ("call", "task", "app")


def _ranked_limit(task: Task | None, options: Mapping[str, Any], conf: Mapping[str, Any],
                  name: str) -> tuple[int, str, float] | None:
    """The ``name`` limit that applies: (its source's rank, how the user set it, s), or
    None when none is set (0 and None: unset, as in Celery). A value that is not a
    positive number is refused naming where it was set."""
    app_value = conf.get(f"task_{name}")
    task_value = getattr(task, name, None)
    # Celery binds the app's setting to a task that sets none: that is the app's
    found = (options.get(name), None if task_value == app_value else task_value, app_value)
    for rank, value in enumerate(found):
        if not value:
            continue
        # (named only here: built for every call, the names were a tenth of its cost)
        where = (name, f"{getattr(task, 'name', 'the task')}'s {name}", f"task_{name}")[rank]
        # (finite as a float: float() of an int past its range raised OverflowError)
        if not is_number(value) or not finite(value) or value <= 0:
            raise InvalidTaskOptions(f"{where} must be a positive number of seconds, got "
                                     f"{shown(value)}")
        return rank, where, float(value)
    return None


def fit_carried_limit(config: SitsConfig, options: dict[str, Any], old: Any,
                      given: Mapping[str, Any]) -> None:
    """A retry given one time limit: the other one Celery carried over from the run is
    dropped from ``options`` where it was class ``old``'s default or would contradict the
    new one, so that the pair is worked out as at submission (both from the call, a soft
    limit past the hard one was refused, and the retry was lost as a Reject)."""
    pair = ("soft_time_limit", "time_limit")
    set_ = [n for n in pair if given.get(n) is not None]
    if len(set_) != 1:
        return
    other = pair[1 - pair.index(set_[0])]
    defaults = config.time_limits(old) if old in config.class_names else (None, None)
    soft, hard = options.get("soft_time_limit"), options.get("time_limit")
    clash = is_number(soft) and is_number(hard) and soft > hard
    if options.get(other) is not None and (
            clash or options[other] == defaults[pair.index(other)]):
        options.pop(other)


def settle_bound_limits(task: Task) -> None:
    """The call's limits are settled by rank (:func:`apply_class_limits`) and carried in
    its options; Celery's ``apply_async`` still refuses a task whose own soft limit is
    past its hard one, and Celery binds the app's ``task_time_limit`` to a task that sets
    none: a task's ``soft_time_limit=2`` under an app's ``task_time_limit=1`` could not
    be sent at all ("soft_time_limit must be less than or equal to time_limit", whatever
    the call gave). The app's value bound to the task is let go (the app's setting is
    read from the app, ranked below the task's)."""
    soft, hard = task.soft_time_limit, task.time_limit
    if not (soft and hard and soft > hard):
        return
    for name in ("time_limit", "soft_time_limit"):
        if getattr(task, name) == task.app.conf.get(f"task_{name}"):
            setattr(task, name, None)
