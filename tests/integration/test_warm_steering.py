"""A worker of several children hands each inference task to the child that holds its
engine warm (``workers/steer.py``), in a real ``celery worker`` with tiny real models.

(The prefork pool wrote each task to the first idle child in its own order: tasks of two
models taking turns on a two-child worker, each child's device tier holding one model,
all went to one child, each a cold start, while the other child held the other model
warm and sat idle.)
"""

from __future__ import annotations

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


def test_each_task_goes_to_the_child_holding_its_model(
        tmp_path: Path, redis_url: str, models_dir: Path, redis_client: redis.Redis) -> None:
    redis_client.flushall()  # earlier modules may leave messages in the celery queue
    config_path = write_config(tmp_path / "sits.toml")
    app = client_app(redis_url, config_path, "steer-client")
    one_model = str(int((models_dir / "gpt" / "model.safetensors").stat().st_size * 1.5))
    worker = spawn_worker(redis_url, config_path, models_dir, tmp_path, {
        "SITS_DEVICE_CACHE_BYTES": one_model, "SITS_HOST_CACHE_BYTES": one_model},
        concurrency=2, name="steer")
    describe = app.tasks["t.describe"]

    def settled() -> None:
        # A child stores its result before its main process hears it is done: until the
        # main process has acked, it still counts that child busy (and steers around it)
        wait_for(lambda: redis_client.zcard("sits:{celery}:u") == 0, CALL_S,
                 "the worker to ack what it ran")

    try:
        wait_ready(app, [worker])
        # Given one child that loaded gpt (a task of it holds that child a while) and the
        # other, the only idle one meanwhile, lm-a
        busy = app.tasks["t.hang"].apply_async((2.0,))
        wait_for(lambda: redis_client.zcard("sits:{celery}:u") == 1, FIRST_CALL_S,
                 "the gpt task to start")
        home = {"lm-a": describe.apply_async(("a",), model="lm-a").get(
            timeout=FIRST_CALL_S)["output"]["pid"]}
        assert busy.get(timeout=FIRST_CALL_S)["output"] == "finished"
        settled()
        home["gpt"] = describe.apply_async(("g",), model="gpt").get(
            timeout=CALL_S)["output"]["pid"]
        assert home["gpt"] != home["lm-a"], worker.log()[-3000:]
        # When tasks of the two models take turns, each sent once the last is done (both
        # children idle at every dispatch)
        runs: list[dict[str, Any]] = []
        for n in range(6):
            model = ("gpt", "lm-a")[n % 2]
            settled()
            result = describe.apply_async((f"t{n}",), model=model).get(timeout=CALL_S)
            runs.append({"model": model, "pid": result["output"]["pid"],
                         "cold": result["sits"]["cold"]})
    finally:
        worker.stop(timeout_s=20)
        app.close()
    # Then each ran on the child that held its model, warm
    assert [r["pid"] for r in runs] == [home[r["model"]] for r in runs], runs
    assert not any(r["cold"] for r in runs), runs
