"""``stacks.install``: SIGUSR2 dumps every thread's stack to stderr, unless Celery's remote
debugger owns the signal. In a fresh interpreter (a handler in pytest's would stay)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import os, signal, threading, time
from sits_queue.workers import stacks
armed = stacks.install()
print("armed", armed, flush=True)
if armed:
    waiting = threading.Thread(target=time.sleep, args=(5,), name="waiting", daemon=True)
    waiting.start()
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(0.2)
print("alive", flush=True)
"""


def run(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "CELERY_RDBSIG"}
    return subprocess.run([sys.executable, "-c", SCRIPT], env={**clean, **env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_usr2_dumps_every_threads_stack_and_the_process_lives_on() -> None:
    out = run()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["armed", "True", "alive"]
    assert out.stderr.count("(most recent call first)") >= 2  # the main thread and "waiting"
    assert "in <module>" in out.stderr


def test_the_remote_debuggers_signal_is_left_to_it() -> None:
    out = run(CELERY_RDBSIG="1")
    assert out.stdout.split() == ["armed", "False", "alive"]
    assert "most recent call first" not in out.stderr
