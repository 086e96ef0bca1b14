"""``sitsq demo``: the A/B workload through SITS alone, on the embedded (or given) Redis.

A worker and beat run as real subprocesses; jobs simulate inference with a seeded
service time, run in 5 ms steps with a yield point between them (time slices), as in
the A/B benchmark's ``sits`` system; the table is the same per-class summary it prints.

It runs under a key prefix of its own, :data:`PREFIX`, on the embedded server too (the
user's ``sitsq celery ...`` work lives there): its worker consumed the ``celery`` queue,
and took the user's waiting tasks, dead-lettered as unknown to it. Each run starts by
deleting what an earlier one left under that prefix (one interrupted left its jobs
queued: the next run counted their completions as its own, and served them late).

One demo runs at a time on a Redis (a lock beside the prefix): two at once deleted each
other's keys and counted each other's completions ("completed 134/100", twice). Ended by
SIGTERM or SIGHUP (a closed terminal) it stops its worker and beat as on Ctrl-C: they run
in sessions of their own, and Python's default exit on those signals left them running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import redis

from sits_queue.bench.ab import CLASSES, DRAIN_TIMEOUT_S, run_system
from sits_queue.bench.workload import mixed_workload
from sits_queue.checks import text
from sits_queue.errors import SitsError

#: The key prefix of the demo's keys, whichever server it runs on.
PREFIX = "sits-demo:"
#: The lock's life beyond the workload's own span, s: the worker's start, the drain, the
#: stop. (A demo killed outright holds it that long, unless it ran on this host: then
#: its pid tells.)
LOCK_MARGIN_S = DRAIN_TIMEOUT_S + 120.0


@contextlib.contextmanager
def _one_at_a_time(redis_url: str, prefix: str, span_s: float) -> Iterator[None]:
    client = redis.Redis.from_url(redis_url)
    # (beside the prefix, not under it: each run deletes what is under it first)
    key, me = f"{prefix.rstrip(':')}-lock", f"{socket.gethostname()}:{os.getpid()}"
    ttl_ms = int((span_s + LOCK_MARGIN_S) * 1000)
    if not client.set(key, me, nx=True, px=ttl_ms):
        holder = text(client.get(key) or b"", "replace")
        host, _, pid = holder.rpartition(":")
        if host == socket.gethostname() and pid.isdigit() and not psutil.pid_exists(int(pid)):
            client.set(key, me, px=ttl_ms)  # its demo was killed outright
        else:
            raise SitsError(f"another sitsq demo ({holder or 'its holder unknown'}) runs on "
                            f"this Redis, under {prefix!r}: wait for it to end")
    try:
        yield
    finally:
        with contextlib.suppress(redis.RedisError):
            if client.get(key) == me.encode():
                client.delete(key)
        client.close()


#: Longest the demo's clean-up may take after SIGTERM or SIGHUP before it exits at once,
#: s (its worker and beat then end with it: ``sits_queue/lifeline.py``).
FORCED_EXIT_S = 40.0
#: The clean-up's deadline, armed by the first of those signals.
_deadline: list[threading.Timer] = []


def _forced_exit() -> None:
    os.write(2, b"demo: still stopping after the signal; exiting now (its worker and beat "
                b"end with it)\n")
    os._exit(1)


def _interrupted(signum: int, frame: Any) -> None:
    """The first signal ends the demo as Ctrl-C does, with a deadline on its clean-up (a
    KeyboardInterrupt raised at an arbitrary point can leave a lock of a client library
    held, and the clean-up waiting on it: a demo sent SIGHUP once outlived the minute a
    test gave it); a second one exits at once."""
    if _deadline:
        _forced_exit()
        return
    timer = threading.Timer(FORCED_EXIT_S, _forced_exit)
    timer.daemon = True
    _deadline.append(timer)
    timer.start()
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _stopped_as_on_ctrl_c() -> Iterator[None]:
    """SIGTERM and SIGHUP end the demo as Ctrl-C does, its ``finally`` blocks run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, _interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        while _deadline:  # (cleaned up in time: a caller that goes on is not ended)
            _deadline.pop().cancel()


def run_demo(redis_url: str, jobs: int, concurrency: int, seed: int,
             echo: Callable[[str], None] = print, prefix: str = "") -> dict[str, object]:
    """The demo on ``redis_url``, every key of it under ``prefix``."""
    workload = mixed_workload(seed, jobs, concurrency)
    # (said once it is this demo's turn: a second one is refused in one line, without
    # saying first that it deletes what the running one has there)
    with _one_at_a_time(redis_url, prefix, workload.duration_s), _stopped_as_on_ctrl_c(), \
            tempfile.TemporaryDirectory(prefix="sits-demo-") as tmp:
        echo(f"demo: {jobs} jobs (10% high, 20% medium, 70% low) arriving at 1.5x what "
             f"{concurrency} worker slots can serve, over {workload.duration_s:.1f} s")
        if prefix:
            echo(f"demo: its keys are under {prefix!r}, apart from any queue of yours "
                 f"there (watch it with SITS_GLOBAL_KEYPREFIX={prefix} sitsq status); what "
                 "an earlier demo left there is deleted")
        # Nothing flushed: `sitsq status` sees the same queues while it runs.
        summary = run_system("sits", workload, redis_url, Path(tmp), echo, flush=False,
                             prefix=prefix)
    echo(f"{'class':<8}{'n':>6}{'wait p50 ms':>13}{'wait p99 ms':>13}{'max ms':>10}")
    for cls in CLASSES:
        c = summary[cls]
        assert isinstance(c, dict)
        if not c["n"]:  # (no job of the class: no wait measured, not one of 0 ms)
            echo(f"{cls:<8}{0:>6}{'-':>13}{'-':>13}{'-':>10}")
            continue
        echo(f"{cls:<8}{c['n']:>6}{c['p50_wait_ms']:>13.1f}{c['p99_wait_ms']:>13.1f}"
             f"{c['max_wait_ms']:>10.1f}")
    echo(f"throughput: {summary['throughput_tps']} tasks/s, completed "
         f"{summary['completed']}/{jobs}")
    return summary
