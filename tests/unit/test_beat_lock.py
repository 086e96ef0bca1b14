"""The beat's lock timeout: it follows the beat's ticks (each extends the lock), not the
rescoring interval (at 300 s, 6 x that kept a killed beat's lock 30 minutes, and its
standby sent no trigger check all that time)."""

from __future__ import annotations

import pytest

from sits_queue.app import make_app
from sits_queue.config import SitsConfig
from sits_queue.priority.beat import SitsScheduler
from sits_queue.settings import (
    BEAT_MAX_LOOP_S,
    MIN_LOCK_TIMEOUT_S,
    beat_lock_timeout_s,
    celery_settings,
)

#: A standby should be sending the passes within this long of the leader's death.
TAKE_OVER_S = 30


@pytest.mark.parametrize("rescore_interval_s", [1.0, 5.0, 300.0, 3600.0])
@pytest.mark.parametrize("trigger_check_interval_s", [1.0, 600.0])
def test_the_lock_follows_the_beat_s_ticks_not_its_rescoring(
        rescore_interval_s: float, trigger_check_interval_s: float) -> None:
    settings = celery_settings(SitsConfig(rescore_interval_s=rescore_interval_s,
                                          trigger_check_interval_s=trigger_check_interval_s))
    loop_s, lock_s = settings["beat_max_loop_interval"], settings["redbeat_lock_timeout"]
    # The beat sleeps at most loop_s between ticks, whatever its entries' periods; each
    # tick extends the lock, which outlives several such sleeps
    assert loop_s == BEAT_MAX_LOOP_S
    assert lock_s == beat_lock_timeout_s(loop_s) >= 5 * loop_s
    # and is gone soon after a beat that stopped ticking
    assert lock_s <= TAKE_OVER_S


@pytest.mark.parametrize(("max_loop_s", "lock_s"), [
    (0.5, MIN_LOCK_TIMEOUT_S), (1.0, MIN_LOCK_TIMEOUT_S), (BEAT_MAX_LOOP_S, MIN_LOCK_TIMEOUT_S),
    (3.1, 16), (10.0, 50), (300.0, 1500),
])
def test_the_lock_outlives_five_of_the_longest_sleeps(max_loop_s: float, lock_s: int) -> None:
    assert beat_lock_timeout_s(max_loop_s) == lock_s


def test_a_beat_that_sleeps_longer_keeps_a_lock_that_outlives_its_sleeps() -> None:
    """``celery beat --max-interval 60``, or an app's own ``beat_max_loop_interval``: a
    lock shorter than the sleep would be lost by a healthy leader between two ticks."""
    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0", rescore_interval_s=300.0),
                   main="beat-lock-unit")
    try:
        default = SitsScheduler(app=app, lazy=True)
        assert (default.max_interval, default.lock_timeout) == (BEAT_MAX_LOOP_S,
                                                                MIN_LOCK_TIMEOUT_S)
        slower = SitsScheduler(app=app, lazy=True, max_interval=60)
        assert slower.lock_timeout == 300
        # A longer timeout the app sets is its own
        app.conf.redbeat_lock_timeout = 120
        del app.redbeat_conf  # (redbeat reads its settings once per app)
        assert SitsScheduler(app=app, lazy=True).lock_timeout == 120
    finally:
        app.close()
