"""``sitsq bench joins``: continuous batching, in-process, on the GPU when there is one.

One seeded set of short prompts, each asking for its own number of new tokens (1 to
64, greedy), decoded through the generation batch function (``batchgen.generate_calls``)
two ways on the same warm model (``coalesce``'s GPT-2 style LM, 4 x 256, random weights
built locally):

* ``static``: batches of :data:`BATCH` that run to their end, one after another (a
  worker without continuous batching, its queue deep);
* ``joined``: one batch that the rest join as a quarter of it frees (the worker's
  continuous batching: the same selection, joint prefill and KV merge of joining rows,
  fed in-process instead of through Redis and Celery's consumer).

Per way: wall time, tasks/s, new tokens/s and the mean rows per decode step; the ratio
of the two throughputs, and whether every prompt got the same tokens both ways. Medians
of interleaved repeats. It measures the decode loop alone: ``bench coalesce`` measures
the same through real workers (``sits_joins``), Redis and the consumer included.

A program, not a test: it prints a table and JSON, and asserts nothing about timings.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sits_queue.bench import coldstart
from sits_queue.bench.coalesce import LM_SHAPE, make_texts, ragged_lengths
from sits_queue.bench.report import ratio
from sits_queue.config import SitsConfig
from sits_queue.workers import joins
from sits_queue.workers import runtime as rt
from sits_queue.workers.batched import Call

#: Rows a batch holds (``batch_max_tasks``).
BATCH = 32


@dataclass(frozen=True)
class Shape:
    prompts: int
    repeats: int
    seed: int = 7

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.repeats < 1:
            raise ValueError("prompts and repeats must be >= 1")


QUICK = Shape(prompts=192, repeats=2)
FULL = Shape(prompts=640, repeats=3)
#: ``--smoke``: a batch of 32 and 12 more, so both ways differ.
SMOKE = Shape(prompts=44, repeats=1)


@dataclass
class LocalFeed:
    """``joins.Feed``'s contract over a list: rows join once a quarter of the batch is
    free (:data:`joins.JOIN_AT_SHARE`), with no time limit to fit; ``joined`` lists the
    calls taken, in their index order after the batch's own."""

    waiting: list[Call]
    first: int
    joined: list[Call] = field(default_factory=list)
    declined: set[int] = field(default_factory=set)

    def take(self, live: int) -> list[tuple[int, Call]]:
        free = joins.room(BATCH, live)
        if free < joins.least(BATCH):
            return []
        out = []
        while free and self.waiting:
            self.joined.append(self.waiting.pop(0))
            out.append((self.first + len(self.joined) - 1, self.joined[-1]))
            free -= 1
        return out

    def fits(self, most: int, step_s: float) -> bool:
        return True

    def decline(self, index: int) -> None:
        self.declined.add(index)

    def first_token(self, index: int) -> None:
        """(A joined row's first token: the benchmark times the whole run.)"""


def _active(engine: Any, device: str, **extra: Any) -> rt.ActiveTask:
    return rt.ActiveTask("lm", SitsConfig().quota("high"), int(engine.size_bytes()), device,
                         on_cuda=device.startswith("cuda"), **extra)


def static(engine: Any, calls: list[Call], device: str) -> dict[str, str]:
    """Batches of :data:`BATCH` that run to their end: each call's text."""
    from sits_queue.workers.batchgen import generate_calls

    got: dict[str, str] = {}
    for start in range(0, len(calls), BATCH):
        part = calls[start:start + BATCH]
        with rt.activated(_active(engine, device)):
            outs = generate_calls(engine, part, share_prefix=False)
        got.update({c.id: out["text"] for c, out in zip(part, outs, strict=True)})
    return got


def joined(engine: Any, calls: list[Call], device: str) -> dict[str, str]:
    """One batch the rest join as it frees (a new one whenever one ends with calls
    left, its rows all done in one step): each call's text."""
    from sits_queue.workers.batchgen import generate_calls

    got: dict[str, str] = {}
    rest = list(calls)
    while rest:
        own = rest[:BATCH]
        feed = LocalFeed(rest[BATCH:], first=len(own))
        delivered: dict[int, Any] = {}

        def early(i: int, out: Any, delivered: dict[int, Any] = delivered) -> bool:
            delivered[i] = out
            return True

        with rt.activated(_active(engine, device, joins=feed, early=early)):
            outs = generate_calls(engine, own, share_prefix=False)
        for i, call in enumerate(own + feed.joined):
            out = delivered.get(i, outs[i] if i < len(own) else None)
            if isinstance(out, dict):
                got[call.id] = out["text"]
        rest = feed.waiting
    return got


