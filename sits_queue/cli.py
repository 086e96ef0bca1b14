"""``sitsq``: status, the demo, benchmarks, and Celery commands on the embedded default.

With ``SITS_REDIS_URL`` unset, every command uses (and if needed starts) the private
embedded Redis in the per-user data dir, and points the processes it starts at it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from importlib import import_module
from pathlib import Path
from typing import Any

import click
import redis
from kombu.exceptions import OperationalError

from sits_queue.bench.report import check_json_path
from sits_queue.broker import sites
from sits_queue.broker.keys import QueueKeys, decode_score, queues_registry, registered_queues
from sits_queue.broker.meta import WaitingMeta
from sits_queue.checks import stored_number
from sits_queue.config import SitsConfig, check_redis_url, redacted
from sits_queue.embedded import resolve_redis_url
from sits_queue.errors import SitsError

#: Waiting tasks shown per queue by ``sitsq status``.
HEAD_ROWS = 5


def _redis_url() -> str:
    return _resolved()[0]


#: Where the command's Redis URL is kept for :class:`_Sitsq`'s error lines.
_URL_KEY = "sits_queue.redis_url"


def _resolved() -> tuple[str, bool]:
    """The Redis to use, and whether it is the embedded one (then said on stderr)."""
    url, embedded = resolve_redis_url(os.environ)
    if (ctx := click.get_current_context(silent=True)) is not None:
        ctx.meta[_URL_KEY] = url  # for the error line of a Redis that fails
    if embedded:
        click.echo("sitsq: no SITS_REDIS_URL (nor redis_url in SITS_CONFIG) set; using the "
                   f"embedded Redis at {redacted(url)}", err=True)
    return url, embedded


class _Sitsq(click.Group):
    """Our own errors (a bad setting, a missing config file) and a Redis that does not
    answer are the user's to fix: one line naming the problem, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SitsError as exc:
            raise click.ClickException(str(exc)) from exc
        except (redis.ConnectionError, redis.TimeoutError, OperationalError) as exc:
            # redis-py's message names the host and port (or the auth failure), not always
            # (a TLS handshake with a plain server: "Timeout connecting to server"); kombu
            # wraps it in OperationalError where the demo publishes (a server stopped under
            # it ended in a 228-line traceback)
            raise click.ClickException(f"cannot reach Redis{_at(ctx)}: {exc}"
                                       f"{_auth_hint(exc)}") from exc
        except redis.RedisError as exc:  # the server refused: a database out of range, an
            # ACL user without the commands, a key of another type
            raise click.ClickException(f"Redis{_at(ctx)} refused: {exc}"
                                       f"{_auth_hint(exc)}") from exc


def _at(ctx: click.Context) -> str:
    url = ctx.meta.get(_URL_KEY)
    return f" at {redacted(url)}" if url else ""


def _auth_hint(exc: Exception) -> str:
    said = str(exc).lower()
    if isinstance(exc, redis.AuthenticationError) or "auth" in said:
        return " (does the URL carry the right password: redis://:PASSWORD@host:port/db?)"
    return ""


@click.group(cls=_Sitsq)
def main() -> None:
    """SITS queue: priority task queue for offline AI inference on GPU fleets."""


