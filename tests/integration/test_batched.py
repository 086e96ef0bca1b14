"""Same-model batching in a real ``celery worker`` subprocess with tiny real models.

The tasks of the first tests are submitted *before* the worker starts, so they all wait
together and the batches the worker forms are fixed by the queue, not by timing: the
first pick of a batch task takes it and its kin up to ``max_batch``. One worker, one
child (the CPU default) serves the module; tests run in file order.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery.result import AsyncResult

from sits_queue.errors import InferenceError, InvalidInput
from sits_queue.procs import CeleryProcess
from tests.integration.counting import counters_once
from tests.integration.inference_app import BATCH_ECHO_MAX, CALL_S, FIRST_CALL_S, serving
from tests.waiting import wait_for

#: Tasks submitted before the worker starts: two full batches of t.batch_echo and a part.
ECHO_TAGS = [f"e{i}" for i in range(2 * BATCH_ECHO_MAX + 3)]
ECHO_TAGS[3] = "bad"
#: Generations: prompt, max_new_tokens, temperature, seed (greedy and sampled together).
PROMPTS = [("Once upon a time", 6, 0.0, 0), ("The cat", 9, 1.5, 3),
           ("In a galaxy far away there was", 4, 0.0, 0), ("", 5, 0.0, 0),
           ("Hello", 12, 0.9, 8)]
#: Generations that start with one of two instruction templates, mixed in one batch: the
#: batch prefills each template once.
TEMPLATE = "Summarise this operations log in one line and keep every number: "
OTHER_TEMPLATE = ("Translate this status line into plain words for a customer who does "
                  "not run the cluster, in one short sentence: ")
TEMPLATED = [(TEMPLATE, "disk 3 is full"), (OTHER_TEMPLATE, "node 7 rebooted twice"),
             (TEMPLATE, "latency is up"), (OTHER_TEMPLATE, "all green")]
TEXTS = ["the cache warms", "a model serves", "queues wait", "batches run together",
         "one more text", "and the last one is a little longer than the others"]



@pytest.fixture(scope="module")
def waiting(app: Celery) -> dict[str, Any]:
    """Submitted with no worker up: echo tasks (one already expired), embeds of two
    normalisations and one bad embed, all waiting together."""
    echo = [app.tasks["t.batch_echo"].delay(tag) for tag in ECHO_TAGS]
    expired = app.tasks["t.batch_echo"].apply_async(
        ("expired",), expires=datetime.now(UTC) - timedelta(seconds=5))
    # its own time limits: not the kin of the echo batches (it ran under their first
    # task's limits, the class's, and its soft limit never fired)
    limited = app.tasks["t.batch_echo"].apply_async(("sleep:3",), soft_time_limit=1,
                                                    time_limit=20)
    embeds = [app.tasks["sits.embed"].apply_async((text,), model="enc") for text in TEXTS]
    raw = app.tasks["sits.embed"].apply_async((TEXTS[:2],), {"normalize": False},
                                              model="enc")
    empty = app.tasks["sits.embed"].apply_async(([],), model="enc")
    gens = [app.tasks["sits.generate_batched"].apply_async(
        (prompt,), {"max_new_tokens": n, "temperature": t, "seed": s}, model="gpt")
            for prompt, n, t, s in PROMPTS]
    templated = [app.tasks["sits.generate_batched"].apply_async(
        (template + item,), {"max_new_tokens": 5, "stop_at_eos": False}, model="gpt",
        sla_class="low") for template, item in TEMPLATED]  # another class: a batch of their own
    return {"echo": echo, "expired": expired, "limited": limited, "embeds": embeds,
            "raw": raw, "empty": empty, "gens": gens, "templated": templated}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_url: str, config_path: Path,
           models_dir: Path, app: Celery, waiting: dict[str, Any]) -> Iterator[CeleryProcess]:
    with serving(redis_url, config_path, models_dir, tmp_path_factory.mktemp("batched-logs"),
                 app, name="batched") as proc:
        yield proc


def results(found: list[AsyncResult], timeout: float = FIRST_CALL_S) -> list[Any]:
    """Each task's result, or the exception it failed with."""
    out: list[Any] = []
    for one in found:
        try:
            out.append(one.get(timeout=timeout))
        except Exception as exc:  # the failures are what some tests check
            out.append(exc)
    return out


