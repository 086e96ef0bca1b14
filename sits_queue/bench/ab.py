"""``sitsq bench ab``: one seeded mixed workload through stock Celery (FIFO), stock
Celery's Redis priority emulation, and SITS, on the same Redis and worker concurrency.

A program, not a test: it prints a table and JSON, and asserts nothing about timings.

``sits`` runs each job's simulated inference in 5 ms steps with a ``yield_point()``
between them, as a SITS task for long work is written (the built-in ``sits.generate``
yields between decode steps): a long low task gives its slot to a high one instead of
finishing first (time slices, workers/slices.py). The total work per job is the same as
in the Celery systems, whose tasks have no way to step aside. Waits count until a task
*first* starts. ``sits_run_to_completion`` is SITS with the job in one piece, as the
Celery tasks run it: the broker's ordering alone.

It also simulates the same arrivals through an ideal strict-priority scheduler that
runs tasks to completion with zero overhead (``ideal_nonpreemptive``): the floor of the
high class's waits for any broker whose workers never idle while work waits. On this
workload that floor's p99 is about stock priority's, so a high p99 of half stock
priority's is out of reach without preemption, which is what the time slices add.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

from sits_queue.bench.ab_apps import DATABASES, SYSTEMS, build, done_key, submit, system_url
from sits_queue.bench.report import ratio, redis_server, run_main, targets_line
from sits_queue.bench.workload import (
    Completion,
    Workload,
    ideal_priority_schedule,
    mixed_workload,
    summarise,
)
from sits_queue.config import SitsConfig
from sits_queue.priority.model import starvation_bound_s
from sits_queue.procs import CeleryProcess, start_beat, start_worker, wait_ready

CLASSES = ("high", "medium", "low")
#: A run that has not drained this long after its last arrival is reported as incomplete.
DRAIN_TIMEOUT_S = 120.0
QUICK = {"n_jobs": 600, "concurrency": 4}
#: The SITS systems and the suffix of their ratio names.
SITS_VARIANTS = (("sits", ""), ("sits_run_to_completion", "_run_to_completion"))
FULL = {"n_jobs": 3000, "concurrency": 4}


def run_system(system: str, workload: Workload, url: str, log_dir: Path,
               on_progress: Callable[[str], None] = print, flush: bool = True,
               prefix: str = "") -> dict[str, Any]:
    """Run one system on the Redis database ``url`` (flushed first when ``flush``), its
    keys under ``prefix`` (without ``flush``, what an earlier run left under a non-empty
    prefix is deleted first: queued jobs of an interrupted run would count as this one's)."""
    client = redis.Redis.from_url(url)
    done = done_key(prefix)
    if flush:
        client.flushdb()
    else:
        client.delete(done)
        if prefix:
            _delete_under(client, prefix)
    app = build(system, url, prefix)
    env = {"SITS_BENCH_SYSTEM": system, "SITS_BENCH_REDIS_URL": url, "SITS_REDIS_URL": url,
           "SITS_BENCH_PREFIX": prefix}
    procs: list[CeleryProcess] = [start_worker("sits_queue.bench.ab_apps", env, log_dir,
                                               concurrency=workload.concurrency)]
    try:
        if system.startswith("sits"):
            procs.append(start_beat("sits_queue.bench.ab_apps", env, log_dir))
        wait_ready(app, procs[:1])
        on_progress(f"  {system}: submitting {len(workload.jobs)} jobs over "
                    f"{workload.duration_s:.1f} s")
        _replay(app, system, workload)
        _await_drain(client, done, len(workload.jobs), procs[0])
    finally:
        # the beat first: a pass it sends after the worker stopped would wait in the
        # control queue (and in `sitsq status`) until the next worker
        for proc in reversed(procs):
            proc.stop()
        app.close()
    records = [json.loads(raw) for raw in client.lrange(done, 0, -1)]
    completions = [Completion(d["c"], d["wait_ms"], d["sub"], d["fin"]) for d in records]
    summary = summarise(completions, CLASSES)
    summary["completed"] = len(completions)
    return summary


def _delete_under(client: redis.Redis, prefix: str) -> None:
    """Every key under ``prefix`` (glob characters in it taken literally)."""
    pattern = "".join(f"[{c}]" if c in "*?[]\\" else c for c in prefix) + "*"
    batch: list[Any] = []
    for key in client.scan_iter(match=pattern, count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            client.delete(*batch)
            batch = []
    if batch:
        client.delete(*batch)


def _replay(app: Any, system: str, workload: Workload) -> None:
    """Submit each job at its arrival time (this pacing is the load generator)."""
    with app.producer_or_acquire() as producer:
        start = time.monotonic()
        for job in workload.jobs:
            delay = start + job.arrival_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            submit(app, system, job.sla_class, job.service_ms, job.context_tokens, producer)


def _await_drain(client: redis.Redis, done: str, n: int, worker: CeleryProcess) -> None:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while client.llen(done) < n and time.monotonic() < deadline:
        if not worker.alive():
            raise RuntimeError(f"worker died:\n{worker.log()[-3000:]}")
        time.sleep(0.2)


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    def p99(name: str) -> float:
        return float(systems[name]["high"]["p99_wait_ms"])

    out: dict[str, float | None] = {}
    for name, suffix in SITS_VARIANTS:
        if name in systems:
            out[f"high_p99_vs_fifo{suffix}"] = ratio(p99(name), p99("celery_fifo"))
            out[f"high_p99_vs_priority{suffix}"] = ratio(p99(name), p99("celery_priority"))
            out[f"throughput_vs_fifo{suffix}"] = ratio(systems[name]["throughput_tps"],
                                                    systems["celery_fifo"]["throughput_tps"])
    return out


def run(quick: bool = False, redis_url: str | None = None, seed: int = 7,
        on_progress: Callable[[str], None] = print, shape: dict[str, int] | None = None
        ) -> dict[str, Any]:
    shape = shape or (QUICK if quick else FULL)
    workload = mixed_workload(seed, shape["n_jobs"], shape["concurrency"])
    with tempfile.TemporaryDirectory(prefix="sits-bench-ab-") as tmp, \
            redis_server(redis_url, len(DATABASES)) as url:
        systems = {name: run_system(name, workload, system_url(url, name),
                                    Path(tmp) / name, on_progress) for name in SYSTEMS}
    bound_s = starvation_bound_s(SitsConfig())
    # The floor: the same arrivals through an ideal strict-priority, run-to-completion
    # scheduler with zero overhead (simulated). No real broker's high p99 is expected
    # below it except by the chance of how a run's timings fall.
    ideal = summarise(ideal_priority_schedule(workload, CLASSES), CLASSES)
    ideal_high = float(ideal["high"]["p99_wait_ms"])  # type: ignore[index]
    stock_high = float(systems["celery_priority"]["high"]["p99_wait_ms"])
    result = {
        "systems": systems,
        "ratios": ratios(systems),
        "ideal_nonpreemptive": {
            **ideal,
            "high_p99_vs_priority": round(ideal_high / stock_high, 3) if stock_high else None,
        },
        "low_max_wait_s": round(float(systems["sits"]["low"]["max_wait_ms"]) / 1000, 2),
        "aging_bound_s": round(bound_s, 1),
        "workload": {"seed": seed, "jobs": len(workload.jobs), "concurrency":
                     workload.concurrency, "load_factor": workload.load_factor,
                     "arrival_span_s": round(workload.duration_s, 2)},
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "python": platform.python_version(), "cpus": os.cpu_count(),
                 "quick": quick},
    }
    r = result["ratios"]
    assert isinstance(r, dict)
    result["targets"] = {}
    for name, suffix in SITS_VARIANTS:
        low_max_s = float(systems[name]["low"]["max_wait_ms"]) / 1000
        result["targets"].update({  # type: ignore[attr-defined]
            f"{name}: high_p99_vs_fifo<=0.10": _at_most(r[f"high_p99_vs_fifo{suffix}"], 0.10),
            f"{name}: high_p99_vs_priority<=0.5":
                _at_most(r[f"high_p99_vs_priority{suffix}"], 0.5),
            f"{name}: throughput_vs_fifo>=0.95":
                r[f"throughput_vs_fifo{suffix}"] is not None
                and r[f"throughput_vs_fifo{suffix}"] >= 0.95,
            f"{name}: low_max_wait<=aging_bound": low_max_s <= bound_s,
        })
    return result


def _at_most(value: float | None, bound: float) -> bool:
    return value is not None and value <= bound


def table(result: dict[str, Any]) -> str:
    lines = [f"{'system':<24}{'class':<8}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}"
             f"{'tput/s':>9}"]
    for name, s in result["systems"].items():
        for cls in CLASSES:
            c = s[cls]
            lines.append(f"{name:<24}{cls:<8}{c['n']:>6}{c['p50_wait_ms']:>10.1f}"
                         f"{c['p99_wait_ms']:>10.1f}{c['max_wait_ms']:>10.1f}"
                         f"{s['throughput_tps'] if cls == 'high' else '':>9}")
    ideal = result["ideal_nonpreemptive"]
    lines.append(f"{'ideal (sim)':<24}{'high':<8}{ideal['high']['n']:>6}"
                 f"{ideal['high']['p50_wait_ms']:>10.1f}{ideal['high']['p99_wait_ms']:>10.1f}"
                 f"{ideal['high']['max_wait_ms']:>10.1f}{ideal['throughput_tps']:>9}")
    lines.append("ratios: " + ", ".join(f"{k}={v}" for k, v in result["ratios"].items()))
    lines.append(f"ideal non-preemptive schedule of the same arrivals: high p99 = "
                 f"{ideal['high_p99_vs_priority']} x stock priority's")
    lines.append(f"low max wait {result['low_max_wait_s']} s (aging bound "
                 f"{result['aging_bound_s']} s)")
    lines.append(targets_line(result["targets"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_main("python -m sits_queue.bench.ab", __doc__, run, table, argv, progress=True)


if __name__ == "__main__":
    sys.exit(main())
