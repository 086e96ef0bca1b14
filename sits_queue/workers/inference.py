"""Inference tasks: the warm engine in, ``{"output", "sits"}`` out, clear errors on failure.

``@app.inference_task(model="name")`` functions receive the engine as their first
argument; :class:`InferenceTask` fetches it from the child's warm cache, applies the
class limits and wraps the result with the cold-start accounting (MISSION §4.1)::

    {"output": ..., "sits": {"cold": bool, "source": "device"|"host"|"disk",
                             "cuda_ctx_ms", "load_ms", "promote_ms", "warmup_ms",
                             "run_ms", "device", "sla_class", "limits": {...}}}

Built in, as tasks ``sits.generate`` and ``sits.embed`` (the model comes per call,
``sits.generate.apply_async(("prompt",), model="gpt")``) and as plain functions:
:func:`generate` (a Hugging Face causal LM, greedy or sampled, decoding step by step
with the KV cache and checking the soft time limit between steps) and :func:`embed`
(mean-pooled encoder output). torch is imported inside the functions only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from celery.exceptions import Retry

from sits_queue import tracing
from sits_queue.app import SitsTask
from sits_queue.broker.keys import AFFINITY_HEADER, CHECKPOINT_HEADER
from sits_queue.cache.kvwarm import (
    encoder_decoder,
    max_positions,
)
from sits_queue.cache.pool import COLD_PHASES
from sits_queue.config import ClassQuota
from sits_queue.errors import (
    ContextTooLong,
    InferenceError,
    ModelLoadError,
    VramLimitExceeded,
)
from sits_queue.exits import fail_exits, worker_exit
from sits_queue.options import PREWARM_TASK
from sits_queue.workers import (
    acquire,
    autoretry,
    batching,
    devicefit,
    firsttoken,
    gpu,
    kvreuse,
    limits,
    metrics,
    runtime,
    slices,
    taskheader,
)
from sits_queue.workers.decoding import (
    decode_steps,
    generated,
    kv_cache_bytes,
    resumed,
    stop_tokens,
)
from sits_queue.workers.inputs import (
    check_arguments,
    check_flag,
    check_length,
    check_prompt,
    check_texts,
    check_tokens,
    prompt_ids,
)

logger = logging.getLogger(__name__)

_MS_PER_S = 1000.0


class InferenceTask(SitsTask):
    """Task base for ``@app.inference_task``: the function's first argument is the engine."""

    abstract = True
    #: Expected failures (bad input, unknown model, limits): logged in one line, no trace.
    throws = (InferenceError,)
    #: Needs the per-task runtime (class caps, engine cache): a worker of plain tasks
    #: only leaves it for another (``workers/request.py``).
    runs_inference = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with fail_exits(self):
            devicefit.check_here(self)  # before its engine takes that device's memory
            return run_inference(runtime.for_app(self.app), self, args, kwargs)


def run_inference(rt: runtime.ChildRuntime, task: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any], tasks: int = 1,
                  early: Callable[[int, Any, dict[str, Any]], bool] | None = None,
                  joins: Any = None) -> dict[str, Any]:
    """Engine from the warm cache, limits, the user's function, accounting; a failure is
    counted by reason, and the child's record and counts go out once per run. ``tasks``:
    how many tasks the run serves (a batch, ``batched.py``); ``early(i, output, meta)``
    takes a batch's call ``i`` done before the run ends, with the run's result metadata
    as of then (``ActiveTask.deliver``), True if it took it; ``joins``: where calls
    that join the batch on the way come from (``ActiveTask.joins``)."""
    delivered = 0

    def counted(index: int, output: Any, meta: dict[str, Any]) -> bool:
        nonlocal delivered
        taken = early is not None and early(index, output, meta)
        delivered += taken
        return taken

    try:
        with firsttoken.first_token_clock() as clock:
            return _run(rt, task, args, kwargs, clock, tasks, counted if early else None,
                        joins)
    except BaseException as exc:
        # (the pool's own way out, a hard time limit's or a terminating revoke's
        # SystemExit, is no failure of the task's to count here: Celery counts the kill)
        reason = None if worker_exit(exc) else metrics.failure_reason(exc)
        if reason is not None and getattr(task, "name", None) == PREWARM_TASK:
            # (no task failed: counted as one, a model that fails to load inflated the
            # inference failure rate at every pre-warm pass)
            rt.count({"prewarm_failures": 1})
        elif reason is not None:  # the calls a batch delivered before it failed did not
            joined = joins.joined if joins is not None else 0
            rt.count(metrics.failure_fields(reason, tasks + joined - delivered))
        raise
    finally:
        rt.publish()


