"""Redis key layout and score encoding for the sorted-set queues.

Every key of one queue shares the hash tag ``{queue}`` so each Lua script touches a
single Redis Cluster slot. The score of a waiting message packs its priority and its
arrival order into one integer below 2**53 (exact in a double), so one ``ZPOPMIN``
gives "highest priority first, FIFO among equals" (BullMQ's ``priority*2^32+counter``
layout, with a log-scaled priority so that both 0.5 and 50,000 keep fine resolution).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from celery.utils.nodenames import WORKER_DIRECT_QUEUE_FORMAT

from sits_queue.checks import text
from sits_queue.errors import InvalidQueueName

logger = logging.getLogger(__name__)

#: Maintenance tasks (rescoring, trigger checks) go here so a deep task backlog never
#: delays the pass that is supposed to reorder it. Every worker consumes it.
CONTROL_QUEUE = "sits.control"
#: Arrival counter bits in the score; it wraps after 4.29e9 messages per queue (days at
#: ten thousand a second). At the wrap, tasks of equal priority put just after it leave
#: before those put just before it, until aging (from 20 s of waiting) tells them apart: the
#: one place FIFO among equal priority gives way, the price of 21 bits of priority levels.
SEQ_BITS = 32
SEQ_SPAN = 1 << SEQ_BITS
#: Priority levels: 21 bits, so (levels << 32) stays below 2**53.
PRIORITY_LEVELS = (1 << 21) - 1
#: Levels per e-fold of (1 + priority): relative resolution 1/131072 ~ 8e-6.
LEVELS_PER_E = 1 << 17
#: Largest priority that still has its own level (log1p(p) * 2**17 < 2**21 - 1).
PRIORITY_CEILING = math.expm1(PRIORITY_LEVELS / LEVELS_PER_E)
#: The least priority a class's weight may give a task (``SitsConfig`` refuses weights
#: under it): a score's levels tell priorities 1% apart from here up (13 levels), while
#: below ~1e-5 every priority is level 0, served first come first served.
PRIORITY_FLOOR = 0.01

#: Header a picked message carries to the pool child: [queue, message id] (time slices).
DELIVERY_HEADER = "sits_delivery"
#: Header with the JSON state a task saved when it last yielded its slot (absent before).
CHECKPOINT_HEADER = "sits_checkpoint"

#: Header set on a message a pick took ahead of its queue's head by affinity (the task
#: reads it as ``self.request.sits_affinity``).
AFFINITY_HEADER = "sits_affinity"

#: Delivery info (and header) on each message of a batch one pick took (pick.lua's batch
#: kin): [batch id, index, size]; the batch id is its first message's id.
BATCH_INFO = "sits_batch"
#: Headers a pick adds for one delivery: never carried into a new message (a retry).
DELIVERY_ONLY = frozenset({DELIVERY_HEADER, CHECKPOINT_HEADER, AFFINITY_HEADER, BATCH_INFO,
                           "redelivered"})

def batch_mark(info: object) -> tuple[str, int, int] | None:
    """``(batch, index, size)`` from a message's delivery info or headers (a request's
    ``request_dict``); None if not in a batch."""
    mark = info.get(BATCH_INFO) if isinstance(info, dict) else None
    if (isinstance(mark, list) and len(mark) == 3 and isinstance(mark[0], str)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in mark[1:])
            and 0 <= mark[1] < mark[2]):
        return mark[0], mark[1], mark[2]
    return None


def batch_units(items: Iterable[tuple[Hashable, object]]) -> int:
    """How many pool jobs (own key, delivery info or headers) pairs make: a batch counts
    once (the transport's prefetch and the worker's reserved count both ask)."""
    return len({mark[0] if (mark := batch_mark(info)) is not None else own
                for own, info in items})


#: Members of the marker set that wakes blocked consumers (one member: puts coalesce).
MARKER_MEMBER = "ready"


def priority_level(priority: float) -> int:
    """Quantise a priority (higher runs sooner) to an integer level in [0, PRIORITY_LEVELS]."""
    if math.isnan(priority):
        raise ValueError("priority is NaN")
    p = min(max(priority, 0.0), PRIORITY_CEILING)
    return min(PRIORITY_LEVELS, round(math.log1p(p) * LEVELS_PER_E))


def score_base(priority: float) -> int:
    """Score without the arrival counter: lower pops first, so invert the level."""
    return (PRIORITY_LEVELS - priority_level(priority)) << SEQ_BITS


def decode_score(score: float) -> tuple[float, int] | None:
    """(approximate priority, arrival counter) of a stored score, for status displays;
    None for a score no put of ours writes (inf, negative, past the lowest level: another
    program's ZADD; ``int()`` of inf failed every status and metrics scrape)."""
    if not (math.isfinite(score) and 0 <= score < (PRIORITY_LEVELS + 1) << SEQ_BITS):
        return None
    s = int(score)
    level = PRIORITY_LEVELS - (s >> SEQ_BITS)
    return math.expm1(level / LEVELS_PER_E), s & (SEQ_SPAN - 1)


@dataclass(frozen=True)
class QueueKeys:
    """The Redis keys of one queue, in the order every Lua script receives them."""

    waiting: str  # ZSET message id -> score
    payloads: str  # HASH message id -> kombu message JSON (until acked or dead-lettered)
    meta: str  # HASH message id -> scheduling metadata JSON (for the rescoring pass)
    marker: str  # ZSET with one member while messages wait; consumers BZPOPMIN it
    seq: str  # STRING arrival counter
    unacked: str  # ZSET message id -> deadline base (pick or heartbeat time, unix s)
    saved: str  # HASH message id -> score it had when picked (restored with it)
    redelivered: str  # HASH message id -> times restored
    dead: str  # HASH message id -> dead-letter record JSON
    arrivals: str  # HASH SLA class -> messages ever enqueued (bandwidth compliance)
    checkpoints: str  # HASH message id -> state a preempted task saved when it yielded
    yields: str  # HASH waiting message id -> time a running task claimed to yield for it
    held: str  # HASH message id -> "<consumer> <until>": released, not offered back to it
    skipped: str  # HASH message id -> when a pick first passed it over at the head (affinity)
    idle: str  # SET message ids held by a worker that has said it has not started them
    sweep: str  # HASH the visibility sweeps' last time and hold (restore.lua), by Redis's clock
    holders: str  # HASH unacked message id -> the consumer holding it (broker/holders.py)

    @classmethod
    def for_queue(cls, queue: str, prefix: str = "") -> QueueKeys:
        """The keys of ``queue``; raises :class:`InvalidQueueName` for a name that would
        not make one hash tag."""
        check_queue_name(queue)
        base = f"{prefix}sits:{{{queue}}}:"
        return cls(*(base + suffix for suffix in (
            "z", "p", "i", "mk", "seq", "u", "s", "rd", "dl", "arr", "ck", "yc", "hd", "af", "id",
            "sw", "ho")))

    def all(self) -> list[str]:
        return [self.waiting, self.payloads, self.meta, self.marker, self.seq, self.unacked,
                self.saved, self.redelivered, self.dead, self.arrivals, self.checkpoints,
                self.yields, self.held, self.skipped, self.idle, self.sweep, self.holders]

    @property
    def put_channel(self) -> str:
        """Pub/sub channel ``put.lua`` announces each put's classes on (running tasks
        listen to know when to look for a reason to yield their slot)."""
        return self.waiting + ":put"


def check_queue_name(queue: str) -> str:
    """``queue``, if it can name a queue; else raises :class:`InvalidQueueName`.

    Redis Cluster hashes only what is inside a key's first ``{...}``: an empty ``{}``
    counts as no tag at all (each key hashes whole, to its own slot), and a brace in the
    name would move the tag. Either way one queue's keys would land in several slots,
    which no script can touch together. A name that is not UTF-8 text (a lone surrogate,
    as JSON carries it or a shell's byte 0xff arrives) is no key at all: it passed, an
    ``add_consumer`` replied ok and the worker's event loop then died encoding it.
    """
    if not isinstance(queue, str) or not queue:
        raise InvalidQueueName(f"a queue name must be a non-empty string, got {queue!r}")
    if "{" in queue or "}" in queue:
        raise InvalidQueueName(f"queue name {queue!r} must not contain braces")
    try:
        queue.encode()
    except UnicodeEncodeError as exc:
        raise InvalidQueueName(f"queue name {queue!r} is not UTF-8 text ({exc.reason} at "
                               f"position {exc.start})") from None
    return queue


#: Reply queues of Celery's remote control (kombu's pidbox: ``<oid>.reply.<namespace>
#: .pidbox``): one per control client, declared expiring by the client. A worker that
#: replies to one did not declare it, so it knows it only by its name.
_REPLY_QUEUE = re.compile(r".+\.reply\..+\.pidbox")
#: Life of a control reply queue its client did not declare here, after its latest put,
#: ms: well past any client's wait for replies (``inspect``'s default is 1 s; Celery
#: declares them expiring after 10 s unused).
REPLY_QUEUE_EXPIRES_MS = 60_000
#: Result queues of Celery's ``rpc://`` backend: named by the client's ``thread_oid``, a
#: UUID, declared by the client (expiring after ``result_expires``) and put to by the
#: workers, which know them only by that name...
_RESULT_QUEUE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: ...and keep them this long after their latest put, ms: the results wait there until
#: the client reads them (Celery's default ``result_expires``, which SITS keeps).
RESULT_QUEUE_EXPIRES_MS = 86_400_000
#: kombu's separator of a binding's parts (routing key, pattern, queue) in its sets.
BINDING_SEP = "\x06\x16"
#: Celery's worker-direct queues (``<hostname>.dq2``): one per worker, for it alone.
DIRECT_QUEUE_SUFFIX = WORKER_DIRECT_QUEUE_FORMAT.format(hostname="")


def is_reply_queue(queue: str) -> bool:
    """A remote-control reply queue, known by its name alone (a worker that replies did
    not declare it): never in the registry, its keys expiring."""
    return _REPLY_QUEUE.fullmatch(queue) is not None


def is_result_queue_name(queue: str) -> bool:
    """Named as an ``rpc://`` result queue is (a UUID). Only a put of a message that is
    not a task makes it one: a work queue may be named so too."""
    return _RESULT_QUEUE.fullmatch(queue) is not None


def registered_queues(names: Iterable[bytes | str]) -> list[str]:
    """The queue registry's members (:func:`queues_registry`) that name a usable queue,
    sorted. One that does not (listed by an older version, or by hand) is skipped with a
    warning: the passes that walk every queue must not stop at it."""
    out = []
    for raw in names:
        name = text(raw, "replace")
        try:
            out.append(check_queue_name(name))
        except InvalidQueueName as exc:
            logger.warning("queue registry: skipping %r (%s)", name, exc)
    return sorted(out)


def site_local(queue: str) -> bool:
    """Whether ``queue``'s tasks are this site's alone, never replicated to peers
    (``broker/sites.py``): the control queue (the beat's maintenance), workers' own
    queues (no worker at a peer serves them: a task taken over there waited for good)
    and reply queues (not work)."""
    return queue == CONTROL_QUEUE or queue.endswith(DIRECT_QUEUE_SUFFIX) or \
        is_reply_queue(queue)


def replicated(names: Iterable[bytes | str]) -> list[str]:
    """:func:`registered_queues` whose tasks peers keep replicas of (not
    :func:`site_local`)."""
    return [name for name in registered_queues(names) if not site_local(name)]


def queues_registry(prefix: str = "") -> str:
    """SET of queue names ever declared (for ``sitsq status``; never used inside a script)."""
    return f"{prefix}sits:queues"


def stats_key(prefix: str = "") -> str:
    """STRING with the latest priority snapshot JSON, written by the rescoring beat task."""
    return f"{prefix}sits:stats"


# -- sites (§2.3, ``broker/sites.py``) ------------------------------------------------------

def replica_keys(prefix: str, origin: str, queue: str) -> tuple[str, str, str]:
    tag = f"{{{origin}:{queue}}}"
    return (f"{prefix}sits:replica:{tag}:z", f"{prefix}sits:replica:{tag}:p",
            f"{prefix}sits:replica:{tag}:m")


def replica_queues_key(prefix: str, origin: str) -> str:
    return f"{prefix}sits:replica:{{{origin}}}:queues"


def origins_key(prefix: str) -> str:
    return f"{prefix}sits:replica:origins"


def alive_key(prefix: str, site: str) -> str:
    return f"{prefix}sits:site:{{{site}}}:alive"


def epoch_key(prefix: str, site: str) -> str:
    """At a peer: the server (``recovery.epoch``) ``site`` last wrote its replicas from."""
    return f"{prefix}sits:site:{{{site}}}:epoch"


def held_restore_key(prefix: str, peer: str) -> str:
    """Here: the put-back from ``peer`` waiting to be confirmed (``recovery.restore``):
    JSON of this site's server, since when, and the other server's record that began it."""
    return f"{prefix}sits:site:{{{peer}}}:restore-held"


def shared_name_key(prefix: str, peer: str) -> str:
    """Here, expiring: the other server last seen writing at ``peer`` under this site's
    name (``recovery.restore``)."""
    return f"{prefix}sits:site:{{{peer}}}:name-shared"


def missing_since_key(prefix: str, site: str) -> str:
    return f"{prefix}sits:site:{{{site}}}:missing-since"


def takenover_key(prefix: str, site: str) -> str:
    return f"{prefix}sits:site:{{{site}}}:takenover"


def mirror_key(prefix: str, site: str) -> str:
    """This site's tasks a peer took over, whose results are to be copied here from the
    peer's backend (``takeover.mirror_results``): ``[peer, task id]`` entries."""
    return f"{prefix}sits:site:{{{site}}}:mirror"


def mirror_chords_key(prefix: str, site: str) -> str:
    """Of those, the chord members: HASH task id -> the message dropped here, whose
    request counts the result in its chord here once it is copied home."""
    return f"{prefix}sits:site:{{{site}}}:mirror-chords"


def outbox_key(prefix: str) -> str:
    # one hash tag with the taken batch's key: take_outbox.lua moves entries between them
    return f"{prefix}sits:site:{{outbox}}"


def taken_key(prefix: str) -> str:
    """The outbox batch a pass is sending: its token, then its entries."""
    return f"{prefix}sits:site:{{outbox}}:taken"


def last_pass_key(prefix: str) -> str:
    return f"{prefix}sits:site:last-pass"


def link_key(prefix: str) -> str:
    """The pass's choice of replica peer, for this site's producers."""
    return f"{prefix}sits:site:link"
