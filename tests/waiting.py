"""Polling with a deadline, for tests that watch real processes."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str,
             poll_s: float = 0.05) -> None:
    """Return once ``predicate()`` holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