def _run(rt: runtime.ChildRuntime, task: Any, args: tuple[Any, ...],
         kwargs: dict[str, Any], clock: firsttoken.FirstToken, tasks: int = 1,
         early: Callable[[int, Any, dict[str, Any]], bool] | None = None,
         joins: Any = None) -> dict[str, Any]:
    try:
        run = _prepare(rt, task, args, kwargs, clock, tasks)
    except (ModelLoadError, VramLimitExceeded) as exc:
        # (a load that failed, or ran out of device memory: what else is checked here
        # gives the same answer every time; a batch's calls' own retries are theirs)
        if tasks != 1 or early is not None or not (isinstance(exc, ModelLoadError)
                                                   or getattr(exc, "at_load", False)):
            raise
        _retry_load(rt, task, exc)
    output = _call(run, task, _active_task(run, task, early, joins), args, kwargs)
    meta = run.so_far()
    _account(run, meta, tasks, joins, output)
    return {"output": output, "sits": meta}


def _retry_load(rt: runtime.ChildRuntime, task: Any, exc: Exception) -> NoReturn:
    """A task whose engine failed to load, retried as its ``autoretry_for`` says (Celery's
    wraps the function alone, called after the load: ``workers/autoretry.py``), else
    failed. Retried, it is counted as a task now: its next run, a retry, is read as the
    same task again (``_resumed``)."""
    try:
        autoretry.retry_or_raise(task, exc)
    except Retry:
        request = task.request
        if not _resumed(request, 1):
            quota = taskheader.task_class(rt.config, request, getattr(task, "sla_class", None))
            rt.count({"tasks": 1, f"tasks:{quota.name}": 1})
        raise


def _resumed(request: Any, tasks: int) -> bool:
    """Whether a run is of a task counted already: a run after a yield has the checkpoint
    header, a retry its count (the task counted on its first run; a retried task counted
    once per run)."""
    retries = getattr(request, "retries", 0)
    return getattr(request, CHECKPOINT_HEADER, None) is not None or (
        tasks == 1 and isinstance(retries, int) and retries > 0)


@dataclass
class _Run:
    """One run of an inference task: its engine and limits, as :func:`_prepare` set them
    up, and its result metadata as of any moment (:meth:`so_far`)."""

    rt: runtime.ChildRuntime
    model: str
    quota: ClassQuota
    cpus: tuple[int, ...]
    engine: Any
    engine_bytes: int
    fraction: float | None  # the allocator's cap (None off CUDA)
    meta: dict[str, Any]  # the cold start's fields, affinity, precision
    prewarm: bool
    soft: float | None
    hard: float | None
    run_started: float  # monotonic: the pool's soft limit counts from here
    clock: firsttoken.FirstToken
    start: float = 0.0  # perf_counter, when the task's function was called

    def so_far(self) -> dict[str, Any]:
        """The run's result metadata as of now."""
        return {**self.meta,
                "run_ms": round((time.perf_counter() - self.start) * _MS_PER_S, 3),
                "first_token_ms": self.clock.ms, "device": self.rt.device_label,
                "slot": self.rt.slot, "sla_class": self.quota.name,
                "limits": {"soft_time_limit_s": self.soft, "time_limit_s": self.hard,
                           "vram_gib": self.quota.vram_gib, "memory_fraction": self.fraction,
                           "cpus": list(self.cpus)}}


