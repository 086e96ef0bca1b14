"""``sitsq``: status, the demo, benchmarks, and Celery commands on the embedded default.

With ``SITS_REDIS_URL`` unset, every command uses (and if needed starts) the private
embedded Redis in the per-user data dir, and points the processes it starts at it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from importlib import import_module
from pathlib import Path
from typing import Any

import click
import redis
from kombu.exceptions import OperationalError

from sits_queue.bench.report import check_json_path
from sits_queue.broker import clock
from sits_queue.broker.keys import QueueKeys, queues_registry, registered_queues
from sits_queue.cache.budgets import settings_from_env
from sits_queue.config import SitsConfig, check_redis_url, redacted
from sits_queue.embedded import resolve_redis_url
from sits_queue.errors import SitsError, missing_extra
from sits_queue.status import (
    format_status,
    json_safe,
    prewarm_status,
    printable,
    queue_status,
    site_status,
    stray_lists,
    workers_status,
)


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
        except ModuleNotFoundError as exc:  # (a benchmark's models: a 64-line traceback)
            if (hint := missing_extra(exc)) is None:
                raise
            raise click.ClickException(f"{exc}: this needs the inference extra: "
                                       f"{hint}") from exc
        except redis.AuthenticationError as exc:  # (a ConnectionError: it was reached)
            raise click.ClickException(f"Redis{_at(ctx)} refused the login: {exc}"
                                       f"{_auth_hint(exc)}") from exc
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
@click.version_option(package_name="sits-queue", prog_name="sitsq")
def main() -> None:
    """SITS queue: priority task queue for offline AI inference on GPU fleets."""


# -- status ----------------------------------------------------------------------------------
@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def status(as_json: bool) -> None:
    """Queues (depth, head tasks with score and class) and the workers seen."""
    config = settings_from_env()
    url = _redis_url()
    client = redis.Redis.from_url(url, socket_timeout=5)
    # (a Redis that does not answer is said by the group, naming the server: _Sitsq)
    queues = queue_status(client, config, clock.now(client))
    report = {"queues": queues, "workers": workers_status(client, config),
              "site": site_status(client, config), "prewarm": prewarm_status(client, config),
              "stray": stray_lists(client, config, [q["queue"] for q in queues])}
    if as_json:
        click.echo(json.dumps(json_safe(report), indent=2, default=str))
        return
    click.echo(format_status(report))


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
                      help="Run on this Redis server: the benchmark runs its systems in "
                      "the URL's database and the next ones (one each, up to 4) and "
                      "FLUSHES them. Default: a private redis-server, "
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
    # A SIGTERM (timeout, a closed session's kill) unwinds the run as Ctrl-C does: its
    # temporary dirs (workers' logs, its private Redis's files) were left behind
    terminated: list[int] = []

    def on_term(signum: int, _frame: Any) -> None:
        terminated.append(signum)
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        rc = import_module(module).main(argv)
    except SystemExit:
        if terminated:
            # and what it started is stopped: one that came while a process was being
            # started (inside Popen, before it returned) left that process running
            import psutil

            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
        raise
    finally:  # (in-process callers, tests, keep their own handler)
        signal.signal(signal.SIGTERM, previous)
    if terminated:
        # (the handler's SystemExit is lost when the signal lands in a finalizer, a
        # __del__ or a weakref callback, where Python ignores it: the run went on to its
        # end, and exited 0 for a run that was told to stop)
        sys.exit(128 + terminated[0])
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

    config = settings_from_env()
    client = redis.Redis.from_url(_redis_url(), socket_timeout=5)
    now = clock.now(client)
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
        click.echo(f"{printable(name)}: {entry['total']} dead letter(s), oldest first")
        for row in entry["oldest"]:
            # (one line each, escaped: a producer's newline split a record, and its
            # terminal escapes reached the terminal)
            age = "?" if row["age_s"] is None else f"{row['age_s']} s ago"
            click.echo(f"  {printable(row['id'])}  {printable(row['task'] or '?')}"
                       f"[{printable(row['task_id'] or '?')}]  {age}"
                       f"  {printable(row['reason'])}")


def _chosen(client: redis.Redis, key: str, ids: tuple[str, ...], every: bool
            ) -> list[bytes | str]:
    if every == bool(ids):
        raise click.UsageError("name the dead letters' ids, or give --all")
    if every:  # as stored: an id that is not UTF-8 is still one to drop or requeue
        return list(client.hkeys(key))
    # an id named twice is one letter; bytes a shell passed that are not UTF-8 (argv's
    # surrogate escapes) are the stored id's bytes, which redis-py cannot encode as text
    named = list(dict.fromkeys(os.fsencode(i) for i in ids))
    return list(dict.fromkeys(_letters_of_tasks(client, key, named)))


def _letters_of_tasks(client: redis.Redis, key: str, ids: list[bytes]) -> list[bytes]:
    """``ids`` with each that is no dead letter's id but a task's (`dead list` shows it in
    brackets, and it is the id a caller knows: it was refused as "no such dead letter")
    replaced by its letter's id; one found as neither stays, to be reported."""
    with client.pipeline(transaction=False) as pipe:
        for message_id in ids:
            pipe.hexists(key, message_id)
        present = pipe.execute()
    wanted = {i for i, there in zip(ids, present, strict=True) if not there}
    if not wanted:
        return ids
    from sits_queue.broker import deadletters

    letters: dict[bytes, list[bytes]] = {}
    for letter, record in client.hscan_iter(key, count=1000):  # (one pass over them)
        task = deadletters.task_of(record)
        if task is not None and (task_id := os.fsencode(task[0])) in wanted:
            letters.setdefault(task_id, []).append(letter)
    for task_id, found in letters.items():
        if len(found) > 1:  # (requeued both, it would run twice)
            raise click.UsageError(
                f"task {printable(os.fsdecode(task_id))} has {len(found)} dead letters ("
                f"{', '.join(sorted(printable(os.fsdecode(f)) for f in found))}): name one")
    return [letters[i][0] if i in letters else i for i in ids]


@dead.command("requeue")
@click.argument("queue")
@click.argument("ids", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Every dead letter of QUEUE.")
def dead_requeue(queue: str, ids: tuple[str, ...], every: bool) -> None:
    """Put dead letters of QUEUE back to run (scored afresh, redelivery count reset)."""
    from sits_queue.app import make_app
    from sits_queue.broker import deadletters

    config = replace(settings_from_env(), redis_url=_redis_url())
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

    config = settings_from_env()
    client = redis.Redis.from_url(_redis_url(), socket_timeout=5)
    _dead_queue(client, config, queue)
    key = QueueKeys.for_queue(queue, config.global_keyprefix).dead
    chosen = _chosen(client, key, ids, every)
    missing = deadletters.drop_each(client, key, chosen)
    click.echo(f"dropped {len(chosen) - len(missing)} of {len(chosen)}")
    for message_id in missing:
        click.echo(f"  {message_id}: no such dead letter (name a letter's id or its task's, "
                   "as `sitsq dead list` shows them)", err=True)
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
    config = replace(settings_from_env(), redis_url=url, metrics_port=port,
                     metrics_addr=addr)
    try:
        server = metrics.serve(config, None, strict=True,
                               queues=lambda c: queue_status(c, config, clock.now(c)),
                               prewarm=lambda c: prewarm_status(c, config))
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
