"""Time slices with real workers: a long low task gives its slot to an urgent one at a
yield point, and resumes from its checkpoint without losing its place or its count."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from sits_queue.broker.keys import QueueKeys
from sits_queue.procs import CeleryProcess
from tests.waiting import wait_for

Spawn = Callable[..., CeleryProcess]
KEYS = QueueKeys.for_queue("celery")


def steps_log(client: redis.Redis) -> list[str]:
    return [x.decode() for x in client.lrange("test:steps", 0, -1)]


def test_an_urgent_task_takes_the_slot_of_a_long_low_one(spawn: Spawn, client_app: Celery,
                                                         redis_client: redis.Redis) -> None:
    spawn(concurrency=1)
    # Given the only slot busy with a low task of 40 steps of 50 ms
    low = client_app.tasks["w.steps"].delay("low", 40, 0.05)
    wait_for(lambda: "low:start:0" in steps_log(redis_client), 20, "the low task to start")
    # When a high task arrives
    submitted = time.time()
    high = client_app.tasks["w.slow"].apply_async(("urgent", 0.0), sla_class="high")
    assert high.get(timeout=30) == "urgent"
    # Then it ran long before the low task could have ended (2 s), and the low task
    # yielded once, resumed from its checkpoint and finished all 40 steps
    assert low.get(timeout=60) == 2
    log = steps_log(redis_client)
    started_high = float(redis_client.get("test:started:urgent") or 0)
    assert started_high == 1
    assert [x for x in log if ":yield:" in x] == [log[1]]
    done_at_yield = int(log[1].rsplit(":", 1)[1])
    assert log[2] == f"low:start:{done_at_yield}"
    assert log[-1] == "low:end:2"
    assert 0 < done_at_yield < 40
    assert time.time() - submitted < 20
    # Yielding is not a redelivery, and an acked task leaves no checkpoint behind
    # (the worker acks just after storing the result)
    wait_for(lambda: redis_client.hlen(KEYS.checkpoints) == 0, 10, "the checkpoint to go")
    assert redis_client.hlen(KEYS.redelivered) == 0
    assert redis_client.hlen(KEYS.yields) == 0


def preempted_once(client_app: Celery, redis_client: redis.Redis, task: str,
                   tag: str) -> tuple[Any, list[str]]:
    """A low ``task`` of 40 steps of 50 ms on the only slot, a high task taking the slot
    at a yield point: the low task's result once it resumed and ended, and the steps."""
    low = client_app.tasks[task].delay(tag, 40, 0.05)
    wait_for(lambda: f"{tag}:start:0" in steps_log(redis_client), 30, "the task to start")
    high = client_app.tasks["w.slow"].apply_async((f"urgent-{tag}", 0.0), sla_class="high")
    assert high.get(timeout=30) == f"urgent-{tag}"
    return low.get(timeout=60), steps_log(redis_client)


def test_a_rate_limited_task_resumes_without_another_token(spawn: Spawn, client_app: Celery,
                                                           redis_client: redis.Redis) -> None:
    # (its resumption waited in the rate-limit bucket for a new token, as a new run: an
    # hour at '1/h', each yield using up a token of the task type's rate)
    spawn(concurrency=1)
    # Given a rate-limited task (1/h) that yields its slot to a high one, then it resumes
    # from its checkpoint and ends (2 runs) without the hour's wait for a token
    result, log = preempted_once(client_app, redis_client, "w.steps_limited", "limited")
    assert result == 2
    assert len([x for x in log if x.startswith("limited:yield:")]) == 1


def test_an_inference_task_yields_through_current_task(spawn: Spawn, client_app: Celery,
                                                       redis_client: redis.Redis) -> None:
    spawn(concurrency=1)
    # Given a low inference task that yields its slot to a high one, then it resumes from
    # the checkpoint current_task gave it
    result, log = preempted_once(client_app, redis_client, "w.infer_steps", "infer")
    assert result["output"] == 2
    assert [x for x in log if ":yield:" in x] == [log[1]]
    assert log[2] == f"infer:start:{log[1].rsplit(':', 1)[1]}" and log[-1] == "infer:end:2"


def test_a_task_of_the_same_class_does_not_preempt(spawn: Spawn, client_app: Celery,
                                                   redis_client: redis.Redis) -> None:
    spawn(concurrency=1)
    steps = client_app.tasks["w.steps"]
    first = steps.delay("first", 10, 0.03)
    wait_for(lambda: "first:start:0" in steps_log(redis_client), 20, "the first task to start")
    second = steps.delay("second", 1, 0.0)
    assert first.get(timeout=30) == 1 and second.get(timeout=30) == 1
    assert steps_log(redis_client) == ["first:start:0", "first:end:1",
                                       "second:start:0", "second:end:1"]


def test_a_task_that_yields_resumes_past_its_expiry(spawn: Spawn, client_app: Celery,
                                                    redis_client: redis.Redis) -> None:
    """(it came back past its expires and was revoked as expired: its work so far thrown
    away, and it never finished)"""
    spawn(concurrency=1)
    # Given a low task of 40 steps that expires 1 s after its submission, running
    low = client_app.tasks["w.steps"].apply_async(("low", 40, 0.05), expires=1.0)
    wait_for(lambda: "low:start:0" in steps_log(redis_client), 20, "the low task to start")
    # When an urgent task takes its slot for longer than that
    high = client_app.tasks["w.slow"].apply_async(("urgent", 1.5), sla_class="high")
    assert high.get(timeout=30) == "urgent"
    # Then it resumes from its checkpoint and finishes
    assert low.get(timeout=60) == 2
    log = steps_log(redis_client)
    assert any(":yield:" in x for x in log) and log[-1] == "low:end:2"


