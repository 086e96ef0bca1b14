"""``sitsq``'s own wiring, through click's runner (no Redis): which server a benchmark
runs on, and how a bad setting is reported."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner

from sits_queue import cli
from sits_queue.bench import ab


@pytest.fixture
def ab_runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    def run(**kwargs: Any) -> dict[str, Any]:
        seen.append(kwargs)
        return {"systems": {}}

    monkeypatch.setattr(ab, "run", run)
    monkeypatch.setattr(ab, "table", lambda result: "table")
    return seen


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


def test_every_bench_offers_the_same_options() -> None:
    out = CliRunner().invoke(cli.main, ["bench", "--help"])
    assert "ab" in out.output and "coldstart" in out.output
    for name in ("ab", "broker", "precision"):
        helped = CliRunner().invoke(cli.main, ["bench", name, "--help"]).output
        assert "--quick" in helped and "--json" in helped and "FLUSHES" in helped


@pytest.mark.parametrize(("env", "line"), [
    ({"SITS_SLICE_MS": "abc"}, "Error: SITS_SLICE_MS='abc' is not a valid float"),
    ({"SITS_CONFIG": "/nonexistent/sits.toml"},
     "Error: config file /nonexistent/sits.toml does not exist"),
    ({"SITS_REDIS_URL": "redis://127.0.0.1:99999/0"},
     "Error: redis_url 'redis://127.0.0.1:99999/0': Port out of range 0-65535"),
])
def test_a_bad_setting_is_one_line_naming_it(env: dict[str, str], line: str) -> None:
    import os

    out = subprocess.run([sys.executable, "-m", "sits_queue.cli", "status"], env={
        **{k: v for k, v in os.environ.items() if not k.startswith("SITS_")}, **env},
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip() == line


@pytest.mark.parametrize("args", [["dead", "list"], ["dead", "drop", "q", "--all"],
                                  ["dead", "requeue", "q", "--all"]])
def test_a_redis_that_does_not_answer_is_one_line(args: list[str]) -> None:
    # Port 1 refuses at once: nothing listens there.
    out = CliRunner().invoke(cli.main, args, env={"SITS_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert out.exit_code == 1
    assert out.output.startswith("Error: cannot reach Redis: Error 111 connecting to "
                                 "127.0.0.1:1"), out.output
    assert "Traceback" not in out.output
