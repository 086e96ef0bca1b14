"""A retried task keeps its SITS options (``SitsTask.signature_from_request``, which
Celery's ``retry`` builds the new message from). No broker: the signature is inspected."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery.app.task import Context

from sits_queue.app import make_app
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidTaskOptions
from sits_queue.options import HEADER


@pytest.fixture
def task() -> Any:
    app = make_app(SitsConfig(), main="retry-unit")

    @app.task(name="u.work", shared=False)
    def work(x: int) -> int:
        return x

    return work


@contextmanager
def capturing_producer() -> Iterator[tuple[Any, list[dict[str, Any]]]]:
    """A producer that keeps what it is given to publish, and the list it keeps it in:
    no broker, what would be sent."""
    from kombu import Connection

    sent: list[dict[str, Any]] = []
    with Connection("memory://") as conn:
        producer = conn.Producer()
        producer.publish = lambda *a, **kw: sent.append(kw)
        yield producer, sent


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


def test_a_retry_with_new_arguments_works_out_what_came_from_the_old_ones(task: Any) -> None:
    """(the first send's input entropy and prompt prefix key, worked out from the old
    arguments, rode on a retry given others)"""
    from sits_queue.options import derived_from_args

    config = SitsConfig()
    old_args = ("ab" * 200,)  # low entropy
    derived = derived_from_args(config, old_args, {})
    header = {"sla_class": "high", "model": "m-x", **derived}
    running = Context(id="t-1", args=old_args, kwargs={}, retries=0, delivery_info={},
                      **{HEADER: header})
    same = task.signature_from_request(running)
    assert same.options["input_entropy"] == derived["input_entropy"]
    assert same.options["prefix_key"] == derived["prefix_key"]
    fresh = task.signature_from_request(running, args=("q9$Lx!7m" * 50,))
    assert "input_entropy" not in fresh.options and "prefix_key" not in fresh.options
    assert fresh.options["model"] == "m-x"  # the rest rides on
    # what the caller chose (not what the old arguments give) rides on all the same
    chosen = Context(id="t-1", args=old_args, kwargs={}, retries=0, delivery_info={},
                     **{HEADER: {**header, "input_entropy": 0.99, "prefix_key": "mine"}})
    kept = task.signature_from_request(chosen, args=("other",))
    assert (kept.options["input_entropy"], kept.options["prefix_key"]) == (0.99, "mine")


def timed_request(header: Any, timelimit: Any) -> Context:
    return Context(id="t-1", args=(1,), kwargs={}, retries=0, delivery_info={},
                   timelimit=timelimit, **{HEADER: header})


def test_a_retry_into_another_class_takes_that_classs_defaults(task: Any) -> None:
    """What the first send filled in from the old class (its SLA, loss preset, time
    limits) is not carried into the new class: the new class's own apply."""
    config = SitsConfig()
    high = config.quota("high")
    header = {"sla_class": "high", "model": "m-x", "latency_sla_ms": high.latency_sla_ms,
              "loss_sensitivity": high.loss_sensitivity}
    sig = task.signature_from_request(timed_request(header, config.time_limits("high")[::-1]),
                                      sla_class="low")
    assert sig.options["sla_class"] == "low" and sig.options["model"] == "m-x"
    assert "latency_sla_ms" not in sig.options and "loss_sensitivity" not in sig.options
    assert sig.options.get("soft_time_limit") is None and sig.options.get("time_limit") is None
    options: dict[str, Any] = dict(sig.options)
    from sits_queue.app import apply_class_limits
    apply_class_limits(task, config, "low", options)
    assert (options["soft_time_limit"], options["time_limit"]) == config.time_limits("low")


def test_a_retry_into_another_class_keeps_what_the_caller_chose(task: Any) -> None:
    """Values that are not the old class's defaults were the caller's: they ride on."""
    config = SitsConfig()
    header = {"sla_class": "high", "latency_sla_ms": 1234.0, "loss_sensitivity": 0.3}
    sig = task.signature_from_request(timed_request(header, (99.0, 70.0)), sla_class="low")
    assert sig.options["latency_sla_ms"] == 1234.0 and sig.options["loss_sensitivity"] == 0.3
    assert (sig.options["soft_time_limit"], sig.options["time_limit"]) == (70.0, 99.0)
    assert config.time_limits("high") != (70.0, 99.0)


