"""Precisions end to end (MISSION §3.2): a real ``celery worker`` serves tiny local models
at the precision each task asks for, each precision its own warm engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from sits_queue.errors import InvalidTaskOptions
from sits_queue.procs import CeleryProcess
from sits_queue.workers import advertise
from sits_queue.workers.advertise import read_workers
from tests.integration.inference_app import CALL_S, FIRST_CALL_S, serving


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_url: str, config_path: Path,
           models_dir: Path, app: Celery) -> Iterator[CeleryProcess]:
    with serving(redis_url, config_path, models_dir, tmp_path_factory.mktemp("precision-logs"),
                 app, name="precision") as proc:
        yield proc


def generate(app: Celery, timeout: float = CALL_S, **options: Any) -> Any:
    return app.tasks["sits.generate"].apply_async(
        ("Once upon a time",), {"max_new_tokens": 6}, model="gpt", **options
    ).get(timeout=timeout)


def test_int8_passes_the_gate_and_is_its_own_warm_engine(app: Celery,
                                                          worker: CeleryProcess) -> None:
    full = generate(app, timeout=FIRST_CALL_S)
    first = generate(app, precision="int8")
    again = generate(app, precision="int8")
    # The int8 engine is built once (cold: quantised and gated), then served warm
    assert first["sits"]["cold"] is True and again["sits"]["cold"] is False
    meta = first["sits"]["precision"]
    assert meta["requested"] == meta["served"] == "int8" and meta["reason"] is None
    assert 0 <= meta["kl"] < 0.05
    assert again["sits"]["precision"] == meta
    assert full["sits"]["precision"] is None  # asked for nothing: served as loaded
    assert again["output"]["tokens"] == 6 and isinstance(again["output"]["text"], str)


def test_the_worker_holds_each_precision_under_its_own_key(
        app: Celery, worker: CeleryProcess, redis_url: str) -> None:
    generate(app, precision="bf16")
    record = next(r for r in read_workers(redis.Redis.from_url(redis_url))
                  if r.get("hostname") == worker.hostname)
    assert {"gpt", "gpt@int8", "gpt@bf16"} <= set(record["warm"])
    # a CPU has no datasheet figures: no precision preferences to advertise
    assert all(d["peak_tflops"] == {} for d in record["devices"])


def test_an_fp32_request_of_an_fp32_checkpoint_is_warm_for_affinity_where_it_ran(
        app: Celery, worker: CeleryProcess, redis_url: str) -> None:
    """(served by the model as loaded, it was matched against gpt@fp32, which no child
    ever holds: no affinity on the worker where it ran warm)"""
    from sits_queue.broker.affinity import AffinityPolicy, warm_of

    generate(app, precision="fp32")
    assert generate(app, precision="fp32")["sits"]["cold"] is False
    client = redis.Redis.from_url(redis_url)
    record = next(r for r in read_workers(client) if r.get("hostname") == worker.hostname)
    children = [advertise.json_object(client.get(advertise.child_key("", worker.hostname,
                                                                    slot)))
                for slot in record["slots"]]
    warm = warm_of([c for c in children if c], AffinityPolicy())
    assert warm.weight("gpt", None, "fp32") == warm.weight("gpt", None) == 1.0


def test_a_batch_of_embeds_runs_on_the_engine_of_its_precision(
        app: Celery, worker: CeleryProcess) -> None:
    got = app.tasks["sits.embed"].apply_async((["a b", "c d"],), model="enc",
                                             precision="fp16").get(timeout=CALL_S)
    assert got["sits"]["precision"]["served"] == "fp16"
    assert len(got["output"]) == 2 and all(len(v) == len(got["output"][0])
                                           for v in got["output"])


def test_an_unknown_precision_is_refused_at_submission(app: Celery) -> None:
    with pytest.raises(InvalidTaskOptions, match="precision must be one of"):
        app.tasks["sits.generate"].apply_async(("x",), model="gpt", precision="int4")
