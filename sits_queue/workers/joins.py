"""Continuous batching: waiting tasks join a generation batch while it decodes.

A generation batch (``sits.generate_batched``, ``batchgen.py``) loses rows as they
finish; without joins its freed rows stay empty until the longest row is done, and the
tasks waiting behind it wait for that. Here the batch takes them on the way:

1. The worker's main process sends a batch of a task that takes joins (``joins = True``
   on the task: the built-in generation batch) as usual, and keeps it as a
   :class:`Running` batch. Every :data:`POLL_S` while it runs, it reads the room the
   child offers (``join.lua``'s state); when there is room, ``pick.lua`` in join mode takes
   waiting tasks of the batch's key (task, model, class) from the first ``batch_window``
   of its queue, atomically, unacked like any pick. They reach Celery's consumer as any
   delivery does (received events, revokes, expiry: Flower sees them), then
   :func:`attach` pushes their pool jobs to the batch's list (``join.lua``) and marks
   them started.
2. The pool child (:class:`Feed`), between decode steps, offers its free rows (up to the
   task's ``max_batch`` rows in all) and takes jobs from the list, oldest first. A row
   joins only if it would finish, at the batch's measured step time, well before the
   run's soft time limit, and only during the first ``batch_join_s`` of the run (a run's
   events and acks go at its end: it must end). A joined row leaves like the others; its
   result is stored when it does.
3. A row the child declines (it would not finish in time, or its KV cache would not fit)
   is seen at the next poll and run again at once, as a batch of its own: another child
   may serve it while this batch decodes (held to the batch's end, it waited for the
   longest row it was meant to overtake).
4. When the batch ends the child closes the list (``join.lua``: nothing is pushed after).
   The main process acks each task the run served and sends its events; a task it did
   not take (pushed too late, or still in the list when a child died) runs again as
   usual, as a batch of its own.

Redis errors in the child end the joining, not the batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
from kombu.exceptions import KombuError
from kombu.utils.json import dumps, loads

from sits_queue.broker.keys import QueueKeys
from sits_queue.broker.scripts import Scripts
from sits_queue.cache.pool import COLD_PHASES
from sits_queue.checks import text

if TYPE_CHECKING:
    from sits_queue.workers.batched import Call

logger = logging.getLogger(__name__)

#: How often the main process reads a running batch's room, s: a decode step of a
#: small model takes about this long, so a freed row is refilled within a step or two.
POLL_S = 0.02
#: A joining row must be expected to finish in this fraction of the time left before
#: the run's soft time limit (steps slow down as the batch grows).
DEADLINE_SHARE = 0.5
#: A batch takes joining rows once this share of its capacity is free: rows join as a
#: batch of their own (one prefill for all, one merge of KV), not one by one.
JOIN_AT_SHARE = 0.25
#: How long a batch's join keys outlive a worker that died holding them, s.
KEY_TTL_S = 3600


# -- pure -----------------------------------------------------------------------------------

def fits(now: float, deadline: float | None, most: int, step_s: float) -> bool:
    """Whether a row of ``most`` new tokens, at ``step_s`` a decode step, finishes within
    :data:`DEADLINE_SHARE` of the time left before the soft ``deadline`` (monotonic s)."""
    return deadline is None or most * step_s < DEADLINE_SHARE * (deadline - now)


def wanted(mode: str, gpus: bool) -> bool:
    """Whether a worker takes joins (``SitsConfig.batch_join``): ``auto`` only where its
    children decode on GPUs, where a decode step of a small batch is bound by reading
    the weights and launching kernels, not by its rows, so fewer, fuller steps are the
    gain. On two CPU cores a step costs in proportion to its rows: joining measured 42%
    fewer steps in the same time in-process (``bench joins``) and 0.93-1.01x through
    real workers (``bench coalesce``)."""
    return mode == "on" or (mode == "auto" and gpus)


def room(capacity: int, live: int) -> int:
    """Rows a batch of ``live`` rows can take, of ``capacity`` in all."""
    return max(0, capacity - live)


def least(capacity: int) -> int:
    """Free rows before a batch of ``capacity`` takes any (:data:`JOIN_AT_SHARE`)."""
    return max(1, int(capacity * JOIN_AT_SHARE))


def join_keys(queue: str, job: str, prefix: str = "") -> list[str]:
    """``join.lua``'s KEYS for the batch whose first task is ``job``: its jobs LIST and
    state HASH, hash-tagged like the queue's own keys."""
    base = QueueKeys.for_queue(queue, prefix).waiting.removesuffix("z") + f"join:{job}"
    return [base, base + ":state"]