def test_waiting_tasks_run_as_batches_of_at_most_max_batch(
        waiting: dict[str, Any], worker: CeleryProcess) -> None:
    got = results(waiting["echo"])
    ids = [one.id for one in waiting["echo"]]
    ok = [(i, g) for i, g in zip(ids, got, strict=True) if not isinstance(g, Exception)]
    # Given 19 tasks waiting before the worker started, when it picks them, then they
    # run as batches of 8, 8 and 3 (the expired one left the last), in one child.
    batches = {tuple(g["output"]["ids"]) for _, g in ok}
    assert sorted(len(b) for b in batches) == [3, BATCH_ECHO_MAX, BATCH_ECHO_MAX], batches
    assert sorted(i for b in batches for i in b) == sorted(ids)  # each task in one batch
    for own, g in ok:
        batch = g["output"]["ids"]
        assert g["sits"]["batch"] == {"size": len(batch), "index": batch.index(own)}
        assert g["output"]["size"] == len(batch)
        # celery.current_task is the batch's task, under its first call's request (it
        # was None: the function runs outside Celery's tracer)
        assert g["output"]["current"] == ["t.batch_echo", batch[0]]
    assert len({g["output"]["pid"] for _, g in ok}) == 1
    assert [g["output"]["tag"] for _, g in ok] == [t for t in ECHO_TAGS if t != "bad"]


def test_a_bad_call_fails_alone(waiting: dict[str, Any], worker: CeleryProcess) -> None:
    got = results(waiting["echo"])
    bad = got[ECHO_TAGS.index("bad")]
    assert isinstance(bad, InvalidInput) and "'bad' is bad" in str(bad)
    assert sum(isinstance(g, Exception) for g in got) == 1


def test_a_task_with_its_own_time_limits_runs_under_them(
        waiting: dict[str, Any], worker: CeleryProcess) -> None:
    # Given a task that set a 1 s soft limit, waiting behind echo tasks of the class's
    # limits, when the worker picks them, then it runs in a batch of its own and stops
    with pytest.raises(SoftTimeLimitExceeded):
        waiting["limited"].get(timeout=FIRST_CALL_S)
    assert all(len(g["output"]["ids"]) <= BATCH_ECHO_MAX and waiting["limited"].id
               not in g["output"]["ids"] for g in results(waiting["echo"])
               if not isinstance(g, Exception))


def test_an_expired_member_leaves_its_batch_to_run(waiting: dict[str, Any],
                                                   worker: CeleryProcess) -> None:
    # The expired task was picked with the last batch; Celery revoked it on receipt, and
    # the rest of that batch ran without it (the transport said the batch was whole).
    last = results(waiting["echo"][-3:])
    assert all(g["output"]["size"] == 3 for g in last)
    # (its state is stored by the worker's main process, the batch's results by the
    # child: in either order)
    wait_for(lambda: waiting["expired"].state == "REVOKED", FIRST_CALL_S,
             "the expired task's REVOKED state")


def test_embeds_batch_together_and_match_a_lone_run(waiting: dict[str, Any],
                                                    worker: CeleryProcess,
                                                    models_dir: Path) -> None:
    from sits_queue.cache.engines import engine_from_path
    from sits_queue.workers.inference import embed

    got = results(waiting["embeds"])
    assert all(g["sits"]["batch"]["size"] >= 2 for g in got), [g["sits"] for g in got]
    engine = engine_from_path("enc", models_dir / "enc", "cpu")
    for text, g in zip(TEXTS, got, strict=True):
        alone = embed(engine, text)
        assert max(abs(a - b) for a, b in zip(g["output"], alone, strict=True)) < 1e-4
    raw = waiting["raw"].get(timeout=CALL_S)["output"]
    for got_vec, own in zip(raw, embed(engine, TEXTS[:2], normalize=False), strict=True):
        assert got_vec == pytest.approx(own, abs=1e-4)
    empty = results([waiting["empty"]])[0]
    assert isinstance(empty, InvalidInput) and "non-empty" in str(empty)


