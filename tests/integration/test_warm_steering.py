"""A worker of several children hands each inference task to the child that holds its
engine warm (``workers/steer.py``), in a real ``celery worker`` with tiny real models.

(The prefork pool wrote each task to the first idle child in its own order: tasks of two
models taking turns on a two-child worker, each child's device tier holding one model,
all went to one child, each a cold start, while the other child held the other model
warm and sat idle.)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import redis

from sits_queue.procs import wait_ready
from tests.integration.inference_app import (
    CALL_S,
    FIRST_CALL_S,
    client_app,
    spawn_worker,
    write_config,
)
from tests.waiting import wait_for


def settled(redis_client: redis.Redis) -> None:
    """Until the worker has acked what it ran: a child stores its result before its main
    process hears it is done, and until then the main process counts that child busy (and
    steers around it)."""
    wait_for(lambda: redis_client.zcard("sits:{celery}:u") == 0, CALL_S,
             "the worker to ack what it ran")


def two_homes(app: Any, redis_client: redis.Redis) -> dict[str, int]:
    """Warm one child with lm-a, the other with gpt (a gpt task holds one child while the
    other, the only idle one, loads lm-a); each model's child pid."""
    describe = app.tasks["t.describe"]
    busy = app.tasks["t.hang"].apply_async((2.0,))
    wait_for(lambda: redis_client.zcard("sits:{celery}:u") == 1, FIRST_CALL_S,
             "the gpt task to start")
    home = {"lm-a": describe.apply_async(("a",), model="lm-a").get(
        timeout=FIRST_CALL_S)["output"]["pid"]}
    assert busy.get(timeout=FIRST_CALL_S)["output"] == "finished"
    settled(redis_client)
    home["gpt"] = describe.apply_async(("g",), model="gpt").get(
        timeout=CALL_S)["output"]["pid"]
    return home


def one_model_worker(tmp_path: Path, redis_url: str, models_dir: Path, name: str
                     ) -> tuple[Any, Any]:
    """A client app and a worker of two children whose caches hold one model each."""
    config_path = write_config(tmp_path / "sits.toml")
    app = client_app(redis_url, config_path, f"{name}-client")
    one_model = str(int((models_dir / "gpt" / "model.safetensors").stat().st_size * 1.5))
    worker = spawn_worker(redis_url, config_path, models_dir, tmp_path, {
        "SITS_DEVICE_CACHE_BYTES": one_model, "SITS_HOST_CACHE_BYTES": one_model},
        concurrency=2, name=name)
    return app, worker


def test_each_task_goes_to_the_child_holding_its_model(
        tmp_path: Path, redis_url: str, models_dir: Path, redis_client: redis.Redis) -> None:
    redis_client.flushall()  # earlier modules may leave messages in the celery queue
    app, worker = one_model_worker(tmp_path, redis_url, models_dir, "steer")
    describe = app.tasks["t.describe"]
    try:
        wait_ready(app, [worker])
        # Given one child that loaded gpt and the other lm-a
        home = two_homes(app, redis_client)
        assert home["gpt"] != home["lm-a"], worker.log()[-3000:]
        # When tasks of the two models take turns, each sent once the last is done (both
        # children idle at every dispatch)
        runs: list[dict[str, Any]] = []
        for n in range(6):
            model = ("gpt", "lm-a")[n % 2]
            settled(redis_client)
            result = describe.apply_async((f"t{n}",), model=model).get(timeout=CALL_S)
            runs.append({"model": model, "pid": result["output"]["pid"],
                         "cold": result["sits"]["cold"]})
    finally:
        worker.stop(timeout_s=20)
        app.close()
    # Then each ran on the child that held its model, warm
    assert [r["pid"] for r in runs] == [home[r["model"]] for r in runs], runs
    assert not any(r["cold"] for r in runs), runs


def test_a_burst_of_both_models_runs_warm(
        tmp_path: Path, redis_url: str, models_dir: Path, redis_client: redis.Redis) -> None:
    """(the worker takes several messages in one turn of its loop and writes them to the
    children on a later one: each pick weighed every idle child, so a burst took two gpt
    tasks for the two idle children, and the one holding lm-a loaded gpt cold, evicting
    lm-a, while lm-a tasks waited)"""
    redis_client.flushall()
    app, worker = one_model_worker(tmp_path, redis_url, models_dir, "burst")
    lengths = app.tasks["t.lengths"]  # (each run pauses SHARD_PAUSE_S: children in step)
    runs: list[dict[str, Any]] = []
    try:
        wait_ready(app, [worker])
        # Given one child that holds gpt, the other lm-a
        home = two_homes(app, redis_client)
        assert home["gpt"] != home["lm-a"], worker.log()[-3000:]
        # When bursts of two gpt tasks then two lm-a ones arrive at once (sent while the
        # worker's main process is stopped)
        for burst in range(3):
            settled(redis_client)
            os.kill(worker.popen.pid, signal.SIGSTOP)
            try:  # (each in Redis once apply_async returns)
                sent = [(model, lengths.apply_async(([f"b{burst}"],), model=model))
                        for model in ("gpt", "gpt", "lm-a", "lm-a")]
            finally:
                os.kill(worker.popen.pid, signal.SIGCONT)
            runs += [{"model": model, "cold": result.get(timeout=CALL_S)["sits"]["cold"]}
                     for model, result in sent]
    finally:
        worker.stop(timeout_s=20)
        app.close()
    # Then every one ran warm (on the child that holds its model)
    assert not any(r["cold"] for r in runs), runs
    assert "Traceback" not in worker.log(), worker.log()[-3000:]
