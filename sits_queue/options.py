"""Submission options: what a task declares about itself, validated before enqueueing.

The same dataclass travels in the message header ``sits`` and is read back by the
broker (to score the message) and by the worker (to apply class limits).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sits_queue.broker.keys import CONTROL_QUEUE as CONTROL_QUEUE
from sits_queue.checks import finite, is_number, shown
from sits_queue.config import (
    MAX_BATCH_TASKS,
    MAX_LATENCY_SLA_MS,
    MAX_LOSS_SENSITIVITY,
    MIN_LATENCY_SLA_MS,
    MIN_LOSS_SENSITIVITY,
    SitsConfig,
)
from sits_queue.errors import InvalidTaskOptions
from sits_queue.priority.entropy import input_entropy

#: The beat's maintenance tasks: routed to the control queue (``app.py``), left out of
#: the task statistics.
MAINTENANCE_TASKS = ("sits.rescore", "sits.check_triggers", "sits.prewarm_plan",
                     "sits.site_sync")


def route_maintenance(name: str, options: dict[str, Any]) -> None:
    """Send a beat maintenance task to the control queue unless the call names a queue.
    Done on every path that publishes (``send_task``, ``enqueue_many``), not by a
    ``task_routes`` entry: an app that assigns ``task_routes`` the usual Celery way
    replaced that entry, and the beat's passes went to the default queue, behind its
    backlog or where no worker took them ("-Q gpu"): rescoring stopped without a word.
    (And a routes table costs every ``delay()`` a route lookup.)"""
    if name in MAINTENANCE_TASKS and not options.get("queue"):
        options["queue"] = CONTROL_QUEUE


#: The pre-warm planner's task (§4.2), sent to a chosen worker's own queue.
PREWARM_TASK = "sits.prewarm"
#: Not work the statistics count (arrivals, latency, done, hotness, demand, the top
#: class's backlog): the beat's tasks, and pre-warms (counted as demand, the forecaster
#: would learn its own pre-warms; as arrivals never done, the top class would read as
#: falling behind).
UNCOUNTED_TASKS = (*MAINTENANCE_TASKS, PREWARM_TASK)

#: The message header that carries these options.
HEADER = "sits"
#: Header with the submission time, for end-to-end latency stats: the producer's clock
#: as the app sends it, Redis's clock once the broker puts it (``broker/clock.py``).
SUBMITTED_AT = "sits_submitted_at"
#: Option names accepted on ``@app.task(...)`` and ``apply_async(...)``.
OPTION_NAMES = ("sla_class", "model", "context_tokens", "latency_sla_ms", "loss_sensitivity",
                "input_entropy", "vram_gib", "prefix_key", "precision", "arithmetic_intensity")
#: Precisions a task may ask its model to be served at (``cache/precision.py``, §3.2).
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
#: Larger contexts than this are typos, not prompts (10M tokens).
MAX_CONTEXT_TOKENS = 10_000_000
#: No single device offers more (largest parts today: 192 GiB).
MAX_VRAM_GIB = 1024.0
#: FLOP per byte past any device's ridge point (the largest tabled: ~810, an L4's int8):
#: larger intensities are typos, not kernels.
MAX_ARITHMETIC_INTENSITY = 1e6
#: A batch key names a task, a model and a class: room for long dotted task names.
MAX_BATCH_KEY = 1000
#: The longest model name or prompt-prefix key a call may give.
MAX_NAME = 200


@dataclass(frozen=True)
class TaskOptions:
    sla_class: str
    model: str | None
    context_tokens: int
    latency_sla_ms: float
    loss_sensitivity: float
    input_entropy: float | None
    vram_gib: float | None
    #: What the prompt starts with, as a key: tasks with equal keys share a prompt prefix
    #: (workers holding its KV pull them first). Given, or derived from the prompt.
    prefix_key: str | None = None
    #: Same-model batching: tasks with equal keys (task, model, class) may run as one
    #: batch of at most ``batch_max`` (``workers/batched.py``). Set by batch tasks.
    batch: str | None = None
    batch_max: int | None = None
    #: The precision to serve the model at (§3.2); None: as loaded.
    precision: str | None = None
    #: FLOP per byte of device-memory traffic (§3.1 roofline): below a device's ridge
    #: point the task is memory-bound there, at or above it compute-bound; placement
    #: matches it to devices relatively rich in that resource. None: not declared.
    arithmetic_intensity: float | None = None

    def to_header(self) -> dict[str, Any]:
        # (every field is a plain value: dataclasses.asdict's deep copy cost ~10 us a call)
        return {name: getattr(self, name) for name in _FIELD_NAMES}


_FIELD_NAMES = tuple(f.name for f in fields(TaskOptions))
_FIELD_SET = frozenset(_FIELD_NAMES)
#: What a ``sits`` header may hold (:class:`TaskOptions`' fields).
OPTION_FIELDS = _FIELD_SET


class _Made(threading.local):
    """The header this thread made last (:func:`header_for`): the dict, a copy of it as
    made, and the config and options it was made from."""

    last: tuple[dict[str, Any], dict[str, Any], SitsConfig, TaskOptions] | None = None


_made = _Made()


def header_for(config: SitsConfig, options: TaskOptions) -> dict[str, Any]:
    """``options`` (resolved under ``config``) as the message header. Remembered, for
    this thread: the submission path reads its own header back twice (``send_task``
    checks it, the put scores it), and :func:`from_header` of this very dict, unchanged,
    under an equal config, returns ``options`` instead of validating them again (~10 us
    each). A changed header (a ``before_task_publish`` handler's) is validated anew."""
    header = options.to_header()
    _made.last = (header, dict(header), config, options)
    return header


def unchanged(header: Mapping[str, Any], copy: Mapping[str, Any]) -> bool:
    """Whether ``header`` still holds what ``copy`` was taken from: equal values of the
    same types (``==`` alone takes True for 1, which validation refuses)."""
    return header == copy and all(type(value) is type(copy[name])
                                  for name, value in header.items())


def resolve(config: SitsConfig, declared: Mapping[str, Any], per_call: Mapping[str, Any],
            args: Any = (), kwargs: Any = None) -> TaskOptions:
    """Merge decorator defaults and per-call options, fill class defaults, validate.

    Raises :class:`InvalidTaskOptions` naming the bad option; the caller enqueues nothing.
    """
    merged = {k: v for k, v in declared.items() if v is not None}
    merged.update({k: v for k, v in per_call.items() if v is not None})
    sla_class = merged.get("sla_class", config.default_class)
    if not isinstance(sla_class, str) or sla_class not in config.class_names:
        raise InvalidTaskOptions(f"unknown sla_class {shown(sla_class)}; known classes: "
                                 f"{list(config.class_names)}")
    quota = config.quota(sla_class)
    entropy = merged.get("input_entropy")
    if entropy is None:
        entropy = input_entropy(args or (), kwargs or {})
    model = _name("model", merged.get("model"))
    if model is not None and "@" in model:
        # an engine's key is model@precision: "lm@fp16" would be lm's fp16 engine
        raise InvalidTaskOptions(f"model must not contain '@' (ask for a precision with "
                                 f"precision=), got {model!r}")
    prefix = merged.get("prefix_key")
    if prefix is None and model is not None:
        prefix = derive_prefix_key(args or (), kwargs or {}, config.prefix_key_chars)
    vram = None if merged.get("vram_gib") is None \
        else _number("vram_gib", merged["vram_gib"], 0.0, MAX_VRAM_GIB)
    if vram is not None and vram > quota.vram_gib:
        # the worker caps a task at its class's VRAM: this one could never run within it
        raise InvalidTaskOptions(f"vram_gib {vram:g} exceeds the {sla_class!r} class's limit "
                                 f"of {quota.vram_gib:g} GiB; ask less or use a larger class")
    return TaskOptions(
        sla_class=sla_class,
        model=model,
        context_tokens=int(_number("context_tokens", merged.get("context_tokens", 0), 0,
                                   MAX_CONTEXT_TOKENS, integer=True)),
        latency_sla_ms=_number("latency_sla_ms", merged.get("latency_sla_ms",
                                                            quota.latency_sla_ms),
                               MIN_LATENCY_SLA_MS, MAX_LATENCY_SLA_MS),
        loss_sensitivity=_number("loss_sensitivity", merged.get("loss_sensitivity",
                                                                quota.loss_sensitivity),
                                 MIN_LOSS_SENSITIVITY, MAX_LOSS_SENSITIVITY),
        input_entropy=None if entropy is None else _number("input_entropy", entropy, 0.0, 1.0),
        vram_gib=vram,
        prefix_key=_name("prefix_key", prefix),
        batch=_name("batch", merged.get("batch"), longest=MAX_BATCH_KEY),
        batch_max=None if merged.get("batch_max") is None
        else int(_number("batch_max", merged["batch_max"], 1, MAX_BATCH_TASKS, integer=True)),
        precision=_precision(merged.get("precision")),
        arithmetic_intensity=None if merged.get("arithmetic_intensity") is None
        else _number("arithmetic_intensity", merged["arithmetic_intensity"], 0.0,
                     MAX_ARITHMETIC_INTENSITY),
    )


def batch_key(task_name: str, options: TaskOptions, timelimit: Any = None) -> str:
    """What tasks must share to run in one batch: the task, its model at its precision,
    its class and its time limits (Celery's ``timelimit`` header: hard, soft; s). A batch
    runs on one engine under its first task's limits: a task that set its own would
    have run under another's (a soft limit of 1 s in a batch led by the class's 24 s
    never fired), so it batches only with tasks that set the same.

    Raises ValueError for a ``timelimit`` that is no Celery pair of limits, and
    :class:`InvalidTaskOptions` for a key longer than :data:`MAX_BATCH_KEY` (a header
    carrying it is refused when read: the task would run with default options).
    """
    key = f"{task_name}|{options.model or ''}|{options.sla_class}"
    if options.precision is not None:
        key = f"{key}|{options.precision}"
    limits = _limits(timelimit)
    key = key if limits is None else f"{key}|t={limits}"
    if len(key) > MAX_BATCH_KEY:
        raise InvalidTaskOptions(
            f"the batch key of {shown(task_name)} (its task name, model, class and time "
            f"limits) is {len(key)} characters, over the {MAX_BATCH_KEY} a batch key may "
            f"have: give the task or the model a shorter name")
    return key


def _limits(timelimit: Any) -> str | None:
    """``hard/soft`` as exact floats (either may be empty); None when neither is set."""
    if timelimit is None:
        return None
    if not isinstance(timelimit, (list, tuple)) or len(timelimit) != 2 or not all(
            v is None or (is_number(v) and finite(v) and v > 0) for v in timelimit):
        raise ValueError(f"timelimit must be [time_limit, soft_time_limit], seconds, "
                         f"got {shown(timelimit)}")
    if timelimit[0] is None and timelimit[1] is None:
        return None
    return "/".join("" if v is None else repr(float(v)) for v in timelimit)


def _precision(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value in PRECISIONS:
        return value
    raise InvalidTaskOptions(f"precision must be one of {list(PRECISIONS)}, got {shown(value)}")


def derived_from_args(config: SitsConfig, args: Any, kwargs: Any) -> dict[str, Any]:
    """The options a send works out from the task's arguments when the caller gives
    none: its ``input_entropy`` and ``prefix_key``."""
    try:
        return {"input_entropy": input_entropy(args, kwargs or {}),
                "prefix_key": derive_prefix_key(args, kwargs or {}, config.prefix_key_chars)}
    except Exception:  # (arguments no send would take: nothing to tell apart)
        return {}


def derive_prefix_key(args: Any, kwargs: Mapping[str, Any], chars: int) -> str | None:
    """The automatic ``prefix_key``: a hash of the prompt's first ``chars`` characters
    (the first positional string argument, else ``prompt=``); None for a shorter prompt,
    no prompt, or ``chars`` 0. Prompts equal that far almost surely share a long token
    prefix too, whose KV a worker may hold (``cache/prefix.py``)."""
    text = args[0] if args and isinstance(args[0], str) else kwargs.get("prompt")
    if chars <= 0 or not isinstance(text, str) or len(text) < chars:
        return None
    # surrogatepass: a lone surrogate (a str Python holds, JSON carries) is the worker's
    # to refuse, naming it; the submission must not fail on the hash
    return hashlib.blake2b(text[:chars].encode(errors="surrogatepass"),
                           digest_size=8).hexdigest()


def from_header(config: SitsConfig, header: Any) -> TaskOptions:
    """Read options back from a message header; raises InvalidTaskOptions if malformed."""
    if header is None:
        return resolve(config, {}, {})
    last = _made.last
    if (last is not None and header is last[0] and unchanged(header, last[1])
            and (config is last[2] or config == last[2])):
        return last[3]
    if not isinstance(header, Mapping):
        raise InvalidTaskOptions(f"header {HEADER!r} must be an object, got "
                                 f"{type(header).__name__}")
    unknown = set(header) - _FIELD_SET
    if unknown:
        raise InvalidTaskOptions(f"header {HEADER!r} has unknown options {sorted(unknown)}")
    return resolve(config, {}, header)


def salvage(config: SitsConfig, header: Mapping[str, Any]) -> tuple[TaskOptions, list[str]]:
    """The options of a ``header`` :func:`from_header` refused, less those that fail on
    their own (beside its class, where that one holds), and the names dropped: a newer
    release's value of an option (a precision, a class this config lacks) loses that
    option alone, not the task's class with it. Raises InvalidTaskOptions where the
    rest still does not hold together."""
    base = {}
    if "sla_class" in header:
        try:
            resolve(config, {}, {"sla_class": header["sla_class"]})
            base = {"sla_class": header["sla_class"]}
        except (ValueError, TypeError, ArithmeticError):
            pass
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    for name, value in header.items():
        try:
            if name not in _FIELD_SET:
                raise InvalidTaskOptions(f"unknown option {name!r}")
            resolve(config, {}, {**base, name: value})
            kept[name] = value
        except (ValueError, TypeError, ArithmeticError):
            dropped.append(str(name))
    return resolve(config, {}, kept), dropped


def _name(option: str, value: Any, longest: int = MAX_NAME) -> str | None:
    """A model name or key: None, or a non-empty string of at most ``longest`` characters."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > longest:
        raise InvalidTaskOptions(f"{option} must be a non-empty string of at most "
                                 f"{longest} characters, got {shown(value)}")
    return value


def scoring_inputs(context_tokens: Any, latency_sla_ms: Any, loss_sensitivity: Any,
                   input_entropy: Any) -> tuple[int, float, float, float]:
    """A stored record's scoring inputs, held to the ranges :func:`resolve` allows (an
    entropy of None is 0): InvalidTaskOptions naming one that is not (a record no
    producer of ours wrote: ``ls`` of inf scored it past every other task)."""
    return (int(_number("context_tokens", context_tokens, 0, MAX_CONTEXT_TOKENS,
                        integer=True)),
            _number("latency_sla_ms", latency_sla_ms, MIN_LATENCY_SLA_MS,
                    MAX_LATENCY_SLA_MS),
            _number("loss_sensitivity", loss_sensitivity, MIN_LOSS_SENSITIVITY,
                    MAX_LOSS_SENSITIVITY),
            _number("input_entropy", input_entropy or 0.0, 0.0, 1.0))


def checked_entropy(value: Any) -> float:
    """An ``input_entropy`` given by a caller, checked as :func:`resolve` checks it."""
    return _number("input_entropy", value, 0.0, 1.0)


def _number(name: str, value: Any, lo: float, hi: float, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTaskOptions(f"{name} must be a number, got {shown(value)}")
    # The range first, compared exactly: float() of an int past ~1e308 raises OverflowError.
    if (isinstance(value, float) and not math.isfinite(value)) or not lo <= value <= hi:
        raise InvalidTaskOptions(f"{name} must be in [{lo:g}, {hi:g}], got {shown(value)}")
    if integer and not float(value).is_integer():
        raise InvalidTaskOptions(f"{name} must be a whole number, got {value!r}")
    return float(value)


