"""``sitsq bench prefix``: offline jobs that share prompt templates, through a fleet of
SITS workers (a) without the KV-prefix cache, (b) with it, pulling in priority order, and
(c) with it, pulling by prefix affinity too (a worker takes first the tasks whose prompt
prefix it holds KV for: ``prefix_key``, ``broker/affinity.py``).

A program, not a test: it prints a table and JSON, and asserts nothing about timings.

How it runs (same for all, one after another, in one process run):

* one Redis server (embedded unless ``--redis-url``), one database per system;
* ``workers`` ``celery worker`` subprocesses (prefork, concurrency 1, each on its own
  cores), the app of ``sitsq bench coldstart`` with one causal LM (4 layers, 256 wide,
  1,024 positions; random weights, built locally);
* the stream: each request is one of ``templates`` long instruction templates (about
  440 tokens; Zipf popularity, seeded) followed by its own short input, and asks for
  ``max_new_tokens`` tokens (scoring and classification jobs: prefill-heavy);
* each child's KV-prefix budget holds about :data:`TEMPLATES_PER_BUDGET` templates'
  KV, so one worker cannot hold them all while the fleet can;
* every worker first serves one short warm-up request (nothing to cache), then the
  whole stream is submitted at once, every request at one priority
  (:data:`INPUT_ENTROPY` declared), so they run in arrival order, templates interleaved.

``cached share``: prompt tokens whose KV came from the prefix cache, over all prompt
tokens. ``svc p50``: start to finish of one task (prefill + decode), ms.
"""

from __future__ import annotations

import math
import os
import platform
import random
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sits_queue.bench import coldstart
from sits_queue.bench.affinity import available_cpus, cpu_sets, run_system
from sits_queue.bench.coldstart import Request
from sits_queue.bench.report import database_url, ratio, redis_server
from sits_queue.bench.workload import percentile
from sits_queue.config import SitsConfig

SYSTEMS = ("no_prefix_cache", "prefix_cache", "prefix_affinity")
DATABASES = {"no_prefix_cache": 0, "prefix_cache": 1, "prefix_affinity": 2}
MODEL = "tiny-lm-0"
#: The model: big enough that prefill dominates a short decode on a CPU core.
MODEL_SHAPE = {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 1024}
#: Each child's prefix budget, in templates' KV: fewer than the templates, on purpose.
TEMPLATES_PER_BUDGET = 2.2
WARMUP_PROMPT = "warm up"
#: Declared on every request, so all rank alike and run in arrival order, templates
#: interleaved (as when many producers submit at once). Left to be measured, a prompt's
#: byte entropy is mostly its template's, so SITS's priority order would group the
#: templates by itself and hide what affinity adds.
INPUT_ENTROPY = 0.5
#: Targets (printed, never asserted): the cache must pay for itself, and affinity must
#: add to it (more of the prompts served from cache, no less throughput).
TARGET_THROUGHPUT_VS_NONE = 1.2
TARGET_CACHED_SHARE_GAIN = 1.1


@dataclass(frozen=True)
class Shape:
    workers: int
    templates: int
    n_requests: int
    max_new_tokens: int = 2
    #: Characters of each template (about 4.5 per token with this tokenizer).
    template_chars: int = 2000
    zipf_exponent: float = 1.0
    seed: int = 11

    def __post_init__(self) -> None:
        if self.workers < 2 or self.templates <= self.workers:
            raise ValueError("need >= 2 workers and more templates than workers")
        if self.n_requests < 1 or self.max_new_tokens < 1:
            raise ValueError("n_requests and max_new_tokens must be >= 1")


QUICK = Shape(workers=2, templates=5, n_requests=120)
FULL = Shape(workers=2, templates=6, n_requests=480)


def templates(shape: Shape) -> list[str]:
    """Long instruction templates, each starting differently (so each has its own
    automatic ``prefix_key``)."""
    from sits_queue.models.tiny import corpus

    sentences = corpus(400, seed=shape.seed)
    out = []
    for t in range(shape.templates):
        rng = random.Random(shape.seed * 1000 + t)
        text = f"Template {t}: follow these rules."
        while len(text) < shape.template_chars:
            text += " " + rng.choice(sentences)
        out.append(text[:shape.template_chars])
    return out