# -- status ----------------------------------------------------------------------------------
def queue_status(client: redis.Redis, config: SitsConfig, now_s: float) -> list[dict[str, Any]]:
    """Per registered queue: depth, unacked, dead letters and the head of the line.

    In three round trips whatever the number of queues (the registry, the counts and
    heads, the heads' records): one after another, seven a queue took a scrape of a
    thousand queues 7 s at a 1 ms round trip, past Prometheus's 10 s default timeout
    once the rest was added."""
    out = []
    members: set[bytes] = client.smembers(  # type: ignore[assignment]
        queues_registry(config.global_keyprefix))
    names = registered_queues(members)
    keys_of = [QueueKeys.for_queue(name, config.global_keyprefix) for name in names]
    with client.pipeline(transaction=False) as pipe:
        for keys in keys_of:
            pipe.zrange(keys.waiting, 0, HEAD_ROWS - 1, withscores=True)
            for command, key in _COUNTED.values():
                getattr(pipe, command)(getattr(keys, key))
        # A key of another type in one queue (another program's) is said on that
        # queue's row: it took the whole status, and the fleet's metrics, down.
        replies = pipe.execute(raise_on_error=False)
    stride = 1 + len(_COUNTED)
    per_queue = []
    for i in range(0, len(replies), stride):
        head, counts = replies[i], dict(zip(_COUNTED, replies[i + 1:i + stride], strict=True))
        errors = [str(r) for r in (head, *counts.values()) if isinstance(r, Exception)]
        per_queue.append(([] if isinstance(head, Exception) else head,
                          {k: None if isinstance(v, Exception) else v
                           for k, v in counts.items()}, errors))
    with client.pipeline(transaction=False) as pipe:
        for keys, (head, _, _) in zip(keys_of, per_queue, strict=True):
            if head:
                pipe.hmget(keys.meta, [m for m, _ in head])
        metas_of = iter(pipe.execute(raise_on_error=False))
    for name, (head, counts, errors) in zip(names, per_queue, strict=True):
        metas = next(metas_of) if head else []
        if isinstance(metas, Exception):
            errors.append(str(metas))
            metas = [None] * len(head)
        rows = []
        for (msg_id, score), raw in zip(head, metas, strict=True):
            prio, seq = decode_score(score) or (None, None)
            row: dict[str, Any] = {"id": msg_id.decode(errors="backslashreplace"),
                                   "priority": None if prio is None else round(prio, 2),
                                   "seq": seq}
            if (meta := WaitingMeta.read(raw)) is not None:
                row.update(task=meta.task, sla_class=meta.options.sla_class,
                           model=meta.options.model,
                           wait_s=stored_number(round(now_s - meta.enqueued_at_s, 2)))
            rows.append(row)
        out.append({"queue": name, **counts, "head": rows,
                    **({"error": "; ".join(errors)} if errors else {})})
    return out


#: What ``queue_status`` counts per queue: field -> (Redis command, QueueKeys attribute).
#: Checkpointed: tasks with a yielded time slice's progress saved (waiting to resume, or
#: running a resumed slice: the checkpoint stays until the task ends, for a crash to
#: resume from); held: tasks a worker released for want of VRAM and holds off a while.
_COUNTED = {"waiting": ("zcard", "waiting"), "unacked": ("zcard", "unacked"),
            "dead": ("hlen", "dead"), "checkpointed": ("hlen", "checkpoints"),
            "held": ("hlen", "held")}


def stray_lists(client: redis.Redis, config: SitsConfig, queues: list[str]) -> dict[str, int]:
    """Messages in plain Redis lists named like queues: what a producer without the SITS
    transport (a stock ``broker_url = redis://...`` app) sends. No SITS worker reads them;
    said here, not left to wait unseen."""
    names = sorted({*queues, "celery"})
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.type(config.global_keyprefix + name)
        kinds = pipe.execute()
    lists = [n for n, kind in zip(names, kinds, strict=True) if kind in (b"list", "list")]
    return {n: int(client.llen(config.global_keyprefix + n)) for n in lists}


def workers_status(client: redis.Redis, config: SitsConfig) -> list[dict[str, Any]]:
    try:
        advertise = import_module("sits_queue.workers.advertise")
    except ImportError:  # pragma: no cover - the worker runtime ships with the package
        return []
    workers: list[dict[str, Any]] = advertise.read_workers(client, config.global_keyprefix)
    return workers


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def status(as_json: bool) -> None:
    """Queues (depth, head tasks with score and class) and the workers seen."""
    config = SitsConfig.from_env()
    url = _redis_url()
    client = redis.Redis.from_url(url, socket_timeout=5)
    # (a Redis that does not answer is said by the group, naming the server: _Sitsq)
    queues = queue_status(client, config, time.time())
    report = {"queues": queues, "workers": workers_status(client, config),
              "site": sites.status(client, config),
              "stray": stray_lists(client, config, [q["queue"] for q in queues])}
    if as_json:
        click.echo(json.dumps(_json_safe(report), indent=2, default=str))
        return
    click.echo(_format_status(report))


def _or_unknown(value: Any) -> Any:
    return "?" if value is None else value


