"""Predictive pre-warming on a worker of several pool children (the default on a host of
several GPUs: a child per GPU), against a real Redis and a real worker: each child keeps
its own engines, so each is an instance the forecast's ``ceil(concurrency x 1.3)``
counts, and the pool hands each pre-warm to a child without the model."""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from sits_queue.priority.tasks import prewarmer
from sits_queue.procs import CeleryProcess
from sits_queue.status import prewarm_status
from sits_queue.workers import advertise, metrics
from tests.integration.prewarming import confident, worker_fixture
from tests.integration.test_cli import sitsq
from tests.waiting import wait_for

setup = worker_fixture("prewarm2", 2)


def holders(r: redis.Redis, hostname: str, model: str) -> list[str]:
    """The slots of the children holding ``model`` on their device tier."""
    children = advertise.read_children(r, "", hostname)
    return sorted(slot for slot, c in children.items()
                  if (c.get("warm") or {}).get(model) == "device")


def await_holders(r: redis.Redis, worker: CeleryProcess, model: str, n: int) -> None:
    try:
        wait_for(lambda: len(holders(r, worker.hostname, model)) == n, 90,
                 f"{n} children to hold {model}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; holders {holders(r, worker.hostname, model)}\n"
                             f"{worker.log()[-3000:]}") from None


def test_each_child_of_a_worker_is_pre_warmed_as_an_instance(
        setup: tuple[Celery, CeleryProcess], r: redis.Redis) -> None:
    app, worker = setup
    # Given a worker whose pool of two children is steered, and advertised so, and a
    # confident forecast of a costly model it does not hold
    wait_for(lambda: (advertise.read_worker(r, "", worker.hostname) or {}).get("steered")
             is True, 30, "the worker's advertisement")
    assert holders(r, worker.hostname, "lm-c") == []
    confident(app, r, worker.hostname, "lm-c")
    # When the planner runs
    report = prewarmer(app).run(time.time())
    # Then it wants ceil(90 x 0.06 s / 2 s x 1.3) = 4 instances, has none, and asks the
    # one worker for one per child: two pre-warms, which its pool hands to both children
    lm_c = next(o for o in report["outlooks"] if o["model"] == "lm-c")
    assert (lm_c["reason"], lm_c["instances"], lm_c["warm_now"]) == ("pre-warm", 4, 0)
    assert report["sent"] == [{"model": "lm-c", "hostname": worker.hostname}] * 2
    # and `sitsq status` says so (the beat's task keeps no result)
    shown = sitsq("status", env={**os.environ, "SITS_REDIS_URL": app.sits.redis_url})
    assert shown.returncode == 0, shown.stderr
    assert f"pre-warm(s) sent: lm-c to {worker.hostname} x2" in shown.stdout, shown.stdout
    assert ("  lm-c: " in shown.stdout
            and "4 warm instance(s) wanted, 0 now: pre-warm" in shown.stdout), shown.stdout
    # and the fleet's metrics (`sitsq metrics`' collector, reading this Redis)
    scraped = {(m.name, s.labels.get("model")): s.value
               for m in metrics.WorkerCollector(app.sits, None, prewarm=lambda c: (
                   prewarm_status(c, app.sits))).collect() for s in m.samples}
    assert scraped[("sits_prewarm_instances_wanted", "lm-c")] == 4
    assert scraped[("sits_prewarm_instances_warm", "lm-c")] == 0
    assert scraped[("sits_prewarm_sent", "lm-c")] == 2
    assert scraped[("sits_prewarm_last_pass_age_seconds", None)] < 60
    await_holders(r, worker, "lm-c", 2)
    # and the next pass counts two warm instances, and has no child left to ask
    again = prewarmer(app).run(time.time())
    assert next(o for o in again["outlooks"] if o["model"] == "lm-c")["warm_now"] == 2
    assert not [s for s in again["sent"] if s["model"] == "lm-c"]
    assert worker.alive(), worker.log()[-2000:]


def test_a_pre_warm_goes_to_the_child_without_the_model(
        setup: tuple[Celery, CeleryProcess], r: redis.Redis) -> None:
    """(steered by affinity, the pre-warm went to the idle child already holding the
    model: it loaded nothing, and the next pass asked for it again)"""
    app, worker = setup
    # Given one child holding lm-b (a task of it ran), the other idle
    app.tasks["sits.generate"].apply_async(("p",), {"max_new_tokens": 2},
                                           model="lm-b").get(timeout=120)
    await_holders(r, worker, "lm-b", 1)
    confident(app, r, worker.hostname, "lm-b")
    # When the planner runs: one warm instance of four, one child left to ask
    report = prewarmer(app).run(time.time())
    lm_b = next(o for o in report["outlooks"] if o["model"] == "lm-b")
    assert (lm_b["reason"], lm_b["warm_now"]) == ("pre-warm", 1)
    assert [s for s in report["sent"] if s["model"] == "lm-b"] == [
        {"model": "lm-b", "hostname": worker.hostname}]
    # Then the pre-warm loads it in the other child
    await_holders(r, worker, "lm-b", 2)
