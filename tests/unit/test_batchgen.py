"""Generation batches (``workers/batchgen.py``): how rows are grouped by the prompt
start they share (pure), and batches on a tiny real model that prefill each group's
start once, take it from the KV-prefix store next time, and decode every row exactly as
it would alone."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from sits_queue.cache.prefix import PrefixStore
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidInput, VramLimitExceeded
from sits_queue.workers import batchgen, decoding, inference, kvreuse, metrics
from sits_queue.workers import runtime as rt
from sits_queue.workers.batched import Call
from sits_queue.workers.batchgen import SHARE_MIN_TOKENS, generate_calls, prefix_groups
from sits_queue.workers.limits import BYTES_PER_GIB

# -- grouping (pure) ----------------------------------------------------------------------------

A = list(range(100, 100 + SHARE_MIN_TOKENS + 4))
B = list(range(300, 300 + SHARE_MIN_TOKENS + 30))


def test_one_template_is_one_group_sharing_all_of_it() -> None:
    assert prefix_groups([[*A, 1, 2], [*A, 3], [*A, 1, 9]]) == [((0, 1, 2), len(A))]


def test_a_batch_mixing_templates_makes_a_group_of_each() -> None:
    prompts = [[*A, 1], [*B, 1], [*A, 2], [7, 8, 9], [*B, 2, 3], [*A, 3]]
    assert prefix_groups(prompts) == [((0, 2, 5), len(A)), ((1, 4), len(B)), ((3,), 0)]


def test_a_group_never_shares_a_whole_prompt() -> None:
    # one prompt is the template itself, or two are the same: each keeps a token of its own
    assert prefix_groups([A, [*A, 5]]) == [((0, 1), len(A) - 1)]
    assert prefix_groups([[*A, 5], [*A, 5]]) == [((0, 1), len(A))]


def test_templates_under_a_common_preamble_are_grouped_to_save_the_most() -> None:
    preamble = list(range(500, 500 + SHARE_MIN_TOKENS + 4))
    long_a, long_b = [*preamble, *range(40)], [*preamble, *range(50, 90)]
    # two rows of each long template: two groups sharing the templates beat one sharing
    # the preamble ((2-1)*60 * 2 = 120 saved, against (4-1)*20 = 60)
    assert prefix_groups([[*long_a, 1], [*long_b, 1], [*long_a, 2], [*long_b, 2]]) == [
        ((0, 2), len(long_a)), ((1, 3), len(long_b))]
    # templates that differ by a token each, under a long preamble, share the preamble
    rows = [[*preamble, t, i] for t in (1, 2, 3) for i in (0, 1)]
    assert prefix_groups(rows) == [((0, 1, 2, 3, 4, 5), len(preamble))]


def test_short_common_starts_are_not_shared() -> None:
    short = A[:SHARE_MIN_TOKENS - 1]
    assert prefix_groups([[*short, 1], [*short, 2]]) == [((0,), 0), ((1,), 0)]
    assert prefix_groups([[1, 2, 3, *A], [4, *A]]) == [((0,), 0), ((1,), 0)]
    assert prefix_groups([[*A, 1]]) == [((0,), 0)]  # one row shares with no one
    assert prefix_groups([]) == []


def test_every_row_lands_in_exactly_one_group() -> None:
    import random

    rng = random.Random(3)
    templates = [[rng.randrange(50) for _ in range(rng.randint(10, 40))] for _ in range(5)]
    prompts = [[*rng.choice(templates), *(rng.randrange(50) for _ in range(rng.randint(1, 9)))]
               for _ in range(64)]
    groups = prefix_groups(prompts)
    assert sorted(r for rows, _ in groups for r in rows) == list(range(64))
    for rows, n in groups:
        assert n == 0 or n >= SHARE_MIN_TOKENS
        assert all(prompts[r][:n] == prompts[rows[0]][:n] and len(prompts[r]) > n
                   for r in rows)


# -- batches on a tiny real model ---------------------------------------------------------------

SHARED = ("you are a careful summariser of operations logs. keep every number. "
          "answer in one line. ") * 2
OTHER = ("translate the following status line into plain words for a reader who does "
         "not run the cluster, briefly. ") * 2
ITEMS = ["disk 3 is full", "node 7 rebooted twice", "ok", "latency is up by a fifth"]


def generate_batch(lm: Any, prompts: list[str], store: PrefixStore | None = None,
                   counts: dict[str, float] | None = None) -> list[Any]:
    calls = [Call(str(i), (p,), {"max_new_tokens": 6, "stop_at_eos": False,
                                 "temperature": 1.3 if i % 2 else 0.0, "seed": i})
             for i, p in enumerate(prompts)]
    seen = counts if counts is not None else {}
    active = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu",
                           prefixes=store, count=lambda f: metrics.merge(seen, f))
    with rt.activated(active):
        return generate_calls(lm, calls)


def alone(lm: Any, prompts: list[str]) -> list[dict[str, Any]]:
    return [inference.generate(lm, p, max_new_tokens=6, stop_at_eos=False,
                               temperature=1.3 if i % 2 else 0.0, seed=i)
            for i, p in enumerate(prompts)]


def forwards_of(lm: Any, run: Any) -> tuple[Any, list[tuple[int, int]]]:
    seen: list[tuple[int, int]] = []
    handle = lm.module.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        return run(), seen
    finally:
        handle.remove()


def test_a_batch_prefills_its_shared_template_once_and_decodes_as_each_alone(
        lm: Any) -> None:
    prompts = [SHARED + item for item in ITEMS]
    got, forwards = forwards_of(lm, lambda: generate_batch(lm, prompts))
    shared = got[0]["shared_tokens"]
    # The template's tokens, once, for one row; then every row goes on from there
    assert shared >= 16 and forwards[0] == (1, shared)
    assert forwards[1][0] == len(prompts) and forwards[1][1] < max(
        g["prompt_tokens"] for g in got)
    for prompt, out, one in zip(prompts, got, alone(lm, prompts), strict=True):
        assert out == {**one, "shared_tokens": shared}, prompt


def test_a_batch_mixing_templates_prefills_each_once_and_decodes_as_each_alone(
        lm: Any) -> None:
    prompts = [SHARED + ITEMS[0], OTHER + ITEMS[1], SHARED + ITEMS[2], "a short one",
               OTHER + ITEMS[3], SHARED + ITEMS[1]]
    got, forwards = forwards_of(lm, lambda: generate_batch(lm, prompts))
    on_shared, on_other = got[0]["shared_tokens"], got[1]["shared_tokens"]
    assert on_shared >= 16 and on_other >= 16 and on_shared != on_other
    assert [g["shared_tokens"] for g in got] == [on_shared, on_other, on_shared, 0,
                                                 on_other, on_shared]
    # each template once, for one row, then the whole batch from its own tokens on
    assert sorted(forwards[:2]) == sorted([(1, on_shared), (1, on_other)])
    assert forwards[2][0] == len(prompts)
    assert forwards[2][1] == max(g["prompt_tokens"] - g["shared_tokens"] for g in got)
    for prompt, out, one in zip(prompts, got, alone(lm, prompts), strict=True):
        assert out == {**one, "shared_tokens": out["shared_tokens"]}, prompt


def test_the_same_prompt_sampled_with_several_seeds_shares_all_but_its_last_token(
        lm: Any) -> None:
    prompts = [SHARED + ITEMS[1]] * 4  # rows 1 and 3 sampled, each with its own seed
    got = generate_batch(lm, prompts)
    assert {g["shared_tokens"] for g in got} == {got[0]["prompt_tokens"] - 1}
    for prompt, out, one in zip(prompts, got, alone(lm, prompts), strict=True):
        assert out == {**one, "shared_tokens": out["shared_tokens"]}, prompt
    assert got[1]["text"] != got[3]["text"]  # the seeds are used


def test_the_next_batch_takes_each_template_from_the_kv_prefix_store(lm: Any) -> None:
    store, counts = PrefixStore(2**26), {}
    first = generate_batch(lm, [SHARED + ITEMS[0], OTHER + ITEMS[0], SHARED + ITEMS[1],
                                OTHER + ITEMS[1]], store, counts)
    assert all(g["cached_tokens"] == 0 for g in first) and len(store) == 2
    prompts = [SHARED + ITEMS[2], OTHER + ITEMS[2], SHARED + ITEMS[3], OTHER + ITEMS[3]]
    second = generate_batch(lm, prompts, store, counts)
    for g in second:
        assert 16 <= g["cached_tokens"] <= g["shared_tokens"]
        assert g["cached_tokens"] % store.block == 0
    assert counts["kv_lookups"] == 4 and counts["kv_hits"] == 2
    plain = generate_batch(lm, prompts)  # no store: the same outputs
    assert [{**g, "cached_tokens": 0} for g in second] == plain


def test_a_model_whose_kv_cache_cannot_be_reused_batches_without_sharing(
        lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # a sliding-window or recurrent cache cannot be cut and placed: every row in full
    monkeypatch.setattr(kvreuse, "reusable", lambda _cache: False)
    prompts = [SHARED + item for item in ITEMS]
    got = generate_batch(lm, prompts, PrefixStore(2**26))
    assert all(g["shared_tokens"] == 0 and g["cached_tokens"] == 0 for g in got)
    for prompt, out, one in zip(prompts, got, alone(lm, prompts), strict=True):
        assert out == {**one, "shared_tokens": 0}, prompt


def test_prompts_with_nothing_in_common_batch_without_sharing(lm: Any) -> None:
    got = generate_batch(lm, ["the queue", "a model serves the"])
    assert all(g["shared_tokens"] == 0 and g["cached_tokens"] == 0 for g in got)


def test_a_row_far_longer_than_the_shared_ones_is_batched_without_sharing(lm: Any) -> None:
    # Sharing would pad every row's own part to the long row's length after the template:
    # more prefill than it saves, so the batch prefills each row in full instead
    long = "the worker loads a model and warms it up before the first task. " * 3
    prompts = [SHARED + "a", SHARED + "b", long]
    got, forwards = forwards_of(lm, lambda: generate_batch(lm, prompts))
    assert [g["shared_tokens"] for g in got] == [0, 0, 0]
    assert forwards[0] == (3, max(g["prompt_tokens"] for g in got))
    for prompt, out, one in zip(prompts, got, alone(lm, prompts), strict=True):
        assert out == {**one, "shared_tokens": 0}, prompt


def test_each_template_is_advertised_under_its_own_tasks_prefix_key(lm: Any) -> None:
    """A batch runs as its first task: every prefix it stored was tagged with that task's
    key, so workers holding template B's KV never drew B's tasks by affinity."""
    store = PrefixStore(2**26)
    prompts = [SHARED + ITEMS[0], OTHER + ITEMS[1], OTHER + ITEMS[2], SHARED + ITEMS[3]]
    tags = ["key-shared", "key-other", "key-other", "key-shared"]
    calls = [Call(str(i), (p,), {"max_new_tokens": 2}, tag)
             for i, (p, tag) in enumerate(zip(prompts, tags, strict=True))]
    active = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu",
                           prefixes=store, prefix_key="key-shared")  # the first task's
    with rt.activated(active):
        generate_calls(lm, calls)
    assert len(store) == 2 and set(store.tags()) == {"key-shared", "key-other"}
    # and a batch of one, alone, tags with its own call's key too
    with rt.activated(active):
        generate_calls(lm, [Call("9", ("entirely new words " * 8,), {"max_new_tokens": 2},
                                 "key-lone")])
    assert "key-lone" in store.tags()


def test_a_batch_of_one_decodes_alone_from_the_store_and_never_yields(lm: Any) -> None:
    store = PrefixStore(2**26)
    generate_batch(lm, [SHARED + item for item in ITEMS[:2]], store)  # stores the template

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("a batch of one went through Hugging Face generate()")

    def yielded(_state: Any, _remaining_s: float | None) -> None:
        raise AssertionError("a batch task yielded: it cannot resume from a checkpoint")

    call = Call("0", (SHARED + "one more line",), {
        "max_new_tokens": 6, "stop_at_eos": False, "temperature": 1.3, "seed": 3})
    active = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu",
                           prefixes=store, yielder=yielded)
    lm.module.generate = refuse
    try:
        with rt.activated(active):
            out = generate_calls(lm, [call])[0]
    finally:
        del lm.module.generate
    assert out["cached_tokens"] >= 16 and out["shared_tokens"] == 0
    one = inference.generate(lm, SHARED + "one more line", max_new_tokens=6,
                             stop_at_eos=False, temperature=1.3, seed=3)
    assert out == {**one, "cached_tokens": out["cached_tokens"], "shared_tokens": 0}
    # Its soft time limit is checked between decode steps, as a plain generation's, and
    # says the same: which model, how far it got
    late = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu",
                         soft_deadline=time.monotonic() - 1.0)
    said = []
    for run in (lambda: generate_calls(lm, [call]),
                lambda: inference.generate(lm, SHARED + "one more line", max_new_tokens=6)):
        with rt.activated(late), pytest.raises(SoftTimeLimitExceeded) as hit:
            run()
        said.append(hit.value.args[0])
    assert said[0] == said[1] == (f"soft time limit hit while generating with model "
                                  f"{lm.key!r}: stopped after 0 of 6 new tokens")


# -- rows leave the batch when they are done ----------------------------------------------------

ROWS = [("the cache warms", 2, 1.5, 1), ("a queue of work", 7, 1.5, 2),
        ("the worker loads a model and", 4, 0.0, 3), ("once more", 7, 1.5, 4)]


def rows_batch(lm: Any, stop_at_eos: bool) -> tuple[list[Any], list[Any], list[int]]:
    """The ``ROWS`` batched (with each forward's batch size) and each alone."""
    calls = [Call(str(i), (p, n), {"temperature": t, "seed": s, "stop_at_eos": stop_at_eos})
             for i, (p, n, t, s) in enumerate(ROWS)]
    got, forwards = forwards_of(lm, lambda: generate_calls(lm, calls))
    each = [inference.generate(lm, p, max_new_tokens=n, temperature=t, seed=s,
                               stop_at_eos=stop_at_eos) for p, n, t, s in ROWS]
    return got, each, [batch for batch, _ in forwards]


def still_going(outputs: list[Any]) -> list[int]:
    """The rows a batch decodes at each step: those with more tokens to come."""
    return [sum(o["tokens"] > step for o in outputs)
            for step in range(max(o["tokens"] for o in outputs))]


def test_a_row_leaves_the_batch_at_its_own_max_new_tokens(lm: Any) -> None:
    got, each, sizes = rows_batch(lm, stop_at_eos=False)
    assert [g["tokens"] for g in got] == [n for _, n, _, _ in ROWS]
    for out, one in zip(got, each, strict=True):
        assert out == {**one, "shared_tokens": 0}
    # one forward per step, over the rows still going: 4, 4, then 3 once the 2-token
    # row is done, then 2 (generate would run all 4 rows for all 7 steps)
    assert sizes == still_going(got) == [4, 4, 3, 3, 2, 2, 2]


def test_a_row_leaves_the_batch_at_its_end_of_sequence_token(lm: Any) -> None:
    import torch

    tokenizer = inference.tokenizer_of(lm, lm.key)
    prompt = tokenizer(ROWS[1][0])["input_ids"]
    progress: dict[str, Any] = {"new": [], "runs": 1}
    decoding.decode_steps(lm.module, torch.tensor([prompt]), 7, frozenset(), 1.5, ROWS[1][3],
                           progress, None, kvreuse.PromptPrefix.looked_up(None, lm.key, prompt),
                           model=lm.key)
    ids = progress["new"]
    # the second row's third token is made the end-of-sequence token: it stops there
    end = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    was = tokenizer.eos_token
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(end)
    try:
        got, each, sizes = rows_batch(lm, stop_at_eos=True)
    finally:
        tokenizer.eos_token = was
    assert got[1]["stopped"] == "eos" and got[1]["tokens"] == ids.index(end) + 1 < 7
    for out, one in zip(got, each, strict=True):
        assert out == {**one, "shared_tokens": 0}
    assert sizes == still_going(got) and sizes[-1] < sizes[0]


def test_a_batch_hitting_its_soft_time_limit_says_how_far_it_got(lm: Any) -> None:
    calls = [Call(str(i), (p, n), {"temperature": t, "seed": s})
             for i, (p, n, t, s) in enumerate(ROWS)]
    late = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu",
                         soft_deadline=time.monotonic() - 1.0)
    with rt.activated(late), pytest.raises(SoftTimeLimitExceeded) as hit:
        generate_calls(lm, calls)
    assert hit.value.args[0] == (f"soft time limit hit while generating a batch of 4 with "
                                 f"model {lm.key!r}: stopped after 0 of 7 decode steps")


