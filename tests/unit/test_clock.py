"""Redis's clock as SITS reads it (``broker/clock.py``): the host's clock plus the offset
to the server's ``TIME``, measured again every ``REFRESH_S``, kept through an outage."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from sits_queue.broker import clock


class Server:
    """A redis-py-shaped client whose server's clock is ``skew_s`` off this host's."""

    def __init__(self, skew_s: float, port: int = 1) -> None:
        self.skew_s, self.calls, self.down = skew_s, 0, False
        self.connection_pool = SimpleNamespace(
            connection_kwargs={"host": "redis.example", "port": port})

    def time(self) -> tuple[int, int]:
        self.calls += 1
        if self.down:
            raise redis.ConnectionError("Connection refused")
        t = time.time() + self.skew_s
        return int(t), int((t % 1) * 1e6)


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    clock.forget()
    yield
    clock.forget()


def test_the_offset_is_taken_at_the_middle_of_the_round_trip() -> None:
    assert clock.offset_of(100.0, (160, 500_000), 101.0) == pytest.approx(60.0)
    assert clock.offset_of(100.0, [b"40", b"0"], 100.0) == pytest.approx(-60.0)


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0, 0.0])
def test_now_is_the_servers_clock_whatever_this_hosts_says(skew_s: float) -> None:
    server = Server(skew_s)
    assert clock.now(server) == pytest.approx(time.time() + skew_s, abs=0.5)
    clock.now(server)
    assert server.calls == 1  # measured once, then the offset serves


def test_each_server_has_its_own_offset() -> None:
    ahead, behind = Server(600.0, port=1), Server(-600.0, port=2)
    assert clock.now(ahead) - clock.now(behind) == pytest.approx(1200.0, abs=0.5)


def test_the_offset_is_measured_again_after_the_refresh(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    mono = [1000.0]
    monkeypatch.setattr(clock.time, "monotonic", lambda: mono[0])
    server = Server(10.0)
    clock.now(server)
    server.skew_s = 70.0  # this host's clock was stepped back a minute
    mono[0] += clock.REFRESH_S - 1
    assert clock.now(server) == pytest.approx(time.time() + 10.0, abs=0.5)
    mono[0] += 1
    assert clock.now(server) == pytest.approx(time.time() + 70.0, abs=0.5)
    assert server.calls == 2


def test_an_outage_keeps_the_last_offset_and_tries_again_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mono = [1000.0]
    monkeypatch.setattr(clock.time, "monotonic", lambda: mono[0])
    server = Server(-300.0)
    clock.now(server)
    server.down = True
    mono[0] += clock.REFRESH_S
    assert clock.now(server) == pytest.approx(time.time() - 300.0, abs=0.5)  # no raise
    assert clock.now(server) == pytest.approx(time.time() - 300.0, abs=0.5)
    assert server.calls == 2  # not again until RETRY_S: a put is not slowed per call
    server.down, server.skew_s = False, -200.0
    mono[0] += clock.RETRY_S
    assert clock.now(server) == pytest.approx(time.time() - 200.0, abs=0.5)


def test_a_round_trip_through_a_redis_stall_measures_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(a ``TIME`` blocked through a 30 s ``SIGSTOP``, the server reading its clock at the
    end, measured +15 s; kept 30 s, a sweep counted live holders silent 15 s early)"""
    host = [1_000_000.0]
    mono = [1000.0]
    monkeypatch.setattr(clock.time, "time", lambda: host[0])
    monkeypatch.setattr(clock.time, "monotonic", lambda: mono[0])

    class Stalled(Server):
        stall_s = 30.0

        def time(self) -> tuple[int, int]:
            self.calls += 1
            host[0] += self.stall_s  # the reply comes once Redis wakes
            return int(host[0]), 0  # read by the server then: no skew at all

    server = Stalled(0.0)
    assert clock.now(server) == pytest.approx(host[0])  # the host's clock, not +15 s
    mono[0] += clock.RETRY_S  # tried again soon; a prompt round trip measures
    server.stall_s = 0.01
    assert clock.now(server) == pytest.approx(host[0], abs=0.01) and server.calls == 2


def test_before_any_measurement_succeeds_this_hosts_clock_stands() -> None:
    server = Server(999.0)
    server.down = True
    assert clock.now(server) == pytest.approx(time.time(), abs=0.5)


@pytest.mark.parametrize("client", [object(), SimpleNamespace(connection_pool=None)])
def test_a_client_that_is_not_redis_pys_keeps_this_hosts_clock(client: Any) -> None:
    assert clock.now(client) == pytest.approx(time.time(), abs=0.5)
