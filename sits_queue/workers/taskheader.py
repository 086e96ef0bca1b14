"""What a running task's SITS options header says: its class, model, prefix key and
precision, read from a delivered request, an eager call's headers or a batch job's dict
(the runtime, the inference tasks and the batches read them alike)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sits_queue.checks import finite, is_number
from sits_queue.config import ClassQuota, SitsConfig
from sits_queue.errors import UnknownModel
from sits_queue.options import HEADER, PRECISIONS

logger = logging.getLogger(__name__)


def sits_header(request: Any) -> Mapping[str, Any] | None:
    """The running task's SITS options header: a delivered message's headers are its
    request's attributes; an eager call (``apply()``, ``task_always_eager``) keeps them
    in ``request.headers`` (read there, or its model, class and precision were ignored);
    a batch's jobs carry a request dict (``workers/batched.py``)."""
    header = request.get(HEADER) if isinstance(request, Mapping) \
        else getattr(request, HEADER, None)
    if header is None:
        headers = request.get("headers") if isinstance(request, Mapping) \
            else getattr(request, "headers", None)
        header = headers.get(HEADER) if isinstance(headers, Mapping) else None
    return header if isinstance(header, Mapping) else None


def task_class(config: SitsConfig, request: Any, declared: str | None = None) -> ClassQuota:
    """The SLA class a running task was submitted with: the message header's, else the
    task's declared one (a direct call has no header), else the default class."""
    header = sits_header(request)
    name = header.get("sla_class") if isinstance(header, Mapping) else None
    if not isinstance(name, str) or name not in config.class_names:
        name = declared if declared in config.class_names else config.default_class
    assert name is not None
    return config.quota(name)


#: Classes this process said it lacks (:func:`say_foreign_class`), at most this many.
_said_foreign: set[str] = set()
_SAID_MOST = 64


def say_foreign_class(config: SitsConfig, request: Any, declared: str | None) -> None:
    """Warn, once per class a process, of a task whose header names a class this
    worker's table lacks (a producer of another table, a release that renamed classes):
    it runs in its own or the default class (:func:`task_class`), with the time limits
    its message carries, set at submission from the class it named."""
    header = sits_header(request)
    name = header.get("sla_class") if isinstance(header, Mapping) else None
    if not isinstance(name, str) or name in config.class_names or name in _said_foreign \
            or len(_said_foreign) >= _SAID_MOST:
        return
    _said_foreign.add(name)
    logger.warning("task %s: sla_class %.100r is not in this worker's classes %s (a producer "
                   "of another class table?): runs in %r, with the time limits its message "
                   "carries", getattr(request, "task", None) or "?", name,
                   list(config.class_names), task_class(config, request, declared).name)


def task_model(request: Any, declared: str | None) -> str:
    header = sits_header(request)
    name = header.get("model") if isinstance(header, Mapping) else None
    name = name if isinstance(name, str) and name else declared
    if not name:
        raise UnknownModel("this inference task names no model; register one with "
                           "@app.model and pass model=... on the task or the call")
    return name


def task_prefix_key(request: Any) -> str | None:
    """The ``prefix_key`` the producer set or derived (``options.derive_prefix_key``)."""
    header = sits_header(request)
    key = header.get("prefix_key") if isinstance(header, Mapping) else None
    return key if isinstance(key, str) and key else None


def task_precision(request: Any, declared: str | None = None) -> str | None:
    """The precision the task asked its model to be served at; None: as loaded."""
    header = sits_header(request)
    value = header.get("precision") if isinstance(header, Mapping) else None
    value = value if isinstance(value, str) and value else declared
    return value if value in PRECISIONS else None


def task_intensity(request: Any) -> float | None:
    """The ``arithmetic_intensity`` (FLOP/byte) the task declared or was given; None where
    it has none (or the header's is no number: a header is checked where it is read for
    the task's options, not here)."""
    header = sits_header(request)
    value = header.get("arithmetic_intensity") if isinstance(header, Mapping) else None
    return float(value) if is_number(value) and finite(value) and value >= 0 else None
