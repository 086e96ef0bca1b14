"""The host shadow pool ages by time in a real worker (§4.3): an engine demoted to host
memory and left unused past ``SITS_HOST_POOL_TTL_S`` is released, the worker says so in
its advertisement, and the next task loads it from disk again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis
from celery import Celery

from sits_queue.workers.advertise import read_workers
from tests.integration.inference_app import FIRST_CALL_S, call, serving
from tests.waiting import wait_for

TTL_S = 3.0


def test_an_engine_unused_in_the_host_pool_past_its_ttl_is_released(
        tmp_path: Path, redis_url: str, config_path: Path, models_dir: Path, app: Celery,
        r: redis.Redis) -> None:
    one_model = str(int((models_dir / "gpt" / "model.safetensors").stat().st_size * 1.5))
    with serving(redis_url, config_path, models_dir, tmp_path, app, {
            "SITS_DEVICE_CACHE_BYTES": one_model, "SITS_HOST_CACHE_BYTES": one_model,
            "SITS_HOST_POOL_TTL_S": str(TTL_S)}, concurrency=1, name="aging") as worker:

        def warm() -> dict[str, Any]:
            found = [w for w in read_workers(r) if w["hostname"] == worker.hostname]
            return dict(found[0]["children"]["0"]["warm"]) if found else {}

        def use(model: str) -> dict[str, Any]:
            meta: dict[str, Any] = call(app, "t.describe", model, model=model,
                                        timeout=FIRST_CALL_S)["sits"]
            return meta

        # Given lm-a demoted to the host pool by lm-b
        assert use("lm-a")["source"] == "disk"
        assert "lm-a" in use("lm-b")["demoted"]
        assert warm() == {"lm-a": "host", "lm-b": "device"}
        # When the worker sits idle past the TTL, then lm-a leaves the host pool (the
        # device tier is not aged) and the worker's advertisement says so
        wait_for(lambda: warm() == {"lm-b": "device"}, TTL_S + 15,
                 "lm-a to leave the host pool")
        # and lm-a comes from disk again
        again = use("lm-a")
        assert again["source"] == "disk" and again["load_ms"] > 0
        assert "host pool released lm-a" in worker.log()
        assert worker.alive()
