"""Same-model batching: batch keys on the message, the batch's bookkeeping in the main
process, and how a batch run's outputs become each task's outcome."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from sits_queue.app import make_app
from sits_queue.broker.keys import BATCH_INFO, batch_mark
from sits_queue.broker.meta import WaitingMeta
from sits_queue.broker.qos import held_units
from sits_queue.calloptions import call_options, resolve_task_options
from sits_queue.config import ConfigError, SitsConfig
from sits_queue.errors import InferenceError, InvalidInput, InvalidTaskOptions
from sits_queue.options import HEADER, batch_key, from_header
from sits_queue.workers import batched, batchmain
from sits_queue.workers.batched import Call, split_outputs

CONFIG = SitsConfig()


@pytest.fixture
def app() -> Any:
    app = make_app(CONFIG, main="batched-unit")

    @app.batch_inference_task(name="u.score", model="enc", max_batch=16, shared=False)
    def score(engine: Any, calls: list[Call]) -> list[Any]:
        return [len(c.args[0]) for c in calls]

    @app.inference_task(name="u.plain", model="enc", shared=False)
    def plain(engine: Any, text: str) -> int:
        return len(text)

    return app


def test_a_batch_task_marks_its_messages_with_task_model_and_class(app: Any) -> None:
    opts = resolve_task_options(app.tasks["u.score"], CONFIG, {"sla_class": "high"}, ("x",))
    assert opts.batch == "u.score|enc|high" and opts.batch_max == 16
    other = resolve_task_options(app.tasks["u.score"], CONFIG, {"model": "enc2"}, ("x",))
    assert other.batch == "u.score|enc2|medium"
    # A plain task carries no batch key; the built-in embed does (batch_max_tasks)
    assert resolve_task_options(app.tasks["u.plain"], CONFIG, {}, ("x",)).batch is None
    embed = resolve_task_options(app.tasks["sits.embed"], CONFIG, {"model": "enc"}, ("x",))
    assert embed.batch_max == CONFIG.batch_max_tasks


@pytest.mark.parametrize("decorator", ["task", "inference_task"])
def test_max_batch_on_a_task_that_is_not_a_batch_task_is_refused(decorator: str) -> None:
    app = make_app(CONFIG, main="batched-unit-plain")
    options = {"model": "enc"} if decorator == "inference_task" else {}

    @getattr(app, decorator)(name="u.not_batch", max_batch=8, shared=False, **options)
    def not_batch(*args: Any) -> int:
        return 1

    # (its calls carried a batch key: picks gathered them as kin, ahead of their turn,
    # for a run that takes them one at a time)
    with pytest.raises(InvalidTaskOptions, match=r"max_batch applies to batch tasks "
                                                 r"\(app.batch_inference_task\); "
                                                 r"'u.not_batch' declares max_batch=8"):
        call_options(app.tasks["u.not_batch"], CONFIG, {}, app.conf, ("x",))


def test_a_batch_key_names_the_time_limits_the_message_carries(app: Any) -> None:
    task = app.tasks["u.score"]
    plain: dict[str, Any] = {}
    opts = call_options(task, CONFIG, plain, app.conf, ("x",))
    soft, hard = CONFIG.time_limits("medium")
    assert (plain["soft_time_limit"], plain["time_limit"]) == (soft, hard)
    assert opts.batch == f"u.score|enc|medium|t={float(hard)!r}/{float(soft)!r}"
    # A call that sets its own limits batches only with calls that set the same
    own: dict[str, Any] = {"soft_time_limit": 1, "time_limit": 20}
    mine = call_options(task, CONFIG, own, app.conf, ("x",))
    assert mine.batch == "u.score|enc|medium|t=20.0/1.0" != opts.batch
    assert call_options(task, CONFIG, {"soft_time_limit": 1.0, "time_limit": 20.0},
                        app.conf, ("y",)).batch == mine.batch


def _message(opts: Any, timelimit: Any) -> dict[str, Any]:
    return {"headers": {"task": "u.score", "timelimit": timelimit,
                        HEADER: opts.to_header()}, "properties": {"delivery_tag": "d"}}


def test_the_broker_keeps_a_batch_key_only_with_the_limits_it_names(app: Any) -> None:
    options: dict[str, Any] = {"soft_time_limit": 1, "time_limit": 20}
    opts = call_options(app.tasks["u.score"], CONFIG, options, app.conf, ("x",))
    kept = WaitingMeta.of_message(CONFIG, _message(opts, [20, 1]), 1.0).options
    assert kept.batch == opts.batch and kept.batch_max == 16
    # Limits changed on the way (or a key made by hand): scheduled alone
    for changed in ([20, 2], [None, None], None, [20], ["20", 1], [20, -1], "abc"):
        alone = WaitingMeta.of_message(CONFIG, _message(opts, changed), 1.0).options
        assert (alone.batch, alone.batch_max) == (None, None), changed
    # A foreign producer's batch key with no limits at all is this task's
    bare = replace(opts, batch=batch_key("u.score", opts))
    assert WaitingMeta.of_message(CONFIG, _message(bare, [None, None]), 1.0).options == bare


@pytest.mark.parametrize("bad", [[1], [1, 2, 3], [True, 1], [float("nan"), 1], [0, 1],
                                 {"hard": 1}, "1/2", [10**400, 1]])
def test_a_timelimit_that_is_no_pair_of_limits_is_refused_by_name(app: Any, bad: Any) -> None:
    opts = resolve_task_options(app.tasks["u.score"], CONFIG, {}, ("x",))
    with pytest.raises(ValueError, match=r"timelimit must be \[time_limit, soft_time_limit\]"):
        batch_key("u.score", opts, bad)


def test_batch_options_survive_the_header_and_the_broker_record(app: Any) -> None:
    opts = resolve_task_options(app.tasks["u.score"], CONFIG, {}, ("x",))
    assert from_header(CONFIG, opts.to_header()) == opts
    assert WaitingMeta.from_json(WaitingMeta(opts, 1.0, "u.score").to_json()).options == opts


@pytest.mark.parametrize(("task_id", "kept"), [
    ("1f0c-task", "1f0c-task"), ("", None), (7, None), ("x" * 201, None), (None, None)])
def test_the_broker_record_keeps_a_task_id_that_is_a_short_string(
        task_id: Any, kept: str | None) -> None:
    """(``sitsq status`` shows it; a foreign producer's odd id is none, never a failure)"""
    message = {"headers": {"task": "u.score", "id": task_id}, "properties": {}}
    meta = WaitingMeta.of_message(CONFIG, message, 1.0)
    assert meta.task_id == kept
    assert WaitingMeta.from_json(meta.to_json()).task_id == kept


@pytest.mark.parametrize(("header", "message"), [
    ({"batch": ""}, "batch must be a non-empty string"),
    ({"batch": 7}, "batch must be a non-empty string"),
    ({"batch_max": 0}, r"batch_max must be in \[1, 1024\]"),
    ({"batch_max": 2.5}, "batch_max must be a whole number"),
    ({"batch_max": "8"}, "batch_max must be a number"),
])
def test_a_bad_batch_header_is_refused_by_name(header: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidTaskOptions, match=message):
        from_header(CONFIG, header)


@pytest.mark.parametrize(("settings", "message"), [
    ({"batch_max_tasks": 0}, r"batch_max_tasks must be an integer in \[1, 1024\]"),
    ({"batch_max_tasks": 5000}, r"batch_max_tasks must be an integer in \[1, 1024\]"),
    ({"batch_window": -1}, "batch_window must be an integer"),
])
def test_bad_batch_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replace(CONFIG, **settings)


def test_batch_mark_reads_only_a_well_formed_mark() -> None:
    assert batch_mark({BATCH_INFO: ["g", 1, 3]}) == ("g", 1, 3)
    for bad in (None, {}, {BATCH_INFO: ["g", 3, 3]}, {BATCH_INFO: ["g", True, 3]},
                {BATCH_INFO: [1, 0, 3]}, {BATCH_INFO: "g"}):
        assert batch_mark(bad) is None


def test_outputs_become_each_calls_result_or_its_own_failure() -> None:
    calls = [Call("a", ("x",)), Call("b", ("y",)), Call("c", ("z",))]
    bad = InvalidInput("item 'y' is bad")
    got = split_outputs([1, bad, 3], calls, {"cold": False})
    assert got["a"] == {"output": 1, "sits": {"cold": False, "batch": {"size": 3, "index": 0}}}
    assert got["b"] is bad
    assert got["c"]["sits"]["batch"]["index"] == 2


@pytest.mark.parametrize("outputs", [[1, 2], None, {"a": 1}])
def test_an_output_list_of_the_wrong_shape_fails_every_call(outputs: Any) -> None:
    calls = [Call("a"), Call("b"), Call("c")]
    got = split_outputs(outputs, calls, {})
    assert all(isinstance(v, InferenceError) and "one output per call" in str(v)
               for v in got.values())


# -- the main process: gathering a delivered batch --------------------------------------------

@dataclass
class FakeRequest:
    id: str
    request_dict: dict[str, Any] = field(default_factory=dict)
    batchable: bool = True  # a batch task's (BatchRequest)


def test_a_delivered_batch_runs_once_carrying_its_members() -> None:
    ran: list[FakeRequest] = []
    members = [FakeRequest(f"t{i}", {BATCH_INFO: ["t0", i, 3]}) for i in range(3)]
    # Given the transport opens batch t0 and delivers two of its three (one expired)
    batchmain.delivery("t0", False, ran.append)
    for request in (members[0], members[2]):
        assert batchmain.gather(request, ran.append) is None
    assert ran == []  # held until the end mark
    # When it closes the batch, the first goes on, carrying the other
    batchmain.delivery("t0", True, ran.append)
    assert ran == [members[0]]
    assert batchmain._ready.pop("t0") == [members[0], members[2]]


def test_a_request_of_no_batch_task_in_a_delivered_batch_runs_alone() -> None:
    """A batch key made by hand on a plain task: its requests are not held (the first
    ran, carrying the others that never ran, nor were acked)."""
    ran: list[FakeRequest] = []
    members = [FakeRequest(f"u{i}", {BATCH_INFO: ["u0", i, 3]}, batchable=i != 1)
               for i in range(3)]
    batchmain.delivery("u0", False, ran.append)
    for request in members:
        assert batchmain.gather(request, ran.append) is None
    batchmain.delivery("u0", True, ran.append)
    assert ran == [members[1], members[0]]  # the plain one alone; the others as a batch
    assert batchmain._ready.pop("u0") == [members[0], members[2]]
    plain = [FakeRequest(f"v{i}", {BATCH_INFO: ["v0", i, 2]}, batchable=False)
             for i in range(2)]
    batchmain.delivery("v0", False, ran.append)
    for request in plain:
        batchmain.gather(request, ran.append)
    batchmain.delivery("v0", True, ran.append)
    assert ran[2:] == plain and "v0" not in batchmain._ready


def test_requests_outside_an_open_batch_run_at_once() -> None:
    ran: list[FakeRequest] = []
    plain = FakeRequest("p")
    late = FakeRequest("late", {BATCH_INFO: ["gone", 1, 2]})  # its batch was closed
    batchmain.gather(plain, ran.append)
    batchmain.gather(late, ran.append)
    assert ran == [plain, late]
    batchmain.delivery("empty", False, ran.append)
    batchmain.delivery("empty", True, ran.append)  # nothing came: nothing runs
    assert ran == [plain, late]


@dataclass
class FakeMessage:
    delivery_info: dict[str, Any]


def test_prefetch_counts_a_batch_as_one_job() -> None:
    delivered = {"a": FakeMessage({BATCH_INFO: ["a", 0, 3]}),
                 "b": FakeMessage({BATCH_INFO: ["a", 1, 3]}),
                 "c": FakeMessage({BATCH_INFO: ["a", 2, 3]}),
                 "d": FakeMessage({})}
    assert held_units(delivered) == 2
    assert held_units(delivered, {"d"}) == 1
    assert held_units(delivered, {"a", "b", "c"}) == 1


class Counted:
    """The child runtime's counters, as ``batched._run`` reaches them."""

    def __init__(self) -> None:
        self.fields: dict[str, float] = {}

    def count(self, fields: dict[str, float]) -> None:
        for key, value in fields.items():
            self.fields[key] = self.fields.get(key, 0.0) + value

    def publish(self) -> None:
        pass


class Feed:
    def __init__(self, declined: set[int]) -> None:
        self.declined, self.joined = declined, 0

    def close(self) -> None:
        pass


class Task:
    app = None

    def push_request(self, **_: Any) -> None:
        pass

    def pop_request(self) -> None:
        pass


def run_counted(monkeypatch: pytest.MonkeyPatch, run: Any, declined: set[int] = frozenset()
                ) -> dict[str, float]:
    counted = Counted()
    monkeypatch.setattr(batched.runtime, "child", lambda: counted)
    monkeypatch.setattr(batched.runtime, "for_app", lambda app: None)
    monkeypatch.setattr(batched.inference, "run_inference", run)
    batched._run(Task(), [Call("own-0", ("a",)), Call("own-1", ("",))], {},
                 early=lambda i, out, meta: True, feed=Feed(set(declined)))
    return counted.fields


def test_each_failed_call_is_counted_once_and_no_joined_success_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def succeeds(rt: Any, task: Any, args: Any, kwargs: Any, tasks: int = 1,
                 early: Any = None, joins: Any = None) -> dict[str, Any]:
        (calls,) = args
        early(1, InvalidInput("prompt must not be empty"), {})  # an own call fails early
        calls += [Call("joined-2", ("b",)), Call("joined-3", ("c",)),
                  Call("joined-4", ("d",))]
        early(2, {"text": "ok"}, {})  # a joined call done: no failure
        early(3, InvalidInput("bad seed"), {})  # a joined call failed on its input
        return {"output": [{"text": "x"}, InvalidInput("prompt must not be empty")],
                "sits": {}}

    # joined-4 was declined (it runs after the batch): not this run's to count
    assert run_counted(monkeypatch, succeeds, declined={4}) == {
        "failed": 2.0, "failed:InvalidInput": 2.0}


def test_a_batch_failing_after_an_early_failure_counts_that_one_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(rt: Any, task: Any, args: Any, kwargs: Any, tasks: int = 1,
              early: Any = None, joins: Any = None) -> dict[str, Any]:
        early(1, InvalidInput("prompt must not be empty"), {})
        # run_inference counts its own failure for the calls not delivered
        raise RuntimeError("the rest failed")

    assert run_counted(monkeypatch, fails) == {"failed": 1.0, "failed:InvalidInput": 1.0}


@dataclass
class PoolRequest:
    """What ``submit`` uses of a Celery request, with the failures it is given."""

    id: str
    time_limits: tuple[Any, Any] = (None, None)
    failures: list[Any] = field(default_factory=list)
    successes: list[Any] = field(default_factory=list)

    class task:  # (as Celery's ``request.task``)
        time_limit = soft_time_limit = None

    name = type = "sits.embed_batched"
    request_dict: dict[str, Any] = field(default_factory=dict)
    body, content_type, content_encoding = b"[[], {}, {}]", "application/json", "utf-8"

    def on_accepted(self, pid: Any, at: float) -> None:
        pass

    def on_failure(self, exc_info: Any, **_: Any) -> None:
        self.failures.append(exc_info)

    def on_success(self, outcome: Any, **_: Any) -> None:
        self.successes.append(outcome)

    def _success_was_stored(self) -> bool:
        return False


def test_a_batch_that_raised_a_base_exception_in_the_solo_pool_fails_each_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery's solo pool hands a BaseException out of the run to the *success* callback,
    as an ExceptionInfo (its ``apply_target``): every call fails, none is left waiting."""
    from celery.concurrency.solo import TaskPool
    from celery.exceptions import WorkerLostError

    from sits_queue.workers.request import failure_of

    def exits(jobs: Any, **_: Any) -> Any:
        raise SystemExit(3)  # a batch function that called sys.exit()

    monkeypatch.setattr(batchmain, "run_batch", exits)
    requests = [PoolRequest("b0"), PoolRequest("b1")]
    batchmain.submit(requests, TaskPool())
    for request in requests:
        assert request.successes == []
        (failure,) = request.failures
        lost = failure_of(failure)
        assert isinstance(lost, WorkerLostError) and "SystemExit(3)" in str(lost)


@pytest.mark.parametrize(("options", "said"), [
    ({"bind": True}, "cannot bind=True"),
    # (one run, one hand-made request: Celery's retry re-raised and every call failed)
    ({"autoretry_for": (ConnectionError,)}, "cannot autoretry_for=.*retry from the caller"),
])
def test_options_a_batch_task_cannot_keep_are_refused_at_its_definition(
        app: Any, options: dict[str, Any], said: str) -> None:
    with pytest.raises(TypeError, match=said):
        app.batch_inference_task(model="enc", **options)


def test_a_function_that_cannot_take_the_engine_is_refused_at_its_definition(
        app: Any) -> None:
    """(each call failed instead, blaming the caller: "takes 0 positional arguments but 1
    was given", or by name "too many positional arguments" for a call that gave none)"""
    def no_engine() -> int:
        return 1

    def engine_only(engine: Any) -> list[int]:
        return []

    with pytest.raises(TypeError, match=r"no_engine is an inference task: it must take "
                                        r"engine as its first positional argument.*takes 0"):
        app.inference_task(model="enc")(no_engine)
    with pytest.raises(TypeError, match=r"engine_only is a batch task: it must take engine "
                                        r"and calls as its first positional arguments"):
        app.batch_inference_task(model="enc")(engine_only)
    assert "u.no_engine" not in app.tasks
    # what can take them is taken: named, by *args, with keyword-only ones beside
    def star(*args: Any) -> Any:
        return args

    def batch(engine: Any, calls: list[Any], *, size: int = 1) -> list[int]:
        return [size] * len(calls)

    app.inference_task(model="enc", name="u.named", shared=False)(engine_only)
    app.inference_task(model="enc", name="u.star", shared=False)(star)
    app.batch_inference_task(model="enc", name="u.batch", shared=False)(batch)
    assert {"u.named", "u.star", "u.batch"} <= set(app.tasks)


_RAN: list[str] = []


def _record(mark: str) -> None:
    _RAN.append(mark)


class _Marks:
    """Unpickled, it records that it ran (a stand-in for any code a pickle runs)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_record, ("unpickled",))


def test_a_job_whose_content_the_app_does_not_accept_is_not_decoded() -> None:
    """(a job's own content type was taken as accepted: one that joined a batch from its
    Redis list, declaring pickle, was unpickled in the pool child whatever the app's
    accept_content; only JSON is accepted by default)"""
    import pickle

    from kombu.exceptions import ContentDisallowed

    from sits_queue.workers import joins

    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="accept-unit")

    @app.batch_inference_task(name="u.batch_accept", model="m", shared=False)
    def batch(engine: Any, calls: list[Any]) -> list[Any]:
        return [None for _ in calls]

    app.set_current()
    body = pickle.dumps(((_Marks(),), {}, {}))
    raw = joins.encode_job(("u.batch_accept", "forged", {"id": "forged"}, body,
                            "application/x-python-serialize", "binary"))
    with pytest.raises(ContentDisallowed):
        batched.run_batch([joins.decode_job(raw)])
    assert _RAN == []
    app.close()


class _StartedBackend:
    """Records what a batch's start stores: ``store_started`` (SITS's backend) or, without
    it, one ``store_result`` per call (any other backend)."""

    def __init__(self, batched_store: bool = True, fails: bool = False) -> None:
        self.stored: list[tuple[str, Any, str]] = []
        self.fails = fails
        if batched_store:
            self.store_started = self._store_started

    def _store_started(self, started: list[tuple[str, Any, Any]]) -> None:
        if self.fails:
            raise ConnectionError("Redis went away")
        self.stored.extend((task_id, result, "STARTED") for task_id, result, _ in started)

    def store_result(self, task_id: str, result: Any, state: str, request: Any = None) -> None:
        self.stored.append((task_id, result, state))


@pytest.mark.parametrize("batched_store", [True, False])
def test_a_batch_marks_each_call_started_as_celerys_tracer_would(
        app: Any, monkeypatch: pytest.MonkeyPatch, batched_store: bool) -> None:
    """(a batch's calls stayed PENDING while it ran: a revoke on a worker that did not
    hold it marked a running call REVOKED)"""
    from celery.app.task import Context

    task = app.tasks["u.score"]
    backend = _StartedBackend(batched_store)
    monkeypatch.setattr(task, "backend", backend)
    requests = [Context({"id": "a", "hostname": "w1@h"}),
                Context({"id": "quiet", "hostname": "w1@h", "ignore_result": True}),
                Context({"id": "b", "hostname": "w1@h"})]
    batched.mark_started(task, requests)
    pid = os.getpid()
    assert backend.stored == [("a", {"pid": pid, "hostname": "w1@h"}, "STARTED"),
                              ("b", {"pid": pid, "hostname": "w1@h"}, "STARTED")]
    # A task that does not track its start, or ignores its results, writes nothing
    backend.stored.clear()
    monkeypatch.setattr(task, "track_started", False)
    batched.mark_started(task, requests)
    monkeypatch.setattr(task, "track_started", True)
    monkeypatch.setattr(task, "ignore_result", True)
    batched.mark_started(task, requests)
    assert backend.stored == []


def test_a_backend_that_fails_at_a_batch_s_start_only_loses_the_early_mark(
        app: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from celery.app.task import Context

    task = app.tasks["u.score"]
    monkeypatch.setattr(task, "backend", _StartedBackend(fails=True))
    batched.mark_started(task, [Context({"id": "a", "hostname": "w1@h"})])  # no raise
    assert "could not mark 1 u.score calls STARTED" in caplog.text


def test_a_task_id_that_is_no_utf8_is_left_out_of_the_record() -> None:
    """(encoding the record failed the put: the message is dead-lettered at its pick,
    with the reason, instead)"""
    message = {"headers": {"task": "u.score", "id": "ab\udc80"}, "properties": {}}
    meta = WaitingMeta.of_message(CONFIG, message, 1.0)
    assert meta.task_id is None and b'"id"' not in meta.to_json()