def make_stream(shape: Shape, texts: Sequence[str]) -> tuple[Request, ...]:
    """The seeded stream: a template by Zipf popularity, then the request's own input."""
    from sits_queue.models.tiny import corpus

    weights = coldstart.popularity([str(i) for i in range(len(texts))], shape.seed,
                                   shape.zipf_exponent)
    names, probs = list(weights), list(weights.values())
    rng = random.Random(shape.seed + 1)
    inputs = corpus(200, seed=shape.seed + 2)
    return tuple(Request(i, MODEL, f"{texts[int(rng.choices(names, probs)[0])]}\n"
                                   f"Input {i}: {rng.choice(inputs)}")
                 for i in range(shape.n_requests))


def kv_bytes_per_token() -> int:
    """Key and value, every layer, fp32: what one cached position costs."""
    return 2 * MODEL_SHAPE["n_layer"] * MODEL_SHAPE["n_embd"] * 4


# -- statistics (pure) ---------------------------------------------------------------------

def summarise(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if not r.get("error")]
    prompt = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    cached = sum(int(r.get("cached_tokens") or 0) for r in ok)
    latency = [(r["fin"] - r["sub"]) * 1000 for r in ok]
    service = [(r["fin"] - r["start"]) * 1000 for r in ok if r.get("start") is not None]
    span = (max(r["fin"] for r in ok) - min(r["sub"] for r in ok)) if ok else 0.0
    return {
        "n": len(ok), "failed": len(records) - len(ok),
        "cached_share": round(cached / prompt, 4) if prompt else 0.0,
        "hit_share": round(sum(1 for r in ok if r.get("cached_tokens")) / len(ok), 4)
        if ok else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "service_p50_ms": round(percentile(service, 50), 1),
        "service_p99_ms": round(percentile(service, 99), 1),
        "p50_ms": round(percentile(latency, 50), 1),
        "p99_ms": round(percentile(latency, 99), 1),
        "throughput_tps": round(len(ok) / span, 2) if span > 0 else 0.0,
        "per_worker": dict(sorted(
            (h, sum(1 for r in ok if r.get("host") == h))
            for h in {str(r.get("host")) for r in ok})),
        "errors": sorted({str(r["error"]) for r in records if r.get("error")})[:5],
    }


