"""``sitsq bench batch``: the throughput/latency frontier of batched embedding across
batch sizes (MISSION §2.4), and the dynamic batch-size controller (§1.2) run against it.

A program, not a test: it prints a table and JSON, and asserts nothing about timings.

* the model: a BERT-style encoder (4 layers x 256, random weights, built locally and
  loaded through the engine loader), on the GPU when there is one, else the CPU;
* the frontier: for each batch size 1..256, warm-up batches then timed ones, through
  ``sits_queue.workers.inference.embed``; throughput (texts/s) and p99 batch latency per
  size, and which sizes are Pareto-optimal (no other size has both more throughput and
  a lower p99);
* the controller: large ``embed`` calls as a worker runs them (the child's ``Batcher``
  with the configured p95 target), from a cold start: the sizes it chose, the p95 of its
  batches once it settled, and its throughput against the best fixed size whose p99
  meets the target.
"""

from __future__ import annotations

import os
import platform
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sits_queue.bench import coldstart
from sits_queue.bench.report import ratio, targets_line
from sits_queue.bench.workload import percentile
from sits_queue.config import SitsConfig
from sits_queue.workers import batching
from sits_queue.workers import runtime as rt
from sits_queue.workers.batching import Batcher, BatchPolicy, Point

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ENCODER = {"n_layer": 4, "hidden": 256, "n_head": 4, "n_positions": 128}
#: Batches the controller runs before its p95 is read (it explores, then settles).
SETTLE_BATCHES = 8
#: Targets (printed, never asserted).
TARGET_P95_SLACK = 1.1  # the controller's p95 within 10% of the target
TARGET_THROUGHPUT_VS_BEST = 0.8


@dataclass(frozen=True)
class Shape:
    #: Timed batches per size (after one warm-up batch).
    batches_per_size: int
    #: ``embed`` calls the controller serves, and texts per call.
    controller_calls: int
    texts_per_call: int = 512
    seed: int = 13


QUICK = Shape(batches_per_size=4, controller_calls=3)
FULL = Shape(batches_per_size=16, controller_calls=10)
#: ``--smoke``.
SMOKE = Shape(batches_per_size=1, controller_calls=1, texts_per_call=96)


def texts(n: int, seed: int) -> list[str]:
    """``n`` distinct short documents (distinct: no cache could serve them)."""
    from sits_queue.models.tiny import corpus

    sentences = corpus(300, seed=seed)
    rng = random.Random(seed)
    return [f"{i}: {rng.choice(sentences)} {rng.choice(sentences)}" for i in range(n)]


def frontier(engine: Any, shape: Shape, device: str) -> list[Point]:
    from sits_queue.workers.inference import embed

    points = []
    docs = texts(sum(SIZES) * (shape.batches_per_size + 1), shape.seed)
    cursor = 0
    for size in SIZES:
        latencies = []
        for i in range(shape.batches_per_size + 1):
            batch, cursor = docs[cursor:cursor + size], cursor + size
            began = time.perf_counter()
            embed(engine, batch)
            _sync(device)
            if i:  # the first batch of a size warms up its kernels
                latencies.append((time.perf_counter() - began) * 1000)
        points.append(Point(size, round(size * len(latencies) / (sum(latencies) / 1000), 1),
                            round(percentile(latencies, 99), 2)))
    return batching.pareto(points)


