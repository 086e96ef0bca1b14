"""Celery's ``autoretry_for`` for an inference task's engine load.

Celery wraps a task's ``run`` in its autoretry policy (``celery.app.autoretry``). An
inference task's engine is fetched before ``run`` is called (``inference._prepare``),
so a loader that failed once (a model store that timed out) failed the task at its first
try, whatever ``autoretry_for`` said, while the same error raised by the function was
retried. Here the same policy, read from the same task attributes, covers the load: a
``ModelLoadError`` alone (``inference._retry_load``). What is checked before or after
the load gives the same answer each time (bad arguments, an unknown model, an engine
larger than the class allows): retried, a typo was told minutes later.

A load failure is a ``ModelLoadError`` whose cause is the loader's own exception: either
matches ``autoretry_for`` and ``dont_autoretry_for`` (``(OSError,)`` names the store's
timeout, as it would raised in the function).
"""

from __future__ import annotations

from typing import Any, NoReturn

from celery.exceptions import Ignore, Retry
from celery.utils.time import get_exponential_backoff_interval


def _types(task: Any, name: str) -> tuple[type[BaseException], ...]:
    return tuple(getattr(task, name, None) or ())


def _matches(exc: BaseException, types: tuple[type[BaseException], ...]) -> bool:
    return bool(types) and (isinstance(exc, types) or isinstance(exc.__cause__, types))


def retry_or_raise(task: Any, exc: Exception) -> NoReturn:
    """Retry ``task`` for ``exc`` as Celery's autoretry would (its backoff, jitter,
    ``retry_kwargs`` and ``max_retries``: past them, ``exc`` itself); else raise ``exc``."""
    if isinstance(exc, Ignore | Retry) or _matches(exc, _types(task, "dont_autoretry_for")) \
            or not _matches(exc, _types(task, "autoretry_for")):
        raise exc
    kwargs = dict(getattr(task, "retry_kwargs", None) or {})
    backoff = float(getattr(task, "retry_backoff", False) or 0)
    if backoff:
        kwargs["countdown"] = get_exponential_backoff_interval(
            factor=int(max(1.0, backoff)), retries=task.request.retries,
            maximum=int(getattr(task, "retry_backoff_max", 600)),
            full_jitter=getattr(task, "retry_jitter", True))
    if hasattr(task, "override_max_retries"):
        kwargs["max_retries"] = task.override_max_retries
    raise task.retry(exc=exc, **kwargs)
