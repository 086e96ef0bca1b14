"""One Redis URL for every user of it: Celery's broker layer (kombu), its result backend,
the beat's redbeat and SITS's own redis-py clients.

Each reads a URL's query its own way: redis-py takes its connection options there, but
kombu passes every query option to its ``Connection`` as a keyword and refuses those it
does not know (``?socket_timeout=5`` stopped every producer, worker and beat with a
``TypeError``), and Celery's backend passes them to redis-py untyped. So
:func:`celery_parts` gives Celery the URL without its connection options, and those
options typed, for the broker's transport options and the backend's ``redis_*``
settings (redbeat and SITS's clients take the URL whole). A ``rediss://`` URL's TLS
options stay in it: kombu and Celery read those from the URL themselves (pure).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

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
