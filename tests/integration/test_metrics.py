"""The worker's Prometheus endpoint, scraped over HTTP from a real ``celery worker``.

What a scrape must show after real inference tasks on tiny real models: tasks by class,
cold starts by source with the time per phase and the histogram agreeing with them,
failures by reason, the device and the warm engines; a second worker on the same port
logs why it has no endpoint and serves on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import redis
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from sits_queue.app import make_app
from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidInput, UnknownModel
from sits_queue.procs import CeleryProcess, wait_ready
from sits_queue.status import format_status, workers_status
from sits_queue.workers import advertise, metrics
from sits_queue.workers import runtime as rt
from sits_queue.workers.devices import Discovery, cpu_device
from tests.integration.counting import read_once
from tests.integration.inference_app import (
    FIRST_CALL_S,
    ROOT,
    build_models,
    call,
    client_app,
    spawn_worker,
    write_config,
)
from tests.waiting import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("metrics")
    return build_models(root / "models"), write_config(root / "sits.toml")


@pytest.fixture(scope="module")
def app(redis_url: str, setup: tuple[Path, Path]) -> Iterator[Celery]:
    client = client_app(redis_url, setup[1], "metrics-client")
    yield client
    client.close()


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_url: str, setup: tuple[Path, Path],
           app: Celery, port: int) -> Iterator[CeleryProcess]:
    proc = spawn_worker(redis_url, setup[1], setup[0], tmp_path_factory.mktemp("logs"),
                        env={"SITS_METRICS_PORT": str(port), "SITS_METRICS_ADDR": "127.0.0.1"},
                        concurrency=1, name="metrics")
    try:
        wait_ready(app, [proc], timeout_s=120)
        yield proc
    finally:
        proc.stop(timeout_s=30)


Sample = tuple[str, tuple[tuple[str, str], ...]]


def scrape_once(port: int, ready: Callable[[dict[Sample, float]], bool], what: str
                ) -> dict[Sample, float]:
    """A scrape in which ``ready`` holds: a pool child writes the counts of a run that
    changed no warm set within ``deferred.DEFER_S`` of its end, not before its result."""
    return read_once(lambda: scrape(port), ready, what)


def scrape(port: int) -> dict[Sample, float]:
    """Every sample, keyed by name and sorted labels (the worker label dropped)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "worker"))
            out[(s.name, labels)] = s.value
    return out



def test_a_scrape_shows_tasks_cold_starts_by_phase_failures_and_devices(
        app: Celery, worker: CeleryProcess, port: int) -> None:
    # Given a fresh worker: its first inference task loads from disk (in the class with
    # the longest time limit: the child imports torch and transformers), the next is warm
    first = call(app, "t.describe", "one", sla_class="high", timeout=FIRST_CALL_S)
    call(app, "t.describe", "two", sla_class="low")
    assert first["sits"]["cold"] is True and first["sits"]["source"] == "disk"
    # And two failures: a model nobody registered, and a malformed prompt
    with pytest.raises(UnknownModel):
        call(app, "sits.generate", "hi", model="no-such-model")
    with pytest.raises(InvalidInput):
        call(app, "sits.generate", "", model="gpt")
    # (the last failure's count comes with every count before it)
    m = scrape_once(port, lambda m: m.get(
        ("sits_inference_failures_total", (("reason", "InvalidInput"),))) == 1,
        "the failures to be counted")
    assert m[("sits_inference_tasks_total", (("sla_class", "high"),))] == 1
    assert m[("sits_inference_tasks_total", (("sla_class", "low"),))] == 1
    # (sits.generate on "gpt" got its engine before rejecting the empty prompt)
    assert m[("sits_inference_tasks_total", (("sla_class", "medium"),))] == 1
    assert m[("sits_cold_starts_total", (("source", "disk"),))] == 1
    assert m[("sits_cold_starts_total", (("source", "host"),))] == 0
    assert m[("sits_cold_start_share", ())] == pytest.approx(1 / 3)
    # The phases add up to the cold start the task's result reported, in seconds
    phases = {p: m[("sits_cold_start_phase_seconds_total", (("phase", p),))]
              for p in ("cuda_ctx", "load", "promote", "warmup")}
    reported = sum(first["sits"][f"{p}_ms"] for p in phases) / 1000
    assert phases["load"] > 0 and sum(phases.values()) == pytest.approx(reported, abs=1e-5)
    assert m[("sits_cold_start_seconds_count", ())] == 1
    assert m[("sits_cold_start_seconds_sum", ())] == pytest.approx(reported, abs=1e-5)
    assert m[("sits_cold_start_seconds_bucket", (("le", "+Inf"),))] == 1
    assert m[("sits_first_token_seconds_count", ())] == 0  # nothing generated a token
    assert m[("sits_inference_failures_total", (("reason", "UnknownModel"),))] == 1
    assert m[("sits_inference_failures_total", (("reason", "InvalidInput"),))] == 1
    # The worker, its device (a CPU host here) and the child's warm engine
    assert m[("sits_worker_slots", ())] == 1
    assert m[("sits_device_vram_bytes", (("device", "cpu:0"), ("state", "total")))] > 0
    assert m[("sits_warm_engines", (("slot", "0"), ("tier", "device")))] == 1


