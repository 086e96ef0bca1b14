"""Celery's own delivery options of a call (``task_id``, ``countdown``, ``eta``,
``expires``, ``queue``), checked before anything is sent.

Celery takes them as given: ``countdown="10"`` failed in its date arithmetic with
"'<' not supported between 'str' and 'int'", ``expires=1e15`` with "Python int too large
to convert to C int", ``queue=5`` with "'int' object has no attribute 'startswith'", and
``eta="tomorrow"`` or ``task_id=5`` were sent, to fail at the worker as a dead letter
(whose failure could not even be stored under a task id that is no string: the caller's
``get()`` raised a TypeError of redis-py's). Each is refused here as
:class:`~sits_queue.errors.InvalidTaskOptions`, naming the option.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.utils.time import maybe_iso8601
from kombu.entity import Queue

from sits_queue.checks import shown
from sits_queue.errors import InvalidTaskOptions


def check_delivery(name: str, options: Mapping[str, Any]) -> None:
    """Refuse a delivery option Celery cannot send as meant (see the module's text)."""
    task_id = options.get("task_id")
    if task_id is not None and (not isinstance(task_id, str) or not task_id):
        raise InvalidTaskOptions(f"task {name}: task_id must be a non-empty string, got "
                                 f"{shown(task_id)}")
    countdown = options.get("countdown")
    if countdown is not None:
        _seconds_from_now(name, "countdown", countdown)
    eta = options.get("eta")
    if eta is not None and not isinstance(eta, datetime):
        _iso_time(name, "eta", eta)
    expires = options.get("expires")
    if expires is not None and not isinstance(expires, datetime):
        if isinstance(expires, str):
            _iso_time(name, "expires", expires)
        else:
            _seconds_from_now(name, "expires", expires)
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


def _seconds_from_now(name: str, option: str, value: Any) -> None:
    """A number of seconds Celery can add to the time now (a datetime holds years 1 to
    9999: a timedelta past them raised OverflowError in the producer)."""
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
        datetime.now(timezone.utc) + timedelta(seconds=seconds)
    except OverflowError:
        raise InvalidTaskOptions(f"task {name}: {option} {shown(value)} s reaches past the "
                                 "years a date holds (1 to 9999)") from None


def _iso_time(name: str, option: str, value: Any) -> None:
    """A datetime's ISO 8601 text, as the worker will parse it (Celery's own reader)."""
    if isinstance(value, str) and value:
        try:
            maybe_iso8601(value)
            return
        except (ValueError, TypeError, OverflowError):
            pass
    raise InvalidTaskOptions(f"task {name}: {option} must be a datetime or its ISO 8601 "
                             f"text, got {shown(value)}")
