"""What ``sitsq status`` reads and shows: each queue's depth and head tasks, the plain
Redis lists a stock producer filled, the live workers and the site's sync; as JSON, or
as lines of text (``format_status``)."""

from __future__ import annotations

import json
from importlib import import_module
from typing import Any

import redis

from sits_queue.broker import clock as redis_clock
from sits_queue.broker.keys import (
    QueueKeys,
    decode_score,
    last_pass_key,
    origins_key,
    outbox_key,
    queues_registry,
    registered_queues,
    replica_keys,
    replica_queues_key,
    taken_key,
)
from sits_queue.broker.meta import WaitingMeta, wait_start
from sits_queue.checks import is_positive, stored_number, text
from sits_queue.config import SitsConfig
from sits_queue.workers.devices import label

#: Waiting tasks shown per queue by ``sitsq status``.
HEAD_ROWS = 5
#: Models shown in the pre-warm lines, most predicted demand first (all in ``--json``).
PREWARM_ROWS = 8


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
        if isinstance(counts["held"], list):
            counts["held"] = holds_in_force(counts["held"], now_s)
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
                # (a task with an ETA waits from when it falls due: not yet, none)
                due_in = wait_start(meta.enqueued_at_s, meta.due_s) - now_s
                row.update(task=meta.task, task_id=meta.task_id,
                           sla_class=meta.options.sla_class, model=meta.options.model,
                           wait_s=0.0 if due_in > 0 else stored_number(round(-due_in, 2)))
                if due_in > 0:
                    row["due_in_s"] = stored_number(round(due_in, 2))
            rows.append(row)
        out.append({"queue": name, **counts, "head": rows,
                    **({"error": "; ".join(errors)} if errors else {})})
    return out


#: What ``queue_status`` counts per queue: field -> (Redis command, QueueKeys attribute).
#: Checkpointed: tasks with a yielded time slice's progress saved (waiting to resume, or
#: running a resumed slice: the checkpoint stays until the task ends, for a crash to
#: resume from); held: tasks a worker released (for want of VRAM, a rate limit's token)
#: and holds off from itself until a time not yet passed (:func:`holds_in_force`).
_COUNTED = {"waiting": ("zcard", "waiting"), "unacked": ("zcard", "unacked"),
            "dead": ("hlen", "dead"), "checkpointed": ("hlen", "checkpoints"),
            "held": ("hvals", "held")}


def holds_in_force(records: list[bytes], now_s: float) -> int:
    """How many of a queue's hold records (``release.lua``'s ``"<consumer> <until>
    <releases>"``, one per consumer that gave the message back) still hold their message
    off from some worker: a record outlives its hold, to count the releases, and a dead
    worker's stayed counted as holding for good."""
    held = 0
    for record in records:
        parts = record.split()
        tills = parts[1::3]
        try:
            held += any(float(till) > now_s for till in tills)
        except ValueError:
            continue
    return held


#: kombu's Redis transport keeps a message sent with a priority above 0 in a list of its
#: own: the queue's name, this separator, the priority step (3, 6 and 9 by default; an
#: app's ``priority_steps`` may use any of 1-9).
KOMBU_PRIORITY_SEP = "\x06\x16"
KOMBU_PRIORITIES = range(1, 10)


def stray_lists(client: redis.Redis, config: SitsConfig, queues: list[str]) -> dict[str, int]:
    """Messages in plain Redis lists named like queues, their priority lists included:
    what a producer without the SITS transport (a stock ``broker_url = redis://...`` app)
    sends. No SITS worker reads them; said here, not left to wait unseen."""
    lists = [(name, config.global_keyprefix + name + suffix)
             for name in sorted({*queues, "celery"})
             for suffix in ("", *(f"{KOMBU_PRIORITY_SEP}{p}" for p in KOMBU_PRIORITIES))]
    with client.pipeline(transaction=False) as pipe:
        for _, key in lists:
            pipe.type(key)
        kinds = pipe.execute()
    found = [(name, key) for (name, key), kind in zip(lists, kinds, strict=True)
             if kind in (b"list", "list")]
    with client.pipeline(transaction=False) as pipe:
        for _, key in found:
            pipe.llen(key)
        lengths = pipe.execute()
    out: dict[str, int] = {}
    for (name, _), n in zip(found, lengths, strict=True):
        out[name] = out.get(name, 0) + int(n)
    return out


