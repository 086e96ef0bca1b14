"""``ops/gpu_check.sh`` end to end on a host without a GPU.

A session is lent a GPU rarely and for minutes, and this script is the first thing it
runs there: it must not be found broken on the device. Here it runs as it will there (a
fresh interpreter, tests/gpu under pytest, the benchmarks, one JSON summary), with every
GPU test skipped for the reason the suite gives, but for three things. The benchmarks run
at their ``--smoke`` shape (``BENCH_SIZE=smoke``): their quick shapes are sized for a GPU,
took four minutes of a 2-core CI runner here, and each benchmark's own test already runs
its code at that smoke shape; what is checked here is the script around them. Three of
the five go through it (:data:`THROUGH_THE_SCRIPT`). And their time boxes are widened:
sized for the GPU host (16 cores and a GPU), a 2-core runner
that shares its cores with others ran past them. On a GPU host the script runs those
tests for real and is run by itself, so this test steps aside there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sits_queue.bench.coldstart import REQUIRED
from tests.conftest import GPU_SKIP_REASON, _nvml_device_count

ROOT = Path(__file__).resolve().parents[2]
#: The script's time boxes (``ops/gpu_check.sh``), s, and how much wider they are here.
BOXES_S = {"TESTS_TIMEOUT_S": 180, "BENCH_TIMEOUT_S": 100, "AFFINITY_TIMEOUT_S": 60,
           "BATCH_TIMEOUT_S": 35, "PRECISION_TIMEOUT_S": 45, "JOINS_TIMEOUT_S": 30,
           "CHECK_TIMEOUT_S": 345}
# (Upper bounds only: a run takes what it takes. The quick precision benchmark once took
# ~58 s of its 25 s GPU box on this 2-core CPU; the smoke ones take 5-35 s each.)
WIDER = 4
#: The whole script, widened boxes and all; past that it is broken, not slow.
SCRIPT_TIMEOUT_S = WIDER * sum(s for n, s in BOXES_S.items() if n != "CHECK_TIMEOUT_S") + 120


def test_the_boxes_here_are_the_scripts() -> None:
    script = (ROOT / "ops" / "gpu_check.sh").read_text()
    for name, seconds in BOXES_S.items():
        assert f'{name}="${{{name}:-{seconds}}}"' in script, name


def run_check(out: Path, boxes_s: dict[str, int], timeout_s: float,
              **extra_env: str) -> tuple[int, str, dict[str, Any]]:
    """``ops/gpu_check.sh`` in a fresh process, its time boxes ``boxes_s``, writing to
    ``out``: (exit status, stdout, summary)."""
    if _nvml_device_count() > 0:
        pytest.skip("a GPU is visible: run `bash ops/gpu_check.sh` itself, it runs tests/gpu")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "TMPDIR": str(out),
           # no carried wheels: this interpreter has the packages already
           "WHEELS": str(out / "no-wheels"),
           # the benchmark's model zoo goes to the user cache dir: keep it in the test's
           "XDG_CACHE_HOME": str(out / "cache"),
           **{name: str(seconds) for name, seconds in boxes_s.items()}, **extra_env}
    proc = subprocess.run(["bash", str(ROOT / "ops" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    summary = out / "gpu_check.json"
    assert summary.exists(), proc.stderr[-3000:]
    return proc.returncode, proc.stdout, json.loads(summary.read_text())


#: The benchmarks the end-to-end run below takes through the script: the cold-start one
#: (the summary's own "bench" entry), the frontier and the joins. The affinity and
#: precision ones, ~170 s more of a 2-core runner's CPU at their smoke shapes (the whole
#: suite neared CI's 20 minutes on a slow one), go through the same `run_bench`; their
#: own modules run them at that shape, and the GPU host runs them all.
THROUGH_THE_SCRIPT = "coldstart batch joins"


@pytest.fixture(scope="module")
def check(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Any]]:
    return run_check(tmp_path_factory.mktemp("gpu_check"),
                     {name: WIDER * seconds for name, seconds in BOXES_S.items()},
                     SCRIPT_TIMEOUT_S, BENCH_SIZE="smoke", BENCHES=THROUGH_THE_SCRIPT)


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)  # (the script, not pytest's 300 s)
def test_the_check_passes_with_every_gpu_test_skipped_for_the_reason(
        check: tuple[int, str, dict[str, Any]]) -> None:
    rc, stdout, summary = check
    assert rc == 0, json.dumps(summary, indent=1)[-4000:]
    assert summary["ok"] is True
    assert json.loads(stdout.strip().splitlines()[-1])["ok"] is True
    assert summary["install"] == {"rc": 0, "missing": [], "log_tail": None}
    tests = summary["tests"]
    assert tests["ran"] is True and tests["rc"] == 0
    # Every test module of tests/gpu was collected: none vanished from the check
    modules = {case["test"].split("::")[0] for case in tests["cases"]}
    assert modules == {"tests.gpu.test_gpu_runtime", "tests.gpu.test_tensorrt"}
    assert tests["counts"]["skipped"] == len(tests["cases"]) >= 7
    assert summary["tests_all_skipped"] is True
    runtime = [c for c in tests["cases"] if c["test"].startswith("tests.gpu.test_gpu_runtime")]
    assert all(GPU_SKIP_REASON in c["message"] for c in runtime)


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)  # (the script, not pytest's 300 s)
def test_the_summary_carries_the_benchmark_and_the_host(
        check: tuple[int, str, dict[str, Any]]) -> None:
    _, _, summary = check
    bench = summary["bench"]
    assert bench["ran"] is True and bench["rc"] == 0
    for name, box in (("bench", "BENCH"), ("bench_batch", "BATCH"), ("bench_joins", "JOINS")):
        timed = summary[name]
        assert timed["box_s"] == WIDER * BOXES_S[f"{box}_TIMEOUT_S"], name
        assert 0 <= timed["elapsed_s"] <= timed["box_s"] + 10, name
    for name in ("bench_affinity", "bench_precision"):
        assert summary[name] == {"ran": False, "selected": False,
                                 "reason": "not in BENCHES"}, name
    result = bench["result"]
    assert set(result["systems"]) == {"celery_load_per_task", "celery_lru", "sits"}
    for system in result["systems"].values():
        assert set(REQUIRED) <= set(system)
    assert set(result["ratios"]) == {"cold_cost_vs_lru", "throughput_vs_lru",
                                     "throughput_vs_load_per_task",
                                     "first_token_spread_vs_lru"}
    assert summary["bench_size"] == "smoke"
    assert result["meta"]["quick"] is True and result["meta"]["smoke"] is True
    for name in ("bench_batch", "bench_joins"):
        assert summary[name]["result"]["meta"]["smoke"] is True, name
    frontier = summary["bench_batch"]
    assert frontier["ran"] is True and frontier["rc"] == 0, frontier["log_tail"]
    assert len(frontier["result"]["points"]) == 9 and frontier["result"]["controller"]
    joined = summary["bench_joins"]
    assert joined["ran"] is True and joined["rc"] == 0, joined["log_tail"]
    assert joined["result"]["joined"]["done"] == joined["result"]["meta"]["shape"]["prompts"]
    assert joined["result"]["ratios"]["joined_throughput_vs_static"] is not None
    assert summary["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert summary["versions"]["cuda_available"] is False
    assert summary["gpus"] == [] or "error" in summary["gpus"]
    assert summary["elapsed_s"] < SCRIPT_TIMEOUT_S


#: Stands in for tests/gpu in the test below: one test passes, the next waits until
#: the check's box interrupts it.
INTERRUPTED_TESTS = """
import threading

