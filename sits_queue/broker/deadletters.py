"""A task whose message the broker dead-letters gets a FAILURE result saying why.

``pick.lua`` parks a poison message (redelivered more than ``max_redeliveries`` times:
it kept killing the workers that ran it) in its queue's dead letters, inspectable, and
never runs it again. Without a result its caller's ``get()`` would wait for ever; here
the task's result becomes a FAILURE with a :class:`~sits_queue.errors.DeadLettered`
naming the reason, stored through the app's own result backend (whatever it is: the
transport cannot know, so ``current_app``'s, the worker's own app in a worker), which
never overwrites a stored SUCCESS (``store_result.lua``).

Best effort, as the dead-lettering itself is what matters: a record that does not read,
or a backend that cannot store, is logged and left.

``sitsq dead`` lists a queue's dead letters, puts chosen ones back (once the bug that
made them poison is fixed) or drops them: :func:`read`, :func:`requeue`, :func:`drop`;
the rescoring pass deletes those older than ``dead_letter_ttl_s``: :func:`expire`.
"""

from __future__ import annotations

import base64
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery.app.task import Context
from kombu.compression import decompress
from kombu.serialization import loads, prepare_accept_content

from sits_queue.broker import clock
from sits_queue.broker.payload import MalformedPayload, check_task_body, decode
from sits_queue.checks import text
from sits_queue.errors import DeadLettered

logger = logging.getLogger(__name__)


def parsed_record(record: bytes | str) -> Any:
    """A dead-letter record's JSON. ``dead.lua`` stores a payload that is not UTF-8 as
    it came (cjson copies its bytes): such a record is read with those bytes kept as
    surrogates, not refused (its reason and age were lost, and it never expired)."""
    try:
        return json.loads(record)
    except UnicodeDecodeError:
        assert isinstance(record, bytes)
        return json.loads(record.decode("utf-8", "surrogateescape"))


def task_of(record: bytes | str) -> tuple[str, str, str] | None:
    """(task id, task name, reason) of a dead-letter record; None if its message has no
    task id."""
    try:
        parsed = parsed_record(record)
        headers = json.loads(parsed["payload"])["headers"]
        task_id, name = headers["id"], headers.get("task", "?")
        reason = str(parsed.get("reason", "dead-lettered"))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    return (task_id, str(name), reason) if isinstance(task_id, str) and task_id else None


def request_of(record: bytes | str, accept: Sequence[str]) -> Context | None:
    """The task request a dead-letter record's message carried, as Celery's worker builds
    it (headers, then the body's args, kwargs and embedded callbacks, errbacks, chain and
    chord): what a failure needs to count as a chord's part and call the errbacks. None
    for a message whose body does not decode (a serializer not in ``accept``: never
    decoded here)."""
    try:
        payload = parsed_record(record)["payload"]
    except Exception:
        return None
    return request_of_payload(payload, accept)


def request_of_payload(payload: bytes | str, accept: Sequence[str]) -> Context | None:
    """:func:`request_of` for a message as the queue stores it."""
    try:
        message = json.loads(payload)
        props = message["properties"]
        body: Any = message["body"]
        if props.get("body_encoding") == "base64":
            body = base64.b64decode(body)
        if compression := message["headers"].get("compression"):
            body = decompress(body, compression)  # type: ignore[no-untyped-call]
        args, kwargs, embed = loads(body, message["content-type"],  # type: ignore[no-untyped-call]
                                    message["content-encoding"], accept=accept)
        request = {**message["headers"], "args": args, "kwargs": kwargs,
                   "reply_to": props.get("reply_to"),
                   "correlation_id": props.get("correlation_id"),
                   "delivery_info": delivery if isinstance(
                       delivery := props.get("delivery_info"), dict) else {},
                   **(embed if isinstance(embed, dict) else {})}
    except Exception:  # (whatever a foreign body raises: the failure is stored without)
        return None
    return Context(request)