def test_a_call_forwarding_delivered_headers_runs_from_no_checkpoint(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """(refused, a task forwarding its request's headers to a child always failed, they
    carry the broker's sits_delivery; and a caller's sits_checkpoint ran the first run
    as if resumed)"""
    spawn(concurrency=1)
    forwarded = {"sits_checkpoint": json.dumps({"done": 4, "runs": 41}),
                 "sits_delivery": "celery", "sits_batch": ["b", 0, 2], "redelivered": True,
                 "trace_id": "t-1"}
    result = client_app.tasks["w.steps"].apply_async(("fwd", 5, 0.0), headers=forwarded)
    assert result.get(timeout=30) == 1  # a first run, all five steps
    assert steps_log(redis_client) == ["fwd:start:0", "fwd:end:1"]
    assert result.get(timeout=1) == 1 and client_app.AsyncResult(result.id).state == "SUCCESS"


def test_yield_point_outside_a_worker_never_yields(client_app: Celery,
                                                    redis_client: redis.Redis) -> None:
    # An eager call has no delivery: yield_point is a no-op and checkpoint is None
    result = client_app.tasks["w.steps"].apply(("eager", 3, 0.0))
    assert result.get() == 1
    assert steps_log(redis_client) == ["eager:start:0", "eager:end:1"]


def yield_once(spawn: Spawn, client_app: Celery, redis_client: redis.Redis, task: str,
               **options: Any) -> Any:
    """Start ``task`` (40 steps of 50 ms) on a one-slot worker and make it yield once to
    an urgent task; its result."""
    spawn(concurrency=1)
    low = client_app.tasks[task].apply_async(("low", 40, 0.05), options or None)
    wait_for(lambda: "low:start:0" in steps_log(redis_client), 20, "the low task to start")
    high = client_app.tasks["w.slow"].apply_async(("urgent", 0.0), sla_class="high")
    assert high.get(timeout=30) == "urgent"
    return low


def test_a_retry_after_a_yield_starts_from_the_beginning(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    low = yield_once(spawn, client_app, redis_client, "w.steps", retry_once=True)
    assert low.get(timeout=60) == 1  # the retry's own run: one run, no checkpoint
    starts = [x for x in steps_log(redis_client) if ":start:" in x]
    # first run, its resumption after the yield, then the retry from step 0 (it carried
    # the delivery's checkpoint header and skipped the steps the first run had done)
    assert len(starts) == 3 and starts[1] != "low:start:0" and starts[2] == "low:start:0"


def test_a_yield_is_not_an_error_to_autoretry_for(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    low = yield_once(spawn, client_app, redis_client, "w.auto_steps")
    # it resumed from its checkpoint (a second run of the same execution); turned into
    # a retry, it started over with its progress lost (one run, one retry used)
    assert low.get(timeout=60) == 2 and low.state == "SUCCESS"
    assert any(":yield:" in x for x in steps_log(redis_client))


def test_a_task_that_rejects_itself_with_requeue_is_never_poison(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    spawn(concurrency=1)
    # more self-requeues than max_redeliveries (5): nothing crashed, it is no poison
    got = client_app.tasks["w.requeue"].delay("again", 8)
    assert got.get(timeout=60) == 8
    assert redis_client.hlen(KEYS.dead) == 0


def test_a_running_task_revoked_without_terminate_ends_at_its_yield(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis) -> None:
    """A revoke leaves a running run alone (Celery's rule); once the task yields its slot
    it is a waiting message, and a revoked waiting one is discarded (README: time
    slices)."""
    worker = spawn(concurrency=1)
    low = client_app.tasks["w.steps"].delay("revoked", 40, 0.05)
    wait_for(lambda: "revoked:start:0" in steps_log(redis_client), 20, "the task to start")
    low.revoke()
    wait_for(lambda: "flagged as revoked" in worker.log_path.read_text(), 10,
             "the worker to hear the revoke")
    high = client_app.tasks["w.slow"].apply_async(("urgent-after-revoke", 0.0),
                                                  sla_class="high")
    assert high.get(timeout=30) == "urgent-after-revoke"
    wait_for(lambda: low.state == "REVOKED", 20, "the task to end revoked",
             seen=lambda: steps_log(redis_client))
    log = steps_log(redis_client)
    assert log[0] == "revoked:start:0" and log[1].startswith("revoked:yield:")
    assert len(log) == 2  # not resumed, not ended
    # and what its yield left (its checkpoint, its record of yields) goes with it
    wait_for(lambda: redis_client.hlen(KEYS.checkpoints) == 0
             and redis_client.hlen(KEYS.yields) == 0, 10, "the checkpoint to go",
             seen=lambda: (redis_client.hgetall(KEYS.checkpoints),
                           redis_client.hgetall(KEYS.yields)))
