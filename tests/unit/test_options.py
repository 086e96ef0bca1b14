"""Submission options (``options.py``): numbers at the edges of what a float holds. No Redis."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from kombu.entity import Queue

from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidTaskOptions
from sits_queue.options import resolve


@pytest.mark.parametrize("option", ["context_tokens", "vram_gib", "latency_sla_ms",
                                    "loss_sensitivity", "input_entropy", "batch_max"])
@pytest.mark.parametrize("value", [10**400, -10**400, 10**5000], ids=["1e400", "-1e400", "1e5000"])
def test_a_huge_integer_option_is_an_invalid_option_naming_it(option: str, value: int) -> None:
    with pytest.raises(InvalidTaskOptions) as info:
        resolve(SitsConfig(), {}, {option: value})
    assert option in str(info.value) and "bits" in str(info.value)


def test_a_model_name_with_an_at_sign_is_refused_on_the_task_and_in_the_registry() -> None:
    """``model@precision`` is an engine's cache key: a model named "lm@fp16" was served
    lm's fp16 engine from a warm child's cache (and was unknown in a fresh one)."""
    from sits_queue.registry import ModelRegistry

    with pytest.raises(InvalidTaskOptions, match="model must not contain '@'"):
        resolve(SitsConfig(), {}, {"model": "lm@fp16"})
    with pytest.raises(ValueError, match="or '@'"):
        ModelRegistry().register("lm@fp16", lambda: None)
    assert resolve(SitsConfig(), {}, {"model": "org/lm-1.5+q:v2"}).model == "org/lm-1.5+q:v2"


@pytest.mark.parametrize(("options", "named"), [
    ({"model": "m" * 10_000}, r"model must be .* got 'm{40}'\.\.\. \(10000 characters\)$"),
    ({"sla_class": "x" * 10_000}, r"unknown sla_class 'x{40}'\.\.\. \(10000 characters\);"),
    ({"prefix_key": "k" * 100_000}, r"prefix_key .* \(100000 characters\)$"),
    ({"precision": ["fp16"] * 1000}, r"precision must be .* \(8000 characters of repr\)$"),
])
def test_a_huge_bad_value_is_named_by_its_start_and_length_not_echoed_whole(
        options: dict[str, object], named: str) -> None:
    # (a worker logs each refused foreign message: a line, not a dump of its header)
    with pytest.raises(InvalidTaskOptions, match=named) as refused:
        resolve(SitsConfig.from_mapping({}), {}, options)
    assert len(str(refused.value)) < 300


@pytest.mark.parametrize(("field", "value", "named"), [
    ("ls", float("inf"), "loss_sensitivity must be in"), ("n", -999, "context_tokens"),
    ("n", 2.5, "context_tokens must be a whole number"), ("e", 5.0, "input_entropy"),
    ("sla", "fast", "latency_sla_ms must be a number"), ("sla", 0.0, "latency_sla_ms"),
    ("t", float("nan"), "enqueued at nan"),
])
def test_a_stored_scheduling_record_out_of_the_options_range_is_refused_naming_it(
        field: str, value: object, named: str) -> None:
    """(the rescoring pass took ``ls`` of inf as a priority past every other task's)"""
    import json

    from sits_queue.broker.meta import WaitingMeta, score_inputs
    from sits_queue.options import resolve as resolved

    ours = WaitingMeta(resolved(SitsConfig(), {}, {"sla_class": "low", "model": "m"}),
                       1_800_000_000.0, "t.x").to_json()
    assert score_inputs(ours) == ("low", 1_800_000_000.0, 0, 5000.0, 0.2, 0.0, "m")
    with pytest.raises(ValueError, match=named):
        score_inputs(json.dumps({**json.loads(ours), field: value}))


@pytest.mark.parametrize("eta, due", [
    ("2026-12-05T03:30:00+00:00", 1796441400.0),
    ("2026-12-05T04:30:00.500000+01:00", 1796441400.5),
    # no time zone: UTC, as Celery's worker reads it by default (it was dropped, and the
    # task aged from its put while not due)
    ("2026-12-05T03:30:00", 1796441400.0),
    # read as Celery reads them (datetime.fromisoformat dropped these, and the task aged
    # from its put while Celery held it to its time)
    ("2026-12-04T24:00:00+00:00", 1796428800.0), ("2026-339", 1796428800.0),
    ("2026-12", 1796083200.0), ("2026", 1767225600.0),
    (None, None), ("soon", None), (1796441400, None), ("2026-13-01T00:00:00+00:00", None),
])
def test_a_waiting_record_keeps_when_its_eta_falls_due(eta: object, due: float | None) -> None:
    """(a running task yielded for a task whose countdown was not due: the freed slot only
    put it in the worker's timer)"""
    from sits_queue.broker.meta import WaitingMeta

    config = SitsConfig()
    message = {"headers": {"task": "t.x", "eta": eta, "sits": None}, "properties": {}}
    meta = WaitingMeta.of_message(config, message, 1_800_000_000.0)
    assert meta.due_s == due
    assert WaitingMeta.from_json(meta.to_json()).due_s == due
    assert (b'"eta"' in meta.to_json()) == (due is not None)


def test_a_newer_releases_options_are_dropped_at_the_put_and_the_rest_kept(
        caplog: pytest.LogCaptureFixture) -> None:
    """(a header with an option this release does not know was scheduled with the
    default options: a fleet upgraded one host at a time requeued a newer producer's
    high task as medium)"""
    from sits_queue.broker.meta import WaitingMeta

    config = SitsConfig()
    header = {**resolve(config, {}, {"sla_class": "high", "model": "lm"}).to_header(),
              "tomorrows_option": 3}
    message = {"headers": {"task": "t.x", "sits": header},
               "properties": {"delivery_tag": "tag-1"}}
    with caplog.at_level("WARNING", logger="sits_queue.broker.meta"):
        meta = WaitingMeta.of_message(config, message, 1_800_000_000.0)
    assert (meta.options.sla_class, meta.options.model) == ("high", "lm")
    assert "tag-1" in caplog.text and "['tomorrows_option']" in caplog.text
    # a value this release does not know (a newer precision) loses that option alone,
    # said; a class this config lacks loses the class alone
    message["headers"]["sits"] = {**header, "precision": "fp8"}
    caplog.clear()
    with caplog.at_level("WARNING", logger="sits_queue.broker.meta"):
        meta = WaitingMeta.of_message(config, message, 1.0)
    assert (meta.options.sla_class, meta.options.model, meta.options.precision) == (
        "high", "lm", None)
    assert "without ['precision']" in caplog.text
    message["headers"]["sits"] = {**header, "sla_class": "platinum"}
    meta = WaitingMeta.of_message(config, message, 1.0)
    assert (meta.options.sla_class, meta.options.model) == ("medium", "lm")
    # a header that is no object gets the defaults
    message["headers"]["sits"] = ["high"]
    assert WaitingMeta.of_message(config, message, 1.0).options.sla_class == "medium"


@pytest.mark.parametrize("args, kwargs, said", [
    ((1,), [2], "u.add: task keyword arguments must be a mapping, got list"),
    (5, None, "u.add: task args must be a list or tuple, got int"),
    ("ab", None, "u.add: task args must be a list or tuple, got str"),
])
def test_arguments_of_the_wrong_shape_are_refused_naming_them(
        args: object, kwargs: object, said: str) -> None:
    """(the options read the arguments first, for their entropy, and failed with
    "'list' object has no attribute 'values'"); nothing is sent: no broker is needed"""
    from sits_queue.app import make_app

    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="shape-unit")

    @app.task(name="u.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    with pytest.raises(TypeError, match=said):
        add.apply_async(args, kwargs)
    with pytest.raises(TypeError, match=said):
        app.send_task("u.add", args, kwargs)
    # a task this app does not register, sent by name, is named too
    with pytest.raises(TypeError, match=said.replace("u.add", "elsewhere.add")):
        app.send_task("elsewhere.add", args, kwargs)


def test_a_countdown_tasks_wait_counts_from_when_it_falls_due() -> None:
    """(it aged from its put: due, it outranked fresh urgent tasks at once)"""
    import json

    from sits_queue.broker.meta import WaitingMeta, score_inputs
    from sits_queue.options import resolve as resolved

    options = resolved(SitsConfig(), {}, {"sla_class": "low"})
    later = WaitingMeta(options, 1_800_000_000.0, "t.x", due_s=1_800_000_060.0)
    assert later.waiting_since_s == 1_800_000_060.0
    assert score_inputs(later.to_json())[1] == 1_800_000_060.0
    # one due already at its put (or with no ETA) waits from its put
    for due in (1_799_999_000.0, None):
        meta = WaitingMeta(options, 1_800_000_000.0, "t.x", due_s=due)
        assert meta.waiting_since_s == 1_800_000_000.0
        assert score_inputs(meta.to_json())[1] == 1_800_000_000.0
    # a foreign record's ETA that is no number is not one
    record = {**json.loads(later.to_json()), "eta": "soon"}
    assert score_inputs(json.dumps(record))[1] == 1_800_000_000.0


@pytest.mark.parametrize("given", [
    {}, {"sla_class": "high", "model": "lm", "context_tokens": 4096},
    {"model": "lm", "precision": "fp16", "vram_gib": 2.5, "prefix_key": "p"},
    {"sla_class": "low", "batch": "t|lm|low", "batch_max": 8, "input_entropy": 0.25},
])
def test_a_header_read_back_is_the_options_it_was_made_from(given: dict[str, object]) -> None:
    """The header the submission path made is not validated again when read back: the
    options it was made from must be what validating it gives."""
    from sits_queue.options import from_header, header_for

    config = SitsConfig()
    options = resolve(config, {}, given, ("some prompt text to measure",), {})
    header = header_for(config, options)
    assert from_header(config, header) is options
    assert from_header(SitsConfig(), dict(header)) == options  # validated in full


def test_a_header_changed_after_it_was_made_is_validated_again() -> None:
    """(a ``before_task_publish`` handler may change it on the way)"""
    from sits_queue.options import from_header, header_for

    config = SitsConfig()
    header = header_for(config, resolve(config, {}, {"sla_class": "high"}))
    header["sla_class"] = "urgent"
    with pytest.raises(InvalidTaskOptions, match="unknown sla_class 'urgent'"):
        from_header(config, header)
    header["sla_class"] = "low"
    assert from_header(config, header).sla_class == "low"


def test_a_header_read_under_another_class_table_is_validated_again() -> None:
    from sits_queue.options import from_header, header_for

    made_under = SitsConfig()
    header = header_for(made_under, resolve(made_under, {}, {"sla_class": "high"}))
    read_under = SitsConfig.from_mapping({"classes": [{"name": "medium"}, {"name": "low"}]})
    with pytest.raises(InvalidTaskOptions, match="unknown sla_class 'high'"):
        from_header(read_under, header)


def test_a_header_value_changed_to_an_equal_one_of_another_type_is_validated_again() -> None:
    """(``True == 1``: a header whose context_tokens became True read as unchanged, and
    was scheduled with options that validation refuses)"""
    from sits_queue.options import from_header, header_for

    config = SitsConfig()
    header = header_for(config, resolve(config, {}, {"context_tokens": 1}))
    header["context_tokens"] = True
    with pytest.raises(InvalidTaskOptions, match="context_tokens must be a number"):
        from_header(config, header)


def test_a_batch_key_past_its_length_is_refused_at_submission() -> None:
    """(made after the options were validated, it was sent, and every reader of the
    header refused it: the task ran with default options)"""
    from sits_queue.app import make_app

    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="batch-key-unit")

    @app.batch_inference_task(model="m", max_batch=4, name="s." + "x" * 990, shared=False)
    def long_named(engine: object, calls: list[object]) -> list[object]:
        return calls

    with pytest.raises(InvalidTaskOptions, match=r"batch key of 's\.x+'\.\.\. \(992 "
                                                 r"characters\) .* is 1001 characters, over "
                                                 r"the 1000"):
        long_named.delay("hello")