def workers_status(client: redis.Redis, config: SitsConfig) -> list[dict[str, Any]]:
    try:
        advertise = import_module("sits_queue.workers.advertise")
    except ImportError:  # pragma: no cover - the worker runtime ships with the package
        return []
    workers: list[dict[str, Any]] = advertise.read_workers(client, config.global_keyprefix)
    return workers


def site_status(client: redis.Redis, config: SitsConfig) -> dict[str, Any] | None:
    """This site for ``sitsq status``: the last pass, the outbox, replicas held here."""
    if not config.site:
        return None
    prefix = config.global_keyprefix
    raw = client.get(last_pass_key(prefix))
    held: dict[str, int] = {}
    for origin_raw in client.smembers(origins_key(prefix)):
        # (names are ours, but a member that is no UTF-8 failed the whole status)
        origin = text(origin_raw, "replace")
        count = 0
        for q in client.smembers(replica_queues_key(prefix, origin)):
            count += int(client.zcard(replica_keys(prefix, origin, text(q, "replace"))[0]))
        held[origin] = count
    # a batch being sent is still the outbox's until the peer has it (less its token)
    outbox = int(client.llen(outbox_key(prefix))) + max(0, client.llen(taken_key(prefix)) - 1)
    try:
        last = json.loads(raw) if raw else None
    except (ValueError, TypeError):  # (not ours to read: as if no pass were recorded)
        last = None
    at = stored_number(last.get("at")) if isinstance(last, dict) else None
    age = round(redis_clock.now(client) - at, 1) if at is not None else None
    return {"site": config.site, "outbox": outbox,
            "replicas_held": held, "last_pass": last, "last_pass_age_s": age}


def prewarm_status(client: redis.Redis, config: SitsConfig) -> dict[str, Any] | None:
    """The pre-warm planner's last pass (``priority/prewarm.py``: its beat task keeps no
    result) with its age; None before any."""
    prewarm = import_module("sits_queue.priority.prewarm")
    try:
        last: dict[str, Any] | None = prewarm.last_pass(client, config)
    except redis.ResponseError as exc:  # (a key of another type: said, the rest shown)
        return {"error": str(exc)}
    if last is None:
        return None
    at = stored_number(last.get("at"))
    age = round(redis_clock.now(client) - at, 1) if at is not None else None
    return {**last, "age_s": age}


def printable(value: Any) -> str:
    """``value`` as text on one line: a character that does not print (a newline, a
    control code in a queue or task name of another program's) escaped, as repr does."""
    text = str(value)
    return text if text.isprintable() else "".join(
        c if c.isprintable() else repr(c)[1:-1] for c in text)


def _or_unknown(value: Any) -> Any:
    return "?" if value is None else value


