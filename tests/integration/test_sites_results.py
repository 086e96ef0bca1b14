"""The result of a task a peer took over reaches the callers at its origin (MISSION
§2.3): site "a" on the session server, site "b" on a server of its own, a real ``celery
worker`` at b running what b took over, and a's pass copying the result home."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group
from celery.exceptions import ChordError
from celery.result import AsyncResult

from sits_queue.app import make_app
from sits_queue.broker import sites
from sits_queue.broker.keys import QueueKeys, mirror_chords_key, mirror_key, missing_since_key
from sits_queue.config import SitsConfig
from sits_queue.procs import start_worker, wait_ready
from tests.integration.conftest import APP_MODULE, ROOT, worker_env
from tests.integration.test_sites import embedded_site
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def site_b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from embedded_site(tmp_path_factory, "site-b-results")


@pytest.fixture
def apps(redis_client: redis.Redis, redis_url: str, site_b: str
         ) -> Iterator[tuple[Celery, Celery]]:
    redis.Redis.from_url(site_b).flushall()
    sites._syncs.clear()  # each test builds its own sites
    a_url = redis_url
    app_a = make_app(SitsConfig(redis_url=a_url, site="a",
                                site_peers=f"b={site_b}?rtt_ms=1.0"), main="site-a")
    app_b = make_app(SitsConfig(redis_url=site_b, site="b",
                                site_peers=f"a={a_url}?rtt_ms=1.0"), main="site-b")
    for app in (app_a, app_b):
        @app.task(name="w.add", shared=False)
        def add(x: int, y: int) -> int:
            return x + y

        @app.task(name="w.fail", shared=False)
        def fail(message: str) -> None:
            raise ValueError(message)

        @app.task(name="w.total", shared=False)
        def total(values: list[int]) -> int:
            return sum(values)
    yield app_a, app_b
    app_a.close()
    app_b.close()


def sync_of(app: Celery) -> sites.SiteSync:
    sync = sites.for_config(app.sits)
    assert sync is not None
    return sync


def take_over(app_a: Celery, app_b: Celery) -> None:
    """Site a replicates its work to b, then falls silent, and b takes it over."""
    sync_of(app_a).sync_pass()
    b = sync_of(app_b).local
    b.delete(sites.alive_key("", "a"))
    assert sync_of(app_b).sync_pass().taken_over == 0  # (b starts counting)
    since = float(b.get(missing_since_key("", "a")) or 0)
    b.set(missing_since_key("", "a"), since - app_b.sits.site_dead_after_s)
    assert sync_of(app_b).sync_pass().taken_over > 0


def test_a_taken_over_tasks_result_reaches_the_caller_at_its_origin(
        apps: tuple[Celery, Celery], site_b: str, tmp_path: Path) -> None:
    """(its result was stored at the peer's backend alone: the caller's get() at the
    origin waited for ever, the copy there dead-lettered as taken over)"""
    app_a, app_b = apps
    # Given a task submitted at a, taken over by b while a was silent
    result = app_a.tasks["w.add"].apply_async((2, 3), sla_class="high")
    take_over(app_a, app_b)
    # and run there by a real worker
    worker = start_worker(APP_MODULE, worker_env(site_b), tmp_path, concurrency=1, cwd=ROOT)
    try:
        wait_ready(app_b, [worker])
        wait_for(lambda: AsyncResult(result.id, app=app_b).state == "SUCCESS", 30,
                 "the task to run at b")
    finally:
        worker.stop(timeout_s=10)
    # When a caller at a is waiting on it, and a comes back
    got: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: got.update(value=result.get(timeout=20)))
    waiter.start()
    report = sync_of(app_a).sync_pass()
    waiter.join(30)
    # Then a's pass dead-letters its own copy and copies b's result home: the caller hears it
    assert report.dropped == 1 and report.results_mirrored == 1, report
    assert got == {"value": 5}
    assert AsyncResult(result.id, app=app_a).state == "SUCCESS"
    assert not sync_of(app_a).local.exists(mirror_key("", "a"))  # nothing left to copy


def test_the_results_of_what_a_taken_over_task_sends_on_come_home_too(
        apps: tuple[Celery, Celery], site_b: str, tmp_path: Path) -> None:
    """(a chain's later steps were sent at the peer by the worker that ran its first:
    their results were there alone, and a caller at the origin waited for ever)"""
    app_a, app_b = apps
    add = app_a.tasks["w.add"]
    # Given a chain (and a task with a link) submitted at a, taken over by b
    steps = chain(add.s(1, 2).set(sla_class="high"), add.s(10).set(sla_class="high"),
                  add.s(100).set(sla_class="high")).apply_async()
    linked = add.apply_async((5, 5), sla_class="high",
                             link=add.s(1000).set(sla_class="high", task_id="linked-next"))
    take_over(app_a, app_b)
    assert sync_of(app_a).sync_pass(app_a.backend).dropped == 2
    # When a real worker at b runs it, sending the later steps on at b
    worker = start_worker(APP_MODULE, worker_env(site_b), tmp_path, concurrency=1, cwd=ROOT)
    try:
        wait_ready(app_b, [worker])
        wait_for(lambda: AsyncResult(steps.id, app=app_b).state == "SUCCESS"
                 and AsyncResult("linked-next", app=app_b).state == "SUCCESS", 30,
                 "the chain and the link to run at b")
    finally:
        worker.stop(timeout_s=10)
    # Then a's next pass copies their results home too: its callers hear them
    report = sync_of(app_a).sync_pass(app_a.backend)
    assert report.results_mirrored == 5, report  # 2 taken over, 3 sent on
    assert steps.get(timeout=5) == 113 and steps.parent.get(timeout=5) == 13
    assert linked.get(timeout=5) == 10
    assert AsyncResult("linked-next", app=app_a).get(timeout=5) == 1010
    assert not sync_of(app_a).local.exists(mirror_key("", "a"))


def test_a_chain_in_a_chord_header_taken_over_counts_in_its_chord_at_the_origin(
        apps: tuple[Celery, Celery], site_b: str, tmp_path: Path) -> None:
    """(the chain's last step alone knows the chord, and it is sent on at the peer: its
    result came home counted in no chord, and the body never ran)"""
    app_a, app_b = apps
    add, high = app_a.tasks["w.add"], {"sla_class": "high"}
    result = chord([chain(add.s(1, 1).set(**high), add.s(10).set(**high)),
                    add.s(2, 2).set(**high)])(app_a.tasks["w.total"].s().set(**high))
    take_over(app_a, app_b)
    assert sync_of(app_a).sync_pass(app_a.backend).dropped == 2
    worker = start_worker(APP_MODULE, worker_env(site_b), tmp_path, concurrency=1, cwd=ROOT)
    try:
        wait_ready(app_b, [worker])
        members = [r.id for r in result.parent.results]
        wait_for(lambda: all(AsyncResult(m, app=app_b).state == "SUCCESS" for m in members),
                 30, "the header to run at b")
    finally:
        worker.stop(timeout_s=10)
    report = sync_of(app_a).sync_pass(app_a.backend)
    assert report.chord_parts == 2, report
    assert queued_tasks(app_a) == [("w.total", result.id)]


def test_a_result_not_ready_at_the_peer_is_copied_at_a_later_pass_failures_too(
        apps: tuple[Celery, Celery]) -> None:
    app_a, app_b = apps
    ok = app_a.tasks["w.add"].apply_async((1, 1), sla_class="high")
    bad = app_a.tasks["w.fail"].apply_async(("boom",), sla_class="high")
    take_over(app_a, app_b)
    # Given neither has run at b yet: a drops its copies, and has nothing to copy yet
    first = sync_of(app_a).sync_pass()
    assert first.dropped == 2 and first.results_mirrored == 0
    assert AsyncResult(ok.id, app=app_a).state == "PENDING"
    # When b's workers run them (b's own backend, as its worker stores them) and one is
    # only STARTED at b
    app_b.backend.mark_as_started(ok.id)
    app_b.backend.mark_as_failure(bad.id, ValueError("boom"))
    second = sync_of(app_a).sync_pass()
    assert second.results_mirrored == 1
    with pytest.raises(ValueError, match="boom"):
        bad.get(timeout=5)
    assert AsyncResult(ok.id, app=app_a).state == "PENDING"  # (STARTED is not copied)
    # Then the other once it is done
    app_b.backend.mark_as_done(ok.id, 2)
    assert sync_of(app_a).sync_pass().results_mirrored == 1
    assert ok.get(timeout=5) == 2


def test_an_origin_back_without_its_data_still_gets_the_results_home(
        apps: tuple[Celery, Celery]) -> None:
    """(its Redis restarted empty: no copy to read the task's id from, and the caller,
    polling the result here, waited for ever)"""
    app_a, app_b = apps
    result = app_a.tasks["w.add"].apply_async((4, 4), sla_class="high")
    take_over(app_a, app_b)
    app_b.backend.mark_as_done(result.id, 8)
    # Given site a's Redis lost everything meanwhile
    local = sync_of(app_a).local
    local.flushall()
    # When it is back, its pass finds no copy to drop, yet copies the result home
    report = sync_of(app_a).sync_pass()
    assert report.dropped == 0 and report.results_mirrored == 1, report
    assert result.get(timeout=5) == 8


def queued_tasks(app: Celery) -> list[tuple[str, str]]:
    """(task name, task id) of every message waiting in ``app``'s default queue."""
    payloads = sync_of(app).local.hvals(QueueKeys.for_queue("celery").payloads)
    return sorted((h["task"], h["id"]) for h in (json.loads(p)["headers"] for p in payloads))


