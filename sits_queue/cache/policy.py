"""The two-tier warm-pool policy (MISSION §4.3), pure: no torch, no I/O, ``now`` passed in.

A *device* pool (engines resident in GPU memory: a hit costs nothing) is backed by a
*host* shadow pool (weights kept in CPU memory: a promotion copies them back and skips
the disk). Each tier has a byte budget; an engine lives in exactly one tier.

Decisions follow vLLM's "snapshot in, plan out": ``plan_*`` reads a :class:`PoolState`
and returns a :class:`Plan` of ordered actions; :func:`apply` turns state and plan into
the next state and checks the invariants after every action, so the engine cache that
executes a plan one action at a time never holds more than either budget, but for one
bounded swap: a device engine demoted into the host room its successor's promotion frees
(both tiers full, the two trade places) may hold the host over budget by at most that
successor's size until its promotion, the next action but one. Otherwise a working set
that fits both tiers went back to disk on every cycle.

Actions, each ``(kind, key)``:

* ``demote``: device -> host (the weights stay in host memory);
* ``evict``: drop the engine from whichever tier holds it;
* ``promote``: host -> device;
* ``load``: from disk into the device (a cold start);
* ``sync``: write a dirty entry back before it is dropped (or in a batch, ``plan_sync``);
* ``resize``: a device entry takes the plan's ``size_bytes`` from now on (``plan_resize``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

Tier = Literal["device", "host"]
ActionKind = Literal["demote", "evict", "promote", "load", "sync", "resize"]
Action = tuple[ActionKind, str]

#: Use timestamps kept per entry: older uses weigh < 2**-16 at any sane half-life anyway.
MAX_USES = 16
#: Half-life of one use's weight in the activity score, seconds: a model called every few
#: minutes outranks one called in a burst an hour ago.
DEFAULT_HALF_LIFE_S = 300.0


class InvariantViolation(RuntimeError):
    """A pool state broke a budget or its key bookkeeping: a bug in a plan or its caller."""


class IllegalAction(ValueError):
    """An action does not fit the state it is applied to (e.g. promoting a device entry)."""


@dataclass(frozen=True)
class Entry:
    """One cached engine."""

    key: str
    size_bytes: int
    tier: Tier
    #: Time of the latest use, seconds (any monotonic clock, as long as ``now_s`` matches).
    last_used_s: float
    #: Recent use times, oldest first, at most :data:`MAX_USES`.
    uses: tuple[float, ...] = ()
    #: Holds state not yet written back (e.g. an updated KV cache).
    dirty: bool = False

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("entry key must be non-empty")
        if self.size_bytes < 0:
            raise ValueError(f"entry {self.key}: size_bytes must be >= 0")
        if self.tier not in ("device", "host"):
            raise ValueError(f"entry {self.key}: unknown tier {self.tier!r}")
        if len(self.uses) > MAX_USES:
            raise ValueError(f"entry {self.key}: more than {MAX_USES} uses kept")

    def used_at(self, now_s: float) -> Entry:
        return replace(self, last_used_s=now_s, uses=(*self.uses, now_s)[-MAX_USES:])


def _frozen_entries(entries: Mapping[str, Entry] | None = None) -> Mapping[str, Entry]:
    return MappingProxyType(dict(entries or {}))


@dataclass(frozen=True)
class PoolState:
    """A snapshot of both tiers."""

    device_budget_bytes: int
    host_budget_bytes: int
    entries: Mapping[str, Entry] = field(default_factory=_frozen_entries, hash=False)

    def __post_init__(self) -> None:
        if self.device_budget_bytes < 0 or self.host_budget_bytes < 0:
            raise ValueError("budgets must be >= 0")
        # A caller's dict must not change the snapshot behind its back.
        object.__setattr__(self, "entries", _frozen_entries(self.entries))

    def on(self, tier: Tier) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries.values() if e.tier == tier)

    def used(self, tier: Tier) -> int:
        return sum(e.size_bytes for e in self.on(tier))

    def free(self, tier: Tier) -> int:
        budget = self.device_budget_bytes if tier == "device" else self.host_budget_bytes
        return budget - self.used(tier)

    @property
    def device_used(self) -> int:
        return self.used("device")

    @property
    def host_used(self) -> int:
        return self.used("host")

    def with_entries(self, entries: Mapping[str, Entry]) -> PoolState:
        return replace(self, entries=entries)


def activity_score(entry: Entry, now_s: float, half_life_s: float) -> float:
    """"LRU weighted by recent activity": ``sum(0.5 ** ((now - t) / half_life))`` over uses.

    Every recent use counts, each decaying by half per ``half_life_s``: one use just now
    scores 1, eight uses one half-life ago score 4. Pure recency (LRU) is the limit of a
    tiny half-life; pure frequency (LFU) of a huge one. Future stamps (clock skew) count 1.
    """
    if not half_life_s > 0:
        raise ValueError(f"half_life_s must be > 0, got {half_life_s!r}")
    return sum(math.pow(0.5, max(0.0, now_s - t) / half_life_s) for t in entry.uses)


def victim_order(entries: Iterable[Entry], now_s: float,
                 half_life_s: float = DEFAULT_HALF_LIFE_S) -> list[Entry]:
    """Coldest first: lowest activity score, ties to the older ``last_used_s``, then key."""
    return sorted(entries, key=lambda e: _rank(e, now_s, half_life_s))


def _rank(entry: Entry, now_s: float, half_life_s: float) -> tuple[float, float, str]:
    return activity_score(entry, now_s, half_life_s), entry.last_used_s, entry.key


@dataclass(frozen=True)
class Plan:
    """Ordered actions, plus the engine being admitted (``apply`` records its use)."""

    actions: tuple[Action, ...] = ()
    #: The engine admitted by ``plan_admit``; None for housekeeping plans.
    key: str | None = None
    #: Its size, bytes (what a ``load`` action allocates).
    size_bytes: int = 0
    #: False when the engine cannot be placed on the device; ``reason`` says why.
    fits: bool = True
    reason: str | None = None
    #: New host budget set by ``plan_shrink_host`` once its evictions are done.
    host_budget_bytes: int | None = None
    #: The host engine this plan promotes, whose room it lends to demotions before the
    #: promotion: while it is on the host, the host may hold up to its size more.
    swap: str | None = None

    @property
    def hit(self) -> bool:
        """The engine was already on the device: nothing to do."""
        return self.fits and self.key is not None and not self.actions

    @property
    def cold(self) -> bool:
        """The plan loads from disk (a cold start, MISSION §4.1)."""
        return any(kind == "load" for kind, _ in self.actions)


# -- applying ---------------------------------------------------------------------------------

def check(state: PoolState, host_slack_bytes: int = 0) -> None:
    """Raise :class:`InvariantViolation` unless both budgets hold (the host's give or take
    ``host_slack_bytes``, a swap's) and keys are consistent."""
    for key, entry in state.entries.items():
        if key != entry.key:
            raise InvariantViolation(f"entry {entry.key!r} stored under key {key!r}")
    for tier in ("device", "host"):
        over = -state.free(tier) - (host_slack_bytes if tier == "host" else 0)
        if over > 0:
            raise InvariantViolation(f"{tier} pool over budget by {over} bytes")


def _slack(state: PoolState, plan: Plan) -> int:
    """What ``plan``'s swap lends the host: its engine's size while that is still there."""
    entry = state.entries.get(plan.swap) if plan.swap is not None else None
    return entry.size_bytes if entry is not None and entry.tier == "host" else 0


def _expect(state: PoolState, action: Action, tier: Tier | None) -> Entry:
    kind, key = action
    entry = state.entries.get(key)
    if entry is None or (tier is not None and entry.tier != tier):
        where = "absent" if entry is None else f"on {entry.tier}"
        raise IllegalAction(f"cannot {kind} {key!r}: it is {where}")
    return entry


def _step(state: PoolState, action: Action, load_size_bytes: int, now_s: float) -> PoolState:
    kind, key = action
    entries = dict(state.entries)
    if kind == "load":
        if key in entries:
            raise IllegalAction(f"cannot load {key!r}: already cached")
        entries[key] = Entry(key, load_size_bytes, "device", last_used_s=now_s)
    elif kind == "evict":
        del entries[_expect(state, action, None).key]
    elif kind == "sync":
        entries[key] = replace(_expect(state, action, None), dirty=False)
    elif kind == "resize":
        entries[key] = replace(_expect(state, action, "device"), size_bytes=load_size_bytes)
    else:
        source: Tier = "device" if kind == "demote" else "host"
        target: Tier = "host" if kind == "demote" else "device"
        entries[key] = replace(_expect(state, action, source), tier=target)
    return state.with_entries(entries)


def apply(state: PoolState, plan: Plan, now_s: float) -> PoolState:
    """The state after ``plan``; invariants are checked after every action.

    A refused plan changes nothing. The admitted engine's use is recorded at ``now_s``.
    """
    if not plan.fits:
        return state
    for action in plan.actions:
        state = _step(state, action, plan.size_bytes, now_s)
        check(state, _slack(state, plan))
    if plan.key is not None:
        entry = state.entries.get(plan.key)
        if entry is None or entry.tier != "device":
            raise IllegalAction(f"plan for {plan.key!r} does not leave it on the device")
        state = state.with_entries({**state.entries, plan.key: entry.used_at(now_s)})
    if plan.host_budget_bytes is not None:
        state = replace(state, host_budget_bytes=plan.host_budget_bytes)
    check(state, _slack(state, plan))
    return state


def _run(state: PoolState, actions: Iterable[Action], now_s: float) -> PoolState:
    for action in actions:
        state = _step(state, action, 0, now_s)
    return state


# -- planning ---------------------------------------------------------------------------------

def _drop(entry: Entry) -> list[Action]:
    """Evict, writing a dirty entry back first."""
    return [("sync", entry.key), ("evict", entry.key)] if entry.dirty else [("evict", entry.key)]


def _displace(state: PoolState, victim: Entry, keep: str, now_s: float,
              half_life_s: float, lent: int) -> list[Action]:
    """Move ``victim`` off the device: demote it if the host can make room by evicting
    only colder entries (never ``keep``, the engine being promoted; ``lent``, the host
    bytes its promotion frees, counts as room), else drop it."""
    free = state.free("host") + lent
    colder: list[Entry] = []
    victim_rank = _rank(victim, now_s, half_life_s)
    for candidate in victim_order((e for e in state.on("host") if e.key != keep),
                                  now_s, half_life_s):
        if free >= victim.size_bytes or _rank(candidate, now_s, half_life_s) > victim_rank:
            break
        colder.append(candidate)
        free += candidate.size_bytes
    if free < victim.size_bytes:
        return _drop(victim)
    return [*(a for c in colder for a in _drop(c)), ("demote", victim.key)]


def _make_device_room(state: PoolState, size_bytes: int, keep: str, now_s: float,
                      half_life_s: float, lent: int) -> list[Action]:
    actions: list[Action] = []
    for victim in _victims(state, size_bytes, keep, now_s, half_life_s):
        step = _displace(state, victim, keep, now_s, half_life_s, lent)
        state = _run(state, step, now_s)
        actions += step
    return _evicted_where_demoted(actions)


def _victims(state: PoolState, size_bytes: int, keep: str, now_s: float,
             half_life_s: float) -> list[Entry]:
    """The device engines that leave to free ``size_bytes``: the coldest first until
    they do, less those whose room the later, larger ones made needless, the warmest
    of them kept first (a small cold engine taken first, then a larger one that freed
    enough alone: both went, the small one the engine just used, and it came back from
    the host at its next task)."""
    free = state.free("device")
    chosen: list[Entry] = []
    for victim in victim_order((e for e in state.on("device") if e.key != keep),
                               now_s, half_life_s):
        if free >= size_bytes:
            break
        chosen.append(victim)
        free += victim.size_bytes
    for victim in reversed(chosen[:-1]):
        if free - victim.size_bytes >= size_bytes:
            chosen.remove(victim)
            free -= victim.size_bytes
    return chosen


def _evicted_where_demoted(actions: list[Action]) -> list[Action]:
    """An engine demoted and then dropped to make room for a warmer one, in one plan, is
    dropped where it was demoted: its copy to the host was for nothing (and the task's
    result named it demoted as well as evicted). Dropped sooner, it frees the device
    sooner and never holds the host: every step stays within both budgets."""
    dropped = {key for kind, key in actions if kind == "evict"}
    twice = {key for kind, key in actions if kind == "demote" and key in dropped}
    out: list[Action] = []
    for kind, key in actions:
        if key not in twice:
            out.append((kind, key))
        elif kind == "demote":  # its later write-back and eviction, here
            out += [a for a in actions if a[1] == key and a[0] in ("sync", "evict")]
    return out


def plan_admit(state: PoolState, key: str, size_bytes: int, now_s: float,
               half_life_s: float = DEFAULT_HALF_LIFE_S) -> Plan:
    """Plan to make ``key`` resident on the device.

    On the device already: a hit, no actions. On the host: demote (or drop) the coldest
    device entries until it fits, then promote it, skipping the disk; its host room counts
    for those demotions (a swap, ``Plan.swap``). Absent: the same, then load it. A cached
    entry keeps its recorded size. An engine larger than the whole device budget is
    refused (``fits=False``): the pool raises ``EngineTooLarge`` and the task fails
    naming the budget to raise (``VramLimitExceeded``).
    """
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
    entry = state.entries.get(key)
    size = entry.size_bytes if entry is not None else size_bytes
    if entry is not None and entry.tier == "device":
        return Plan(key=key, size_bytes=size)
    if size > state.device_budget_bytes:
        return Plan(key=key, size_bytes=size, fits=False,
                    reason=f"engine {key!r} needs {size} bytes; the device pool holds "
                           f"{state.device_budget_bytes}: it cannot be placed on the device")
    lent = size if entry is not None else 0
    actions = _make_device_room(state, size, key, now_s, half_life_s, lent)
    actions.append(("promote" if entry is not None else "load", key))
    return Plan(actions=tuple(actions), key=key, size_bytes=size,
                swap=key if entry is not None else None)


def plan_resize(state: PoolState, key: str, size_bytes: int, now_s: float,
                half_life_s: float = DEFAULT_HALF_LIFE_S) -> Plan:
    """Plan for ``key``, on the device, to count ``size_bytes`` from now on: what an
    engine takes there may be known only once it is there (a TensorRT execution context's
    activation memory, read from the deserialised engine). When it grew, the coldest other
    device engines make room first, as for an admission; refused (``fits=False``) past
    the whole device budget. The plan records no use: the admission did.
    """
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
    entry = _expect(state, ("resize", key), "device")
    if size_bytes > state.device_budget_bytes:
        return Plan(size_bytes=size_bytes, fits=False,
                    reason=f"engine {key!r} takes {size_bytes} bytes on the device; the "
                           f"device pool holds {state.device_budget_bytes}")
    # Room for the growth: the device's free bytes must cover it before the resize
    actions = _make_device_room(state, size_bytes - entry.size_bytes, key, now_s,
                                half_life_s, 0)
    return Plan(actions=(*actions, ("resize", key)), size_bytes=size_bytes)


def plan_expire(state: PoolState, now_s: float, host_ttl_s: float) -> Plan:
    """Drop host entries unused for longer than ``host_ttl_s`` (aging by time)."""
    if not host_ttl_s > 0:
        raise ValueError(f"host_ttl_s must be > 0, got {host_ttl_s!r}")
    stale = sorted((e for e in state.on("host") if now_s - e.last_used_s > host_ttl_s),
                   key=lambda e: (e.last_used_s, e.key))
    return Plan(actions=tuple(a for e in stale for a in _drop(e)))


def plan_shrink_host(state: PoolState, new_budget_bytes: int, now_s: float,
                     half_life_s: float = DEFAULT_HALF_LIFE_S) -> Plan:
    """Drop the coldest host entries until the host pool fits ``new_budget_bytes``
    (aging by memory pressure); :func:`apply` then sets the new budget."""
    if new_budget_bytes < 0:
        raise ValueError(f"new_budget_bytes must be >= 0, got {new_budget_bytes}")
    excess = state.host_used - new_budget_bytes
    actions: list[Action] = []
    for victim in victim_order(state.on("host"), now_s, half_life_s):
        if excess <= 0:
            break
        actions += _drop(victim)
        excess -= victim.size_bytes
    return Plan(actions=tuple(actions), host_budget_bytes=new_budget_bytes)


def mark_dirty(state: PoolState, key: str) -> PoolState:
    """``key`` now holds state not yet written back."""
    entry = _expect(state, ("sync", key), None)
    return state.with_entries({**state.entries, key: replace(entry, dirty=True)})


def plan_sync(state: PoolState, max_batch: int) -> Plan:
    """Write back up to ``max_batch`` dirty entries, least recently used first
    (MISSION §4.3: dirty entries are synced in batches)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    dirty = sorted((e for e in state.entries.values() if e.dirty),
                   key=lambda e: (e.last_used_s, e.key))
    return Plan(actions=tuple(("sync", e.key) for e in dirty[:max_batch]))
