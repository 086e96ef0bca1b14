"""One Redis URL for Celery's broker and backend, redbeat and redis-py (``redisurl``)."""

from __future__ import annotations

import pytest

from sits_queue.config import SitsConfig
from sits_queue.errors import ConfigError
from sits_queue.redisurl import celery_parts, unsupported
from sits_queue.settings import celery_settings


def test_connection_options_leave_the_url_as_settings() -> None:
    url, options = celery_parts("redis://:pw@h:1/0?socket_timeout=5&health_check_interval=30"
                                "&retry_on_timeout=true&socket_keepalive=0&db=3")
    assert url == "redis://:pw@h:1/3"  # (redis-py takes ?db= over the path: moved there)
    assert options == {"socket_timeout": 5.0, "health_check_interval": 30,
                       "retry_on_timeout": True, "socket_keepalive": False}
    tls, _ = celery_parts("rediss://h:1/0?ssl_cert_reqs=required&socket_timeout=2")
    assert tls == "rediss://h:1/0?ssl_cert_reqs=required"  # kombu and Celery read these


def test_celery_is_given_them_for_the_broker_and_the_backend() -> None:
    settings = celery_settings(SitsConfig(
        redis_url="redis://h:1/2?socket_timeout=5&max_connections=40"))
    assert settings["broker_url"] == "redis://h:1/2"
    assert settings["result_backend"].endswith("+redis://h:1/2")
    assert settings["broker_transport_options"]["socket_timeout"] == 5.0
    assert (settings["redis_socket_timeout"], settings["redis_max_connections"]) == (5.0, 40)
    # redbeat takes the URL whole, as redis-py does
    assert settings["redbeat_redis_url"] == "redis://h:1/2?socket_timeout=5&max_connections=40"


@pytest.mark.parametrize(("url", "why"), [
    ("unix:///tmp/r.sock", "a unix socket cannot be Celery's broker URL"),
    ("redis://h/0?protocol=3", "query option protocol is not one Celery's broker layer"),
    ("redis://h/0?ssl_cert_reqs=none", "ssl_cert_reqs is for a rediss:// URL"),
    ("rediss://h/0", "must say ssl_cert_reqs=required, optional or none"),
])
def test_a_url_celery_cannot_use_is_refused_naming_why(url: str, why: str) -> None:
    assert why in (unsupported(url) or "")


def test_a_refused_url_is_a_one_line_setting_error() -> None:
    with pytest.raises(ConfigError, match=r"redis_url 'rediss://h/0': a rediss:// URL"):
        SitsConfig(redis_url="rediss://h/0")
    assert unsupported("redis://h/0?socket_timeout=5&db=1") is None
    assert unsupported("rediss://h/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem") is None


@pytest.mark.parametrize("option", ["socket_timeout", "db", "health_check_interval",
                                    "max_connections", "socket_connect_timeout",
                                    "retry_on_timeout"])
def test_a_query_option_without_a_value_is_refused_naming_it(option: str) -> None:
    """(parse_qsl drops a blank option, so every check passed it; Celery's reading did
    not: "?socket_timeout=" ended every command on a traceback, "could not convert
    string to float: ''")"""
    with pytest.raises(ConfigError, match=f"query option {option} has no value"):
        SitsConfig(redis_url=f"redis://127.0.0.1:6379/0?{option}=")
    # a site peer's URL too (redis-py's alone: it passed)
    with pytest.raises(ConfigError, match=f"query option {option} has no value"):
        SitsConfig(site="a", site_peers=f"b=redis://127.0.0.1:6380/2?{option}=")


def test_too_few_connections_for_a_worker_are_refused() -> None:
    """(at 1 a worker started, then lost its broker in a loop and ran nothing)"""
    with pytest.raises(ConfigError, match="max_connections must be at least 10"):
        SitsConfig(redis_url="redis://127.0.0.1:6379/0?max_connections=1")
    assert SitsConfig(redis_url="redis://127.0.0.1:6379/0?max_connections=10")
