"""Continuous batching in a real ``celery worker``: tasks submitted while a generation
batch decodes join its freed rows, decode exactly what they would alone, and are stored
when they are done; a task that would not finish before the batch's soft time limit is
declined and runs after it; nothing is left behind in Redis.

The batch runs on the "slow" model (the tiny GPT with a pause per forward, here 50 ms),
so it is still decoding when the later tasks arrive, however slow the machine. Whether a
row is declined, and whether it then finishes alone within its soft limit, are matters of
decode time: the pause makes up most of a step, so the time a busy host's scheduling adds
to each step (20 ms made a 20 ms pause's step 42 ms, past a 40 ms margin) moves them
little.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from celery.result import AsyncResult

from sits_queue.broker.keys import QueueKeys
from sits_queue.procs import CeleryProcess
from sits_queue.workers import metrics
from tests.integration.inference_app import CALL_S, FIRST_CALL_S, serving
from tests.waiting import wait_for

#: The pause per forward of the "slow" model here, s.
STEP_S = 0.05
#: The long row (tokens) and its soft limit, s: it runs ~60 x 50 ms = 3 s, well inside.
LONG, SOFT_S = 60, 8
#: The time limits of every row here: tasks join a batch of their own key, which names
#: them (a task that set other limits would have run under the batch's).
LIMITS = {"soft_time_limit": SOFT_S, "time_limit": 60}
#: Rows submitted while it decodes: prompt, max_new_tokens, temperature, seed. The last
#: would take at least 90 x 50 ms = 4.5 s (more on a busy host: the join measures the
#: batch's steps), more than half of the at most 8 s left before the long row's soft
#: limit: declined, it runs after the batch, alone, within its own 8 s at up to 88 ms a
#: step (the pause's 50 and 38 more).
LATER = [("the worker keeps", 4, 0.0, 0), ("a queue of work", 6, 1.3, 5),
         ("one long continuation", 90, 0.0, 0)]


def gen(app: Celery, prompt: str, n: int, temperature: float = 0.0, seed: int = 0,
        **options: Any) -> AsyncResult:
    return app.tasks["sits.generate_batched"].apply_async(
        (prompt,), {"max_new_tokens": n, "temperature": temperature, "seed": seed,
                    "stop_at_eos": False}, model="slow", **options)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_url: str, config_path: Path,
           models_dir: Path, app: Celery) -> Iterator[CeleryProcess]:
    """One worker, one child, joins on (``auto`` takes them only on GPUs), the slow model
    loaded (a cold start must not eat the long row's time limit)."""
    with serving(redis_url, config_path, models_dir, tmp_path_factory.mktemp("joins-logs"),
                 app, env={"SITS_BATCH_JOIN": "on", "SITS_TEST_SLOW_FORWARD_S": str(STEP_S)},
                 name="joins") as proc:
        gen(app, "warm up", 1).get(timeout=FIRST_CALL_S)
        yield proc


@pytest.fixture(scope="module")
def first(app: Celery, r: redis.Redis, worker: CeleryProcess) -> dict[str, AsyncResult]:
    """A long row running alone (a batch of one: nothing else waits), and a short one
    submitted once it runs: joined and stored early, it shows the long one decoding."""
    long = gen(app, "once upon a time", LONG, **LIMITS)
    # taken by the idle worker (its own batch, with its own time limits) before the
    # short one is sent: once it is in, the full worker takes more only as joins
    waiting = QueueKeys.for_queue("celery").waiting
    wait_for(lambda: r.zcard(waiting) == 0, timeout_s=CALL_S,
             what="the worker to take the long row")
    short = gen(app, "the cat", 2, **LIMITS)
    assert short.get(timeout=CALL_S)["sits"]["batch"]["joined"] is True
    assert long.state != "SUCCESS"
    return {"long": long, "short": short}


@pytest.fixture(scope="module")
def later(app: Celery, first: dict[str, AsyncResult]) -> list[AsyncResult]:
    """Submitted while the long row decodes."""
    return [gen(app, p, n, t, s, **LIMITS) for p, n, t, s in LATER]


def test_tasks_join_a_running_batch_and_decode_as_alone(
        first: dict[str, AsyncResult], later: list[AsyncResult], models_dir: Path) -> None:
    from sits_queue.cache.engines import engine_from_path
    from sits_queue.workers.inference import generate

    joined = [r.get(timeout=CALL_S) for r in later[:2]]
    long = first["long"].get(timeout=CALL_S)
    engine = engine_from_path("gpt", models_dir / "gpt", "cpu")  # the slow model's weights
    engine.to_device("cpu")
    for (prompt, n, t, s), got, result in zip(LATER[:2], joined, later[:2], strict=True):
        assert got["sits"]["batch"]["joined"] is True
        alone = generate(engine, prompt, max_new_tokens=n, temperature=t, seed=s,
                         stop_at_eos=False)
        assert got["output"] == {**alone, "shared_tokens": 0}
        # stored when done, while the long row went on
        assert result.date_done < first["long"].date_done
        assert got["sits"]["run_ms"] < long["sits"]["run_ms"]
        # its own run, warm, timed from its join: not the batch's figures
        sits = got["sits"]
        assert (sits["cold"], sits["source"], sits["load_ms"]) == (False, "device", 0.0)
        assert 0 < sits["first_token_ms"] <= sits["run_ms"]
        assert sits["first_token_ms"] != long["sits"]["first_token_ms"]
        # the batch's size is the calls it began with, the long row alone, for every
        # member; a joined call's index counts on from there
        assert sits["batch"]["size"] == 1 and sits["batch"]["index"] >= 1
    assert long["output"]["tokens"] == LONG and "joined" not in long["sits"]["batch"]
    assert long["sits"]["batch"] == {"size": 1, "index": 0}


def test_a_row_that_would_not_finish_before_the_soft_limit_runs_after_the_batch(
        first: dict[str, AsyncResult], later: list[AsyncResult]) -> None:
    got = later[2].get(timeout=CALL_S)
    assert got["output"]["tokens"] == LATER[2][1]
    assert "joined" not in got["sits"]["batch"]
    assert later[2].date_done > first["long"].date_done


def test_joined_tasks_are_counted_and_no_join_keys_are_left(
        r: redis.Redis, worker: CeleryProcess, later: list[AsyncResult]) -> None:
    for result in later:
        result.get(timeout=CALL_S)

    def counters() -> dict[str, float]:
        record = metrics.read(r, "", worker.hostname)[0]
        return {k.decode(): float(v) for k, v in record["counters"].items()}

    # results are stored as each task finishes; the batch's counts and its join keys'
    # removal follow when it ends (from the child, then the main process)
    wait_for(lambda: counters().get("model_runs:slow") == 3 + len(LATER)  # each task once
             and not list(r.scan_iter(match="*:join:*")), 30, "the batches to end")
    assert counters()["joined"] == 3  # the short one and the later two (the last declined)
    assert counters()["ftt"] == 3 + len(LATER)  # each generation's own first token
    assert counters().get("failed", 0) == 0  # a joined task that succeeded is no failure


def test_a_soft_limit_fails_the_rows_still_going_and_keeps_the_joined_ones_done(
        app: Celery, r: redis.Redis, worker: CeleryProcess,
        later: list[AsyncResult]) -> None:
    for result in later:  # the module's first batch and its rerun are over
        result.get(timeout=CALL_S)
    # ~200 x 50 ms = 10 s asked for, a 1.5 s soft limit: it stops mid-way
    doomed_limits = {"soft_time_limit": 1.5, "time_limit": 30}
    doomed = gen(app, "a row that runs out of time", 200, **doomed_limits)
    waiting = QueueKeys.for_queue("celery").waiting
    wait_for(lambda: r.zcard(waiting) == 0, timeout_s=CALL_S,
             what="the worker to take the doomed row")
    # joins (3 x 50 ms fits) and is done well before
    quick = gen(app, "in and out", 3, **doomed_limits)
    got = quick.get(timeout=CALL_S)
    assert got["sits"]["batch"]["joined"] is True and got["output"]["tokens"] == 3
    # (the loop's own check says how far it got; Celery's signal, due at the same
    # moment, may land first and say nothing: either is the soft limit)
    with pytest.raises(SoftTimeLimitExceeded):
        doomed.get(timeout=CALL_S)
    assert quick.state == "SUCCESS"  # stored when done: the batch's failure leaves it
    # the child serves on
    assert gen(app, "after", 2).get(timeout=CALL_S)["output"]["tokens"] == 2