def encode_job(job: tuple[Any, ...]) -> str:
    """A pool job (name, id, request dict, body, content type, encoding) as JSON: only
    data crosses Redis (bytes as base64), never pickle."""
    return str(dumps(list(job)))  # type: ignore[no-untyped-call]


def decode_job(raw: bytes | str) -> tuple[Any, ...]:
    job = loads(raw)  # type: ignore[no-untyped-call]
    if not isinstance(job, list) or len(job) != 6 or not isinstance(job[1], str):
        raise ValueError(f"not a pool job: {str(raw)[:200]!r}")
    return tuple(job)


_scripts = Scripts.register()


def _join_script(client: redis.Redis, keys: list[str], *args: Any) -> Any:
    return _scripts.run_on("join", keys, list(args), client)


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


# -- the pool child ---------------------------------------------------------------------------

@dataclass
class Feed:
    """The child's end of a running batch's joins (``ActiveTask.joins``): offers room,
    takes jobs, says which rows may join. ``add(job)`` appends a job to the batch's own
    lists and returns its call index."""

    client: redis.Redis
    keys: list[str]
    capacity: int
    until: float  # monotonic s: no joins after
    add: Callable[[tuple[Any, ...]], tuple[int, Call]]
    deadline: Callable[[], float | None] = lambda: None
    declined: set[int] = field(default_factory=set)
    taken: int = 0
    offered: int = -1
    open: bool = True
    #: perf_counter s when each joined call (by index) was taken, and when its first new
    #: token came (:meth:`first_token`): its own run's, for its result (:meth:`own_meta`).
    joined_at: dict[int, float] = field(default_factory=dict)
    first_at: dict[int, float] = field(default_factory=dict)

    @property
    def least(self) -> int:
        """Free rows before the batch takes any."""
        return least(self.capacity)

    @property
    def joined(self) -> int:
        """Calls that joined the batch (taken and not declined)."""
        return self.taken - len(self.declined)

    def take(self, live: int) -> list[tuple[int, Call]]:
        """Jobs for the batch's free rows (``live`` rows are decoding), as calls with
        their index; offers the room first."""
        if not self.open:
            return []
        if time.monotonic() >= self.until:
            self.close()
            return []
        # Offered only once the batch takes any: the main process picks as soon as room
        # is offered, and a task it picked for rows this batch would not take yet sat
        # unacked, held here, until the batch ended, while other slots stood idle.
        free = room(self.capacity, live)
        free = free if free >= self.least else 0
        try:
            if free != self.offered:
                self.offered = free
                if not _join_script(self.client, self.keys, "room", KEY_TTL_S, free):
                    self.open = False  # the main process closed it (it gave up on us)
                    return []
            raw = _join_script(self.client, self.keys, "take", free) if free else []
        except redis.RedisError as exc:
            logger.warning("continuous batching stopped for this batch: %s", exc)
            self.open = False
            return []
        taken = []
        self.taken += len(raw)
        self.offered -= len(raw)  # join.lua counted them out of the room offered
        for item in raw:
            try:
                taken.append(self.add(decode_job(item)))
                self.joined_at[taken[-1][0]] = time.perf_counter()
            except (ValueError, KombuError) as exc:  # not our main process's: a bug, or
                # forged (content the app does not accept). Stop here: the main process
                # runs its jobs from this one on again (it counts those the batch
                # returns, in order); the batch goes on.
                logger.error("join list of %s: %s", self.keys[0], exc)
                self.close()
                break
        return taken

    def fits(self, most: int, step_s: float) -> bool:
        return fits(time.monotonic(), self.deadline(), most, step_s)

    def first_token(self, index: int) -> None:
        """The joined call ``index`` has its first new token (its prefill's)."""
        if index not in self.first_at:
            self.first_at[index] = time.perf_counter()

    def first_tokens_ms(self) -> list[float]:
        """Each joined call's time from its join to its first new token, ms."""
        return [_ms(at - self.joined_at[i]) for i, at in self.first_at.items()
                if i in self.joined_at]

    def own_meta(self, index: int, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Joined call ``index``'s result metadata as it leaves: the batch's (device,
        class, limits, precision) with its own run: served by the engine the batch held,
        no cold start; its run and its first token timed from its join (the batch's
        figures, a cold load's included, were another run's)."""
        now = time.perf_counter()
        began = self.joined_at.get(index, now)
        first = self.first_at.get(index)
        return {**meta, "cold": False, "source": "device",
                **dict.fromkeys(COLD_PHASES, 0.0), "evicted": [], "demoted": [],
                "run_ms": _ms(now - began),
                "first_token_ms": _ms(first - began) if first is not None else None}

    def decline(self, index: int) -> None:
        """The job at call ``index`` is not run here: the main process runs it again (told
        through the list too: should this child die, it learns it there)."""
        self.declined.add(index)
        try:
            _join_script(self.client, self.keys, "decline", index)
        except redis.RedisError as exc:
            logger.warning("could not record a declined join in %s: %s", self.keys[0], exc)

    def close(self) -> None:
        """No more joins (the main process runs what it pushes after as a batch of its own)."""
        if not self.open:
            return
        self.open = False
        try:
            _join_script(self.client, self.keys, "close")
        except redis.RedisError as exc:
            logger.warning("could not close the join list %s: %s", self.keys[0], exc)


# -- the main process -----------------------------------------------------------------------

@dataclass
class Running:
    """A batch that takes joins, from its send until its end: its requests (its own
    first, then those attached, in push order: the child takes them in that order)."""

    queue: str
    key: str
    keys: list[str]
    requests: list[Any]
    own: int
    pid: Callable[[], int | None]
    pushed: int = 0
    #: Call indices of declined joins already run again (:func:`poll`).
    returned: set[int] = field(default_factory=set)


#: Batches that take joins now, by their first task's id.
_running: dict[str, Running] = {}
#: Join deliveries under way (their batch mark's group) -> the batch they join.
_groups: dict[str, str] = {}
#: ids of the requests attached to a running batch (not reserved units of their own).
_attached: set[str] = set()


def start(job: str, queue: str, key: str, keys: list[str], requests: list[Any],
          pid: Callable[[], int | None]) -> None:
    _running[job] = Running(queue, key, keys, requests, len(requests), pid)


def attached(request: Any) -> bool:
    return getattr(request, "id", None) in _attached


def declined_in(state: dict[Any, Any]) -> set[int]:
    """The call indices a batch's child declined, from its state hash (``join.lua``)."""
    found = set()
    for field_ in state:
        name = text(field_)
        if name.startswith("d:") and name[2:].isdigit():
            found.add(int(name[2:]))
    return found


def poll(client: redis.Redis, pick: Callable[[str, str, int, str], None],
         rerun: Callable[[list[Any]], None]) -> None:
    """Main process, every :data:`POLL_S`: for each running batch with room the child
    offered beyond the jobs waiting in its list, ``pick(queue, key, n, group)`` delivers
    up to ``n`` waiting tasks of its key as join group ``group`` (then :func:`attach`);
    the joins its child declined since go to ``rerun`` (run as a batch of their own)."""
    if not _running:
        return
    jobs = list(_running.items())
    try:
        with client.pipeline(transaction=False) as pipe:
            for _, batch in jobs:
                pipe.hgetall(batch.keys[1])
                pipe.llen(batch.keys[0])
            replies = pipe.execute()
    except redis.RedisError as exc:
        logger.warning("continuous batching: could not read the running batches: %s", exc)
        return
    for n, (job, batch) in enumerate(jobs):
        state, waiting = replies[2 * n] or {}, int(replies[2 * n + 1] or 0)
        back = sorted(i for i in declined_in(state) - batch.returned
                      if batch.own <= i < len(batch.requests))
        if back and job in _running:
            batch.returned.update(back)
            members = [batch.requests[i] for i in back]
            for member in members:
                _attached.discard(member.id)  # a unit of its own again
            rerun(members)
        free = int(state.get(b"room", state.get("room", 0)) or 0)
        if free > waiting and job in _running:
            group = f"{job}:join:{batch.pushed}"
            _groups[group] = job
            try:
                pick(batch.queue, batch.key, free - waiting, group)
            finally:
                _groups.pop(group, None)


def joining(group: str) -> bool:
    return group in _groups


def attach(group: str, members: list[Any], admitted: Callable[[Any], bool],
           run_apart: Callable[[list[Any]], None], client: redis.Redis) -> None:
    """The requests a join delivery brought (each checked: revoked, declared VRAM): their
    jobs pushed to the running batch, marked started. If the batch has ended meanwhile
    (its list is closed), they run as a batch of their own."""
    job = _groups.get(group)
    batch = _running.get(job) if job is not None else None
    members = [m for m in members if admitted(m)]
    if not members:
        return
    if batch is None:
        run_apart(members)
        return
    from sits_queue.workers.batchmain import _job

    try:
        pushed = _join_script(client, batch.keys, "push", KEY_TTL_S,
                              *(encode_job(_job(m)) for m in members))
    except redis.RedisError as exc:
        logger.warning("continuous batching: could not push joins: %s", exc)
        pushed = 0
    if not pushed:
        run_apart(members)
        return
    batch.pushed += len(members)
    accepted = time.monotonic()
    for member in members:
        batch.requests.append(member)
        _attached.add(member.id)
        member.on_accepted(batch.pid(), accepted)


def given_back(job: str) -> set[str]:
    """ids of the declined joins of the running batch ``job`` that :func:`poll` has run
    again already (its end must not run them a second time)."""
    batch = _running.get(job)
    if batch is None:
        return set()
    return {batch.requests[i].id for i in batch.returned}


def finish(job: str, client: redis.Redis, taken: int | None = None
           ) -> tuple[list[Any], list[Any]]:
    """The batch ``job`` ended (``taken``: the joins its child reported it took; it says
    which it declined) or its child died (None: the list's own counts say): the requests
    the run served (its own first), and the attached ones it did not take or declined
    (those :func:`poll` has not run again already), to run again. Closes the list first,
    so nothing more is pushed to it. An unknown batch: (None-like) two empty lists."""
    batch = _running.pop(job, None)
    if batch is None:
        return [], []
    for member in batch.requests[batch.own:]:
        _attached.discard(member.id)
    declined: set[int] = set()
    try:
        closed = _join_script(client, batch.keys, "close")
        client.delete(*batch.keys)
        if taken is None:
            taken, declined = int(closed[0]), {int(i) for i in closed[2:]}
    except redis.RedisError as exc:
        logger.warning("continuous batching: could not close %s: %s", batch.keys[0], exc)
        if taken is None:  # unknown: those pushed run again (a result stored is kept)
            taken = 0
    end = batch.own + taken
    served = [r for i, r in enumerate(batch.requests[:end]) if i not in declined]
    return served, [*(batch.requests[i] for i in sorted(declined - batch.returned)
                      if i < end), *batch.requests[end:]]