@pytest.mark.parametrize(("options", "said"), [
    ({"task_id": 5}, "task_id must be a non-empty string, got 5"),
    ({"task_id": ""}, "task_id must be a non-empty string"),
    # (sent, to be dead-lettered at the worker: no result key can hold it)
    ({"task_id": "\udcff-x"}, r"task_id must be UTF-8 text, got '\\udcff-x'"),
    ({"countdown": "10"}, "countdown must be a number of seconds, got '10'"),
    ({"countdown": float("nan")}, "countdown must be a finite number of seconds, got nan"),
    ({"countdown": 10**400}, "countdown must be a finite number of seconds"),
    ({"countdown": 1e15}, "countdown 1000000000000000.0 s reaches past the years"),
    ({"expires": 1e15}, "expires 1000000000000000.0 s reaches past the years"),
    ({"expires": True}, "expires must be a number of seconds"),
    ({"expires": "soon"}, "expires must be a datetime or its ISO 8601 text, got 'soon'"),
    ({"eta": "tomorrow"}, "eta must be a datetime or its ISO 8601 text, got 'tomorrow'"),
    ({"eta": 12}, "eta must be a datetime or its ISO 8601 text, got 12"),
    # past the years a date holds where the worker times them (it dead-lettered them with
    # an OverflowError; a datetime was not looked at)
    ({"eta": "9999-12-31T23:59:59-05:00"},
     "eta '9999-12-31T23:59:59-05:00' falls past the years a date holds"),
    ({"eta": datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-5)))},
     "eta '9999-12-31T23:59:59-05:00' falls past the years"),
    ({"eta": "9999-12-31T24:00:00"}, "eta '9999-12-31T24:00:00' falls past the years"),
    ({"eta": "0001-01-01T00:00:00+05:00"}, "eta '0001-01-01T00:00:00\\+05:00' falls past"),
    ({"countdown": -1e11}, "countdown -100000000000.0 s reaches past the years"),
    ({"queue": 5}, "queue must be a queue's name or a kombu Queue, got 5"),
    # (Celery lays them over its own: the message ran under that id, get() waited for good)
    ({"headers": {"id": 5}}, r"headers cannot set Celery's task id \('id': 5\); give "
                             r"task_id= instead"),
    ({"headers": {"id": "x"}, "task_id": "y"}, "headers cannot set Celery's task id"),
])
def test_celerys_delivery_options_are_checked_before_anything_is_sent(
        options: dict[str, object], said: str) -> None:
    """(they failed deep in Celery with errors naming none of them, or were sent to be
    dead-lettered at the worker); no broker is reached: nothing is sent"""
    from sits_queue.app import make_app

    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="delivery-unit")

    @app.task(name="u.echo", shared=False)
    def echo(x: int) -> int:
        return x

    with pytest.raises(InvalidTaskOptions, match=f"task u.echo: {said}"):
        echo.apply_async((1,), **options)
    with pytest.raises(InvalidTaskOptions, match=said):
        app.send_task("u.echo", (1,), **options)


