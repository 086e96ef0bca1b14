"""A retried task keeps its SITS options (``SitsTask.signature_from_request``, which
Celery's ``retry`` builds the new message from). No broker: the signature is inspected."""

from __future__ import annotations

from typing import Any

import pytest
from celery.app.task import Context

from sits_queue.app import make_app
from sits_queue.config import SitsConfig
from sits_queue.options import HEADER


@pytest.fixture
def task() -> Any:
    app = make_app(SitsConfig(), main="retry-unit")

    @app.task(name="u.work", shared=False)
    def work(x: int) -> int:
        return x

    return work


def request(header: Any) -> Context:
    return Context(id="t-1", args=(1,), kwargs={}, retries=0, delivery_info={},
                   **{HEADER: header})


def test_the_running_tasks_options_ride_on_the_retry(task: Any) -> None:
    header = {"sla_class": "high", "model": "m-x", "context_tokens": 512, "vram_gib": None}
    sig = task.signature_from_request(request(header), countdown=1)
    assert sig.options["sla_class"] == "high" and sig.options["model"] == "m-x"
    assert sig.options["context_tokens"] == 512
    assert "vram_gib" not in sig.options  # unset stays unset
    assert sig.options["countdown"] == 1


def test_options_given_to_the_retry_win(task: Any) -> None:
    sig = task.signature_from_request(request({"sla_class": "high"}), sla_class="low")
    assert sig.options["sla_class"] == "low"


@pytest.mark.parametrize("header", [None, "not a mapping", ["high"]])
def test_a_request_without_a_readable_header_carries_nothing(task: Any, header: Any) -> None:
    sig = task.signature_from_request(request(header))
    assert "sla_class" not in sig.options and "model" not in sig.options
