"""``sitsq demo``: the A/B workload through SITS alone, on the embedded (or given) Redis.

A worker and beat run as real subprocesses; jobs simulate inference with a seeded
service time, run in 5 ms steps with a yield point between them (time slices), as in
the A/B benchmark's ``sits`` system; the table is the same per-class summary it prints.

It runs under a key prefix of its own, :data:`PREFIX`, on the embedded server too (the
user's ``sitsq celery ...`` work lives there): its worker consumed the ``celery`` queue,
and took the user's waiting tasks, dead-lettered as unknown to it. Each run starts by
deleting what an earlier one left under that prefix (one interrupted left its jobs
queued: the next run counted their completions as its own, and served them late).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from sits_queue.bench.ab import CLASSES, run_system
from sits_queue.bench.workload import mixed_workload

#: The key prefix of the demo's keys, whichever server it runs on.
PREFIX = "sits-demo:"


def run_demo(redis_url: str, jobs: int, concurrency: int, seed: int,
             echo: Callable[[str], None] = print, prefix: str = "") -> dict[str, object]:
    """The demo on ``redis_url``, every key of it under ``prefix``."""
    workload = mixed_workload(seed, jobs, concurrency)
    echo(f"demo: {jobs} jobs (10% high, 20% medium, 70% low) arriving at 1.5x what "
         f"{concurrency} worker slots can serve, over {workload.duration_s:.1f} s")
    if prefix:
        echo(f"demo: its keys are under {prefix!r}, apart from any queue of yours there "
             f"(watch it with SITS_GLOBAL_KEYPREFIX={prefix} sitsq status); what an "
             "earlier demo left there is deleted")
    with tempfile.TemporaryDirectory(prefix="sits-demo-") as tmp:
        # Nothing flushed: `sitsq status` sees the same queues while it runs.
        summary = run_system("sits", workload, redis_url, Path(tmp), echo, flush=False,
                             prefix=prefix)
    echo(f"{'class':<8}{'n':>6}{'wait p50 ms':>13}{'wait p99 ms':>13}{'max ms':>10}")
    for cls in CLASSES:
        c = summary[cls]
        assert isinstance(c, dict)
        echo(f"{cls:<8}{c['n']:>6}{c['p50_wait_ms']:>13.1f}{c['p99_wait_ms']:>13.1f}"
             f"{c['max_wait_ms']:>10.1f}")
    echo(f"throughput: {summary['throughput_tps']} tasks/s, completed "
         f"{summary['completed']}/{jobs}")
    return summary
