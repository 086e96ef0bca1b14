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
from collections.abc import Iterator, Mapping, Sequence
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
        """SIGTERM to the process group, as a service manager stops one: the main process
        shuts down warm and gives its held messages back; the pool children get it too,
        so a task still running is cut short and requeued, as for a lost child (signal
        the main process alone for running tasks to finish)."""
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


#: How long the workers may take to answer a remote-control command, s: a call returns as
#: soon as every one has (a loaded host's workers can be slow to answer).
CONTROL_TIMEOUT_S = READY_TIMEOUT_S
#: Longest one question to the workers waits for their replies, s (then asked again).
ASK_S = 5.0


@dataclass
class Hold:
    """An :func:`intake_held` block: when its workers were told to consume again."""

    #: Unix s, set as the block ends; what it submitted all arrived then, at once.
    released_s: float | None = None

    def arrived(self, submitted_s: float) -> float:
        """When a task submitted at ``submitted_s`` in the block reached the workers."""
        if self.released_s is None:
            raise RuntimeError("the hold is not released yet")
        return max(submitted_s, self.released_s)


@contextlib.contextmanager
def intake_held(app: Celery, workers: Sequence[CeleryProcess], queue: str | None = None,
                timeout_s: float = CONTROL_TIMEOUT_S) -> Iterator[Hold]:
    """The ``workers`` take nothing from ``queue`` (default: the app's default queue) while
    the block runs, and consume it again after: what the block submits there is all
    waiting before any of it is taken (a backlog, as "submitted at once" promises: a
    producer slower than the workers, as on a loaded host, fed them one task at a time,
    and a worker choosing among the waiting tasks had none to choose from). Celery's own
    remote control: ``cancel_consumer``, then ``add_consumer``. A benchmark times the
    stream from :attr:`Hold.released_s` (its submission is not the workers' time)."""
    queue = queue or app.conf.task_default_queue
    names = [w.hostname for w in workers]
    before = _consumed(app, names, timeout_s)
    if missing := sorted(n for n, qs in before.items() if queue not in qs):
        raise ValueError(f"workers {missing} do not consume {queue!r}")
    app.control.cancel_consumer(queue, destination=names, reply=True, timeout=timeout_s)
    # (a command's reply comes before the worker's loop applies it: wait until it has)
    _await_consumed(app, {n: qs - {queue} for n, qs in before.items()}, timeout_s)
    hold = Hold()
    try:
        yield hold
    finally:
        hold.released_s = time.time()
        # (the reply is enough: the worker's loop consumes at its next turn)
        replies = app.control.add_consumer(queue, destination=names, reply=True,
                                           timeout=timeout_s)
        if silent := set(names) - {host for reply in replies or [] for host in reply}:
            raise TimeoutError(f"workers {sorted(silent)} did not say they consume "
                               f"{queue!r} again in {timeout_s:.0f} s")


def _consumed(app: Celery, names: Sequence[str], timeout_s: float
              ) -> dict[str, frozenset[str]]:
    """The queues each worker named consumes now, by its hostname: asked again (for
    those yet to answer) every :data:`ASK_S` until ``timeout_s``, so that one reply
    lost or late costs a question, not the whole wait."""
    deadline = time.monotonic() + timeout_s
    out: dict[str, frozenset[str]] = {}
    while missing := [n for n in names if n not in out]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"workers {sorted(missing)} did not say which queues they "
                               f"consume in {timeout_s:.0f} s")
        replies = app.control.inspect(destination=missing,
                                      timeout=min(ASK_S, left)).active_queues()
        out.update({host: frozenset(q["name"] for q in queues)
                    for host, queues in (replies or {}).items() if host in missing})
    return out


def _await_consumed(app: Celery, want: Mapping[str, frozenset[str]], timeout_s: float) -> None:
    """Until each worker in ``want`` consumes exactly its queues there."""
    deadline = time.monotonic() + timeout_s
    # (each round may ask for a while, even past the deadline: a last look, not none)
    while (now := _consumed(app, list(want), max(ASK_S, deadline - time.monotonic()))) != want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers consume {now}, not {dict(want)}, after "
                               f"{timeout_s:.0f} s")
        time.sleep(0.05)
