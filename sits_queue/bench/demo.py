"""``sitsq demo``: the A/B workload through SITS alone, on the embedded (or given) Redis.

A worker and beat run as real subprocesses; jobs simulate inference with a seeded
service time, run in 5 ms steps with a yield point between them (time slices), as in
the A/B benchmark's ``sits`` system; the table is the same per-class summary it prints.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from sits_queue.bench.ab import CLASSES, run_system
from sits_queue.bench.workload import mixed_workload


def run_demo(redis_url: str, jobs: int, concurrency: int, seed: int,
             echo: Callable[[str], None] = print) -> dict[str, object]:
    workload = mixed_workload(seed, jobs, concurrency)
    echo(f"demo: {jobs} jobs (10% high, 20% medium, 70% low) arriving at 1.5x what "
         f"{concurrency} worker slots can serve, over {workload.duration_s:.1f} s")
    with tempfile.TemporaryDirectory(prefix="sits-demo-") as tmp:
        # The user's database: keep what is there, so `sitsq status` sees the same queues.
        summary = run_system("sits", workload, redis_url, Path(tmp), echo, flush=False)
    echo(f"{'class':<8}{'n':>6}{'wait p50 ms':>13}{'wait p99 ms':>13}{'max ms':>10}")
    for cls in CLASSES:
        c = summary[cls]
        assert isinstance(c, dict)
        echo(f"{cls:<8}{c['n']:>6}{c['p50_wait_ms']:>13.1f}{c['p99_wait_ms']:>13.1f}"
             f"{c['max_wait_ms']:>10.1f}")
    echo(f"throughput: {summary['throughput_tps']} tasks/s, completed "
         f"{summary['completed']}/{jobs}")
    return summary
