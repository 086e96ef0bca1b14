"""A batch's time budget: the policy (``batchtime.py``) and the main process's cut
(``batchbudget.py``) over stand-in requests; the real worker's in
``tests/integration/test_batched.py``."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from sits_queue.config import SitsConfig
from sits_queue.errors import ConfigError
from sits_queue.options import HEADER
from sits_queue.workers import batchbudget
from sits_queue.workers.batchembed import texts_of
from sits_queue.workers.batchgen import tokens_asked
from sits_queue.workers.batchtime import WINDOW, Run, Times, fitting


def test_nothing_is_cut_without_a_run_a_limit_or_a_share() -> None:
    works = [1.0] * 10
    assert fitting(None, works, 2.0, 0.8) == 10
    assert fitting(Times(), works, 2.0, 0.8) == 10
    slow = Times().record(Run(1.0, 5.0))
    assert fitting(slow, works, None, 0.8) == 10
    assert fitting(slow, works, 0.0, 0.8) == 10
    assert fitting(slow, works, 2.0, 0.0) == 10
    assert fitting(slow, [], 2.0, 0.8) == 0


def test_the_longest_prefix_within_the_share_runs_and_at_least_one() -> None:
    times = Times().record(Run(4.0, 1.0))  # 0.25 s a unit
    assert fitting(times, [1.0] * 10, 2.0, 0.8) == 6  # 1.5 s of the 1.6 allowed
    assert fitting(times, [1.0] * 6, 2.0, 0.8) == 6
    # units weigh: a call asking 4 units costs as much as four of one
    assert fitting(times, [4.0, 1.0, 1.0, 1.0], 2.0, 0.8) == 3
    # one call over the budget alone still runs (it fails or not on its own)
    assert fitting(times, [100.0, 1.0], 2.0, 0.8) == 1


def test_a_run_stopped_at_its_limit_counts_twice_the_limit() -> None:
    stopped = Times().record(Run(8.0, 2.0, cut_short=True))
    assert stopped.per_unit_s() == pytest.approx(0.5)
    assert fitting(stopped, [1.0] * 8, 2.0, 0.8) == 3  # share / 2 of the 8 that failed


def test_the_median_of_the_last_runs_is_the_estimate() -> None:
    times = Times()
    for seconds in (1.0, 9.0, 2.0):  # per unit: 1, 9, 2
        times = times.record(Run(1.0, seconds))
    assert times.per_unit_s() == 2.0
    for _ in range(WINDOW):
        times = times.record(Run(2.0, 1.0))
    assert len(times.runs) == WINDOW and times.per_unit_s() == 0.5
    # an empty or unmeasured run teaches nothing
    assert times.record(Run(0.0, 1.0)) is times and times.record(Run(1.0, -1.0)) is times


def test_the_built_in_tasks_weigh_texts_and_tokens_asked() -> None:
    assert texts_of(["a", "b", "c"]) == 3.0 and texts_of("one") == 1.0
    assert texts_of(["a"], normalize=False) == 1.0 and texts_of() == 1.0
    assert tokens_asked("p", 64) == 64.0 and tokens_asked("p", max_new_tokens=5) == 5.0
    assert tokens_asked("p") == 32.0  # the default
    # malformed arguments (the call fails on its own in the batch) weigh the default
    assert tokens_asked("p", max_new_tokens=-3) == 32.0
    assert tokens_asked("p", max_new_tokens="lots") == 32.0
    assert tokens_asked(nope=1) == 32.0


def test_batch_time_share_is_checked() -> None:
    assert SitsConfig().batch_time_share == 0.8
    assert SitsConfig.from_env({"SITS_BATCH_TIME_SHARE": "0"}).batch_time_share == 0.0
    for bad in ("1.5", "-0.1", "nan"):
        with pytest.raises(ConfigError, match="batch_time_share must be"):
            SitsConfig.from_env({"SITS_BATCH_TIME_SHARE": bad})


# -- the main process's cut, over stand-in requests ----------------------------------------

@dataclass
class App:
    sits: SitsConfig = field(default_factory=SitsConfig)


@dataclass
class Task:
    app: App
    batch_work: Any = None
    soft_time_limit: float | None = None
    time_limit: float | None = None


@dataclass
class Request:
    task: Task
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    key: str | None = "k"
    time_limits: tuple[float | None, float | None] = (30.0, 2.0)  # hard, soft
    name: str = "t.batch"

    @property
    def request_dict(self) -> dict[str, Any]:
        return {HEADER: {"batch": self.key}} if self.key is not None else {}


@pytest.fixture
def given_back(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    back: list[Any] = []
    monkeypatch.setattr(batchbudget.admission, "_give_back", back.append)
    monkeypatch.setattr(batchbudget, "_times", OrderedDict())
    yield back


def requests(n: int, **kwargs: Any) -> list[Request]:
    task = kwargs.pop("task", None) or Task(App())
    return [Request(task, (f"call {i}",), **kwargs) for i in range(n)]


def test_a_batch_is_cut_after_its_key_missed_its_limit(given_back: list[Any]) -> None:
    first = requests(8)
    assert batchbudget.cut(first) == first and not given_back  # nothing known yet
    batchbudget.stopped(first)  # the pool stopped it at its 2 s soft limit
    again = requests(8)
    assert batchbudget.cut(again) == again[:3]
    assert given_back == again[3:]
    # it ran: 3 calls in 0.6 s; the median of 0.5 and 0.2 s a call fits 4 now
    batchbudget.ran(again[:3], 0.6)
    assert len(batchbudget.cut(requests(8))) == 4


def test_keys_limits_and_shares_are_each_batchs_own(given_back: list[Any]) -> None:
    batchbudget.stopped(requests(8))
    # another key learned nothing; a batch with no key or a share of 0 is never cut
    assert len(batchbudget.cut(requests(8, key="other"))) == 8
    assert len(batchbudget.cut(requests(8, key=None))) == 8
    off = Task(App(SitsConfig(batch_time_share=0.0)))
    assert len(batchbudget.cut(requests(8, task=off))) == 8
    # no soft limit: the hard one is the budget (30 s: all 8 fit)
    assert len(batchbudget.cut(requests(8, time_limits=(30.0, None)))) == 8
    # no limit on the message or the task: nothing to fit
    assert len(batchbudget.cut(requests(8, time_limits=(None, None)))) == 8
    assert not given_back


def test_a_work_function_that_raises_or_lies_counts_one(given_back: list[Any]) -> None:
    def work(text: str) -> float:
        if text == "call 0":
            raise ValueError("not a text it knows")
        return float("nan") if text == "call 1" else 4.0

    task = Task(App(), batch_work=work)
    calls = requests(4, task=task)
    assert [batchbudget.work_of(r) for r in calls] == [1.0, 1.0, 4.0, 4.0]
    batchbudget.ran(calls, 2.0)  # 10 units in 2 s: 0.2 s a unit
    assert len(batchbudget.cut(requests(4, task=task))) == 3  # 1 + 1 + 4 units: 1.2 s


@pytest.mark.parametrize("ending", [SystemExit(3), KeyboardInterrupt(), ValueError("odd")])
def test_a_work_function_that_fails_or_exits_counts_one_and_is_said_once(
        ending: BaseException, given_back: list[Any], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(it runs in the worker's main process: its sys.exit() ended the worker after each
    batch, the message given back unacked to end the next worker alike)"""
    monkeypatch.setattr(batchbudget, "_failing", set())

    def work(text: str) -> float:
        raise ending

    calls = requests(3, task=Task(App(), batch_work=work))
    assert [batchbudget.work_of(r) for r in calls] == [1.0, 1.0, 1.0]
    said = [r.getMessage() for r in caplog.records if "work= function failed" in r.message]
    assert len(said) == 1 and said[0].startswith("task t.batch: ")
    assert type(ending).__name__ in said[0]