def test_generations_batch_and_match_a_lone_run_greedy_or_sampled(
        waiting: dict[str, Any], worker: CeleryProcess, models_dir: Path) -> None:
    from sits_queue.cache.engines import engine_from_path
    from sits_queue.workers.inference import generate

    got = results(waiting["gens"])
    engine = engine_from_path("gpt", models_dir / "gpt", "cpu")
    engine.to_device("cpu")
    for (prompt, n, t, s), g in zip(PROMPTS, got, strict=True):
        if not prompt:  # the empty prompt fails alone
            assert isinstance(g, InvalidInput) and "non-empty string" in str(g)
            continue
        assert g["sits"]["batch"]["size"] == len(PROMPTS)
        alone = generate(engine, prompt, max_new_tokens=n, temperature=t, seed=s)
        assert g["output"] == {**alone, "cached_tokens": 0, "shared_tokens": 0}
        # Every row's first token came with the batch's first step, cold start included
        assert 0 < g["sits"]["first_token_ms"] <= g["sits"]["run_ms"] + sum(
            g["sits"][f"{p}_ms"] for p in ("cuda_ctx", "load", "promote", "warmup")) + 200
    firsts = {g["sits"]["first_token_ms"] for g in got if not isinstance(g, Exception)}
    assert len(firsts) == 1
    # Each row's result was stored when the row was done, not with the batch's end: the
    # shorter a row, the sooner (its run_ms, and when the worker stored it)
    done = sorted((n, g["sits"]["run_ms"], one.date_done) for (_, n, _, _), g, one
                  in zip(PROMPTS, got, waiting["gens"], strict=True)
                  if not isinstance(g, Exception))
    assert [n for n, _, _ in done] == [4, 6, 9, 12]
    for (_, ms, at), (_, later_ms, later_at) in itertools.pairwise(done):
        assert ms < later_ms and at < later_at


@pytest.fixture(scope="module")
def later(app: Celery, waiting: dict[str, Any], worker: CeleryProcess) -> dict[str, Any]:
    """A call with the first template, sent alone once the templated batch is done (a
    fixture: the counters test counts it, run alone too)."""
    results(waiting["templated"])
    return app.tasks["sits.generate_batched"].apply_async(  # type: ignore[no-any-return]
        (TEMPLATE + "a new line",), {"max_new_tokens": 5, "stop_at_eos": False},
        model="gpt").get(timeout=CALL_S)["output"]


def test_a_batch_mixing_templates_prefills_each_once_and_keeps_them_for_the_next(
        waiting: dict[str, Any], worker: CeleryProcess, models_dir: Path,
        later: dict[str, Any]) -> None:
    from sits_queue.cache.engines import engine_from_path
    from sits_queue.workers.inference import generate

    got = results(waiting["templated"])
    engine = engine_from_path("gpt", models_dir / "gpt", "cpu")
    engine.to_device("cpu")
    assert all(g["sits"]["batch"]["size"] == len(TEMPLATED) for g in got)
    # Each template's rows share that template's tokens (its own length)
    shares = {t: {g["output"]["shared_tokens"] for (tt, _), g in zip(TEMPLATED, got,
                                                                     strict=True) if tt == t}
              for t in (TEMPLATE, OTHER_TEMPLATE)}
    assert all(len(n) == 1 and min(n) >= 16 for n in shares.values()), shares
    shared = min(shares[TEMPLATE])
    assert shared < min(shares[OTHER_TEMPLATE])  # the longer template shares more
    for (template, item), g in zip(TEMPLATED, got, strict=True):
        alone = generate(engine, template + item, max_new_tokens=5, stop_at_eos=False)
        assert g["output"] == {**alone, "cached_tokens": 0,
                               "shared_tokens": min(shares[template])}
    # A later call with the same template, alone in its batch, finds the template in the
    # worker's KV-prefix cache (the batch stored it there)
    assert 16 <= later["cached_tokens"] <= shared and later["shared_tokens"] == 0
    assert later == {**generate(engine, TEMPLATE + "a new line", max_new_tokens=5,
                                stop_at_eos=False),
                     "cached_tokens": later["cached_tokens"], "shared_tokens": 0}