def accepted(backend: Any) -> list[str]:
    """The content types ``backend``'s app accepts (its settings name serializers,
    "json"; kombu's ``loads`` checks content types)."""
    conf = getattr(getattr(backend, "app", None), "conf", None)
    return sorted(prepare_accept_content(  # type: ignore[no-untyped-call]
        getattr(conf, "accept_content", None) or ["json"]))


def fail_tasks(client: Any, dead_key: str, ids: Sequence[str], backend: Any = None) -> int:
    """Store FAILURE for the tasks of dead-lettered messages ``ids``, as a chord's part
    with its errbacks called where the message says so; how many were stored."""
    if backend is None:
        from celery import current_app

        backend = current_app.backend
    app = getattr(backend, "app", None)
    accept = accepted(backend)
    failed = 0
    for message_id, record in zip(ids, client.hmget(dead_key, list(ids)), strict=True):
        task = task_of(record) if record is not None else None
        if task is None:
            continue
        task_id, name, reason = task
        # ("will not run": a poison message's task may have started at each delivery,
        # its worker lost every time)
        error = DeadLettered(f"task {name}[{task_id}] will not run: its message was "
                             f"dead-lettered ({reason}); it stays in the queue's dead "
                             f"letters as {message_id}")
        request = request_of(record, accept)
        if not _store_failure(backend, task_id, name, error, request):
            continue
        _announce_failure(app, task_id, name, error, request)
        failed += 1
    return failed


def _store_failure(backend: Any, task_id: str, name: str, error: Exception,
                   request: Context | None) -> bool:
    """The failure stored, then (with ``request``) counted as its chord's part and told
    to its errbacks, as Celery's worker does for a task that failed; False when it could
    not be stored (a disabled or unreachable backend: the record remains)."""
    try:
        backend.mark_as_failure(task_id, error, request=request)
        return True
    except Exception as exc:
        if request is None:
            logger.warning("dead-lettered task %s[%s]: could not store its failure: %s",
                           name, task_id, exc)
            return False
        # (its chord's callback or an errback not registered here raised, or the store)
        logger.warning("dead-lettered task %s[%s]: its failure could not be stored as "
                       "its chord's part and told to its errbacks (%s); stored alone",
                       name, task_id, exc)
    return _store_failure(backend, task_id, name, error, None)


#: The worker's own name (``-n``), set at its start: the events it sends say it (None
#: outside a worker: Celery's default name for the process).
event_hostname: str | None = None


def _announce_failure(app: Any, task_id: str, name: str, error: Exception,
                      request: Context | None) -> None:
    """A ``task-failed`` event for a dead-lettered task, where the app sends task events:
    Flower (which follows events, not the result backend) showed a poison task, whose
    runs all died with their pool child, as STARTED for ever. It carries the task's name
    and arguments, as a ``task-received`` would (a task that never reached Celery's
    consumer had none in Flower), and comes from the worker's own name (the process's
    default one made a worker of its own in Flower's list)."""
    if app is None or not app.conf.worker_send_task_events:
        return
    shown: dict[str, Any] = {"name": name}
    if request is not None:
        shown["args"] = getattr(request, "argsrepr", None) or repr(tuple(request.args or ()))
        shown["kwargs"] = getattr(request, "kwargsrepr", None) or repr(request.kwargs or {})
    try:
        with app.events.default_dispatcher(hostname=event_hostname) as dispatcher:
            dispatcher.send("task-failed", uuid=task_id, exception=repr(error),
                            traceback=None, **shown)
    except Exception as exc:  # an event is no reason to fail the dead-lettering
        logger.warning("dead-lettered task %s: could not send its task-failed event: %s",
                       task_id, exc)


