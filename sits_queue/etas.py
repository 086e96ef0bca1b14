"""When a task falls due, as Celery will have it: one reading of an ``eta`` for the checks
at submission (``delivery.py``), the broker's scoring record (``broker/meta.py``) and the
worker's statistics (``workers/signals.py``), and whether Celery can hold the time at
all.

(The broker read the ``eta`` header with ``datetime.fromisoformat`` while Celery reads
it with dateutil's ``isoparse``: ``...T24:00:00+00:00``, which Celery runs at the next
day's midnight, and ISO's ``2026-344``, ``2026-12`` or ``2026`` were no ETA to the
broker, so such a task aged from its put while not due, rescored to the top, and
``sitsq status`` said it had waited rather than when it falls due.)
"""

from __future__ import annotations

import math
from datetime import datetime, timezone, tzinfo
from typing import Any

from celery.utils.time import add_seconds_to_datetime, maybe_iso8601


def read_eta(value: str | datetime) -> datetime:
    """``value`` as an aware datetime: Celery's own reading of its text, one without a
    time zone in UTC (as Celery's worker reads it by default). Raises ``ValueError`` for
    what Celery does not read either, ``OverflowError`` for a text past year 9999
    (``9999-12-31T24:00:00``)."""
    when: datetime | None = maybe_iso8601(value)
    if when is None:  # (maybe_iso8601's answer to "")
        raise ValueError("an empty ETA")
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def due_s(value: Any) -> float | None:
    """When an ETA (its text, or a datetime) falls due, s since the epoch; None without
    one, or for one Celery does not read."""
    if not isinstance(value, (str, datetime)):
        return None
    try:
        due = read_eta(value).timestamp()
    except (ValueError, TypeError, OverflowError):
        return None
    return due if math.isfinite(due) else None


def after_seconds(now: datetime, seconds: float) -> datetime:
    """The ETA Celery makes of a countdown (or a numeric ``expires``) given at ``now``,
    in ``now``'s time zone: the app's. Raises ``OverflowError`` where that falls past
    the years a datetime holds, as Celery's producer did (a bare OverflowError out of
    ``apply_async``)."""
    return add_seconds_to_datetime(now, seconds)  # type: ignore[no-any-return]


def out_of_range(when: datetime, *zones: tzinfo) -> bool:
    """Whether the aware ``when`` falls outside the years a datetime holds (1 to 9999) in
    UTC, in this system's time zone, or in any of ``zones``. Celery's worker times an
    ETA in its system's zone (``to_system_tz``): one past them there was logged as
    "Couldn't convert ETA", its task failed with an OverflowError and dead-lettered. A
    worker's zone is not known at submission; the producer's stands for it."""
    for zone in (timezone.utc, None, *zones):
        try:
            when.astimezone(zone)
        except (OverflowError, ValueError, OSError):
            return True
    return False