def test_counters_count_tasks_not_batches(r: redis.Redis, worker: CeleryProcess,
                                          waiting: dict[str, Any],
                                          later: dict[str, Any]) -> None:
    results([*waiting["echo"], waiting["expired"], waiting["limited"], *waiting["embeds"],
             waiting["raw"], waiting["empty"], *waiting["gens"], *waiting["templated"]])
    # 18 echo tasks ran (1 failed by its own output) + 6 + 1 embeds; one more embed
    # failed on input, alone; 4 generations + one that failed on input; the templated
    # batch and the later call (its fixture). A batch's cold start counts once.
    generations = len(PROMPTS) + len(TEMPLATED) + 1
    counters = counters_once(r, worker.hostname, lambda c: c.get("model_runs:gpt", 0) >= len(
        ECHO_TAGS) + generations and c.get("failed:InvalidInput", 0) >= 3 and c.get(
        "ftt", 0) >= generations, "every batch's counts")
    assert counters["tasks"] >= len(ECHO_TAGS) + len(TEXTS) + 1
    assert counters["model_runs:gpt"] == len(ECHO_TAGS) + generations
    assert counters["failed:InvalidInput"] == 3
    assert counters["ftt"] == generations  # each generation batch's tasks, one first token
    assert counters["kv_hits"] >= 1  # the later call's template, from the KV-prefix cache
    assert counters["cold"] <= 2


def test_an_idle_worker_runs_a_call_at_once_as_a_batch_of_one(
        app: Celery, waiting: dict[str, Any], worker: CeleryProcess) -> None:
    # idle: the echo tasks that waited for the worker are done (run alone, this test
    # would otherwise find them queued and join their batch)
    results(waiting["echo"] + [waiting["limited"]])
    got = app.tasks["t.batch_echo"].delay("alone").get(timeout=CALL_S)
    assert got["output"]["size"] == 1 and got["sits"]["batch"] == {"size": 1, "index": 0}


def test_a_crashed_run_fails_every_call_and_the_worker_serves_on(
        app: Celery, worker: CeleryProcess) -> None:
    got = app.tasks["t.batch_echo"].delay("boom")
    with pytest.raises(RuntimeError, match="batch run crashed"):
        got.get(timeout=CALL_S)
    short = app.tasks["t.batch_short"].delay("x")
    with pytest.raises(InferenceError, match="returned 0 outputs for 1 calls"):
        short.get(timeout=CALL_S)
    assert app.tasks["t.batch_echo"].delay("after").get(timeout=CALL_S)["output"]["tag"] \
        == "after"


def test_a_batch_function_that_retries_or_exits_fails_each_call_by_its_own_name(
        app: Celery, worker: CeleryProcess) -> None:
    """(retry() from a batch function sent nothing, its request hand-made: each call was
    stored as RETRY and never ran again; and an exit named the first call's id in every
    call's failure, as its own)"""
    from sits_queue.errors import TaskExited

    retried = app.tasks["t.batch_echo"].delay("retry")
    with pytest.raises(InferenceError, match="a batch function cannot retry"):
        retried.get(timeout=CALL_S)
    exited = app.tasks["t.batch_echo"].delay("exit")
    with pytest.raises(TaskExited, match=rf"the batch of 1 t\.batch_echo calls led by "
                                         rf"{exited.id} tried to end its process"):
        exited.get(timeout=CALL_S)
    assert app.tasks["t.batch_echo"].delay("after").get(timeout=CALL_S)["output"]["tag"] \
        == "after"