def park(channel: Any, queue: str, picked: list[Any], exc: Exception, no_ack: bool,
         why: str) -> None:
    """Park a picked message (``[id, payload, ...]``) that no consumer could take, with
    the reason (``why``: the error), and fail its task's result if it names one."""
    problem = str(exc) if isinstance(exc, MalformedPayload) else f"{type(exc).__name__}: {exc}"
    reason = f"{why}: {problem}"
    tag = picked[0]  # as stored: it may not even be text
    logger.error("queue %r message %s: %s; moved to dead letters", queue,
                 text(tag, "replace"), reason)
    dead = channel.keys(queue).dead
    if no_ack:  # the pick forgot it already: the record dead.lua would write
        record = {"reason": reason, "at": clock.now(channel.raw), "meta": None,
                  "payload": text(picked[1], "replace")}
        channel.raw.hset(dead, tag, json.dumps(record))
        # (its replicas went with the pick)
    else:
        channel._run("dead", queue, [clock.now(channel.raw), reason, tag])
        channel._replicas_gone(queue, [text(tag, "replace")])
    # its caller's get() raises instead of waiting for ever (when it has a task id)
    fail_tasks(channel.raw, dead, [text(tag, "replace")])


# -- inspecting, requeueing and dropping (``sitsq dead``) -------------------------------------

@dataclass(frozen=True)
class DeadLetter:
    """One record of a queue's dead letters, as ``sitsq dead`` shows it."""

    id: str
    task: str
    task_id: str | None
    reason: str
    at: float | None

    def row(self, now_s: float) -> dict[str, Any]:
        return {"id": self.id, "task": self.task, "task_id": self.task_id,
                "reason": self.reason,
                "age_s": None if self.at is None else round(now_s - self.at, 1)}


#: What reading a record another program wrote may raise (ArithmeticError: an integer
#: past float's range; RecursionError: JSON nested thousands deep).
_UNREADABLE = (ValueError, TypeError, AttributeError, KeyError, ArithmeticError,
               RecursionError)


def read(client: Any, dead_key: str, limit: int | None = None) -> list[DeadLetter]:
    """The queue's dead letters, oldest first (at most ``limit``). A record that does not
    parse is shown with what could be read of it."""
    out = []
    for raw_id, record in client.hscan_iter(dead_key, count=500):
        message_id = shown(raw_id)
        try:
            parsed = parsed_record(record)
            reason = str(parsed.get("reason", "?"))
            at = float(parsed["at"]) if parsed.get("at") is not None else None
            if at is not None and not math.isfinite(at):
                at = None  # (a foreign writer's "nan": --json must stay JSON)
        except _UNREADABLE:
            reason, at = "(unreadable record)", None
        task = task_of(record)
        out.append(DeadLetter(message_id, task[1] if task else "?",
                              task[0] if task else None, reason, at))
    out.sort(key=lambda d: (d.at is None, d.at or 0.0))
    return out if limit is None else out[:limit]


def shown(message_id: bytes | str) -> str:
    """An id as text to show: one that is not UTF-8 (written by another program) with its
    odd bytes escaped; ``sitsq dead ... --all`` passes such ids on as they are stored."""
    return text(message_id, "backslashreplace")


#: Dead letters requeued per round of Redis calls (one HMGET, one requeue.lua).
REQUEUE_CHUNK = 200