def test_celerys_own_shutdown_raised_meanwhile_still_stops_the_worker() -> None:
    from celery.exceptions import WorkerShutdown, WorkerTerminate

    for stop in (WorkerShutdown(0), WorkerTerminate(1)):
        def work(text: str, stop: BaseException = stop) -> float:
            raise stop  # (a signal handler's, run while the function did)

        with pytest.raises(type(stop)):
            batchbudget.work_of(requests(1, task=Task(App(), batch_work=work))[0])


def test_a_batch_tasks_work_is_its_own_function_and_must_be_callable() -> None:
    from sits_queue.app import make_app

    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="batchtime_unit")

    @app.batch_inference_task(model="m", work=lambda text, n=1: float(n))
    def weighed(engine: Any, calls: list[Any]) -> list[Any]:
        return [None for _ in calls]

    @app.batch_inference_task(model="m")
    def plain(engine: Any, calls: list[Any]) -> list[Any]:
        return [None for _ in calls]

    # (not bound to the task: a call's arguments are all it gets)
    assert app.tasks[weighed.name].batch_work("a text", n=3) == 3.0
    assert app.tasks[plain.name].batch_work is None
    assert app.tasks["sits.embed"].batch_work(["a", "b"]) == 2.0
    assert app.tasks["sits.generate_batched"].batch_work("p", 7) == 7.0
    with pytest.raises(TypeError, match="work must be a callable"):
        app.batch_inference_task(model="m", work=3)  # type: ignore[arg-type]