import pytest


@pytest.mark.gpu
def test_passes():
    pass


@pytest.mark.gpu
def test_waits_for_the_box():
    threading.Event().wait(300)  # until the check's SIGINT
"""
#: The box of the tests above: far past their start-up (no torch to import), far short
#: of the wait.
INTERRUPT_AFTER_S = 20
#: Stands in for tests/gpu where the tests only need to pass: one test, which writes a
#: worker's log in its tmp_path (as the GPU tests' workers do).
QUICK_TESTS = """
import pytest


@pytest.mark.gpu
def test_passes(tmp_path):
    (tmp_path / "gpu.log").write_text("pool child 0 pinned")
"""


def stand_in_tests(tmp_path: Path, source: str) -> Path:
    """A folder of GPU-marked tests, ``source``, for GPU_TESTS."""
    tests_dir = tmp_path / "gpu_tests"
    tests_dir.mkdir()
    (tests_dir / "test_stand_in.py").write_text(source)
    (tests_dir / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: stand-in\n")
    return tests_dir


@pytest.mark.slow
def test_a_step_past_its_box_is_stopped_and_the_summary_says_so(
        tmp_path: Path) -> None:
    tests_dir = stand_in_tests(tmp_path, INTERRUPTED_TESTS)
    boxes = {**dict.fromkeys(BOXES_S, 1), "TESTS_TIMEOUT_S": INTERRUPT_AFTER_S,
             "CHECK_TIMEOUT_S": 600}
    (out := tmp_path / "out").mkdir()
    rc, _, summary = run_check(out, boxes, 180, GPU_TESTS=str(tests_dir))
    assert rc == 1 and summary["ok"] is False
    # pytest, stopped at its box, is interrupted as by ^C rather than killed: it still
    # writes the junit of the tests that ran (SIGTERM, the old kill, left none)
    tests = summary["tests"]
    assert tests["rc"] == 124, tests["log_tail"]
    # the test that finished before the box is in it (the interrupted one's entry, when
    # pytest writes one, has no failure: the step's rc is what says it was cut)
    first = tests["cases"][0]
    assert first["test"].endswith("::test_passes") and first["status"] == "passed", tests
    for name in ("bench", "bench_affinity", "bench_batch", "bench_precision", "bench_joins"):
        assert summary[name]["rc"] == 124 and summary[name]["box_s"] == 1, name


def test_benchmarks_past_the_checks_own_box_are_not_run_and_the_summary_says_so(
        tmp_path: Path) -> None:
    tests_dir = stand_in_tests(tmp_path, QUICK_TESTS)
    # When the check's own box is spent by the time the benchmarks come (it keeps 15 s
    # for a benchmark's kill and the summary)
    boxes = {**BOXES_S, "CHECK_TIMEOUT_S": 15}
    (out := tmp_path / "out").mkdir()
    rc, _, summary = run_check(out, boxes, 120, GPU_TESTS=str(tests_dir))
    # Then no benchmark starts, each says why, and the check is not ok
    assert summary["tests"]["rc"] == 0 and summary["tests"]["counts"]["passed"] == 1
    for name in ("bench", "bench_affinity", "bench_batch", "bench_precision", "bench_joins"):
        assert summary[name] == {
            "ran": False, "reason": "the check's CHECK_TIMEOUT_S was spent before it"}, name
    assert rc == 1 and summary["ok"] is False


def test_benches_picks_the_benchmarks_and_the_others_are_left_out(tmp_path: Path) -> None:
    tests_dir = stand_in_tests(tmp_path, QUICK_TESTS)
    (out := tmp_path / "out").mkdir()
    rc, _, summary = run_check(out, BOXES_S, 120, GPU_TESTS=str(tests_dir),
                               BENCHES="no-such-benchmark", KEEP_LOGS=str(out / "logs.tgz"))
    for name in ("bench", "bench_affinity", "bench_batch", "bench_precision", "bench_joins"):
        assert summary[name] == {"ran": False, "selected": False,
                                 "reason": "not in BENCHES"}, name
    # a check of the tests alone is ok when they pass; its logs are kept whole
    assert rc == 0 and summary["ok"] is True
    listed = subprocess.run(["tar", "-tzf", str(out / "logs.tgz")], capture_output=True,
                            text=True, check=True).stdout.split()
    assert {"./pytest.log", "./junit.xml", "./worker-logs/test_passes0__gpu.log"} <= set(listed)


def test_a_bench_size_the_script_does_not_know_is_refused(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "BENCH_SIZE": "tiny"}
    proc = subprocess.run(["bash", str(ROOT / "ops" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "BENCH_SIZE must be quick or smoke, not 'tiny'" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


#: A ``sitecustomize`` that makes the named modules unimportable, as on a host without
#: them: with None in ``sys.modules``, ``find_spec`` finds nothing and an import raises
#: ModuleNotFoundError.
HIDE = """
import os, sys
for name in os.environ["HIDE_MODULES"].split():
    sys.modules[name] = None
"""


@pytest.mark.parametrize("hidden", ["prometheus_client", "vine"],
                         ids=["listed", "found-by-importing-the-package"])
def test_a_missing_package_is_named_before_any_test_runs(tmp_path: Path, hidden: str) -> None:
    # Given a host without one package the check needs: one it lists, or one only an
    # import of the package itself reveals (Celery's own dependency, vine)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(HIDE)
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path),
           "TMPDIR": str(tmp_path), "WHEELS": str(tmp_path / "no-wheels"),
           "HIDE_MODULES": hidden,
           "PYTHONPATH": str(tmp_path / "site") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(["bash", str(ROOT / "ops" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    # Then the check says so in a line and in its summary, and runs nothing
    assert proc.returncode == 1
    assert f"missing python packages: {hidden}" in proc.stderr
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["install"]["missing"] == [hidden]
    assert summary["tests"]["ran"] is False