def test_a_work_function_that_exits_leaves_the_worker_serving(
        app: Celery, worker: CeleryProcess) -> None:
    """(``work=`` runs in the worker's main process: its sys.exit() ended the worker once
    the batch had run, and the message, given back unacked, ended the next worker too)"""
    weighed = app.tasks["t.batch_weighed"]
    assert weighed.delay("exit").get(timeout=CALL_S)["output"] == 4
    assert weighed.delay("after").get(timeout=CALL_S)["output"] == 5
    assert worker.popen.poll() is None
    said = "task t.batch_weighed: its work= function failed on a call's arguments " \
           "(SystemExit: 3)"
    wait_for(lambda: said in worker.log_path.read_text(), 10, "the warning")


def test_soft_time_limit_fails_the_batch_and_the_child_lives(
        app: Celery, worker: CeleryProcess) -> None:
    got = app.tasks["t.batch_echo"].apply_async(("sleep:3",), soft_time_limit=1,
                                               time_limit=20)
    with pytest.raises(SoftTimeLimitExceeded):
        got.get(timeout=CALL_S)
    assert worker.alive()
    # The pool's timeout callback reached the request (billiard calls it by keyword)
    _logged(worker, f"Soft time limit (1.0s) exceeded for t.batch_echo[{got.id}]")
    assert app.tasks["t.batch_echo"].delay("later").get(timeout=CALL_S)["output"]["tag"] \
        == "later"


def test_a_hard_time_limit_fails_the_batch_and_the_child_is_replaced(
        app: Celery, worker: CeleryProcess) -> None:
    # A run that sleeps through its soft limit: the pool kills the child at the hard one
    got = app.tasks["t.batch_echo"].apply_async(("hang:30",), soft_time_limit=1,
                                               time_limit=3)
    with pytest.raises(TimeLimitExceeded):
        got.get(timeout=CALL_S)
    assert worker.alive()
    _logged(worker, f"Hard time limit (3.0s) exceeded for t.batch_echo[{got.id}]")
    # (limits past the class's: the replacement child's cold start counts against them)
    after = app.tasks["t.batch_echo"].apply_async(
        ("after-kill",), soft_time_limit=90, time_limit=110).get(timeout=FIRST_CALL_S)
    assert after["output"]["tag"] == "after-kill"


def test_a_batch_that_missed_its_soft_limit_is_cut_so_the_next_ones_fit(
        app: Celery, worker: CeleryProcess, waiting: dict[str, Any]) -> None:
    from sits_queue.broker.bulk import enqueue_many

    _settled(waiting)
    echo = app.tasks["t.batch_echo"]
    # (limits of their own: a batch key no other test's batches taught anything)
    limits = {"soft_time_limit": 2, "time_limit": 31}
    # Eight calls of 0.3 s each, waiting together: one batch of 8 needs 2.4 s. Nothing
    # is known of the key yet, so it runs whole, and its soft limit fails every call
    missed = enqueue_many(echo, [("sleep:0.3",)] * BATCH_ECHO_MAX, **limits)
    for task_id in missed:
        with pytest.raises(SoftTimeLimitExceeded):
            app.AsyncResult(task_id).get(timeout=CALL_S)
    # The same eight again: the worker learned that 8 needed over 2 s, so it runs only
    # as many as fit 80% of the limit and gives the rest back to the queue for the next
    # batch: every call succeeds, still in batches
    again = enqueue_many(echo, [("sleep:0.3",)] * BATCH_ECHO_MAX, **limits)
    got = [app.AsyncResult(task_id).get(timeout=CALL_S) for task_id in again]
    sizes = [g["output"]["size"] for g in got]
    assert 1 < max(sizes) < BATCH_ECHO_MAX, sizes
    _logged(worker, f"batch of {BATCH_ECHO_MAX} t.batch_echo tasks cut to ")
    assert "went back to their queue" in worker.log()


