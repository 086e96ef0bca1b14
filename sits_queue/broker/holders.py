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
* Each sweep tick looks at the records there; the consumer that drops the record of a
  holder whose process has ended restores what it held (``restore.lua``'s ``=`` mode),
  counted as a redelivery as the timeout's restore is: a task that kills its worker
  each time is dead-lettered after ``max_redeliveries`` the sooner. A restored task
  does not run beside an orphan of itself: Celery's prefork children get SIGKILL when
  their parent dies (``set_pdeathsig``).

Certain or nothing: a live worker taken for dead would have its running tasks run
twice. A holder on another host, in another pid namespace (a restarted container has a
new one), whose ``/proc`` entry cannot be read, where ``/proc`` is missing (macOS), or
whose record cannot be read, is left to the visibility timeout.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis

from sits_queue.checks import text

logger = logging.getLogger(__name__)

#: A host's hash of records lives this long after its last write, s: a host never seen
#: again leaves nothing for good.
HOST_KEPT_S = 3600
PROC = "/proc"
#: Linux's largest pid_max (2**22): a record's pid above it is no process's.
PID_MAX = 1 << 22


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


def _stat(path: str) -> tuple[bytes, int] | None:
    """(state, start time in clock ticks after boot) from a ``/proc/<pid>/stat``; None
    if it cannot be read or parsed."""
    try:
        with open(path, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so the fields
    # are counted from the last ')'; state is field 3, starttime field 22.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _exists(pid: int) -> bool:
    """Whether some process has ``pid`` here (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: it exists, and is another user's)
        return True
    return True


def ended(pid: int, started: int, proc: str = PROC,
          exists: Callable[[int], bool] = _exists) -> bool:
    """Whether the process ``pid`` that started at ``started`` has certainly ended: no
    process has its pid, or a later one, or only its zombie (killed, not yet reaped). A
    process /proc does not show (``hidepid``, another user's under systemd's
    ``ProtectProc``) or that cannot be read has not: a live worker must never be taken
    for dead, its running tasks would run twice."""
    if not exists(pid):
        return True
    stat = _stat(f"{proc}/{pid}/stat")
    if stat is None:
        return False
    state, ticks = stat
    return state in (b"Z", b"X") or ticks != started


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
        _this = pid, read_process(pid)
    return _this[1]


def read_process(pid: int, proc: str = PROC) -> Process:
    """Process ``pid``, this one, as ``proc`` shows it: not checkable where that is not
    of this process's pid namespace (``unshare --pid`` without a /proc of its own: its
    pids there name other processes)."""
    try:
        ours = os.readlink(f"{proc}/self") == str(pid)
    except OSError:
        ours = False
    stat = _stat(f"{proc}/self/stat") if ours else None
    return Process(socket.gethostname(), pid, stat[1] if stat else None,
                   _read(f"{proc}/sys/kernel/random/boot_id"), _pidns(proc))


@dataclass(frozen=True)
class Holder:
    """What one consumer wrote of itself: its process, its queues, and when (Redis's
    clock: deadlines it wrote are no later than that, or were written after it by a
    pick in the beat period before it died)."""

    consumer: str
    process: Process
    queues: tuple[str, ...]
    seen: float
    #: its visibility timeout, s (apps sharing a Redis may set others)
    timeout: float

    def encode(self) -> str:
        return json.dumps({"host": self.process.host, "pid": self.process.pid,
                           "started": self.process.started, "queues": list(self.queues),
                           "seen": self.seen, "timeout": self.timeout},
                          separators=(",", ":"))

    @classmethod
    def decode(cls, consumer: str, raw: Any, here: Process) -> Holder | None:
        """The record ``raw`` of ``consumer`` in ``here``'s host hash; None for one this
        version cannot read (another program's or a later version's): left alone."""
        try:
            data = json.loads(raw)
            pid, started, seen = data["pid"], data["started"], float(data["seen"])
            timeout = float(data["timeout"])
            queues = tuple(data["queues"])
            host = data.get("host")
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError,
                RecursionError):
            return None
        if not (type(pid) is int and type(started) is int and 0 < pid <= PID_MAX
                and all(isinstance(q, str) for q in queues) and math.isfinite(seen)
                and math.isfinite(timeout) and timeout > 0):
            return None
        return cls(consumer, Process(str(host), pid, started, here.boot, here.pidns),
                   queues, seen, timeout)


Ended = Callable[[int, int], bool]


def gone(holder: Holder, here: Process, has_ended: Ended = ended) -> bool:
    """Whether ``holder``'s process has certainly ended (the records of one host hash
    share its boot and pid namespace; one of another host name is left alone: VMs
    cloned from one snapshot share a boot id)."""
    assert holder.process.started is not None  # (decode: an int)
    return (holder.process.host == here.host
            and has_ended(holder.process.pid, holder.process.started))


def host_key(prefix: str, process: Process) -> str | None:
    """The hash of the holders ``process`` can check (its host's boot, its pid
    namespace); None where it can check none."""
    if not process.checkable:
        return None
    return f"{prefix}sits:holders:{process.boot}:{process.pidns}"


def record(client: Any, prefix: str, consumer: str, queues: Iterable[str], now: float,
           visibility_timeout: float) -> None:
    """Write (or refresh) ``consumer``'s record; the host hash lives while someone there
    writes (a host never seen again leaves nothing for good)."""
    process = this_process()
    key = host_key(prefix, process)
    if key is None:
        return
    holder = Holder(consumer, process, tuple(dict.fromkeys(queues)), now,
                    visibility_timeout)
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, consumer, holder.encode())
    pipe.expire(key, HOST_KEPT_S)
    pipe.execute()


#: ``restore(queue, args)``: ``restore.lua`` run on a queue, its reply.
Restore = Callable[[str, list[Any]], Any]


def forget(prefix: str, consumer: str) -> tuple[str, str, str] | None:
    """(HDEL, key, field) of ``consumer``'s record, for a channel that closes holding
    nothing; None where it writes none."""
    key = host_key(prefix, this_process())
    return None if key is None else ("HDEL", key, consumer)


def reclaim(client: Any, prefix: str, own: str, now: float,
            restore: Restore, has_ended: Ended = ended,
            older: Callable[[], str | None] = lambda: None) -> int:
    """Put back what the consumers of this host whose process has ended held; none
    while ``older()`` names a live worker of a release that keeps no holder entries
    (its sweep and pick leave a message it took again under the dead holder's name,
    and a dead holder that had come back from a stall, its record fresh, would have
    that message put back while it runs). Returns how many."""
    here = this_process()
    key = host_key(prefix, here)
    if key is None:
        return 0
    total, looked, older_live = 0, False, None
    for name, raw in client.hgetall(key).items():
        consumer = text(name, "replace")
        holder = None if consumer == own else Holder.decode(consumer, raw, here)
        if holder is None:
            continue
        if not gone(holder, here, has_ended):
            # A live process's record no one rewrote for three timeouts is of a channel
            # it closed (a consuming one rewrites it each tick, one holding anything at
            # each beat besides).
            if holder.seen < now - 3 * holder.timeout:
                client.hdel(key, consumer)
            continue
        if not looked:  # (once a call, and only when someone died: it reads the fleet)
            looked, older_live = True, older()
            if older_live:
                _say_once(f"a worker of an earlier release is live ({older_live}): what "
                          f"a dead worker of this host held is left to the visibility "
                          f"timeout")
        if older_live:
            continue
        if client.hdel(key, consumer) != 1:
            continue  # another consumer of this host took it first: that one puts back
        restored = _put_back(holder, restore)
        total += restored
        if restored:
            logger.warning("restored %d message(s) held by process %d on %s, which ended "
                           "(consumer %s)", restored, holder.process.pid,
                           holder.process.host, consumer[:8])
    return total


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning(message)


#: Holder entries a queue's ``restore.lua`` call scans (HSCAN's COUNT): a queue holding
#: 100k ETA tasks unacked is looked through in steps, none holding Redis for long.
SCAN_STEP = 1000


def _put_back(holder: Holder, restore: Restore) -> int:
    """``restore.lua``'s ``=`` mode through each of ``holder``'s queues. Its own
    deadlines are under ``seen`` plus half the timeout (a pick comes at most a tick, a
    sixth of it, after a record). Another holder's that an earlier release's worker took
    again, which records no holder and so leaves the entry under the dead one's name,
    is above that: restored by a sweep once the dead one's last beat (at most a third
    of the timeout before ``seen``) was a timeout old, then picked. Returns how many;
    a queue that fails is left to the visibility timeout."""
    restored = 0
    bound = holder.seen + holder.timeout / 2
    period = holder.timeout / 3
    for queue in holder.queues:
        cursor: Any = "0"
        try:
            while True:
                n, cursor = restore(queue, ["=", holder.consumer, bound, period, cursor,
                                            SCAN_STEP])
                restored += int(n)
                if text(cursor) == "0":
                    break
        except ValueError:  # a queue name no key can be made of (InvalidQueueName)
            continue
        except redis.RedisError as exc:
            logger.warning("what process %d held in queue %r is left to the visibility "
                           "timeout: %s", holder.process.pid, queue, exc)
    return restored
