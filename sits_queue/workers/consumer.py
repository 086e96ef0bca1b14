"""The worker's Celery consumer, losing no message Celery cannot run.

Stock Celery *acks* a message whose body does not decode (a corrupt compressed body, a
content type it has no decoder for): logged, then gone, and its caller's ``get()``
waits for ever. It rejects a task message it finds invalid (a bad ETA, a content type
it does not accept) or cannot place, and the reason is in the worker's log only. Here
each is dead-lettered (``sitsq dead``) with the reason Celery found, and the task's
result, when the message names a task, fails with it (``DeadLettered``). Celery's own
handling (its log lines, the ``task_rejected`` signal, NotRegistered for an unknown
task) is otherwise kept.

The reason travels to ``QoS.reject`` through the channel (``reject_reasons``): Celery
rejects through kombu's ``Message.reject``, which carries nothing but the tag.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.concurrency import solo
from celery.concurrency.base import BasePool
from celery.exceptions import WorkerTerminate
from celery.platforms import EX_FAILURE
from celery.worker.consumer import Consumer
from celery.worker.consumer.consumer import MESSAGE_DECODE_ERROR, dump_body
from celery.worker.state import active_requests, successful_requests, task_ready
from kombu.utils.encoding import safe_repr

from sits_queue.workers.eventflush import CoalescedEvents

logger = logging.getLogger("celery.worker.consumer.consumer")  # where Celery logs these

#: Longest exception text kept in a dead letter's reason.
REASON_CHARS = 500


def reject_reason(what: str, exc: BaseException | None) -> str:
    """``what``, with the exception's type and text, cut to :data:`REASON_CHARS`."""
    said = f"{what}: {type(exc).__name__}: {exc}" if exc is not None else what
    return said if len(said) <= REASON_CHARS else said[:REASON_CHARS] + "..."


def task_reject_reason(exc: Any) -> str:
    """A task's own ``Reject(reason, requeue=False)`` as its dead letter's reason."""
    reason = exc.reason
    if isinstance(reason, BaseException):
        return reject_reason("rejected by the task", reason)
    return reject_reason(f"rejected by the task: {reason}", None)


def note_reject(message: Any, reason: str, fail: bool) -> bool:
    """Give the SITS channel the reason for the reject to come (``fail``: the task's
    result fails with it; Celery stored none); False for a message of another transport
    (Celery's own handling applies)."""
    reasons = getattr(message.channel, "reject_reasons", None)
    if reasons is None or message.delivery_tag is None:
        return False
    reasons[message.delivery_tag] = (reason, fail)
    return True


class SitsConsumer(CoalescedEvents, Consumer):  # type: ignore[misc]
    """Celery's consumer, dead-lettering what it would drop or reject without a word, its
    task events published together (``workers/eventflush.py``)."""

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        if not note_reject(message, reject_reason("body does not decode", exc), fail=True):
            super().on_decode_error(message, exc)
            return
        logger.critical(MESSAGE_DECODE_ERROR, exc, message.content_type,
                        message.content_encoding, safe_repr(message.headers),  # type: ignore[no-untyped-call]
                        dump_body(message, message.body), exc_info=True)
        message.reject_log_error(logger, self.connection_errors)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        note_reject(message, reject_reason("invalid task message", exc), fail=True)
        super().on_invalid_task(body, message, exc)

    def on_unknown_message(self, body: Any, message: Any) -> None:
        note_reject(message, "not a task message: no task name in its headers or body", fail=True)
        super().on_unknown_message(body, message)

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        # Celery stores NotRegistered as the result itself. (exc is its KeyError.)
        name = (message.headers or {}).get("task")
        if name is None and isinstance(body, dict):  # protocol 1
            name = body.get("task")
        note_reject(message, f"unknown task {name!r}: not registered in this worker "
                    "(NotRegistered)", fail=False)
        super().on_unknown_task(body, message, exc)

    def cancel_active_requests(self) -> None:
        """Celery's, but on the solo pool (the task runs on this thread, which the
        signal interrupts) a cold shutdown (SIGQUIT, a second Ctrl-C) gives the running
        task back to its queue, as a prefork worker's does, by ending this process now
        with its message unacked (given back as the channel closes). Celery asked the
        pool to end the job there, which raised NotImplementedError into the running
        task: it was stored as FAILURE and acked, its work lost. Another pool that
        cannot end one job (threads: the task runs on a thread nothing can stop) lets
        its tasks run to their end, said in a warning (Celery's NotImplementedError
        ended the signal handler as an "Unrecoverable error")."""
        # (prefork's TaskPool sets terminate_job on the instance when it starts: its
        # class has BasePool's, which raises)
        terminate_job = getattr(self.pool, "terminate_job", None)
        if getattr(terminate_job, "__func__", terminate_job) is not BasePool.terminate_job \
                or not active_requests:
            super().cancel_active_requests()
            return
        given_back = [r for r in list(active_requests) if _given_back_at_cancel(r)]
        if not (isinstance(self.pool, solo.TaskPool) and given_back):
            # (Celery's ask raised NotImplementedError out of the signal handler: an
            # "Unrecoverable error" and its traceback, the tasks running to their end)
            logger.warning("cold shutdown of a %s pool: its %d running task(s) cannot be "
                           "stopped; the worker stops once they end",
                           type(self.pool).__module__.rsplit(".", 1)[-1],
                           len(active_requests))
            return
        logger.warning("cold shutdown of a solo pool with a task running: its message goes "
                       "back to its queue, and the worker stops now")
        # Started, so its give-back counts as a redelivery, as a prefork worker's does
        # (the solo pool's task blocked the loop whose ticks note what has started)
        channel = getattr(self.task_consumer, "channel", None)
        note_started = getattr(getattr(channel, "qos", None), "note_started", None)
        if note_started is not None:
            note_started()
        for request in given_back:
            # (no longer running: the channel's close gives its message back, where it
            # kept a running task's for it to ack)
            task_ready(request)
            request.send_event("task-cancelled")
        raise WorkerTerminate(EX_FAILURE)


def _given_back_at_cancel(request: Any) -> bool:
    """Whether a cold shutdown gives ``request`` back (Celery's rule): a late-acked task
    not yet acked nor done."""
    return bool(request.task.acks_late and not request.acknowledged
                and request.id not in successful_requests)
