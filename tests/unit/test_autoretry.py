"""Celery's ``autoretry_for`` over an inference task's engine fetch (``workers/autoretry.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import Ignore, Retry

from sits_queue.errors import ModelLoadError
from sits_queue.workers.autoretry import retry_or_raise


class Task(SimpleNamespace):
    def retry(self, exc: BaseException, **kwargs: Any) -> Retry:
        self.retried = kwargs
        return Retry(exc=exc)


def load_failure(cause: BaseException) -> ModelLoadError:
    try:
        raise ModelLoadError("loader for model 'm' failed") from cause
    except ModelLoadError as exc:
        return exc


@pytest.mark.parametrize("autoretry_for", [(OSError,), (ModelLoadError,), (Exception,)])
def test_a_load_failure_or_its_cause_named_is_retried_with_the_tasks_options(
        autoretry_for: tuple[type[BaseException], ...]) -> None:
    task = Task(autoretry_for=autoretry_for, retry_kwargs={"countdown": 2, "max_retries": 5},
                request=SimpleNamespace(retries=0))
    with pytest.raises(Retry):
        retry_or_raise(task, load_failure(OSError("store timed out")))
    assert task.retried == {"countdown": 2, "max_retries": 5}


def test_backoff_sets_the_countdown_as_celery_does() -> None:
    task = Task(autoretry_for=(OSError,), retry_backoff=3, retry_jitter=False,
                request=SimpleNamespace(retries=2))
    with pytest.raises(Retry):
        retry_or_raise(task, OSError("x"))
    assert task.retried == {"countdown": 12}  # 3 * 2**2


@pytest.mark.parametrize(("options", "exc"), [
    ({}, load_failure(OSError("x"))),                                     # no autoretry_for
    ({"autoretry_for": (ValueError,)}, load_failure(OSError("x"))),       # another type
    ({"autoretry_for": (Exception,), "dont_autoretry_for": (OSError,)},  # told not to
     load_failure(OSError("x"))),
    ({"autoretry_for": (Exception,)}, Ignore()),                          # Celery's own
])
def test_what_the_task_does_not_retry_is_raised_as_it_came(options: dict[str, Any],
                                                           exc: Exception) -> None:
    task = Task(request=SimpleNamespace(retries=0), **options)
    with pytest.raises(type(exc)) as raised:
        retry_or_raise(task, exc)
    assert raised.value is exc and not hasattr(task, "retried")
