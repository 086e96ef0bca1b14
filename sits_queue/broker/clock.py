"""Redis's clock: the one clock SITS compares times on across hosts.

A task's wait is the time between its put and now; its latency, between its submission
and its end; a held message's deadline, set by the worker holding it and compared by
another worker's sweep. Each read ``time.time()`` on its own host, so a producer whose
clock was an hour behind put tasks that had "waited" an hour (above every fresh task of
any class, its latency an hour in its class's p95), one an hour ahead starved past the
starvation bound, and a worker five minutes behind had its running tasks restored by
another's sweep and run twice. Every such time now is the host's clock plus its offset
to the Redis server's ``TIME``, measured over the client SITS already holds and again
every :data:`REFRESH_S` (a step of the host's clock is caught then), one offset per
server and process.

The offset is taken at the middle of the ``TIME`` round trip: off by at most half of it,
so a round trip over :data:`MAX_ROUND_TRIP_S` (Redis stalled meanwhile) measures nothing.
A measurement that fails (Redis away, or that slow) keeps the last offset and is tried
again after :data:`RETRY_S`; before any has succeeded the host's own clock stands (the
caller's own command then meets the same outage and says so).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Seconds between two measurements of one server's offset.
REFRESH_S = 30.0
#: Seconds before a failed measurement is tried again.
RETRY_S = 5.0
#: A ``TIME`` round trip longer than this, s, measures nothing: the server read its clock
#: somewhere within it, not halfway (one blocked through a 30 s stall of Redis made an
#: offset of +15 s, kept for :data:`REFRESH_S`, and a sweep with it counted live holders
#: silent 15 s early). Tried again after :data:`RETRY_S`.
MAX_ROUND_TRIP_S = 0.5


def offset_of(before_s: float, server_time: Sequence[Any], after_s: float) -> float:
    """Redis's clock less this host's, from one ``TIME`` reply (seconds, microseconds)
    between two readings of the host's clock: the server read its own about halfway."""
    seconds, micros = server_time[0], server_time[1]
    return int(seconds) + int(micros) / 1e6 - (before_s + after_s) / 2


@dataclass
class _Offset:
    seconds: float = 0.0
    #: ``time.monotonic()`` after which it is measured again.
    due: float = float("-inf")


_offsets: dict[tuple[Any, ...], _Offset] = {}
_lock = threading.Lock()


def _server(client: Any) -> tuple[Any, ...] | None:
    """Which server ``client`` talks to (host and port, or a socket's path); None for a
    client that is not redis-py's (a test double: it keeps the host's clock)."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        return None
    return (kwargs.get("host"), kwargs.get("port"), kwargs.get("path"))


def now(client: Any) -> float:
    """The time on the clock of ``client``'s Redis server, seconds since the epoch."""
    server = _server(client)
    if server is None:
        return time.time()
    with _lock:
        offset = _offsets.setdefault(server, _Offset())
        measure = time.monotonic() >= offset.due
        if measure:  # one thread measures; the others meanwhile take the last offset
            offset.due = time.monotonic() + RETRY_S
    if measure:
        try:
            before = time.time()
            reply = client.time()
            after = time.time()
        except Exception:  # Redis away, a client closing: the last offset stands
            pass
        else:
            if after - before <= MAX_ROUND_TRIP_S:
                offset.seconds = offset_of(before, reply, after)
                offset.due = time.monotonic() + REFRESH_S
    return time.time() + offset.seconds


def forget() -> None:
    """Measure every server again at its next use (tests; a process that knows its
    clock was stepped)."""
    with _lock:
        _offsets.clear()