def json_safe(value: Any) -> Any:
    """``value`` with every float that is not finite as None: JSON has no NaN or inf, and
    a record of another writer's may hold them (``status --json`` printed ``NaN``, which
    a JSON reader refuses)."""
    if isinstance(value, float):
        return stored_number(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def format_status(report: dict[str, Any]) -> str:
    lines = []
    site = report.get("site")
    if site:
        lines.append(_site_line(site))
    if not report["queues"]:
        lines.append("no queues yet (submit a task first)")
    for q in report["queues"]:
        lines.append(f"queue {printable(q['queue'])}: {_or_unknown(q['waiting'])} waiting, "
                     f"{_or_unknown(q['unacked'])} running/reserved, "
                     f"{_or_unknown(q['dead'])} dead-lettered, "
                     f"{_or_unknown(q['checkpointed'])} with a yield's progress saved, "
                     f"{_or_unknown(q['held'])} held off by a worker")
        if q.get("error"):
            lines.append(f"  not all of it readable (a key of another program's?): "
                         f"{q['error']}")
        # (columns as wide as the longest name, a space after: a class of 8 letters
        # ran into its task's name, "criticalp4.echo")
        classes = [printable(row.get("sla_class") or "?") for row in q["head"]]
        # (with the task id, as `sitsq dead list` shows it: what revoke() takes)
        tasks = [printable(row.get("task") or "?")
                 + (f"[{printable(row['task_id'])}]" if row.get("task_id") else "")
                 for row in q["head"]]
        wide = max([7, *map(len, classes)]) + 1
        wider = max([31, *map(len, tasks)]) + 1
        for row, sla_class, task in zip(q["head"], classes, tasks, strict=True):
            prio = "?" if row["priority"] is None else f"{row['priority']:.2f}"
            waited = (f"due in {row['due_in_s']} s" if row.get("due_in_s") is not None
                      else f"waited {_or_unknown(row.get('wait_s'))} s")
            lines.append(f"  {prio:>12}  {sla_class:<{wide}}{task:<{wider}}{waited}")
    for name, n in (report.get("stray") or {}).items():
        lines.append(f"warning: {n} message(s) in plain Redis lists of queue {name!r} (the "
                     "list of its name and its priority lists): sent by a "
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
    if report.get("prewarm"):
        try:
            lines.extend(_prewarm_lines(report["prewarm"]))
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as exc:
            lines.append(f"pre-warm: last pass record not readable here "
                         f"({type(exc).__name__}: {exc}); see sitsq status --json")
    return "\n".join(lines)


def _prewarm_lines(last: dict[str, Any]) -> list[str]:
    """The planner's last pass: what it sent where, and why each model got what it did
    (an operator's question: why is this model not warm?)."""
    if "error" in last:
        return [f"pre-warm: last pass record not readable here ({last['error']})"]
    outlooks = [o for o in last["outlooks"] if isinstance(o, dict)]
    sent: dict[tuple[str, str], int] = {}
    for s in last.get("sent") or []:
        key = (printable(s["model"]), printable(s["hostname"]))
        sent[key] = sent.get(key, 0) + 1
    age = last.get("age_s")
    where = ", ".join(f"{m} to {h}" + (f" x{n}" if n > 1 else "")
                      for (m, h), n in sent.items())
    lines = [f"pre-warm: last pass {f'{age} s ago' if age is not None else '(time unknown)'}"
             f", {len(outlooks)} model(s) forecast, {sum(sent.values())} pre-warm(s) sent"
             + (f": {where}" if where else "")]
    ranked = sorted(outlooks, key=lambda o: -(stored_number(o.get("predicted")) or 0.0))
    for o in ranked[:PREWARM_ROWS]:
        lines.append(f"  {printable(o['model'])}: {o['predicted']} task(s) predicted next "
                     f"interval (confidence {o['confidence']}), {o['instances']} warm "
                     f"instance(s) wanted, {o['warm_now']} now: {printable(o['reason'])}")
    if len(ranked) > PREWARM_ROWS:
        lines.append(f"  ... and {len(ranked) - PREWARM_ROWS} more (sitsq status --json)")
    if held := last.get("held_off"):
        lines.append("  held off, their pre-warms having not taken: "
                     + ", ".join(printable(m) for m in held))
    return lines


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


def _devices_text(devices: Any) -> str:
    """Each advertised device's label, name and memory free of its total (NVML, as of
    the worker's last refresh): a worker of several GPUs showed only their names."""
    parts = []
    for d in devices if isinstance(devices, list) else []:
        if not isinstance(d, dict):
            continue
        free, total = d.get("free_vram_bytes"), d.get("total_vram_bytes")
        memory = ""
        if isinstance(free, int) and isinstance(total, int) \
                and not isinstance(free, bool) and not isinstance(total, bool):
            memory = f" {free / 2**30:,.1f} of {total / 2**30:,.1f} GiB free"
            if d.get("readable") is False:  # (NVML could not read it at the last refresh)
                memory += " (unreadable now: an earlier reading)"
        # (as metrics and results name it: a MIG slice by its UUID, its GPU's index
        # being every slice's)
        parts.append(f"{printable(label(d.get('kind', '?'), d.get('index', '?'), d.get('uuid')))} "
                     f"{printable(d.get('name', '?'))}{memory}")
    return "; ".join(parts)


def _links_text(links: Any) -> str:
    """The topology NVML reports between each pair of the worker's GPUs (by index)."""
    parts = []
    for link in links if isinstance(links, list) else []:
        if isinstance(link, dict) and {"a", "b", "level"} <= set(link):
            parts.append(f"cuda:{printable(link['a'])}-cuda:{printable(link['b'])} "
                         f"{printable(link['level'])}")
    return ", ".join(parts)


def _placement_text(placement: Any) -> str:
    """What the worker's picks weigh against its fleet (``workers/fleet.py``): the
    precisions and the roofline bound its devices are relatively strong at, with its
    fp16 ridge point; empty where it weighs nothing."""
    if not isinstance(placement, dict):
        return ""
    parts = []
    for name, key in (("precision", "precisions"), ("roofline", "bounds")):
        weights = placement.get(key)
        for what, w in sorted(weights.items() if isinstance(weights, dict) else ()):
            if is_positive(w):  # (a record no worker of ours wrote: -1, inf, "lots")
                parts.append(f"{name} {printable(what)} +{w:g}")
    ridges = placement.get("ridges")
    ridge = ridges.get("fp16") if isinstance(ridges, dict) else None
    if parts and is_positive(ridge):
        parts.append(f"fp16 ridge {ridge:,.0f} FLOP/byte")
    # (a host of unlike GPUs: what each device's own children pick by)
    devices = placement.get("devices")
    for uuid, own in sorted(devices.items() if isinstance(devices, dict) else ()):
        if isinstance(own, dict) and (text := _placement_text(
                {"precisions": own.get("precisions"), "bounds": own.get("bounds"),
                 "ridges": own.get("ridges")})):
            parts.append(f"on {printable(uuid)}: {text}")
    return ", ".join(parts)


def _warm_text(children: Any) -> str:
    """Each pool process's warm engines: the tier each is in and its size, where the
    child's record says (an older writer's gives the tier only)."""
    parts = []
    for slot, child in sorted((children or {}).items(), key=lambda kv: str(kv[0])):
        warm, sizes = child.get("warm"), child.get("warm_bytes")
        sizes = sizes if isinstance(sizes, dict) else {}
        for key, tier in sorted(warm.items() if isinstance(warm, dict) else ()):
            size = sizes.get(key)
            shown = f", {size / 2**20:,.1f} MiB" if isinstance(size, int) else ""
            parts.append(f"{printable(key)} on slot {slot} ({tier}{shown})")
    return "; ".join(parts)


def _phase_lines(cold: dict[str, Any]) -> list[str]:
    """The cold starts' phases: each a mean per cold start (a total, shown beside a mean
    first-token time, read as one start's), the totals after."""
    totals = cold.get("phases_ms") or {}
    starts = cold.get("cold")
    if not isinstance(totals, dict) or not totals:
        return []
    shown = ", ".join(f"{k} {v:,.1f}" for k, v in totals.items())
    if not isinstance(starts, int) or starts <= 0:
        return [f"    cold-start ms, in all: {shown}"]
    means = ", ".join(f"{k} {v / starts:,.1f}" for k, v in totals.items())
    return [f"    cold-start ms, mean of {starts}: {means} (in all: {shown})"]


def _worker_lines(w: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    devices = ", ".join(str(d.get("name", "?")) for d in w.get("devices", []))
    cold = w.get("cold_start", {})
    lines.append(f"  {w.get('hostname', '?')}: pid {w.get('pid', '?')}, concurrency "
                 f"{w.get('concurrency', '?')}, devices [{devices}], warm engines "
                 f"{w.get('warm', [])}, cold starts {cold.get('cold', 0)}/"
                 f"{cold.get('tasks', 0)} tasks, {cold.get('affinity_picks', 0)} taken "
                 "ahead by affinity")
    if shown := _devices_text(w.get("devices")):
        lines.append(f"    devices: {shown}")
    queues = w.get("queues")
    if isinstance(queues, list):  # (its peers for placement: workers/fleet.py)
        lines.append("    queues: " + (", ".join(printable(q) for q in queues) or "none"))
    if links := _links_text(w.get("links")):
        lines.append(f"    links: {links}")
    if placed := _placement_text(w.get("placement")):
        lines.append(f"    placement: {placed}")
    if warm := _warm_text(w.get("children")):
        lines.append(f"    warm: {warm}")
    if w.get("plain_tasks_only"):
        lines.append(f"    plain tasks only ({w['plain_tasks_only']} pool): inference "
                     "tasks are left for other workers")
    lines += _phase_lines(cold)
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
