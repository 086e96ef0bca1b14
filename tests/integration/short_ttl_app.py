"""``worker_app`` with the advertisement's TTL cut to a second (``test_advertise.py``): a
test sees a task outlast it, and four times it (the counters' old expiry), in seconds."""

from __future__ import annotations

from sits_queue.workers import advertise

#: The worker's advertisement TTL and refresh period here, s.
TTL_S = 1
REFRESH_S = 0.25
advertise.TTL_S = TTL_S
advertise.REFRESH_S = REFRESH_S

from tests.integration.worker_app import app, tasks  # noqa: E402

__all__ = ["app", "tasks"]
