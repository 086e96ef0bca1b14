"""``short_ttl_app`` (an advertisement refreshed every quarter second) with the runtime
profile sampled every fifth of a second (``test_profile.py``): a test sees a task of a few
seconds outlast many sampling periods."""

from __future__ import annotations

from sits_queue.workers import profile

#: The worker's sampling period here, s.
SAMPLE_S = 0.2
profile.SAMPLE_S = SAMPLE_S
# The advertised sample count is the window's: kept past the usual minute (12 samples),
# it keeps counting through the test instead of stopping at 12.
profile.WINDOW = 100_000

from tests.integration.short_ttl_app import app, tasks  # noqa: E402

__all__ = ["app", "tasks"]
