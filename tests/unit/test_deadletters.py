"""Dead-lettered tasks get a FAILURE naming why (``broker/deadletters.py``); no Redis."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sits_queue.broker import deadletters
from sits_queue.errors import DeadLettered


def record(headers: Any, reason: str = "redelivered 6 times (poison message)") -> bytes:
    return json.dumps({"reason": reason, "at": 1.0, "meta": None,
                       "payload": json.dumps({"headers": headers, "body": ""})}).encode()


class Records:
    def __init__(self, records: dict[str, bytes | None]) -> None:
        self.records = records

    def hmget(self, key: str, ids: list[str]) -> list[bytes | None]:
        assert key == "dead"
        return [self.records.get(i) for i in ids]


class Backend:
    def __init__(self, broken: bool = False) -> None:
        self.failed: dict[str, BaseException] = {}
        self.broken = broken

    def mark_as_failure(self, task_id: str, exc: BaseException) -> None:
        if self.broken:
            raise ConnectionError("result backend away")
        self.failed[task_id] = exc


@pytest.mark.parametrize("raw", [b"not json", record([1, 2]), record({"task": "t"}),
                                 record({"id": ""}), b'{"payload": 5}'])
def test_a_record_without_a_task_id_is_left_alone(raw: bytes) -> None:
    assert deadletters.task_of(raw) is None


def test_each_dead_lettered_task_fails_with_its_reason() -> None:
    backend = Backend()
    client = Records({"m1": record({"id": "t-1", "task": "w.crash"}), "m2": b"junk",
                      "m3": None})
    assert deadletters.fail_tasks(client, "dead", ["m1", "m2", "m3"], backend) == 1
    (exc,) = backend.failed.values()
    assert isinstance(exc, DeadLettered) and "w.crash[t-1] was not run" in str(exc)
    assert "(redelivered 6 times (poison message))" in str(exc) and "as m1" in str(exc)


def test_a_backend_that_cannot_store_is_logged_not_raised(
        caplog: pytest.LogCaptureFixture) -> None:
    client = Records({"m1": record({"id": "t-1", "task": "w.crash"})})
    assert deadletters.fail_tasks(client, "dead", ["m1"], Backend(broken=True)) == 0
    assert "could not store its failure" in caplog.text


def test_a_record_with_a_time_that_is_no_number_lists_without_an_age() -> None:
    class Letters:
        def hscan_iter(self, key: str, count: int) -> Any:
            yield b"a", json.dumps({"reason": "x", "at": "nan"}).encode()
            yield b"b", b'{"reason": "y", "at": 1e400}'

    rows = [d.row(0.0) for d in deadletters.read(Letters(), "dead")]
    # (--json printed NaN and -Infinity, which no strict parser reads)
    assert [r["age_s"] for r in rows] == [None, None]
    json.dumps(rows, allow_nan=False)