def _settled(waiting: dict[str, Any]) -> None:
    """Every task the module submitted before its worker started has ended (run alone,
    a test below would see them join its batch)."""
    for found in waiting.values():
        results(found if isinstance(found, list) else [found])


def _busy(app: Celery, worker: CeleryProcess) -> AsyncResult:
    """A task running in the one child: what is submitted now waits (the prefetch is
    full) and is picked as one batch when it ends. (A plain task submitted first could
    be overtaken by affinity: the warm model's task went first.)"""
    busy = app.tasks["t.batch_echo"].delay("sleep:2")
    _active(app, worker, {busy.id})
    return busy


def _active(app: Celery, worker: CeleryProcess, ids: set[str]) -> None:
    """Wait until the worker runs every task of ``ids``."""
    def running() -> bool:
        replies = app.control.inspect(destination=[worker.hostname], timeout=1).active() or {}
        return ids <= {t["id"] for tasks in replies.values() for t in tasks}
    wait_for(running, FIRST_CALL_S, "the batch to run")


def test_terminating_one_member_gives_its_batch_mates_back_to_run(
        app: Celery, waiting: dict[str, Any], worker: CeleryProcess) -> None:
    """(revoke(terminate=True) of one member killed the child running its whole batch,
    and every member was announced revoked and acked: the others never ran)"""
    _settled(waiting)
    # Given one batch of four running (they waited behind a task holding the one child)
    busy = _busy(app, worker)
    tags = ["sleep:4", "a", "b", "victim"]
    # Limits of their own, past the class's 24 s soft limit: the rerun starts in the
    # replacement child, whose cold start (import torch, load the model) counts against
    # it, and took over 20 s on a 2-core CI runner busy with other modules
    members = [app.tasks["t.batch_echo"].apply_async((tag,), soft_time_limit=90,
                                                     time_limit=110) for tag in tags]
    busy.get(timeout=CALL_S)
    _active(app, worker, {m.id for m in members})
    # When the last is revoked with terminate=True
    app.control.revoke(members[3].id, terminate=True)
    # Then it alone is revoked; its batch-mates run again and succeed
    got = results(members)
    assert [g["output"]["tag"] for g in got[:3]] == tags[:3]
    assert AsyncResult(members[3].id, app=app).state == "REVOKED"
    assert worker.alive()


def test_a_running_member_is_started_and_a_revoke_without_terminate_lets_it_finish(
        app: Celery, waiting: dict[str, Any], worker: CeleryProcess, redis_url: str,
        config_path: Path, models_dir: Path, tmp_path: Path) -> None:
    """(a batch's members stayed PENDING while it ran, their records written only by
    their traces after it: revoke(id) without terminate, on a worker that did not hold
    the batch, marked a running member REVOKED and its caller's get() raised
    TaskRevokedError, though the batch ran it and stored its SUCCESS after)"""
    _settled(waiting)
    # Given a second worker, which holds none of the batch (it consumes another queue)
    with serving(redis_url, config_path, models_dir, tmp_path, app, name="bystander",
                 pool="solo", env={"SITS_PREIMPORT": "0"},
                 extra_args=("-Q", "bystander")) as bystander:
        # And a batch of two running on the first (they waited behind a busy task)
        busy = _busy(app, worker)
        members = [app.tasks["t.batch_echo"].delay(tag) for tag in ("sleep:4", "a")]
        busy.get(timeout=CALL_S)
        _active(app, worker, {m.id for m in members})
        # Then each member is STARTED while the batch runs, as a plain task is
        seen: list[str] = []
        wait_for(lambda: _past_pending(app, members, seen), FIRST_CALL_S,
                 "the members' states")
        assert seen == ["STARTED", "STARTED"]
        # When one is revoked without terminate, and both workers have handled it
        replies = app.control.revoke(members[1].id, reply=True, timeout=10,
                                     destination=[worker.hostname, bystander.hostname])
        assert len(replies) == 2, replies
        # Then it is not marked revoked (asked at once, while its batch sleeps on), and
        # its caller gets its result when the batch ends, as for a plain task
        assert AsyncResult(members[1].id, app=app).state in ("STARTED", "SUCCESS")
        got = results([members[1], members[0]], CALL_S)
        assert [g["output"]["tag"] for g in got] == ["a", "sleep:4"], got
        assert AsyncResult(members[1].id, app=app).state == "SUCCESS"


