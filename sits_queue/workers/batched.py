"""Same-model batching: tasks of one batch task, model and class run as one batch.

Offline inference submits work one item per task (``embed.delay(text)`` a million
times), while a model runs a batch of 32 in about the time it runs one. Here the
broker gathers and the worker batches, without holding anything back in a buffer:

1. The producer marks a batch task's message with its batch key (task, model, class)
   and ``max_batch`` (``options.batch_key``). ``pick.lua``, when the task it picks has
   one, also takes the waiting tasks with the same key among the first
   ``batch_window`` of the queue, up to ``max_batch`` in all, atomically with the pick;
   each is unacked like any picked message. Nothing waits for a batch to fill: a batch
   is what was waiting, so a quiet queue runs tasks one by one at once.
2. The transport delivers them one after another between two marks, each message
   marked ``[batch, index, size]``; Celery makes a request of each as usual (received
   events, revokes, expiry), and :func:`gather` holds them until the end mark, then
   passes the first on through Celery's pool semaphore carrying the others, and
   :class:`BatchRequest` sends the pool one job for all of them (each checked for
   revokes and VRAM admission first), with the class's time limits.
3. In the pool child, :func:`run_batch` gets the engine once and calls the task's
   function once with every call (:class:`Call`); then each request goes through
   Celery's own tracer as if it had run alone, with the outcome the batch gave it:
   its result stored, its signals sent, its failure its own. The main process acks
   each message and sends each its events (Flower sees every task).

A batch task's function takes the engine and a list of calls and returns one output
per call, in order; an exception instance in that list fails that call only::

    @app.batch_inference_task(model="encoder", max_batch=64)
    def score(engine, calls):
        return engine.module.score([c.args[0] for c in calls])

    score.delay("one text")   # -> {"output": ..., "sits": {..., "batch": {"size", "index"}}}

Why not celery-batches: it buffers prefetched messages in the worker for a count or a
time, which needs prefetching (it would take tasks out of our priority order) and
holds early tasks back; here the batch is taken from Redis by priority in one step.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from weakref import ref

from celery import bootsteps, current_app
from celery.app.trace import fast_trace_task, trace_task_ret
from celery.exceptions import TaskRevokedError
from celery.worker import state
from kombu.serialization import loads

from sits_queue.broker import intake
from sits_queue.broker.keys import batch_mark, batch_units
from sits_queue.cache import kvwarm
from sits_queue.errors import InferenceError, InvalidInput
from sits_queue.workers import firsttoken, inference, kvreuse, metrics, runtime
from sits_queue.workers import request as admission
from sits_queue.workers.request import SitsRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Call:
    """One task of a batch: its id and the arguments it was called with."""

    id: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def split_outputs(outputs: Any, calls: list[Call], meta: dict[str, Any]) -> dict[str, Any]:
    """Each call's outcome from a batch run: its ``{"output", "sits"}`` result, or the
    exception that fails it. An output list of the wrong shape fails every call."""
    if not isinstance(outputs, (list, tuple)) or len(outputs) != len(calls):
        got = (f"{len(outputs)} outputs" if isinstance(outputs, (list, tuple))
               else type(outputs).__name__)
        error = InferenceError(f"batch function returned {got} for {len(calls)} calls; "
                               "it must return one output per call, in order")
        return {c.id: error for c in calls}
    return {c.id: out if isinstance(out, BaseException)
            else {"output": out, "sits": {**meta, "batch": {"size": len(calls), "index": i}}}
            for i, (c, out) in enumerate(zip(calls, outputs, strict=True))}


# -- the pool child ------------------------------------------------------------------------

#: Outcomes :func:`run_batch` computed, by task id, until the tracer asks for them.
_outcomes: dict[str, Any] = {}


def run_batch(jobs: list[tuple[Any, ...]]) -> list[tuple[Any, Any, float]]:
    """Pool job: the batch's calls in one run, then Celery's tracer per task.

    ``jobs`` are the arguments Celery's own job would have had per task (name, id,
    request, body, content type, encoding). Returns what that job returns, per task,
    each with the batch's run time.
    """
    began = time.monotonic()
    app = current_app._get_current_object()
    task = app.tasks[jobs[0][0]]
    calls: list[Call] = []
    for _name, task_id, _request, body, content_type, encoding in jobs:
        args, kwargs, _embed = loads(body, content_type, encoding,  # type: ignore[no-untyped-call]
                                     accept={content_type})
        calls.append(Call(task_id, tuple(args), dict(kwargs)))
    _outcomes.update(_run(task, calls, jobs[0][2]))
    trace = fast_trace_task if app.use_fast_trace_task else trace_task_ret
    try:
        results = [trace(*job) for job in jobs]
    finally:
        for call in calls:
            _outcomes.pop(call.id, None)
    elapsed = time.monotonic() - began
    return [(failed, retval, elapsed) for failed, retval, _ in results]


def _run(task: Any, calls: list[Call], request: dict[str, Any]) -> dict[str, Any]:
    """The batch through ``run_inference`` (engine, limits, accounting) under the first
    task's request; every call's outcome (the error of a failed run fails them all)."""
    task.push_request(**{**request, "id": calls[0].id, "args": calls[0].args,
                         "kwargs": calls[0].kwargs, "is_eager": False})
    try:
        result = inference.run_inference(runtime.for_app(task.app), task, (calls,), {},
                                         tasks=len(calls))
    except Exception as exc:  # SoftTimeLimitExceeded too: each call fails with it
        return {c.id: exc for c in calls}
    finally:
        task.pop_request()
    outcomes = split_outputs(result["output"], calls, result["sits"])
    failed = [reason for out in outcomes.values() if isinstance(out, BaseException)
              and (reason := metrics.failure_reason(out)) is not None]
    child = runtime.child()
    if failed and child is not None:
        for reason in failed:
            child.count(metrics.failure_fields(reason))
        child.publish()
    return outcomes


# -- the built-in batch function -----------------------------------------------------------

_EMBED = inspect.signature(inference.embed)


def _arguments(signature: inspect.Signature, task: str, engine: Any, call: Call
               ) -> dict[str, Any] | InvalidInput:
    """One call's arguments by name, defaults filled in, as the batch function's
    single-call signature reads them; or the error that fails that call alone."""
    try:
        bound = signature.bind(engine, *call.args, **call.kwargs)
    except TypeError as exc:
        return InvalidInput(f"{task} arguments: {exc}")
    bound.apply_defaults()
    return dict(bound.arguments)


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
        args = _arguments(_EMBED, "sits.embed", engine, call)
        if isinstance(args, InvalidInput):
            outputs[i] = args
            continue
        groups.setdefault(bool(args["normalize"]), []).append((i, args["texts"]))
    for normalize, members in groups.items():
        valid: list[tuple[int, Any, list[str]]] = []
        for i, texts in members:
            try:
                valid.append((i, texts, inference.check_texts(texts)))
            except InferenceError as exc:
                outputs[i] = exc
        if not valid:
            continue
        try:
            vectors = inference.embed(engine, [t for *_, own in valid for t in own], normalize)
        except InferenceError:  # the model refused one (too long): the culprit fails alone
            for i, texts, _ in valid:
                outputs[i] = _alone(engine, texts, normalize)
            continue
        start = 0
        for i, texts, own in valid:
            part = vectors[start:start + len(own)]
            outputs[i] = part[0] if isinstance(texts, str) else part
            start += len(own)
    return outputs


def generate_batched(engine: Any, prompt: str, max_new_tokens: int = 32,
                     temperature: float = 0.0, seed: int = 0,
                     stop_at_eos: bool = True) -> dict[str, Any]:
    """One call of ``sits.generate_batched`` (its signature: a call's arguments, those of
    ``sits.generate``; the batch function is :func:`generate_calls`), as a plain function."""
    out = generate_calls(engine, [Call("", (prompt, max_new_tokens, temperature, seed,
                                            stop_at_eos))])[0]
    if isinstance(out, BaseException):
        raise out
    result: dict[str, Any] = out
    return result


_GENERATE = inspect.signature(generate_batched)


@dataclass(frozen=True)
class _Row:
    """One call of a generation batch: where its output goes, its prompt's token ids and
    how it decodes."""

    index: int
    ids: list[int]
    most: int
    temperature: float
    seed: int


def generate_calls(engine: Any, calls: list[Call], *, share_prefix: bool = True
                   ) -> list[Any]:
    """Continuations of every call's prompt as one padded batch through Hugging Face
    ``generate`` (the KV cache, the attention mask and positions handled there), each
    cut to its own ``max_new_tokens`` and, with ``stop_at_eos``, after its
    end-of-sequence token; greedy or sampled per call (``temperature``, ``seed``), each
    row sampled as :func:`~sits_queue.workers.inference.generate` samples (the softmax at
    its temperature, a generator seeded by its seed and the position): what that decodes
    for each prompt alone (tested, greedy and sampled), as ``{"text", "tokens",
    "prompt_tokens", "cached_tokens", "shared_tokens", "stopped", "runs": 1}``.

    Prompts that start alike (one instruction template over many inputs: the offline
    case) have that prefix prefilled once for the whole batch, after the part the
    child's KV-prefix store already holds, and stored for later batches
    (``shared_tokens``: the prefix's length; ``cached_tokens``: the part from the store).
    A batch of one runs ``inference.generate``'s decode loop instead (faster alone; its
    ``shared_tokens`` is 0, the store still serves its prompt's start). No time slices
    (``sits.generate``'s); a call with bad arguments or a prompt the model cannot take
    fails alone. ``share_prefix`` False prefills every row in full (what
    ``sitsq bench coalesce`` compares with)."""
    model = getattr(engine, "key", "?")
    module, tokenizer = inference.module_of(engine, model), inference.tokenizer_of(engine, model)
    limit = kvwarm.max_positions(module, tokenizer)
    outputs: list[Any] = [None] * len(calls)
    groups: dict[bool, list[_Row]] = {}
    for i, call in enumerate(calls):
        args = _arguments(_GENERATE, "sits.generate_batched", engine, call)
        if isinstance(args, InvalidInput):
            outputs[i] = args
            continue
        prompt, most = args["prompt"], args["max_new_tokens"]
        try:
            inference.check_prompt(prompt, most, args["temperature"], args["seed"])
            ids = tokenizer(prompt)["input_ids"]
            inference.check_context(model, len(ids), most, limit)
        except InferenceError as exc:
            outputs[i] = exc
            continue
        row = _Row(i, ids, most, float(args["temperature"]), int(args["seed"]))
        groups.setdefault(bool(args["stop_at_eos"]), []).append(row)
    for stop, rows in groups.items():
        for row, out in zip(rows, _generate_rows(module, tokenizer, model, rows, stop,
                                                 share_prefix), strict=True):
            outputs[row.index] = out
    return outputs


#: Shortest token prefix a generation batch's prompts must share for it to be prefilled
#: once for all of them: one KV-prefix block, the least the store keeps (a shorter
#: common start stays in the batch's own prefill).
SHARE_MIN_TOKENS = 16


def shared_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with, leaving each at least one of its own (a row needs
    one position past the prefix to give logits); 0 below :data:`SHARE_MIN_TOKENS`."""
    if not prompts:
        return 0
    shortest = min(len(p) for p in prompts)
    n = 0
    while n < shortest - 1 and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n if n >= SHARE_MIN_TOKENS else 0


def _generate_rows(module: Any, tokenizer: Any, model: str, rows: list[_Row], stop: bool,
                   share: bool = True) -> list[dict[str, Any]]:
    import copy

    import torch
    from transformers import LogitsProcessorList

    longest = max(row.most for row in rows)
    width = max(len(row.ids) for row in rows)
    active = runtime.active()
    if active is not None:
        active.check_vram(inference.kv_cache_bytes(module, (width + longest) * len(rows)))
    eos = getattr(tokenizer, "eos_token_id", None)
    if len(rows) == 1:
        return [_generate_alone(module, tokenizer, model, rows[0], eos if stop else None,
                                active)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    device = next(module.parameters()).device
    shared = shared_prefix([row.ids for row in rows]) if share else 0
    past, cached = _shared_cache(module, model, rows[0].ids[:shared], len(rows), active) \
        if shared else (None, 0)
    if past is None:
        shared = 0
    input_ids, mask = _layout(rows, shared, pad)
    width = int(input_ids.shape[1])
    config = copy.deepcopy(module.generation_config)
    # Greedy for ``generate``: the sampled rows' tokens are chosen by _RowSampler, which
    # leaves generate's argmax no other choice.
    config.update(max_new_tokens=longest, do_sample=False, pad_token_id=pad,
                  eos_token_id=eos if stop else None)
    extra = {kvwarm.cache_kwarg(module): past} if past is not None else {}
    with torch.inference_mode():
        out = module.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                              generation_config=config,
                              logits_processor=LogitsProcessorList([_row_sampler(width, rows)]),
                              **extra)
    results = []
    for r, row in enumerate(rows):
        new = out[r, width:].tolist()[:row.most]
        if stop and eos is not None and eos in new:
            new = new[:new.index(eos) + 1]
        results.append({"text": tokenizer.decode(new, skip_special_tokens=True),
                        "tokens": len(new), "prompt_tokens": len(row.ids),
                        "cached_tokens": cached, "shared_tokens": shared,
                        "stopped": "eos" if stop and new and new[-1] == eos else "length",
                        "runs": 1})
    return results


def _generate_alone(module: Any, tokenizer: Any, model: str, row: _Row, eos: int | None,
                    active: runtime.ActiveTask | None) -> dict[str, Any]:
    """A batch of one: ``inference.generate``'s own decode loop, which is what the row
    would get from ``generate`` (the same tokens, tested) without its per-call set-up
    (generation config, logits processors, stopping criteria: a quarter of a short
    generation's time with a small model), and with its soft-limit check between steps.
    Never yields: a batch task does not resume from a checkpoint."""
    import torch

    device = next(module.parameters()).device
    unsliced = replace(active, yielder=None) if active is not None else None
    prefix = inference.PromptPrefix.looked_up(unsliced, model, row.ids)
    progress: dict[str, Any] = {"new": [], "runs": 1}
    inference.decode_steps(module, torch.tensor([row.ids], device=device), row.most, eos,
                           row.temperature, row.seed, progress, unsliced, prefix)
    new: list[int] = progress["new"]
    return {"text": tokenizer.decode(new, skip_special_tokens=True), "tokens": len(new),
            "prompt_tokens": len(row.ids), "cached_tokens": prefix.tokens,
            "shared_tokens": 0,
            "stopped": "eos" if eos is not None and new and new[-1] == eos else "length",
            "runs": 1}


def _layout(rows: list[_Row], shared: int, pad: int) -> tuple[Any, Any]:
    """Token ids and attention mask of a batch: each prompt's own tokens end together
    (left padding); with a shared prefix, that comes first in every row and the padding
    sits between it and the rest (masked out; positions count only real tokens)."""
    import torch

    own = max(len(row.ids) - shared for row in rows)
    input_ids = torch.full((len(rows), shared + own), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), shared + own), dtype=torch.long)
    for r, row in enumerate(rows):
        rest = row.ids[shared:]
        input_ids[r, :shared] = torch.tensor(row.ids[:shared], dtype=torch.long)
        mask[r, :shared] = 1
        input_ids[r, shared + own - len(rest):] = torch.tensor(rest, dtype=torch.long)
        mask[r, shared + own - len(rest):] = 1
    return input_ids, mask