def ratios(systems: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    none, cache, aff = (systems[s] for s in SYSTEMS)
    return {
        "throughput_vs_no_cache": ratio(aff["throughput_tps"], none["throughput_tps"]),
        "throughput_vs_cache_alone": ratio(aff["throughput_tps"], cache["throughput_tps"]),
        "cache_alone_throughput_vs_no_cache": ratio(cache["throughput_tps"],
                                                  none["throughput_tps"]),
        "cached_share_vs_cache_alone": ratio(aff["cached_share"], cache["cached_share"]),
    }


def targets(r: Mapping[str, float | None]) -> dict[str, bool]:
    tput, share = r["throughput_vs_no_cache"], r["cached_share_vs_cache_alone"]
    return {f"throughput_vs_no_cache>={TARGET_THROUGHPUT_VS_NONE}":
            tput is not None and tput >= TARGET_THROUGHPUT_VS_NONE,
            f"cached_share_vs_cache_alone>={TARGET_CACHED_SHARE_GAIN}":
            share is not None and share >= TARGET_CACHED_SHARE_GAIN}


# -- the program ---------------------------------------------------------------------------

def system_url(base_url: str, system: str) -> str:
    return database_url(base_url, DATABASES[system])


def settings_of(system: str, prefix_budget: int) -> tuple[dict[str, Any], dict[str, str]]:
    """(``SitsConfig`` settings, environment) of a system's workers."""
    budget = "0" if system == "no_prefix_cache" else str(prefix_budget)
    settings: dict[str, Any] = {}
    if system == "prefix_cache":
        settings["affinity_prefix_weight"] = 0.0  # one model: plain priority order
    return settings, {"SITS_KV_PREFIX_CACHE_BYTES": budget}


def run(quick: bool = False, redis_url: str | None = None, *, shape: Shape | None = None,
        zoo_root: Path | None = None, on_progress: Callable[[str], None] = print
        ) -> dict[str, Any]:
    """The three systems on one stream; the result the JSON holds."""
    from sits_queue.models.tiny import build_tiny_causal_lm

    shape = shape or (QUICK if quick else FULL)
    zoo = (zoo_root or coldstart.default_zoo()) / "prefix-lm"
    build_tiny_causal_lm(zoo / MODEL, seed=shape.seed, **MODEL_SHAPE)
    texts = templates(shape)
    stream = make_stream(shape, texts)
    size = coldstart.weights_bytes(zoo / MODEL)
    budgets = (math.ceil(size * 2), math.ceil(size * 2))  # the engine always fits
    # a template is ~template_chars / 4.5 tokens (measured: 440 tokens for 2,000)
    template_kv = int(shape.template_chars / 4.5 * kv_bytes_per_token())
    prefix_budget = int(template_kv * TEMPLATES_PER_BUDGET)
    on_progress(f"prefix: {shape.workers} workers, {shape.templates} templates, "
                f"{len(stream)} requests, prefix budget {prefix_budget} bytes per child")
    records: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="sits-bench-prefix-") as tmp, \
            redis_server(redis_url, len(DATABASES)) as url:
        for name in SYSTEMS:
            settings, env = settings_of(name, prefix_budget)
            records[name] = run_system(
                name, stream, MODEL, system_url(url, name), zoo, budgets,
                (shape.workers, shape.max_new_tokens), Path(tmp) / name, on_progress,
                settings=settings, extra_env=env, warmup_prompt=WARMUP_PROMPT,
                submit_options={"input_entropy": INPUT_ENTROPY})
    systems = {name: summarise(recs) for name, recs in records.items()}
    r = ratios(systems)
    return {"systems": systems, "ratios": r, "meta": {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "quick": quick,
        "shape": asdict(shape), "model": {"name": MODEL, **MODEL_SHAPE, "bytes": size},
        "prefix_budget_bytes_per_child": prefix_budget, "template_kv_bytes": template_kv,
        "affinity": asdict(SitsConfig().affinity), "concurrency": 1,
        "cpus_per_worker": cpu_sets(shape.workers, available_cpus()),
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "torch": coldstart._version("torch"), "targets": targets(r)}}


def table(result: Mapping[str, Any]) -> str:
    lines = [f"{'system':<18}{'n':>5}{'cached %':>10}{'hits %':>8}{'svc p50':>9}"
             f"{'p50 ms':>9}{'p99 ms':>9}{'tput/s':>8}"]
    for name, s in result["systems"].items():
        lines.append(f"{name:<18}{s['n']:>5}{s['cached_share'] * 100:>10.1f}"
                     f"{s['hit_share'] * 100:>8.1f}{s['service_p50_ms']:>9.1f}"
                     f"{s['p50_ms']:>9.0f}{s['p99_ms']:>9.0f}{s['throughput_tps']:>8.2f}")
    meta = result["meta"]
    lines.append("(cached: prompt tokens not prefilled; hits: tasks that found a prefix; "
                 "svc: start -> finish; p50/p99: submit -> finish)")
    lines.append(f"{meta['shape']['workers']} workers x concurrency 1, "
                 f"{meta['shape']['templates']} templates of {meta['shape']['template_chars']}"
                 f" characters, prefix budget {meta['prefix_budget_bytes_per_child']} bytes "
                 f"per child (~{TEMPLATES_PER_BUDGET} templates)")
    return "\n".join(lines + coldstart.footer(result))


def main(argv: list[str] | None = None) -> int:
    return coldstart.zoo_main("python -m sits_queue.bench.prefix", __doc__, run, table, argv)


if __name__ == "__main__":
    sys.exit(main())
