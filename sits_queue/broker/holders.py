"""A worker process that died holding messages: what it held goes back at once.

A held message's deadline is pushed by its holder's heartbeat, and a holder silent for
the visibility timeout (60 s) has its messages restored by any consumer's sweep
(``qos.py``). That wait is for a holder no one can see: one on another host may be
alive behind a slow network. A holder on this very host, in this pid namespace, can be
seen: ``/proc/<pid>/stat`` says whether its process still runs, and its start time
tells a reused pid apart. So a worker killed by the OOM killer, a segfault in a CUDA
extension under ``--pool=solo`` or a ``kill -9`` has what it held put back by the next
sweep tick of any worker of its host — the one its supervisor starts in its place
among them — instead of a minute later.

* ``pick.lua`` records who holds each message it hands out (the queue's holders hash:
  message id -> consumer id); ack, release, restore and dead-lettering drop the entry.
* Each consumer records, at its first consume and at every beat and sweep, which
  process it is and which queues it consumes (:class:`Holder`), in one hash per host
  and pid namespace (:func:`host_key`), so a sweep reads only its neighbours'.
* Each sweep tick restores what a holder there whose process is gone held
  (``restore.lua``'s ``=`` mode), counted as a redelivery as the timeout's restore is:
  a task that kills its worker each time is dead-lettered after ``max_redeliveries``
  the sooner. A restored task does not run beside an orphan of itself: Celery's prefork
  children get SIGKILL when their parent dies (``set_pdeathsig``).

Certain or nothing: a holder on another host or in another pid namespace (a restarted
container has a new one), where ``/proc`` is missing (macOS), or a record that cannot
be read, is left to the visibility timeout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis

from sits_queue.checks import text

logger = logging.getLogger(__name__)

#: A record no consumer rewrote for this long (s; at least ten visibility timeouts) is
#: of a consumer that is gone one way or another (a channel closed across a reconnect,
#: a process whose records another host's view cannot check): dropped. A live one
#: writes its record again at its next sweep.
STALE_S = 3600.0
PROC = "/proc"


@dataclass(frozen=True)
class Process:
    """A process as its own host sees it: enough to tell later whether it still runs."""

    host: str
    pid: int
    #: clock ticks from boot to its start (``/proc/<pid>/stat`` field 22); None where
    #: there is no /proc
    started: int | None
    #: the kernel's boot id, and the pid namespace's inode: pids mean the same only
    #: where both match
    boot: str | None
    pidns: str | None

    @property
    def checkable(self) -> bool:
        return self.started is not None and bool(self.boot) and bool(self.pidns)


def start_ticks(pid: int, proc: str = PROC) -> int | None:
    """When process ``pid`` started (clock ticks after boot); None if there is no such
    process here, or only its zombie (killed, not yet reaped by its parent)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so the fields
    # are counted from the last ')'; state is field 3, starttime field 22.
    fields = stat[stat.rfind(b")") + 2:].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _pidns(proc: str = PROC) -> str | None:
    try:
        link = os.readlink(f"{proc}/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return None
    return link[link.find("[") + 1:link.rfind("]")] or None


_this: tuple[int, Process] | None = None


def this_process() -> Process:
    """This process (read again after a fork)."""
    global _this
    pid = os.getpid()
    if _this is None or _this[0] != pid:
        _this = pid, Process(socket.gethostname(), pid, start_ticks(pid),
                             _read(f"{PROC}/sys/kernel/random/boot_id"), _pidns())
    return _this[1]


@dataclass(frozen=True)
class Holder:
    """What one consumer wrote of itself: its process, its queues, and when (Redis's
    clock: deadlines it wrote are no later than that, or were written after it by a
    pick in the beat period before it died)."""

    consumer: str
    process: Process
    queues: tuple[str, ...]
    seen: float

    def encode(self) -> str:
        return json.dumps({"host": self.process.host, "pid": self.process.pid,
                           "started": self.process.started, "queues": list(self.queues),
                           "seen": self.seen}, separators=(",", ":"))

    @classmethod
    def decode(cls, consumer: str, raw: Any, here: Process) -> Holder | None:
        """The record ``raw`` of ``consumer`` in ``here``'s host hash; None for one this
        version cannot read (another program's or a later version's): left alone."""
        try:
            data = json.loads(raw)
            pid, started, seen = data["pid"], data["started"], float(data["seen"])
            queues = tuple(data["queues"])
            host = data.get("host")
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if not (type(pid) is int and type(started) is int and pid > 0
                and all(isinstance(q, str) for q in queues) and seen == seen):
            return None
        return cls(consumer, Process(str(host), pid, started, here.boot, here.pidns),
                   queues, seen)


def gone(holder: Holder, started: Callable[[int], int | None] = start_ticks) -> bool:
    """Whether ``holder``'s process has certainly ended: its pid runs no process here,
    or a later one (the records of one host hash share its boot and pid namespace)."""
    return started(holder.process.pid) != holder.process.started


def host_key(prefix: str, process: Process) -> str | None:
    """The hash of the holders ``process`` can check (its host's boot, its pid
    namespace); None where it can check none."""
    if not process.checkable:
        return None
    return f"{prefix}sits:holders:{process.boot}:{process.pidns}"


def record(client: Any, prefix: str, consumer: str, queues: Iterable[str], now: float) -> None:
    """Write (or refresh) ``consumer``'s record; the host hash lives while someone there
    writes (a host never seen again leaves nothing for good)."""
    process = this_process()
    key = host_key(prefix, process)
    if key is None:
        return
    holder = Holder(consumer, process, tuple(dict.fromkeys(queues)), now)
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, consumer, holder.encode())
    pipe.expire(key, int(STALE_S))
    pipe.execute()


