"""Flower's broker reader for SITS apps: chosen by the app's broker options, Flower's own
for any other app, and a Broker page that never fails on a bad name or a missing Redis."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator

import pytest
from celery import Celery, _state

from sits_queue import flower as sits_flower
from sits_queue.app import make_app, sits_transport_options
from sits_queue.config import SitsConfig

broker = pytest.importorskip("flower.utils.broker")


@pytest.fixture(autouse=True)
def _current_app() -> Iterator[None]:
    """These tests set the current Celery app; the next test gets the one it had."""
    before = _state.get_current_app()
    yield
    before.set_current()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again on leaving: nothing listens there


def test_a_sits_apps_options_get_the_sorted_set_reader() -> None:
    config = SitsConfig(redis_url="redis://127.0.0.1:1/3", global_keyprefix="t:")
    assert sits_flower.install() is True  # Flower is imported by this module
    assert sits_flower.install() is True  # and a second call changes nothing
    reader = broker.Broker("redis://127.0.0.1:1/3",
                           broker_options=sits_transport_options(config))
    assert isinstance(reader, sits_flower.SitsQueues)
    assert reader.config.global_keyprefix == "t:"
    assert reader.config.redis_url == "redis://127.0.0.1:1/3"


def test_other_apps_keep_flowers_own_readers() -> None:
    sits_flower.install()
    Celery("plain", set_as_current=True)  # the current app is no SITS one
    assert type(broker.Broker("redis://127.0.0.1:1/0", broker_options={})) is broker.Redis
    assert type(broker.Broker("amqp://guest@127.0.0.1//", http_api=None,
                              broker_options={})) is broker.RabbitMQ


def test_replaced_options_fall_back_to_the_current_sits_app() -> None:
    sits_flower.install()
    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/5", global_keyprefix="x:"),
                   main="replaced")
    app.set_current()
    app.conf.broker_transport_options = {"socket_timeout": 3}  # no SITS config in there
    reader = broker.Broker("redis://127.0.0.1:1/5",
                           broker_options=app.conf.broker_transport_options)
    assert isinstance(reader, sits_flower.SitsQueues)
    assert reader.config.global_keyprefix == "x:"


def test_names_no_queue_can_have_are_shown_missing_without_a_round_trip() -> None:
    reader = sits_flower.SitsQueues(SitsConfig(redis_url=f"redis://127.0.0.1:{_closed_port()}"))
    rows = asyncio.run(reader.queues(["a{b", "x}"]))
    assert rows == [{"name": "a{b", "messages": None}, {"name": "x}", "messages": None}]


def test_an_unreachable_redis_gives_an_empty_table_and_a_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://:secret@127.0.0.1:{_closed_port()}/0"
    reader = sits_flower.SitsQueues(SitsConfig(redis_url=url))
    with caplog.at_level(logging.ERROR, logger="sits_queue.flower"):
        assert asyncio.run(reader.queues(["celery"])) == []
    assert "SITS queue depths unreadable" in caplog.text
    assert "secret" not in caplog.text  # the password stays out of the log