@pytest.mark.parametrize("options", [
    {"task_id": "mine-1"}, {"task_id": "mine-2", "headers": {"id": "mine-2", "x": 1}},
    {"countdown": 10}, {"countdown": -3.5}, {"countdown": 0},
    {"eta": datetime(2030, 1, 1, tzinfo=timezone.utc)}, {"eta": "2030-01-01T00:00:00+00:00"},
    # what Celery can hold, to its last hours (in a system and app zone within 12 h of UTC)
    {"eta": "2026-344"}, {"eta": "2026-12"}, {"eta": "2026"},
    {"eta": "2026-12-31T24:00:00+00:00"}, {"eta": "9999-12-31T12:00:00+00:00"},
    {"eta": datetime(9999, 12, 31, 12)}, {"eta": datetime(1, 1, 1, 12, tzinfo=timezone.utc)},
    {"eta": datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=11)))},
    {"expires": 60}, {"expires": datetime(2030, 1, 1)}, {"expires": "2030-01-01T00:00:00"},
    {"queue": "elsewhere"}, {"queue": Queue("elsewhere")},
])
def test_celerys_delivery_options_as_celery_takes_them_pass(options: dict[str, object]) -> None:
    from sits_queue.delivery import check_delivery

    check_delivery("u.echo", options)
