"""A pool child whose sentinel fired before it could be reaped is looked at again soon
(``workers/reap.py``), not at the pool's 5 s ``maintain_pool`` timer. Stand-ins for the
pool and the event loop: which look-agains are scheduled, and when they stop."""

from __future__ import annotations

from typing import Any

from sits_queue.workers import reap


class Hub:
    def __init__(self) -> None:
        self.later: list[tuple[float, Any, tuple[Any, ...]]] = []

    def call_later(self, delay_s: float, fun: Any, *args: Any) -> None:
        self.later.append((delay_s, fun, args))

    def run_next(self) -> float:
        delay_s, fun, args = self.later.pop(0)
        fun(*args)
        return delay_s


class Pool:
    """A pool whose child ``proc`` is reapable only after ``looks`` maintain_pool calls."""

    def __init__(self, looks: int) -> None:
        self.proc = Proc()
        self._pool = [self.proc, object()]
        self.looks_left = looks
        self.maintained = 0
        self.untracked: list[Any] = []

    def maintain_pool(self) -> None:
        self.maintained += 1
        self.looks_left -= 1
        if self.looks_left <= 0 and self.proc in self._pool:
            self._pool.remove(self.proc)

    def _event_process_exit(self, hub: Any, proc: Any) -> None:
        self.untracked.append(proc)  # (Celery's: the sentinel unwatched, then a look)
        proc._sentinel_poll = None
        self.maintain_pool()


class Proc:
    _sentinel_poll: int | None = 7


def test_a_child_reaped_at_its_sentinel_needs_no_look_again() -> None:
    pool, hub = Pool(looks=1), Hub()
    assert reap.install(pool)
    pool._event_process_exit(hub, pool.proc)
    assert pool.proc not in pool._pool and hub.later == []


def test_a_child_not_yet_reapable_is_looked_at_again_until_it_is() -> None:
    pool, hub = Pool(looks=4), Hub()
    assert reap.install(pool)
    pool._event_process_exit(hub, pool.proc)
    assert pool.untracked == [pool.proc] and pool.maintained == 1
    # (a registration meanwhile, on a reconnect, watches the popen's sentinel again: it
    # watched None, and the consumer could not restart)
    assert "_sentinel_poll" not in vars(pool.proc)
    delays = []
    while hub.later:
        delays.append(hub.run_next())
    assert delays == [0.001, 0.002, 0.004]  # doubling; none once it is reaped
    assert pool.proc not in pool._pool and pool.maintained == 4


def test_the_look_agains_end_at_the_last_and_leave_the_rest_to_the_pools_timer() -> None:
    pool, hub = Pool(looks=10**6), Hub()
    assert reap.install(pool)
    pool._event_process_exit(hub, pool.proc)
    delays = []
    while hub.later:
        delays.append(hub.run_next())
    assert delays[0] == reap.FIRST_RETRY_S and delays[-1] == reap.LAST_RETRY_S
    assert sum(delays) < 1.1 and pool.proc in pool._pool  # (then the 5 s timer, as before)


def test_a_pool_without_the_parts_is_left_as_it_is() -> None:
    assert not reap.install(object())
    assert not reap.install(None)