def _prepare(rt: runtime.ChildRuntime, task: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any], clock: firsttoken.FirstToken, tasks: int) -> _Run:
    """The run's engine from the warm cache, its class's cores and memory cap, and its
    start counted and traced."""
    check_arguments(task, args, kwargs)
    request = task.request
    # the pool's soft limit counts from the run's start, engine load included
    run_started = slices.started_at(getattr(request, "id", None))
    model = taskheader.task_model(request, getattr(task, "model", None))
    quota = taskheader.task_class(rt.config, request, getattr(task, "sla_class", None))
    # (said now: a run whose engine fails to load was traced without them)
    tracing.annotate({"sits.model": model, "sits.sla_class": quota.name})
    cpus = rt.confine(quota)
    rt.cap_for_class(quota)  # the context first, so its cost is timed on its own
    precision = taskheader.task_precision(request, getattr(task, "precision", None))
    acquire_ns = time.time_ns()
    try:
        engine, cold, served = acquire.acquire(rt, model, precision)
    finally:  # (a get that failed after making room pushed engines out too)
        acquire.drop_prefixes_off_device(rt)
    acquired_ns = time.time_ns()
    rt.confine(quota)  # again: the first load may have imported torch just now (threads)
    engine_bytes = int(engine.size_bytes())
    limits.check_engine_fits_class(model, quota, engine_bytes)
    fraction = rt.cap_for_class(quota, engine_bytes)
    meta = acquire.cold_meta(cold, rt.take_ctx_ms())
    # Taken ahead of its queue's head because this worker held the model warm (pick.lua).
    meta["affinity"] = bool(getattr(request, AFFINITY_HEADER, False))
    # What a precision request got (§3.2): served, the int8 gate's KL, why not if not.
    meta["precision"] = served
    prewarm = getattr(task, "name", None) == PREWARM_TASK
    rt.count(metrics.task_fields(meta, quota.name, model, tasks, prewarm,
                                 _resumed(request, tasks)))
    # Published now (a warm set that changed at once, the counts within the deferred
    # writer's half second), not only when the run ends: a child killed at its hard
    # limit never gets there, and the task and its cold start went uncounted
    rt.publish()
    _trace(meta, model, quota.name, acquire_ns, acquired_ns)
    timelimit = getattr(request, "timelimit", None) or (None, None)
    hard, soft = (*tuple(timelimit), None, None)[:2]
    return _Run(rt, model, quota, cpus, engine, engine_bytes, fraction, meta, prewarm,
                soft or getattr(task, "soft_time_limit", None), hard, run_started, clock)


def _active_task(run: _Run, task: Any,
                 early: Callable[[int, Any, dict[str, Any]], bool] | None,
                 joins: Any) -> runtime.ActiveTask:
    """What the built-in functions read of the run while it runs (``runtime.active``)."""
    rt = run.rt
    return runtime.ActiveTask(
        model=run.model, quota=run.quota, engine_bytes=run.engine_bytes,
        device=rt.torch_device, on_cuda=rt.on_cuda,
        soft_deadline=run.run_started + run.soft if run.soft else None,
        yielder=getattr(task, "yield_point", None), checkpoint=getattr(task, "checkpoint", None),
        prefixes=rt.prefixes(), count=rt.count,
        prefix_key=taskheader.task_prefix_key(task.request), embeddings=rt.embeddings(),
        batcher=rt.batcher(run.model),
        early=(lambda i, out: bool(early(i, out, run.so_far()))) if early else None,
        joins=joins)


