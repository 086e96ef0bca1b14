"""One Redis URL for every user of it: Celery's broker layer (kombu), its result backend,
the beat's redbeat and SITS's own redis-py clients.

Each reads a URL's query its own way: redis-py takes its connection options there, but
kombu passes every query option to its ``Connection`` as a keyword and refuses those it
does not know (``?socket_timeout=5`` stopped every producer, worker and beat with a
``TypeError``), and Celery's backend passes them to redis-py untyped. So
:func:`celery_parts` gives Celery the URL without its connection options, and those
options typed, for the broker's transport options and the backend's ``redis_*``
settings (redbeat and SITS's clients take the URL whole). A ``rediss://`` URL's TLS
options stay in it: kombu and Celery read those from the URL themselves.

And the checks every Redis URL passes (:func:`check_redis_url`), and the masking of
credentials in what is shown (:func:`redacted`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from sits_queue import checks
from sits_queue.errors import ConfigError

#: Connection options a URL may carry, by how its value is read (as redis-py reads it).
CONNECTION_OPTIONS: dict[str, Callable[[str], Any]] = {
    "socket_timeout": float, "socket_connect_timeout": float,
    "socket_keepalive": lambda v: v.strip().lower() in ("1", "true", "yes", "on"),
    "retry_on_timeout": lambda v: v.strip().lower() in ("1", "true", "yes", "on"),
    "health_check_interval": int, "max_connections": int,
}
#: Celery's result-backend setting for each of them.
BACKEND_SETTINGS = {
    "socket_timeout": "redis_socket_timeout",
    "socket_connect_timeout": "redis_socket_connect_timeout",
    "socket_keepalive": "redis_socket_keepalive",
    "retry_on_timeout": "redis_retry_on_timeout",
    "health_check_interval": "redis_backend_health_check_interval",
    "max_connections": "redis_max_connections",
}
#: Yes/no query options, and the words redis-py and Celery both read the same way.
_URL_FLAGS = frozenset({"socket_keepalive", "retry_on_timeout"})
_FLAG_WORDS = frozenset({"1", "true", "yes", "0", "false", "no"})
#: A ``rediss://`` URL's TLS options, which kombu and Celery read from the URL.
TLS_OPTIONS = frozenset({"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})
#: What a ``rediss://`` URL's ``ssl_cert_reqs`` may say (Celery's backend requires it).
CERT_REQS = ("required", "optional", "none")


def unsupported(url: str) -> str | None:
    """Why Celery cannot use ``url`` (its scheme, a query option it refuses, a missing TLS
    setting), or None. For the main Redis URL: a site peer's is redis-py's alone."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return ("a unix socket cannot be Celery's broker URL (kombu reads its path as a "
                "database); give redis://host:port")
    query = parse_qsl(parts.query, keep_blank_values=True)
    odd = sorted({k for k, _ in query} - set(CONNECTION_OPTIONS) - TLS_OPTIONS - {"db"})
    if odd:
        return (f"query option {', '.join(odd)} is not one Celery's broker layer takes "
                f"(it takes {', '.join(sorted(CONNECTION_OPTIONS))}, db and, for "
                "rediss://, the ssl_* files and ssl_cert_reqs)")
    tls = sorted({k for k, _ in query} & TLS_OPTIONS)
    if tls and parts.scheme != "rediss":
        return f"{', '.join(tls)} is for a rediss:// URL"
    reqs = [v for k, v in query if k == "ssl_cert_reqs"]
    if parts.scheme == "rediss" and (not reqs or reqs[-1] not in CERT_REQS):
        return ("a rediss:// URL must say ssl_cert_reqs=required, optional or none "
                "(Celery's result backend refuses one that does not)")
    return None


