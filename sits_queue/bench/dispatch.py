"""``sitsq bench dispatch``: what a task costs to get through a worker, beside its work.

One worker (prefork, concurrency 1, Celery's default log level, WARNING) per system
(``dispatch_apps.py``): stock Celery with
its defaults, stock Celery set up with SITS's guarantees (late acks, prefetch 1, events,
STARTED), and SITS; the same no-op task everywhere, so the task's own work is nil and
everything measured is the queue's:

* ``burst``: N tasks enqueued with no worker running, then the worker started: tasks/s
  from the first result to the last (the ``date_done`` Celery stores with each result, so
  the measurement adds no Redis call per task, and reads each result about once), and
  the worker's CPU time per task
  (parent and pool child, psutil, over the same span as far as a 50 ms poll sees it;
  null in a round whose burst ended too soon after the first poll to time);
* ``idle``: then, with the queue empty, single tasks one after another: ``delay()`` to
  ``get()``, p50/p99 ms (waking an idle worker, dispatch, result).

Systems alternate over rounds (the median is reported) so that drift of a shared machine
falls on all of them. A program, not a test: it prints a table and JSON and asserts
nothing about timings. Without ``--redis-url`` it starts a private ``redis-server``.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import redis
from celery import Celery

from sits_queue.bench.dispatch_apps import ENV_SYSTEM, ENV_URL, SYSTEMS, TASK, build
from sits_queue.bench.report import database_url, ratio, redis_server, run_main, targets_line
from sits_queue.bench.workload import percentile
from sits_queue.procs import CeleryProcess, start_worker, wait_ready

#: One database per system, so the runs cannot see each other's keys.
DATABASES = {"celery_default": 0, "celery_guarantees": 1, "sits": 2}
#: SITS against stock Celery given the same guarantees: it must not cost throughput.
#: (Against stock Celery's defaults there is no target: they guarantee less, acking a
#: task as it starts and prefetching past the priority order, and send no events.)
TARGET_VS_GUARANTEES = 1.0
POLL_S = 0.05
#: Results read per poll: the oldest tasks not yet done. Tasks of one class run in
#: submission order, so that is where results appear; reading every result on every
#: poll would cost this process a share of the 2 cores the measured worker runs on.
POLL_WINDOW = 256
BURST_TIMEOUT_S = 300.0
#: Tasks that must finish after the first poll that saw one done for CPU time per task
#: to mean anything: a burst over before a poll comes round leaves none, and psutil's
#: CPU times move in clock ticks (10 ms), so a handful of 1 ms tasks reads as nothing.
MIN_CPU_TASKS = 20


@dataclass(frozen=True)
class Shape:
    burst: int  # tasks per burst
    idle: int  # single tasks timed on an idle worker
    rounds: int  # alternating rounds per system


FULL = Shape(burst=2000, idle=100, rounds=5)
QUICK = Shape(burst=500, idle=20, rounds=1)


# -- statistics (pure) ---------------------------------------------------------------------

def burst_rate(done_at: Sequence[float]) -> float:
    """Tasks/s from the first result to the last (``n - 1`` intervals)."""
    if len(done_at) < 2:
        return 0.0
    span = max(done_at) - min(done_at)
    return round((len(done_at) - 1) / span, 1) if span > 0 else 0.0


def _median(values: Sequence[float | None]) -> float | None:
    measured = [v for v in values if v is not None]
    return round(statistics.median(measured), 3) if measured else None


def summarise(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One system's figures: the median over its rounds of each (of the rounds that
    measured it: CPU time is None in a round whose burst was too short to time)."""
    keys = ("tasks_per_s", "cpu_ms_per_task", "parent_cpu_ms_per_task",
            "child_cpu_ms_per_task", "idle_p50_ms", "idle_p99_ms")
    out: dict[str, Any] = {k: _median([r[k] for r in rounds]) for k in keys}
    out["rounds"] = [dict(r) for r in rounds]
    return out


def cpu_per_task(first: tuple[float, float], last: tuple[float, float],
                 tasks: int) -> tuple[float, float] | None:
    """(parent, child) CPU ms per task between two readings ``tasks`` apart; None when
    too few tasks ran between them to measure (see ``MIN_CPU_TASKS``)."""
    if tasks < MIN_CPU_TASKS:
        return None
    return ((last[0] - first[0]) * 1000 / tasks, (last[1] - first[1]) * 1000 / tasks)


def ratios(systems: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    s, g, d = systems["sits"], systems["celery_guarantees"], systems["celery_default"]
    return {
        "throughput_vs_same_guarantees": ratio(s["tasks_per_s"], g["tasks_per_s"]),
        "throughput_vs_stock_defaults": ratio(s["tasks_per_s"], d["tasks_per_s"]),
        "cpu_per_task_vs_same_guarantees": ratio(s["cpu_ms_per_task"], g["cpu_ms_per_task"]),
        "idle_p50_vs_stock_defaults": ratio(s["idle_p50_ms"], d["idle_p50_ms"]),
    }


def targets(r: Mapping[str, float | None]) -> dict[str, bool]:
    def at_least(name: str, bound: float) -> bool:
        value = r[name]
        return value is not None and value >= bound

    return {"throughput_vs_same_guarantees": at_least("throughput_vs_same_guarantees",
                                                       TARGET_VS_GUARANTEES)}


# -- one round of one system ---------------------------------------------------------------

def _cpu_s(worker: CeleryProcess) -> tuple[float, float]:
    """(parent, children) CPU seconds of a worker so far."""
    parent = psutil.Process(worker.pid)
    times = parent.cpu_times()
    children = 0.0
    for child in parent.children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        children += t.user + t.system
    return times.user + times.system, children


def _done_at(app: Celery, ids: Sequence[str]) -> list[float | None]:
    """When each task's result was stored (unix s), None while it has none."""
    backend = app.backend
    raw = backend.client.mget([backend.get_key_for_task(i) for i in ids])
    out: list[float | None] = []
    for value in raw:
        meta = backend.decode_result(value) if value else None
        if meta is None or meta.get("status") != "SUCCESS" or not meta.get("date_done"):
            out.append(None)
            continue
        done = meta["date_done"]
        stamp = datetime.fromisoformat(done) if isinstance(done, str) else done
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=timezone.utc)
        out.append(stamp.timestamp())
    return out