def _past_pending(app: Celery, members: list[AsyncResult], seen: list[str]) -> bool:
    """Whether no member is PENDING any more; their states then in ``seen``."""
    found = [AsyncResult(m.id, app=app).state for m in members]
    seen[:] = found
    return "PENDING" not in found


def test_a_hard_limit_spares_the_rows_that_had_finished(
        app: Celery, waiting: dict[str, Any], worker: CeleryProcess) -> None:
    """(each member's on_timeout ran: a row that had finished and stored its SUCCESS
    fired its errbacks and task_failure handlers, for a task that succeeded)"""
    _settled(waiting)
    # Given a short and a long generation in one batch, the long one stuck past its
    # soft limit (the "stuck" model) and an errback on the short one
    busy = _busy(app, worker)
    errback = app.tasks["t.ping"].si("errback fired").set(task_id=f"errback-{time.time()}")
    limits = {"soft_time_limit": 3, "time_limit": 5}
    short = app.tasks["sits.generate_batched"].apply_async(
        ("the cat",), {"max_new_tokens": 2, "stop_at_eos": False}, model="stuck",
        link_error=errback, **limits)
    long = app.tasks["sits.generate_batched"].apply_async(
        ("once upon a time",), {"max_new_tokens": 60, "stop_at_eos": False},
        model="stuck", **limits)
    busy.get(timeout=CALL_S)
    # When the short row finishes and the batch then meets its hard limit
    assert short.get(timeout=FIRST_CALL_S)["sits"]["batch"]["size"] == 2
    with pytest.raises(TimeLimitExceeded):
        long.get(timeout=FIRST_CALL_S)
    _logged(worker, f"Hard time limit (5.0s) exceeded for sits.generate_batched[{long.id}]")
    # (the failure callbacks of one run go out together: two round trips later, an
    # errback they sent has been received, and, one class, runs before the second)
    for tag in ("later", "later again"):
        assert app.tasks["t.ping"].delay(tag).get(timeout=FIRST_CALL_S) == tag
    # Then the short row stays a success: no hard limit is reported for it, its
    # errback never ran
    assert f"Hard time limit (5.0s) exceeded for sits.generate_batched[{short.id}]" \
        not in worker.log()
    assert AsyncResult(short.id, app=app).state == "SUCCESS"
    assert AsyncResult(errback.id, app=app).state == "PENDING"


def _logged(worker: CeleryProcess, line: str, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while line not in worker.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert line in worker.log(), worker.log()[-3000:]
    assert "Pool callback raised" not in worker.log(), worker.log()[-3000:]


def test_bad_max_batch_is_refused(app: Celery) -> None:
    with pytest.raises(ValueError, match="max_batch must be an integer"):
        app.batch_inference_task(model="gpt", max_batch=0)
    with pytest.raises(ValueError, match="max_batch"):
        app.batch_inference_task(model="gpt", max_batch=True)


def test_bulk_submitted_embeds_wait_together_and_run_in_batches(
        app: Celery, worker: CeleryProcess) -> None:
    from sits_queue.broker.bulk import enqueue_many

    # One put.lua call for all 40: the next pick finds them waiting together
    ids = enqueue_many(app.tasks["sits.embed"], [(f"text number {i}",) for i in range(40)],
                       model="enc")
    got = [app.AsyncResult(i).get(timeout=CALL_S) for i in ids]
    sizes = [g["sits"]["batch"]["size"] for g in got]
    assert max(sizes) > 1 and all(s <= 32 for s in sizes)  # batch_max_tasks
    assert len({len(g["output"]) for g in got}) == 1
