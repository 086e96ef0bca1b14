"""``sits.embed`` over a batch (the built-in batch task): the texts of the batch's calls
embedded together, in runs of at most ``inputs.MAX_EMBED_BATCH`` texts, then handed back
to their calls; a call with bad arguments, or texts the model refuses, fails alone."""

from __future__ import annotations

import inspect
from typing import Any

from sits_queue.errors import InferenceError, InvalidInput
from sits_queue.workers import inference, inputs
from sits_queue.workers.batched import Call, arguments

_EMBED = inspect.signature(inference.embed)


def texts_of(texts: Any = None, *_args: Any, **_kwargs: Any) -> float:
    """A call's share of a batch's time (``batchtime.py``): its texts."""
    return float(len(texts)) if isinstance(texts, (list, tuple)) else 1.0


def embed_calls(engine: Any, calls: list[Call]) -> list[Any]:
    """``sits.embed`` over a batch: the texts of every call that asks for the same
    normalisation go through :func:`~sits_queue.workers.inference.embed` together (its
    cache and batch-size controller see them as one list), then back to their calls.

    A call with bad arguments fails alone; so does one whose texts the model refuses
    (too long): when the joint run fails on input, each call runs alone.
    """
    outputs: list[Any] = [None] * len(calls)
    groups: dict[bool, list[tuple[int, Any]]] = {}
    for i, call in enumerate(calls):
        args = arguments(_EMBED, "sits.embed", engine, call)
        if not isinstance(args, InvalidInput):
            try:
                inputs.check_flag("normalize", args["normalize"])
            except InvalidInput as exc:
                args = exc
        if isinstance(args, InvalidInput):
            outputs[i] = args
            continue
        groups.setdefault(args["normalize"], []).append((i, args["texts"]))
    for normalize, members in groups.items():
        valid: list[tuple[int, Any, list[str]]] = []
        for i, texts in members:
            try:
                valid.append((i, texts, inputs.check_texts(texts)))
            except InferenceError as exc:
                outputs[i] = exc
        for run in _runs(valid):
            _embed_run(engine, run, normalize, outputs)
    return outputs


def _runs(valid: list[tuple[int, Any, list[str]]]) -> list[list[tuple[int, Any, list[str]]]]:
    """Calls (each whole) in runs of at most ``MAX_EMBED_BATCH`` texts: one call takes
    that many, so a batch of calls over it ran every call alone."""
    runs: list[list[tuple[int, Any, list[str]]]] = []
    size = 0
    for call in valid:
        if not runs or size + len(call[2]) > inputs.MAX_EMBED_BATCH:
            runs.append([])
            size = 0
        runs[-1].append(call)
        size += len(call[2])
    return runs


def _embed_run(engine: Any, run: list[tuple[int, Any, list[str]]], normalize: bool,
               outputs: list[Any]) -> None:
    try:
        vectors = inference.embed(engine, [t for *_, own in run for t in own], normalize)
    except InferenceError:  # the model refused one (too long): the culprit fails alone
        for i, texts, _ in run:
            outputs[i] = _alone(engine, texts, normalize)
        return
    start = 0
    for i, texts, own in run:
        part = vectors[start:start + len(own)]
        outputs[i] = part[0] if isinstance(texts, str) else part
        start += len(own)


def _alone(engine: Any, texts: Any, normalize: bool) -> Any:
    try:
        return inference.embed(engine, texts, normalize)
    except InferenceError as exc:
        return exc
