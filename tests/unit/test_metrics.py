"""The worker's metrics, pure parts: what a task adds, failure reasons, the families."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from celery.exceptions import Retry, SoftTimeLimitExceeded
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from sits_queue.config import ConfigError, SitsConfig
from sits_queue.errors import ModelLoadError, VramLimitExceeded
from sits_queue.workers import advertise, metrics
from sits_queue.workers.slices import Preempted


def cold_meta(source: str = "disk", **phases: float) -> dict[str, Any]:
    return {"cold": True, "source": source,
            **{f"{p}_ms": phases.get(p, 0.0) for p in metrics.PHASES}}


def test_a_warm_task_counts_only_as_a_task() -> None:
    assert metrics.task_fields({"cold": False, "source": "device"}, "high") == \
        {"tasks": 1, "tasks:high": 1, "runs": 1}


def test_a_task_taken_by_affinity_is_counted() -> None:
    meta = {"cold": False, "source": "device", "affinity": True}
    assert metrics.task_fields(meta, "high") == {"tasks": 1, "tasks:high": 1, "runs": 1,
                                                 "affinity": 1}


def test_a_cold_task_counts_its_source_phases_and_bucket() -> None:
    fields = metrics.task_fields(cold_meta("host", promote=0.75, warmup=0.25), "low")
    assert fields == {"tasks": 1, "tasks:low": 1, "runs": 1, "cold_runs": 1, "cold": 1,
                      "cold:host": 1, "cold_ms": 1.0, "cold_le:1": 1,
                      "phase_ms:promote": 0.75, "phase_ms:warmup": 0.25}


@pytest.mark.parametrize(("ms", "bucket"), [(0.0, "1"), (1.0, "1"), (1.01, "5"),
                                            (30000.0, "30000"), (30000.5, "+Inf")])
def test_buckets_are_upper_bounds(ms: float, bucket: str) -> None:
    assert f"cold_le:{bucket}" in metrics.task_fields(cold_meta(load=ms), "low")


def test_the_planners_cold_start_cost_is_of_loads_from_disk() -> None:
    # (a promotion from the shadow pool is no cold start a worker without the model
    # pays: averaged in, a 2 s load and two 50 ms promotions read as 700 ms, under the
    # 850 ms bar, and pre-warming that worked well turned itself off)
    host = metrics.task_fields(cold_meta("host", promote=50.0), "low", "m")
    disk = metrics.task_fields(cold_meta("disk", load=2000.0), "low", "m")
    assert not any(k.startswith("model_cold") for k in host)
    assert disk["model_cold:m"] == 1 and disk["model_cold_ms:m"] == 2000.0


def test_a_resumed_run_is_no_new_task_but_a_cold_start_it_pays_counts() -> None:
    # (a generation that yielded its slot N times counted N + 1 tasks, and as many in
    # the cold-start share's denominator)
    warm = {"cold": False, "source": "device", "affinity": True}
    assert metrics.task_fields(warm, "low", resumed=True) == {"runs": 1, "affinity": 1}
    cold = metrics.task_fields(cold_meta("host", promote=0.5), "low", resumed=True)
    assert cold == {"runs": 1, "cold_runs": 1, "cold": 1, "cold:host": 1, "cold_ms": 0.5,
                    "cold_le:1": 1, "phase_ms:promote": 0.5}


def test_the_cold_start_share_is_over_task_runs_and_never_passes_one() -> None:
    # A task warm at first, then resumed cold (its engine left while it waited), beside
    # a warm batch of 3 that paid one load: 4 tasks, 5 runs of tasks, 4 of them cold.
    # (over tasks the share was 2 cold starts / 1 task = 2.0 for the first alone)
    values: dict[str, float] = {}
    for fields in (metrics.task_fields({"cold": False, "source": "device"}, "low"),
                   metrics.task_fields(cold_meta("host"), "low", resumed=True),
                   metrics.task_fields(cold_meta("disk"), "low", tasks=3)):
        for k, v in fields.items():
            values[k] = values.get(k, 0.0) + v
    assert values["tasks"] == 4 and values["cold"] == 2
    assert advertise.cold_share(values) == pytest.approx(4 / 5)
    assert advertise.cold_share({}) == 0.0


def test_a_prewarm_is_no_task_and_no_cold_start_but_its_load_cost_counts() -> None:
    fields = metrics.task_fields(cold_meta("disk", load=900.0), "high", "m", prewarm=True)
    assert fields == {"prewarms": 1, "model_cold:m": 1, "model_cold_ms:m": 900.0}


def test_an_unknown_source_is_bounded() -> None:
    assert "cold:other" in metrics.task_fields(cold_meta("somewhere"), "low")


@pytest.mark.parametrize(("exc", "reason"), [
    (VramLimitExceeded("x"), "VramLimitExceeded"),
    (ModelLoadError("x"), "ModelLoadError"),
    (SoftTimeLimitExceeded(), "SoftTimeLimitExceeded"),
    (ValueError("user code"), "other"),
    (Preempted("high task waiting"), None),   # a yield is not a failure
    (Retry(), None),
])
def test_failure_reasons_are_a_bounded_set(exc: BaseException, reason: str | None) -> None:
    assert metrics.failure_reason(exc) == reason


def test_a_first_token_counts_once_per_task_of_its_run() -> None:
    # Given a batch of 3 whose first token came 30 ms into the run, each task waited 30 ms
    assert metrics.first_token_fields(30.0, tasks=3) == {"ftt": 3, "ftt_ms": 90.0,
                                                         "ftt_le:50": 3}
    assert metrics.first_token_fields(40_000.0) == {"ftt": 1, "ftt_ms": 40_000.0,
                                                    "ftt_le:+Inf": 1}


def test_merge_adds() -> None:
    into = {"tasks": 1.0}
    metrics.merge(into, {"tasks": 1, "cold": 1})
    assert into == {"tasks": 2.0, "cold": 1.0}


def scrape(workers: list[dict[str, Any]]) -> dict[tuple[str, tuple[tuple[str, str], ...]],
                                                  float]:
    class Fixed:
        def collect(self) -> Any:
            return metrics.families(workers, ("high", "low"))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


WORKER = {
    "hostname": "w1@gpu-a", "host": "gpu-a", "pid": 42, "concurrency": 2,
    "devices": [{"kind": "cuda", "index": 0, "total_vram_bytes": 80 * 2**30,
                 "free_vram_bytes": 60 * 2**30, "utilisation_pct": 25}],
    "children": {"0": {"warm": {"a": "device", "b": "host", "c": "host"},
                       "memory": {"allocated_bytes": 1024}}},
    # as HGETALL returns it: bytes, counts per bucket (not cumulative)
    "counters": {b"tasks": b"10", b"tasks:high": b"7", b"tasks:low": b"3", b"cold": b"3",
                 b"runs": b"12", b"cold_runs": b"4",
                 b"cold:disk": b"1", b"cold:host": b"2", b"cold_ms": b"1503.5",
                 b"cold_le:1": b"1", b"cold_le:5": b"1", b"cold_le:2500": b"1",
                 b"phase_ms:load": b"1200", b"phase_ms:cuda_ctx": b"150",
                 b"phase_ms:promote": b"3.5", b"phase_ms:warmup": b"150",
                 b"failed": b"2", b"failed:VramLimitExceeded": b"2", b"affinity": b"4",
                 b"prewarms": b"6",
                 b"emb_texts": b"9", b"emb_cached": b"5", b"kv_hits": b"2",
                 b"ftt": b"4", b"ftt_ms": b"260", b"ftt_le:25": b"3", b"ftt_le:250": b"1"},
}


def test_families_from_a_worker_record() -> None:
    m = scrape([WORKER])
    w = ("worker", "w1@gpu-a")
    assert m[("sits_worker_info", (("host", "gpu-a"), ("pid", "42"), w))] == 1
    assert m[("sits_inference_tasks_total", (("sla_class", "high"), w))] == 7
    assert m[("sits_cold_starts_total", (("source", "host"), w))] == 2
    assert m[("sits_cold_start_share", (w,))] == pytest.approx(4 / 12)
    assert m[("sits_affinity_picks_total", (w,))] == 4
    assert m[("sits_prewarms_total", (w,))] == 6
    assert m[("sits_embedding_texts_total", (("kind", "cached"), w))] == 5
    assert m[("sits_kv_prefix_total", (("kind", "hits"), w))] == 2
    assert m[("sits_kv_prefix_total", (("kind", "tokens"), w))] == 0
    assert m[("sits_cold_start_phase_seconds_total", (("phase", "load"), w))] == 1.2
    # Cumulative buckets in seconds, count = every cold start, sum = their cost
    assert m[("sits_cold_start_seconds_bucket", (("le", "0.001"), w))] == 1
    assert m[("sits_cold_start_seconds_bucket", (("le", "0.005"), w))] == 2
    assert m[("sits_cold_start_seconds_bucket", (("le", "1.0"), w))] == 2
    assert m[("sits_cold_start_seconds_bucket", (("le", "2.5"), w))] == 3
    assert m[("sits_cold_start_seconds_count", (w,))] == 3
    assert m[("sits_cold_start_seconds_sum", (w,))] == pytest.approx(1.5035)
    assert m[("sits_first_token_seconds_bucket", (("le", "0.01"), w))] == 0
    assert m[("sits_first_token_seconds_bucket", (("le", "0.025"), w))] == 3
    assert m[("sits_first_token_seconds_bucket", (("le", "+Inf"), w))] == 4
    assert m[("sits_first_token_seconds_count", (w,))] == 4
    assert m[("sits_first_token_seconds_sum", (w,))] == pytest.approx(0.26)
    assert m[("sits_inference_failures_total", (("reason", "VramLimitExceeded"), w))] == 2
    dev = ("device", "cuda:0")
    assert m[("sits_device_vram_bytes", (dev, ("state", "free"), w))] == 60 * 2**30
    assert m[("sits_device_utilisation_ratio", (dev, w))] == 0.25
    assert m[("sits_warm_engines", (("slot", "0"), ("tier", "host"), w))] == 2
    assert m[("sits_child_allocated_bytes", (("slot", "0"), w))] == 1024


def test_a_worker_without_counts_reports_zeros_not_gaps() -> None:
    m = scrape([{"hostname": "w2@h", "concurrency": 1}])
    w = ("worker", "w2@h")
    assert m[("sits_inference_tasks_total", (("sla_class", "low"), w))] == 0
    assert m[("sits_cold_start_share", (w,))] == 0
    assert m[("sits_affinity_picks_total", (w,))] == 0
    assert m[("sits_prewarms_total", (w,))] == 0
    assert m[("sits_cold_start_seconds_count", (w,))] == 0


@pytest.mark.parametrize("port", [-1, 65536, True, 1.5])
def test_metrics_port_is_checked(port: Any) -> None:
    with pytest.raises(ConfigError, match="metrics_port"):
        SitsConfig(metrics_port=port)


def test_metrics_port_from_the_environment() -> None:
    assert SitsConfig.from_env({"SITS_METRICS_PORT": "9808"}).metrics_port == 9808
    with pytest.raises(ConfigError, match="SITS_METRICS_PORT"):
        SitsConfig.from_env({"SITS_METRICS_PORT": "ninety"})


def test_no_port_no_endpoint() -> None:
    assert metrics.serve(SitsConfig(), "w@h") is None


@pytest.mark.parametrize("odd", [
    {"devices": "cuda:0"}, {"devices": ["cuda:0"]}, {"concurrency": "four"},
    {"children": {"0": {"warm": ["a"]}}}, {"children": {"0": {"memory": {
        "allocated_bytes": None}}}}, {"children": ["0"]},
    {"devices": [{"kind": "cuda", "index": 0, "free_vram_bytes": "lots",
                  "utilisation_pct": {"x": 1}}]},
    {"counters": {b"tasks": b"x", b"tasks:high": b"2"}},
    # numbers past a float's range: int() of inf and float() of a huge int raised
    {"counters": {b"tasks": b"10", b"cold": b"1e400", b"cold_ms": b"-inf"}},
    {"counters": {b"tasks": b"inf", b"cold_le:100": b"nan"}},
    {"devices": [{"kind": "cuda", "index": 0, "total_vram_bytes": 10**400,
                  "free_vram_bytes": float("nan"), "utilisation_pct": float("inf")}]},
])
def test_one_odd_worker_record_spoils_none_of_the_scrape(odd: dict[str, Any]) -> None:
    """(an older, newer or foreign writer's record raised in families(): the scrape was
    an HTTP 500, every worker and queue gauge lost)"""
    m = scrape([WORKER, {"hostname": "odd@h", **odd}])
    assert m[("sits_inference_tasks_total", (("sla_class", "high"), ("worker", "w1@gpu-a")))] \
        == 7
    assert m[("sits_worker_info", (("host", ""), ("pid", ""), ("worker", "odd@h")))] == 1


def test_a_scrape_says_when_it_could_not_read_redis() -> None:
    from prometheus_client import CollectorRegistry

    from sits_queue.config import SitsConfig

    # (it answered 200 with no samples: a healthy target with an empty fleet)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.WorkerCollector(SitsConfig(redis_url="redis://127.0.0.1:1/0")))
    text = generate_latest(registry).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text)
               for s in f.samples}
    assert samples["sits_redis_up"] == 0


def test_each_redis_url_gets_its_own_client_in_a_process() -> None:
    from sits_queue.config import SitsConfig
    from sits_queue.workers import advertise

    # (cached per process only: a process with two configurations, or a test that
    # scraped an unreachable Redis, sent every later scrape to the first one's Redis)
    one, two = (SitsConfig(redis_url=f"redis://127.0.0.1:{port}/0") for port in (1, 2))
    get = advertise.client_for  # (the task statistics' writes use it too)
    assert get(one).connection_pool.connection_kwargs["port"] == 1
    assert get(two).connection_pool.connection_kwargs["port"] == 2
    assert get(two) is get(two)
    assert get(one).connection_pool.connection_kwargs["socket_connect_timeout"] == 2


def test_mig_devices_of_one_gpu_are_series_of_their_own() -> None:
    # (the slices of one GPU share its NVML index: their series had one label set, and
    # Prometheus rejects a scrape with two samples of one)
    slices = [{"kind": "cuda", "index": 0, "uuid": f"MIG-{n}", "total_vram_bytes": 10 * 2**30,
               "free_vram_bytes": n * 2**30} for n in (1, 2)]
    whole = {"kind": "cuda", "index": 1, "uuid": "GPU-1", "total_vram_bytes": 80 * 2**30,
             "free_vram_bytes": 3 * 2**30}
    m = scrape([{"hostname": "w3@h", "concurrency": 3, "devices": [*slices, whole]}])
    w = ("worker", "w3@h")
    free = {dict(k[1])["device"]: v for k, v in m.items()
            if k[0] == "sits_device_vram_bytes" and ("state", "free") in k[1] and w in k[1]}
    assert free == {"cuda:0/MIG-1": 2**30, "cuda:0/MIG-2": 2 * 2**30, "cuda:1": 3 * 2**30}


def _samples(fams: list[Any]) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("model", "")): s.value for f in fams for s in f.samples}


def test_the_last_pre_warm_pass_is_gauges_of_a_bounded_set_of_models() -> None:
    """(the planner's decisions were nowhere a dashboard could read them)"""
    outlooks = [{"model": f"m{i:02d}", "predicted": float(i), "confidence": 0.9,
                 "instances": i % 4, "warm_now": 1, "reason": "pre-warm"} for i in range(25)]
    outlooks += [{"model": 7}, "junk", {"model": "odd", "predicted": "lots"}]
    last = {"age_s": 12.5, "outlooks": outlooks,
            "sent": [{"model": "m24", "hostname": "a"}] * 2 + [{"model": "m03"}, "junk"]}
    got = _samples(metrics.prewarm_families(last))
    assert got[("sits_prewarm_last_pass_age_seconds", "")] == 12.5
    # the 20 most predicted models only, each with what the pass weighed
    models = {m for (name, m) in got if name == "sits_prewarm_predicted_tasks"}
    assert models == {f"m{i:02d}" for i in range(5, 25)}
    assert got[("sits_prewarm_instances_wanted", "m23")] == 3
    assert got[("sits_prewarm_instances_warm", "m23")] == 1
    assert got[("sits_prewarm_sent", "m24")] == 2 and got[("sits_prewarm_sent", "m05")] == 0
    assert ("sits_prewarm_sent", "m03") not in got  # (not among those shown)
    # before any pass, or a record not readable: no such gauges (not zeros)
    assert metrics.prewarm_families(None) == []
    assert metrics.prewarm_families({"error": "WRONGTYPE"}) == []
    assert metrics.prewarm_families({"outlooks": "x"}) == []


@pytest.mark.parametrize(("err", "hint"), [
    (98, "give each worker on a host its own SITS_METRICS_PORT"),  # EADDRINUSE
    # (a port under 1024 without the privilege: the address was blamed)
    (13, "choose a SITS_METRICS_PORT of 1024 or more"),  # EACCES
    (99, "check SITS_METRICS_ADDR"),  # EADDRNOTAVAIL
])
def test_an_endpoint_that_cannot_listen_says_what_to_change(
        err: int, hint: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def refused(*_: Any, **__: Any) -> Any:
        raise OSError(err, "refused")

    monkeypatch.setattr(metrics, "start_http_server", refused)
    with caplog.at_level("ERROR", logger=metrics.logger.name):
        assert metrics.serve(SitsConfig(metrics_port=80), "w@h") is None
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("metrics endpoint not started: cannot listen on") and hint in said


@pytest.mark.parametrize(("addr", "url"), [("::1", "http://[::1]:"),
                                           ("127.0.0.1", "http://127.0.0.1:")])
def test_the_endpoint_logs_a_url_an_ipv6_address_can_be_opened_at(
        addr: str, url: str, caplog: pytest.LogCaptureFixture) -> None:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family) as probe:  # (a free port on that address)
            probe.bind((addr, 0))
            port = probe.getsockname()[1]
    except OSError as exc:  # (a host without IPv6 on its loopback: nothing to show)
        pytest.skip(f"cannot listen on {addr}: {exc}")
    with caplog.at_level("INFO", logger=metrics.logger.name):
        assert metrics.serve(SitsConfig(metrics_port=port, metrics_addr=addr), "w@h",
                             strict=True) is not None
    try:
        (said,) = [r.getMessage() for r in caplog.records if "metrics at" in r.getMessage()]
        assert said == f"metrics at {url}{port}/metrics"
    finally:
        metrics.stop()