def test_template_rows_leave_a_shared_prefill_batch_and_decode_as_each_alone(
        lm: Any) -> None:
    # Rows placed on their groups' shared KV (two templates and a row of its own) leave
    # at their own lengths: the shared cache loses their rows, not the others'
    prompts = [SHARED + ITEMS[0], OTHER + ITEMS[1], SHARED + ITEMS[2], "a short one",
               OTHER + ITEMS[3]]
    most = [3, 8, 1, 5, 2]
    calls = [Call(str(i), (p, n), {"temperature": 1.3 if i % 2 else 0.0, "seed": i,
                                   "stop_at_eos": False})
             for i, (p, n) in enumerate(zip(prompts, most, strict=True))]
    got, forwards = forwards_of(lm, lambda: generate_calls(lm, calls))
    assert [g["shared_tokens"] > 0 for g in got] == [True, True, True, False, True]
    assert [batch for batch, _ in forwards[2:]] == still_going(got)  # after 2 prefills
    for i, (prompt, out) in enumerate(zip(prompts, got, strict=True)):
        one = inference.generate(lm, prompt, max_new_tokens=most[i], stop_at_eos=False,
                                 temperature=1.3 if i % 2 else 0.0, seed=i)
        assert out == {**one, "shared_tokens": out["shared_tokens"]}, prompt