def _json_safe(value: Any) -> Any:
    """``value`` with every float that is not finite as None: JSON has no NaN or inf, and
    a record of another writer's may hold them (``status --json`` printed ``NaN``, which
    a JSON reader refuses)."""
    if isinstance(value, float):
        return stored_number(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _format_status(report: dict[str, Any]) -> str:
    lines = []
    site = report.get("site")
    if site:
        lines.append(_site_line(site))
    if not report["queues"]:
        lines.append("no queues yet (submit a task first)")
    for q in report["queues"]:
        lines.append(f"queue {q['queue']}: {_or_unknown(q['waiting'])} waiting, "
                     f"{_or_unknown(q['unacked'])} running/reserved, "
                     f"{_or_unknown(q['dead'])} dead-lettered, "
                     f"{_or_unknown(q['checkpointed'])} with a yield's progress saved, "
                     f"{_or_unknown(q['held'])} held off by a worker")
        if q.get("error"):
            lines.append(f"  not all of it readable (a key of another program's?): "
                         f"{q['error']}")
        for row in q["head"]:
            prio = "?" if row["priority"] is None else f"{row['priority']:.2f}"
            lines.append(f"  {prio:>12}  {row.get('sla_class') or '?'!s:<8}"
                         f"{row.get('task') or '?'!s:<32}waited {_or_unknown(row.get('wait_s'))} s")
    for name, n in (report.get("stray") or {}).items():
        lines.append(f"warning: {n} message(s) in the plain Redis list {name!r}: sent by a "
                     "producer without the SITS transport (a stock redis:// broker_url); "
                     "no SITS worker reads them. Send with the SITS app (its "
                     "broker_transport) instead.")
    lines.append(f"workers: {len(report['workers'])}")
    for w in report["workers"]:
        try:
            lines.extend(_worker_lines(w))
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as exc:
            # an advertisement of an older, newer or foreign writer: said, not fatal (an
            # int past float's range in a field formatted as a float: OverflowError)
            lines.append(f"  {w.get('hostname', '?')}: advertisement not readable here "
                         f"({type(exc).__name__}: {exc}); see sitsq status --json")
    return "\n".join(lines)


def _site_line(site: dict[str, Any]) -> str:
    age = site.get("last_pass_age_s")
    passed = (f"last sync pass {age} s ago" if age is not None else
              "no sync pass yet (is a beat running? without one, the outbox is not "
              "drained)")
    try:
        last = site["last_pass"] or {}
        peer = (f"replica at {last['peer']} ({last['rtt_ms']} ms; "
                + ", ".join(f"{c} {m}" for c, m in last.get("modes", {}).items()) + ")"
                if last.get("peer") else "no live peer")
        if last.get("errors"):
            peer += f" (last pass: {'; '.join(str(e) for e in last['errors'])})"
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        # a record of another writer's (or version's): said, and the rest still shown
        peer = (f"last pass record not readable here ({type(exc).__name__}: {exc}); "
                "see sitsq status --json")
    return (f"site {site['site']}: {peer}, outbox {site['outbox']}, holding replicas of "
            f"{site['replicas_held'] or 'no site'}; {passed}")


def _worker_lines(w: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    devices = ", ".join(str(d.get("name", "?")) for d in w.get("devices", []))
    cold = w.get("cold_start", {})
    lines.append(f"  {w.get('hostname', '?')}: pid {w.get('pid', '?')}, concurrency "
                 f"{w.get('concurrency', '?')}, devices [{devices}], warm engines "
                 f"{w.get('warm', [])}, cold starts {cold.get('cold', 0)}/"
                 f"{cold.get('tasks', 0)} tasks, {cold.get('affinity_picks', 0)} taken "
                 "ahead by affinity")
    if w.get("plain_tasks_only"):
        lines.append(f"    plain tasks only ({w['plain_tasks_only']} pool): inference "
                     "tasks are left for other workers")
    phases = ", ".join(f"{k} {v:,.1f}" for k, v in cold.get("phases_ms", {}).items())
    if phases:
        lines.append(f"    cold-start ms: {phases}")
    if cold.get("first_tokens"):
        lines.append(f"    first token: {cold['first_token_ms_mean']:,.1f} ms mean over "
                     f"{cold['first_tokens']} generations")
    failed = ", ".join(f"{k} {v}" for k, v in cold.get("failed", {}).items())
    if failed:
        lines.append(f"    failed: {failed}")
    prof = w.get("profile") or {}
    if prof.get("samples"):
        why = f": {prof['why']}" if prof.get("why") else ""
        lines.append(f"    intake {prof['state']}{why}; CPU {prof['cpu_util']:.0%} "
                     f"(burstiness {prof['cpu_burstiness']}), fds "
                     f"{prof['fd_pressure']:.1%} of limit, host memory "
                     f"{prof['mem_available']:.0%} free, disk p95 "
                     f"{prof['io_latency_p95_ms']} ms (skew {prof['io_skew']})")
    return lines


# -- demo ------------------------------------------------------------------------------------
@main.command()
# (bounded: a million jobs take hours, and 10^8 ran out of memory building the list;
# each pool process of the demo's worker is a Python with Celery loaded)
@click.option("--jobs", default=400, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Jobs in the mixed workload.")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1, 256),
              help="Worker pool processes.")
@click.option("--seed", default=7, show_default=True)
def demo(jobs: int, concurrency: int, seed: int) -> None:
    """The main job: a worker and beat on the embedded Redis (or yours: SITS_REDIS_URL),
    a mixed workload across the classes, then a per-class table of waits and
    throughput. Under a key prefix of its own: your queues are not touched."""
    from sits_queue.bench.demo import PREFIX, run_demo

    # Under its prefix on the embedded server too: `sitsq celery ...` keeps the user's
    # own work there, and the demo's worker took their waiting tasks (dead-lettered).
    try:
        run_demo(_redis_url(), jobs=jobs, concurrency=concurrency, seed=seed,
                 echo=click.echo, prefix=PREFIX)
    except (RuntimeError, TimeoutError) as exc:
        # Its worker died or never came up (a bad worker setting: SITS_DEVICE_CACHE_BYTES
        # and the like are read there): what happened and the log's last line, which
        # names the cause, not the log's last 3,000 characters as a traceback.
        said = [line.strip() for line in str(exc).splitlines() if line.strip()]
        head = said[0].rstrip(":") if said else type(exc).__name__
        raise click.ClickException(f"the demo's {head}" + (
            f": {said[-1]}" if len(said) > 1 else "")) from exc


# -- benchmarks ------------------------------------------------------------------------------
@main.group()
def bench() -> None:
    """Benchmark programs: they print a table and JSON; they assert nothing."""


def _checked(check: Callable[[Any], Any]) -> Callable[[click.Context, click.Parameter, Any],
                                                      Any]:
    """A click callback refusing, as a usage error before the run (a full benchmark
    takes minutes), a value ``check`` raises a ValueError for (ConfigError is one)."""
    def callback(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        try:
            return None if value is None else check(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from exc
    return callback


def _bench_options(fn: Any) -> Any:
    fn = click.option("--redis-url", callback=_checked(check_redis_url),
                      help="Run on this Redis server: the benchmark FLUSHES "
                      "the databases it uses there. Default: a private redis-server, "
                      "started and stopped for the run (SITS_REDIS_URL is not used).")(fn)
    fn = click.option("--json", "json_path", type=click.Path(path_type=Path),
                      callback=_checked(check_json_path),
                      help="Also write the JSON result here.")(fn)
    fn = click.option("--quick", is_flag=True,
                      help="A smaller run (seconds to a few minutes).")(fn)
    return fn


#: ``sitsq bench <name>``: the program's module, and its line in ``--help``.
_BENCHES = {
    "ab": ("sits_queue.bench.ab",
           "Stock Celery FIFO vs stock Celery priority vs SITS on one seeded workload."),
    "broker": ("sits_queue.bench.broker",
               "delay() rate, bulk enqueue, pick latency and a rescoring pass at depth."),
    "coldstart": ("sits_queue.bench.coldstart",
                  "Load-per-task vs module LRU vs the SITS two-tier engine cache."),
    "affinity": ("sits_queue.bench.affinity",
                 "A fleet of workers pulling in priority order vs by warm-engine affinity."),
    "prefix": ("sits_queue.bench.prefix", "Shared prompt templates: no KV-prefix cache vs "
               "the cache vs the cache + affinity."),
    "coalesce": ("sits_queue.bench.coalesce", "One text per task: stock Celery vs SITS one "
                 "at a time vs same-model batches."),
    "precision": ("sits_queue.bench.precision", "An encoder and an LM at fp32/fp16/bf16/"
                  "int8: gate KL, memory, speed, closeness."),
    "sites": ("sits_queue.bench.sites",
              "Two sites: enqueue cost per sync mode, and what survives losing a site."),
    "batch": ("sits_queue.bench.batch", "Batched embedding: the throughput/p99 frontier "
              "and the batch-size controller."),
    "dispatch": ("sits_queue.bench.dispatch", "Per-task cost through a worker: stock "
                 "Celery's defaults vs Celery with SITS's guarantees vs SITS."),
    "joins": ("sits_queue.bench.joins", "Continuous batching in-process (GPU if any): "
              "batches run to their end vs rows joining as rows free."),
}


#: The benchmarks with a ``--smoke`` shape (the ones ``ops/gpu_check.sh`` runs).
_SMOKED = frozenset({"coldstart", "affinity", "batch", "precision", "joins"})


def _bench_command(name: str, module: str, summary: str) -> None:
    @bench.command(name, help=summary)
    @_bench_options
    def command(quick: bool, json_path: Path | None, redis_url: str | None,
                smoke: bool = False) -> None:
        if quick and smoke:
            raise click.UsageError("--quick and --smoke are two sizes: give one")
        size = ["--smoke"] if smoke else ["--quick"] if quick else []
        _run_module(module, size, json_path, redis_url)

    if name in _SMOKED:
        click.option("--smoke", is_flag=True,
                     help="The smallest run through every path: it checks a set-up; its "
                          "figures mean nothing.")(command)


for _name, (_module, _summary) in _BENCHES.items():
    _bench_command(_name, _module, _summary)


def _run_module(module: str, size: list[str], json_path: Path | None,
                redis_url: str | None = None) -> None:
    argv = size + (["--json", str(json_path)] if json_path else [])
    argv += ["--redis-url", redis_url] if redis_url else []
    rc = import_module(module).main(argv)
    if rc:
        sys.exit(rc)


# -- celery passthrough ----------------------------------------------------------------------
@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
              add_help_option=False)  # `sitsq celery worker --help` is Celery's help
@click.option("-A", "--app", "app_name", default="sits_queue", show_default=True,
              help="The module that defines your tasks (it imports sits_queue's app).")
@click.argument("command")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def celery(app_name: str, command: str, args: tuple[str, ...]) -> None:
    """Run `celery -A APP COMMAND ...` (any Celery command: worker, beat, flower,
    inspect, control, purge, ...) against the configured or embedded Redis."""
    # Celery's help needs no Redis: the embedded one is not started for it
    helping = "--help" in (command, *args)
    if helping:  # (what this wrapper adds, before Celery's own help)
        click.echo(f"sitsq celery [-A APP] COMMAND ...: celery -A {app_name} COMMAND ... "
                   "against SITS_REDIS_URL, else the embedded Redis (started if need be); "
                   "-A/--app names your tasks' module (default: sits_queue). Celery's "
                   "help follows.\n", err=True)
    env = dict(os.environ) if helping else {**os.environ, "SITS_REDIS_URL": _redis_url()}
    argv = [sys.executable, "-m", "celery", "-A", app_name, command, *args]
    os.execvpe(argv[0], argv, env)


# -- dead letters ----------------------------------------------------------------------------
@main.group()
def dead() -> None:
    """A queue's dead letters (poison, malformed or rejected messages): list them, put
    them back once fixed, or drop them."""


def _dead_queue(client: redis.Redis, config: SitsConfig, queue: str | None) -> list[str]:
    members: set[bytes] = client.smembers(  # type: ignore[assignment]
        queues_registry(config.global_keyprefix))
    names = registered_queues(members)
    if queue is None:
        return names
    if queue not in names:
        raise click.ClickException(f"no queue {queue!r}; queues: {', '.join(names) or 'none'}")
    return [queue]


@dead.command("list")
@click.argument("queue", required=False)
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1),
              help="Records shown per queue, oldest first.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def dead_list(queue: str | None, limit: int, as_json: bool) -> None:
    """Dead letters of QUEUE (default: every queue that has any)."""
    from sits_queue.broker import deadletters

    config = SitsConfig.from_env()
    client = redis.Redis.from_url(_redis_url(), socket_timeout=5)
    now = time.time()
    report: dict[str, dict[str, Any]] = {}
    for name in _dead_queue(client, config, queue):
        key = QueueKeys.for_queue(name, config.global_keyprefix).dead
        try:
            if total := int(client.hlen(key)):
                rows = [d.row(now) for d in deadletters.read(client, key, limit)]
                report[name] = {"total": total, "oldest": rows}
        except redis.ResponseError as exc:  # one queue's key of another type: the rest shown
            report[name] = {"total": None, "oldest": [], "error": str(exc)}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    if not report:
        click.echo("no dead letters")
    for name, entry in report.items():
        if entry.get("error"):
            click.echo(f"{name}: dead letters not readable (a key of another program's?): "
                       f"{entry['error']}")
            continue
        click.echo(f"{name}: {entry['total']} dead letter(s), oldest first")
        for row in entry["oldest"]:
            click.echo(f"  {row['id']}  {row['task']}[{row['task_id']}]  {row['age_s']} s ago"
                       f"  {row['reason']}")


def _chosen(client: redis.Redis, key: str, ids: tuple[str, ...], every: bool
            ) -> list[bytes | str]:
    if every == bool(ids):
        raise click.UsageError("name the dead letters' ids, or give --all")
    if every:  # as stored: an id that is not UTF-8 is still one to drop or requeue
        return list(client.hkeys(key))
    # an id named twice is one letter; bytes a shell passed that are not UTF-8 (argv's
    # surrogate escapes) are the stored id's bytes, which redis-py cannot encode as text
    return list(dict.fromkeys(os.fsencode(i) for i in ids))


@dead.command("requeue")
@click.argument("queue")
@click.argument("ids", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Every dead letter of QUEUE.")
def dead_requeue(queue: str, ids: tuple[str, ...], every: bool) -> None:
    """Put dead letters of QUEUE back to run (scored afresh, redelivery count reset)."""
    from sits_queue.app import make_app
    from sits_queue.broker import deadletters

    config = replace(SitsConfig.from_env(), redis_url=_redis_url())
    client = redis.Redis.from_url(config.redis_url, socket_timeout=5)
    _dead_queue(client, config, queue)
    chosen = _chosen(client, QueueKeys.for_queue(queue, config.global_keyprefix).dead,
                     ids, every)
    app = make_app(config, main="sitsq-dead")
    try:
        with app.connection_for_write() as conn:
            done, refused = deadletters.requeue(conn.default_channel, queue, chosen)
    finally:
        app.close()
    click.echo(f"requeued {len(done)} of {len(chosen)}")
    for message_id, why in refused.items():
        click.echo(f"  {message_id}: {why}", err=True)
    if refused:
        sys.exit(1)


@dead.command("drop")
@click.argument("queue")
@click.argument("ids", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Every dead letter of QUEUE.")
def dead_drop(queue: str, ids: tuple[str, ...], every: bool) -> None:
    """Delete dead letters of QUEUE for good."""
    from sits_queue.broker import deadletters

    config = SitsConfig.from_env()
    client = redis.Redis.from_url(_redis_url(), socket_timeout=5)
    _dead_queue(client, config, queue)
    key = QueueKeys.for_queue(queue, config.global_keyprefix).dead
    chosen = _chosen(client, key, ids, every)
    missing = deadletters.drop_each(client, key, chosen)
    click.echo(f"dropped {len(chosen) - len(missing)} of {len(chosen)}")
    for message_id in missing:
        click.echo(f"  {message_id}: no such dead letter", err=True)
    if missing:
        sys.exit(1)


@main.command("metrics")
@click.option("--port", default=9808, show_default=True, type=click.IntRange(1, 65535))
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
def metrics_command(port: int, addr: str) -> None:
    """Serve Prometheus metrics of every live worker and every queue, from Redis.

    One endpoint for the fleet, for when Prometheus cannot reach each worker's own
    (SITS_METRICS_PORT); runs until interrupted.
    """
    from sits_queue.workers import metrics

    url = _redis_url()
    config = replace(SitsConfig.from_env(), redis_url=url, metrics_port=port,
                     metrics_addr=addr)
    try:
        server = metrics.serve(config, None, strict=True,
                               queues=lambda c: queue_status(c, config, time.time()))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {addr}:{port}: {exc.strerror or exc} "
                                   "(see --port and --addr)") from exc
    host = f"[{addr}]" if ":" in addr else addr  # (an IPv6 address, as a URL writes it)
    click.echo(f"sitsq: serving http://{host}:{server.server_address[1]}/metrics "
               f"(Redis {redacted(url)})", err=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        metrics.stop()


@main.command("redis-url")
def redis_url_command() -> None:
    """Print the Redis URL sitsq uses (the embedded one, started if need be), password
    included, for a program that submits tasks: ``export SITS_REDIS_URL=$(sitsq
    redis-url)``. Without it such a program reads SITS_REDIS_URL like a worker does, and
    unset, uses redis://localhost:6379/0, not the embedded server."""
    url, _ = resolve_redis_url(os.environ)
    check_redis_url(url)
    click.echo(url)


@main.command("stop-redis")
def stop_redis() -> None:
    """Stop the embedded Redis started by earlier sitsq commands (its data is kept)."""
    from sits_queue.embedded import stop_server

    click.echo("stopped" if stop_server() else "no embedded Redis was running")


if __name__ == "__main__":
    main()
