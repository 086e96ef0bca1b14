"""A kombu message as the queue stores it (``put.lua``'s payload) and as a pick hands it
back: encoding, the shape check, and what the transport adds for the consumer.

Stored payloads come from producers, and from anyone else who can write to Redis, so a
pick trusts nothing in them: :func:`decode` raises on anything a consumer could not
take, and the transport dead-letters such a message rather than handing it on.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import orjson
from kombu.transport import virtual
from kombu.utils.json import dumps, loads

from sits_queue.broker.keys import AFFINITY_HEADER, BATCH_INFO, CHECKPOINT_HEADER, DELIVERY_HEADER
from sits_queue.checks import is_utf8, shown, text

#: Types orjson writes as kombu's JSON does (so kombu's ``loads`` gives the same value).
_NATIVE = frozenset({str, int, bool, type(None)})
#: Containers both write as JSON objects and arrays (a tuple comes back a list either way).
_CONTAINERS = frozenset({dict, list, tuple})


class MalformedPayload(ValueError):
    """A stored payload that is JSON but not a message a kombu consumer can take."""


def encode(message: dict[str, Any]) -> bytes:
    """``message`` as compact JSON that kombu's ``loads`` reads back as the same message.

    orjson (5-10x faster than kombu's encoder) when every value is plain JSON; kombu's
    own encoder otherwise, as stock kombu transports write: orjson would write NaN and
    infinities as null and datetimes, UUIDs and enums as bare strings, and refuses bytes,
    Decimals, ints beyond 64 bits and non-string keys.
    """
    if _plain(message):
        try:
            return orjson.dumps(message)
        except TypeError:
            pass  # an int beyond 64 bits, a non-string key, a lone surrogate
    encoded: str = dumps(message, separators=(",", ":"))  # type: ignore[no-untyped-call]
    return encoded.encode()


def _plain(value: Any) -> bool:
    """True if every value in ``value`` (recursively) is a JSON type orjson writes
    faithfully: exact types, since subclasses (enums, str subclasses) are written by
    value. Keys are left to orjson, which refuses the ones it cannot write."""
    item: Any
    for item in value.values() if type(value) is dict else value:
        kind = type(item)
        if kind in _NATIVE:
            continue
        if kind is float:
            if not math.isfinite(item):
                return False
        elif kind not in _CONTAINERS or not _plain(item):
            return False
    return True


def decode(raw: bytes | str, codecs: Collection[str] = ()) -> dict[str, Any]:
    """The message stored as ``raw``, its shape checked; ``codecs``: the body encodings
    the consumer's channel decodes, besides none and utf-8.

    Raises ValueError (a :class:`MalformedPayload` for a wrong shape) or whatever
    kombu's ``loads`` raises for a typed value that does not decode (``{"__type__":
    "uuid", "__value__": 5}`` raises TypeError, a bad decimal InvalidOperation).
    """
    message = loads(raw)  # type: ignore[no-untyped-call]
    if not isinstance(message, dict) or not isinstance(message.get("properties"), dict):
        raise MalformedPayload("not a kombu message (no 'properties' object)")
    props = message["properties"]
    _expect(props.get("delivery_info"), dict, "properties.delivery_info", "an object")
    _expect(message.get("headers"), dict, "headers", "an object")
    _expect(message.get("body"), (str, bytes), "body", "a string")
    for name in ("content-type", "content-encoding"):
        _expect(message.get(name), str, name, "a string")
    encoding = props.get("body_encoding")
    _expect(encoding, str, "properties.body_encoding", "a string")
    if encoding and encoding.lower() != "utf-8" and encoding not in codecs:
        # kombu would look the codec up as None and fail with an AttributeError
        raise MalformedPayload(f"properties.body_encoding {shown(encoding)} is not one of "
                               f"{sorted(codecs)}")
    headers = message.get("headers") or {}
    # Celery looks its task up by this name: an unhashable one would raise in its consumer.
    _expect(headers.get("task"), str, "headers.task", "a string")
    if headers.get("task") is not None:
        _check_task_message(headers)
    return message


def _check_task_message(headers: dict[str, Any]) -> None:
    """What Celery's consumer takes for granted in a task message's headers (protocol 2)
    and fails on in the worker's main process (which stops it, or wedges a pool slot): the
    task id, the time limits and the stamps. Its body is checked once kombu has decoded
    it (:func:`check_task_body`)."""
    task_id = headers.get("id")
    if not isinstance(task_id, str) or not task_id:
        raise MalformedPayload(f"headers.id is not a task id (a non-empty string): "
                               f"{shown(task_id)}")
    if not is_utf8(task_id):  # (a lone surrogate, JSON-escaped)
        # ran, then its result could not be stored (UnicodeEncodeError in the worker's
        # main process) and the message was acked: lost, unexplained
        raise MalformedPayload(f"headers.id is not UTF-8 text: {shown(task_id)}")
    limits = headers.get("timelimit")
    if limits is not None and not (
            isinstance(limits, (list, tuple)) and len(limits) == 2
            and all(_seconds(x) for x in limits)):
        raise MalformedPayload(f"headers.timelimit is not [hard, soft] seconds or nulls: "
                               f"{shown(limits)}")
    # Celery's Request.revoked() walks them before the pool takes the task, after the
    # pool's slot was taken for it: raised on there, the slot was never given back.
    stamped = headers.get("stamped_headers")
    if stamped is not None and not (isinstance(stamped, list)
                                    and all(isinstance(h, str) for h in stamped)):
        raise MalformedPayload(f"headers.stamped_headers is not a list of header names: "
                               f"{shown(stamped)}")
    stamps = headers.get("stamps")
    if stamps is not None and not isinstance(stamps, dict):
        raise MalformedPayload(f"headers.stamps is not an object: {shown(stamps)}")


def _seconds(value: Any) -> bool:
    """None, or a number of seconds Celery's pool can arm a timer with: an integer past a
    float's range (JSON has them) raised OverflowError in the worker's main process once
    the child took the job, stopping the worker; redelivered uncounted, the message
    then stopped every worker that took it, one after another. Not below 0 (0: none, as
    in Celery): a negative soft limit fired at once, the task's outcome a race between
    its body and the signal."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value)) and value >= 0
    except OverflowError:
        return False