def test_members_already_started_are_never_given_back(given_back: list[Any]) -> None:
    """(joins a batch did not take run apart after their started event: acked already
    without acks_late, a give-back would lose them)"""
    batchbudget.stopped(requests(8))
    leftovers = requests(8)
    leftovers[5].time_start = 1.0  # type: ignore[attr-defined]
    assert batchbudget.cut(leftovers) == leftovers and not given_back


def test_the_keys_remembered_are_bounded(given_back: list[Any]) -> None:
    for n in range(batchbudget.MOST_KEYS + 5):
        batchbudget.ran(requests(1, key=f"k{n}"), 1.0)
    assert len(batchbudget._times) == batchbudget.MOST_KEYS
    assert "k0" not in batchbudget._times and f"k{batchbudget.MOST_KEYS + 4}" in batchbudget._times


# -- what a batch's end records (batchmain.submit's callback, over a stand-in pool) --------

class Pool:
    """Runs nothing: hands ``ran`` (what run_batch returned) to the success callback."""

    def __init__(self, ran: Any) -> None:
        self.ran = ran

    def apply_async(self, fun: Any, callback: Any = None, **_: Any) -> None:
        callback(self.ran)


@dataclass(eq=False)
class Member(Request):
    id: str = "m"
    type: str = "t.batch"
    body: bytes = b""
    content_type: str = "application/json"
    content_encoding: str = "utf-8"

    def on_success(self, outcome: Any) -> None:
        pass


def members(n: int, task: Task) -> list[Member]:
    return [Member(task, (f"call {i}",), id=f"id{i}") for i in range(n)]


def test_a_batch_that_took_joins_and_missed_its_limit_is_learned(
        given_back: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """(a batch that took joins recorded nothing: under a backlog a generation batch on a
    GPU always takes some, so it never learned, and missed its limit again)"""
    from sits_queue.workers import batchmain, joins

    monkeypatch.setattr(batchmain, "_joins", batchmain.JoinSetup(object(), "", 10.0, print))
    monkeypatch.setattr(joins, "start", lambda *a, **k: None)
    monkeypatch.setattr(joins, "finish", lambda *a, **k: ([], []))
    task = Task(App())
    task.joins = True  # type: ignore[attr-defined]
    own = members(8, task)
    # its 8 calls, one more that joined and one it declined (None); stopped at 2 s
    ran = ([("r", None, 2.0)] * 9 + [None], {"seconds": 2.0, "cut_short": True})
    batchmain.submit(own, Pool(ran))
    assert batchbudget._times["k"].runs == (batchtime_run(8.0, 2.0, True),)
    assert len(batchbudget.cut(members(8, task))) == 3


def test_a_run_that_failed_on_its_load_teaches_nothing(
        given_back: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """(a cold load that failed after 0.3 s was recorded as the calls' run time, and cut
    the next batches though nothing had run)"""
    from sits_queue.errors import ModelLoadError
    from sits_queue.workers import batched, batchmain
    from sits_queue.workers.batched import Call

    class Stub:
        app = None

        def push_request(self, **_: Any) -> None: ...

        def pop_request(self) -> None: ...

    def failing(*_a: Any, **_k: Any) -> Any:
        time.sleep(0.3)
        raise ModelLoadError("could not load")

    monkeypatch.setattr(batched.runtime, "child", lambda: None)
    monkeypatch.setattr(batched.runtime, "for_app", lambda app: None)
    monkeypatch.setattr(batched.inference, "run_inference", failing)
    outcomes, timing = batched._run(Stub(), [Call(f"c{i}", ("x",)) for i in range(2)], {})
    assert all(isinstance(o, ModelLoadError) for o in outcomes.values())
    assert timing["failed"] is True and timing["cut_short"] is False
    task = Task(App())
    batchmain.submit(members(2, task), Pool(([("f", None, 0.3)] * 2,
                                           {**timing, "seconds": 0.3})))
    assert "k" not in batchbudget._times


def batchtime_run(work: float, seconds: float, cut_short: bool) -> Any:
    from sits_queue.workers.batchtime import Run

    return Run(work, seconds, cut_short)
