"""ETAs and countdowns read as Celery reads them (``etas.py``): the broker's record, the
worker's statistics and the checks at submission agree with Celery, and what Celery
cannot hold is refused when it is given, naming the option and its value."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from celery.utils.time import maybe_iso8601, maybe_make_aware
from celery.utils.time import timezone as celery_zones
from kombu.asynchronous.timer import to_timestamp

from sits_queue.config import SitsConfig
from sits_queue.delivery import check_delivery
from sits_queue.errors import InvalidTaskOptions

UNREACHABLE = "redis://127.0.0.1:1/0"  # (nothing is sent: a refusal comes first)
#: ETAs as a caller may write them; Celery holds some, not others.
ETAS = ["2026-12-04T24:00:00+00:00", "2026-339", "2026-W49-5", "2026-12", "2026",
        "20261205T033000Z", "2026-12-05T03:30:00.123456789+00:00", "2026-12-05T03:30:00",
        "9999-12-31T23:59:59+00:00", "9999-12-31T23:59:59-05:00", "9999-12-31T24:00:00",
        "0001-01-01T00:00:00+00:00", "0001-01-01T00:00:00+05:00"]


def celery_times(eta: str, app_zone: Any = timezone.utc) -> float:
    """When Celery's worker runs a message with this ``eta`` header (its Request, then
    its strategy's timer): raises where it cannot."""
    when = maybe_make_aware(maybe_iso8601(eta), app_zone)
    to_timestamp(celery_zones.to_system(when))
    return float(when.timestamp())


@pytest.fixture
def system_zone(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Sets this process's time zone (``TZ``) for the test, and puts it back after."""
    def use(name: str) -> None:
        monkeypatch.setenv("TZ", name)
        time.tzset()

    yield use
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("eta", ETAS)
def test_the_broker_and_the_worker_s_statistics_read_an_eta_as_celery_does(eta: str) -> None:
    """(the broker read it with datetime.fromisoformat: ``T24:00:00`` and ``2026-339``
    were no ETA to it, and the task aged from its put while Celery held it)"""
    from sits_queue.broker.meta import due_at
    from sits_queue.workers.signals import _due_at

    try:
        expected: float | None = maybe_make_aware(maybe_iso8601(eta)).timestamp()
    except OverflowError:
        expected = None
    assert due_at({"eta": eta}) == expected
    assert _due_at(SimpleNamespace(eta=eta)) == expected


@pytest.mark.parametrize("eta", ETAS)
@pytest.mark.parametrize("zone", ["UTC", "Pacific/Kiritimati", "Etc/GMT+12"])
def test_an_eta_is_refused_exactly_where_celery_s_worker_cannot_time_it(
        eta: str, zone: str, system_zone: Any) -> None:
    """(``9999-12-31T23:59:59-05:00`` was sent, and the worker logged "Couldn't convert
    ETA", failed the task with an OverflowError and dead-lettered it)"""
    system_zone(zone)
    try:
        celery_times(eta)
        holds = True
    except OverflowError:
        holds = False
    if holds:
        check_delivery("u.echo", {"eta": eta})
    else:
        with pytest.raises(InvalidTaskOptions, match=f"task u.echo: eta '{eta[:4]}.*' falls "
                                                     "past the years a date holds"):
            check_delivery("u.echo", {"eta": eta})


def test_a_datetime_eta_is_checked_as_its_text_is(system_zone: Any) -> None:
    """(a datetime was sent unchecked)"""
    system_zone("UTC")
    west = timezone(timedelta(hours=-5))
    with pytest.raises(InvalidTaskOptions, match="eta '9999-12-31T23:59:59-05:00' falls past"):
        check_delivery("u.echo", {"eta": datetime(9999, 12, 31, 23, 59, 59, tzinfo=west)})
    check_delivery("u.echo", {"eta": datetime(9999, 12, 31, 18, 59, 59, tzinfo=west)})
    check_delivery("u.echo", {"eta": datetime(9999, 12, 31, 23, 59, 59)})  # naive: UTC
    # A worker on a system ahead of UTC cannot time the last hours (the producer's zone
    # stands for the worker's)
    system_zone("Pacific/Kiritimati")
    with pytest.raises(InvalidTaskOptions, match="eta '9999-12-31T23:59:59' falls past"):
        check_delivery("u.echo", {"eta": datetime(9999, 12, 31, 23, 59, 59)})


def _countdown_to(when: datetime) -> float:
    return (when - datetime.now(timezone.utc)).total_seconds()


@pytest.mark.parametrize(("app_zone", "refused"), [
    ("UTC", False), ("Etc/GMT+12", False), ("Etc/GMT-14", True)])
def test_a_countdown_is_refused_exactly_where_celery_cannot_make_its_eta(
        app_zone: str, refused: bool, system_zone: Any) -> None:
    """A countdown landing at 9999-12-31T20:00Z: Celery makes its ETA in the app's time
    zone, where +14 h is a year 10000 (a bare OverflowError out of ``apply_async``)"""
    from sits_queue.app import make_app

    system_zone("UTC")
    app = make_app(SitsConfig(redis_url=UNREACHABLE), main=f"countdown-{app_zone}")
    app.conf.timezone = app_zone

    @app.task(name="u.echo", shared=False)
    def echo(x: int) -> int:
        return x

    countdown = _countdown_to(datetime(9999, 12, 31, 20, tzinfo=timezone.utc))
    try:
        try:
            app.amqp.as_task_v2("an-id", "u.echo", countdown=countdown)
            celery_refuses = False
        except OverflowError:
            celery_refuses = True
        assert celery_refuses == refused
        if refused:
            said = (fr"task u.echo: countdown {countdown!r} s reaches past the years a date "
                    fr"holds \(1 to 9999\) in UTC, this system's time zone or the app's "
                    fr"\({app_zone}\)")
            with pytest.raises(InvalidTaskOptions, match=said):
                echo.apply_async((1,), countdown=countdown)
            with pytest.raises(InvalidTaskOptions, match=said):
                app.send_task("u.echo", (1,), countdown=countdown)
        else:
            check_delivery("u.echo", {"countdown": countdown}, app.timezone)
    finally:
        app.close()


def test_bulk_submission_refuses_an_eta_celery_cannot_hold(system_zone: Any) -> None:
    """(enqueue_many sent it, to be dead-lettered at the worker)"""
    from sits_queue.app import make_app
    from sits_queue.broker.bulk import enqueue_many

    system_zone("UTC")
    app = make_app(SitsConfig(redis_url=UNREACHABLE), main="bulk-eta")

    @app.task(name="u.echo", shared=False)
    def echo(x: int) -> int:
        return x

    try:
        with pytest.raises(InvalidTaskOptions, match="eta '9999-12-31T23:59:59-05:00'"):
            enqueue_many(echo, [(1,), (2,)], eta="9999-12-31T23:59:59-05:00")
        with pytest.raises(InvalidTaskOptions, match=r"countdown 1000000000000000\.0 s reaches"):
            enqueue_many(echo, [(1,)], countdown=1e15)
    finally:
        app.close()