def _call(run: _Run, task: Any, active: runtime.ActiveTask, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> Any:
    """The task's function on the warm engine; out of memory is the class's
    ``VramLimitExceeded``, the memory released first."""
    oom: str | None = None
    retry: Retry | None = None
    run.start = time.perf_counter()
    try:
        with runtime.activated(active), acquire.using(run.rt, run.engine.key):
            return task.run(run.engine, *args, **kwargs)
    except slices.Preempted:
        # A slice that yielded served the model as much as the last one will: its time
        # is service time too (the task itself counts once, on the run that finishes).
        if not run.prewarm:
            run.rt.count(metrics.run_fields(
                run.model, round((time.perf_counter() - run.start) * _MS_PER_S, 3), 0))
        raise
    except Retry as exc:
        # The task's autoretry_for took an out-of-memory error (Celery's wrapper turns it
        # into a Retry before it gets here): its memory is released all the same, or the
        # allocator kept it for the child's next task
        cause = getattr(exc, "exc", None)
        if not isinstance(cause, BaseException) or not gpu.is_oom(cause):
            raise
        cause.__traceback__ = None  # (its frames hold the run's tensors)
        retry = exc
    except Exception as exc:
        if not gpu.is_oom(exc):
            raise
        oom = str(exc).splitlines()[0][:300]
    # (out of the except clause: its traceback no longer holds the run's tensors)
    gpu.release_memory()
    if retry is not None:
        raise retry.with_traceback(None)
    raise VramLimitExceeded(f"task exceeded the {run.quota.vram_gib:g} GiB VRAM limit of "
                            f"class {run.quota.name!r} running model {run.model!r}: {oom}")


def _account(run: _Run, meta: dict[str, Any], tasks: int, joins: Any, output: Any) -> None:
    """The finished run's service time, joins and first token, counted and traced."""
    joined = joins.joined if joins is not None else 0  # calls that joined the batch
    if not run.prewarm:  # (its run is no service time of the model's)
        run.rt.count(metrics.run_fields(run.model, meta["run_ms"], tasks + joined))
    if joined:
        run.rt.count(metrics.joined_fields(run.quota.name, joined))
    if run.clock.ms is not None:
        run.rt.count(metrics.first_token_fields(run.clock.ms, tasks))
        tracing.annotate({"sits.first_token_ms": run.clock.ms})
    for ms in joins.first_tokens_ms() if joined else ():  # each joined call's own
        run.rt.count(metrics.first_token_fields(ms))
    if isinstance(output, dict) and isinstance(output.get("cached_tokens"), int):
        tracing.annotate({"sits.cached_tokens": output["cached_tokens"]})


def _trace(meta: dict[str, Any], model: str, sla_class: str, start_ns: int,
           end_ns: int) -> None:
    """What the run's span should say (OpenTelemetry, when configured): bounded
    attributes, and a child span for a cold start with its phases."""
    tracing.annotate({"sits.model": model, "sits.sla_class": sla_class,
                      "sits.cold": meta["cold"], "sits.affinity": meta["affinity"]})
    if meta["cold"]:
        tracing.record_span("sits.cold_start", start_ns, end_ns, {
            "sits.model": model, "sits.cold_source": str(meta["source"]),
            **{f"sits.{phase}": float(meta[phase]) for phase in COLD_PHASES}})


# -- the built-in functions ------------------------------------------------------------------

def tokenizer_of(engine: Any, model: str) -> Any:
    tokenizer = getattr(engine, "artifacts", {}).get("tokenizer")
    if tokenizer is None:
        raise ModelLoadError(f"model {model!r} has no tokenizer; built-in text tasks need a "
                             "Hugging Face model directory with one")
    return tokenizer


def module_of(engine: Any, model: str) -> Any:
    module = getattr(engine, "module", None)
    if module is None:
        raise ModelLoadError(f"model {model!r} is a {getattr(engine, 'backend', '?')} engine; "
                             "built-in text tasks need a torch (Hugging Face) model")
    return module


def lm_of(engine: Any, model: str) -> Any:
    """:func:`module_of` for generation: a causal LM (one with an output head), else a
    clear error (an encoder's forward has no logits: an AttributeError mid-decode)."""
    module = module_of(engine, model)
    head = getattr(module, "get_output_embeddings", None)
    if head is None or head() is None:
        raise ModelLoadError(f"model {model!r} ({type(module).__name__}) is not a causal "
                             "language model: it has no output head to generate with")
    if encoder_decoder(module):  # its decoder needs inputs of its own: T5 fails, BART babbles
        raise ModelLoadError(f"model {model!r} ({type(module).__name__}) is an "
                             "encoder-decoder (seq2seq) model; the built-in generation "
                             "decodes causal language models only: call "
                             "engine.module.generate(...) from an @app.inference_task")
    return module


def generate(engine: Any, prompt: str, max_new_tokens: int = 32, temperature: float = 0.0,
             seed: int = 0, stop_at_eos: bool = True) -> dict[str, Any]:
    """Continue ``prompt`` with a causal LM, one token per step through the KV cache.

    Greedy at ``temperature`` 0, else sampled, each position from its own seed (``seed``
    and the position), so a sample does not depend on how the run was cut. Refuses, with
    :class:`ContextTooLong`, a prompt that with ``max_new_tokens`` would pass the
    model's maximum positions. Between steps the soft time limit is checked; when it
    hits, the step's tensors are dropped and ``SoftTimeLimitExceeded`` says how far it got.

    Between steps it is also a yield point (time slices, ``workers/slices.py``): once
    it has run its slice while a task of a heavier class waits, it keeps the tokens so
    far and gives its slot up; the next run re-reads prompt and tokens in one forward
    pass (the KV cache is rebuilt, not shipped) and decodes on. The result is an uncut
    run's up to floating-point rounding: a one-pass prefill and step-by-step decoding
    round differently, so a near-tie between two tokens could go the other way (on CPU
    the tests see identical output). ``runs`` in the result counts the runs it took.
    """
    import torch

    check_prompt(prompt, max_new_tokens, temperature, seed, stop_at_eos)
    model = getattr(engine, "key", "?")
    tokenizer = tokenizer_of(engine, model)
    module = lm_of(engine, model)
    device = next(module.parameters()).device
    ids = prompt_ids(prompt, max_new_tokens, max_positions(module, tokenizer), tokenizer,
                     model)
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    prompt_tokens = len(ids)
    active = runtime.active()
    if active is not None:
        active.check_vram(kv_cache_bytes(module, prompt_tokens + max_new_tokens))
    eos = stop_tokens(module, tokenizer) if stop_at_eos else frozenset()
    progress = resumed(active.checkpoint if active is not None else None, max_new_tokens,
                        int(getattr(module.config, "vocab_size", 0) or 0))
    # A resumed generation's first token came in its first run: report that one.
    if (first := firsttoken.carry(progress.pop("first_token_ms", None))) is not None:
        progress["first_token_ms"] = first
    new: list[int] = progress["new"]
    if new:  # the tokens of earlier runs go in with the prompt: one pass rebuilds the cache
        input_ids = torch.cat([input_ids, torch.tensor([new], device=device)], dim=1)
    prefix = kvreuse.PromptPrefix.looked_up(active, model, input_ids[0].tolist())
    # (of the prompt: a resumed run's store may hold its earlier tokens too, and a
    # result said 176 cached tokens of a 2-token prompt)
    progress["cached_tokens"] = min(prefix.tokens, prompt_tokens)
    decode_steps(module, input_ids, max_new_tokens, eos, float(temperature), int(seed),
                 progress, active, prefix, model=model)
    return generated(tokenizer, new, eos, prompt_tokens=prompt_tokens,
                     cached_tokens=progress["cached_tokens"], runs=progress["runs"])


def embed(engine: Any, texts: str | Sequence[str], normalize: bool = True) -> Any:
    """Mean-pooled (over real tokens) last hidden states; a list per text, L2-normalised.

    A single string gives one vector, a list gives a list of vectors. In a worker, texts
    this child embedded with this model within the TTL come from its embedding cache
    (``cache/embeddings.py``, §4.4) and only the others run through the model, as one
    batch (a cached vector was computed in another batch: equal up to the rounding of
    padding).
    """
    batch = check_texts(texts)
    check_flag("normalize", normalize)
    model = getattr(engine, "key", "?")
    active = runtime.active()
    cache = active.embeddings if active is not None else None

    def compute(todo: list[str]) -> list[list[float]]:
        batcher = active.batcher if active is not None else None
        if batcher is None:
            return _embed_batch(engine, model, todo, normalize, active)
        return _in_batches(batcher, todo,
                           lambda chunk: _embed_batch(engine, model, chunk, normalize, active))

    if cache is None:
        vectors = compute(batch)
    else:
        vectors, hits = cache.embed(model, normalize, batch, compute)
        if active is not None and active.count is not None:
            active.count(metrics.embed_fields(len(batch), hits))
    return vectors[0] if isinstance(texts, str) else vectors


def _in_batches(batcher: Any, items: list[str],
                run: Callable[[list[str]], list[list[float]]]) -> list[list[float]]:
    """``run`` over ``items`` in batches the controller sizes (``batching.py``, §1.2),
    each one timed (and its memory measured on a GPU) and fed back."""
    out: list[list[float]] = []
    start = 0
    while start < len(items):
        size = batcher.size(gpu.free_bytes())
        chunk = items[start:start + size]
        before = gpu.memory_stats()["allocated_bytes"]
        gpu.reset_peak()
        began = time.perf_counter()
        out += run(chunk)
        latency_ms = (time.perf_counter() - began) * _MS_PER_S
        peak = gpu.memory_stats()["peak_allocated_bytes"]
        if len(chunk) == size:  # a short remainder says little about its size
            batcher.record(batching.Sample(size, latency_ms, max(0, peak - before) / size))
        start += len(chunk)
    return out


def _embed_batch(engine: Any, model: str, batch: list[str], normalize: bool,
                 active: runtime.ActiveTask | None) -> list[list[float]]:
    import torch

    module, tokenizer = module_of(engine, model), tokenizer_of(engine, model)
    device = next(module.parameters()).device
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    # On the right whatever the checkpoint says: padded on the left, every position moved
    # and a text's vector depended on the texts batched with it (cosine 0.47, tiny LM).
    limit = max_positions(module, tokenizer)
    for text in batch:
        check_length(f"text {text[:40]!r}", text, limit, tokenizer, model)
    side, tokenizer.padding_side = tokenizer.padding_side, "right"
    try:
        enc = tokenizer(batch, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    for text, kept in zip(batch, enc["attention_mask"].sum(dim=1).tolist(), strict=True):
        # (a text of no tokens pooled to a zero vector, not the unit one promised)
        check_tokens(f"text {text[:40]!r}", int(kept), model)
    length = int(enc["input_ids"].shape[1])
    if limit is not None and length > limit:
        raise ContextTooLong(f"longest text is {length} tokens; model {model!r} takes "
                             f"at most {limit}")
    if active is not None:
        active.check_vram(kv_cache_bytes(module, length * len(batch)))
    enc = {k: v.to(device) for k, v in enc.items()}
    # A causal LM's head gives logits, not states: its body (base_model) gives the last
    # hidden states, as an encoder does (base_model is the module itself there). An
    # encoder-decoder's is its encoder: its base model is both halves (T5's refused
    # inputs with no decoder ones; BART's pooled its decoder's states of the shifted text).
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False) and \
            callable(getattr(module, "get_encoder", None)):
        body = module.get_encoder()
        enc = {k: enc[k] for k in ("input_ids", "attention_mask")}
    else:
        body = getattr(module, "base_model", None) or module
    with torch.inference_mode():
        out = body(**enc)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        if normalize:
            pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
        vectors: list[list[float]] = pooled.float().cpu().tolist()
    return vectors


def prewarm(engine: Any) -> dict[str, Any]:
    """Nothing but getting the engine: the worker loads and warms it up as for any task
    (``sits.prewarm``, sent by the pre-warm planner, ``priority/prewarm.py``)."""
    return {"model": getattr(engine, "key", "?"), "bytes": int(engine.size_bytes())}


#: The built-in tasks' declared roofline intensities (§3.1; a call may give its own),
#: FLOP per byte of weights read, at 2-byte (fp16) weights: a forward pass does 2 FLOP
#: per weight per token in flight. Decoding one row: 1, memory-bound on every GPU (fp16
#: ridge points are 140-400); decoding a batch of 32 rows: 32, still memory-bound; an
#: encoder over a batch (32 texts of ~64 tokens): ~2048, compute-bound everywhere. At
#: fp32 (4-byte weights, ridges of 10-100 on CUDA cores) a call gives its own. Only a
#: fleet of unlike devices reads them (``broker/affinity.py``).
DECODE_FLOP_PER_BYTE = 1.0
BATCH_DECODE_FLOP_PER_BYTE = 32.0
ENCODE_FLOP_PER_BYTE = 2048.0


def register(app: Any) -> dict[str, Any]:
    """``sits.generate``, ``sits.embed`` (a batch task: calls waiting together run as
    one batch) and ``sits.prewarm`` on ``app`` (model per call)."""
    from sits_queue.workers import batchembed, batchgen

    tasks: dict[str, Callable[..., Any]] = {
        "generate": app.inference_task(
            name="sits.generate", shared=False,
            arithmetic_intensity=DECODE_FLOP_PER_BYTE)(generate),
        "embed": app.batch_inference_task(
            name="sits.embed", shared=False, work=batchembed.texts_of,
            arithmetic_intensity=ENCODE_FLOP_PER_BYTE)(batchembed.embed_calls),
        "generate_batched": app.batch_inference_task(
            name="sits.generate_batched", shared=False, joins=True,
            work=batchgen.tokens_asked,
            arithmetic_intensity=BATCH_DECODE_FLOP_PER_BYTE)(batchgen.generate_calls),
        "prewarm": app.inference_task(name=PREWARM_TASK, shared=False)(prewarm),
    }
    return tasks
