"""``kill -USR2 <pool child pid>``: the child writes every thread's Python stack to its
stderr (the worker's log), at once, even while a thread is stuck inside a C call (a
driver, a lock) that no Python-level handler would interrupt.

For a child that stops answering: on the H200 host a replacement child hung in its
first task, and nothing said where. Python's ``faulthandler`` does the dump from its C
signal handler. Not installed when Celery's remote debugger owns the signal
(``CELERY_RDBSIG`` set), nor where the process has no stderr to write to.
"""

from __future__ import annotations

import faulthandler
import io
import os
import signal
import sys

#: The signal: Celery's pool children take SIGUSR1 for soft time limits.
SIGNAL = getattr(signal, "SIGUSR2", None)


def install() -> bool:
    """Arm the dump in this process; True when armed."""
    if SIGNAL is None or os.environ.get("CELERY_RDBSIG"):
        return False
    stream = sys.__stderr__  # the real fd 2: Celery replaces sys.stderr with a logger
    if stream is None:
        return False
    try:
        faulthandler.register(SIGNAL, file=stream, all_threads=True)
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation, RuntimeError):
        return False  # no stderr with a file descriptor behind it
    return True
