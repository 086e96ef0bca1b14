"""Time slices: which classes outrank which, what a yield point reads off the request,
and the Preempted exception crossing the pool's pipe (no services)."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from types import SimpleNamespace

import pytest
from celery.exceptions import Reject

from sits_queue.config import ConfigError, SitsConfig
from sits_queue.workers.slices import (
    Preempted,
    Running,
    past_slice,
    running_from,
    state_json,
)


def test_classes_yield_only_to_heavier_ones() -> None:
    config = SitsConfig()
    assert config.outranking("low") == ("high", "medium")
    assert config.outranking("medium") == ("high",)
    assert config.outranking("high") == ()


@pytest.mark.parametrize("field", ["slice_ms", "yield_wait_ms"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "20"])
def test_bad_slice_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        replace(SitsConfig(), **{field: value})


def request(**fields: object) -> SimpleNamespace:
    return SimpleNamespace(**fields)


def test_running_is_read_from_the_delivery_and_sits_headers() -> None:
    got = running_from(request(sits_delivery=["celery", "m-1"], sits={"sla_class": "low"}), 5.0)
    assert got == Running("celery", "m-1", "low", 5.0)


@pytest.mark.parametrize("req", [
    request(),  # an eager call: no delivery
    request(sits_delivery=["celery", "m-1"]),  # no sits header (a foreign producer)
    request(sits_delivery="celery/m-1", sits={"sla_class": "low"}),
    request(sits_delivery=["celery"], sits={"sla_class": "low"}),
    request(sits_delivery=["celery", 7], sits={"sla_class": "low"}),
    request(sits_delivery=["celery", "m-1"], sits={"sla_class": None}),
])
def test_anything_else_never_yields(req: SimpleNamespace) -> None:
    assert running_from(req, 0.0) is None


def test_the_slice_is_measured_from_the_run_start() -> None:
    config = replace(SitsConfig(), slice_ms=20.0)
    running = Running("q", "m", "low", started=100.0)
    assert not past_slice(running, 100.019, config.slice_s("low"))
    assert past_slice(running, 100.021, config.slice_s("low"))


def test_a_class_may_have_its_own_slice_quota() -> None:
    config = SitsConfig.from_mapping({"slice_ms": 20.0, "classes": [
        {"name": "high"}, {"name": "medium", "slice_ms": 50.0}, {"name": "low"}]})
    medium = Running("q", "m", "medium", started=100.0)
    medium_s = config.slice_s("medium")
    assert not past_slice(medium, 100.049, medium_s) and past_slice(medium, 100.051, medium_s)
    low = Running("q", "m", "low", started=100.0)  # no quota of its own: the global one
    assert past_slice(low, 100.021, config.slice_s("low"))
    stranger = Running("q", "m", "other-table", started=100.0)
    assert past_slice(stranger, 100.021, config.slice_s("other-table"))


def test_preempted_is_a_requeueing_reject_that_survives_pickling() -> None:
    exc = Preempted("yielded")
    assert isinstance(exc, Reject) and exc.requeue
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, Preempted) and back.requeue and back.reason == "yielded"


def test_a_yield_point_with_redis_unreachable_lets_the_task_run_on(
        caplog: pytest.LogCaptureFixture) -> None:
    from sits_queue.app import make_app
    from sits_queue.workers import slices

    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="slices_unit")

    @app.task(bind=True, sla_class="low", shared=False)
    def step(self: object) -> None: ...

    task = app.tasks[step.name]
    task.push_request(id="t-1", sits_delivery=["celery", "m-1"], sits={"sla_class": "low"})
    slices._starts["t-1"] = -1e9  # long past its slice
    try:
        with caplog.at_level("WARNING"):
            task.yield_point({"done": 3})  # no Preempted, no ConnectionError
        assert "yield point skipped" in caplog.text
        assert task.checkpoint is None
    finally:
        slices._starts.pop("t-1", None)
        task.pop_request()
        app.close()


def test_a_foreign_header_never_fails_a_yield_point(caplog: pytest.LogCaptureFixture) -> None:
    from sits_queue.app import make_app
    from sits_queue.workers import slices

    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="slices_foreign")

    @app.task(bind=True, shared=False)
    def step(self: object) -> None: ...

    task = app.tasks[step.name]
    # a class this worker does not know runs as the default one; a checkpoint that is
    # not JSON is a first run
    task.push_request(id="t-2", sits_delivery=["celery", "m-2"], sits={"sla_class": "bogus"},
                      sits_checkpoint=b"{not json")
    slices._starts["t-2"] = -1e9
    try:
        with caplog.at_level("WARNING"):
            assert task.checkpoint is None
            task.yield_point({"done": 1})  # no ConfigError: it asks Redis (away here)
        assert "not JSON" in caplog.text and "yield point skipped" in caplog.text
    finally:
        slices._starts.pop("t-2", None)
        task.pop_request()
        app.close()


@pytest.mark.parametrize("bad", ["x", -1, -0.5, float("nan"), float("inf"), True, [1]])
def test_a_remaining_estimate_that_is_no_number_of_seconds_is_named(bad: object) -> None:
    """("x" failed the task with "'<' not supported between instances of 'str' and
    'float'"; -1 never yielded, NaN always did)"""
    from sits_queue.app import make_app

    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="slices_remaining")

    @app.task(bind=True, sla_class="low", shared=False)
    def step(self: object) -> None: ...

    task = app.tasks[step.name]
    try:
        with pytest.raises(ValueError, match=r"yield_point: remaining_s must be a finite "
                                             r"number of seconds >= 0 or None, got"):
            task.yield_point({"done": 1}, remaining_s=bad)
        task.yield_point({"done": 1}, remaining_s=0)  # (outside a worker: never yields)
        task.yield_point({"done": 1}, remaining_s=2.5)
    finally:
        app.close()


