"""Rows that join a running generation batch (continuous batching; the Redis side and
the rules are ``joins.py``, the batch's decode loop ``batchdecode.py``): which waiting calls
join, and their prefill, together, as a batch of their own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sits_queue.cache import kvwarm
from sits_queue.errors import InferenceError
from sits_queue.workers import (
    batchdecode,
    batchgen,
    decoding,
    firsttoken,
    gpu,
    inference,
    kvreuse,
    runtime,
)
from sits_queue.workers.batchgen import _Row

#: Joining rows prefilled: their KV cache, its attention mask, each row's first token and
#: (shared tokens, tokens from the KV-prefix store).
Prefilled = tuple[Any, Any, list[int], list[tuple[int, int]]]


@dataclass
class Joining:
    """Rows that join a running batch (continuous batching, ``workers/joins.py``):
    ``take(room, step_s)`` gives up to ``room`` rows that fit before the run's limits at
    ``step_s`` seconds a decode step, ``decline(row)`` hands back one that cannot join
    after all (it runs after this batch), ``prefill`` prefills rows that join, and
    ``starts`` records how each joined call's prompt start was prefilled."""

    take: Callable[[int, float], list[_Row]]
    decline: Callable[[_Row], None]
    #: ``prefill(rows, generator)``: :func:`prefill_rows` on the batch's model.
    prefill: Callable[[list[_Row], Any], Prefilled | None]
    #: Each joined call's (shared tokens, tokens from the KV-prefix store).
    starts: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: ``first(index)``: joined call ``index`` has its first new token (its own timing).
    first: Callable[[int], None] = lambda index: None


def joining_for(engine: Any, tokenizer: Any, model: str, limit: int | None, stop: bool,
             send: Callable[[int, Any], None]) -> Joining | None:
    """What a batch takes joining rows from: the running task's feed (``workers/joins.py``,
    in a worker that runs continuous batches), or None. A joining call with bad arguments
    fails at once; one that stops otherwise than the batch (``stop_at_eos``), would not
    finish before the run's limits, or whose KV cache (twice over: the merge copies) the
    device's memory under the class cap cannot take now is declined (it runs after this
    batch, which must not run out of memory for it)."""
    active = runtime.active()
    feed = active.joins if active is not None else None
    if feed is None:
        return None
    module = inference.module_of(engine, model)

    def take(live: int, step_s: float) -> list[_Row]:
        rows = []
        budget = gpu.free_bytes()  # None on a CPU
        for index, call in feed.take(live):
            parsed = batchgen._parse(engine, tokenizer, model, limit, index, call)
            if isinstance(parsed, InferenceError):
                send(index, parsed)
                continue
            row = parsed[1]
            cost = 2 * decoding.kv_cache_bytes(module, len(row.ids) + row.most)
            if parsed[0] != stop or not feed.fits(row.most, step_s) or (
                    budget is not None and cost > budget):
                feed.decline(index)
                continue
            budget = budget - cost if budget is not None else None
            rows.append(row)
        return rows

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        getattr(tokenizer, "eos_token_id", None) or 0)
    return Joining(take, lambda row: feed.decline(row.index),
                   lambda rows, generator: prefill_rows(module, model, rows, generator,
                                                        active, pad),
                   first=feed.first_token)


def _prefill_row(module: Any, model: str, row: _Row, generator: Any,
                 active: runtime.ActiveTask | None) -> tuple[Any, int, int] | None:
    """A joining row's prompt prefilled alone, after the part of it the child's KV-prefix
    store holds: its one-row KV cache, its first token (chosen as the batch chooses) and
    the tokens that came from the store. None when it cannot join: a cache that is not a
    plain one per layer, or no device memory left for it (freed again)."""
    import torch

    device = next(module.parameters()).device
    prefix = kvreuse.PromptPrefix.looked_up(active, model, row.ids, row.tag)
    prefilled = _prefill(module, input_ids=torch.tensor([row.ids[prefix.tokens:]],
                                                        device=device),
                         attention_mask=torch.ones((1, len(row.ids)), dtype=torch.long,
                                                   device=device),
                         **{kvwarm.cache_kwarg(module): prefix.start})
    if prefilled is None:
        return None
    cache, logits = prefilled
    prefix.after_prefill(cache)
    first = (decoding.sampled(logits, row.temperature, row.seed, 0, generator)
             if row.temperature > 0 else int(torch.argmax(logits, dim=-1).item()))
    firsttoken.mark()  # a lone row's first token (the batch's came before a joining one's)
    return cache, first, prefix.tokens


def prefill_rows(module: Any, model: str, rows: list[_Row], generator: Any,
                  active: runtime.ActiveTask | None, pad: int
                  ) -> Prefilled | None:
    """Rows joining a batch, prefilled together as a batch of their own (the shared
    starts of those that share one prefilled once, as a batch's are; one row alone from
    the KV-prefix store): their KV cache, its attention mask, each row's first token and
    (shared tokens, tokens from the store). None when they cannot join (a cache that is
    not a plain one per layer, or no device memory for them: freed again)."""
    import torch

    device = next(module.parameters()).device
    if generator is None:  # a lone row's, before its batch loop made one
        generator = torch.Generator(device="cpu")
    if len(rows) == 1:
        one = _prefill_row(module, model, rows[0], generator, active)
        if one is None:
            return None
        return (one[0], torch.ones((1, len(rows[0].ids)), dtype=torch.long, device=device),
                [one[1]], [(0, one[2])])
    groups, shared = batchgen._plan([row.ids for row in rows])
    past, cached = None, [0] * len(rows)
    if groups:
        past, cached = batchgen._prefix_cache(module, model, rows, groups, active)
        if past is None:
            shared = [0] * len(rows)
    input_ids, mask = batchgen._layout(rows, shared, pad)
    start = max(shared) if past is not None else 0
    mask = mask.to(device)
    extra = {"position_ids": batchdecode.positions_of(mask)[:, start:]} \
        if batchdecode.takes_positions(module) else {}
    prefilled = _prefill(module, input_ids=input_ids[:, start:].to(device), attention_mask=mask,
                         **{kvwarm.cache_kwarg(module): past}, **extra)
    if prefilled is None:
        return None
    cache, logits = prefilled
    firsts = torch.argmax(logits, dim=-1).tolist()
    for b, row in enumerate(rows):
        if row.temperature > 0:
            firsts[b] = decoding.sampled(logits[b:b + 1], row.temperature, row.seed, 0,
                                          generator)
    return cache, mask, firsts, list(zip(shared, cached, strict=True))


def _prefill(module: Any, **inputs: Any) -> tuple[Any, Any] | None:
    """One prefill forward of joining rows: their KV cache and last logits; None when the
    cache is not a plain one per layer, or the device ran out of memory (freed again)."""
    import torch

    try:
        with torch.inference_mode():
            out = module(use_cache=True, **inputs)
    except Exception as exc:
        if not gpu.is_oom(exc):
            raise
        gpu.release_memory()
        return None
    cache = kvwarm.cache_of(out)
    if not kvreuse.reusable(cache):
        return None
    return cache, out.logits[:, -1, :].float()