def test_sitsq_status_shows_the_phases_and_failures(worker: CeleryProcess,
                                                    redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)

    def text() -> str:
        return format_status({"queues": [], "workers": workers_status(client, SitsConfig())})

    # The advertisement is refreshed every few seconds from the same counters
    wait_for(lambda: "failed: InvalidInput 1, UnknownModel 1" in text(), 20,
             "the worker's record to show the failures")
    assert "cold-start ms, mean of " in text() and "load " in text()
    client.close()


def test_counts_survive_a_scrape_and_grow(app: Celery, worker: CeleryProcess,
                                          port: int) -> None:
    before = scrape(port)
    call(app, "t.describe", "three", sla_class="low")
    key = ("sits_inference_tasks_total", (("sla_class", "low"),))
    after = scrape_once(port, lambda m: m[key] > before[key], "the task to be counted")
    assert after[key] == before[key] + 1
    # A warm task adds no cold start
    assert after[("sits_cold_start_seconds_count", ())] == \
        before[("sits_cold_start_seconds_count", ())]



def test_a_generation_counts_its_first_token(app: Celery, worker: CeleryProcess, port: int,
                                             redis_url: str) -> None:
    before = scrape(port)
    out = call(app, "sits.generate", "the first token", model="gpt",
               kwargs={"max_new_tokens": 3, "stop_at_eos": False}, timeout=FIRST_CALL_S)
    count, total = ("sits_first_token_seconds_count", ()), ("sits_first_token_seconds_sum", ())
    after = scrape_once(port, lambda m: m[count] > before[count], "the first token's count")
    assert after[count] == before[count] + 1
    assert after[total] - before[total] == pytest.approx(out["sits"]["first_token_ms"] / 1000,
                                                         abs=1e-6)
    client = redis.Redis.from_url(redis_url)
    wait_for(lambda: "first token: " in format_status(
        {"queues": [], "workers": workers_status(client, SitsConfig())}), 20,
        "sitsq status to show the first-token mean")
    client.close()


def test_a_generation_that_yields_its_slot_counts_as_one_task(
        app: Celery, worker: CeleryProcess, port: int, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    waiting = QueueKeys.for_queue("celery")
    first = ("sits_first_token_seconds_count", ())
    tasks = {cls: ("sits_inference_tasks_total", (("sla_class", cls),)) for cls in ("low",
                                                                                  "high")}
    base = scrape(port)
    # (the model loaded first, in a class whose time limit a fresh child's imports fit)
    call(app, "t.generate_slow", "warm", 1, sla_class="high", timeout=FIRST_CALL_S)
    before = scrape_once(port, lambda m: m[first] > base[first], "the warm-up's counts")
    # Given a low-class generation of 80 steps at >= 20 ms each on the worker's one slot
    long = app.tasks["t.generate_slow"].apply_async(("the slices", 80), sla_class="low")
    wait_for(lambda: client.zcard(waiting.waiting) == 0 and client.zcard(waiting.unacked) == 1,
             30, "the generation to start")
    # When a high task arrives while it decodes, it takes the slot the generation yields
    call(app, "t.describe", "urgent", sla_class="high", timeout=FIRST_CALL_S)
    out = long.get(timeout=FIRST_CALL_S)
    assert out["output"]["runs"] >= 2
    after = scrape_once(port, lambda m: m[first] > before[first] and all(
        m[key] > before[key] for key in tasks.values()), "both tasks' counts")
    client.close()
    # Then the generation counts as one task, however many runs it took: in the tasks,
    # the cold-start share's denominator, and its first token
    for cls, key in tasks.items():
        assert after[key] == before[key] + 1, cls
    assert after[first] == before[first] + 1


def test_only_the_main_process_listens(worker: CeleryProcess, port: int) -> None:
    def listening(pid: int) -> bool:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))

    children = psutil.Process(worker.pid).children()
    assert children and listening(worker.pid)
    # The pool child forked after the endpoint started, and closed its copy of the socket
    assert not any(listening(c.pid) for c in children)


