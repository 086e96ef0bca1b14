"""``sitsq bench sites``: what priority sync between sites (§2.3) costs a producer and
what it saves when a site is lost, with two real Redis servers on this machine.

A program, not a test: it prints a table and JSON, and asserts nothing about timings.

* **enqueue**: one seeded mix of tasks (10% high, 20% medium, 70% low) submitted with
  ``apply_async`` by a producer of site "a", three ways: one site (no peers), a near peer
  (RTT pinned at 1 ms: high replicated in the enqueue, medium/low by the pass) and a far
  peer (40 ms: high and medium by the pass, low not at all). Per class: submissions/s
  and p99 enqueue latency. The peer is on this machine, so the "near" figures are the
  real cost of a synchronous replica over loopback (the RTT is pinned only to choose
  the mode, no delay is added).
* **failover**: site "a" enqueues the mix, runs its sync pass once, and is lost (its
  Redis stopped). Site "b" runs its pass every ``site_sync_interval_s`` until it takes
  a's work over. Per class: tasks that were waiting at a, and tasks now waiting at b;
  and the time from the loss to the take-over (``site_dead_after_s`` bounds it).
"""

from __future__ import annotations

import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

from sits_queue.app import make_app
from sits_queue.bench.report import ratio, run_main, targets_line
from sits_queue.bench.workload import percentile
from sits_queue.broker import sites
from sits_queue.broker.keys import QueueKeys
from sits_queue.broker.meta import sla_class_of
from sits_queue.config import SitsConfig
from sits_queue.embedded import EmbeddedRedis

CLASSES = ("high", "medium", "low")
MIX = (0.1, 0.2, 0.7)
SETUPS = {"one_site": None, "near_peer": 1.0, "far_peer": 40.0}
TASK = "bench.sites.job"
SYNC_INTERVAL_S = 0.5
DEAD_AFTER_S = 2.0
#: Targets (printed, never asserted): a near peer's synchronous replica must not halve
#: the top class's enqueue rate, and a lost site must lose no replicated task.
TARGET_NEAR_HIGH_RATE = 0.5


@dataclass(frozen=True)
class Shape:
    tasks: int
    seed: int = 23


QUICK = Shape(tasks=1000)
FULL = Shape(tasks=5000)


def mix(shape: Shape) -> list[str]:
    rng = random.Random(shape.seed)
    return rng.choices(CLASSES, weights=MIX, k=shape.tasks)


def producer(url: str, peer_url: str | None, rtt_ms: float | None) -> Any:
    settings: dict[str, Any] = {"redis_url": url, "site_sync_interval_s": SYNC_INTERVAL_S,
                                "site_dead_after_s": DEAD_AFTER_S}
    if peer_url is not None:
        settings.update(site="a", site_peers=f"b={peer_url}?rtt_ms={rtt_ms}")
    app = make_app(SitsConfig(**settings), main=f"bench-sites-{rtt_ms}")

    @app.task(name=TASK, shared=False, ignore_result=True)  # type: ignore[untyped-decorator]
    def job(i: int) -> int:
        return i

    return app


def enqueue(app: Any, classes: list[str]) -> dict[str, Any]:
    """Submit the mix; per class, submissions/s and p99 latency of one ``apply_async``."""
    task = app.tasks[TASK]
    lat: dict[str, list[float]] = {c: [] for c in CLASSES}
    with app.producer_or_acquire() as prod:
        # connections, links; in a queue of its own, out of the failover's count (the
        # table said 3,503 low of 5,001 submissions)
        task.apply_async((-1,), sla_class="low", producer=prod, queue="bench-warm-up")
        for i, sla_class in enumerate(classes):
            began = time.perf_counter()
            task.apply_async((i,), sla_class=sla_class, producer=prod)
            lat[sla_class].append(time.perf_counter() - began)
    return {c: {"n": len(v), "rate_per_s": round(len(v) / sum(v), 1) if v else 0.0,
                "p99_ms": round(percentile([x * 1000 for x in v], 99), 3)}
            for c, v in lat.items()}


def waiting_by_class(client: redis.Redis, queue: str = "celery") -> dict[str, int]:
    keys = QueueKeys.for_queue(queue)
    out = dict.fromkeys(CLASSES, 0)
    for _, raw in client.hscan_iter(keys.meta):
        c = sla_class_of(raw)
        if c in out:
            out[c] += 1
    return out


