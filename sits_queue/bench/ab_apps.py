"""The systems of ``sitsq bench ab``, as Celery apps workers load with ``-A``.

``SITS_BENCH_SYSTEM`` picks one (:data:`SYSTEMS`) and
``SITS_BENCH_REDIS_URL`` its Redis database; the A/B benchmark gives each system its own
database (:func:`system_url`) so the runs cannot see each other's keys.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from sits_queue.app import make_app
from sits_queue.bench.report import database_url
from sits_queue.config import SitsConfig

SYSTEMS = ("celery_fifo", "celery_priority", "sits", "sits_run_to_completion")
DATABASES = {"celery_fifo": 0, "celery_priority": 1, "sits": 2, "sits_run_to_completion": 3}
SITS_SYSTEMS = ("sits", "sits_run_to_completion")
#: ``sits`` runs the service time in steps this long with a yield point between steps,
#: as a SITS task for long work is written (``sits.generate`` yields between decode
#: steps); ``sits_run_to_completion`` runs it in one piece, as the Celery tasks do, ms.
STEP_MS = 5.0
#: Stock Celery's Redis priorities: 0 is served first (kombu BRPOPs buckets in order).
STOCK_PRIORITY = {"high": 0, "medium": 5, "low": 9}
DONE_KEY = "bench:done"
TASK_NAME = "bench.work"


def system_url(base_url: str, system: str) -> str:
    return database_url(base_url, DATABASES[system])


def done_key(prefix: str = "") -> str:
    """Where the tasks report, under the run's key prefix (``sitsq demo``'s on a server
    of the user's)."""
    return f"{prefix}{DONE_KEY}"


def build(system: str, url: str, prefix: str = "") -> Celery:
    """``system``'s app on ``url``; ``prefix``: on every key (SITS systems only)."""
    if system in SITS_SYSTEMS:
        app = make_app(SitsConfig(redis_url=url, global_keyprefix=prefix),
                       main=f"bench_{system}")
    elif system == "celery_fifo":
        app = Celery("bench_fifo", broker=url)  # stock defaults, on purpose
    elif system == "celery_priority":
        app = Celery("bench_priority", broker=url)
        # Celery's documented settings for the best priority behaviour on Redis.
        app.conf.update(
            broker_transport_options={"queue_order_strategy": "priority",
                                      "priority_steps": list(range(10)), "sep": ":"},
            worker_prefetch_multiplier=1, task_acks_late=True)
    else:
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
    app.conf.task_ignore_result = True
    if prefix and system not in SITS_SYSTEMS:
        raise ValueError(f"a key prefix is for the SITS systems, not {system!r}")
    if system == "sits":
        _register_sliced(app, url, done_key(prefix))
    else:
        _register(app, url, done_key(prefix))
    return app


def _register(app: Celery, url: str, done: str) -> None:
    clients: dict[int, redis.Redis] = {}

    @app.task(name=TASK_NAME, shared=False)  # type: ignore[untyped-decorator]
    def work(sla_class: str, service_ms: float, submitted_s: float) -> None:
        started = time.time()
        time.sleep(service_ms / 1000)  # the simulated inference
        pid = os.getpid()
        if pid not in clients:
            clients[pid] = redis.Redis.from_url(url)
        clients[pid].rpush(done, json.dumps({
            "c": sla_class, "wait_ms": (started - submitted_s) * 1000, "sub": submitted_s,
            "fin": time.time()}))


def _register_sliced(app: Celery, url: str, done: str) -> None:
    """The same simulated inference, in steps with yield points (SITS time slices)."""
    clients: dict[int, redis.Redis] = {}

    @app.task(name=TASK_NAME, bind=True, shared=False)  # type: ignore[untyped-decorator]
    def work(self: Any, sla_class: str, service_ms: float, submitted_s: float) -> None:
        # The wait that counts is until the task first started; progress survives yields.
        state = self.checkpoint or {"started": time.time(), "left_ms": service_ms}
        while state["left_ms"] > 0:
            # Progress is the time actually spent, so sleep overshoot does not add up
            # over the steps: the task is busy for service_ms in all, as in the others.
            began = time.perf_counter()
            time.sleep(min(STEP_MS, state["left_ms"]) / 1000)
            state["left_ms"] -= (time.perf_counter() - began) * 1000
            if state["left_ms"] > 0:
                self.yield_point(state, remaining_s=state["left_ms"] / 1000)
        pid = os.getpid()
        if pid not in clients:
            clients[pid] = redis.Redis.from_url(url)
        clients[pid].rpush(done, json.dumps({
            "c": sla_class, "wait_ms": (state["started"] - submitted_s) * 1000,
            "sub": submitted_s, "fin": time.time()}))


def submit(app: Celery, system: str, sla_class: str, service_ms: float,
           context_tokens: int, producer: Any) -> None:
    """Send one job the way a user of that system would."""
    args = (sla_class, service_ms, time.time())
    task = app.tasks[TASK_NAME]
    if system in SITS_SYSTEMS:
        task.apply_async(args, sla_class=sla_class, context_tokens=context_tokens,
                         input_entropy=0.5, producer=producer)
    elif system == "celery_priority":
        task.apply_async(args, priority=STOCK_PRIORITY[sla_class], producer=producer)
    else:
        task.apply_async(args, producer=producer)


_system = os.environ.get("SITS_BENCH_SYSTEM")
if _system:
    app = build(_system, os.environ["SITS_BENCH_REDIS_URL"],
                os.environ.get("SITS_BENCH_PREFIX", ""))