def test_a_second_worker_on_the_same_port_says_so_and_serves(
        tmp_path_factory: pytest.TempPathFactory, redis_url: str, setup: tuple[Path, Path],
        app: Celery, worker: CeleryProcess, port: int) -> None:
    proc = spawn_worker(redis_url, setup[1], setup[0], tmp_path_factory.mktemp("logs2"),
                        env={"SITS_METRICS_PORT": str(port), "SITS_METRICS_ADDR": "127.0.0.1"},
                        concurrency=1, name="metrics-2")
    try:
        wait_ready(app, [proc], timeout_s=120)
        wait_for(lambda: "metrics endpoint not started" in proc.log(), 30,
                 "the second worker to log that the port is taken")
        assert "give each worker on a host its own SITS_METRICS_PORT" in proc.log()
        assert proc.alive()
        # The first worker's endpoint still answers
        assert ("sits_worker_slots", ()) in scrape(port)
    finally:
        proc.stop(timeout_s=30)


def sitsq_metrics(port: int, addr: str, redis_url: str) -> subprocess.Popen[str]:
    """``sitsq metrics`` running, its stderr piped (it says its URL there)."""
    return subprocess.Popen([sys.executable, "-m", "sits_queue.cli", "metrics", "--port",
                             str(port), "--addr", addr], cwd=ROOT,
                            env={**os.environ, "SITS_REDIS_URL": redis_url},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_sitsq_metrics_serves_the_fleet_and_the_queues(
        app: Celery, worker: CeleryProcess, redis_url: str) -> None:
    # Given a task waiting in a queue no worker consumes, and a pre-warm pass recorded
    from sits_queue.priority.prewarm import Prewarmer

    app.tasks["t.ping"].apply_async(("x",), queue="nobody-consumes")
    client = redis.Redis.from_url(redis_url)
    Prewarmer(app.sits, client, lambda model, hostname: None).run(time.time())
    port = free_port()
    proc = sitsq_metrics(port, "127.0.0.1", redis_url)
    try:
        def answers() -> bool:
            try:
                scrape(port)
            except OSError:
                return False
            return True

        wait_for(answers, 30, "sitsq metrics to answer")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        # Every live worker, labelled by its hostname, and every queue
        assert f'sits_worker_slots{{worker="{worker.hostname}"}} 1.0' in text
        assert 'sits_queue_waiting{queue="nobody-consumes"} 1.0' in text
        assert 'sits_queue_dead{queue="celery"}' in text
        # and the planner's last pass (no model forecast yet: its age alone)
        assert "sits_prewarm_last_pass_age_seconds " in text
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        with app.connection_for_write() as conn:
            conn.default_channel.queue_purge("nobody-consumes")


def test_sitsq_metrics_on_a_taken_port_exits_with_the_reason(
        worker: CeleryProcess, redis_url: str, port: int) -> None:
    out = subprocess.run([sys.executable, "-m", "sits_queue.cli", "metrics", "--port",
                          str(port), "--addr", "127.0.0.1"], cwd=ROOT,
                         env={**os.environ, "SITS_REDIS_URL": redis_url},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "(see --port and --addr)" in out.stderr
    assert "SITS_METRICS" not in out.stderr  # the flags set them, not the settings


def test_counts_a_child_could_not_publish_go_with_its_next_publish(
        redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nothing listens on: Redis away
        s.bind(("127.0.0.1", 0))
        away = s.getsockname()[1]
    app = make_app(SitsConfig(redis_url=f"redis://127.0.0.1:{away}/0"), main="away")
    device = cpu_device()
    child = rt.ChildRuntime(app=app, plan=rt.WorkerPlan("w@h", Discovery((device,)), (0,), 1),
                            slot=0, device=device)
    monkeypatch.setattr(advertise, "_clients", {})
    child.count(metrics.failure_fields("InvalidInput"))
    child.publish()  # logged, not raised; the counts are kept
    child.count(metrics.failure_fields("InvalidInput"))
    # When Redis is back, both counts arrive, once
    app.sits = replace(app.sits, redis_url=redis_url)
    monkeypatch.setattr(advertise, "_clients", {})
    child.publish()
    child.publish()
    counters = redis_client.hgetall(advertise.counters_key("", "w@h"))
    assert counters[b"failed"] == b"2" and counters[b"failed:InvalidInput"] == b"2"


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback")
def test_sitsq_metrics_on_an_ipv6_address_says_a_url_that_works(redis_url: str) -> None:
    # (it said http://::1:9877/metrics, which no client parses)
    port = free_port()
    proc = sitsq_metrics(port, "::1", redis_url)
    try:
        assert proc.stderr is not None
        said = proc.stderr.readline()
        url = said.split("serving ", 1)[1].split(" ", 1)[0]
        assert url == f"http://[::1]:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert "sits_redis_up 1.0" in reply.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