def test_a_batch_task_never_yields(caplog: pytest.LogCaptureFixture) -> None:
    """(one run serves many calls; run alone, as a batch of one, it asked the broker and
    could give up a slot no call's slice was)"""
    from typing import Any

    from sits_queue.app import make_app
    from sits_queue.workers import slices

    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="slices_batch")

    @app.batch_inference_task(name="u.batch", model="m", sla_class="low", shared=False)
    def batch(engine: Any, calls: list[Any]) -> list[Any]:
        return [None for _ in calls]

    task = app.tasks["u.batch"]
    task.push_request(id="t-3", sits_delivery=["celery", "m-3"], sits={"sla_class": "low"})
    slices._starts["t-3"] = -1e9  # long past its slice
    try:
        with caplog.at_level("WARNING"):
            task.yield_point({"done": 1})
        assert "yield point skipped" not in caplog.text  # the broker was not even asked
    finally:
        slices._starts.pop("t-3", None)
        task.pop_request()
        app.close()


def test_the_state_kept_at_a_yield_must_be_json_data() -> None:
    assert json.loads(state_json({"done": 3, "ids": [1, 2]})) == {"done": 3, "ids": [1, 2]}
    assert state_json(None) == "null"
    with pytest.raises(TypeError, match="yield_point state must be JSON data"):
        state_json({"tensor": object()})


def test_a_yield_crosses_to_the_parent_without_its_traceback_frames(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery's tracer builds two ExceptionInfos per Reject (its result, which goes back
    to the parent, and its log record); billiard copied every frame's code positions
    into each: ~1.1 ms a yield, 32 KB pickled. A yield's keep the exception and its text
    only; a failure's keep their frames."""
    from celery.app import trace as celery_trace
    from celery.app.trace import build_tracer

    from sits_queue.app import make_app

    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="slices_trace")

    @app.task(bind=True, sla_class="low", shared=False, ignore_result=True)
    def yields(self: object) -> None:
        raise Preempted("yielded its slot")

    @app.task(bind=True, sla_class="low", shared=False, ignore_result=True)
    def fails(self: object) -> None:
        raise ValueError("a real failure")

    built: list[object] = []  # the traceback of each ExceptionInfo the tracer builds

    class Counting(celery_trace.ExceptionInfo):  # type: ignore[misc, name-defined]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            built.append(self.tb)

    monkeypatch.setattr(celery_trace, "ExceptionInfo", Counting)
    request = {"id": "t-1", "args": [], "kwargs": {}, "delivery_info": {}, "hostname": "h"}
    try:
        outcomes, frames = {}, {}
        for task in (app.tasks[yields.name], app.tasks[fails.name]):
            # As the prefork child does: Celery stores the tracer on the task.
            task.__trace__ = build_tracer(task.name, task, app=app, eager=False)
            built.clear()
            outcomes[task.name] = task.__trace__("t-1", [], {}, request)[0]
            frames[task.name] = list(built)
        # Then the yield's ExceptionInfos keep its exception and text, not the frames...
        slim = outcomes[yields.name]
        assert isinstance(slim.exception.exc, Preempted) and slim.tb is None
        assert "Preempted" in slim.traceback and "yielded its slot" in slim.traceback
        assert len(pickle.dumps(vars(slim))) < 4096  # (what crosses; Counting is local)
        assert frames[yields.name] == [None, None]  # the result's and the log's
        # ...while a failure's are untouched (its traceback is reported in full)
        failed = outcomes[fails.name]
        assert failed.tb is not None and "a real failure" in failed.traceback
        assert frames[fails.name] and all(tb is not None for tb in frames[fails.name])
    finally:
        app.close()


def test_yield_points_with_redis_away_warn_once_and_ask_again_after_a_while(
        caplog: pytest.LogCaptureFixture) -> None:
    """(each yield point asked again: a warning each, ~50 lines a second from a task of
    20 ms steps, and against a Redis that hangs each blocked up to the socket timeout)"""
    import redis

    from sits_queue.workers import slices

    class Away:
        """A client whose every call fails as a Redis that is down does."""

        asked = 0

        def pubsub(self, **_: object) -> Away:
            return self

        def subscribe(self, *_: object) -> None:
            Away.asked += 1
            raise redis.ConnectionError("Error 111 connecting to localhost:6396")

    slicer = slices.Slicer(replace(SitsConfig(), slice_ms=20.0), client=Away())  # type: ignore[arg-type]
    running = Running("q", "m", "low", started=0.0)
    with caplog.at_level("DEBUG", logger=slices.logger.name):
        # When a task passes 100 yield points over 1 s with Redis down
        for step in range(100):
            assert not slicer.claim(running, 1.0 + step / 100, {"done": step})
        # Then Redis was asked once, and said so once, as a warning
        assert Away.asked == 1
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "yield point skipped" in warnings[0].getMessage()
        # and asked again once the pause is over (failing again: no new warning)
        assert not slicer.claim(running, 1.0 + slices.AWAY_S + 0.01, None)
        assert Away.asked == 2
        assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
