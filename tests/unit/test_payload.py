"""Stored payloads (``broker/payload.py``): what the put path writes and what a pick
accepts. No Redis."""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import math
import uuid
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from kombu.utils.json import loads

from sits_queue.broker import payload


class Colour(enum.Enum):
    RED = "red"


def message(**headers: Any) -> dict[str, Any]:
    """A kombu message as ``Channel._put`` receives it (the body already encoded)."""
    return {"body": "W1tdLCB7fSwge31d", "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"task": "t.echo", "id": "1", "eta": None, "retries": 0,
                        "timelimit": [45, 36.0], "stamps": {}, **headers},
            "properties": {"delivery_tag": "1", "body_encoding": "base64", "priority": 0,
                           "delivery_info": {"exchange": "", "routing_key": "celery"}}}


# -- encode -----------------------------------------------------------------------------------


def test_a_plain_message_is_written_by_orjson() -> None:
    plain = message(sits={"latency_sla_ms": 800.0, "model": None}, tags=("a", 1))
    assert payload.encode(plain) == orjson.dumps(plain)


@pytest.mark.parametrize("value", [
    float("nan"), float("inf"), -float("inf"), datetime.datetime(2026, 1, 2, 3, 4, 5),
    datetime.date(2026, 1, 2), uuid.UUID(int=7), b"\x00abc", b"\xff\xfe",
    decimal.Decimal("1.5"), 2**70, [1, float("nan")], {"deep": {"er": uuid.UUID(int=1)}},
])
def test_what_orjson_would_change_round_trips_through_kombus_json(value: Any) -> None:
    # Given a header value that orjson writes unfaithfully (or refuses)
    stored = payload.encode(message(h=value))
    # Then kombu's loads (what a pick uses) gives the very value back
    got = loads(stored)["headers"]["h"]
    if isinstance(value, float) and math.isnan(value):
        assert math.isnan(got)
    elif isinstance(value, list) and isinstance(value[1], float):
        assert got[0] == 1 and math.isnan(got[1])
    else:
        assert got == value and type(got) is type(value)


def test_an_enum_or_a_str_subclass_goes_the_way_kombu_writes_it() -> None:
    # orjson would write the enum by value; kombu refuses it, as stock kombu publishes do
    with pytest.raises(TypeError):
        payload.encode(message(h=Colour.RED))

    class Name(str):
        pass

    assert loads(payload.encode(message(h=Name("x"))))["headers"]["h"] == "x"


def test_non_string_keys_are_written_as_json_writes_them() -> None:
    assert loads(payload.encode(message(h={1: "a"})))["headers"]["h"] == {"1": "a"}


# -- decode -----------------------------------------------------------------------------------


def stored(change: Callable[[dict[str, Any]], Any] = lambda m: None) -> bytes:
    """A stored payload: :func:`message` after ``change``."""
    m = message()
    change(m)
    return json.dumps(m).encode()


def test_a_good_message_decodes() -> None:
    assert payload.decode(stored(), {"base64"})["headers"]["task"] == "t.echo"


@pytest.mark.parametrize(("raw", "reason"), [
    (b"[1, 2]", "no 'properties' object"),
    (stored(lambda m: m["properties"].update(delivery_info=5)),
     "properties.delivery_info is not an object"),
    (stored(lambda m: m.update(headers=[1])), "headers is not an object"),
    (stored(lambda m: m.update(body={"a": 1})), "body is not a string"),
    (stored(lambda m: m.update({"content-type": 7})), "content-type is not a string"),
    (stored(lambda m: m["properties"].update(body_encoding="rot13")),
     "'rot13' is not one of ['base64']"),
    (stored(lambda m: m["headers"].update(task=["t"])), "headers.task is not a string"),
])
def test_a_message_no_consumer_could_take_is_refused_with_the_reason(raw: bytes,
                                                                     reason: str) -> None:
    with pytest.raises(payload.MalformedPayload) as info:
        payload.decode(raw, {"base64"})
    assert reason in str(info.value)


@pytest.mark.parametrize(("value", "error"), [
    ({"__type__": "uuid", "__value__": 5}, TypeError),
    ({"__type__": "decimal", "__value__": "abc"}, decimal.InvalidOperation),
    ({"__type__": "nosuchtype", "__value__": 1}, ValueError),
])
def test_typed_values_that_do_not_decode_raise(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        payload.decode(stored(lambda m: m["headers"].update(x=value)), {"base64"})


@pytest.mark.parametrize(("reply", "rest", "poisoned"), [
    ([b"t1", b"{}", 0, None, 0], [b"t1", b"{}", 0, None, 0], []),
    ([b"t1", b"{}", 0, None, 0, b"k", b"{}", 0, [b"p1", b"p2"]],
     [b"t1", b"{}", 0, None, 0, b"k", b"{}", 0], ["p1", "p2"]),
    ([0, [b"p1"]], 0, ["p1"]),  # it met only poison: the number, as without any
    (3, 3, []), ([], [], []),
])
def test_a_picks_reply_gives_up_the_poison_it_parked(reply: Any, rest: Any,
                                                      poisoned: list[str]) -> None:
    assert payload.poison_split(reply) == (rest, poisoned)
