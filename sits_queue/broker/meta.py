"""What the broker keeps about a waiting message besides its payload: the scoring inputs."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import orjson

from sits_queue.checks import is_utf8
from sits_queue.config import (
    MAX_LATENCY_SLA_MS,
    MAX_LOSS_SENSITIVITY,
    MIN_LATENCY_SLA_MS,
    MIN_LOSS_SENSITIVITY,
    SitsConfig,
)
from sits_queue.etas import due_s
from sits_queue.options import (
    HEADER,
    MAX_CONTEXT_TOKENS,
    MAX_NAME,
    OPTION_FIELDS,
    TaskOptions,
    batch_key,
    from_header,
    salvage,
    scoring_inputs,
)

logger = logging.getLogger(__name__)


def compact_json(value: Any) -> bytes:
    """``value`` as compact JSON bytes: orjson (5-10x faster than json on the put path),
    falling back to the stdlib for what orjson refuses (ints beyond 64 bits, non-str keys).
    """
    try:
        return orjson.dumps(value)
    except TypeError:
        # unescaped non-ASCII, as orjson writes it: pick.lua finds batch keys in the text
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()

# Short JSON keys: this record exists once per waiting message (100k+ in a deep queue).
_KEYS = {"sla_class": "c", "model": "m", "context_tokens": "n", "latency_sla_ms": "sla",
         "loss_sensitivity": "ls", "input_entropy": "e", "vram_gib": "v",
         "prefix_key": "px", "batch": "b", "batch_max": "bn", "precision": "q",
         "arithmetic_intensity": "ai"}


def due_at(headers: Any) -> float | None:
    """When a message's ETA or countdown falls due (unix s), from Celery's ``eta`` header;
    None without one, or one that does not parse. Read as Celery's worker reads it
    (``etas.py``; one without a time zone is UTC): dropped, the task aged from its put
    while not due, and outranked work it should not have. (Read with
    ``datetime.fromisoformat``, ``T24:00:00`` and ISO's ``2026-344`` were dropped so,
    while Celery held them to their time.)"""
    eta = headers.get("eta") if isinstance(headers, dict) else None
    return due_s(eta) if isinstance(eta, str) else None


@dataclass(frozen=True)
class WaitingMeta:
    options: TaskOptions
    enqueued_at_s: float
    task: str
    #: When its ETA falls due: a running task does not yield for it before (preempt.lua).
    due_s: float | None = None
    #: Celery's task id (``sitsq status`` shows it: what ``revoke`` and ``AsyncResult``
    #: take; the message id is the broker's).
    task_id: str | None = None

    @property
    def waiting_since_s(self) -> float:
        """When its wait began: its put, or when its ETA fell due if that is later (a
        countdown is the caller's wish, not lateness)."""
        return wait_start(self.enqueued_at_s, self.due_s)

    def to_json(self) -> bytes:
        record: dict[str, Any] = {short: getattr(self.options, name)
                                  for name, short in _KEYS.items()}
        record["t"] = self.enqueued_at_s
        record["task"] = self.task
        if self.task_id is not None:
            record["id"] = self.task_id
        if self.due_s is not None:
            record["eta"] = self.due_s
        return compact_json(record)

    @classmethod
    def of_message(cls, config: SitsConfig, message: dict[str, Any], now: float
                   ) -> WaitingMeta:
        """The record of a message to put, its options read from its header (checked;
        a foreign producer's bad header gets the defaults, never a refusal)."""
        headers = message.get("headers")
        if not isinstance(headers, dict):
            headers = {}
        header = headers.get(HEADER)
        if isinstance(header, dict) and (unknown := sorted(set(header) - OPTION_FIELDS)):
            # A newer release's options (a fleet upgraded one host at a time: its
            # producer's header requeued or retried here): the ones known here keep
            # their effect, class included, where the defaults replaced them all
            logger.warning("message %s: options %s are unknown to this release; "
                           "scheduled by the others",
                           message.get("properties", {}).get("delivery_tag"), unknown)
            header = {k: v for k, v in header.items() if k in OPTION_FIELDS}
        try:
            options = from_header(config, header)
        except (ValueError, TypeError, ArithmeticError) as exc:
            # A foreign producer wrote a bad header (or a newer release, a value this one
            # does not know): enqueue by what holds of it, else with defaults; never drop.
            # InvalidTaskOptions (a ValueError) names the option; a TypeError or an
            # ArithmeticError would mean a check it slipped past: no reason to refuse either.
            tag = message.get("properties", {}).get("delivery_tag")
            try:
                if not isinstance(header, dict):
                    raise TypeError("the header is no object")
                options, dropped = salvage(config, header)
                logger.warning("message %s: %s; scheduling it without %s", tag, exc, dropped)
            except (ValueError, TypeError, ArithmeticError, AttributeError):
                logger.warning("message %s: %s; scheduling it with default options", tag, exc)
                options = from_header(config, None)
        task = str(headers.get("task", ""))
        if options.batch is not None:
            # A batch key is the producer's for a batch task: its task, model, class,
            # precision and time limits. One that names another (a header made by hand,
            # limits changed on the way) would gather tasks no batch can run together:
            # the message is scheduled as a lone task.
            try:
                own = batch_key(task, options, headers.get("timelimit"))
            except ValueError as exc:
                own = str(exc)  # Celery refuses the message at the worker, naming it
            if options.batch != own:
                logger.warning("message %s: batch key %r is not this task's (%r); "
                               "scheduled alone",
                               message.get("properties", {}).get("delivery_tag"),
                               options.batch, own)
                options = replace(options, batch=None, batch_max=None)
        return cls(options=options, enqueued_at_s=now, task=task, due_s=due_at(headers),
                   task_id=task_id_of(headers))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WaitingMeta:
        record = json.loads(raw)
        options = TaskOptions(**{name: record.get(short) for name, short in _KEYS.items()})
        due = record.get("eta")
        task_id = record.get("id")
        return cls(options=options, enqueued_at_s=float(record["t"]),
                   task=str(record.get("task", "")),
                   due_s=float(due) if isinstance(due, int | float) else None,
                   task_id=task_id if isinstance(task_id, str) else None)

    @classmethod
    def read(cls, raw: str | bytes | None) -> WaitingMeta | None:
        """:meth:`from_json`, or None for a record that is absent or not one (written by
        hand or by another program: whatever walks every record must walk past it)."""
        if raw is None:
            return None
        try:
            return cls.from_json(raw)
        except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError,
                RecursionError):  # (JSON nested thousands deep)
            return None