def one_round(system: str, url: str, shape: Shape, log_dir: Path) -> dict[str, Any]:
    """Enqueue a burst, start the worker, time it through; then the idle probe."""
    client = redis.Redis.from_url(url)
    client.flushdb()
    app = build(system, url)
    task = app.tasks[TASK]
    worker: CeleryProcess | None = None
    try:
        with app.producer_or_acquire() as producer:
            ids = [task.apply_async((i,), producer=producer).id for i in range(shape.burst)]
        env = {**os.environ, ENV_SYSTEM: system, ENV_URL: url}
        # Celery's default log level: at INFO every task writes two lines, a cost of its
        # own that would blur the queue's.
        worker = start_worker("sits_queue.bench.dispatch_apps", env, log_dir, concurrency=1,
                              hostname=f"{system}@%h", extra_args=["--loglevel=WARNING"])
        deadline = time.monotonic() + BURST_TIMEOUT_S
        first_cpu: tuple[float, float] | None = None
        first_count = 0
        pending, done = list(ids), []  # not done yet in submission order; when done
        while True:
            window = pending[:POLL_WINDOW]
            stamps = _done_at(app, window)
            done += [d for d in stamps if d is not None]
            pending = [i for i, d in zip(window, stamps, strict=True) if d is None] \
                + pending[len(window):]
            if first_cpu is None and done:
                first_cpu, first_count = _cpu_s(worker), len(done)
            if not pending:
                break
            if not worker.alive():
                raise RuntimeError(f"{system}'s worker died:\n{worker.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{system}: {len(done)} of {len(ids)} done after "
                                   f"{BURST_TIMEOUT_S:.0f} s:\n{worker.log()[-2000:]}")
            time.sleep(POLL_S)
        last_cpu = _cpu_s(worker)
        assert first_cpu is not None
        cpu = cpu_per_task(first_cpu, last_cpu, len(ids) - first_count)
        wait_ready(app, [worker])
        task.delay(-1).get(timeout=30)  # the client's result subscription, not timed
        latencies = []
        for i in range(shape.idle):
            start = time.perf_counter()
            task.delay(i).get(timeout=30)
            latencies.append((time.perf_counter() - start) * 1000)
        return {"tasks_per_s": burst_rate(done),
                "cpu_ms_per_task": None if cpu is None else round(cpu[0] + cpu[1], 3),
                "parent_cpu_ms_per_task": None if cpu is None else round(cpu[0], 3),
                "child_cpu_ms_per_task": None if cpu is None else round(cpu[1], 3),
                "idle_p50_ms": round(percentile(latencies, 50), 2),
                "idle_p99_ms": round(percentile(latencies, 99), 2)}
    finally:
        if worker is not None:
            worker.stop()
        app.close()
        client.flushdb()
        client.close()


# -- the program -----------------------------------------------------------------------------

def run(quick: bool = False, redis_url: str | None = None, *, shape: Shape | None = None,
        on_progress: Callable[[str], None] = print) -> dict[str, Any]:
    shape = shape or (QUICK if quick else FULL)
    load_before = os.getloadavg()[0]
    per_system: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    with redis_server(redis_url, len(DATABASES)) as base, \
            tempfile.TemporaryDirectory(prefix="sits-dispatch-") as tmp:
        for n in range(shape.rounds):
            order = SYSTEMS[n % len(SYSTEMS):] + SYSTEMS[:n % len(SYSTEMS)]
            for system in order:
                on_progress(f"round {n + 1}/{shape.rounds}: {system}, {shape.burst} tasks")
                per_system[system].append(one_round(
                    system, database_url(base, DATABASES[system]), shape, Path(tmp)))
        version = str(redis.Redis.from_url(base).info("server").get("redis_version", "?"))
    systems = {s: summarise(rounds) for s, rounds in per_system.items()}
    r = ratios(systems)
    return {"systems": systems, "ratios": r, "targets": targets(r),
            "meta": {"shape": asdict(shape), "quick": quick, "redis_version": version,
                     "python": platform.python_version(), "cpus": os.cpu_count(),
                     "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "loadavg_1m_before": round(load_before, 2),
                     "loadavg_1m_after": round(os.getloadavg()[0], 2)}}


def table(result: Mapping[str, Any]) -> str:
    lines = [f"{'system':<20}{'tasks/s':>9}{'cpu ms/task':>13}{'parent':>8}{'child':>8}"
             f"{'idle p50 ms':>13}{'idle p99 ms':>13}"]
    def ms(value: float | None, width: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.3f}"

    for name, s in result["systems"].items():
        lines.append(f"{name:<20}{s['tasks_per_s']:>9.1f}{ms(s['cpu_ms_per_task'], 13)}"
                     f"{ms(s['parent_cpu_ms_per_task'], 8)}{ms(s['child_cpu_ms_per_task'], 8)}"
                     f"{s['idle_p50_ms']:>13.2f}{s['idle_p99_ms']:>13.2f}")
    lines.append("ratios: " + ", ".join(f"{k} {v}" for k, v in result["ratios"].items()))
    lines.append(targets_line(result["targets"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_main("sitsq bench dispatch", __doc__, run, table, argv, progress=True)


if __name__ == "__main__":
    sys.exit(main())