def requeue(channel: Any, queue: str, ids: Sequence[bytes | str]
            ) -> tuple[list[str], dict[str, str]]:
    """Put dead-lettered messages back into ``queue`` as their producer would (scored
    afresh, redelivery count reset), then drop their records. Returns (requeued ids,
    {id: why not} for the others: gone, or a payload that never was a message).
    A chunk of :data:`REQUEUE_CHUNK` at a time: a few round trips per chunk, and never
    every record in memory (or in one Redis reply) at once."""
    keys = channel.keys(queue)
    done: list[str] = []
    refused: dict[str, str] = {}
    ids = list(dict.fromkeys(ids))  # an id named twice is one letter, requeued once
    for start in range(0, len(ids), REQUEUE_CHUNK):
        chunk = ids[start:start + REQUEUE_CHUNK]
        ready: list[tuple[bytes | str, bytes, dict[str, Any]]] = []
        for message_id, record in zip(chunk, channel.raw.hmget(keys.dead, chunk), strict=True):
            if record is None:
                refused[shown(message_id)] = "no such dead letter (name a letter's id or " \
                                             "its task's, as `sitsq dead list` shows them)"
                continue
            try:
                tag = text(message_id)
            except UnicodeDecodeError:
                refused[shown(message_id)] = "its id is not UTF-8 (another program's); " \
                                             "drop it instead"
                continue
            try:
                message = decode(parsed_record(record)["payload"], tuple(channel.codecs))
                message["properties"]["delivery_tag"] = tag
                _check_body(channel, message)
            except (ValueError, TypeError, KeyError, ArithmeticError, RecursionError) as exc:
                # (RecursionError: a body nested thousands deep, parked for it: raised, it
                # ended the command and left the rest of the letters named dead)
                refused[shown(message_id)] = f"its payload is not a message ({exc}); drop " \
                                             "it instead"
                continue
            ready.append((message_id, record, message))
        if not ready:
            continue
        now = clock.now(channel.raw)
        scorer = channel.snapshots.scorer(channel.raw, now)
        records = [channel._put_record(m, None, now, scorer) for _, _, m in ready]
        # One requeue.lua for the chunk: each letter put back only if its record is the
        # one read here, and that record dropped with it (another requeue of the same
        # letters at once put them back twice)
        n, waiting, missed = channel._run("requeue", queue, [
            a for (_, record, _), args in zip(ready, records, strict=True)
            for a in (*args, record)])
        channel._after_put(queue, int(n), int(waiting))
        gone = {text(m) for m in missed}  # (every id in ready is UTF-8: checked above)
        put_back = [text(i) not in gone for i, _, _ in ready]
        channel._replicate(queue, [args for args, back in zip(records, put_back, strict=True)
                                   if back])
        for (message_id, _, _), back in zip(ready, put_back, strict=True):
            if back:
                done.append(shown(message_id))
            else:
                refused[shown(message_id)] = "requeued or dropped meanwhile (by another " \
                                             "command?), or dead-lettered anew: list again"
    return done, refused


def _check_body(channel: Any, message: dict[str, Any]) -> None:
    """Raise :class:`MalformedPayload` (a ValueError) for a body no worker can take: put
    back, it would only be dead-lettered again by the first worker to meet it."""
    built = channel.Message({**message, "properties": {
        "delivery_info": {}, **message["properties"]}}, channel=channel)
    if built.errors:
        raise MalformedPayload(f"body does not decompress: {built.errors[0][1]!r}")
    check_task_body(built)


def drop(client: Any, dead_key: str, ids: Sequence[bytes | str]) -> int:
    """Delete dead-letter records for good; how many there were."""
    return int(client.hdel(dead_key, *ids)) if ids else 0


def drop_each(client: Any, dead_key: str, ids: Sequence[bytes | str]) -> list[str]:
    """Delete dead-letter records for good; returns the ids (as shown) that had none."""
    ids = list(dict.fromkeys(ids))
    with client.pipeline(transaction=False) as pipe:
        for message_id in ids:
            pipe.hdel(dead_key, message_id)
        deleted = pipe.execute()
    return [shown(i) for i, n in zip(ids, deleted, strict=True) if not n]


def expire(client: Any, dead_key: str, before_s: float, chunk: int = 500) -> int:
    """Delete the records dead-lettered before ``before_s`` (unix s); how many there
    were. A record without a readable time is left: ``sitsq dead`` shows it, a person
    drops it. Scanned and deleted a chunk at a time, so a large hash never holds Redis
    in one call."""
    expired = 0
    old: list[bytes] = []
    for message_id, record in client.hscan_iter(dead_key, count=chunk):
        try:
            at = float(parsed_record(record)["at"])
        except _UNREADABLE:
            continue
        if at < before_s:
            old.append(message_id)
        if len(old) >= chunk:
            expired += drop(client, dead_key, old)
            old = []
    return expired + drop(client, dead_key, old)
