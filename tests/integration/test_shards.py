"""High-entropy inputs split into early-stoppable shards (MISSION §1.3), through a real
worker: the split, the order of the outputs, and an early stop that revokes the rest."""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout
from kombu.exceptions import EncodeError

from sits_queue.broker.keys import QueueKeys
from sits_queue.procs import CeleryProcess
from sits_queue.shards import apply_sharded
from tests.integration.inference_app import (
    SHARD_PAUSE_S,
    build_models,
    serving,
)
from tests.waiting import wait_for

CALL_S = 120
DENSE = [base64.b64encode(random.Random(i).randbytes(30 + i)).decode() for i in range(20)]
PROSE = [f"the cat sat on the mat and looked at the garden number {i}" for i in range(20)]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_url: str, config_path: Path,
           app: Celery) -> Iterator[CeleryProcess]:
    models = build_models(tmp_path_factory.mktemp("models"))
    with serving(redis_url, config_path, models, tmp_path_factory.mktemp("shards-logs"), app,
                 name="shards") as proc:
        yield proc


def test_dense_input_runs_as_shards_in_input_order(app: Celery, worker: CeleryProcess) -> None:
    job = apply_sharded(app.tasks["t.lengths"], DENSE, shard_items=4)
    assert len(job) == 5 and job.plan.sharded and job.plan.entropy is not None
    assert job.get(timeout=CALL_S) == [len(t) for t in DENSE]
    # each shard was its own task, with its own result
    assert len({r.id for r in job.results}) == 5


def test_prose_goes_as_one_task(app: Celery, worker: CeleryProcess) -> None:
    job = apply_sharded(app.tasks["t.lengths"], PROSE, shard_items=4)
    assert len(job) == 1 and not job.plan.sharded
    assert job.get(timeout=CALL_S) == [len(t) for t in PROSE]


def test_the_callers_entropy_decides_and_is_sent_once(app: Celery,
                                                      worker: CeleryProcess) -> None:
    # prose, which measures low, split because the caller says it is high-entropy
    job = apply_sharded(app.tasks["t.lengths"], PROSE, shard_items=4, input_entropy=0.99)
    assert len(job) == 5 and job.plan.sharded and job.plan.entropy == 0.99
    assert job.get(timeout=CALL_S) == [len(t) for t in PROSE]
    # and dense text kept whole when the caller says it is low
    whole = apply_sharded(app.tasks["t.lengths"], DENSE, shard_items=4, input_entropy=0.01)
    assert len(whole) == 1 and whole.get(timeout=CALL_S) == [len(t) for t in DENSE]


def test_the_tasks_declared_entropy_decides_when_the_caller_says_none(
        app: Celery, worker: CeleryProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """(apply_sharded measured the items, split on that, and sent the measured value as
    the call's, outranking the task's declaration in every shard's score)"""
    task = app.tasks["t.lengths"]
    # Given a task declaring low entropy (it wants arrival order), dense items stay whole
    monkeypatch.setattr(task, "input_entropy", 0.01)
    whole = apply_sharded(task, DENSE, shard_items=4)
    assert len(whole) == 1 and not whole.plan.sharded and whole.plan.entropy == 0.01
    assert whole.get(timeout=CALL_S) == [len(t) for t in DENSE]
    # and one declaring high entropy has prose split
    monkeypatch.setattr(task, "input_entropy", 0.99)
    split = apply_sharded(task, PROSE, shard_items=4)
    assert len(split) == 5 and split.plan.sharded and split.plan.entropy == 0.99
    assert split.get(timeout=CALL_S) == [len(t) for t in PROSE]


def test_an_early_stop_revokes_the_shards_not_yet_run(app: Celery,
                                                      worker: CeleryProcess) -> None:
    job = apply_sharded(app.tasks["t.lengths"], DENSE, shard_items=2)  # 10 shards
    # When the caller has what it needs after two shards, it stops
    found = job.take(lambda items: len(items) >= 4, timeout=CALL_S)
    assert found == [len(t) for t in DENSE[:4]]
    # Then the shards still waiting are revoked: the worker discards them
    wait_for(lambda: all(r.ready() for r in job.results), 30, "every shard to settle")
    states = [r.state for r in job.results]
    assert states[:2] == ["SUCCESS", "SUCCESS"]
    assert states.count("REVOKED") >= 5, states  # one may have started meanwhile
    assert states[-1] == "REVOKED"


def test_a_timeout_bounds_the_whole_job_not_each_shard(app: Celery,
                                                      worker: CeleryProcess) -> None:
    # (the model warm first: a cold start alone would outlast the timeout below)
    assert app.tasks["t.lengths"].delay(["warm"]).get(timeout=CALL_S)["output"] == [4]
    job = apply_sharded(app.tasks["t.lengths"], DENSE, shard_items=2)  # 10 shards
    # One worker slot runs them one after another: the job takes 10 pauses at least,
    # each shard about one. A timeout of 4 pauses is the job's, so it runs out.
    whole_s = len(job) * SHARD_PAUSE_S
    with pytest.raises(CeleryTimeout):
        job.get(timeout=whole_s * 0.4)
    # Then the job is still there to wait for, in full
    assert job.get(timeout=CALL_S) == [len(t) for t in DENSE]


def test_a_bad_items_argument_is_refused(app: Celery) -> None:
    with pytest.raises(TypeError, match="items must be a list"):
        apply_sharded(app.tasks["t.lengths"], "one string")


def test_an_item_the_serializer_refuses_sends_no_shard(app: Celery,
                                                       redis_client: redis.Redis) -> None:
    """(Celery sends a group's members one at a time: the shards before it were queued,
    and the caller, given an EncodeError, had no handle on them)"""
    items = ["x"] * 100 + [object()]
    with pytest.raises(EncodeError):  # (a queue no worker takes: what was sent stays)
        apply_sharded(app.tasks["t.lengths"], items, input_entropy=0.9, shard_items=10,
                      queue="unserved")
    assert redis_client.zcard(QueueKeys.for_queue("unserved").waiting) == 0
