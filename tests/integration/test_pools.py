"""Pool choices other than the default prefork, with real ``celery worker`` subprocesses.

``--pool=solo`` runs tasks in the worker process itself, one at a time: the per-task
runtime (pinning, class caps, warm engines) holds there, and a soft time limit still
stops a generation between decode steps (checked by the loop itself: the solo pool has
no timer to raise it). A pool that runs several tasks side by side in one process
(threads, gevent, eventlet) would share one memory cap and one confinement between
them: the worker refuses to start with one at a concurrency above 1, naming the fix,
unless it runs plain tasks only (``SITS_PLAIN_TASKS_ONLY``): then its tasks run side
by side and an inference task sent to it stays in its queue for another worker.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from celery.utils import worker_direct

from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from sits_queue.procs import CeleryProcess
from sits_queue.status import format_status, workers_status
from sits_queue.workers import cores
from tests.integration.conftest import refusal
from tests.integration.inference_app import CALL_S, FIRST_CALL_S, call, serving, spawn_worker
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def solo(tmp_path_factory: pytest.TempPathFactory, redis_url: str, config_path: Path,
         models_dir: Path, app: Celery) -> Iterator[CeleryProcess]:
    # (-c 2, which Celery's solo pool ignores: the worker took it for 2 slots, each
    # task confined to half the cores)
    with serving(redis_url, config_path, models_dir, tmp_path_factory.mktemp("solo-logs"),
                 app, name="solo", pool="solo", concurrency=2) as proc:
        yield proc



def test_a_solo_worker_runs_inference_in_its_own_process_warm_after_the_first(
        app: Celery, solo: CeleryProcess) -> None:
    first = call(app, "t.describe", "one", timeout=FIRST_CALL_S)
    second = call(app, "t.describe", "two")
    assert first["output"]["pid"] == second["output"]["pid"] == solo.pid
    assert first["sits"]["cold"] is True and second["sits"]["cold"] is False
    assert "pool child 0" in solo.log() and "pinned to CPU" in solo.log()
    # The class's CPU confinement applies in the worker process itself ("one": 1 core;
    # a platform without CPU affinity, macOS, pins nothing)
    confined = call(app, "t.describe", "confined", sla_class="one")
    assert len(confined["output"]["affinity"]) == (1 if cores.can_pin() else len(cores.usable()))
    # and a class of more cores than the host has gets them all: the one slot is the host's
    wide = call(app, "t.describe", "wide", sla_class="high")
    assert len(wide["output"]["affinity"]) == len(cores.usable())
    text = call(app, "sits.generate", "the solo worker", model="gpt", timeout=FIRST_CALL_S,
                kwargs={"max_new_tokens": 4, "stop_at_eos": False})
    assert text["output"]["tokens"] == 4 and text["sits"]["first_token_ms"] > 0


def test_a_soft_time_limit_stops_a_generation_on_a_solo_worker(
        app: Celery, solo: CeleryProcess) -> None:
    # Given 200 decode steps of >= 20 ms and a 1 s soft limit, which the solo pool has no
    # timer to raise, the generation stops between steps by itself and says how far it got
    result = app.tasks["t.generate_slow"].apply_async(("the solo", 200), soft_time_limit=1.0)
    with pytest.raises(SoftTimeLimitExceeded, match=r"stopped after \d+ of 200"):
        result.get(timeout=FIRST_CALL_S)
    assert solo.alive()
    assert call(app, "t.describe", "after")["output"]["tag"] == "after"


def test_a_pool_sharing_one_process_between_tasks_is_refused_at_start(
        tmp_path: Path, redis_url: str, config_path: Path, models_dir: Path) -> None:
    log = refusal(spawn_worker(redis_url, config_path, models_dir, tmp_path, concurrency=2,
                               name="threads", pool="threads"), "its pool")
    assert "would run 2 tasks in one process" in log and "--pool=solo" in log, log[-2000:]


def test_a_bad_cache_size_stops_the_worker_at_start_naming_it(
        tmp_path: Path, redis_url: str, config_path: Path, models_dir: Path) -> None:
    """Read again by each pool child at fork: refused in the parent, before any child
    (which would log the error and serve with no cache)."""
    log = refusal(spawn_worker(redis_url, config_path, models_dir, tmp_path, concurrency=1,
                               name="badcache", env={"SITS_DEVICE_CACHE_BYTES": "inf"}),
                  "its cache size")
    assert "SITS_DEVICE_CACHE_BYTES='inf' must be a finite number of bytes" in log, log[-2000:]
    assert "OverflowError" not in log and "pool child" not in log


def test_the_same_pool_at_concurrency_1_serves(tmp_path: Path, redis_url: str,
                                               config_path: Path, models_dir: Path,
                                               app: Celery) -> None:
    with serving(redis_url, config_path, models_dir, tmp_path, app, concurrency=1,
                 name="threads1", pool="threads") as proc:
        # sent to this worker's own queue: the solo worker of this module serves the rest
        out = call(app, "t.describe", "threaded", timeout=FIRST_CALL_S,
                   queue=worker_direct(proc.hostname))
    assert out["output"]["pid"] == proc.pid and out["sits"]["device"] == "cpu"


def test_a_worker_of_plain_tasks_only_runs_them_side_by_side_and_leaves_inference(
        tmp_path: Path, redis_url: str, config_path: Path, models_dir: Path,
        app: Celery, r: redis.Redis) -> None:
    with serving(redis_url, config_path, models_dir, tmp_path, app, concurrency=4,
                 name="plain", pool="threads", env={"SITS_PLAIN_TASKS_ONLY": "1"}) as proc:
        queue = worker_direct(proc.hostname)
        waits = [app.tasks["t.wait"].apply_async((1.0,), queue=queue) for _ in range(4)]
        outs = [w.get(timeout=FIRST_CALL_S) for w in waits]
        # four threads of the worker process, all four waiting at the same time
        assert {o["pid"] for o in outs} == {proc.pid} and len({o["thread"] for o in outs}) == 4
        assert max(o["began"] for o in outs) < min(o["ended"] for o in outs)
        # its advert says so, and `sitsq status` shows it
        record = next(w for w in workers_status(r, SitsConfig())
                      if w["hostname"] == proc.hostname)
        assert record["plain_tasks_only"] == "threads"
        assert "plain tasks only (threads pool)" in format_status(
            {"queues": [], "workers": [record], "site": None})
        # An inference task is not started here and not failed: it stays in its queue
        left = app.tasks["t.describe"].apply_async(("left",), queue=queue.name)
        wait_for(lambda: "this worker runs plain tasks only" in proc.log(), 30,
                 "the worker to leave the inference task")
        keys = QueueKeys.for_queue(queue.name)

        def waiting() -> list[str]:  # the task ids of the queue's waiting messages
            return [json.loads(r.hget(keys.payloads, m) or "{}").get("headers", {}).get("id")
                    for m in r.zrange(keys.waiting, 0, -1)]

        wait_for(lambda: waiting() == [left.id], 10, "the inference task back in its queue")
        assert left.state == "PENDING" and not r.hlen(keys.redelivered)
        # and plain tasks go on meanwhile
        assert app.tasks["t.wait"].apply_async((0.0,), queue=queue).get(
            timeout=CALL_S)["pid"] == proc.pid
    assert waiting() == [left.id]  # still there for another worker


def test_a_prefork_worker_of_plain_tasks_only_leaves_inference_too(
        tmp_path: Path, redis_url: str, config_path: Path, models_dir: Path,
        app: Celery, r: redis.Redis) -> None:
    """(on prefork the setting was ignored: the worker loaded the model and ran the
    inference task, and took one a plain-only threads worker had just released)"""
    with serving(redis_url, config_path, models_dir, tmp_path, app, concurrency=1,
                 name="plainfork", env={"SITS_PLAIN_TASKS_ONLY": "1"}) as proc:
        queue = worker_direct(proc.hostname)
        left = app.tasks["t.describe"].apply_async(("left",), queue=queue.name)
        wait_for(lambda: "this worker runs plain tasks only (SITS_PLAIN_TASKS_ONLY)"
                 in proc.log(), 30, "the worker to leave the inference task")
        assert left.state == "PENDING"
        record = next(w for w in workers_status(r, SitsConfig())
                      if w["hostname"] == proc.hostname)
        assert record["plain_tasks_only"] == "prefork"
        assert app.tasks["t.wait"].apply_async((0.0,), queue=queue).get(
            timeout=CALL_S)["pid"] != proc.pid  # a plain task, in its pool child