def controller(engine: Any, shape: Shape, target_ms: float) -> dict[str, Any]:
    from sits_queue.workers.inference import embed

    batcher = Batcher(BatchPolicy(target_p95_ms=target_ms))
    active = rt.ActiveTask("encoder", SitsConfig().quota("high"), engine.size_bytes(),
                           "bench", batcher=batcher)
    docs = texts(shape.controller_calls * shape.texts_per_call, shape.seed + 1)
    began = time.perf_counter()
    with rt.activated(active):
        for c in range(shape.controller_calls):
            embed(engine, docs[c * shape.texts_per_call:(c + 1) * shape.texts_per_call])
    seconds = time.perf_counter() - began
    samples = list(batcher.state.samples)
    settled = samples[SETTLE_BATCHES:] or samples
    return {"sizes": [s.size for s in samples],
            "settled_size_p50": percentile([s.size for s in settled], 50),
            "settled_p95_ms": round(percentile([s.latency_ms for s in settled], 95), 2),
            "throughput": round(len(docs) / seconds, 1), "batches": len(samples)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def best_under(points: list[Point], target_ms: float) -> Point | None:
    """The fastest fixed size whose p99 meets the target."""
    fits = [p for p in points if p.p99_ms <= target_ms]
    return max(fits, key=lambda p: p.throughput) if fits else None


def run(quick: bool = False, redis_url: str | None = None, *, shape: Shape | None = None,
        zoo_root: Path | None = None, on_progress: Callable[[str], None] = print
        ) -> dict[str, Any]:
    """The frontier and the controller; the result the JSON holds (no Redis involved:
    ``redis_url`` is accepted for the common command line and unused)."""
    import torch

    from sits_queue.models.tiny import build_tiny_encoder

    shape = shape or (QUICK if quick else FULL)
    engine, device = coldstart.on_device("encoder", build_tiny_encoder(
        (zoo_root or coldstart.default_zoo()) / "batch-encoder", seed=shape.seed, **ENCODER))
    target = SitsConfig().batch_target_p95_ms
    on_progress(f"batch: encoder {ENCODER} on {device}, sizes {SIZES}")
    points = frontier(engine, shape, device)
    ctl = controller(engine, shape, target)
    best = best_under(points, target)
    vs_best = ratio(ctl["throughput"], best.throughput) if best else None
    met = {f"controller_p95<={TARGET_P95_SLACK}x_target":
           ctl["settled_p95_ms"] <= TARGET_P95_SLACK * target,
           f"throughput_vs_best_fixed>={TARGET_THROUGHPUT_VS_BEST}":
           vs_best is not None and vs_best >= TARGET_THROUGHPUT_VS_BEST}
    return {"points": [asdict(p) for p in points], "controller": ctl,
            "best_fixed_under_target": asdict(best) if best else None,
            "ratios": {"controller_throughput_vs_best_fixed": vs_best},
            "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "quick": quick, "shape": asdict(shape), "encoder": ENCODER,
                     "device": device, "target_p95_ms": target,
                     "torch_threads": torch.get_num_threads(),
                     "python": platform.python_version(), "cpus": os.cpu_count(),
                     "torch": coldstart._version("torch"), "targets": met}}


def table(result: Mapping[str, Any]) -> str:
    lines = [f"{'batch':>6}{'texts/s':>10}{'p99 ms':>9}  pareto"]
    for p in result["points"]:
        lines.append(f"{p['batch']:>6}{p['throughput']:>10.1f}{p['p99_ms']:>9.2f}  "
                     f"{'*' if p['pareto'] else ''}")
    ctl, meta = result["controller"], result["meta"]
    best = result["best_fixed_under_target"]
    lines.append(f"controller (target p95 {meta['target_p95_ms']:g} ms): sizes "
                 f"{ctl['sizes'][:12]}{' ...' if len(ctl['sizes']) > 12 else ''}; settled "
                 f"at {ctl['settled_size_p50']:g}, p95 {ctl['settled_p95_ms']} ms, "
                 f"{ctl['throughput']} texts/s")
    lines.append("best fixed size under the target: "
                 + (f"{best['batch']} ({best['throughput']} texts/s, p99 {best['p99_ms']} ms)"
                    if best else "none"))
    lines.append(f"device {meta['device']}, {meta['torch_threads']} torch threads")
    lines.append("ratios: " + ", ".join(f"{k}={v}" for k, v in result["ratios"].items()))
    lines.append(targets_line(meta["targets"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return coldstart.zoo_main("python -m sits_queue.bench.batch", __doc__, run, table, argv,
                              smoke={"shape": SMOKE})


if __name__ == "__main__":
    sys.exit(main())
