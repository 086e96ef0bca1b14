"""The beat (``priority/beat.py``'s scheduler over redbeat): a real ``celery beat`` that
lives through Redis outages, and an app's own schedule that cannot drop SITS's passes."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.beat import ScheduleEntry

from sits_queue.app import CONTROL_QUEUE, make_app
from sits_queue.broker.keys import QueueKeys, stats_key
from sits_queue.config import SitsConfig
from sits_queue.embedded import EmbeddedRedis
from sits_queue.priority.beat import SitsScheduler
from sits_queue.procs import start_beat, start_worker
from tests.integration.conftest import APP_MODULE, ROOT, worker_env
from tests.waiting import wait_for

CONTROL = QueueKeys.for_queue(CONTROL_QUEUE)


class Sends:
    """Maintenance tasks the beat has sent (no worker runs them): taken out of the control
    queue as they come, for the beat sends none of a task while one of it waits."""

    def __init__(self, url: str) -> None:
        self.url, self.count = url, 0

    def __call__(self) -> int:
        with contextlib.suppress(redis.ConnectionError):
            self.count += len(redis.Redis.from_url(self.url).zpopmin(CONTROL.waiting, 100))
        return self.count


@pytest.mark.parametrize("outage", ["stopped", "restarted empty"])
def test_the_beat_lives_through_a_redis_outage(tmp_path: Path, outage: str) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    port = server.port
    env = worker_env(url, rescore_interval_s="1", trigger_check_interval_s="1",
                     prewarm_interval_s="0")
    beat = start_beat(APP_MODULE, env, tmp_path / "logs", cwd=ROOT)
    sent = Sends(url)
    try:
        wait_for(lambda: sent() >= 2, 60, "the beat's first passes")
        # When Redis goes away for a few ticks and comes back on the same port: with its
        # data ("stopped": its lock and entries stay), or without (the lock is lost)
        if outage == "stopped":
            redis.Redis.from_url(url).save()
        server.stop()
        time.sleep(3)
        server = EmbeddedRedis(tmp_path / ("redis" if outage == "stopped" else "fresh"),
                               port=port, password=server.password)
        server.start()
        before = sent()
        # Then the beat is still there, sending the passes again
        wait_for(lambda: sent() >= before + 2, 60, "passes sent after the outage")
        assert beat.alive(), beat.log()[-3000:]
        assert "unreachable" in beat.log()
        if outage == "restarted empty":
            assert "lost its lock" in beat.log()
    finally:
        beat.stop(timeout_s=10)
        server.stop()


@pytest.mark.parametrize("rescore_interval_s", ["1", "300"])
def test_a_standby_beat_takes_over_once_the_lock_of_a_killed_one_expires(
        tmp_path: Path, redis_url: str, redis_client: redis.Redis,
        rescore_interval_s: str) -> None:
    """(redbeat takes the lock at start blocking, looking again every max_interval: the
    standby stood idle up to 300 s past the lock's expiry, with no rescoring or aging.
    And the lock lived 6 x the rescoring interval: 30 minutes at 300 s, with no trigger
    check sent all that time)"""
    redis_client.flushall()
    env = worker_env(redis_url, rescore_interval_s=rescore_interval_s,
                     trigger_check_interval_s="1", prewarm_interval_s="0")
    first = start_beat(APP_MODULE, env, tmp_path / "first", cwd=ROOT)
    standby = None
    sent = Sends(redis_url)
    try:
        wait_for(lambda: sent() >= 2, 60, "the first beat's passes")
        standby = start_beat(APP_MODULE, env, tmp_path / "standby", cwd=ROOT)
        wait_for(lambda: "beat: Starting..." in standby.log(), 60, "the standby to start")
        first.kill()
        before = sent()
        # The lock lives on for its timeout (15 s, however long the rescoring interval),
        # then the standby takes it
        wait_for(lambda: sent() >= before + 2, 90,
                 "passes from the standby once the lock expired")
        assert "beat: acquired lock" in standby.log()
        assert standby.alive(), standby.log()[-3000:]
    finally:
        first.stop(timeout_s=10)
        if standby is not None:
            standby.stop(timeout_s=10)


def test_a_leader_with_long_periods_keeps_its_lock_from_tick_to_tick(
        redis_url: str, redis_client: redis.Redis) -> None:
    """The lock's timeout no longer follows the rescoring interval: the beat's sleep
    between ticks (each extends the lock) must stay well inside it, whatever the
    entries' periods (a sleep to the next rescoring, 300 s, would outlive a 15 s lock)"""
    redis_client.flushall()
    app = make_app(SitsConfig(redis_url=redis_url, rescore_interval_s=300.0,
                              trigger_check_interval_s=600.0, prewarm_interval_s=0.0),
                   main="beat-long-periods")
    try:
        scheduler = SitsScheduler(app=app)
        for _ in range(3):
            sleep_s = scheduler.tick()
            assert scheduler.lock is not None
            ttl_s = redis_client.pttl(scheduler.lock_key) / 1000
            # Given the lock just extended, when the beat sleeps its sleep_s, then the
            # lock outlives that sleep several times over
            assert 0 < sleep_s <= scheduler.max_interval
            assert ttl_s > 5 * sleep_s - 1
            assert ttl_s <= scheduler.lock_timeout <= 30
        scheduler.close()
    finally:
        app.close()


