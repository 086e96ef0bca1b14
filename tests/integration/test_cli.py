"""`sitsq` as a user runs it: a real subprocess, a real Redis."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import redis
from celery import Celery

from sits_queue.broker.keys import QueueKeys, queues_registry
from sits_queue.embedded import EmbeddedRedis
from sits_queue.procs import CeleryProcess
from tests.integration.commands import sent_commands
from tests.integration.conftest import ROOT
from tests.waiting import wait_for


def sitsq(*args: str, env: dict[str, str], timeout: float = 180
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sits_queue.cli", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_status_shows_depth_and_head_tasks_with_class(client_app: Celery, redis_url: str,
                                                      redis_client: redis.Redis) -> None:
    low = client_app.tasks["w.add"].apply_async((1, 2), sla_class="low")
    high = client_app.tasks["w.add"].apply_async((3, 4), sla_class="high")
    out = sitsq("status", "--json", env={**os.environ, "SITS_REDIS_URL": redis_url})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    (queue,) = [q for q in report["queues"] if q["queue"] == "celery"]
    assert queue["waiting"] == 2
    assert [row["sla_class"] for row in queue["head"]] == ["high", "low"]
    assert queue["head"][0]["priority"] > queue["head"][1]["priority"]
    assert queue["head"][0]["task"] == "w.add"
    # each with its task id (what revoke() takes) beside its message id (the broker's)
    assert [row["task_id"] for row in queue["head"]] == [high.id, low.id]
    assert queue["head"][0]["id"] != high.id
    assert queue["checkpointed"] == queue["held"] == 0
    # A task resuming from a yield and one held off by a worker are counted
    first_id = queue["head"][0]["id"]
    keys = QueueKeys.for_queue("celery")
    redis_client.hset(keys.checkpoints, first_id, "{}")
    redis_client.hset(keys.held, first_id, "consumer 9999999999 0")
    # (a record outlives its hold: one whose time has passed holds nothing off; a dead
    # worker's stayed counted for good)
    redis_client.hset(keys.held, queue["head"][1]["id"], "gone@host 1000.000 2")
    text = sitsq("status", env={**os.environ, "SITS_REDIS_URL": redis_url}).stdout
    assert "1 with a yield's progress saved, 1 held off by a worker" in text
    assert f"w.add[{high.id}]" in text and f"w.add[{low.id}]" in text


def test_status_says_when_a_stock_producer_sent_to_a_plain_list(
        redis_url: str) -> None:
    # a stock Celery app pointed at the same Redis (no SITS transport) pushes to a list
    from celery import Celery as StockCelery

    stock = StockCelery("stock", broker=redis_url, set_as_current=False)
    try:
        stock.send_task("w.add", (1, 2))
        # kombu keeps a priority above 0 in a list of its own ("celery\x06\x166")
        stock.send_task("w.add", (1, 2), priority=5)
    finally:
        stock.close()
    env = {**os.environ, "SITS_REDIS_URL": redis_url}
    out = sitsq("status", env=env)
    assert out.returncode == 0, out.stderr
    assert "warning: 2 message(s) in plain Redis lists of queue 'celery'" in out.stdout
    # one left in a priority list only is said too (it was not)
    redis.Redis.from_url(redis_url).delete("celery")
    assert json.loads(sitsq("status", "--json", env=env).stdout)["stray"] == {"celery": 1}


def test_status_counts_the_wait_of_a_task_with_an_eta_from_when_it_is_due(
        client_app: Celery, redis_url: str) -> None:
    client_app.tasks["w.add"].apply_async((1, 2), countdown=3600, queue="later")
    out = sitsq("status", "--json", env={**os.environ, "SITS_REDIS_URL": redis_url})
    (queue,) = [q for q in json.loads(out.stdout)["queues"] if q["queue"] == "later"]
    (row,) = queue["head"]
    # (it showed as waiting since its put)
    assert row["wait_s"] == 0 and 3500 < row["due_in_s"] <= 3600


def test_status_uses_the_redis_of_the_config_file(client_app: Celery, redis_url: str,
                                                  redis_client: redis.Redis,
                                                  tmp_path: Path) -> None:
    client_app.tasks["w.add"].apply_async((1, 2), sla_class="low")
    site = tmp_path / "site.toml"
    site.write_text(f'redis_url = "{redis_url}"\n')
    env = {k: v for k, v in os.environ.items() if k != "SITS_REDIS_URL"}
    env.update(SITS_CONFIG=str(site), XDG_DATA_HOME=str(tmp_path / "data"))
    out = sitsq("status", "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert "embedded" not in out.stderr  # no private server started beside the user's
    (queue,) = [q for q in json.loads(out.stdout)["queues"] if q["queue"] == "celery"]
    assert queue["waiting"] == 1
    assert not (tmp_path / "data").exists()
    # a config file that cannot be read is named, not replaced by the embedded server
    env["SITS_CONFIG"] = str(tmp_path / "missing.toml")
    bad = sitsq("status", env=env)
    assert bad.returncode != 0 and "missing.toml" in bad.stderr
    assert not (tmp_path / "data").exists()


def test_status_reports_an_unreachable_redis_clearly() -> None:
    out = sitsq("status", env={**os.environ, "SITS_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert out.returncode != 0
    assert "cannot reach Redis" in out.stderr


def test_status_says_a_wrong_password_was_refused_not_unreachable(tmp_path: Path) -> None:
    """(the server answered and refused the login: "cannot reach Redis" sent users to
    look at the network)"""
    with EmbeddedRedis(tmp_path / "redis", password="s3cret-right") as server:
        wrong = server.url.replace("s3cret-right", "s3cret-wrong")
        out = sitsq("status", env={**os.environ, "SITS_REDIS_URL": wrong})
    assert out.returncode != 0 and "refused the login" in out.stderr, out.stderr
    assert "cannot reach" not in out.stderr and "right password" in out.stderr
    assert "s3cret" not in out.stderr  # (the password is masked)


def test_embedded_default_starts_reuses_and_stops(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SITS_REDIS_URL"}
    env["XDG_DATA_HOME"] = str(tmp_path)
    first = sitsq("status", env=env)
    assert first.returncode == 0, first.stderr
    assert "embedded Redis" in first.stderr
    second = sitsq("status", env=env)
    url = first.stderr.split(" at ")[-1].strip()
    assert url in second.stderr  # the same server, reused
    # Its whole URL, password and all, for a program that submits tasks to it (sitsq
    # said it redacted, and the app's own default is localhost:6379)
    printed = sitsq("redis-url", env=env)
    assert printed.returncode == 0, printed.stderr
    full = printed.stdout.strip()
    assert full.split("@")[-1] == url.split("@")[-1] and full != url
    assert redis.Redis.from_url(full, socket_timeout=5).ping()
    # and a configured one as it is, nothing started
    mine = "redis://:pw@10.1.2.3:6380/2"
    assert sitsq("redis-url", env={**env, "SITS_REDIS_URL": mine}).stdout.strip() == mine
    stopped = sitsq("stop-redis", env=env)
    assert stopped.stdout.strip() == "stopped"
    assert sitsq("stop-redis", env=env).stdout.strip() == "no embedded Redis was running"


def test_demo_runs_the_mixed_workload_to_completion_apart_from_the_users_queues(
        client_app: Celery, redis_url: str, redis_client: redis.Redis) -> None:
    """(on a server of the user's, its worker took the user's waiting tasks off the
    ``celery`` queue and dead-lettered them as unknown to it)"""
    waiting = client_app.tasks["w.add"].delay(2, 3)
    keys = QueueKeys.for_queue("celery")
    before = redis_client.zrange(keys.waiting, 0, -1)
    # what an interrupted demo left under its prefix (its jobs still queued there were
    # counted as the next run's and served late) goes before the run
    redis_client.set("sits-demo:left-by-an-earlier-demo", 1)
    # and the lock of a demo killed outright on this host (its pid gone) is taken over
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    redis_client.set("sits-demo-lock", f"{socket.gethostname()}:{dead}")
    out = sitsq("demo", "--jobs", "60", env={**os.environ, "SITS_REDIS_URL": redis_url})
    assert out.returncode == 0, out.stderr + out.stdout
    assert "completed 60/60" in out.stdout and "'sits-demo:'" in out.stdout
    for cls in ("high", "medium", "low"):
        assert any(line.startswith(cls) for line in out.stdout.splitlines())
    # the user's task still waits, untouched; the demo's keys are all under its prefix
    assert redis_client.zrange(keys.waiting, 0, -1) == before and before
    assert redis_client.hlen(keys.dead) == 0 and waiting.state == "PENDING"
    assert not [k for k in redis_client.scan_iter(match="bench:*")]
    assert list(redis_client.scan_iter(match="sits-demo:*"))
    assert not redis_client.exists("sits-demo:left-by-an-earlier-demo")
    assert not redis_client.exists("sits-demo-lock")


def test_a_second_demo_on_the_same_redis_is_refused_while_one_runs(
        redis_url: str, redis_client: redis.Redis) -> None:
    """(two at once deleted each other's keys and counted each other's completions:
    "completed 134/100", twice)"""
    redis_client.set("sits-demo-lock", f"{socket.gethostname()}:{os.getpid()}")  # live
    try:
        out = sitsq("demo", "--jobs", "5", env={**os.environ, "SITS_REDIS_URL": redis_url})
    finally:
        redis_client.delete("sits-demo-lock")
    assert out.returncode == 1
    assert out.stderr.startswith("Error: another sitsq demo (") and "wait for it" in out.stderr
    assert out.stdout == ""  # in one line (it said first that it deletes the other's keys)
    assert not list(redis_client.scan_iter(match="sits-demo:*"))  # nothing of it ran


def _demo_processes(redis_url: str) -> list[psutil.Process]:
    """The worker and beat a demo on ``redis_url`` started (and their children)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if "sits_queue.bench.ab_apps" in " ".join(proc.info["cmdline"] or []) and \
                    proc.environ().get("SITS_REDIS_URL") == redis_url:
                found.append(proc)
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_demo_ended_by_a_signal_stops_its_worker_and_beat(
        redis_url: str, sig: int) -> None:
    """(they run in sessions of their own, and Python's default exit on SIGTERM or SIGHUP,
    a closed terminal, skipped the demo's own clean-up: both ran on)"""
    demo = subprocess.Popen([str(Path(sys.executable).with_name("sitsq")), "demo", "--jobs",
                             "5000"], env={**os.environ, "SITS_REDIS_URL": redis_url},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            if "submitting" in line:  # its worker and beat are up
                break
        assert len(_demo_processes(redis_url)) >= 2
        demo.send_signal(sig)
        demo.wait(60)
        wait_for(lambda: not _demo_processes(redis_url), 30, "the demo's worker and beat "
                 "to stop")
    finally:
        demo.kill()
        for proc in _demo_processes(redis_url):
            proc.kill()


def test_status_lists_live_workers_with_their_devices(
        spawn: Callable[..., CeleryProcess], redis_url: str) -> None:
    worker = spawn()
    env = {**os.environ, "SITS_REDIS_URL": redis_url}
    deadline = time.monotonic() + 30
    while True:
        report = json.loads(sitsq("status", "--json", env=env).stdout)
        if any(w["hostname"] == worker.hostname for w in report["workers"]):
            break
        assert time.monotonic() < deadline, report
        time.sleep(0.5)
    (record,) = [w for w in report["workers"] if w["hostname"] == worker.hostname]
    assert record["devices"] and record["devices"][0]["kind"] in ("cpu", "cuda")
    text = sitsq("status", env=env).stdout
    assert worker.hostname in text and "cold starts" in text


def test_sitsq_celery_passes_any_command_and_its_help_to_celery(redis_url: str) -> None:
    env = {**os.environ, "SITS_REDIS_URL": redis_url}
    helped = sitsq("celery", "worker", "--help", env=env)
    assert helped.returncode == 0 and "--concurrency" in helped.stdout  # Celery's own help
    assert helped.stderr.startswith("sitsq celery [-A APP] COMMAND")  # after what sitsq adds
    pinged = sitsq("celery", "inspect", "ping", "--timeout", "0.5", env=env)
    assert "No nodes replied" in pinged.stdout + pinged.stderr  # ran, on our Redis
    status = sitsq("celery", "status", env=env)  # not a command sitsq names itself
    assert "No nodes replied" in status.stdout + status.stderr
    # -A names the module with the user's tasks (sits_queue's own by default)
    missing = sitsq("celery", "-A", "no_such_tasks_module", "status", env=env)
    assert "module no_such_tasks_module was not found" in missing.stdout + missing.stderr
    theirs = sitsq("celery", "--app", "tests.integration.worker_app", "status", env=env)
    assert "No nodes replied" in theirs.stdout + theirs.stderr


@pytest.mark.parametrize("via", [["celery", "-A", "sits_queue"], ["sitsq", "celery"]])
def test_celery_call_with_a_bad_option_says_it_in_one_line(redis_url: str, via: list[str],
                                                           redis_client: redis.Redis) -> None:
    env = {**os.environ, "SITS_REDIS_URL": redis_url}
    runner = ["-m", "celery", *via[1:]] if via[0] == "celery" else ["-m", "sits_queue.cli",
                                                                      *via[1:]]
    said = subprocess.run([sys.executable, *runner, "call", "sits_queue.demo.job", "--args",
                           "[1]", "--countdown", "nan"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert said.returncode == 1
    assert said.stderr.splitlines()[-1] == (
        "Error: task sits_queue.demo.job: countdown must be a finite number of seconds, got nan")
    assert "Traceback" not in said.stderr
    assert redis_client.dbsize() == 0  # nothing was sent
    # what is not ours is shown as Celery shows it
    theirs = subprocess.run([sys.executable, *runner, "call", "sits_queue.demo.job",
                             "--serializer", "nope"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert theirs.returncode == 1 and "Traceback" in theirs.stderr
    assert "SerializerNotInstalled" in theirs.stderr


def test_dead_letters_are_listed_requeued_and_dropped(
        client_app: Celery, spawn: Callable[..., CeleryProcess], redis_url: str,
        redis_client: redis.Redis) -> None:
    env = {**os.environ, "SITS_REDIS_URL": redis_url}
    keys = QueueKeys.for_queue("celery")
    result = client_app.tasks["w.add"].apply_async((2, 3), sla_class="low")
    (message_id,) = [i.decode() for i in redis_client.hkeys(keys.payloads)]
    # ...and one whose body is nested too deep to decode (a RecursionError ended the
    # requeue, the letters beside it left dead)
    deep = json.loads(redis_client.hget(keys.payloads, message_id))
    deep["body"] = base64.b64encode(b"[" * 100_000 + b"]" * 100_000).decode()
    deep["headers"]["id"] = "deep-task"
    # Given a message dead-lettered as poison, and records whose payload is not a message
    with client_app.connection_for_write() as conn:
        conn.default_channel._run("dead", "celery", [time.time(), "test: poison", message_id])
    redis_client.hset(keys.dead, "junk", json.dumps({"reason": "malformed", "payload": "{"}))
    redis_client.hset(keys.dead, "deep", json.dumps({"reason": "malformed",
                                                     "payload": json.dumps(deep)}))
    # Then they are listed with their task and reason
    listed = sitsq("dead", "list", "celery", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    report = json.loads(listed.stdout)["celery"]
    assert report["total"] == 3
    poison = next(r for r in report["oldest"] if r["id"] == message_id)
    assert poison["task"] == "w.add" and poison["task_id"] == result.id
    assert poison["reason"] == "test: poison"
    # When the poison one is requeued, named by its task's id as a caller knows it (the
    # junk one cannot be), a worker runs it
    requeued = sitsq("dead", "requeue", "celery", "deep", result.id, "junk", env=env)
    assert requeued.returncode == 1 and "requeued 1 of 3" in requeued.stdout
    assert "junk: its payload is not a message" in requeued.stderr
    assert "deep: its payload is not a message (maximum recursion depth" in requeued.stderr
    spawn()
    assert result.get(timeout=60) == 5
    # And the junk one is dropped; a queue that does not exist is named
    assert "dropped 2 of 2" in sitsq("dead", "drop", "celery", "--all", env=env).stdout
    assert redis_client.hlen(keys.dead) == 0
    missing = sitsq("dead", "list", "nope", env=env)
    assert missing.returncode != 0 and "no queue 'nope'" in missing.stderr
    assert sitsq("dead", "drop", "celery", env=env).returncode != 0  # ids or --all


def test_a_dead_letter_is_listed_on_one_escaped_line(
        client_app: Celery, redis_url: str, redis_client: redis.Redis) -> None:
    """(a producer's newline in a reason split its record over lines, and its terminal
    escapes reached the terminal; a record with no time or task read '?[None]  None s')"""
    keys = QueueKeys.for_queue("celery")
    redis_client.sadd(queues_registry(""), "celery")
    redis_client.hset(keys.dead, "odd", json.dumps({"reason": "bad\nline \x1b[31mred",
                                                     "payload": "{"}))
    out = sitsq("dead", "list", "celery", env={**os.environ, "SITS_REDIS_URL": redis_url})
    assert out.returncode == 0, out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("  ")]
    assert "bad\\nline \\x1b[31mred" in row and "\x1b" not in out.stdout
    assert "None" not in row and "?[?]  ?" in row


def test_dead_letter_commands_name_what_is_not_there(
        client_app: Celery, redis_url: str, redis_client: redis.Redis) -> None:
    env = {**os.environ, "SITS_REDIS_URL": redis_url}
    client_app.tasks["w.add"].apply_async((1, 1), sla_class="low")  # the queue exists
    keys = QueueKeys.for_queue("celery")
    # Nothing dead: --all does nothing, and says so
    for command, said in (("requeue", "requeued 0 of 0"), ("drop", "dropped 0 of 0")):
        out = sitsq("dead", command, "celery", "--all", env=env)
        assert out.returncode == 0 and said in out.stdout, out.stderr
    # An id that is not a dead letter is named, and the exit status says so
    redis_client.hset(keys.dead, "junk", json.dumps({"reason": "malformed", "payload": "{"}))
    out = sitsq("dead", "drop", "celery", "junk", "nope", "junk", env=env)
    assert out.returncode == 1
    assert "dropped 1 of 2" in out.stdout and "nope: no such dead letter" in out.stderr
    assert redis_client.hlen(keys.dead) == 0
    # A task's id names its letter; a task with two letters is refused, both named
    for letter in ("l-1", "l-2"):
        redis_client.hset(keys.dead, letter, json.dumps({
            "reason": "x", "payload": json.dumps({"headers": {"id": "t-1", "task": "x"}})}))
    out = sitsq("dead", "drop", "celery", "t-1", env=env)
    assert out.returncode == 2 and "task t-1 has 2 dead letters (l-1, l-2): name one" in \
        out.stderr, out.stderr
    redis_client.hdel(keys.dead, "l-2")
    out = sitsq("dead", "drop", "celery", "t-1", env=env)
    assert out.returncode == 0 and "dropped 1 of 1" in out.stdout, out.stderr
    assert redis_client.hlen(keys.dead) == 0


def test_a_redis_that_refuses_a_command_is_one_line(redis_url: str) -> None:
    out = sitsq("status", env={**os.environ, "SITS_REDIS_URL": redis_url.rsplit("/", 1)[0]
                               + "/999"})
    assert out.returncode == 1
    assert out.stderr.strip().endswith("DB index is out of range"), out.stderr
    assert "Traceback" not in out.stderr


def test_many_dead_letters_are_requeued_in_a_few_calls_a_chunk(
        client_app: Celery, redis_client: redis.Redis) -> None:
    """(three round trips per letter: 100k letters took 164 s and half a GiB)"""
    from sits_queue.broker import deadletters

    keys = QueueKeys.for_queue("celery")
    for i in range(50):
        client_app.tasks["w.add"].apply_async((i, 1), sla_class="low")
    ids = [i.decode() for i in redis_client.hkeys(keys.payloads)]
    with client_app.connection_for_write() as conn:
        channel = conn.default_channel
        channel._run("dead", "celery", [time.time(), "test: parked", *ids])
        assert redis_client.hlen(keys.dead) == 50 and redis_client.zcard(keys.waiting) == 0

        def calls() -> dict[str, int]:
            return {k: int(v.get("calls", 0))
                    for k, v in redis_client.info("commandstats").items()}

        before = calls()
        done, refused = deadletters.requeue(channel, "celery", ids)
        after = calls()
    spent = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert sorted(done) == sorted(ids) and refused == {}
    assert redis_client.zcard(keys.waiting) == 50 and redis_client.hlen(keys.dead) == 0
    # one chunk: one requeue.lua (a script's own commands count apart; EVALSHA only
    # comes from clients)
    assert spent.get("cmdstat_evalsha", 0) <= 1, spent


def test_a_dead_letter_whose_id_is_not_utf8_is_named_as_listed_and_dropped(
        redis_url: str, redis_client: redis.Redis) -> None:
    keys = QueueKeys.for_queue("celery")
    redis_client.sadd("_kombu.binding.celery", "x")  # (a registered queue, as after a put)
    redis_client.sadd("sits:queues", "celery")
    odd = b"\xff\xfeid-1"
    redis_client.hset(keys.dead, odd, json.dumps({"reason": "foreign", "payload": "{}"}))
    env = {**os.environ, "SITS_REDIS_URL": redis_url}
    # requeue says why not (it blamed the payload), and the id a shell passes as raw
    # bytes drops it (a traceback: surrogates not allowed)
    requeued = sitsq("dead", "requeue", "celery", "--all", env=env)
    assert "its id is not UTF-8" in requeued.stderr, requeued.stderr
    out = subprocess.run([sys.executable, "-m", "sits_queue.cli", "dead", "drop", "celery",
                          os.fsdecode(odd)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "dropped 1 of 1" in out.stdout, out.stderr
    assert redis_client.hlen(keys.dead) == 0


def test_celerys_help_through_sitsq_starts_no_embedded_redis(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SITS_REDIS_URL"}
    env["XDG_DATA_HOME"] = str(tmp_path)
    try:
        out = sitsq("celery", "worker", "--help", env=env)
        assert out.returncode == 0 and "Usage" in out.stdout, out.stderr
        assert not (tmp_path / "sits-queue").exists()
    finally:  # (one it started anyway is not left running)
        from sits_queue.embedded import stop_server

        if (tmp_path / "sits-queue" / "redis").exists():
            stop_server(tmp_path / "sits-queue" / "redis")


def test_status_and_the_fleet_metrics_read_past_records_no_writer_of_ours_made(
        client_app: Celery, redis_url: str, redis_client: redis.Redis) -> None:
    """(a score of -inf, a waiting record of NaN, a site record of another shape or a
    member that is no UTF-8 each made `sitsq status` a traceback, `status --json` print
    NaN, or every scrape of `sitsq metrics` an HTTP 500)"""
    import math

    from prometheus_client import CollectorRegistry, generate_latest

    from sits_queue.broker.keys import last_pass_key, origins_key, replica_queues_key
    from sits_queue.config import SitsConfig
    from sits_queue.status import queue_status
    from sits_queue.workers.metrics import WorkerCollector

    client_app.tasks["w.add"].apply_async((1, 2), sla_class="low")
    keys = QueueKeys.for_queue("celery")
    redis_client.zadd(keys.waiting, {"junk-inf": -math.inf, "junk-huge": -1e300})
    redis_client.hset(keys.meta, "junk-inf", '{"c": "low", "t": NaN}')
    redis_client.set(last_pass_key(""), '{"peer": "p", "rtt_ms": 1, "modes": [1], "at": 1'
                     + "0" * 400 + "}")
    redis_client.sadd(origins_key(""), b"\xff\xfe")
    redis_client.sadd(replica_queues_key("", "o1"), b"\xff")
    redis_client.sadd(origins_key(""), "o1")
    env = {**os.environ, "SITS_REDIS_URL": redis_url, "SITS_SITE": "s1"}

    text = sitsq("status", env=env)
    assert text.returncode == 0, text.stderr
    assert "site s1: last pass record not readable here" in text.stdout
    assert "           ?  low     ?" in text.stdout  # the junk's priority is unknown
    assert "queue celery: 3 waiting" in text.stdout
    as_json = sitsq("status", "--json", env=env)
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)  # (NaN is no JSON)
    head = {row["id"]: row for row in report["queues"][0]["head"]}
    assert head["junk-inf"]["priority"] is None and head["junk-inf"]["wait_s"] is None
    assert head["junk-huge"]["priority"] is None
    assert [row["priority"] is not None for row in report["queues"][0]["head"]].count(True) == 1

    config = SitsConfig(redis_url=redis_url)
    registry = CollectorRegistry()
    registry.register(WorkerCollector(config, queues=lambda c: queue_status(c, config, 0.0)))
    scraped = generate_latest(registry).decode()
    assert 'sits_redis_up 1.0' in scraped and 'sits_queue_waiting{queue="celery"} 3.0' in scraped


def test_the_queues_are_read_in_a_few_round_trips_whatever_their_number(
        client_app: Celery, redis_client: redis.Redis, redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(seven round trips a queue, one after another: a scrape of a thousand queues took
    7 s at a 1 ms round trip, near Prometheus's 10 s default timeout)"""
    from sits_queue.config import SitsConfig
    from sits_queue.status import queue_status

    for i in range(40):
        client_app.tasks["w.add"].apply_async((i, i), queue=f"rt-{i}")
    with sent_commands(monkeypatch) as sent:
        queues = queue_status(redis_client, SitsConfig(redis_url=redis_url), time.time())
    assert len(sent) <= 3  # the registry, the counts and heads, the heads' records
    mine = [q for q in queues if q["queue"].startswith("rt-")]
    assert len(mine) == 40 and all(q["waiting"] == 1 and q["unacked"] == 0 for q in mine)
    assert all(q["head"][0]["task"] == "w.add" for q in mine)


def test_a_benchmark_stopped_by_sigterm_leaves_no_temporary_dirs(tmp_path: Path) -> None:
    """(only Ctrl-C unwound a run: a timeout's SIGTERM left its workers' logs and its
    private Redis's files in /tmp)"""
    env = {k: v for k, v in os.environ.items() if k != "SITS_REDIS_URL"}
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "sits_queue.cli", "bench", "ab", "--quick"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(list(tmp_path.glob("sits-bench-*"))) >= 2, 60,
                 "the run's temporary dirs")
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert list(tmp_path.glob("sits-bench-*")) == []
    # (its private Redis, when the signal came while it was being started, ran on)
    wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                             for p in started), 30, "what the run started to stop")