def celery_parts(url: str) -> tuple[str, dict[str, Any]]:
    """(the URL Celery's broker and backend are given: without connection options, its
    ``?db=`` as the path's database; those options, typed)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    options = {k: CONNECTION_OPTIONS[k](v) for k, v in query if k in CONNECTION_OPTIONS}
    path = parts.path
    for k, v in query:
        if k == "db":  # (redis-py takes it over the path; kombu does not read it)
            path = f"/{int(v)}"
    kept = [(k, v) for k, v in query if k in TLS_OPTIONS]
    return urlunsplit(parts._replace(path=path, query=urlencode(kept))), options


def backend_settings(options: dict[str, Any]) -> dict[str, Any]:
    """Celery's result-backend settings for connection ``options``."""
    return {BACKEND_SETTINGS[k]: v for k, v in options.items() if k in BACKEND_SETTINGS}


# -- checking and showing a URL ----------------------------------------------------------

#: The credentials of a URL (user, password), up to the last "@" before its host: a raw
#: space in a password (redis-py takes one) included, which kept the password in clear
#: (a URL with no path then followed by an "@" in the text masks more: never less).
_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/]*@")


#: A password given as a URL's query option (refused in ours: :func:`check_redis_url`).
_QUERY_PASSWORD = re.compile(r"(?P<key>[?&]password=)[^&\s]*", re.IGNORECASE)


def redacted(text: str) -> str:
    """``text`` with the credentials of every URL in it masked, for messages and logs
    (an "@" in a path, a socket's name, is not a credential: it stays)."""
    return _QUERY_PASSWORD.sub(r"\g<key>***", _CREDENTIALS.sub(r"\g<scheme>***@", text))


