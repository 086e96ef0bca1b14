"""``sitsq``'s own wiring, through click's runner (no Redis): which server a benchmark
runs on, and how a bad setting is reported."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from sits_queue import cli, status
from sits_queue.bench import ab, demo


def stub_bench(monkeypatch: pytest.MonkeyPatch, module: Any, result: dict[str, Any]
               ) -> list[dict[str, Any]]:
    """``module``'s run (recording the keywords of each call, returning ``result``) and
    table stood in for: what the command line passes, without a run."""
    seen: list[dict[str, Any]] = []

    def run(**kwargs: Any) -> dict[str, Any]:
        seen.append(kwargs)
        return result

    monkeypatch.setattr(module, "run", run)
    monkeypatch.setattr(module, "table", lambda result: "table")
    return seen


@pytest.fixture
def ab_runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return stub_bench(monkeypatch, ab, {"systems": {}})


def test_bench_ab_never_runs_on_the_configured_redis(ab_runs: list[dict[str, Any]]) -> None:
    """It flushes the databases it uses: only a server named for it on the command line,
    else a private one (as every other benchmark)."""
    out = CliRunner().invoke(cli.main, ["bench", "ab", "--quick"],
                             env={"SITS_REDIS_URL": "redis://127.0.0.1:6379/0"})
    assert out.exit_code == 0, out.output
    assert ab_runs == [{"quick": True, "redis_url": None, "on_progress": ab_runs[0]["on_progress"]}]
    out = CliRunner().invoke(cli.main, ["bench", "ab", "--redis-url", "redis://h:1/0"])
    assert out.exit_code == 0, out.output
    assert ab_runs[1]["redis_url"] == "redis://h:1/0"


@pytest.mark.parametrize("embedded", [True, False])
def test_the_demo_keeps_to_its_prefix_on_any_server(monkeypatch: pytest.MonkeyPatch,
                                                    embedded: bool) -> None:
    """(on the embedded server it ran without one: `sitsq celery ...` keeps the user's
    work there, and the demo's worker dead-lettered their waiting tasks)"""
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(cli, "_resolved", lambda: ("redis://h:1/0", embedded))
    monkeypatch.setattr(demo, "run_demo", lambda url, **kwargs: seen.append(kwargs))
    out = CliRunner().invoke(cli.main, ["demo", "--jobs", "5"])
    assert out.exit_code == 0, out.output
    assert [k["prefix"] for k in seen] == [demo.PREFIX] and demo.PREFIX


def test_a_demo_whose_worker_dies_says_why_in_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(a bad worker setting gave an 86-line traceback)"""
    def died(url: str, **kwargs: Any) -> None:
        raise RuntimeError("worker demo@h exited with 1:\nTraceback (most recent call "
                           "last):\n  File ...\nsits_queue.errors.ConfigError: "
                           "SITS_DEVICE_CACHE_BYTES='lots' is not a size\n")

    monkeypatch.setattr(cli, "_resolved", lambda: ("redis://h:1/0", True))
    monkeypatch.setattr(demo, "run_demo", died)
    out = CliRunner().invoke(cli.main, ["demo"])
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert out.output.strip().splitlines() == [
        "Error: the demo's worker demo@h exited with 1: sits_queue.errors.ConfigError: "
        "SITS_DEVICE_CACHE_BYTES='lots' is not a size"]


def test_a_demo_whose_redis_goes_away_says_so_in_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(kombu wraps the connection error where the demo publishes: `sitsq stop-redis`
    under a running demo ended it in a 228-line traceback)"""
    from kombu.exceptions import OperationalError

    def lost(url: str, **kwargs: Any) -> None:
        raise OperationalError("Error 111 connecting to 127.0.0.1:5. Connection refused.")

    monkeypatch.setattr(cli, "_resolved", lambda: ("redis://h:1/0", True))
    monkeypatch.setattr(demo, "run_demo", lost)
    out = CliRunner().invoke(cli.main, ["demo"])
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert out.output.strip().startswith("Error: cannot reach Redis")


def test_every_bench_offers_the_same_options() -> None:
    out = CliRunner().invoke(cli.main, ["bench", "--help"])
    assert "ab" in out.output and "coldstart" in out.output
    for name in ("ab", "broker", "precision"):
        helped = CliRunner().invoke(cli.main, ["bench", name, "--help"]).output
        assert "--quick" in helped and "--json" in helped and "FLUSHES" in helped


def test_smoke_is_offered_where_a_benchmark_has_its_shape_and_reaches_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sits_queue.bench import batch, coldstart

    for name in cli._SMOKED:
        assert "--smoke" in CliRunner().invoke(cli.main, ["bench", name, "--help"]).output
    assert "--smoke" not in CliRunner().invoke(cli.main, ["bench", "ab", "--help"]).output
    out = CliRunner().invoke(cli.main, ["bench", "ab", "--smoke"])
    assert out.exit_code == 2 and "No such option '--smoke'" in out.output
    out = CliRunner().invoke(cli.main, ["bench", "batch", "--quick", "--smoke"])
    assert out.exit_code == 2 and "--quick and --smoke are two sizes" in out.output
    seen = stub_bench(monkeypatch, batch, {"meta": {}})
    out = CliRunner().invoke(cli.main, ["bench", "batch", "--smoke"])
    assert out.exit_code == 0, out.output
    assert seen == [{"quick": True, "redis_url": None, "zoo_root": None,
                     "shape": batch.SMOKE}]
    assert '"smoke": true' in out.output
    # the module's own command line refuses both sizes too
    with pytest.raises(SystemExit):
        coldstart.main(["--quick", "--smoke"])


@pytest.mark.parametrize(("env", "line"), [
    ({"SITS_SLICE_MS": "abc"}, "Error: SITS_SLICE_MS='abc' is not a valid float"),
    ({"SITS_CONFIG": "/nonexistent/sits.toml"},
     "Error: config file /nonexistent/sits.toml does not exist"),
    ({"SITS_REDIS_URL": "redis://127.0.0.1:99999/0"},
     "Error: redis_url 'redis://127.0.0.1:99999/0': Port out of range 0-65535 "
     "(set by SITS_REDIS_URL)"),
    # (status took it, where the app, its workers and `celery -A` refused it)
    ({"SITS_DEVICE_CACHE_BYTES": "lots", "SITS_REDIS_URL": "redis://127.0.0.1:1/0"},
     "Error: SITS_DEVICE_CACHE_BYTES='lots' is not a number of bytes (say 8GiB, 512MB or "
     "65536)"),
])
def test_a_bad_setting_is_one_line_naming_it(env: dict[str, str], line: str) -> None:
    import os

    out = subprocess.run([sys.executable, "-m", "sits_queue.cli", "status"], env={
        **{k: v for k, v in os.environ.items() if not k.startswith("SITS_")}, **env},
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip() == line


def test_help_works_beside_a_bad_setting() -> None:
    """(the package's import stopped every sitsq command: even --help printed only the
    setting's error)"""
    import os

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SITS_")},
           "SITS_SLICE_MS": "abc"}
    for args in (["--help"], ["status", "--help"]):
        out = subprocess.run([sys.executable, "-m", "sits_queue.cli", *args], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.startswith("Usage: "), out.stderr


@pytest.mark.parametrize("command", [
    [str(Path(sys.executable).with_name("celery")), "-A", "sits_queue", "worker"],
    [sys.executable, "-m", "celery", "-A", "sits_queue", "inspect", "ping"],
])
def test_celerys_command_line_says_a_bad_setting_in_one_line(command: list[str],
                                                             tmp_path: Path) -> None:
    import os

    # (from another directory: the package as installed, as a user's shell finds it)
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**{k: v for k, v in os.environ.items()
                                 if not k.startswith("SITS_")}, "SITS_SLICE_MS": "abc"})
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == "Error: SITS_SLICE_MS='abc' is not a valid float"


