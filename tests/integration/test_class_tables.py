"""A producer and a worker of different class tables (a fleet upgraded host by host, one
release renaming classes): what the producer sent runs, retries and goes on down its
chain at the worker, in the worker's own classes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery, chain, chord

from sits_queue.broker.keys import QueueKeys
from sits_queue.errors import InvalidTaskOptions
from sits_queue.procs import CeleryProcess
from tests.waiting import wait_for

Spawn = Callable[..., CeleryProcess]

#: The worker's table: none of the producer's "medium" or "low".
FOUR_CLASSES = """
default_class = "batch"
[[classes]]
name = "critical"
cpu_cores = 1
vram_gib = 8
max_run_s = 20
weight = 1000
latency_sla_ms = 500
loss_sensitivity = 0.9
[[classes]]
name = "high"
[[classes]]
name = "batch"
cpu_cores = 1
vram_gib = 4
max_run_s = 30
weight = 5
latency_sla_ms = 10000
loss_sensitivity = 0.3
[[classes]]
name = "scavenger"
cpu_cores = 1
vram_gib = 2
max_run_s = 30
weight = 0.5
latency_sla_ms = 60000
loss_sensitivity = 0.1
"""


def test_a_class_the_worker_lacks_still_retries_and_chains_in_its_default_class(
        spawn: Spawn, client_app: Celery, redis_client: redis.Redis, tmp_path: Path) -> None:
    """(the retry was refused, "unknown sla_class 'medium'", and dead-lettered; a chain
    stopped at its second step, which failed with the same error)"""
    table = tmp_path / "four.toml"
    table.write_text(FOUR_CLASSES)
    worker = spawn(concurrency=1, config=str(table))
    # When the producer's "medium" task retries itself at the worker
    retried = client_app.tasks["w.flaky"].apply_async(("other-table", 1), sla_class="medium")
    # Then it runs again, in the worker's default class
    outcome = retried.get(timeout=30)
    assert (outcome["runs"], outcome["retries"], outcome["sla_class"]) == (2, 1, "batch")
    # So does one sent with a hand-made header naming only its class (nothing carried
    # as keywords: the header Celery copied into the retry was checked again, refused)
    by_hand = client_app.tasks["w.flaky"].apply_async(
        ("other-table-header", 1), headers={"sits": {"sla_class": "low"}})
    outcome = by_hand.get(timeout=30)
    assert (outcome["runs"], outcome["retries"], outcome["sla_class"]) == (2, 1, "batch")
    # And a chain of the producer's "medium" steps runs to its end
    add = client_app.tasks["w.add"]
    steps = chain(add.s(1, 2).set(sla_class="medium"), add.s(10).set(sla_class="medium"),
                  add.s(100).set(sla_class="medium"))
    assert steps.apply_async().get(timeout=30) == 113
    # And a chord whose body is of the producer's "medium": the body is sent on by the
    # header's last task, as a result backend's callback (it failed the chord,
    # "ChordError: Callback error: InvalidTaskOptions")
    total = client_app.tasks["w.total"]
    joined = chord([add.s(1, 2).set(sla_class="medium"), add.s(3, 4)],
                   total.s().set(sla_class="medium"))
    assert joined.apply_async().get(timeout=30) == 10
    # a chord whose body is a chain, and a chain's step that replaces itself (Celery
    # carries the chain on into the replacement: its later steps were checked there
    # against the worker's table, and the replacement refused)
    chained_body = chord([add.s(1, 2), add.s(3, 4)],
                         chain(total.s().set(sla_class="medium"),
                               add.s(100).set(sla_class="medium")))
    assert chained_body.apply_async().get(timeout=30) == 110
    replacing = chain(client_app.tasks["w.add_by_replacing"].s(1, 1).set(sla_class="medium"),
                      add.s(1000).set(sla_class="medium"))
    assert replacing.apply_async().get(timeout=30) == 1002
    # while a class the task's own code names for its replacement is refused there
    typo = client_app.tasks["w.add_by_replacing"].delay(1, 1, "typo")
    with pytest.raises(InvalidTaskOptions, match="unknown sla_class 'typo'"):
        typo.get(timeout=30)
    # Said in the worker's log, with what it ran them as; nothing dead-lettered
    said = "'medium' is not in this worker's classes"
    wait_for(lambda: f"w.total: sla_class {said}" in worker.log_path.read_text()
             and worker.log_path.read_text().count(said) >= 4
             and "'low' is not in this worker's classes" in worker.log_path.read_text(),
             10, "the warnings",
             seen=lambda: worker.log_path.read_text()[-2000:])
    assert "sent on in 'batch'" in worker.log_path.read_text()
    # and so are the tasks run in a class other than their own, once a class
    classes = "['critical', 'high', 'batch', 'scavenger']"
    for name, asked in (("w.flaky", "medium"), ("w.flaky", "low")):
        assert worker.log_path.read_text().count(
            f"task {name}: sla_class '{asked}' is not in this worker's classes {classes} (a "
            f"producer of another class table?): runs in 'batch', with the time limits its "
            f"message carries") == 1
    assert redis_client.hlen(QueueKeys.for_queue("celery").dead) == 0


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_a_task_of_a_class_the_worker_lacks_is_said_on_every_pool(
        spawn: Spawn, client_app: Celery, tmp_path: Path, pool: str) -> None:
    """(said from the pool child's runtime alone: a threads pool, which has none, ran
    such tasks unsaid)"""
    table = tmp_path / "four.toml"
    table.write_text(FOUR_CLASSES)
    worker = spawn(concurrency=1, pool=pool, config=str(table))
    assert client_app.tasks["w.add"].apply_async((1, 2), sla_class="low").get(timeout=30) == 3
    wait_for(lambda: "task w.add: sla_class 'low' is not in this worker's classes" in
             worker.log_path.read_text() and "runs in 'batch'" in worker.log_path.read_text(),
             10, "the warning", seen=lambda: worker.log_path.read_text()[-2000:])