def check_task_body(message: Any) -> None:
    """A task message's JSON body (as kombu's message holds it, its body encoding undone)
    is ``[args, kwargs, embed]``: Celery unpacks it in the worker's main process (another
    shape stops it) or acks and loses what does not parse. Another serializer's body is
    Celery's to check (and to refuse what it must). A compressed body is checked as kombu
    decompressed it."""
    headers = message.headers or {}
    if headers.get("task") is None:
        return
    if not message.content_type:
        # kombu hands such a body over as it is, and Celery's unpacking of it failed with
        # "too many values to unpack", naming neither
        raise MalformedPayload("no content-type: a task message says how its body is "
                               "encoded (application/json, ...)")
    if message.content_type != "application/json":
        return
    body = message.body or b""
    try:
        try:
            decoded = orjson.loads(body)
        except orjson.JSONDecodeError:  # strict: a lone surrogate kombu's json reads
            decoded = loads(body)  # type: ignore[no-untyped-call]
    except (ValueError, TypeError) as exc:  # JSONDecodeError included
        raise MalformedPayload(f"body is not JSON: {exc}") from exc
    if not (isinstance(decoded, list) and len(decoded) == 3 and isinstance(decoded[0], list)
            and isinstance(decoded[1], dict) and isinstance(decoded[2], (dict, type(None)))):
        raise MalformedPayload("body is not a task's [args (a list), kwargs (an object), "
                               "embed (an object)]")


def _expect(value: Any, kind: type | tuple[type, ...], name: str, what: str) -> None:
    if value is not None and not isinstance(value, kind):
        raise MalformedPayload(f"{name} is not {what} ({type(value).__name__})")


def prepare(message: dict[str, Any], queue: str, tag: str, times: int,
            checkpoint: bytes | str | None, by_affinity: bool) -> dict[str, Any]:
    """``message`` (checked by :func:`decode`) as its consumer gets it: its id as the
    delivery tag, its queue and redelivery in the delivery info, and the headers the
    pool child reads."""
    props = message["properties"]
    props["delivery_tag"] = tag
    info = props.get("delivery_info")
    if info is None:
        info = props["delivery_info"] = {}
    info["sits_queue"] = queue
    headers = message.get("headers")
    if headers is None:
        headers = message["headers"] = {}
    # Where the running task's message lives, for the task itself: Celery hands the
    # headers (not the delivery info) to the pool child, which needs both to yield
    # its slot (workers/slices.py).
    headers[DELIVERY_HEADER] = [queue, tag]
    if checkpoint:  # it yielded its slot before: where it got to
        headers[CHECKPOINT_HEADER] = text(checkpoint)
        # Its run began before any expiry (a yield is a running task's): resumed, it goes
        # on (its expiry revoked it as it came back, the work so far thrown away)
        if headers.get("expires") is not None:
            headers["expires"] = None
    if by_affinity:
        headers[AFFINITY_HEADER] = True
    if times:
        info["redelivered"] = True
        headers["redelivered"] = True
    return message


def mark(batch: list[Any], group: str) -> list[Any]:
    """Each kombu message of a batch marked ``[group, index, size]`` (``keys.batch_mark``)
    in its delivery info and headers."""
    for index, message in enumerate(batch):
        mark = [group, index, len(batch)]
        message.delivery_info[BATCH_INFO] = mark
        message.headers[BATCH_INFO] = mark
    return batch


def poison_split(picked: Any) -> tuple[Any, list[str]]:
    """``pick.lua``'s reply without the ids it dead-lettered as poison on its way (its
    last element, a list, when there were any), and those ids."""
    if not isinstance(picked, list) or not picked or not isinstance(picked[-1], list):
        return picked, []
    rest = picked[:-1]
    return (rest[0] if len(rest) == 1 else rest), [text(i, "replace") for i in picked[-1]]


class SitsMessage(virtual.Message):
    """kombu's message; one a pick built already passes through kombu's ``Message(raw)``
    calls as it is.

    The pick builds each message where a failure is caught (``Channel._decode``: a body
    that does not decode is dead-lettered there); kombu then calls ``Message(raw)`` again
    on delivery (``basic_consume``'s callback), which would decode the body a second time.
    """

    #: When this worker picked it, ``time.monotonic()`` (``workers/etaorder.py``).
    picked_at: float | None = None

    def __new__(cls, payload: Any = None, *args: Any, **kwargs: Any) -> SitsMessage:
        if isinstance(payload, cls):
            return payload
        return super().__new__(cls)

    def __init__(self, payload: Any = None, *args: Any, **kwargs: Any) -> None:
        if payload is not self:
            super().__init__(payload, *args, **kwargs)  # type: ignore[no-untyped-call]