def without_credentials(value: Any) -> Any:
    """``value`` with the credentials of every URL in it masked, through mappings and
    sequences: for what is shown to others (remote-control replies, Flower)."""
    if isinstance(value, str):
        return redacted(value)
    if isinstance(value, Mapping):
        return {k: without_credentials(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_credentials(v) for v in value]
    return value


#: Query options of a Redis URL that are durations, s: a timeout must be > 0 (0 makes
#: the socket non-blocking, every read fails), the health-check interval >= 0 (0: off).
_URL_DURATIONS = {"socket_timeout": 0.0, "socket_connect_timeout": 0.0,
                  "health_check_interval": None}


#: What kombu's URL parser takes from a URL's parts, and refuses twice from its query.
_KOMBU_URL_FIELDS = frozenset({"transport", "hostname", "port", "userid", "password",
                               "virtual_host"})


def check_redis_url(url: str, what: str = "redis_url", celery: bool = True) -> str:
    """``url``, if redis-py can take it as meant; else a ConfigError naming what is wrong
    (redis-py raises a bare ValueError for a port out of range, reads a database that is
    not a number as database 0, and takes an unknown query option or a negative timeout
    until the first connection, where it fails as a TypeError or a socket error).
    ``what``: how the message names it (a site peer's entry); ``celery``: Celery's
    broker and backend use it too (``redisurl.unsupported``), not only redis-py."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"{what} must be redis://, rediss:// or unix://, got "
                          f"{checks.shown(redacted(url))}")
    shown = checks.shown(redacted(url))
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (parsed on access: raises for a bad port)
        if parts.hostname:  # (what the resolver will be given: idna fails at connect)
            parts.hostname.encode("idna")
    except (ValueError, UnicodeError) as exc:  # Invalid IPv6 URL, a port out of range
        raise ConfigError(f"{what} {shown}: {exc}") from None
    if parts.scheme == "unix" and not parts.path.strip("/"):
        raise ConfigError(f"{what} {shown}: no socket path (unix:///path/to/redis.sock)")
    db = parts.path.strip("/") if parts.scheme != "unix" else ""
    if db and not db.isdigit():
        raise ConfigError(f"{what} {shown}: database {db!r} is not a number")
    # Kombu (Celery's broker layer) reads these from the URL itself: given in the query
    # too, every producer and Celery command failed with a raw TypeError ("multiple
    # values for keyword argument 'password'")
    query = parse_qsl(parts.query)  # (without blank options: those are refused below)
    clashing = sorted(k for k, _ in query if k in _KOMBU_URL_FIELDS)
    if clashing:
        raise ConfigError(f"{what} {shown}: {', '.join(clashing)} cannot be a query option "
                          "(Celery's broker layer reads it from the URL itself); give the "
                          "password as redis://:PASSWORD@host, a user as redis://USER:"
                          "PASSWORD@host")
    # (parse_qsl drops them, so did every check below; Celery's reading of the URL does
    # not: "?socket_timeout=" ended every command on a traceback, "could not convert
    # string to float: ''")
    blank = sorted({k for k, v in parse_qsl(parts.query, keep_blank_values=True)
                    if not v.strip()})
    if blank:
        raise ConfigError(f"{what} {shown}: query option {', '.join(blank)} has no value")
    for key, path in query:
        # redis-py opens them at the first connection and says "No such file or
        # directory" naming none: a worker retried that for good
        if key in TLS_OPTIONS - {"ssl_cert_reqs"} and not os.access(path, os.R_OK):
            state = "is not a readable file" if os.path.exists(path) else "does not exist"
            raise ConfigError(f"{what} {shown}: {key} {path} {state}")
    for key, word in query:
        # redis-py reads any value but 0/f/false/n/no as true, this module's reading for
        # Celery's backend only 1/true/yes/on: "off" or "maybe" meant one to the broker's
        # connections and the other to the backend's
        if key in _URL_FLAGS and word.strip().lower() not in _FLAG_WORDS:
            raise ConfigError(f"{what} {shown}: {key} must be true or false (1/0, yes/no), "
                              f"got {checks.shown(word)}")
    import redis  # (a light import; redis is loaded anyway)

    try:  # its query options: ?socket_timeout=5s, ?db=abc or ?foo=1 raised at first use
        connection = redis.ConnectionPool.from_url(url).make_connection()
    except TypeError as exc:  # the connection class takes no such keyword
        option = str(exc).rsplit(" ", 1)[-1]
        raise ConfigError(f"{what} {shown}: no query option {option} for a "
                          f"{parts.scheme}:// connection") from None
    except (ValueError, redis.RedisError) as exc:
        raise ConfigError(f"{what} {shown}: {exc}") from None
    for name, above in _URL_DURATIONS.items():
        value = getattr(connection, name, None)
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (above is not None and value <= above):
            raise ConfigError(f"{what} {shown}: {name} must be "
                              + ("> 0" if above is not None else ">= 0")
                              + f" s, got {value!r}")
    if celery and (why := unsupported(url)) is not None:
        raise ConfigError(f"{what} {shown}: {why}")
    most = [v for k, v in query if k == "max_connections"]
    if celery and most and int(most[-1]) < MIN_CONNECTIONS:
        # (its consumer, producers, result backend and heartbeat each hold one: at 1 a
        # worker started, then lost its broker in a loop and ran nothing)
        raise ConfigError(f"{what} {shown}: max_connections must be at least "
                          f"{MIN_CONNECTIONS} (a worker holds several at once; Celery's "
                          f"default is {MIN_CONNECTIONS}), got {most[-1]}")
    return url


#: The fewest connections per pool a URL may allow (kombu's and Celery's default pool).
MIN_CONNECTIONS = 10


#: Characters a key prefix must not hold: Redis glob characters (kombu subscribes to the
#: remote control's and the events' channels by pattern, the prefix unescaped: a
#: deployment with "dep?:" heard another's "depB:" broadcasts, its shutdown too), hash-tag
#: braces (every key's tag would be the prefix's, one Cluster slot for all), and
#: whitespace or control characters (they break the channel and log lines they go in).
_PREFIX_REFUSED = re.compile(r"[*?\[\]\\{}\s\x00-\x1f\x7f]")


def check_key_prefix(prefix: str, what: str = "global_keyprefix") -> str:
    """``prefix``, if it can prefix every key and channel as meant; else a ConfigError."""
    bad = _PREFIX_REFUSED.search(prefix)
    if bad is not None:
        raise ConfigError(f"{what} {prefix!r} must not contain {bad.group()!r} (no Redis "
                          "glob characters *?[]\\, no braces, no whitespace or control "
                          "characters): channels are subscribed to by pattern and keys "
                          "hash-tagged by queue under it")
    return prefix