def test_celerys_command_line_says_a_bad_cache_size_in_one_line(tmp_path: Path) -> None:
    """(the worker's children read it: the worker stopped with two tracebacks, 68 lines)"""
    import os

    command = [str(Path(sys.executable).with_name("celery")), "-A", "sits_queue", "worker"]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**{k: v for k, v in os.environ.items()
                                 if not k.startswith("SITS_")}, "SITS_DEVICE_CACHE_BYTES": "8XB"})
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == ("Error: SITS_DEVICE_CACHE_BYTES='8XB' is not a number of "
                                  "bytes (say 8GiB, 512MB or 65536)")


def test_a_program_importing_the_package_gets_the_exception() -> None:
    import os

    out = subprocess.run([sys.executable, "-c", "import sits_queue"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "SITS_SLICE_MS": "abc"})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "sits_queue.errors.ConfigError: SITS_SLICE_MS='abc' is not a valid float")


@pytest.mark.parametrize("args", [["dead", "list"], ["dead", "drop", "q", "--all"],
                                  ["dead", "requeue", "q", "--all"]])
def test_a_redis_that_does_not_answer_is_one_line(args: list[str]) -> None:
    # Port 1 refuses at once: nothing listens there.
    out = CliRunner().invoke(cli.main, args, env={"SITS_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert out.exit_code == 1
    assert out.output.startswith("Error: cannot reach Redis at redis://127.0.0.1:1/0: "
                                 "Error 111 connecting to "
                                 "127.0.0.1:1"), out.output
    assert "Traceback" not in out.output


@pytest.mark.parametrize(("args", "said"), [
    (["bench", "ab", "--quick", "--redis-url", "http://h:1/0"],
     "redis_url must be redis://, rediss:// or unix://"),
    (["bench", "ab", "--quick", "--redis-url", "redis://h:1/db"], "is not a number"),
    (["bench", "ab", "--quick", "--json", "/no/such/dir/x.json"],
     "directory /no/such/dir does not exist"),
    (["demo", "--concurrency", "0"], "0 is not in the range 1<=x<=256"),
    # (10^8 jobs ran out of memory building the workload)
    (["demo", "--jobs", "100000000"], "100000000 is not in the range 1<=x<=1000000"),
])
def test_bad_options_are_refused_before_anything_runs(
        ab_runs: list[dict[str, Any]], args: list[str], said: str) -> None:
    out = CliRunner().invoke(cli.main, args)
    assert out.exit_code == 2, out.output  # a usage error, before the run
    assert said in out.output and "Traceback" not in out.output
    assert ab_runs == []


def test_a_bench_module_run_alone_refuses_an_unwritable_json_path(
        capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    with pytest.raises(SystemExit) as exited:
        ab.main(["--quick", "--json", str(tmp_path / "missing" / "x.json")])
    assert exited.value.code == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--quick", "--json", str(tmp_path)])  # a directory
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://h:1/0", "redis://h:1/5"),
    ("redis://:pw@h:1", "redis://:pw@h:1/5"),
    # counted from the URL's own database (ab flushed 1-4 whatever the URL named)
    ("rediss://h:1/2?socket_timeout=3", "rediss://h:1/7?socket_timeout=3"),
    ("unix:///tmp/r.sock", "unix:///tmp/r.sock?db=5"),
    ("unix://u:pw@/tmp/r.sock?db=2&socket_timeout=3", "unix://u:pw@/tmp/r.sock?socket_timeout=3&db=7"),
    # (redis-py takes db= over the path: every system ran in database 2)
    ("redis://h:1/0?db=2&socket_timeout=3", "redis://h:1/7?socket_timeout=3"),
])
def test_a_benchmarks_database_is_set_in_any_redis_url(url: str, expected: str) -> None:
    from sits_queue.bench.report import database_url

    assert database_url(url, 5) == expected


def test_a_benchmark_refuses_databases_past_the_server_s() -> None:
    from sits_queue.bench.report import redis_server

    with redis_server("redis://127.0.0.1:1/12", 4) as url:
        assert url == "redis://127.0.0.1:1/12"
    # (a server that does not say how many it keeps has Redis's 16; nothing listens here)
    with pytest.raises(SystemExit, match=r"databases 13\.\.16 .* name database 12 or lower"), \
            redis_server("redis://127.0.0.1:1/13", 4):
        pass


@pytest.mark.parametrize("odd", [
    {"devices": "cuda:0"}, {"devices": None}, {"devices": ["cuda:0"]},
    {"cold_start": "none"}, {"cold_start": {"first_tokens": 3}},
    {"cold_start": {"phases_ms": {"load": "slow"}}}, {"profile": {"samples": 4}},
    # (an int past float's range, formatted as a float, raised OverflowError)
    {"cold_start": {"phases_ms": {"load": 10 ** 400}}},
    {"cold_start": {"first_tokens": 1, "first_token_ms_mean": 10 ** 400}},
    {"children": [1]}, {"children": {"0": "warm"}},
])
def test_status_says_a_worker_record_it_cannot_read_and_shows_the_rest(
        odd: dict[str, Any]) -> None:
    """(an older, newer or foreign writer's record made `sitsq status` a traceback)"""
    report = {"queues": [{"queue": "celery", "waiting": 1, "unacked": 0, "dead": 0,
                          "checkpointed": 0, "held": 0,
                          "head": [{"id": "x", "priority": 1.0, "seq": 1,
                                    "sla_class": None, "task": None}]}],
              "workers": [{"hostname": "odd@h", **odd},
                          {"hostname": "good@h", "pid": 1, "concurrency": 1}]}
    shown = status.format_status(report)
    assert "odd@h: advertisement not readable here" in shown
    assert "good@h: pid 1, concurrency 1" in shown and "queue celery: 1 waiting" in shown


def test_status_shows_each_childs_warm_engines_with_tier_and_size() -> None:
    """(it listed the engines' names only: where each was, and how much it held, took
    the Prometheus endpoint)"""
    worker = {"hostname": "w@h", "pid": 1, "concurrency": 2, "warm": ["enc", "gpt"],
              "children": {"1": {"warm": {"gpt": "host"}},  # an older writer's: no sizes
                           "0": {"warm": {"enc": "device", "gpt": "device"},
                                 "warm_bytes": {"enc": 3 * 2**20, "gpt": 1536 * 2**20}}}}
    shown = status.format_status({"queues": [], "workers": [worker]})
    assert ("    warm: enc on slot 0 (device, 3.0 MiB); gpt on slot 0 (device, 1,536.0 MiB); "
            "gpt on slot 1 (host)") in shown.splitlines()
    idle = status.format_status({"queues": [], "workers": [{**worker, "children": {}}]})
    assert "warm:" not in idle


def test_status_shows_cold_start_phases_as_means_per_start_and_in_all() -> None:
    """(it showed the totals alone, beside a mean first-token time: 832 ms of loading
    over six cold starts read as one start's)"""
    worker = {"hostname": "w@h", "pid": 1, "concurrency": 1, "cold_start": {
        "cold": 6, "tasks": 40, "phases_ms": {"load": 832.2, "promote": 2.6, "warmup": 75.0}}}
    shown = status.format_status({"queues": [], "workers": [worker]})
    assert ("    cold-start ms, mean of 6: load 138.7, promote 0.4, warmup 12.5 (in all: "
            "load 832.2, promote 2.6, warmup 75.0)") in shown.splitlines()
    worker["cold_start"]["cold"] = 0  # (a record whose counts cannot say how many)
    assert "    cold-start ms, in all: load 832.2, promote 2.6, warmup 75.0" in \
        status.format_status({"queues": [], "workers": [worker]}).splitlines()


def test_status_shows_each_devices_free_memory() -> None:
    """(a worker of several GPUs showed their names only: how much each had free took
    --json)"""
    gib = 2**30
    worker = {"hostname": "w@h", "pid": 1, "concurrency": 2, "devices": [
        {"index": 0, "kind": "cuda", "name": "NVIDIA H100 80GB HBM3",
         "total_vram_bytes": 80 * gib, "free_vram_bytes": 70 * gib},
        {"index": 1, "kind": "cuda", "name": "NVIDIA A100-SXM4-40GB",
         "total_vram_bytes": 40 * gib, "free_vram_bytes": 2 * gib + gib // 2},
        {"index": 2, "kind": "cuda", "name": "odd", "free_vram_bytes": "lots"}]}
    shown = status.format_status({"queues": [], "workers": [worker]})
    assert ("    devices: cuda:0 NVIDIA H100 80GB HBM3 70.0 of 80.0 GiB free; cuda:1 NVIDIA "
            "A100-SXM4-40GB 2.5 of 40.0 GiB free; cuda:2 odd") in shown.splitlines()
    # one NVML could not read at the worker's last refresh says its reading is old (it
    # showed a lost GPU's last free memory as now's)
    worker["devices"][1]["readable"] = False
    shown = status.format_status({"queues": [], "workers": [worker]})
    assert "A100-SXM4-40GB 2.5 of 40.0 GiB free (unreadable now: an earlier reading); " \
        "cuda:2" in shown


def test_status_shows_the_queues_a_worker_consumes() -> None:
    worker = {"hostname": "w@h", "pid": 1, "concurrency": 1, "queues": ["a", "b\x1b[2J"]}
    assert "    queues: a, b\\x1b[2J" in status.format_status(
        {"queues": [], "workers": [worker]}).splitlines()
    # every consumer cancelled: said; an earlier release's record: no line
    assert "    queues: none" in status.format_status(
        {"queues": [], "workers": [{**worker, "queues": []}]}).splitlines()
    assert "queues:" not in status.format_status(
        {"queues": [], "workers": [{**worker, "queues": None}]})


def test_status_shows_what_a_workers_picks_weigh_against_its_fleet() -> None:
    worker = {"hostname": "w@h", "pid": 1, "concurrency": 1, "placement": {
        "precisions": {"int8": 0.5}, "bounds": {"memory@fp16": 0.199383},
        "ridges": {"fp16": 206.145833, "int8": 412.3}}}
    worker["links"] = [{"a": 0, "b": 1, "level": "NVLINK", "weight": 1.0}, "junk", {"a": 0}]
    shown = status.format_status({"queues": [], "workers": [worker]})
    assert "    links: cuda:0-cuda:1 NVLINK" in shown.splitlines()
    assert ("    placement: precision int8 +0.5, roofline memory@fp16 +0.199383, fp16 ridge 206 "
            "FLOP/byte") in shown.splitlines()
    # a fleet of one kind weighs nothing, and a record no worker of ours wrote is skipped
    for nothing in ({"precisions": {}, "bounds": {}, "ridges": {}}, "junk",
                    {"bounds": {"memory": "lots"}, "ridges": [1]}):
        assert "placement:" not in status.format_status(
            {"queues": [], "workers": [{**worker, "placement": nothing}]})


def test_status_names_each_mig_slice_by_its_uuid_as_metrics_do() -> None:
    """(two slices of GPU 0 were both "cuda:0": which had the room was not to be told)"""
    gib = 2**30
    slices = [{"index": 0, "kind": "cuda", "uuid": f"MIG-{n}", "name": "NVIDIA A100 3g.40gb",
               "total_vram_bytes": 40 * gib, "free_vram_bytes": free * gib}
              for n, free in (("aaaa", 39), ("bbbb", 1))]
    whole = {"index": 1, "kind": "cuda", "uuid": "GPU-cccc", "name": "NVIDIA A100"}
    worker = {"hostname": "w@h", "pid": 1, "concurrency": 3, "devices": [*slices, whole]}
    shown = status.format_status({"queues": [], "workers": [worker]})
    assert ("    devices: cuda:0/MIG-aaaa NVIDIA A100 3g.40gb 39.0 of 40.0 GiB free; "
            "cuda:0/MIG-bbbb NVIDIA A100 3g.40gb 1.0 of 40.0 GiB free; cuda:1 NVIDIA A100"
            ) in shown.splitlines()


@pytest.mark.parametrize("last", [
    {"peer": "p"}, {"peer": "p", "rtt_ms": 1, "modes": [1]}, [1], "yesterday",
])
def test_status_says_a_site_record_it_cannot_read_and_shows_the_rest(last: Any) -> None:
    """(a last-pass record of another writer's made `sitsq status` a traceback)"""
    report = {"site": {"site": "s1", "outbox": 2, "replicas_held": {}, "last_pass": last,
                       "last_pass_age_s": None},
              "queues": [], "workers": []}
    shown = status.format_status(report)
    assert "site s1: last pass record not readable here" in shown
    assert "outbox 2" in shown and "no queues yet" in shown


def _outlook(model: str, predicted: float, reason: str = "pre-warm") -> dict[str, Any]:
    return {"model": model, "predicted": predicted, "confidence": 0.9, "concurrency": 1.0,
            "cold_ms": 2000.0, "instances": 4, "warm_now": 1, "reason": reason}


def test_status_says_what_the_last_pre_warm_pass_did_and_why() -> None:
    """(the planner's beat task keeps no result: why a model was not warm was nowhere to
    be read)"""
    last = {"age_s": 42.0, "held_off": ["flaky"],
            "outlooks": [_outlook("small", 1.0, "cold start 12 ms <= 850 ms: not worth it"),
                         _outlook("lm-c", 91.0)]
            + [_outlook(f"m{i}", 0.5, "confidence 0.10 < 0.82") for i in range(8)],
            "sent": [{"model": "lm-c", "hostname": "w1@h"}] * 2
            + [{"model": "lm-c", "hostname": "w2@h"}]}
    shown = status.format_status({"queues": [], "workers": [], "prewarm": last}).splitlines()
    at = shown.index("pre-warm: last pass 42.0 s ago, 10 model(s) forecast, 3 pre-warm(s) "
                     "sent: lm-c to w1@h x2, lm-c to w2@h")
    # most predicted demand first, each with the planner's reason
    assert shown[at + 1] == ("  lm-c: 91.0 task(s) predicted next interval (confidence "
                             "0.9), 4 warm instance(s) wanted, 1 now: pre-warm")
    assert shown[at + 2].startswith("  small: 1.0") and shown[at + 2].endswith("not worth it")
    assert shown[at + 9] == "  ... and 2 more (sitsq status --json)"
    assert shown[at + 10] == "  held off, their pre-warms having not taken: flaky"
    # none recorded yet: no such lines
    assert "pre-warm" not in status.format_status({"queues": [], "workers": [],
                                                   "prewarm": None})


def test_status_says_a_pre_warm_record_it_cannot_read_and_shows_the_rest() -> None:
    report = {"queues": [], "workers": [],
              "prewarm": {"outlooks": [{"model": "x"}], "sent": [], "age_s": 1.0}}
    shown = status.format_status(report)
    assert "pre-warm: last pass record not readable here (KeyError" in shown
    assert "no queues yet" in shown


def test_status_shows_a_score_no_put_of_ours_wrote_as_unknown() -> None:
    from sits_queue.broker.keys import PRIORITY_LEVELS, SEQ_BITS, decode_score, score_base

    for foreign in (math.inf, -math.inf, math.nan, -1.0, -1e300, float(2 ** 60)):
        assert decode_score(foreign) is None
    assert decode_score(float((PRIORITY_LEVELS + 1) << SEQ_BITS) - 1) is not None
    prio, seq = decode_score(float(score_base(37.7) + 5)) or (0.0, 0)
    assert prio == pytest.approx(37.7, rel=0.01) and seq == 5
    report = {"queues": [{"queue": "celery", "waiting": 1, "unacked": 0, "dead": 0,
                          "checkpointed": 0, "held": 0,
                          "head": [{"id": "x", "priority": None, "seq": None,
                                    "sla_class": None, "task": None, "wait_s": None}]}],
              "workers": []}
    assert "           ?  ?       ?" in status.format_status(report)
    assert status.json_safe({"a": [math.nan, 1.5, {"b": math.inf}], "c": "x"}) == \
        {"a": [None, 1.5, {"b": None}], "c": "x"}


def test_status_shows_names_on_one_line_and_when_a_task_falls_due() -> None:
    report = {"queues": [{"queue": "new\nline\x06\x16b", "waiting": 1, "unacked": 0,
                          "dead": 0, "checkpointed": 0, "held": 0,
                          "head": [{"id": "x", "priority": 1.0, "seq": 1, "sla_class": "low",
                                    "task": "t\rx", "wait_s": 0.0, "due_in_s": 60.0}]}],
              "workers": []}
    shown = status.format_status(report).splitlines()
    assert shown[0].startswith("queue new\\nline\\x06\\x16b: 1 waiting")
    assert "t\\rx" in shown[1] and shown[1].endswith("due in 60.0 s")
    assert status.printable("ünïcode ok") == "ünïcode ok"


def test_a_redis_that_does_not_answer_is_named_without_its_password() -> None:
    # (a TLS handshake with a plain server said only "Timeout connecting to server")
    out = CliRunner().invoke(cli.main, ["dead", "list"],
                             env={"SITS_REDIS_URL": "redis://:secret@127.0.0.1:1/0"})
    assert out.exit_code == 1
    assert out.output.startswith("Error: cannot reach Redis at redis://***@127.0.0.1:1/0: ")
    assert "secret" not in out.output


def test_a_demo_signalled_twice_or_stuck_in_its_clean_up_exits_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(a KeyboardInterrupt raised at an arbitrary point can leave a client library's lock
    held and the clean-up waiting on it: a demo sent SIGHUP outlived a minute)"""
    exits: list[int] = []
    monkeypatch.setattr(demo.os, "_exit", exits.append)
    with pytest.raises(KeyboardInterrupt), demo._stopped_as_on_ctrl_c():
        demo._interrupted(signal.SIGHUP, None)
    # cleaned up in time: the deadline is cancelled (a caller that goes on is not ended)
    assert exits == [] and not demo._deadline
    # a second signal during the clean-up: at once
    with pytest.raises(KeyboardInterrupt), demo._stopped_as_on_ctrl_c():
        try:
            demo._interrupted(signal.SIGTERM, None)
        finally:
            demo._interrupted(signal.SIGTERM, None)  # (the stand-in returns)
    assert exits == [1] and not demo._deadline
    # a clean-up that outlasts the deadline: ended by it
    exits.clear()
    monkeypatch.setattr(demo, "FORCED_EXIT_S", 0.05)
    with pytest.raises(KeyboardInterrupt), demo._stopped_as_on_ctrl_c():
        try:
            demo._interrupted(signal.SIGHUP, None)
        finally:
            deadline = demo._deadline[0]
            deadline.join(5)
    assert exits == [1]


def test_a_benchmark_without_the_inference_extra_names_it_in_one_line() -> None:
    """(`sitsq bench joins --smoke` without torch ended in a 64-line traceback)"""
    import os

    code = ("import sys; sys.modules['torch'] = sys.modules['transformers'] = None; "
            "from sits_queue import cli; cli.main(['bench', 'joins', '--smoke'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items()
                                           if not k.startswith("SITS_")})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].endswith(
        "this needs the inference extra: pip install 'sits-queue[inference]'"), out.stderr
    assert "Traceback" not in out.stderr


def test_sitsq_says_its_version() -> None:
    from importlib.metadata import version

    out = CliRunner().invoke(cli.main, ["--version"])
    assert out.exit_code == 0 and out.output.strip() == f"sitsq, version {version('sits-queue')}"


def test_status_columns_fit_long_class_and_task_names() -> None:
    """(a class of 8 letters ran into its task's name: "criticalp4.echo")"""
    head = [{"id": "x", "priority": 1.0, "seq": 1, "sla_class": "critical", "task": "p4.echo",
             "wait_s": 0.5},
            {"id": "y", "priority": 1.0, "seq": 2, "sla_class": "scavenger",
             "task": "a" * 40, "wait_s": 0.5}]
    report = {"queues": [{"queue": "celery", "waiting": 2, "unacked": 0, "dead": 0,
                          "checkpointed": 0, "held": 0, "head": head}], "workers": []}
    rows = [line.split() for line in status.format_status(report).splitlines()
            if "waited" in line]
    assert rows == [["1.00", "critical", "p4.echo", "waited", "0.5", "s"],
                    ["1.00", "scavenger", "a" * 40, "waited", "0.5", "s"]]


@pytest.mark.parametrize(("argv0", "orig", "celerys"), [
    ("/venv/bin/celery", ["/venv/bin/python", "/venv/bin/celery", "call", "x"], True),
    ("-m", ["python", "-m", "celery", "-A", "sits_queue", "call", "x"], True),
    ("/venv/lib/celery/__main__.py", ["python", "-m", "celery"], True),
    # another program run with -m while its package imports sits_queue: its own
    # tracebacks are left whole
    ("-m", ["python", "-m", "pkg.run"], False),
    ("/venv/bin/sitsq", ["python", "/venv/bin/sitsq", "status"], False),
    ("run.py", ["python", "run.py"], False),
])
def test_sits_errors_are_one_line_on_celerys_command_line_alone(
        monkeypatch: pytest.MonkeyPatch, argv0: str, orig: list[str], celerys: bool) -> None:
    import sits_queue

    monkeypatch.setattr(sys, "argv", [argv0])
    monkeypatch.setattr(sys, "orig_argv", orig)
    assert sits_queue._is_celerys() is celerys


def test_a_benchmark_told_to_stop_exits_so_when_the_signal_landed_in_a_finalizer(
        ) -> None:
    """(Python ignores the handler's SystemExit raised inside a __del__: the run went on
    to its end and exited 0; CI saw it once, `bench ab --quick` sent SIGTERM)"""
    code = (
        "import os, signal, sys, types\n"
        "from sits_queue import cli\n"
        "class Late:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "def main(argv):\n"
        "    late = Late()\n"
        "    del late\n"
        "    return 0\n"
        "sys.modules['late_bench'] = types.ModuleType('late_bench')\n"
        "sys.modules['late_bench'].main = main\n"
        "cli._run_module('late_bench', [], None)\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 128 + signal.SIGTERM, ran.stderr