# -- a row's result goes out when the row is done ---------------------------------------------

def delivering(lm: Any, calls: list[Call]) -> tuple[list[Any], list[tuple[int, Any, int]]]:
    """The batch's outputs, and what it delivered early: (call, output, forwards run by
    then)."""
    delivered: list[tuple[int, Any, int]] = []
    seen: list[int] = []
    handle = lm.module.register_forward_pre_hook(lambda *_: seen.append(1))

    def early(i: int, out: Any) -> bool:  # takes each call once, as run_batch does
        if i in (d[0] for d in delivered):
            return False
        delivered.append((i, out, len(seen)))
        return True

    active = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu",
                           early=early)
    try:
        with rt.activated(active):
            return generate_calls(lm, calls), delivered
    finally:
        handle.remove()


def test_a_row_done_before_the_last_is_delivered_then(lm: Any) -> None:
    calls = [Call(str(i), (p, n), {"temperature": t, "seed": s, "stop_at_eos": False})
             for i, (p, n, t, s) in enumerate(ROWS)]
    calls.insert(2, Call("bad", ("",), {}))  # fails on its arguments: delivered at once
    got, delivered = delivering(lm, calls)
    # the bad call before any forward; the 2-token row after 2 steps, the 4-token one
    # after 4; the two 7-token rows end the batch and go back with it
    assert [(i, n) for i, _, n in delivered] == [(2, 0), (0, 2), (3, 4)]
    assert isinstance(delivered[0][1], InvalidInput) and delivered[0][1] is got[2]
    for i, out, _ in delivered[1:]:
        assert out == got[i] and out["tokens"] == calls[i].args[1]


