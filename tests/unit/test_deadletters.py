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
        self.requests: dict[str, Any] = {}
        self.broken = broken

    def mark_as_failure(self, task_id: str, exc: BaseException, request: Any = None) -> None:
        if self.broken:
            raise ConnectionError("result backend away")
        if request is not None and request.chord == "not a signature":
            raise TypeError("the chord's callback does not build")  # as Celery's would
        self.failed[task_id] = exc
        self.requests[task_id] = request


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
    assert isinstance(exc, DeadLettered) and "w.crash[t-1] will not run" in str(exc)
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


def _record(body: bytes, content_type: str = "application/json",
            properties: dict[str, Any] | None = None) -> str:
    import base64

    message = {"body": base64.b64encode(body).decode(), "content-type": content_type,
               "content-encoding": "utf-8",
               "headers": {"id": "t-1", "task": "w.add", "group": "g-1", "root_id": "r-1"},
               "properties": {"body_encoding": "base64", "reply_to": "client-1",
                              "correlation_id": "t-1", **(properties or {})}}
    return json.dumps({"reason": "poison", "at": 1.0, "payload": json.dumps(message)})


def test_a_letters_request_is_the_one_celerys_worker_builds() -> None:
    embed = {"chord": {"task": "w.total"}, "errbacks": [{"task": "w.record"}],
             "callbacks": None, "chain": None}
    record = _record(json.dumps([[1, 2], {"k": 3}, embed]).encode(),
                     properties={"delivery_info": {"routing_key": "celery"}})
    request = deadletters.request_of(record, ["application/json"])
    assert request is not None
    assert (request.id, request.group, request.root_id) == ("t-1", "g-1", "r-1")
    assert (request.args, request.kwargs) == ([1, 2], {"k": 3})
    assert request.chord == {"task": "w.total"} and request.errbacks == [{"task": "w.record"}]
    assert request.reply_to == "client-1" and request.delivery_info == {"routing_key": "celery"}


def test_a_compressed_letters_request_is_read_decompressed() -> None:
    """(kombu compresses a body sent with ``compression=``: read as it was, a chord's
    member failed or taken over was not counted in its chord)"""
    import zlib

    body = json.dumps([[1], {}, {"chord": {"task": "w.total"}}]).encode()
    record = json.loads(_record(zlib.compress(body)))
    message = json.loads(record["payload"])
    message["headers"]["compression"] = "application/x-gzip"
    request = deadletters.request_of_payload(json.dumps(message), ["application/json"])
    assert request is not None and request.chord == {"task": "w.total"}
    message["headers"]["compression"] = "application/x-nosuch"
    assert deadletters.request_of_payload(json.dumps(message), ["application/json"]) is None


@pytest.mark.parametrize(("body", "content_type", "accept"), [
    (b"\x80\x04not json", "application/json", ["application/json"]),  # does not decode
    (b"[1, 2]", "application/json", ["application/json"]),  # not [args, kwargs, embed]
    (b"anything", "application/x-python-serialize", ["application/json"]),  # not accepted
])
def test_a_body_that_does_not_decode_gives_no_request(body: bytes, content_type: str,
                                                      accept: list[str]) -> None:
    assert deadletters.request_of(_record(body, content_type), accept) is None


def test_a_letter_fails_as_its_chords_part_and_alone_where_that_cannot_be_told(
        caplog: pytest.LogCaptureFixture) -> None:
    told = _record(json.dumps([[], {}, {"chord": {"task": "w.total"}}]).encode())
    odd = _record(json.dumps([[], {}, {"chord": "not a signature"}]).encode())
    client = Records({"m1": told.encode(), "m2": odd.encode().replace(b"t-1", b"t-2")})
    backend = Backend()
    assert deadletters.fail_tasks(client, "dead", ["m1", "m2"], backend) == 2
    assert backend.requests["t-1"].chord == {"task": "w.total"}
    assert backend.requests["t-2"] is None and set(backend.failed) == {"t-1", "t-2"}
    assert "could not be stored as its chord's part" in caplog.text
