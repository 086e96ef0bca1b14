"""``sitsq bench coalesce``: one text per task, as offline embedding jobs submit them,
through (a) a stock Celery worker that keeps the encoder warm in a module global,
(b) a SITS worker running tasks one at a time (``batch_window`` 0), and (c) a SITS
worker batching same-model tasks (``sits.embed`` is a batch task: the tasks waiting
together run as one forward pass, ``workers/batched.py``); the generation streams also
through (d) ``sits_joins``: (c) with continuous batching on (``batch_join`` on: waiting
tasks join a generation batch's freed rows, ``workers/joins.py``; ``auto``, the
default, leaves it off on a CPU host), and last ``gen_paced``, through (c) and (d) only:
the ragged prompts arriving at :data:`PACED_GEN_SHARE` of what (c) sustained on
``gen_ragged``, where a task arriving while a batch decodes waits for its end in (c) and
joins it in (d).

A program, not a test: it prints a table and JSON, and asserts nothing about timings.

How it runs (the same for all systems, in one process run):

* one Redis server (embedded unless ``--redis-url``), one database per system;
* one ``celery worker`` per system (prefork, concurrency 1, on every core this process
  may use), all three up at once, each stream run through each system in turn (the
  others idle): a small machine's speed drifts over minutes, and one system's streams
  all in a row would carry that drift into the comparison; a BERT-style encoder (4
  layers, 256 wide; random weights, built locally);
* three seeded streams of short texts: ``burst``, the whole job submitted at once (the
  offline case: throughput); then arrivals at fixed rates, as a job fed by a producer
  pipeline: ``light`` at 50% of what the faster of the one-at-a-time systems sustained
  in its burst (one at a time keeps up: what batching costs when there is nothing to
  batch), and ``heavy`` at 150% of it (one at a time falls behind, either system, its
  queue growing for as long as the stream lasts); then
  ``gen_burst``: prompts for a small causal LM (4 x 256) submitted at once, each asking
  for 8 new tokens greedily (stock Celery: ``inference.generate`` per task; SITS:
  ``sits.generate_batched``); then ``gen_template``: the same, each prompt one
  instruction template (:data:`TEMPLATE`, 84 tokens) followed by its own short input, as
  offline jobs mostly are (a batch prefills the template once; one at a time, SITS takes
  it from the worker's KV-prefix store; stock Celery prefills it every time); then
  ``gen_ragged``: short prompts each asking for its own number of tokens, 1 to
  :data:`RAGGED_MOST` (seeded), as generations that end where their text does (a batch's
  row leaves it, its result stored, when it has its tokens);
* every worker first embeds one text (its cold start is not measured);
* last, in this process, one batch of :data:`BATCH_ROWS` template prompts through the
  batch function with the template's prefill shared and with every row prefilled in
  full, then the same with the prompts over four templates, interleaved (each
  template's rows prefilled from one shared start: ``meta.template_batch``): what the
  sharing saves a batch, which the streams cannot show apart from the per-task costs
  around it; and the one-template batch with each row asking for its own number of
  tokens (1 to :data:`RAGGED_MOST`, seeded), against all asking for the longest
  (``meta.ragged_batch``): what a row leaving the batch when it is done saves.

``batch``: mean tasks per run (1 for one at a time). ``p50/p99``: submit -> finish, ms;
throughput: tasks over first submission -> last finish.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

from sits_queue.bench import coldstart
from sits_queue.bench.affinity import available_cpus
from sits_queue.bench.coalesce_apps import (
    DONE_KEY,
    GEN_ONLY,
    GEN_TOKENS,
    LM_MODEL,
    MODEL,
    SYSTEMS,
    build,
    settings_of,
    task_names,
    worker_env,
)
from sits_queue.bench.report import database_url, ratio, redis_server, targets_line
from sits_queue.bench.workload import percentile
from sits_queue.procs import intake_held, start_worker, wait_ready

DATABASES = {"celery_per_task": 0, "sits_one_by_one": 1, "sits_batched": 2,
             "sits_joins": 3}
#: One-at-a-time SITS first: its burst throughput sets the paced streams' rates.
RUN_ORDER = ("sits_one_by_one", "celery_per_task", "sits_batched", "sits_joins")
#: The systems that run one task at a time: the faster one's burst sets the paced rates.
ONE_AT_A_TIME = ("sits_one_by_one", "celery_per_task")
ENCODER_SHAPE = {"n_layer": 4, "hidden": 256, "n_head": 4, "n_positions": 128}
LM_SHAPE = {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 256}
#: The paced streams' rates, as shares of the faster one-at-a-time system's burst throughput.
LOADS = {"light": 0.5, "heavy": 1.5}
#: Embedding streams, then generations submitted at once: short prompts, prompts that
#: share one instruction template, and short prompts each asking for its own length.
STREAMS = ("burst", *LOADS, "gen_burst", "gen_template", "gen_ragged", "gen_paced")
#: ``gen_paced``'s rate: this share of what batching sustained on ``gen_ragged``.
PACED_GEN_SHARE = 0.5
#: The systems ``gen_paced`` runs through: batches running to their end, and joined.
PACED_GEN_SYSTEMS = ("sits_batched", "sits_joins")
#: The instruction every ``gen_template`` prompt starts with.
TEMPLATE = ("You summarise operations logs for the on-call engineer. Keep every number, "
            "name the host, say what changed and what to do next, in one short line. Log: ")
#: Targets (printed, never asserted): batching must multiply a burst's throughput, keep
#: up with a heavy stream, and cost little latency on a light one.
TARGET_BURST_THROUGHPUT = 2.0
TARGET_HEAVY_P99 = 0.5
TARGET_LIGHT_P50 = 1.25
DRAIN_S_PER_TASK = 0.5


@dataclass(frozen=True)
class Shape:
    burst: int
    paced: int  # tasks of each paced stream
    generations: int = 200
    seed: int = 5
    #: Timed runs of each in-process batch (after one that warms up): their median.
    batch_repeats: int = 5

    def __post_init__(self) -> None:
        if min(self.burst, self.paced, self.generations, self.batch_repeats) < 1:
            raise ValueError("burst, paced, generations and batch_repeats must be >= 1")


QUICK = Shape(burst=1200, paced=400, generations=200)
FULL = Shape(burst=4000, paced=1500, generations=600)


def make_texts(n: int, seed: int) -> list[str]:
    """``n`` short texts (one to three corpus sentences), seeded."""
    from sits_queue.models.tiny import corpus

    sentences = corpus(300, seed=seed)
    rng = random.Random(seed)
    return [" ".join(rng.choice(sentences) for _ in range(rng.randint(1, 3)))
            for _ in range(n)]


# -- statistics (pure) ---------------------------------------------------------------------

def summarise(records: Sequence[dict[str, Any]], submitted: Mapping[str, float]
              ) -> dict[str, Any]:
    ok = [r for r in records if not r.get("error") and r["id"] in submitted]
    latency = [(r["fin"] - submitted[r["id"]]) * 1000 for r in ok]
    span = (max(r["fin"] for r in ok) - min(submitted[r["id"]] for r in ok)) if ok else 0.0
    sizes = [int(r.get("size") or 1) for r in ok]
    return {
        "n": len(ok), "failed": len(records) - len(ok),
        "throughput_tps": round(len(ok) / span, 2) if span > 0 else 0.0,
        "p50_ms": round(percentile(latency, 50), 1),
        "p99_ms": round(percentile(latency, 99), 1),
        "mean_batch": round(sum(sizes) / len(sizes), 2) if sizes else 0.0,
        "errors": sorted({str(r["error"]) for r in records if r.get("error")})[:3],
    }


def ratios(result: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, float | None]:
    def of(stream: str, field: str, other: str = "sits_one_by_one") -> float | None:
        return ratio(result[stream]["sits_batched"][field], result[stream][other][field])

    def joined(stream: str, field: str) -> float | None:
        return ratio(result[stream]["sits_joins"][field], result[stream]["sits_batched"][field])

    return {"burst_throughput_vs_one_by_one": of("burst", "throughput_tps"),
            "burst_throughput_vs_celery": of("burst", "throughput_tps", "celery_per_task"),
            "heavy_p99_vs_one_by_one": of("heavy", "p99_ms"),
            "heavy_p99_vs_celery": of("heavy", "p99_ms", "celery_per_task"),
            "light_p50_vs_one_by_one": of("light", "p50_ms"),
            "light_p50_vs_celery": of("light", "p50_ms", "celery_per_task"),
            "gen_throughput_vs_one_by_one": of("gen_burst", "throughput_tps"),
            "gen_throughput_vs_celery": of("gen_burst", "throughput_tps", "celery_per_task"),
            "template_throughput_vs_one_by_one": of("gen_template", "throughput_tps"),
            "template_throughput_vs_celery": of("gen_template", "throughput_tps",
                                                "celery_per_task"),
            "ragged_throughput_vs_one_by_one": of("gen_ragged", "throughput_tps"),
            "ragged_throughput_vs_celery": of("gen_ragged", "throughput_tps",
                                              "celery_per_task"),
            "ragged_p50_vs_celery": of("gen_ragged", "p50_ms", "celery_per_task"),
            # continuous batching: the same batches, joined (sits_joins) and not
            "joins_gen_throughput": joined("gen_burst", "throughput_tps"),
            "joins_ragged_throughput": joined("gen_ragged", "throughput_tps"),
            "joins_paced_p50": joined("gen_paced", "p50_ms"),
            "joins_paced_p99": joined("gen_paced", "p99_ms")}


def targets(r: Mapping[str, float | None]) -> dict[str, bool]:
    def meets(name: str, bound: float, above: bool) -> bool:
        value = r[name]
        return value is not None and (value >= bound if above else value <= bound)

    return {f"burst_throughput_vs_one_by_one>={TARGET_BURST_THROUGHPUT}":
            meets("burst_throughput_vs_one_by_one", TARGET_BURST_THROUGHPUT, True),
            f"heavy_p99_vs_one_by_one<={TARGET_HEAVY_P99}":
            meets("heavy_p99_vs_one_by_one", TARGET_HEAVY_P99, False),
            f"light_p50_vs_one_by_one<={TARGET_LIGHT_P50}":
            meets("light_p50_vs_one_by_one", TARGET_LIGHT_P50, False)}


# -- the template's shared prefill, in-process ----------------------------------------------

#: Rows of the in-process template batch: a full batch (``batch_max_tasks``).
BATCH_ROWS = 32
#: Most new tokens a row of the in-process ragged batch asks for.
RAGGED_MOST = 64
#: The mixed batch's other instructions (with :data:`TEMPLATE`: a batch of several jobs'
#: prompts, one template each, as a queue fed by several jobs delivers them).
OTHER_TEMPLATES = (
    "Classify the ticket below as billing, outage, access or other, and give the one "
    "sentence of it that decided the class, quoted exactly. Ticket: ",
    "Rewrite the release note below for customers: no internal names, no ticket numbers, "
    "plain words, at most two sentences. Note: ",
    "Extract every host name, error code and time from the alert below as a comma "
    "separated list, in the order they appear, nothing else. Alert: ")


def mixed_prompts(texts: Sequence[str]) -> list[str]:
    """``texts`` behind the four templates in turn."""
    templates = (TEMPLATE, *OTHER_TEMPLATES)
    return [templates[i % len(templates)] + t for i, t in enumerate(texts)]


def ragged_lengths(n: int, seed: int) -> list[int]:
    """``max_new_tokens`` of the in-process ragged batch's rows: seeded, 1 to
    :data:`RAGGED_MOST`."""
    rng = random.Random(seed)
    return [rng.randint(1, RAGGED_MOST) for _ in range(n)]


def in_process_batches(lm_dir: Path, batches: Mapping[str, Sequence[str]],
                       lengths: Sequence[int], repeats: int) -> dict[str, Any]:
    """What one batch's generation saves, measured in this process (the worker streams
    cannot show it apart from the per-task costs around it), as median ms of
    ``generate_calls`` over ``repeats`` runs:

    * ``template_batch``, per batch of prompts (``one``: one template; ``mixed``: four,
      interleaved): shared starts prefilled once per group, and every row prefilled in
      full (the same outputs);
    * ``ragged_batch``: the ``one`` prompts, each asking for its own number of tokens
      (``lengths``), every row leaving the batch when it is done; and the same rows all
      asking for the longest, which is what decoding every row until the longest is done
      costs (Hugging Face ``generate``'s way)."""
    import torch

    from sits_queue.cache.engines import engine_from_path
    from sits_queue.workers.batched import Call
    from sits_queue.workers.batchgen import generate_calls
    from sits_queue.workers.inference import tokenizer_of

    torch.set_num_threads(len(available_cpus()))
    engine = engine_from_path(LM_MODEL, lm_dir, "cpu")
    engine.to_device("cpu")
    tokenizer = tokenizer_of(engine, LM_MODEL)

    def median_ms(calls: list[Call], share: bool) -> tuple[float, list[Any]]:
        times, got = [], []
        for _ in range(repeats + 1):  # the first run warms up
            start = time.perf_counter()
            got = generate_calls(engine, calls, share_prefix=share)
            times.append((time.perf_counter() - start) * 1000)
        return round(statistics.median(times[1:]), 1), got

    def asking(prompts: Sequence[str], most: Sequence[int]) -> list[Call]:
        return [Call(str(i), (p,), {"max_new_tokens": n, "stop_at_eos": False})
                for i, (p, n) in enumerate(zip(prompts, most, strict=True))]

    templates: dict[str, Any] = {}
    for batch, prompts in batches.items():
        calls = asking(prompts, [GEN_TOKENS] * len(prompts))
        shared_ms, got = median_ms(calls, True)
        shared = [g["shared_tokens"] for g in got]
        templates[batch] = {
            "rows": len(calls), "shared_ms": shared_ms,
            "unshared_ms": median_ms(calls, False)[0], "shared_tokens": max(shared),
            "groups": len({tuple(tokenizer(p)["input_ids"][:n])
                           for n, p in zip(shared, prompts, strict=True) if n})}
    prompts = batches["one"]
    ragged_ms, got = median_ms(asking(prompts, lengths), True)
    longest_ms = median_ms(asking(prompts, [max(lengths)] * len(prompts)), True)[0]
    engine.release()
    return {"template_batch": templates, "ragged_batch": {
        "rows": len(prompts), "tokens": sum(g["tokens"] for g in got),
        "longest": max(lengths), "ragged_ms": ragged_ms, "longest_ms": longest_ms}}


# -- running one system --------------------------------------------------------------------

class Runner:
    """One system's worker, warm, and the streams through it."""

    def __init__(self, system: str, url: str, model_dir: Path, lm_dir: Path,
                 log_dir: Path) -> None:
        self.system, self.url = system, url
        self.client = redis.Redis.from_url(url)
        self.client.flushdb()
        self.app = build(system, url, model_dir, lm_dir, settings_of(system))
        env = worker_env(system, url, model_dir, lm_dir)
        self.worker = start_worker("sits_queue.bench.coalesce_apps", env, log_dir,
                                   concurrency=1, hostname=f"{system}@%h",
                                   cpus=available_cpus())
        embed, generate = task_names(system)
        self.task, self.gen_task = self.app.tasks[embed], self.app.tasks[generate]

    def __enter__(self) -> Runner:
        wait_ready(self.app, [self.worker])
        # their cold starts are not measured
        self.stream(["warm up"], rate_per_s=None)
        self.stream(["warm up"], rate_per_s=None, tokens=[GEN_TOKENS])
        return self

    def __exit__(self, *_: Any) -> None:
        self.worker.stop()
        self.app.close()
        self.client.flushdb()  # leave nothing behind
        self.client.close()

    def stream(self, texts: Sequence[str], rate_per_s: float | None,
               tokens: Sequence[int] | None = None
               ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Submit ``texts`` (all at once, or at ``rate_per_s``) to embed, or with
        ``tokens`` as prompts, each to continue by its number of tokens; the records once
        done."""
        self.client.delete(DONE_KEY)
        submitted: dict[str, float] = {}
        plain = self.system == "celery_per_task"
        task = self.gen_task if tokens else self.task
        options: dict[str, Any] = {} if plain else {"model": LM_MODEL if tokens else MODEL}
        start = time.monotonic()
        # (all at once: a backlog, however slow this producer; paced: as they come)
        gate: Any = nullcontext() if rate_per_s else intake_held(self.app, [self.worker])
        with self.app.producer_or_acquire() as producer, gate as hold:
            for i, text in enumerate(texts):
                if rate_per_s:  # the arrival process of the paced stream
                    delay = start + i / rate_per_s - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                now = time.time()
                if not tokens:
                    args: tuple[Any, ...] = (text,)
                    kwargs: dict[str, Any] = {}
                else:  # the same greedy work: its length, no stop at EOS
                    args, kwargs = ((text, tokens[i]), {}) if plain else \
                        ((text,), {"max_new_tokens": tokens[i], "stop_at_eos": False})
                result = task.apply_async(args, kwargs, producer=producer, **options)
                submitted[result.id] = now
        if hold is not None:  # (at once: all arrived as the worker was let at them)
            submitted = {task_id: hold.arrived(sent) for task_id, sent in submitted.items()}
        timeout = max(coldstart.DRAIN_MIN_S, DRAIN_S_PER_TASK * len(texts))
        records = coldstart.await_records(self.client, len(texts), [self.worker], timeout,
                                          f"{self.system}'s stream", key=DONE_KEY)
        return records, submitted


def run(quick: bool = False, redis_url: str | None = None, *, shape: Shape | None = None,
        zoo_root: Path | None = None, on_progress: Callable[[str], None] = print
        ) -> dict[str, Any]:
    """Every system on every stream (``sits_joins`` on the generation streams only,
    ``gen_paced`` through the two batching systems only); the result the JSON holds."""
    from sits_queue.models.tiny import build_tiny_causal_lm, build_tiny_encoder

    shape = shape or (QUICK if quick else FULL)
    zoo = zoo_root or coldstart.default_zoo()
    model_dir = build_tiny_encoder(zoo / "coalesce-enc", seed=shape.seed, **ENCODER_SHAPE)
    lm_dir = build_tiny_causal_lm(zoo / "coalesce-lm", seed=shape.seed, **LM_SHAPE)
    texts = {"burst": make_texts(shape.burst, shape.seed),
             **{name: make_texts(shape.paced, shape.seed + 1 + i)
                for i, name in enumerate(LOADS)},
             "gen_burst": make_texts(shape.generations, shape.seed + 9),
             "gen_template": [TEMPLATE + t for t in make_texts(shape.generations,
                                                               shape.seed + 10)],
             "gen_ragged": make_texts(shape.generations, shape.seed + 12),
             "gen_paced": make_texts(shape.generations, shape.seed + 13)}
    lengths = {"gen_burst": [GEN_TOKENS] * shape.generations,
               "gen_template": [GEN_TOKENS] * shape.generations,
               "gen_ragged": ragged_lengths(shape.generations, shape.seed + 12),
               "gen_paced": ragged_lengths(shape.generations, shape.seed + 13)}
    on_progress(f"coalesce: {shape.burst} texts at once, then {shape.paced} at each of "
                f"{len(LOADS)} rates, one text per task")
    out: dict[str, dict[str, Any]] = {name: {} for name in STREAMS}
    base = 0.0  # the faster one-at-a-time system's burst throughput: sets the rates
    with tempfile.TemporaryDirectory(prefix="sits-bench-coalesce-") as tmp, \
            redis_server(redis_url, len(DATABASES)) as url, ExitStack() as stack:
        # Every system's worker up at once (each idle but for its own turn) and the streams
        # interleaved, a stream through each system in turn: this machine's speed drifts
        # over minutes, and one system's streams all in a row would carry its drift.
        runners = {system: stack.enter_context(Runner(
            system, database_url(url, DATABASES[system]), model_dir, lm_dir,
            Path(tmp) / system)) for system in RUN_ORDER}
        for name in STREAMS:
            for system, runner in runners.items():
                if (system in GEN_ONLY and not name.startswith("gen_")) or (
                        name == "gen_paced" and system not in PACED_GEN_SYSTEMS):
                    continue
                rate = LOADS[name] * base if name in LOADS else PACED_GEN_SHARE * out[
                    "gen_ragged"]["sits_batched"]["throughput_tps"] if name == "gen_paced" \
                    else None
                out[name][system] = summarise(*runner.stream(
                    texts[name], rate, lengths.get(name)))
            if name == "burst":
                # The faster of the two, so that "heavy" is past what either sustains
                # (from one-at-a-time SITS alone, slower than stock Celery here, heavy was
                # ~1.2x Celery's and it kept up, against what the stream is for)
                base = max(out[name][s]["throughput_tps"] for s in ONE_AT_A_TIME)
            on_progress(f"  {name}: " + ", ".join(
                f"{system} {out[name][system]['throughput_tps']}/s p50 "
                f"{out[name][system]['p50_ms']} ms" for system in out[name]))
    result = {name: {s: v[s] for s in SYSTEMS if s in v} for name, v in out.items()}
    inputs = make_texts(BATCH_ROWS, shape.seed + 10)
    batch_ms = in_process_batches(lm_dir, {"one": [TEMPLATE + t for t in inputs],
                                           "mixed": mixed_prompts(inputs)},
                                  ragged_lengths(BATCH_ROWS, shape.seed + 11),
                                  shape.batch_repeats)
    ragged = batch_ms["ragged_batch"]
    r = {**ratios(result), **{
        f"{'template' if name == 'one' else 'mixed'}_batch_shared_vs_unshared":
        ratio(b["shared_ms"], b["unshared_ms"])
        for name, b in batch_ms["template_batch"].items()},
        "ragged_batch_vs_longest": ratio(ragged["ragged_ms"], ragged["longest_ms"])}
    return {**result, "ratios": r, "meta": {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "quick": quick,
        "shape": asdict(shape), "encoder": ENCODER_SHAPE, "lm": LM_SHAPE,
        "gen_tokens": GEN_TOKENS, **batch_ms,
        "rates_per_s": {n: round(load * (base or 0.0), 1) for n, load in LOADS.items()},
        "gen_paced_per_s": round(PACED_GEN_SHARE * result["gen_ragged"]["sits_batched"][
            "throughput_tps"], 1),
        "concurrency": 1, "cpus": available_cpus(), "python": platform.python_version(),
        "host_cpus": os.cpu_count(), "torch": coldstart._version("torch"),
        "targets": targets(r)}}


def table(result: Mapping[str, Any]) -> str:
    lines = [f"{'stream':<13}{'system':<18}{'n':>6}{'tput/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
             f"{'batch':>7}"]
    for stream in STREAMS:
        for name, s in result[stream].items():
            lines.append(f"{stream:<13}{name:<18}{s['n']:>6}{s['throughput_tps']:>9.1f}"
                         f"{s['p50_ms']:>9.1f}{s['p99_ms']:>9.1f}{s['mean_batch']:>7.2f}")
    rates = ", ".join(f"{n} {r}/s" for n, r in result["meta"]["rates_per_s"].items())
    rates += f", gen_paced {result['meta']['gen_paced_per_s']}/s"
    lines.append(f"(p50/p99: submit -> finish; batch: mean tasks per run; paced: {rates}, "
                 "shares of the faster one-at-a-time system's burst throughput; gen_burst: "
                 f"greedy generations of {GEN_TOKENS} tokens, submitted at once; "
                 "gen_template: the same from "
                 "prompts sharing one instruction template; gen_ragged: short prompts "
                 f"asking 1-{RAGGED_MOST} tokens each; gen_paced: such prompts arriving "
                 f"at {PACED_GEN_SHARE:g}x batching's gen_ragged rate)")
    failed = {f"{k}/{n}": s["failed"] for k in STREAMS
              for n, s in result[k].items() if s["failed"]}
    if failed:
        lines.append(f"FAILED tasks: {failed}")
    tb = result["meta"]["template_batch"]
    one, mixed = tb["one"], tb["mixed"]
    lines.append(f"one batch of {one['rows']} template prompts, in-process: "
                 f"{one['shared_ms']} ms sharing the {one['shared_tokens']}-token prefill, "
                 f"{one['unshared_ms']} ms prefilling every row; {mixed['rows']} prompts "
                 f"over 4 templates: {mixed['shared_ms']} ms prefilling each of its "
                 f"{mixed['groups']} groups' template once, {mixed['unshared_ms']} ms "
                 "every row")
    rb = result["meta"]["ragged_batch"]
    lines.append(f"the {rb['rows']} template prompts asking 1-{rb['longest']} tokens each "
                 f"({rb['tokens']} in all), in-process: {rb['ragged_ms']} ms, each row "
                 f"leaving when done; {rb['longest_ms']} ms all asking {rb['longest']}")
    lines.append("ratios: " + ", ".join(f"{k}={v}" for k, v in result["ratios"].items()))
    lines.append(targets_line(result["meta"]["targets"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return coldstart.zoo_main("python -m sits_queue.bench.coalesce", __doc__, run, table,
                              argv)


if __name__ == "__main__":
    sys.exit(main())