def test_an_assigned_beat_schedule_keeps_the_sits_passes(redis_url: str,
                                                        redis_client: redis.Redis) -> None:
    """Celery's docs assign ``beat_schedule``: that must not unschedule rescoring."""
    app = make_app(SitsConfig(redis_url=redis_url), main="beat-assigned")
    app.conf.beat_schedule = {"tick": {"task": "app.tick", "schedule": 5.0}}
    redis_client.flushall()
    try:
        scheduler = SitsScheduler(app=app)
        assert {"tick", "sits-rescore", "sits-check-triggers"} <= set(app.conf.beat_schedule)
        scheduler.tick()  # (installed once it holds the lock)
        for name in ("tick", "sits-rescore", "sits-check-triggers"):
            assert redis_client.exists(f"sits:redbeat:{name}"), name
    finally:
        app.close()


def test_an_entry_whose_task_would_be_refused_is_left_out_in_one_error(
        redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
        ) -> None:
    """(it was sent each period and refused each time, with a stack dump)"""
    app = make_app(SitsConfig(redis_url=redis_url), main="beat-refused")
    schedule = {
        "bad-class": {"task": "app.tick", "schedule": 5.0, "options": {"sla_class": "nope"}},
        "bad-args": {"task": "app.tick", "schedule": 5.0, "args": 5},
        "bad-delivery": {"task": "app.tick", "schedule": 5.0, "options": {"task_id": ""}},
        "tick": {"task": "app.tick", "schedule": 5.0, "options": {"sla_class": "high"}},
        # one of SITS's own, changed by the app: its default runs (left out, rescoring
        # stopped, and with it aging and pruning)
        "sits-rescore": {"task": "sits.rescore", "schedule": 9.0,
                         "options": {"sla_class": "urgent"}},
    }
    app.conf.beat_schedule = dict(schedule)
    redis_client.flushall()
    try:
        with caplog.at_level("INFO", logger="sits_queue.priority.beat"):
            scheduler = SitsScheduler(app=app)
            scheduler.tick()
        said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(said) == 4, said
        assert any("'sits-rescore' (sits.rescore)" in line and "SITS's default entry runs "
                   "instead" in line for line in said)
        definition = json.loads(redis_client.hget("sits:redbeat:sits-rescore", "definition"))
        assert "urgent" not in json.dumps(definition) and \
            definition["schedule"]["every"] == app.sits.rescore_interval_s
        assert any("'bad-class' (app.tick)" in line and "sla_class 'nope'" in line
                   for line in said)
        assert any("'bad-args'" in line and "app.tick: task args must be a list or tuple, got int"
                   in line for line in said)
        assert any("'bad-delivery'" in line and "task_id" in line for line in said)
        assert redis_client.exists("sits:redbeat:tick")
        for name in ("bad-class", "bad-args", "bad-delivery"):
            assert not redis_client.exists(f"sits:redbeat:{name}"), name
        # An entry not in the app's schedule (put in Redis by other means) is refused as
        # it comes due: in one line, once, and the beat goes on
        caplog.clear()
        entry = ScheduleEntry(name="dynamic", task="app.tick", schedule=1.0, app=app,
                              options={"sla_class": "nope"})
        with caplog.at_level("INFO", logger="sits_queue.priority.beat"):
            assert scheduler.apply_async(entry, advance=False) is None
            assert scheduler.apply_async(entry, advance=False) is None
        (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert line.startswith("beat: dynamic (app.tick) not sent: unknown sla_class 'nope'")
        assert not caplog.records[0].exc_info
        scheduler.close()
    finally:
        app.close()


def test_a_standby_beat_leaves_the_leader_s_schedule_alone(
        redis_url: str, redis_client: redis.Redis) -> None:
    """(redbeat installs a beat's entries as it starts, before any lock, deleting what its
    schedule lacks: a standby without the user's tasks module deleted the leader's
    periodic tasks, and one with another interval changed the leader's rescoring)"""
    redis_client.flushall()
    leader_app = make_app(SitsConfig(redis_url=redis_url, rescore_interval_s=2.0),
                          main="beat-leader")
    leader_app.conf.beat_schedule = {"tick": {"task": "app.tick", "schedule": 5.0}}
    standby_app = make_app(SitsConfig(redis_url=redis_url, rescore_interval_s=30.0),
                           main="beat-standby")
    try:
        leader = SitsScheduler(app=leader_app)
        leader.tick()
        assert redis_client.exists("sits:redbeat:tick")
        rescore = redis_client.hget("sits:redbeat:sits-rescore", "definition")
        standby = SitsScheduler(app=standby_app)
        standby.tick()  # the lock is the leader's: it stands by
        assert standby.lock is None
        assert redis_client.exists("sits:redbeat:tick")
        assert redis_client.hget("sits:redbeat:sits-rescore", "definition") == rescore
        # Once the leader lets go, the standby's schedule is the one in Redis
        leader.close()
        standby.tick()
        assert standby.lock is not None
        assert not redis_client.exists("sits:redbeat:tick")
        assert json.loads(redis_client.hget("sits:redbeat:sits-rescore", "definition")
                          )["schedule"]["every"] == 30.0
        standby.close()
    finally:
        leader_app.close()
        standby_app.close()


def test_the_beat_lives_through_a_full_redis(tmp_path: Path) -> None:
    """(a server out of memory, maxmemory with noeviction, refused the beat's writes: it
    exited 1 on a traceback and stayed down once the server had room again)"""
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    env = worker_env(url, rescore_interval_s="1", trigger_check_interval_s="1",
                     prewarm_interval_s="0")
    beat = start_beat(APP_MODULE, env, tmp_path / "logs", cwd=ROOT)
    sent, client = Sends(url), redis.Redis.from_url(url)
    try:
        wait_for(lambda: sent() >= 2, 60, "the beat's first passes")
        # When the server is full (every write that may grow it refused)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
        wait_for(lambda: "beat: Redis is full" in beat.log() or not beat.alive(), 30,
                 "the beat to meet a full Redis")
        assert beat.alive(), beat.log()[-3000:]
        # Then, room again, it goes on
        client.config_set("maxmemory", 0)
        before = sent()
        wait_for(lambda: sent() >= before + 2, 60, "the beat's passes once there is room")
        assert beat.alive() and "Traceback" not in beat.log(), beat.log()[-3000:]
    finally:
        beat.stop(timeout_s=10)
        client.close()
        server.stop()


def test_a_beat_started_while_redis_is_away_waits_for_it(tmp_path: Path) -> None:
    """(the schedule's install at start met the connection error and ended the beat)"""
    first = EmbeddedRedis(tmp_path / "probe")
    first.start()
    port, password = first.port, first.password
    url = first.url
    first.stop()  # a port and password a server will have, with none there yet
    env = worker_env(url, rescore_interval_s="1", trigger_check_interval_s="1",
                     prewarm_interval_s="0")
    beat = start_beat(APP_MODULE, env, tmp_path / "logs", cwd=ROOT)
    server = EmbeddedRedis(tmp_path / "redis", port=port, password=password)
    try:
        wait_for(lambda: "unreachable" in beat.log() or not beat.alive(), 60,
                 "the beat to meet no Redis")
        assert beat.alive(), beat.log()[-3000:]
        server.start()
        sent = Sends(url)
        wait_for(lambda: sent() >= 2, 60, "the beat's passes once Redis is there")
        assert beat.alive(), beat.log()[-3000:]
    finally:
        beat.stop(timeout_s=10)
        server.stop()


def test_assigned_task_routes_keep_the_beat_s_passes_on_the_control_queue(
        redis_url: str, redis_client: redis.Redis) -> None:
    """(assigning ``task_routes`` replaced the entry that routed them: they went to the
    default queue, behind its backlog, or to no worker at all with ``-Q gpu``)"""
    app = make_app(SitsConfig(redis_url=redis_url), main="routes-assigned")
    app.conf.task_routes = {"app.render": {"queue": "gpu"}}
    default = QueueKeys.for_queue(app.conf.task_default_queue)
    try:
        before = redis_client.zcard(CONTROL.waiting)
        app.tasks["sits.rescore"].delay()
        app.send_task("sits.check_triggers")
        assert redis_client.zcard(CONTROL.waiting) == before + 2
        assert redis_client.zcard(default.waiting) == 0
        # an explicit queue still wins, as in Celery
        app.tasks["sits.rescore"].apply_async(queue="elsewhere")
        assert redis_client.zcard(QueueKeys.for_queue("elsewhere").waiting) == 1
    finally:
        app.close()


def test_the_beat_s_passes_go_to_the_control_queue_on_every_path(
        redis_url: str, redis_client: redis.Redis) -> None:
    """(routed as they are sent, with no routes table of SITS's own: delay(), send_task
    by name, enqueue_many)"""
    from sits_queue.broker.bulk import enqueue_many

    app = make_app(SitsConfig(redis_url=redis_url), main="routes-default")
    default = QueueKeys.for_queue(app.conf.task_default_queue)
    try:
        assert not app.amqp.router.routes  # delay() pays no route lookup
        before = redis_client.zcard(CONTROL.waiting)
        app.tasks["sits.rescore"].delay()
        app.send_task("sits.prewarm_plan")
        enqueue_many(app.tasks["sits.check_triggers"], [(), ()])
        assert redis_client.zcard(CONTROL.waiting) == before + 4
        assert redis_client.zcard(default.waiting) == 0
        enqueue_many(app.tasks["sits.rescore"], [()], queue="elsewhere")
        assert redis_client.zcard(QueueKeys.for_queue("elsewhere").waiting) == 1
    finally:
        app.close()


def test_the_beat_sends_no_pass_beside_one_still_waiting(
        redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
        ) -> None:
    """(with every slot busy, the passes queued behind one another, each expired by the
    time a slot took it: none ran, and the control queue only grew)"""
    app = make_app(SitsConfig(redis_url=redis_url), main="beat-one-waiting")
    try:
        scheduler = SitsScheduler(app=app, lazy=True)
        entry, other = (ScheduleEntry(name=f"sits-{task}", task=f"sits.{task}",
                                      schedule=1.0, app=app)
                        for task in ("rescore", "check_triggers"))
        assert scheduler.apply_async(entry, advance=False) is not None
        # one waits: none beside it (said once while it lasts: it was a line a second)
        with caplog.at_level("DEBUG", logger="sits_queue.priority.beat"):
            assert scheduler.apply_async(entry, advance=False) is None
            assert scheduler.apply_async(entry, advance=False) is None
        assert [r.levelname for r in caplog.records if "not sent" in r.getMessage()] == \
            ["INFO", "DEBUG"]
        assert scheduler.apply_async(other, advance=False) is not None  # another task's own
        assert redis_client.zcard(CONTROL.waiting) == 2
        # Once it is taken, the next is sent, and a later wait is said again
        redis_client.zpopmin(CONTROL.waiting, 2)
        assert scheduler.apply_async(entry, advance=False) is not None
        caplog.clear()
        with caplog.at_level("DEBUG", logger="sits_queue.priority.beat"):
            assert scheduler.apply_async(entry, advance=False) is None
        assert [r.levelname for r in caplog.records if "not sent" in r.getMessage()] == \
            ["INFO"]
    finally:
        app.close()


def test_a_worker_whose_every_slot_is_busy_still_runs_the_passes(
        tmp_path: Path, redis_url: str, redis_client: redis.Redis, client_app: Celery
        ) -> None:
    """Long tasks back to back on the one slot: each freed slot takes the waiting pass
    first, and the beat keeps one waiting (they expired and piled up: no pass ran, and
    a waiting low task never aged)"""
    redis_client.flushall()
    env = worker_env(redis_url, rescore_interval_s="1", trigger_check_interval_s="1",
                     prewarm_interval_s="0")
    for n in range(12):
        client_app.tasks["w.slow"].apply_async((f"busy{n}", 1.5), sla_class="low")
    worker = start_worker(APP_MODULE, env, tmp_path / "worker", concurrency=1, cwd=ROOT)
    beat = start_beat(APP_MODULE, env, tmp_path / "beat", cwd=ROOT)
    passes: set[float] = set()
    depths: list[int] = []

    def rescored() -> bool:
        snapshot = redis_client.get(stats_key())
        if snapshot is not None:
            passes.add(json.loads(snapshot)["now_s"])
        depths.append(int(redis_client.zcard(CONTROL.waiting)))
        return len(passes) >= 4

    try:
        wait_for(rescored, 60, "four rescoring passes while every slot is busy")
        assert redis_client.llen("test:finished") < 12  # (busy all along)
        assert max(depths) <= 2  # one pass of each kind waits, at most
        # and the passes, at --loglevel=INFO, are not in the logs line by line (~3 lines
        # a second at the default intervals); the user's tasks are
        assert "sits.rescore[" not in worker.log() and "w.slow[" in worker.log()
        assert "Sending due task" not in beat.log()
    finally:
        beat.stop(timeout_s=10)
        worker.stop(timeout_s=10)


def test_a_pass_goes_to_the_control_queue_alone_under_topic_routing(
        redis_url: str, redis_client: redis.Redis) -> None:
    """(Celery's routing guide: a topic exchange, the default queue bound "task.#". The
    control queue, bound with the app's default routing key, matched it too: each pass
    went to both queues and ran twice; a task sent to the default key landed in both)"""
    from kombu import Queue

    app = make_app(SitsConfig(redis_url=redis_url), main="topic-routing")
    app.conf.task_queues = (Queue("default", routing_key="task.#"),
                            Queue("feed_tasks", routing_key="feed.#"))
    app.conf.task_default_queue = "default"
    app.conf.task_default_exchange = "tasks"
    app.conf.task_default_exchange_type = "topic"
    app.conf.task_default_routing_key = "task.default"
    default = QueueKeys.for_queue("default")
    try:
        app.send_task("sits.rescore")
        assert redis_client.zcard(CONTROL.waiting) == 1
        assert redis_client.zcard(default.waiting) == 0
        app.send_task("app.work", exchange="tasks", routing_key="task.default")
        assert redis_client.zcard(default.waiting) == 1
        assert redis_client.zcard(CONTROL.waiting) == 1
    finally:
        app.close()


@pytest.mark.parametrize("outage", ["down", "hung"])
def test_a_beat_stopped_while_its_redis_is_away_stops(tmp_path: Path, outage: str) -> None:
    """(SIGTERM with Redis down: exit 1 on ~1,400 lines of traceback; with Redis hung,
    the lock's release failed inside the signal handler, the next tick took the error
    for an outage to wait out, and the beat went on leading for good)"""
    import os
    import signal

    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    beat = start_beat(APP_MODULE, worker_env(url, prewarm_interval_s="0"),
                      tmp_path / "logs", cwd=ROOT)
    stopped = False
    try:
        wait_for(lambda: "acquired lock" in beat.log(), 60, "the beat to lead")
        if outage == "down":
            server.stop()
        else:
            os.kill(server.pid, signal.SIGSTOP)
            stopped = True
        time.sleep(1)
        # When it is asked to stop
        os.kill(beat.pid, signal.SIGTERM)
        # Then it stops, at once but for one socket timeout, saying so in one line
        beat.popen.wait(30)
        log = beat.log()
        assert beat.popen.returncode == 0, log[-3000:]
        assert "could not release its lock, Redis unreachable" in log
        assert "Traceback" not in log, log[-3000:]
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        beat.kill()
        server.stop()