Restore = Callable[[str, list[Any]], int]


def reclaim(client: Any, prefix: str, own: str, now: float, visibility_timeout: float,
            restore: Restore, started: Callable[[int], int | None] = start_ticks) -> int:
    """Put back what the consumers of this host whose process has ended held;
    ``restore(queue, args)`` runs ``restore.lua`` on a queue. Returns how many."""
    here = this_process()
    key = host_key(prefix, here)
    if key is None:
        return 0
    total = 0
    for name, raw in client.hgetall(key).items():
        consumer = text(name)
        if consumer == own:
            continue
        holder = Holder.decode(consumer, raw, here)
        if holder is None:
            continue
        if not gone(holder, started):
            if holder.seen < now - max(STALE_S, 10 * visibility_timeout):
                client.hdel(key, consumer)
            continue
        restored, whole = _put_back(holder, visibility_timeout, restore)
        total += restored
        if restored:
            logger.warning("restored %d message(s) held by process %d on %s, which ended "
                           "(consumer %s)", restored, holder.process.pid,
                           holder.process.host, consumer[:8])
        if whole:  # (else the next tick tries again; the timeout's sweep covers the rest)
            client.hdel(key, consumer)
    return total


def _put_back(holder: Holder, visibility_timeout: float, restore: Restore) -> tuple[int, bool]:
    """``restore.lua``'s ``=`` mode on each of ``holder``'s queues: its deadlines are
    under ``seen`` plus the timeout (a later holder's, left under its name by a worker
    of an older version, are above it). Returns (restored, whether every queue answered)."""
    restored, whole = 0, True
    bound = holder.seen + visibility_timeout
    period = visibility_timeout / 3
    for queue in holder.queues:
        try:
            restored += int(restore(queue, ["=", holder.consumer, bound, period]))
        except redis.ResponseError as exc:  # a queue key of another type: the rest go on
            logger.warning("could not restore what consumer %s held in queue %r: %s",
                           holder.consumer[:8], queue, exc)
        except ValueError:  # a queue name no key can be made of (InvalidQueueName)
            continue
        except redis.RedisError:
            whole = False
    return restored, whole
