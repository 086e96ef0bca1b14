"""Polling with a deadline, for tests that watch real processes."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str,
             poll_s: float = 0.05, seen: Callable[[], object] | None = None) -> None:
    """Return once ``predicate()`` holds; fail naming ``what`` after ``timeout_s`` (and,
    given ``seen``, what it reads then: the state the wait never left)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            last = "" if seen is None else f"; last seen: {seen()!r}"
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{last}")
        time.sleep(poll_s)
