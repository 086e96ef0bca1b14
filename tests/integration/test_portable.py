"""A real worker and ``sitsq demo`` where the platform has no CPU affinity calls, as on a
developer's macOS laptop: a ``sitecustomize`` deletes ``os.sched_getaffinity`` and
``os.sched_setaffinity`` in every Python the test starts (the worker died at start with
an AttributeError)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis
from celery import Celery

from sits_queue.procs import start_worker, wait_ready
from sits_queue.workers import cores
from tests.integration.conftest import ROOT, worker_env
from tests.integration.test_profile import profile_of
from tests.waiting import wait_for

#: Deletes what macOS's ``os`` lacks, at the start of each interpreter that finds it.
SITECUSTOMIZE = """
import os
for name in ("sched_getaffinity", "sched_setaffinity"):
    if hasattr(os, name):
        delattr(os, name)
"""


def macos_path(tmp_path: Path) -> str:
    """A PYTHONPATH whose interpreters have no CPU affinity calls."""
    site = tmp_path / "macos"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])


def test_a_worker_without_affinity_serves_and_says_confinement_is_off(
        tmp_path: Path, redis_url: str, redis_client: redis.Redis, client_app: Celery
        ) -> None:
    # Given a prefork worker on a "macOS" Python, sampling its profile five times a second
    env = {**worker_env(redis_url), "PYTHONPATH": macos_path(tmp_path)}
    proc = start_worker("tests.integration.short_sample_app", env, tmp_path / "logs",
                        concurrency=2, cwd=ROOT)
    try:
        wait_ready(client_app, [proc])
        # When it runs tasks in both children (each confines itself to its class first)
        results = [client_app.tasks["w.add"].delay(i, 1) for i in range(4)]
        # Then they complete, and its profile samples without failing
        assert [r.get(timeout=30) for r in results] == [1, 2, 3, 4]
        # (advertised: a sample that fails counts none)
        wait_for(lambda: profile_of(redis_client, proc).get("samples", 0) >= 5, 30,
                 "five samples of its profile")
        log = proc.log()
        assert log.count(cores.UNPINNED_NOTICE) == 1, log[-3000:]
        assert "could not sample" not in log and "Traceback" not in log, log[-3000:]
        assert proc.alive()
    finally:
        proc.stop(timeout_s=15)


def test_the_demo_runs_without_affinity(tmp_path: Path, redis_url: str) -> None:
    env = {**os.environ, "SITS_REDIS_URL": redis_url, "PYTHONPATH": macos_path(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "sits_queue.cli", "demo", "--jobs", "20",
                          "--concurrency", "2"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "completed 20/20" in out.stdout