def _shared_cache(module: Any, model: str, tokens: list[int], rows: int,
                  active: runtime.ActiveTask | None) -> tuple[Any, int]:
    """The KV cache of the batch's shared prefix, prefilled once (after the longest part
    the child's KV-prefix store holds, which it then keeps for later batches and
    generations) and repeated for every row; with the tokens that came from the store.
    (None, 0) for a model whose cache cannot be shared (sliding-window, recurrent)."""
    import torch

    prefix = inference.PromptPrefix.looked_up(active, model, tokens)
    device = next(module.parameters()).device
    with torch.inference_mode():
        out = module(input_ids=torch.tensor([tokens[prefix.tokens:]], device=device),
                     attention_mask=torch.ones((1, len(tokens)), dtype=torch.long,
                                               device=device),
                     use_cache=True, **{kvwarm.cache_kwarg(module): prefix.start})
    cache = kvwarm.cache_of(out)
    if not kvreuse.reusable(cache):
        return None, 0
    prefix.after_prefill(cache)  # a copy: the repeat below is in place
    cache.batch_repeat_interleave(rows)
    return cache, prefix.tokens


def _row_sampler(width: int, rows: list[_Row]) -> Any:
    """A ``LogitsProcessor`` that marks the first token (``firsttoken.py``) and, for each
    sampled row, draws that row's token as ``inference.generate`` would at that position
    and leaves it the only possible one."""
    import torch
    from transformers import LogitsProcessor

    sampled = [(r, row) for r, row in enumerate(rows) if row.temperature > 0]
    generator = torch.Generator(device="cpu")

    class RowSampler(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            firsttoken.mark()
            position = int(input_ids.shape[1]) - width
            for r, row in sampled:
                probs = torch.softmax(scores[r:r + 1].float() / row.temperature, dim=-1).cpu()
                token = int(torch.multinomial(probs, 1, generator=inference.seeded(
                    generator, row.seed, position)))
                scores[r] = -math.inf
                scores[r, token] = 0.0
            return scores

    return RowSampler()


def _alone(engine: Any, texts: Any, normalize: bool) -> Any:
    try:
        return inference.embed(engine, texts, normalize)
    except InferenceError as exc:
        return exc


class BatchInferenceTask(inference.InferenceTask):
    """Task base for ``@app.batch_inference_task``: ``fun(engine, calls) -> outputs``."""

    abstract = True
    Request = "sits_queue.workers.batched:BatchRequest"
    #: Callers pass one call's arguments, not the function's (engine, calls).
    typing = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task_id = self.request.id
        if task_id in _outcomes:  # a batch computed it (run_batch)
            outcome = _outcomes.pop(task_id)
        else:  # alone: a batch of one (an eager call, or a worker without batches)
            call = Call(task_id or "", args, kwargs)
            result = inference.run_inference(runtime.for_app(self.app), self, ([call],), {})
            outcome = split_outputs(result["output"], [call], result["sits"])[call.id]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


# -- the main process ----------------------------------------------------------------------

#: Batches being delivered now (the transport's marks), with the requests that came.
_open: dict[str, list[Any]] = {}
#: Whole batches on their way to the pool, by their first request's id.
_ready: dict[str, list[Any]] = {}


def gather(request: Any, run: Callable[[Any], Any]) -> Any:
    """The consumer's ``on_task_request`` for every request (``run`` is Celery's own):
    a member of a batch being delivered is held until the batch is whole; the first one
    held then goes to ``run`` (through the pool semaphore, once for all) carrying the
    others. Anything else, a late member included, runs as usual."""
    mark = batch_mark(getattr(request, "request_dict", None))
    members = _open.get(mark[0]) if mark is not None else None
    if members is None:
        return run(request)
    members.append(request)
    return None


def delivery(batch: str, done: bool, run: Callable[[Any], Any]) -> None:
    """The transport's marks around a batch's delivery; at the end, send what came."""
    if not done:
        _open[batch] = []
        return
    members = _open.pop(batch, None)
    if members:
        _ready[members[0].id] = members
        run(members[0])


def _execute_batched(self: Any, pool: Any, **kwargs: Any) -> Any:
    """``execute_using_pool`` of a batch task: the request and those it carries, each
    checked (revoked, VRAM admission) and run as one pool job."""
    members = _ready.pop(self.id, None) or [self]
    runnable = [m for m in members if _admitted(m)]
    if not runnable:
        raise TaskRevokedError(self.id)  # frees the pool slot it was given
    return submit(runnable, pool)


def _admitted(request: Any) -> bool:
    """False for a request revoked meanwhile, or whose declared VRAM does not fit (then
    its message goes back to the queue, as ``request.py`` does for any task)."""
    return not request.revoked() and not admission.refused(request)


def submit(requests: list[Any], pool: Any) -> Any:
    """One pool job for ``requests``; Celery's callbacks fan out to each of them."""
    first = requests[0]
    time_limit, soft_time_limit = first.time_limits

    def each(method: str) -> Callable[..., None]:
        def call(*args: Any) -> None:
            for request in requests:
                getattr(request, method)(*args)
        return call

    def done(results: Any) -> None:
        for request, outcome in zip(requests, results, strict=False):
            request.on_success(outcome)

    result = pool.apply_async(
        run_batch, args=([_job(r) for r in requests],),
        accept_callback=each("on_accepted"), timeout_callback=each("on_timeout"),
        callback=done, error_callback=each("on_failure"),
        soft_timeout=soft_time_limit or first.task.soft_time_limit,
        timeout=time_limit or first.task.time_limit, correlation_id=first.id)
    if result is not None:
        for request in requests:
            request._apply_result = ref(result)
    if len(requests) > 1:
        logger.debug("batch of %d %s tasks sent to the pool", len(requests), first.name)
    return result


def _job(request: Any) -> tuple[Any, ...]:
    return (request.type, request.id, request.request_dict, request.body,
            request.content_type, request.content_encoding)


class BatchRequest(SitsRequest):
    """Request of a batch task: runs with the requests of its batch in one pool job.

    Celery generates a subclass per task type with its own ``execute_using_pool``;
    the batch one replaces it (it does SitsRequest's VRAM admission per member).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.execute_using_pool = _execute_batched


BatchRequest.execute_using_pool = _execute_batched


def reserved_units() -> int:
    """Reserved requests, a batch counting as one (it takes one pool slot)."""
    return batch_units((id(r), getattr(r, "request_dict", None))
                       for r in list(state.reserved_requests))


class Batches(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer step: requests of a delivered batch are gathered before Celery's pool
    semaphore (one slot for the batch), and a batch counts as one task where the worker
    decides whether to take more (``worker_disable_prefetch`` counts reserved requests
    against the pool size: a batch of 32 would stop a worker whose second child is idle
    from taking anything)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    name = "SITS batches"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        run = c.on_task_request  # before Tasks.start builds the strategies around it
        c.on_task_request = lambda request: gather(request, run)
        self.run = run

    def start(self, c: Any) -> None:
        intake.on_batch(lambda batch, done: delivery(batch, done, self.run))
        if not c.app.conf.worker_disable_prefetch or c.task_consumer is None:
            return
        qos = c.task_consumer.channel.qos
        plain = type(qos).can_consume

        def can_consume(self: Any) -> bool:
            limit = getattr(c.controller, "max_concurrency", None) or c.pool.num_processes
            return reserved_units() < limit and bool(plain(self))

        qos.can_consume = can_consume.__get__(qos)

    def stop(self, c: Any) -> None:
        intake.on_batch(None)
        # A batch cut short by a reconnect or shutdown: its messages go back to the queue
        # with the channel's unacked ones (or by the visibility timeout).
        _open.clear()
        _ready.clear()