def task_id_of(headers: Any) -> str | None:
    """A message's Celery task id (its ``id`` header), None for none or one that is no
    short string (a foreign producer's)."""
    task_id = headers.get("id") if isinstance(headers, dict) else None
    # (one that is no UTF-8, a lone surrogate, would fail the record's encoding, and the
    # put with it: the message is dead-lettered at its pick, with the reason, instead)
    return task_id if isinstance(task_id, str) and 0 < len(task_id) <= MAX_NAME \
        and is_utf8(task_id) else None


def wait_start(enqueued_s: float, due: Any) -> float:
    """When a task's wait begins: its put, or when its ETA falls due if that is later. A
    countdown or an ETA is the caller's wish, not lateness: its wait, and its aging,
    count from then (it aged from its put, and outranked fresh urgent tasks the moment
    it was due). A ``due`` that is no finite number (a foreign record's) is none."""
    if type(due) in (int, float) and math.isfinite(due) and due > enqueued_s:
        return float(due)
    return enqueued_s


def score_inputs(raw: str | bytes) -> tuple[str, float, int, float, float, float, str | None]:
    """The scorer's arguments straight from a stored record, without building objects.

    (sla_class, waiting since (``WaitingMeta.waiting_since_s``), context_tokens,
    latency_sla_ms, loss_sensitivity, input_entropy, model) — the order of
    :meth:`Scorer.score`. The rescoring pass reads
    one record per waiting message, so this skips the dataclasses; it still holds each
    input to the range the options allow (ValueError naming one that is not).
    """
    r = json.loads(raw)
    enqueued = float(r["t"])
    if not math.isfinite(enqueued):
        raise ValueError(f"enqueued at {enqueued}")
    enqueued = wait_start(enqueued, r.get("eta"))
    n, sla, ls, e = r["n"], r["sla"], r["ls"], r["e"] or 0.0
    # What our producers write passes the ranges at a glance (a pass reads 100k+ records);
    # anything else is checked in full, which names what is wrong.
    ours = type(n) is int and type(sla) is float and type(ls) is float and type(e) is float
    # (the same ranges as scoring_inputs checks, from the same constants)
    if not (ours and 0 <= n <= MAX_CONTEXT_TOKENS
            and MIN_LATENCY_SLA_MS <= sla <= MAX_LATENCY_SLA_MS
            and MIN_LOSS_SENSITIVITY <= ls <= MAX_LOSS_SENSITIVITY and 0.0 <= e <= 1.0):
        n, sla, ls, e = scoring_inputs(n, sla, ls, e)
    return r["c"], enqueued, n, float(sla), float(ls), float(e), r["m"]


def sla_class_of(raw: str | bytes | None) -> str | None:
    """The SLA class a stored record names; None for a record that is absent or not
    understood (the sites' replicas and digests read only this)."""
    try:
        record = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        return None
    value = record.get("c") if isinstance(record, dict) else None
    return value if isinstance(value, str) else None
