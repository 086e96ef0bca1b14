"""Time to the first new token of a generation (MISSION §4.4's first-token latency).

A cold start shows first in the first token: the source measures its spread (+/-18.7 ms
before its remedies, +/-3.2 ms after). The worker starts a clock when an inference run
begins, before it gets its engine, so a cold start's load and warm-up count; the decode
loops mark it when they have their first new token (prefill and first sample done).
The run's ``sits`` block then says ``first_token_ms`` (``workers/inference.py``) and the
worker counts it in its ``sits_first_token_seconds`` histogram (``metrics.py``).

The clock is a process global, not a field of the running task, so code that decodes
outside a SITS worker (a plain Celery task of ``sitsq bench coldstart``) times itself
the same way: ``with first_token_clock() as clock: ...; clock.ms``. A run that resumes a
yielded generation (time slices) carries the first run's figure over: its first token
came then.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

_MS_PER_S = 1000.0


class FirstToken:
    """One run's clock: started when made, marked once."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.ms: float | None = None

    def mark(self) -> float | None:
        """The first call stops the clock; every call returns the ms it read."""
        if self.ms is None:
            self.ms = round((time.perf_counter() - self.started) * _MS_PER_S, 3)
        return self.ms

    def carry(self, ms: float) -> None:
        """A resumed generation's first token came in an earlier run, ``ms`` after it
        began: report that, not this run's first step."""
        self.ms = ms


_clock: FirstToken | None = None


@contextmanager
def first_token_clock() -> Iterator[FirstToken]:
    """Time the first token of whatever decodes inside the block."""
    global _clock
    clock, previous = FirstToken(), _clock
    _clock = clock
    try:
        yield clock
    finally:
        _clock = previous


def mark() -> float | None:
    """The decode loop has its first new token: the ms since the run began (None with no
    clock running)."""
    return _clock.mark() if _clock is not None else None


def waiting() -> bool:
    """A clock is running and no first token has been marked yet (a GPU caller syncs
    then, so that the mark is when the token exists, not when its kernels were queued)."""
    return _clock is not None and _clock.ms is None


def carry(ms: object) -> float | None:
    """Report ``ms`` from a saved checkpoint as this run's first-token time, if it is a
    finite non-negative number (a checkpoint is data from Redis: anything else is
    ignored). Returns what was carried."""
    if isinstance(ms, bool) or not isinstance(ms, int | float) \
            or not math.isfinite(ms) or ms < 0:
        return None
    if _clock is not None:
        _clock.carry(float(ms))
    return float(ms)
