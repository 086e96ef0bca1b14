"""The embedded server's data directory: where it is, who may read it, and the small
files in it (port, password, the config the last start wrote) read and written so that a
damaged or missing one never stops a ``sitsq`` command.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import platformdirs

from sits_queue.errors import SitsError

CONF_FILE = "redis.conf"
LOG_FILE = "redis.log"
PID_FILE = "redis.pid"
PORT_FILE = "port"
PASSWORD_FILE = "password"
LOCK_FILE = ".lock"


def conf_value(value: str) -> str:
    """Quote a value for redis.conf (a path may hold spaces, a password anything)."""
    if "\n" in value or "\r" in value or "\0" in value:
        raise SitsError(f"redis setting {value!r} must not contain line breaks or NUL")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def default_data_dir() -> Path:
    """Where the CLI's embedded server keeps its data (per user).

    A container's user may have no home: HOME unset and a uid with no passwd entry.
    platformdirs then raises RuntimeError (it was a traceback from every ``sitsq``
    command); older versions return a relative ``~/.local/share``, a dir in the cwd.
    """
    try:
        found = Path(platformdirs.user_data_dir("sits-queue"))
    except RuntimeError:
        found = None
    if found is None or not found.is_absolute():
        raise SitsError(f"no place for the embedded Redis's data: {_why_no_home()}; set HOME "
                        "(or XDG_DATA_HOME) to a writable dir, or SITS_REDIS_URL to a Redis "
                        "of your own")
    return found / "redis"


def _why_no_home() -> str:
    home = os.environ.get("HOME")
    if not home:
        return f"HOME is unset and uid {os.getuid()} has no passwd entry"
    return f"HOME={home!r} is not an absolute path"


def make_private(data_dir: Path) -> None:
    """The data dir readable by its owner only, where it is ours: ``mkdir``'s mode is for
    a new one, and Redis creates ``appendonlydir/`` readable by all, so a dir that existed
    open (made by hand, by a tool) showed every queued task to each local user, whatever
    the password."""
    with contextlib.suppress(OSError):  # (not ours to change: left as its owner keeps it)
        stat = data_dir.stat()
        if stat.st_uid == os.getuid() and stat.st_mode & 0o077:
            data_dir.chmod(0o700)


@contextlib.contextmanager
def locked(data_dir: Path) -> Iterator[None]:
    """Serialise ensure/stop per data dir: two ``sitsq`` runs must not start two servers."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    make_private(data_dir)
    with (data_dir / LOCK_FILE).open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_int(path: Path) -> int | None:
    """The positive number ``path`` holds (a pid, a port); None for anything else (a
    pid file holding -5 made every sitsq command fail in psutil until it was deleted)."""
    try:
        value = int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return value if value > 0 else None


def read_port(data_dir: Path) -> int | None:
    """The port recorded for this data dir, if it is one a server can listen on."""
    port = read_int(data_dir / PORT_FILE)
    if port is None:  # lost: the port the last start wrote into its config
        for line in _conf_lines(data_dir):
            if line.startswith("port ") and line[5:].strip().isdigit():
                port = int(line[5:])
    return port if port is not None and 0 < port < 65536 else None


def password_of(data_dir: Path) -> str:
    """The server's password, created once: other local users must not reach user data.
    A password file lost (deleted by hand, a cleaner) is read back from the server's
    config: a new one made the server look dead, and it was replaced, every worker
    holding the old URL refused for good."""
    secret = _password_file(data_dir)
    if secret is None:
        secret = _configured_password(data_dir) or secrets.token_urlsafe(24)
        write_private(data_dir / PASSWORD_FILE, secret + "\n")
    return secret


def _password_file(data_dir: Path) -> str | None:
    """The password file's password; None when it is missing, empty (a failed or cut
    write) or not text (its bytes were damaged: it raised UnicodeDecodeError, and every
    sitsq command, stop-redis too, stopped on a traceback)."""
    with contextlib.suppress(FileNotFoundError, UnicodeDecodeError):
        return (data_dir / PASSWORD_FILE).read_text().strip() or None
    return None


def stored_password(data_dir: Path) -> str | None:
    """The server's password as this data dir keeps it: its file, else the config the
    last start wrote (stop-redis read the file alone: with it and the pid file gone it
    said no server ran, and left it running)."""
    return _password_file(data_dir) or _configured_password(data_dir)


def _configured_password(data_dir: Path) -> str | None:
    """The ``requirepass`` the last start wrote into the server's config, if any."""
    for line in _conf_lines(data_dir):
        name, _, value = line.strip().partition(" ")
        if name == "requirepass" and len(value) >= 2 and value[0] == value[-1] == '"':
            # (conf_value's quoting, undone)
            secret = re.sub(r"\\(.)", r"\1", value[1:-1])
            return secret or None
    return None


def _conf_lines(data_dir: Path) -> list[str]:
    """The lines of the config the last start wrote ([] without one); a damaged byte in
    it must not hide the others (it raised UnicodeDecodeError through every command)."""
    try:
        return (data_dir / CONF_FILE).read_text(errors="replace").splitlines()
    except OSError:
        return []


def write_private(path: Path, text: str) -> None:
    """Write ``text`` whole or not at all (0600; a temporary file renamed over ``path``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