def _timed(engine: Any, run: Callable[[], dict[str, str]]) -> tuple[float, dict[str, str],
                                                                     list[int]]:
    """Wall seconds, the texts, and the rows of each decode step (one new token each)."""
    sizes: list[int] = []
    handle = engine.module.register_forward_pre_hook(
        lambda _m, _a, kw: sizes.append(kw["input_ids"].shape[0])
        if kw["input_ids"].shape[1] == 1 else None, with_kwargs=True)
    try:
        began = time.perf_counter()
        texts = run()
        return time.perf_counter() - began, texts, sizes
    finally:
        handle.remove()


def run(quick: bool = False, redis_url: str | None = None, *, shape: Shape | None = None,
        zoo_root: Path | None = None, on_progress: Callable[[str], None] = print
        ) -> dict[str, Any]:
    """Both ways, interleaved; the result the JSON holds (no Redis involved:
    ``redis_url`` is accepted for the common command line and unused)."""
    import torch

    from sits_queue.models.tiny import build_tiny_causal_lm

    shape = shape or (QUICK if quick else FULL)
    engine, device = coldstart.on_device("lm", build_tiny_causal_lm(
        (zoo_root or coldstart.default_zoo()) / "joins-lm", seed=shape.seed, **LM_SHAPE))
    lengths = ragged_lengths(shape.prompts, shape.seed)
    calls = [Call(str(i), (text,), {"max_new_tokens": n, "stop_at_eos": False})
             for i, (text, n) in enumerate(zip(make_texts(shape.prompts, shape.seed),
                                               lengths, strict=True))]
    on_progress(f"joins: {shape.prompts} prompts asking 1-{max(lengths)} tokens, "
                f"LM {LM_SHAPE} on {device}, batches of {BATCH}")
    static(engine, calls[:BATCH], device)  # warm-up: kernels, allocator, caches
    runs: dict[str, list[tuple[float, dict[str, str], list[int]]]] = {"static": [],
                                                                       "joined": []}
    for _ in range(shape.repeats):
        runs["static"].append(_timed(engine, lambda: static(engine, calls, device)))
        runs["joined"].append(_timed(engine, lambda: joined(engine, calls, device)))
    tokens = sum(lengths)
    out: dict[str, Any] = {}
    for way, done in runs.items():
        wall = statistics.median(s for s, _, _ in done)
        sizes = done[-1][2]
        out[way] = {"s": round(wall, 3), "tasks_per_s": round(shape.prompts / wall, 1),
                    "tokens_per_s": round(tokens / wall, 1), "steps": len(sizes),
                    "rows_per_step": round(sum(sizes) / len(sizes), 2) if sizes else 0.0,
                    "done": len(done[-1][1])}
        on_progress(f"  {way}: {out[way]}")
    same = runs["static"][-1][1] == runs["joined"][-1][1]
    return {**out, "ratios": {"joined_throughput_vs_static": ratio(
        out["joined"]["tokens_per_s"], out["static"]["tokens_per_s"])},
        "same_texts": same,
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "quick": quick, "shape": asdict(shape), "lm": LM_SHAPE, "batch": BATCH,
                 "tokens": tokens, "device": device,
                 "torch_threads": torch.get_num_threads(),
                 "python": platform.python_version(), "cpus": os.cpu_count(),
                 "torch": coldstart._version("torch")}}


def table(result: Mapping[str, Any]) -> str:
    lines = [f"{'way':<8}{'s':>8}{'tasks/s':>9}{'tokens/s':>10}{'steps':>7}{'rows/step':>11}"]
    for way in ("static", "joined"):
        r = result[way]
        lines.append(f"{way:<8}{r['s']:>8.3f}{r['tasks_per_s']:>9.1f}{r['tokens_per_s']:>10.1f}"
                     f"{r['steps']:>7}{r['rows_per_step']:>11.2f}")
    meta = result["meta"]
    lines.append(f"{meta['shape']['prompts']} prompts, {meta['tokens']} new tokens, batches "
                 f"of {meta['batch']}, on {meta['device']}; same texts both ways: "
                 f"{result['same_texts']}")
    lines.append("ratios: " + ", ".join(f"{k}={v}" for k, v in result["ratios"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return coldstart.zoo_main("python -m sits_queue.bench.joins", __doc__, run, table, argv,
                              smoke={"shape": SMOKE})


if __name__ == "__main__":
    sys.exit(main())
