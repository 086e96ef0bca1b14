"""The embedded server found by what answers on its port, not by its pid file: a pid file
naming another process must not start a second server on the same AOF."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sits_queue.embedded import EmbeddedRedis, ensure_server, stop_server
from tests.integration.test_embedded import _gone
from tests.waiting import wait_for


def _pid_of(data_dir: Path) -> int:
    return int((data_dir / "redis.pid").read_text())


def _redis_servers_in(data_dir: Path) -> list[int]:
    """Pids of the redis-servers running in ``data_dir`` (ours run there: ``dir``)."""
    found = []
    for proc in psutil.process_iter(["name", "cwd"]):
        if "redis-server" in (proc.info["name"] or "") and proc.info["cwd"] and \
                Path(proc.info["cwd"]) == data_dir.resolve():
            found.append(proc.pid)
    return found


@pytest.fixture
def shared_dir(tmp_path: Path) -> Iterator[Path]:
    """A data dir for ensure_server whose daemons are stopped even if the test fails."""
    data_dir = tmp_path / "shared"
    yield data_dir
    stop_server(data_dir)
    for pid in _redis_servers_in(data_dir):  # any second server a failing test left
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def bystander() -> Iterator[int]:
    """A live process that is not a redis-server, for a pid file to name."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_a_pid_file_naming_another_process_does_not_start_a_second_server(
        shared_dir: Path, bystander: int) -> None:
    # Given a live server whose pid file was overwritten with another live process's pid
    url, _ = ensure_server(shared_dir)
    pid = _pid_of(shared_dir)
    (shared_dir / "redis.pid").write_text(f"{bystander}\n")
    # When the CLI asks again, then it reuses that server and corrects its pid file
    again, started = ensure_server(shared_dir)
    assert (again, started) == (url, False)
    assert _pid_of(shared_dir) == pid
    assert _redis_servers_in(shared_dir) == [pid]
    # and stopping stops it, and only it
    (shared_dir / "redis.pid").write_text(f"{bystander}\n")
    assert stop_server(shared_dir)
    assert _gone(pid) and not _gone(bystander)
    assert _redis_servers_in(shared_dir) == []


@pytest.mark.parametrize("same_password", [True, False])
def test_a_server_of_another_dir_on_the_recorded_port_is_not_adopted(
        shared_dir: Path, tmp_path: Path, bystander: int, same_password: bool) -> None:
    # Given our server stopped, and another dir's server (with our password, or another)
    # now on its port
    ensure_server(shared_dir)
    port = int((shared_dir / "port").read_text())
    password = (shared_dir / "password").read_text().strip()
    stop_server(shared_dir)
    theirs = password if same_password else "not-" + password
    with EmbeddedRedis(tmp_path / "other", port=port, password=theirs) as other:
        assert other.pid is not None
        (shared_dir / "redis.pid").write_text(f"{bystander}\n")
        # When the CLI needs its server, then it starts its own elsewhere
        url, started = ensure_server(shared_dir)
        assert started and f":{port}/" not in url
        assert _pid_of(shared_dir) != other.pid
        # and stopping ours leaves the other one running
        assert stop_server(shared_dir)
        assert not _gone(other.pid)


@pytest.mark.parametrize("pid_file", ["ours", "-5", "gone"])
def test_a_busy_server_is_reused_not_replaced(shared_dir: Path, pid_file: str) -> None:
    """(a server busy past the probe's 0.5 s, running a long script, was taken for dead:
    killed, and every connected worker with it)"""
    import threading

    import redis

    url, _ = ensure_server(shared_dir)
    pid = _pid_of(shared_dir)
    if pid_file != "ours":
        (shared_dir / "redis.pid").write_text("-5\n" if pid_file == "-5" else "")
    busy = redis.Redis.from_url(url)
    # A script that holds the server for 2 s (below lua-time-limit: no BUSY replies yet,
    # nothing answered at all)
    holding = threading.Thread(target=busy.eval, args=(
        "local t = tonumber(redis.call('TIME')[1]) + 2 "
        "while tonumber(redis.call('TIME')[1]) < t do end", 0))
    holding.start()
    try:
        def held() -> bool:  # a PING goes unanswered while the script holds the server
            try:
                return not redis.Redis.from_url(url, socket_timeout=0.2).ping()
            except redis.TimeoutError:
                return True

        wait_for(held, 10, "the script to hold the server")
        again, started = ensure_server(shared_dir)
    finally:
        holding.join()
    assert (again, started) == (url, False)
    assert _redis_servers_in(shared_dir) == [pid] and _pid_of(shared_dir) == pid
    assert busy.ping()  # the same server, and its client's connection, live on


@pytest.mark.parametrize("content", ["-5", "-1", "0"])
def test_a_pid_file_that_names_no_process_is_ignored(shared_dir: Path, content: str) -> None:
    """(psutil refused a negative pid with a ValueError: every sitsq command failed with a
    traceback until the file was deleted)"""
    url, _ = ensure_server(shared_dir)
    stop_server(shared_dir)
    (shared_dir / "redis.pid").write_text(f"{content}\n")
    again, started = ensure_server(shared_dir)
    assert (again, started) == (url, True)
    assert stop_server(shared_dir)


def test_a_lost_password_file_is_read_back_and_the_server_kept(shared_dir: Path) -> None:
    """(a new password made the live server look dead: it was replaced, and every worker
    holding the old URL was refused for good)"""
    url, _ = ensure_server(shared_dir)
    pid = _pid_of(shared_dir)
    (shared_dir / "password").unlink()
    again, started = ensure_server(shared_dir)
    assert (again, started) == (url, False)
    assert _redis_servers_in(shared_dir) == [pid]
    assert (shared_dir / "password").read_text().strip() in url
