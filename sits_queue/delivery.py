"""Celery's own delivery options of a call (``task_id``, ``countdown``, ``eta``,
``expires``, ``queue``), checked before anything is sent.

Celery takes them as given: ``countdown="10"`` failed in its date arithmetic with
"'<' not supported between 'str' and 'int'", ``expires=1e15`` with "Python int too large
to convert to C int", ``queue=5`` with "'int' object has no attribute 'startswith'", and
``eta="tomorrow"`` or ``task_id=5`` were sent, to fail at the worker as a dead letter
(whose failure could not even be stored under a task id that is no string: the caller's
``get()`` raised a TypeError of redis-py's). So were ETAs past the years a date holds
(``eta="9999-12-31T23:59:59-05:00"``, in UTC a year 10000; a datetime ``eta`` was not
looked at), dead-lettered by the worker with an OverflowError, and a countdown that
lands past them in the app's time zone raised a bare OverflowError. Each is refused
here as :class:`~sits_queue.errors.InvalidTaskOptions`, naming the option and its value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from datetime import datetime, timezone, tzinfo
from typing import Any

from kombu.entity import Queue

from sits_queue.broker.keys import DELIVERY_ONLY
from sits_queue.checks import is_utf8, shown
from sits_queue.errors import InvalidTaskOptions
from sits_queue.etas import after_seconds, out_of_range, read_eta


def check_delivery(name: str, options: Mapping[str, Any],
                   zone: tzinfo = timezone.utc) -> None:
    """Refuse a delivery option Celery cannot send as meant (see the module's text);
    ``zone``: the app's time zone, where Celery turns a countdown into an ETA."""
    task_id = options.get("task_id")
    if task_id is not None and (not isinstance(task_id, str) or not task_id):
        raise InvalidTaskOptions(f"task {name}: task_id must be a non-empty string, got "
                                 f"{shown(task_id)}")
    if task_id is not None and not is_utf8(task_id):
        # (a lone surrogate was sent, to be dead-lettered: no result key holds it)
        raise InvalidTaskOptions(f"task {name}: task_id must be UTF-8 text, got "
                                 f"{shown(task_id)}")
    countdown = options.get("countdown")
    if countdown is not None:
        _seconds_from_now(name, "countdown", countdown, zone)
    eta = options.get("eta")
    if eta is not None:
        _eta(name, eta)
    expires = options.get("expires")
    if expires is not None and not isinstance(expires, datetime):
        if isinstance(expires, str):
            _iso_time(name, "expires", expires)
        else:
            _seconds_from_now(name, "expires", expires, zone)
    headers = options.get("headers")
    if isinstance(headers, Mapping) and "id" in headers and headers["id"] != task_id:
        # (Celery lays a call's headers over its own: the message ran, or was dead-
        # lettered, under that id, and the caller's get() waited for good on another)
        raise InvalidTaskOptions(f"task {name}: headers cannot set Celery's task id "
                                 f"('id': {shown(headers['id'])}); give task_id= instead")
    queue = options.get("queue")
    if queue is not None and not (isinstance(queue, Queue)
                                  or (isinstance(queue, str) and queue)):
        raise InvalidTaskOptions(f"task {name}: queue must be a queue's name or a kombu "
                                 f"Queue, got {shown(queue)}")


def _seconds_from_now(name: str, option: str, value: Any, zone: tzinfo) -> None:
    """A number of seconds Celery can add to the time now in the app's ``zone``, to a
    time its worker can hold (a datetime holds years 1 to 9999: a timedelta past them
    raised OverflowError in the producer)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidTaskOptions(f"task {name}: {option} must be a number of seconds, got "
                                 f"{shown(value)}")
    try:
        seconds = float(value)
    except OverflowError:  # an int past a float's range
        seconds = math.inf
    if not math.isfinite(seconds):
        raise InvalidTaskOptions(f"task {name}: {option} must be a finite number of "
                                 f"seconds, got {shown(value)}")
    try:
        beyond = out_of_range(after_seconds(datetime.now(zone), seconds), zone)
    except OverflowError:
        beyond = True
    if beyond:
        raise InvalidTaskOptions(f"task {name}: {option} {shown(value)} s reaches past the "
                                 f"years a date holds (1 to 9999) in UTC, this system's "
                                 f"time zone or the app's ({zone})")


def _eta(name: str, value: Any) -> None:
    """An ETA Celery reads, and that its worker can time: within the years a date holds
    in UTC and in its system's time zone (a datetime was sent unchecked)."""
    if isinstance(value, datetime):  # (naive: UTC, as Celery's worker reads it)
        when = value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
        given = value.isoformat()  # (as Celery sends it; its repr runs long)
    else:
        when, given = _iso_time(name, "eta", value), value
    if out_of_range(when):
        raise InvalidTaskOptions(f"task {name}: eta {shown(given)} falls past the years a "
                                 "date holds (1 to 9999) in UTC or this system's time zone")


def _iso_time(name: str, option: str, value: Any) -> datetime:
    """A datetime's ISO 8601 text, as the worker will parse it (Celery's own reader):
    the time it names."""
    if isinstance(value, str) and value:
        try:
            return read_eta(value)
        except OverflowError:  # (9999-12-31T24:00:00)
            raise InvalidTaskOptions(f"task {name}: {option} {shown(value)} falls past the "
                                     "years a date holds (1 to 9999)") from None
        except (ValueError, TypeError):
            pass
    raise InvalidTaskOptions(f"task {name}: {option} must be a datetime or its ISO 8601 "
                             f"text, got {shown(value)}")


def drop_delivery_only(options: dict[str, Any]) -> None:
    """Take the headers a pick adds to one delivery out of a call's ``headers=``: a task
    that forwards ``self.request.headers`` (its correlation headers) carries them, and
    a caller's ``sits_checkpoint`` ran the first run from a made-up checkpoint,
    ``self.checkpoint`` being None there only on the broker's word. (Refused, every
    forwarding of a request's headers failed.)"""
    headers = options.get("headers")
    if isinstance(headers, Mapping) and not DELIVERY_ONLY.isdisjoint(headers):
        options["headers"] = {k: v for k, v in headers.items() if k not in DELIVERY_ONLY}