def test_a_retry_in_the_same_class_keeps_its_limits(task: Any) -> None:
    config = SitsConfig()
    limits = config.time_limits("high")
    sig = task.signature_from_request(timed_request({"sla_class": "high"}, limits[::-1]),
                                      sla_class="high")
    assert (sig.options["soft_time_limit"], sig.options["time_limit"]) == limits


@pytest.mark.parametrize(("carried", "given", "want"), [
    # the class's own (high: 36 / 45) carried over, one limit given: worked out from it
    # as at submission (both carried, a soft one past the hard one was refused)
    ((36.0, 45.0), {"time_limit": 5}, (4.0, 5)),
    ((36.0, 45.0), {"soft_time_limit": 50}, (50, 62.5)),
    ((36.0, 45.0), {"time_limit": 100}, (80.0, 100)),
    # the caller's own carried over: kept where it still fits the new one...
    ((70.0, 99.0), {"time_limit": 80}, (70.0, 80)),
    ((20.0, 99.0), {"soft_time_limit": 30}, (30, 99.0)),
    # ...and worked out afresh where it would not
    ((70.0, 99.0), {"time_limit": 50}, (40.0, 50)),
    ((70.0, 99.0), {"soft_time_limit": 120}, (120, 150.0)),
    # both given: as given
    ((36.0, 45.0), {"time_limit": 5, "soft_time_limit": 2}, (2, 5)),
])
def test_a_retry_given_one_time_limit_gets_a_pair_that_holds(
        task: Any, carried: tuple[float, float], given: dict[str, float],
        want: tuple[float, float]) -> None:
    from sits_queue.app import apply_class_limits

    config = SitsConfig()
    sig = task.signature_from_request(timed_request({"sla_class": "high"}, carried[::-1]),
                                      **given)
    options: dict[str, Any] = dict(sig.options)
    apply_class_limits(task, config, "high", options)
    assert (options["soft_time_limit"], options["time_limit"]) == pytest.approx(want)


@pytest.mark.parametrize(("task_limits", "call", "want"), [
    # the class's: low = (8, 10)
    ({}, {}, (8.0, 10)),
    # a call's hard limit under the class's soft one brings the soft one down with it
    ({}, {"time_limit": 1}, (0.8, 1)),
    # above it, the soft one goes up with it: the class's would cut the task short
    ({}, {"time_limit": 100}, (80.0, 100)),
    ({}, {"time_limit": 1, "soft_time_limit": 0.5}, (0.5, 1)),  # both given: as given
    # a task's own hard limit likewise (Celery sends the task's time_limit itself)
    ({"time_limit": 2}, {}, (1.6, 2)),
    ({"time_limit": 2, "soft_time_limit": 1.9}, {}, (1.9, 2)),
    ({"time_limit": 2, "soft_time_limit": 1.9}, {"time_limit": 5}, (1.9, 5)),
    # a soft limit past the class's hard one (10) moves the hard one up: it fires first
    ({}, {"soft_time_limit": 12}, (12, 15)),
])
def test_a_hard_limit_of_the_call_or_task_brings_the_soft_one_with_it(
        task_limits: dict[str, float], call: dict[str, float],
        want: tuple[float | None, float | None]) -> None:
    from sits_queue.app import apply_class_limits

    app = make_app(SitsConfig(), main="limits-unit")

    @app.task(name="u.limited", shared=False, sla_class="low", **task_limits)
    def limited() -> None:
        return None

    options: dict[str, Any] = dict(call)
    apply_class_limits(limited, SitsConfig(), "low", options)
    assert (options.get("soft_time_limit"), options.get("time_limit")) == pytest.approx(want)


