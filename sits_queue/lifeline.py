"""A worker or beat that ``sitsq`` starts (the demo, a benchmark, the test suite) ends with
the process that started it.

Started in sessions of their own (so that a Ctrl-C at the terminal reaches them through
their starter, which stops them in order), they outlived a starter killed outright
(SIGKILL, the OOM killer, a CI timeout): the next demo's figures counted the orphan's
work, two beats ran at once, and a test run's workers went on taking CPU. A process
started with :data:`ENV` set to its parent's pid watches that pid: once it is
re-parented, it stops as on SIGTERM (Celery's warm shutdown). Workers and beats started
otherwise (systemd, a shell, a container) never set it and are left alone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

from celery import signals

logger = logging.getLogger(__name__)

#: The environment variable naming the pid whose end ends this process.
ENV = "SITS_EXIT_WITH"
#: How often the parent is looked at, s.
CHECK_S = 1.0


def parent_of(env: Mapping[str, str]) -> int | None:
    """The pid :data:`ENV` names; None when unset or not a pid."""
    raw = env.get(ENV, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 1 else None


def watch(env: Mapping[str, str] = os.environ, check_s: float = CHECK_S) -> bool:
    """Stop this process once its parent is no longer the one :data:`ENV` names (from a
    daemon thread); False, and nothing watched, where it names none."""
    parent = parent_of(env)
    if parent is None:
        return False

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(check_s)
        logger.warning("the process that started this one (pid %d) has ended: stopping",
                       parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=run, name="sits-lifeline", daemon=True).start()
    return True


def _on_start(**_: Any) -> None:
    watch()


def connect() -> None:
    """Watch from the worker's and the beat's main process (not pool children: forked
    from the main one, they end with it)."""
    signals.worker_init.connect(_on_start, weak=False, dispatch_uid="sits-lifeline")
    signals.beat_init.connect(_on_start, weak=False, dispatch_uid="sits-lifeline-beat")
