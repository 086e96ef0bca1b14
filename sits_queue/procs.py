"""Start and stop ``celery worker`` / ``celery beat`` subprocesses (demo, bench, tests).

Each process gets its own session so that stopping it (or SIGKILLing it to simulate a
crashed host) takes its pool children with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from celery import Celery

from sits_queue import lifeline
from sits_queue.workers import cores

#: How long a worker may take to answer its first ping, s (imports + pool start).
READY_TIMEOUT_S = 60.0


@dataclass
class CeleryProcess:
    """One running ``celery`` command."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    hostname: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        """Warm shutdown (SIGTERM): running tasks finish, held messages go back."""
        if not self.alive():
            return
        self._signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group, as if the host died."""
        self._signal(signal.SIGKILL)
        # The kernel always delivers SIGKILL; the bound only guards against a zombie reaper.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)


#: Runs celery with the CPU affinity given in argv[1] (comma-separated): set before the
#: interpreter imports anything, so the worker and every pool child inherit it.
_PINNED = ("import os, runpy, sys; "
           "os.sched_setaffinity(0, [int(c) for c in sys.argv.pop(1).split(',')]); "
           "sys.argv[0] = 'celery'; runpy.run_module('celery', run_name='__main__')")


def celery_command(app_module: str, args: Sequence[str], env: Mapping[str, str],
                   log_path: Path, cwd: Path | None = None,
                   cpus: Sequence[int] | None = None) -> CeleryProcess:
    """``celery -A app_module *args`` in its own session, logging to ``log_path``; on
    ``cpus`` only, if given (as ``taskset`` would, without needing it) and the platform
    can pin (not macOS: there it runs on every core)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    launcher = (["-c", _PINNED, ",".join(map(str, cpus))] if cpus and cores.can_pin()
                else ["-m", "celery"])
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            [sys.executable, *launcher, "-A", app_module, *args],
            # (it ends with this process, should this one be killed outright: lifeline)
            env={**os.environ, **env, lifeline.ENV: str(os.getpid())}, stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
    return CeleryProcess(name=args[0], popen=popen, log_path=log_path)


def start_worker(app_module: str, env: Mapping[str, str], log_dir: Path, *,
                 concurrency: int = 2, queues: str | None = None, pool: str = "prefork",
                 extra_args: Sequence[str] = (), cwd: Path | None = None,
                 hostname: str | None = None, cpus: Sequence[int] | None = None
                 ) -> CeleryProcess:
    hostname = hostname or f"w{uuid.uuid4().hex[:8]}@%h"
    args = ["worker", "--loglevel=INFO", f"--concurrency={concurrency}", f"--pool={pool}",
            f"--hostname={hostname}", "--without-mingle", "--without-gossip", *extra_args]
    if queues:
        args.append(f"--queues={queues}")
    proc = celery_command(app_module, args, env, log_dir / f"{hostname.split('@')[0]}.log", cwd,
                          cpus)
    proc.hostname = hostname.replace("%h", os.uname().nodename)
    return proc


def start_beat(app_module: str, env: Mapping[str, str], log_dir: Path,
               cwd: Path | None = None) -> CeleryProcess:
    return celery_command(app_module, ["beat", "--loglevel=INFO"], env, log_dir / "beat.log",
                          cwd)


def wait_ready(app: Celery, workers: Sequence[CeleryProcess],
               timeout_s: float = READY_TIMEOUT_S) -> None:
    """Block until every worker answers a broadcast ping; raise with its log if one dies."""
    deadline = time.monotonic() + timeout_s
    pending = {w.hostname for w in workers}
    while pending:
        for w in workers:
            if not w.alive():
                raise RuntimeError(f"worker {w.hostname} exited with {w.popen.returncode}:\n"
                                   f"{w.log()[-3000:]}")
        if time.monotonic() > deadline:
            logs = "\n".join(w.log()[-2000:] for w in workers if w.hostname in pending)
            raise TimeoutError(f"workers {sorted(pending)} not ready after {timeout_s:.0f} s:\n"
                               f"{logs}")
        for reply in app.control.ping(timeout=0.5) or []:
            pending -= set(reply)
