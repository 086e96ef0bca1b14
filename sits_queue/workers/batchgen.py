"""``sits.generate_batched``: the continuations of a batch of prompts in one run.

The calls of a batch (``workers/batchmain.py`` gathers them) decode as one left-padded
batch with one KV cache, each row greedy or sampled exactly as ``inference.generate``
decodes it alone. A row leaves the batch at its own ``max_new_tokens`` or
end-of-sequence token, its KV rows dropped, so the steps after it cost only the rows
still going (Hugging Face ``generate`` runs every row until the longest one is done).

Offline prompts mostly start with one of a few instruction templates. Prefilling a
template once per batch instead of once per row is most of a short generation's work,
so the rows are grouped by the prompt start they share (:func:`prefix_groups`: a
template's rows together, even when the batch mixes templates), each group's start is
prefilled once, after the part the child's KV-prefix store already holds, and stored for
later batches; every row then goes on from its group's KV in one batch::

    row  | pad | template A's KV (prefilled once)  | pad | own tokens ->
    row  |        template B's KV (once)           | pad | own tokens ->
    row  |            (no shared start)        pad       | own tokens ->

Padding is masked out and positions count real tokens only, so each row decodes what it
would alone (tested token for token, greedy and sampled). A batch of one runs
``inference.generate``'s own decode loop (which also yields between steps for a plain
``sits.generate``; a batch never does).
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sits_queue.cache import kvwarm
from sits_queue.errors import InferenceError, InvalidInput, VramLimitExceeded
from sits_queue.workers import decoding, inference, inputs, kvreuse, runtime
from sits_queue.workers.batchdecode import Decoding
from sits_queue.workers.batched import Call, arguments

if TYPE_CHECKING:
    from sits_queue.workers.batchjoin import Joining

#: Shortest token prefix the prompts of a group must share for it to be prefilled once
#: for all of them: one KV-prefix block, the least the store keeps (a shorter common
#: start stays in the batch's own prefill).
SHARE_MIN_TOKENS = 16


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


def tokens_asked(*args: Any, **kwargs: Any) -> float:
    """A call's share of a batch's time (``batchtime.py``): the tokens it asks for (its
    rows leave the batch when done, so a batch's decode steps add up its rows' tokens).
    Arguments that do not bind count as the default: the call fails on its own."""
    default = _GENERATE.parameters["max_new_tokens"].default
    try:
        asked = _GENERATE.bind(None, *args, **kwargs).arguments.get("max_new_tokens", default)
    except TypeError:
        asked = default
    return float(asked if isinstance(asked, int) and asked > 0 else default)


@dataclass(frozen=True)
class _Row:
    """One call of a generation batch: where its output goes, its prompt's token ids and
    how it decodes."""

    index: int
    ids: list[int]
    most: int
    temperature: float
    seed: int
    #: Its call's ``prefix_key``: what the KV its prompt's start stores is tagged with.
    tag: str | None = None


def generate_calls(engine: Any, calls: list[Call], *, share_prefix: bool = True
                   ) -> list[Any]:
    """Continuations of every call's prompt as one batch (the module's docstring): what
    ``inference.generate`` decodes for each prompt alone, as ``{"text", "tokens",
    "prompt_tokens", "cached_tokens", "shared_tokens", "stopped", "runs": 1}``
    (``shared_tokens``: the length of the prompt start the row's group prefilled once;
    ``cached_tokens``: the part of it that came from the KV-prefix store; a batch of one
    shares nothing, though the store still serves its prompt's start).

    No time slices (``sits.generate``'s); a call with bad arguments or a prompt the model
    cannot take fails alone. ``share_prefix`` False prefills every row in full (what
    ``sitsq bench coalesce`` compares with)."""
    from sits_queue.workers import batchjoin

    model = getattr(engine, "key", "?")
    module, tokenizer = inference.lm_of(engine, model), inference.tokenizer_of(engine, model)
    limit = kvwarm.max_positions(module, tokenizer)
    active = runtime.active()
    outputs: list[Any] = [None] * len(calls)
    groups: dict[bool, list[_Row]] = {}
    for i, call in enumerate(calls):
        parsed = _parse(engine, tokenizer, model, limit, i, call)
        if isinstance(parsed, InferenceError):
            outputs[i] = parsed
        else:
            groups.setdefault(parsed[0], []).append(parsed[1])

    def send(i: int, out: Any) -> None:
        """Call ``i`` is done: in a worker its result is stored now (once: a call
        delivered already is not again), while the rest of the batch goes on."""
        if active is not None:
            active.deliver(i, out)

    if groups:  # the failed calls fail now, not after the rest
        for i, out in enumerate(outputs):
            if out is not None:
                send(i, out)
    runs: list[tuple[bool, list[_Row], bool]] = []
    for stop, rows in groups.items():
        fitted, too_big = _fitted(module, rows, active)
        for index, error in too_big.items():
            outputs[index] = error
            send(index, error)
        # a group split to fit its class runs unshared: the narrowest layouts
        runs += [(stop, part, share_prefix and len(fitted) == 1) for part in fitted]
    for n, (stop, rows, share) in enumerate(runs, 1):
        # Only the last run takes joining rows: the others wait for it.
        joining = batchjoin.joining_for(engine, tokenizer, model, limit, stop, send) \
            if n == len(runs) else None
        for row, out in zip(rows, _generate_rows(module, tokenizer, model, rows, stop,
                                                 share, send, joining), strict=True):
            outputs[row.index] = out
            if n < len(runs):  # another run goes next
                send(row.index, out)
    return outputs


def _fitted(module: Any, rows: list[_Row], active: runtime.ActiveTask | None
            ) -> tuple[list[list[_Row]], dict[int, InferenceError]]:
    """The group as runs whose estimated working memory fits the class (where the class
    is enforced by estimate: off CUDA; there the allocator's cap decides): one run when
    the rows fit together, as they almost always do. Else rows run in as few runs as
    fit (shortest first), and a row too big even alone fails alone, with its
    ``VramLimitExceeded`` — not every call of the batch for one long ``max_new_tokens``."""
    if active is None:
        return [rows], {}

    def fits(part: list[_Row]) -> VramLimitExceeded | None:
        width = max(len(r.ids) for r in part) + max(r.most for r in part)
        try:
            active.check_vram(decoding.kv_cache_bytes(module, width * len(part)))
        except VramLimitExceeded as exc:
            return exc
        return None

    if fits(rows) is None:
        return [rows], {}
    runs: list[list[_Row]] = []
    failed: dict[int, InferenceError] = {}
    part: list[_Row] = []
    for row in sorted(rows, key=lambda r: (len(r.ids) + r.most, r.index)):
        if (alone := fits([row])) is not None:
            failed[row.index] = alone
            continue
        if part and fits([*part, row]) is not None:
            runs.append(part)
            part = []
        part.append(row)
    return [*runs, part] if part else runs, failed


def _parse(engine: Any, tokenizer: Any, model: str, limit: int | None, index: int,
           call: Call) -> tuple[bool, _Row] | InferenceError:
    """Call ``index`` as a row of the batch, with whether it stops at end-of-sequence;
    or the error that fails it alone (bad arguments, a prompt the model cannot take)."""
    args = arguments(_GENERATE, "sits.generate_batched", engine, call)
    if isinstance(args, InvalidInput):
        return args
    prompt, most = args["prompt"], args["max_new_tokens"]
    try:
        inputs.check_prompt(prompt, most, args["temperature"], args["seed"],
                            args["stop_at_eos"])
        ids = inputs.prompt_ids(prompt, most, limit, tokenizer, model)
    except InferenceError as exc:
        return exc
    return args["stop_at_eos"], _Row(index, ids, most, float(args["temperature"]),
                                     int(args["seed"]), call.prefix_key)


# -- which rows share what (pure) ------------------------------------------------------------

def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens ``a`` and ``b`` start with alike, leaving each at least one of its own (a
    row needs one position past its prefix to give logits)."""
    most = min(len(a), len(b)) - 1
    n = 0
    while n < most and a[n] == b[n]:
        n += 1
    return max(n, 0)


def prefix_groups(prompts: Sequence[Sequence[int]], least: int = SHARE_MIN_TOKENS
                  ) -> list[tuple[tuple[int, ...], int]]:
    """The rows of a batch grouped to prefill each shared prompt start once: ``(row
    indices, shared tokens)`` per group, every row in one group.

    Chosen to save the most prefill: a group of ``n`` rows sharing ``p`` tokens saves
    ``(n - 1) * p``, so two templates that begin with the same preamble make two groups
    (each sharing its whole template), not one sharing the preamble. A group shares at
    least ``least`` tokens; a row that shares fewer with every other is a group of its
    own sharing 0. Sorted, prompts that share a start are neighbours, and a set of
    neighbours shares the least of its adjacent common starts: the best grouping of a
    run either keeps it whole or splits it where that least one is (recursively)."""
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    common = [_common(prompts[a], prompts[b]) for a, b in itertools.pairwise(order)]

    def best(lo: int, hi: int) -> tuple[int, list[tuple[tuple[int, ...], int]]]:
        # rows order[lo..hi]; common[lo..hi-1] between neighbours
        if lo == hi:
            return 0, [((order[lo],), 0)]
        least_common = min(common[lo:hi])
        saved, parts, start = 0, [], lo
        for k in [*(k for k in range(lo, hi) if common[k] == least_common), hi]:
            got, groups = best(start, k)
            saved, start = saved + got, k + 1
            parts.extend(groups)
        whole = (hi - lo) * least_common
        if least_common >= least and whole >= saved:
            return whole, [(tuple(sorted(order[lo:hi + 1])), least_common)]
        return saved, parts

    if not prompts:
        return []
    return sorted(best(0, len(order) - 1)[1])


# -- the batch ---------------------------------------------------------------------------------

def _generate_rows(module: Any, tokenizer: Any, model: str, rows: list[_Row], stop: bool,
                   share: bool, send: Callable[[int, Any], None],
                   joining: Joining | None = None) -> list[dict[str, Any]]:
    """The batch's rows decoded (the module's description); rows that join it on the
    way (``joining``) are sent as they finish, the batch's own are returned. A lone row
    decodes through ``inference.generate``'s loop unless rows may join it."""
    import torch

    longest = max(row.most for row in rows)
    active = runtime.active()
    eos = getattr(tokenizer, "eos_token_id", None)
    # the tokens a row stops at
    end = decoding.stop_tokens(module, tokenizer) if stop else frozenset()
    groups, shared = _plan([row.ids for row in rows]) if share and len(rows) > 1 \
        else ([], [0] * len(rows))
    if active is not None:
        try:
            active.check_vram(decoding.kv_cache_bytes(
                module, (_width(rows, shared) + longest) * len(rows)))
        except VramLimitExceeded:
            if not any(shared):
                raise
            # The shared layout can be wider than the widest row (the longest shared
            # start plus the longest own part): where it does not fit and the plain one,
            # which _fitted sized the run by, does, the rows go unshared
            groups, shared = [], [0] * len(rows)
            active.check_vram(decoding.kv_cache_bytes(
                module, (_width(rows, shared) + longest) * len(rows)))
    lone = len(rows) == 1
    if lone and joining is None:
        return [_generate_alone(module, tokenizer, model, rows[0], end, active)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    past, cached, first = None, [0] * len(rows), None
    if lone and joining is not None:  # one row others may join: prefilled as theirs are
        prefilled = joining.prefill([rows[0]], None)
        if prefilled is None:
            return [_generate_alone(module, tokenizer, model, rows[0], end, active)]
        past, _, (first,), ((_, cached[0]),) = prefilled
        input_ids = torch.tensor([[*rows[0].ids, first]], dtype=torch.long)
        mask = torch.ones_like(input_ids)
        if rows[0].most <= 1 or first in end:  # done at its first token
            return [{**decoding.generated(tokenizer, [first], end,
                                           prompt_tokens=len(rows[0].ids),
                                           cached_tokens=cached[0], runs=1),
                     "shared_tokens": 0}]
    elif groups:
        past, cached = _prefix_cache(module, model, rows, groups, active)
        if past is None:
            shared = [0] * len(rows)
    if not lone:
        input_ids, mask = _layout(rows, shared, pad)

    own = len(rows)  # the batch's own rows; any after them joined it on the way
    rows = list(rows)

    def result(r: int, new: list[int]) -> dict[str, Any]:
        # (shared tokens, tokens from the KV-prefix store): a joined row's, as it joined
        row_shared, row_cached = (shared[r], cached[r]) if r < own \
            else joining.starts[rows[r].index] if joining is not None else (0, 0)
        return {**decoding.generated(tokenizer, new, end, prompt_tokens=len(rows[r].ids),
                                      cached_tokens=row_cached, runs=1),
                "shared_tokens": row_shared}

    left: dict[int, dict[str, Any]] = {}  # the rows that left before the last ones

    def leave(r: int, new: list[int]) -> None:
        left[r] = result(r, new)
        send(rows[r].index, left[r])

    news = Decoding(module, model, rows, input_ids, mask, past,
                    (len(rows[0].ids) if lone else max(shared)) if past is not None else 0,
                    end, active, leave, joining, first).run()
    for r in range(own, len(rows)):  # joined rows still going at the end
        if r not in left:
            leave(r, news[r])
    return [left[r] if r in left else result(r, new) for r, new in enumerate(news[:own])]


def _plan(prompts: list[list[int]]
          ) -> tuple[list[tuple[tuple[int, ...], int]], list[int]]:
    """The groups worth prefilling once and each row's shared tokens, or none (all 0)
    when the padded layout would cost more prefill than it saves (rows with no shared
    start are padded to the longest start's width: prefilled tokens, all rows' own parts
    padded alike, against every row in full)."""
    nothing: tuple[list[tuple[tuple[int, ...], int]], list[int]] = ([], [0] * len(prompts))
    groups = [(rows, n) for rows, n in prefix_groups(prompts) if n > 0]
    if not groups:
        return nothing
    shares = _shares(groups, len(prompts))
    own = max(len(p) - s for p, s in zip(prompts, shares, strict=True))
    grouped = sum(n for _, n in groups) + len(prompts) * own
    worth = grouped < len(prompts) * max(len(p) for p in prompts)
    return (groups, shares) if worth else nothing


def _shares(groups: list[tuple[tuple[int, ...], int]], n_rows: int) -> list[int]:
    shares = [0] * n_rows
    for rows, n in groups:
        for r in rows:
            shares[r] = n
    return shares


def _width(rows: list[_Row], shared: list[int]) -> int:
    """Positions of the batch's layout (:func:`_layout`)."""
    return max(shared) + max(len(row.ids) - s for row, s in zip(rows, shared, strict=True))


def _layout(rows: list[_Row], shared: list[int], pad: int) -> tuple[Any, Any]:
    """Token ids and attention mask of a batch: each row's shared start ends where the
    longest one does, and each row's own tokens end together (left padding before each
    part, masked out; positions count only real tokens)."""
    import torch

    start = max(shared)
    input_ids = torch.full((len(rows), _width(rows, shared)), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for r, (row, n) in enumerate(zip(rows, shared, strict=True)):
        rest = row.ids[n:]
        input_ids[r, start - n:start] = torch.tensor(row.ids[:n], dtype=torch.long)
        mask[r, start - n:start] = 1
        input_ids[r, input_ids.shape[1] - len(rest):] = torch.tensor(rest, dtype=torch.long)
        mask[r, input_ids.shape[1] - len(rest):] = 1
    return input_ids, mask


def _prefix_cache(module: Any, model: str, rows: list[_Row],
                  groups: list[tuple[tuple[int, ...], int]],
                  active: runtime.ActiveTask | None) -> tuple[Any, list[int]]:
    """The batch's KV cache of its groups' shared starts, each prefilled once and placed
    in its rows right-aligned (zeros before, masked out), with each row's tokens that
    came from the KV-prefix store; (None, zeros) for a model whose cache cannot be
    shared (sliding-window, recurrent)."""
    import torch

    cached = [0] * len(rows)
    prefilled = []
    for members, n in groups:
        first = rows[members[0]]
        cache, from_store = _group_cache(module, model, first.ids[:n], active, first.tag)
        if cache is None:
            return None, [0] * len(rows)
        prefilled.append((cache, list(members)))
        for r in members:
            cached[r] = from_store
    width = max(n for _, n in groups)
    first = prefilled[0][0]
    memo: dict[int, Any] = {}
    with torch.inference_mode():
        for i, layer in enumerate(first.layers):
            for name in ("keys", "values"):
                like = getattr(layer, name)
                batch = like.new_zeros((len(rows), like.shape[1], width, like.shape[3]))
                for cache, placed in prefilled:
                    part = getattr(cache.layers[i], name)
                    batch[placed, :, width - part.shape[-2]:, :] = part
                # deepcopy consults the memo first: the batch's tensor stands in for it
                memo[id(like)] = batch
        return copy.deepcopy(first, memo), cached


def _group_cache(module: Any, model: str, tokens: list[int],
                 active: runtime.ActiveTask | None, tag: str | None) -> tuple[Any, int]:
    """One group's shared start as a one-row KV cache, prefilled after the longest part
    the child's KV-prefix store holds (which then keeps it for later batches and
    generations); with the tokens that came from the store. (None, 0) when the model's
    cache cannot be reused."""
    import torch

    prefix = kvreuse.PromptPrefix.looked_up(active, model, tokens, tag)
    device = next(module.parameters()).device
    with torch.inference_mode():
        out = module(input_ids=torch.tensor([tokens[prefix.tokens:]], device=device),
                     attention_mask=torch.ones((1, len(tokens)), dtype=torch.long,
                                               device=device),
                     use_cache=True, **{kvwarm.cache_kwarg(module): prefix.start})
    cache = kvwarm.cache_of(out)
    if not kvreuse.reusable(cache):
        return None, 0
    prefix.after_prefill(cache)
    return cache, prefix.tokens


def _generate_alone(module: Any, tokenizer: Any, model: str, row: _Row, eos: frozenset[int],
                    active: runtime.ActiveTask | None) -> dict[str, Any]:
    """A batch of one: ``inference.generate``'s own decode loop, from the longest start
    of its prompt the child's KV-prefix store holds (a batch of one has no group to
    prefill once), with its soft-limit check between steps. Never yields: a batch task
    does not resume from a checkpoint."""
    import torch

    device = next(module.parameters()).device
    unsliced = replace(active, yielder=None) if active is not None else None
    prefix = kvreuse.PromptPrefix.looked_up(unsliced, model, row.ids, row.tag)
    progress: dict[str, Any] = {"new": [], "runs": 1}
    decoding.decode_steps(module, torch.tensor([row.ids], device=device), row.most, eos,
                           row.temperature, row.seed, progress, unsliced, prefix, model=model)
    return {**decoding.generated(tokenizer, progress["new"], eos, prompt_tokens=len(row.ids),
                                  cached_tokens=prefix.tokens, runs=1),
            "shared_tokens": 0}