@pytest.mark.parametrize(("conf", "call", "want"), [
    # the app's task_time_limit / task_soft_time_limit rank above the class's (8, 10)
    ({"task_time_limit": 50}, {}, (40.0, 50)),
    ({"task_soft_time_limit": 3}, {}, (3.0, 10)),
    ({"task_time_limit": 50, "task_soft_time_limit": 45}, {}, (45.0, 50)),
    ({"task_soft_time_limit": 12}, {}, (12.0, 15)),
    # and below a call's
    ({"task_time_limit": 50, "task_soft_time_limit": 45}, {"time_limit": 5}, (4.0, 5)),
    ({"task_time_limit": 50}, {"soft_time_limit": 7}, (7.0, 50)),
    # a call's soft limit past the app's hard one: the call's wins, the hard one moves up
    ({"task_time_limit": 300}, {"soft_time_limit": 600}, (600.0, 750)),
])
def test_the_apps_time_limit_settings_rank_above_the_class(
        conf: dict[str, float], call: dict[str, float],
        want: tuple[float | None, float | None]) -> None:
    from sits_queue.app import apply_class_limits

    app = make_app(SitsConfig(), main="limits-conf")
    app.conf.update(conf)

    @app.task(name="u.plain", shared=False, sla_class="low")
    def plain() -> None:
        return None

    options: dict[str, Any] = dict(call)
    apply_class_limits(plain, SitsConfig(), "low", options, app.conf)
    assert (options.get("soft_time_limit"), options.get("time_limit")) == pytest.approx(want)


@pytest.mark.parametrize("call", [{"time_limit": "ten"}, {"soft_time_limit": -1},
                                  {"time_limit": float("nan")}, {"time_limit": True},
                                  # past a float's range: float() of it raised OverflowError
                                  {"time_limit": 10**400}, {"soft_time_limit": 10**400}])
def test_a_time_limit_that_is_not_a_positive_number_is_refused_by_name(
        call: dict[str, Any]) -> None:
    from sits_queue.app import apply_class_limits

    with pytest.raises(InvalidTaskOptions, match=next(iter(call))):
        apply_class_limits(None, SitsConfig(), "low", dict(call))


