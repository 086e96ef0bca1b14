"""The beat's and the triggers' rescoring passes take at most a share of the time: over a
deep backlog a pass outlasts the trigger check's interval, and passes ran back to back
while any urgent task waited, a one-slot worker running nothing else."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import redis
from celery import Celery

from sits_queue.broker import clock
from sits_queue.broker.bulk import enqueue_many
from sits_queue.procs import CeleryProcess
from tests.waiting import wait_for


def test_a_spaced_pass_waits_its_share_of_the_time(client_app: Celery,
                                                   redis_client: redis.Redis) -> None:
    from sits_queue.priority.rescore import MOST_PASS_SHARE, Rescorer, _state_key

    rescorer = Rescorer(client_app.sits, redis_client)
    key = _state_key(client_app.sits, "last-pass")
    # A pass leaves its end, on Redis's clock (this host's plus the offset measured
    # here: time.time() alone read up to a round trip behind), and its length
    started = clock.now(redis_client)
    report = rescorer.rescore_all()
    assert report is not None
    last = json.loads(redis_client.get(key) or "{}")
    assert last["took_s"] == report.duration_ms / 1000
    assert started <= last["end"] <= clock.now(redis_client)
    # Given a last pass of 10 s that ended just now: a spaced pass waits (3 x 10 s at a
    # quarter of the time), an unspaced one (a caller's own) runs
    redis_client.set(key, json.dumps({"end": time.time(), "took_s": 10.0}))
    assert rescorer.rescore_all(spaced=True) is None
    assert rescorer.rescore_all() is not None
    # and once that has passed, the spaced one runs too
    waited = 10.0 * (1 / MOST_PASS_SHARE - 1)
    redis_client.set(key, json.dumps({"end": time.time() - waited - 1, "took_s": 10.0}))
    assert rescorer.rescore_all(spaced=True) is not None
    # A record that is not one (another program's) spaces nothing
    redis_client.set(key, "not json")
    assert rescorer.rescore_all(spaced=True) is not None


def test_a_one_slot_worker_runs_its_tasks_beside_passes_over_a_deep_backlog(
        spawn: Callable[..., CeleryProcess], client_app: Celery,
        redis_client: redis.Redis) -> None:
    """(0 of 20 tasks ran in 45 s over 100k waiting: check_triggers' full passes of
    ~2 s ran back to back, each check firing the backlog trigger)"""
    # Given 100k urgent tasks waiting in a queue no worker here serves, and the beat's
    # passes over them under way (the backlog trigger firing)
    enqueue_many(client_app.tasks["w.add"], [(i, i) for i in range(100_000)], queue="gpu",
                 sla_class="high", chunk=2000)
    worker = spawn(concurrency=1, rescore_interval_s="1", trigger_check_interval_s="1",
                   prewarm_interval_s="0")
    spawn("beat", rescore_interval_s="1", trigger_check_interval_s="1",
          prewarm_interval_s="0")
    wait_for(lambda: worker.log().count("priority triggers ('backlog',) fired") >= 2, 90,
             "the backlog trigger's passes")
    # When tasks come to the one-slot worker's own queue, they run
    results = [client_app.tasks["w.add"].delay(i, 1) for i in range(10)]
    wait_for(lambda: all(r.ready() for r in results), 60, "the worker's own tasks to run")
    assert [r.get(timeout=1) for r in results] == [i + 1 for i in range(10)]
