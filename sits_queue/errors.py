"""Errors a user of SITS queue can catch."""

from __future__ import annotations


class SitsError(Exception):
    """Base of every error SITS queue raises on purpose."""


class ConfigError(SitsError, ValueError):
    """The configuration (file, environment or arguments) is invalid."""


class InvalidTaskOptions(SitsError, ValueError):
    """A submission named an unknown class or an invalid option; nothing was enqueued."""


class InvalidQueueName(SitsError, ValueError):
    """A queue name the broker cannot use: empty, or with a brace (either would spread
    the queue's keys over Redis Cluster slots, which its scripts cannot span)."""


class Unroutable(SitsError, ValueError):
    """A task sent to an exchange whose routing key reaches no queue: not sent."""


class DeadLettered(SitsError, RuntimeError):
    """The broker parked the task's message in its queue's dead letters without running it
    (a poison message: it was redelivered more than ``max_redeliveries`` times, each
    after a worker running it died); the message stays there, inspectable. Pickles and
    JSON-serialises by its message alone."""


class TaskOutOfMemory(SitsError, RuntimeError):
    """A task raised ``MemoryError`` (an allocation its process could not get: a prompt or
    batch too large for host memory). Its result says ``MemoryError``; the worker's log
    and task events say this. Not a ``MemoryError`` itself: Celery's worker re-raises one
    in its main process and stops, and the message, given back, stopped every worker
    that took it next, never counted as a redelivery."""


class NoDeviceLargeEnough(SitsError, ValueError):
    """A task declares more VRAM (``vram_gib``) than the largest device of any live
    worker holds in all: no worker could ever start it. Its message is dead-lettered
    (``sitsq dead requeue`` puts it back once a worker with a larger device serves)."""


class TaskExited(SitsError, RuntimeError):
    """A task raised ``SystemExit`` or ``KeyboardInterrupt`` (it called ``sys.exit()``) in
    a worker: failed as that task's error. Let through, it ended the pool child and its
    warm engines, and the message, redelivered, ended a child at every run until it was
    dead-lettered as poison with no word of why; in a solo pool it stopped the worker.
    (Celery's own shutdown signals, ``WorkerShutdown``/``WorkerTerminate``, go through.)"""


class UnreadableResult(SitsError, ValueError):
    """A task's result record in the backend is not one Celery writes (another program's,
    or corrupt): said at once rather than retried as if Redis were away."""


class InferenceError(SitsError):
    """An inference task failed for a reason the submitter can act on.

    Subclasses pickle and JSON-serialise by their message alone, so the result backend
    carries the reason to the caller unchanged.
    """


class UnknownModel(InferenceError, LookupError):
    """The task named a model no ``@app.model`` loader registered on this worker."""


class ModelLoadError(InferenceError):
    """A model loader raised, or returned something that is not a model."""


class InvalidInput(InferenceError, ValueError):
    """The task's arguments are malformed (e.g. a prompt that is not a string)."""


class ContextTooLong(InferenceError, ValueError):
    """The input (plus the tokens to generate) exceeds the model's maximum positions."""


class VramLimitExceeded(InferenceError, RuntimeError):
    """The task needed more device memory than its SLA class allows (MISSION §1.4).

    Raised for a real CUDA out-of-memory under the per-process memory fraction, and on
    hosts without CUDA for an estimate that exceeds the class cap. Deliberately *not* a
    ``MemoryError``: Celery's worker treats a ``MemoryError`` from a task as fatal and
    exits (``Request.on_failure``), while this failure must leave the worker serving.
    """

    #: Whether the device ran short while loading the model (a retry may find room),
    #: not against the class's cap (the same answer every time); the worker's own mark.
    at_load = False


#: What the ``inference`` extra installs (pyproject.toml), by import name.
INFERENCE_MODULES = frozenset({"torch", "transformers", "tokenizers", "onnxruntime", "onnx",
                               "onnxscript", "safetensors"})
INFERENCE_INSTALL = "pip install 'sits-queue[inference]'"


def missing_extra(exc: BaseException) -> str | None:
    """The install line for ``exc``, a ModuleNotFoundError of a module the ``inference``
    extra installs (a worker or ``sitsq bench`` without it said only "No module named
    'torch'"); None for anything else."""
    name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    return INFERENCE_INSTALL if name and name.partition(".")[0] in INFERENCE_MODULES else None