def failover(tmp: Path, classes: list[str], rtt_ms: float) -> dict[str, Any]:
    """Site a (peer b at ``rtt_ms``) enqueues, syncs once, and is lost; b takes over."""
    with EmbeddedRedis(tmp / f"b-{rtt_ms}") as b_server:
        a_server = EmbeddedRedis(tmp / f"a-{rtt_ms}")
        a_url = a_server.start()
        try:
            app_a = producer(a_server.url, b_server.url, rtt_ms)
            enqueue(app_a, classes)
            sync_a = sites.for_config(app_a.sits)
            assert sync_a is not None
            sync_a.sync_pass()
            before = waiting_by_class(redis.Redis.from_url(a_server.url))
            app_a.close()
        finally:
            a_server.stop()  # the site is lost
        lost_at = time.monotonic()
        config_b = SitsConfig(redis_url=b_server.url, site="b",
                              site_peers=f"a={a_url}?rtt_ms={rtt_ms}",
                              site_sync_interval_s=SYNC_INTERVAL_S,
                              site_dead_after_s=DEAD_AFTER_S)
        sync_b = sites.SiteSync(config_b)
        taken = 0
        deadline = lost_at + 10 * DEAD_AFTER_S
        while not taken and time.monotonic() < deadline:
            taken = sync_b.sync_pass().taken_over
            if not taken:
                time.sleep(SYNC_INTERVAL_S)
        after = waiting_by_class(redis.Redis.from_url(b_server.url))
        took_s = round(time.monotonic() - lost_at, 2) if taken else None
    return {"waiting_at_a": before, "waiting_at_b_after": after, "taken_over": taken,
            "takeover_s": took_s,
            "survived_share": {c: round(after[c] / before[c], 4) if before[c] else None
                               for c in CLASSES}}


def run(quick: bool = False, redis_url: str | None = None, *, shape: Shape | None = None,
        on_progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Enqueue three ways, then two failover drills (``redis_url`` unused: it needs two
    servers of its own)."""
    shape = shape or (QUICK if quick else FULL)
    classes = mix(shape)
    result: dict[str, Any] = {"enqueue": {}, "failover": {}}
    with tempfile.TemporaryDirectory(prefix="sits-bench-sites-") as tmp_dir:
        tmp = Path(tmp_dir)
        for name, rtt in SETUPS.items():
            with EmbeddedRedis(tmp / f"{name}-a") as a, EmbeddedRedis(tmp / f"{name}-b") as b:
                app = producer(a.url, None if rtt is None else b.url, rtt)
                result["enqueue"][name] = enqueue(app, classes)
                app.close()
            sites._syncs.clear()
            on_progress(f"  enqueue {name}: " + ", ".join(
                f"{c} {v['rate_per_s']}/s" for c, v in result["enqueue"][name].items()))
        for name in ("near_peer", "far_peer"):
            rtt = SETUPS[name]
            assert rtt is not None
            result["failover"][name] = failover(tmp, classes, rtt)
            sites._syncs.clear()
            on_progress(f"  failover {name}: {result['failover'][name]['survived_share']}")
    enq = result["enqueue"]
    r = {f"{setup}_{c}_rate_vs_one_site": ratio(enq[setup][c]["rate_per_s"],
                                                enq["one_site"][c]["rate_per_s"])
         for setup in ("near_peer", "far_peer") for c in CLASSES}
    result["ratios"] = r
    near, far = result["failover"]["near_peer"], result["failover"]["far_peer"]
    targets = {f"near_high_rate_vs_one_site>={TARGET_NEAR_HIGH_RATE}":
               (r["near_peer_high_rate_vs_one_site"] or 0) >= TARGET_NEAR_HIGH_RATE,
               "near_peer_lost_no_task": all(v == 1.0 for v in near["survived_share"].values()
                                             if v is not None),
               "far_peer_kept_high_and_medium": far["survived_share"]["high"] == 1.0
               and far["survived_share"]["medium"] == 1.0}
    result["meta"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "quick": quick,
        "shape": asdict(shape), "setups_rtt_ms": SETUPS, "sync_interval_s": SYNC_INTERVAL_S,
        "dead_after_s": DEAD_AFTER_S, "python": platform.python_version(),
        "cpus": os.cpu_count(), "targets": targets}
    return result


def table(result: Mapping[str, Any]) -> str:
    lines = [f"{'enqueue':<11}" + "".join(f"{c + ' /s':>12}{c + ' p99':>12}"
                                          for c in CLASSES)]
    for name, per in result["enqueue"].items():
        lines.append(f"{name:<11}" + "".join(f"{per[c]['rate_per_s']:>12.1f}"
                                             f"{per[c]['p99_ms']:>10.3f}ms" for c in CLASSES))
    lines.append(f"{'failover':<11}" + "".join(f"{c:>14}" for c in CLASSES) + "   take-over")
    for name, f in result["failover"].items():
        cells = "".join(f"{f['waiting_at_b_after'][c]:>6}/{f['waiting_at_a'][c]:<7}"
                        for c in CLASSES)
        lines.append(f"{name:<11}{cells}   {f['takeover_s']} s after the loss")
    lines.append("(failover: tasks waiting at b after the take-over / waiting at a when it "
                 "was lost)")
    lines.append("ratios: " + ", ".join(f"{k}={v}" for k, v in result["ratios"].items()))
    lines.append(targets_line(result["meta"]["targets"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_main("python -m sits_queue.bench.sites", __doc__, run, table, argv)


if __name__ == "__main__":
    sys.exit(main())
