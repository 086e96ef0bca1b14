"""What every benchmark program shares: its command line and how it reports."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from sits_queue.checks import make_file_in
from sits_queue.config import check_redis_url
from sits_queue.embedded import EmbeddedRedis

#: Databases a Redis server has unless its ``databases`` setting says otherwise (0-15).
SERVER_DATABASES = 16


@contextmanager
def redis_server(redis_url: str | None, span: int = 1) -> Iterator[str]:
    """The given URL, or a private redis-server (never 6379) for the duration of the run.
    A benchmark runs its ``span`` systems in the URL's database and the next ones, one
    each (:func:`database_url`), and flushes them."""
    if redis_url is not None:
        first = url_database(redis_url)
        if first + span > SERVER_DATABASES and first + span > (
                kept := server_databases(redis_url)):
            raise SystemExit(
                f"--redis-url: this benchmark runs its systems in databases {first}.."
                f"{first + span - 1} (one each, the URL's first) and flushes them; this "
                f"Redis server has 0-{kept - 1}: name database {kept - span} or lower")
        yield redis_url
        return
    with tempfile.TemporaryDirectory(prefix="sits-bench-") as tmp, \
            EmbeddedRedis(Path(tmp) / "redis") as server:
        yield server.url


def server_databases(url: str) -> int:
    """How many databases the server at ``url`` keeps (its ``databases`` setting), else
    :data:`SERVER_DATABASES` where it does not say (CONFIG refused, unreachable: the run
    says that in its own words)."""
    import redis

    try:
        with redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5) as client:
            return int(client.config_get("databases").get("databases", SERVER_DATABASES))
    except (redis.RedisError, ValueError, TypeError, OSError):
        return SERVER_DATABASES


def url_database(url: str) -> int:
    """The database a Redis URL names: its ``db`` query parameter, which redis-py takes
    over the path, else its path (not a ``unix://`` one: that is the socket), else 0."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if "db" in query:
        return int(query["db"])
    path = parts.path.strip("/")
    return int(path) if parts.scheme != "unix" and path.isdigit() else 0


def parser(prog: str, description: str | None = None, smoke: bool = False
           ) -> argparse.ArgumentParser:
    """--quick, --json PATH and --redis-url, the options all benchmarks take; --smoke
    too where the benchmark has a smoke shape."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a smaller run")
    if smoke:
        size.add_argument("--smoke", action="store_true",
                          help="the smallest run through every path: it checks a set-up "
                               "(ops/gpu_check.sh's own test runs it); its figures mean "
                               "nothing")
    p.add_argument("--json", type=_argument(check_json_path, Path),
                   help="also write the JSON result here")
    p.add_argument("--redis-url", type=_argument(check_redis_url),
                   help="use this server: its systems run in the URL's database and the next "
                        "ones, one each, which the benchmark FLUSHES; default: "
                        "a private redis-server")
    return p


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` to three places; None when ``b`` is 0 (nothing to compare against) or
    either was not measured (None)."""
    return round(a / b, 3) if a is not None and b else None


def database_url(base_url: str, offset: int) -> str:
    """``base_url`` naming the database ``offset`` past its own: a benchmark's systems
    each run in their own, from the URL's on (``--redis-url redis://h/9``: 9, 10, ...).
    A ``unix://`` URL's path is the socket, so its database is the ``db`` query
    parameter; other query parameters are kept."""
    database = url_database(base_url) + offset
    parts = urlsplit(base_url)
    # A db query parameter wins over the path in redis-py: every system shared it.
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "db"]
    if parts.scheme == "unix":
        # (by hand: urlunsplit drops the empty host, writing unix:/path)
        return f"unix://{parts.netloc}{parts.path}?{urlencode([*query, ('db', database)])}"
    return urlunsplit(parts._replace(path=f"/{database}", query=urlencode(query)))


#: Longest path quoted whole in an error; a longer one (a name over the OS's 255-byte
#: limit, say) would bury the reason at the end of a screenful.
_QUOTED_PATH_CHARS = 80


def _shortened(path: Path) -> str:
    """``path`` for an error line: its start and its end, which tell paths apart."""
    text = str(path)
    if len(text) <= _QUOTED_PATH_CHARS:
        return text
    keep = (_QUOTED_PATH_CHARS - 3) // 2
    return f"{text[:keep]}...{text[-keep:]} ({len(text)} characters)"


def check_json_path(path: Path) -> Path:
    """``path``, if a result can be written there; else a ValueError saying why."""
    try:
        return _checked_json_path(path)
    except OSError as exc:  # a name too long, a path through a file: stat() itself fails
        raise ValueError(f"cannot write {_shortened(path)}: {exc.strerror or exc}") from exc


def _checked_json_path(path: Path) -> Path:
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ValueError(f"{path} is a directory")
    if not parent.is_dir():
        raise ValueError(f"{parent} is not a directory" if parent.exists()
                         else f"directory {parent} does not exist")
    # Tried, not asked (os.access says yes to root everywhere: a run into /proc went its
    # whole length and then failed to write): a file made and removed beside it, and the
    # file itself opened for appending when it is there, written to by neither
    try:
        if path.exists():
            with path.open("a"):
                pass
        else:
            make_file_in(parent, ".sits-bench-")
    except OSError as exc:
        raise ValueError(f"{path} is not writable: {exc.strerror or exc}") from exc
    return path


def _argument(check: Callable[[Any], Any], convert: Callable[[str], Any] = str
              ) -> Callable[[str], Any]:
    """An argparse ``type`` refusing what ``check`` raises a ValueError for (ConfigError
    is one), with its message."""
    def parse(raw: str) -> Any:
        try:
            return check(convert(raw))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return parse


def targets_line(targets: Mapping[str, bool]) -> str:
    return "targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}"
                                   for k, v in targets.items())


def emit(text: str, result: Mapping[str, Any], json_path: Path | None,
         echo: Callable[[str], Any] = print) -> None:
    """The table, then the JSON; the JSON also to ``json_path`` when given.

    For a benchmark's command line: a file that cannot be written ends the program with a
    one-line error (exit status 1) rather than a traceback. check_json_path ran before the
    run, but the folder may have gone since, the disk filled, or the path be one whose
    check cannot tell (``/proc/x.json``)."""
    echo(text)
    rendered = json.dumps(result, indent=2)
    echo(rendered)
    if json_path:
        try:
            json_path.write_text(rendered + "\n")
        except OSError as exc:
            # SystemExit, not a SitsError: `python -m sits_queue.bench.X` has no handler of
            # ours, and the "Error: " prefix matches what sitsq (click) prints.
            raise SystemExit(f"Error: cannot write the JSON result to {_shortened(json_path)}: "
                             f"{exc.strerror or exc} (the results were printed to stdout)") from exc


def run_main(prog: str, doc: str | None, run_fn: Callable[..., dict[str, Any]],
             table_fn: Callable[[dict[str, Any]], str], argv: list[str] | None,
             progress: bool = False) -> int:
    """The command line of a benchmark that takes only the common options: run it, print
    its table and JSON (``coldstart.zoo_main`` adds ``--zoo`` for the model-zoo ones).
    With ``progress``, ``run_fn`` also takes ``on_progress``: its lines go to stderr."""
    args = parser(prog, doc).parse_args(argv)
    extra: dict[str, Any] = {}
    if progress:
        extra["on_progress"] = lambda line: print(line, file=sys.stderr)
    result = run_fn(quick=args.quick, redis_url=args.redis_url, **extra)
    emit(table_fn(result), result, args.json)
    return 0