def test_a_batch_with_two_kinds_of_stop_delivers_the_first_kinds_rows_when_done(
        lm: Any) -> None:
    calls = [Call("0", (ROWS[0][0], 3), {"stop_at_eos": False}),
             Call("1", (ROWS[1][0], 3), {"stop_at_eos": True}),
             Call("2", (ROWS[2][0], 2), {"stop_at_eos": False})]
    got, delivered = delivering(lm, calls)
    # stop_at_eos False runs first (rows 0 and 2): row 2 leaves it after 2 steps, row 0
    # ends it and is delivered before row 1's batch (of one) starts
    assert [(i, n) for i, _, n in delivered] == [(2, 2), (0, 3)]
    assert all(out == got[i] for i, out, _ in delivered)


def test_outside_a_worker_nothing_is_delivered_early(lm: Any) -> None:
    calls = [Call(str(i), (p, n), {"stop_at_eos": False}) for i, (p, n, _, _) in enumerate(ROWS)]
    active = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu")
    with rt.activated(active):
        assert not active.deliver(0, "x")
        assert [g["tokens"] for g in generate_calls(lm, calls)] == [2, 7, 4, 7]


def test_a_soft_time_limit_after_a_delivery_fails_only_the_rows_still_going(
        lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [Call(str(i), (p, n), {"stop_at_eos": False}) for i, (p, n, _, _) in enumerate(ROWS)]
    delivered: list[int] = []

    def early(i: int, _out: Any) -> bool:
        delivered.append(i)
        monkeypatch.setattr(rt.time, "monotonic", lambda: 1e12)  # the deadline passes now
        return True

    active = rt.ActiveTask("lm", SitsConfig().quota("high"), lm.size_bytes(), "cpu",
                           soft_deadline=time.monotonic() + 3600, early=early)
    with rt.activated(active), pytest.raises(SoftTimeLimitExceeded) as hit:
        generate_calls(lm, calls)
    # the 2-token row was done and delivered; the limit stopped the other three next step
    assert delivered == [0]
    assert hit.value.args[0].endswith("stopped after 2 of 7 decode steps")


def test_a_batch_over_its_class_runs_in_parts_that_fit_and_fails_only_a_row_too_big(
        lm: Any) -> None:
    def ids(prompt: str) -> int:
        return len(inference.tokenizer_of(lm, "lm")(prompt)["input_ids"])

    short = ["the worker loads", "a queue waits", "once more"]
    long_prompt, huge_prompt = "every task keeps", "the cache warms"
    # a class that holds the long row alone (and the short ones together), not both
    module = inference.module_of(lm, "lm")
    kv = decoding.kv_cache_bytes(module, int(1.5 * (ids(long_prompt) + 40)))
    quota = replace(SitsConfig().quota("low"),
                    vram_gib=(lm.size_bytes() + kv) / BYTES_PER_GIB)
    calls = [*(Call(f"s{i}", (p, 2), {"stop_at_eos": False}) for i, p in enumerate(short)),
             Call("long", (long_prompt, 40), {"stop_at_eos": False}),
             Call("huge", (huge_prompt, 200), {"stop_at_eos": False})]
    delivered: dict[int, Any] = {}
    active = rt.ActiveTask("lm", quota, lm.size_bytes(), "cpu",
                           early=lambda i, out: delivered.setdefault(i, out) is out)
    with rt.activated(active):
        got = generate_calls(lm, calls)
    # every call that fits alone gets what it would alone...
    for call, out in zip(calls[:4], got, strict=False):
        prompt, most = call.args
        assert out == {**inference.generate(lm, prompt, max_new_tokens=most,
                                            stop_at_eos=False),
                       "cached_tokens": 0, "shared_tokens": 0}, call.id
    # ...and the one too big for the class even alone fails alone, at once
    assert isinstance(got[4], VramLimitExceeded) and "class 'low'" in str(got[4])
    assert delivered[4] is got[4]
    # (the whole batch at once would not have fitted)
    with rt.activated(active), pytest.raises(VramLimitExceeded):
        active.check_vram(decoding.kv_cache_bytes(
            module, (max(map(ids, [*short, long_prompt])) + 40) * 4))


def test_a_row_alone_in_its_group_and_too_big_fails_alone(lm: Any) -> None:
    """(a group of one row skipped the check: its run raised, and every call of the
    batch failed with it, those of the other group too)"""
    def ids(prompt: str) -> int:
        return len(inference.tokenizer_of(lm, "lm")(prompt)["input_ids"])

    prompt = "the worker loads the prompt"
    module = inference.module_of(lm, "lm")
    quota = replace(SitsConfig().quota("low"), vram_gib=(
        lm.size_bytes() + decoding.kv_cache_bytes(module, ids(prompt) + 20)) / BYTES_PER_GIB)
    # the big one the only row that stops at the end of sequence, first: its group ran first
    calls = [Call("big", (prompt, 150), {"stop_at_eos": True}),
             Call("small", (prompt, 4), {"stop_at_eos": False})]
    active = rt.ActiveTask("lm", quota, lm.size_bytes(), "cpu")
    with rt.activated(active):
        got = generate_calls(lm, calls)
    assert isinstance(got[0], VramLimitExceeded)
    assert got[1] == {**inference.generate(lm, prompt, max_new_tokens=4, stop_at_eos=False),
                      "cached_tokens": 0, "shared_tokens": 0}


def test_rows_that_fit_unshared_are_not_failed_by_a_wider_shared_layout(lm: Any) -> None:
    """(sharing a long template laid out its start plus the longest own part, wider than
    any row: the class refused that layout and failed every call, which fitted plain)"""
    tokenizer = inference.tokenizer_of(lm, "lm")
    template = "summarise this operations log in one line and keep every number: "
    prompts = [template + tail for tail in ("disk 3 full", "node 7 rebooted", "all green",
                                            "ok")]
    prompts.append("a short, unrelated prompt of its own")  # shorter than each, not by much
    width = max(len(tokenizer(p)["input_ids"]) for p in prompts) + 4
    groups, shared = batchgen._plan([tokenizer(p)["input_ids"] for p in prompts])
    rows = [batchgen._Row(i, tokenizer(p)["input_ids"], 4, 0.0, 0, None)
            for i, p in enumerate(prompts)]
    assert groups and batchgen._width(rows, shared) + 4 > width  # wider shared than plain
    module = inference.module_of(lm, "lm")
    quota = replace(SitsConfig().quota("low"), vram_gib=(
        lm.size_bytes() + decoding.kv_cache_bytes(module, width * len(prompts)))
        / BYTES_PER_GIB)
    calls = [Call(str(i), (p, 4), {"stop_at_eos": False}) for i, p in enumerate(prompts)]
    active = rt.ActiveTask("lm", quota, lm.size_bytes(), "cpu")
    with rt.activated(active):
        got = generate_calls(lm, calls)
    for prompt, out in zip(prompts, got, strict=True):
        assert not isinstance(out, Exception), out
        assert out["text"] == inference.generate(lm, prompt, max_new_tokens=4,
                                                 stop_at_eos=False)["text"]


def test_a_row_stops_at_the_end_tokens_the_model_s_generation_config_lists(lm: Any) -> None:
    """(only the tokenizer's EOS was looked at: a chat model's end-of-turn tokens, listed
    in its generation_config as transformers' generate reads them, were run past to
    max_new_tokens)"""
    import torch

    tokenizer = inference.tokenizer_of(lm, lm.key)
    greedy = tokenizer(ROWS[2][0])["input_ids"]
    first = int(lm.module.generate(torch.tensor([greedy]), max_new_tokens=1, do_sample=False,
                                   pad_token_id=tokenizer.eos_token_id)[0, -1])
    sampled = tokenizer(ROWS[1][0])["input_ids"]
    progress: dict[str, Any] = {"new": [], "runs": 1}
    decoding.decode_steps(lm.module, torch.tensor([sampled]), 7, frozenset(), 1.5,
                           ROWS[1][3], progress, None,
                           kvreuse.PromptPrefix.looked_up(None, lm.key, sampled), model=lm.key)
    ids = progress["new"]
    end = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i] and t != first)
    config = lm.module.generation_config
    was = config.eos_token_id
    config.eos_token_id = [tokenizer.eos_token_id, first, end]
    try:
        got, each, _ = rows_batch(lm, stop_at_eos=True)
        reference = lm.module.generate(torch.tensor([greedy]), max_new_tokens=4,
                                       do_sample=False, pad_token_id=tokenizer.eos_token_id)
    finally:
        config.eos_token_id = was
    # the greedy row ends at its first token, as transformers' generate does
    assert got[2]["stopped"] == "eos" and got[2]["tokens"] == 1
    assert reference.shape[1] == len(greedy) + 1
    # the sampled row at the listed token, part way
    assert got[1]["stopped"] == "eos" and got[1]["tokens"] == ids.index(end) + 1 < 7
    for out, one in zip(got, each, strict=True):
        assert out == {**one, "shared_tokens": 0}