def test_celerys_priority_is_said_once_not_to_order_sits_queues(
        caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(SitsConfig(), main="priority-note")

    @app.task(name="u.ranked", shared=False)
    def ranked() -> None:
        return None

    with capturing_producer() as (producer, sent), \
            caplog.at_level("WARNING", logger="sits_queue.app"):
        ranked.apply_async(priority=0, producer=producer)  # a retry's: none said
        assert not caplog.records
        ranked.apply_async(priority=9, producer=producer)
        ranked.apply_async(priority=9, producer=producer)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "priority=9 does not order SITS queues" in said[0]
    assert len(sent) == 3


def test_sits_options_in_task_routes_reach_the_message_and_are_checked() -> None:
    """(a route's SITS options were dropped without a word, an unknown class included:
    they are resolved before Celery routes the message)"""
    app = make_app(SitsConfig(), main="routed-options")
    app.conf.task_routes = {"u.routed": {"queue": "celery", "sla_class": "high",
                                         "model": "m-route"},
                            "u.bad": {"sla_class": "nope"}}

    @app.task(name="u.routed", shared=False)
    def routed() -> None:
        return None

    @app.task(name="u.bad", shared=False)
    def bad() -> None:
        return None

    with capturing_producer() as (producer, sent):
        routed.apply_async(producer=producer)
        routed.apply_async(producer=producer, sla_class="low")  # the call's own wins
        app.send_task("u.routed", producer=producer)
        with pytest.raises(InvalidTaskOptions, match="unknown sla_class 'nope'"):
            bad.apply_async(producer=producer)
    got = [(kw["headers"][HEADER]["sla_class"], kw["headers"][HEADER]["model"]) for kw in sent]
    assert got == [("high", "m-route"), ("low", "m-route"), ("high", "m-route")]


def test_both_limits_from_one_source_the_soft_past_the_hard_are_refused() -> None:
    from sits_queue.app import apply_class_limits

    with pytest.raises(InvalidTaskOptions, match="soft_time_limit 12 s must not exceed "
                                                 "time_limit 10 s"):
        apply_class_limits(None, SitsConfig(), "low",
                           {"soft_time_limit": 12, "time_limit": 10})


def test_a_bad_app_setting_is_refused_naming_the_setting() -> None:
    from sits_queue.app import apply_class_limits

    app = make_app(SitsConfig(), main="limits-bad-conf")
    app.conf.task_time_limit = "300"

    @app.task(name="u.any", shared=False)
    def any_task() -> None:
        return None

    with pytest.raises(InvalidTaskOptions, match="task_time_limit must be a positive"):
        apply_class_limits(any_task, SitsConfig(), "low", {}, app.conf)


@pytest.fixture
def replacing() -> Any:
    """A task app whose replacement is captured instead of sent (``on_replace``)."""
    app = make_app(SitsConfig(), main="replace-unit")

    @app.task(name="u.plain", shared=False)
    def plain() -> None:
        return None

    @app.task(name="u.low", sla_class="low", shared=False)
    def low() -> None:
        return None

    @app.task(name="u.host", bind=True, shared=False)
    def host(self: Any) -> None:
        return None

    host.on_replace = lambda sig: sig
    return app


def replaced(app: Any, header: Any, sig: Any) -> Any:
    host = app.tasks["u.host"]
    host.push_request(id="t-1", args=(), kwargs={}, delivery_info={}, **{HEADER: header})
    try:
        return host.replace(sig)
    finally:
        host.pop_request()


def test_a_replacement_goes_on_in_the_running_tasks_class(replacing: Any) -> None:
    """(Celery carries no options into a replacement: an urgent task that replaced itself
    went on in the default class)"""
    from celery import chain, chord, group
    plain, low = replacing.tasks["u.plain"], replacing.tasks["u.low"]
    sig = replaced(replacing, {"sla_class": "high"}, plain.s())
    assert sig.options["sla_class"] == "high"
    canvas = chain(plain.s(), group(plain.s(), low.s(), plain.s().set(sla_class="medium")),
                   chord([plain.s()], plain.s()))
    sent = replaced(replacing, {"sla_class": "high"}, canvas)
    from sits_queue.calloptions import leaves
    classes = [leaf.options.get("sla_class") for leaf in leaves(sent)]
    # a task that declares its own class, or a signature that names one, keeps it
    assert classes == ["high", "high", None, "medium", "high", "high"]


@pytest.mark.parametrize("header", [None, "not a mapping", {"sla_class": None}])
def test_a_replacement_of_a_task_without_a_readable_class_gets_none(
        replacing: Any, header: Any) -> None:
    sig = replaced(replacing, header, replacing.tasks["u.plain"].s())
    assert "sla_class" not in sig.options


@pytest.mark.parametrize(("conf", "declared", "call", "want"), [
    # the task's soft limit past the app's hard one: settled by rank (the hard one rises)
    ({"task_time_limit": 1}, {"soft_time_limit": 2}, {}, [2.5, 2.0]),
    ({"task_time_limit": 1}, {"soft_time_limit": 2}, {"time_limit": 10}, [10.0, 2.0]),
    ({"task_time_limit": 1}, {"soft_time_limit": 2}, {"time_limit": 10, "soft_time_limit": 3},
     [10.0, 3.0]),
    # the task's hard limit under the app's soft one: the soft one comes to its fraction
    ({"task_soft_time_limit": 5}, {"time_limit": 4}, {}, [4.0, 3.2]),
])
def test_a_task_s_limit_against_the_app_s_is_sent_settled_by_rank(
        conf: dict[str, float], declared: dict[str, float], call: dict[str, float],
        want: list[float]) -> None:
    """(Celery binds the app's setting to the task and refused the pair in apply_async,
    "soft_time_limit must be less than or equal to time_limit", whatever the call gave:
    the task could not be sent at all)"""
    app = make_app(SitsConfig(), main="limits-bound")
    app.conf.update(conf)

    @app.task(name="u.bound", shared=False, **declared)
    def bound() -> None:
        return None

    with capturing_producer() as (producer, sent):
        bound.apply_async(producer=producer, **call)
    assert sent[0]["headers"]["timelimit"] == pytest.approx(want)


def test_a_task_declaring_its_soft_limit_past_its_hard_one_is_refused_by_name() -> None:
    app = make_app(SitsConfig(), main="limits-own")

    @app.task(name="u.own", shared=False, soft_time_limit=5, time_limit=4)
    def own() -> None:
        return None

    with pytest.raises(InvalidTaskOptions, match=r"u\.own's soft_time_limit 5 s must not "
                                                 r"exceed u\.own's time_limit 4 s"):
        own.delay()


def test_a_router_is_asked_once_per_send_and_its_one_answer_routes_and_classes() -> None:
    """(the SITS options were read from one lookup, Celery routed by a second: a round
    robin gave each task the class of one answer and the queue of the next, and all four
    went to one queue)"""
    app = make_app(SitsConfig(), main="routed-once")
    answers = itertools.cycle([{"queue": "rr-gpu", "sla_class": "high"},
                               {"queue": "rr-cpu", "sla_class": "low"}])
    asked: list[str] = []

    def round_robin(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                    **kw: Any) -> Any:
        if name != "u.rr":
            return None
        asked.append(name)
        return dict(next(answers))

    app.conf.task_routes = (round_robin,)

    @app.task(name="u.rr", shared=False)
    def rr(x: int) -> int:
        return x

    with capturing_producer() as (producer, sent):
        for i in range(4):
            rr.apply_async((i,), producer=producer)
        app.send_task("u.rr", (4,), producer=producer)
        app.send_task("u.rr", (5,), producer=producer)
    assert len(asked) == 6
    got = [(kw["routing_key"], kw["headers"][HEADER]["sla_class"]) for kw in sent]
    assert got == [("rr-gpu", "high"), ("rr-cpu", "low")] * 3
    # the route's SITS options are in the header, not loose in the message's properties
    assert all("sla_class" not in kw for kw in sent)


def test_routes_do_not_reach_the_beat_s_maintenance_tasks() -> None:
    """(a glob entry's class and its class's time limits were given to the beat's
    passes: ``sits.rescore`` ran as "low", limited to 10 s)"""
    app = make_app(SitsConfig(), main="routed-maintenance")
    app.conf.task_routes = {"*": {"queue": "gpu", "sla_class": "low",
                                  "routing_key": "elsewhere"}}
    rescore = app.tasks["sits.rescore"]
    with capturing_producer() as (producer, sent):
        app.send_task("sits.rescore", producer=producer)
        rescore.apply_async(producer=producer)
        app.send_task("sits.rescore", producer=producer,
                      headers={HEADER: {"sla_class": "high"}})
    assert [kw["routing_key"] for kw in sent] == ["sits.control"] * 3
    assert [kw["headers"][HEADER]["sla_class"] for kw in sent] == ["high"] * 3
    # (the passes' own limit: the top class's, or the least a pass over a deep backlog
    # needs; not the route's class's)
    from sits_queue.priority.tasks import MAINTENANCE_MIN_LIMIT_S

    own = max(SitsConfig().quota("high").max_run_s, MAINTENANCE_MIN_LIMIT_S)
    assert all(kw["headers"]["timelimit"][0] == own for kw in sent)


def test_maintenance_passes_get_time_to_go_over_a_deep_backlog() -> None:
    """(they ran in the top class under its limits: a latency-critical top class of
    max_run_s = 1 killed every rescoring pass over 200k tasks, and the queue's tail was
    never aged)"""
    from dataclasses import replace

    from sits_queue.options import MAINTENANCE_TASKS
    from sits_queue.priority.tasks import MAINTENANCE_MIN_LIMIT_S

    base = SitsConfig()
    quick = replace(base, classes=tuple(replace(c, max_run_s=1.0) if c.name == base.top_class
                                        else c for c in base.classes))
    app = make_app(quick, main="maintenance-limits")
    app.conf.task_time_limit = 2  # (an app's limit for its own tasks: not the passes')
    with capturing_producer() as (producer, sent):
        for name in MAINTENANCE_TASKS:
            app.tasks[name].apply_async(producer=producer)
    limits = [m["headers"]["timelimit"] for m in sent]
    assert limits == [[MAINTENANCE_MIN_LIMIT_S, MAINTENANCE_MIN_LIMIT_S
                       * quick.soft_limit_fraction]] * len(MAINTENANCE_TASKS), limits
    # A top class of a longer limit keeps it
    app = make_app(replace(base, classes=tuple(replace(c, max_run_s=900.0)
                                               if c.name == base.top_class else c
                                               for c in base.classes)), main="long-top")
    with capturing_producer() as (producer, sent):
        app.tasks["sits.rescore"].apply_async(producer=producer)
    assert sent[0]["headers"]["timelimit"][0] == 900.0