@pytest.mark.parametrize("how", ["worker", "failure", "gzip", "later"])
def test_a_taken_over_chord_member_counts_in_its_chord_at_the_origin(
        apps: tuple[Celery, Celery], site_b: str, tmp_path: Path, how: str) -> None:
    """(its result came home, but the chord's count here never heard of it: the body
    never ran, its caller waited for ever)"""
    app_a, app_b = apps
    add = app_a.tasks["w.add"]
    options = {"sla_class": "high", **({"compression": "gzip"} if how == "gzip" else {})}
    # Given a chord submitted at a whose members b took over while a was silent (and a
    # plain group's member beside it)
    result = chord([add.s(1, 1).set(**options), add.s(2, 2).set(**options)])(
        app_a.tasks["w.total"].s().set(sla_class="high"))
    members = [child.id for child in result.parent.results]
    plain = group([add.s(5, 5).set(sla_class="high")]).apply_async()
    take_over(app_a, app_b)
    assert sync_of(app_a).sync_pass(app_a.backend).dropped == 3
    assert queued_tasks(app_a) == []
    chords = sync_of(app_a).local.hkeys(mirror_chords_key("", "a"))
    assert sorted(k.decode() for k in chords) == sorted(members)  # (not the plain one)
    # When both run at b: a real worker there, which counts them in a chord b's backend
    # does not know; or one of them fails
    if how == "worker":
        worker = start_worker(APP_MODULE, worker_env(site_b), tmp_path, concurrency=1,
                              cwd=ROOT)
        try:
            wait_ready(app_b, [worker])
            wait_for(lambda: all(AsyncResult(m, app=app_b).state == "SUCCESS"
                                 for m in members), 30, "the members to run at b")
        finally:
            worker.stop(timeout_s=10)
        assert "ERROR" not in worker.log()
    else:
        app_b.backend.mark_as_done(members[0], 2)
        if how == "failure":
            app_b.backend.mark_as_failure(members[1], ValueError("boom"))
        else:
            app_b.backend.mark_as_done(members[1], 4)
    app_b.backend.mark_as_done(plain.results[0].id, 10)
    if how == "later":  # (a pass with no backend to count them with: they wait for one)
        report = sync_of(app_a).sync_pass()
        assert report.results_mirrored == 3 and report.chord_parts == 0, report
        assert queued_tasks(app_a) == []
        report = sync_of(app_a).sync_pass(app_a.backend)
        assert report.chord_parts == 2, report
    else:
        report = sync_of(app_a).sync_pass(app_a.backend)
        # Then their results, copied home, count in the chord there
        assert report.results_mirrored == 3 and report.chord_parts == 2, report
    if how == "failure":  # (failing it, as Celery fails a chord one of whose members failed)
        body = AsyncResult(result.id, app=app_a)
        assert body.state == "FAILURE" and isinstance(body.result, ChordError)
        assert "boom" in str(body.result)
        assert queued_tasks(app_a) == []
    else:  # its body is sent at a
        assert queued_tasks(app_a) == [("w.total", result.id)]
    assert plain.get(timeout=5) == [10]
    # and nothing is left to count, or counted twice
    assert sync_of(app_a).sync_pass(app_a.backend).results_mirrored == 0
    assert not sync_of(app_a).local.exists(mirror_chords_key("", "a"))
    assert not sync_of(app_a).local.exists(mirror_key("", "a"))
