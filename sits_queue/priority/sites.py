"""Topology-aware priority sync between sites (MISSION §2.3): the pure policy.

A deployment may span sites, each with its own Redis and workers. Each site keeps a
*standby replica* of its waiting work at one peer, so that urgent tasks survive the loss
of a site; how closely each class is kept in sync depends on its tier and on the link:

* link weight ``1 / (0.7 * rtt_ms + 0.3 * hops)`` (the source's formula); the replica
  goes to the live peer with the highest weight, the nearest;
* tiers by class weight: the heaviest class is P0 (real-time alerts in the source), the
  lightest P2 (bulk logs), any between P1;
* the decision table, with the source's 5 ms threshold (``site_strong_rtt_ms``):

  ====  ======================================  ==================================
  tier  rtt <= threshold                        rtt > threshold
  ====  ======================================  ==================================
  P0    strong: replicated in the enqueue       asynchronous, digest-checked
  P1    asynchronous, digest-checked            asynchronous, digest-checked
  P2    eventual: asynchronous, no digest       skip: no replica
  ====  ======================================  ==================================

  (P1 is not in the source's table; it gets the middle row: never a WAN round trip in
  the enqueue, never left unchecked.)

"Digest-checked": each sync pass compares an order-independent digest of the ids the
origin holds in those classes with the replica's, and repairs the replica when they
differ. The I/O is ``broker/sites.py``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from sits_queue.errors import ConfigError

#: The source's threshold between strong and asynchronous sync, ms.
STRONG_RTT_MS = 5.0
#: Site names go into Redis keys: short and printable.
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class Tier(str, enum.Enum):
    P0 = "P0"
    P1 = "P1"
    P2 = "P2"


class SyncMode(str, enum.Enum):
    STRONG = "strong"  # in the enqueue: the producer returns once the replica has it
    ASYNC_DIGEST = "async+digest"  # by the sync pass, digest-checked and repaired
    EVENTUAL = "eventual"  # by the sync pass, never checked
    SKIP = "skip"  # no replica

    @property
    def replicated(self) -> bool:
        return self is not SyncMode.SKIP


@dataclass(frozen=True)
class Peer:
    """A peer site as configured: its name, its Redis, hops away, and (optionally) a
    pinned RTT in ms instead of a measured one."""

    name: str
    redis_url: str
    hops: int = 1
    rtt_ms: float | None = None
    #: The peer's ``global_keyprefix`` (``?prefix=``), where it differs from this
    #: site's: what is written there must be under the names the peer reads. None: ours.
    key_prefix: str | None = None


@dataclass(frozen=True)
class Link:
    """A peer as measured now."""

    peer: Peer
    rtt_ms: float
    alive: bool = True

    @property
    def weight(self) -> float:
        return link_weight(self.rtt_ms, self.peer.hops)


def link_weight(rtt_ms: float, hops: int) -> float:
    """The source's ``1 / (0.7 * rtt_ms + 0.3 * hops)``; higher is nearer."""
    cost = 0.7 * rtt_ms + 0.3 * hops
    return math.inf if cost <= 0 else 1.0 / cost


def tiers(class_weights: Mapping[str, float]) -> dict[str, Tier]:
    """Each class's tier: the heaviest P0, the lightest P2, the rest P1 (one class: P0)."""
    top, bottom = max(class_weights.values()), min(class_weights.values())
    return {name: Tier.P0 if w == top else Tier.P2 if w == bottom else Tier.P1
            for name, w in class_weights.items()}


def decide(tier: Tier, rtt_ms: float, strong_rtt_ms: float = STRONG_RTT_MS) -> SyncMode:
    """The decision table (module docstring)."""
    near = rtt_ms <= strong_rtt_ms
    if tier is Tier.P0:
        return SyncMode.STRONG if near else SyncMode.ASYNC_DIGEST
    if tier is Tier.P1:
        return SyncMode.ASYNC_DIGEST
    return SyncMode.EVENTUAL if near else SyncMode.SKIP


def replica_link(links: Iterable[Link]) -> Link | None:
    """Where this site keeps its replica: the live peer with the highest link weight
    (ties by name, so every pass picks the same one)."""
    live = [link for link in links if link.alive]
    return max(live, key=lambda link: (link.weight, link.peer.name)) if live else None


@dataclass(frozen=True)
class SyncPlan:
    """One sync pass's view: the replica's peer and each class's mode toward it."""

    link: Link | None
    modes: Mapping[str, SyncMode]

    def mode(self, sla_class: str) -> SyncMode:
        if self.link is None:
            return SyncMode.SKIP
        return self.modes.get(sla_class, SyncMode.SKIP)

    def classes(self, *wanted: SyncMode) -> tuple[str, ...]:
        return tuple(sorted(c for c in self.modes if self.mode(c) in wanted))


def plan(class_weights: Mapping[str, float], links: Sequence[Link],
         strong_rtt_ms: float = STRONG_RTT_MS) -> SyncPlan:
    link = replica_link(links)
    rtt = link.rtt_ms if link is not None else math.inf
    return SyncPlan(link, {name: decide(tier, rtt, strong_rtt_ms)
                           for name, tier in tiers(class_weights).items()})


def without_strong(plan: SyncPlan) -> SyncPlan:
    """``plan`` with its strong classes asynchronous and digest-checked instead: toward a
    peer whose last synchronous write failed or timed out, so that the enqueue does not
    wait on it again for a while (the digest still checks those classes)."""
    return SyncPlan(plan.link, {c: SyncMode.ASYNC_DIGEST if m is SyncMode.STRONG else m
                                for c, m in plan.modes.items()})


def other_live_peers(links: Iterable[Link], plan: SyncPlan) -> tuple[str, ...]:
    """Live peers that do not keep the replica now, but may still hold some of it: an
    earlier replica peer (before a new measurement chose another), or one a producer
    chose by an older measurement. They are heartbeated all the same (or they would take
    over a site that is alive) and their replicas handed over to the replica peer."""
    keeper = plan.link.peer.name if plan.link is not None else None
    return tuple(sorted(link.peer.name for link in links
                        if link.alive and link.peer.name != keeper))


def encode_choice(link: Link | None) -> str:
    """The sync pass's choice of replica peer as it publishes it for producers."""
    return json.dumps(None if link is None else {"peer": link.peer.name,
                                                 "rtt_ms": link.rtt_ms})


def decode_choice(raw: bytes | str, peers: Sequence[Peer]) -> list[Link] | None:
    """A published choice as the links a producer plans with: the chosen peer alone, or
    none when the pass found no live peer; None when it cannot be used (malformed, or a
    peer this process does not know): the producer then measures by itself."""
    try:
        record = json.loads(raw)
        if record is None:
            return []
        name, rtt = str(record["peer"]), float(record["rtt_ms"])
    except (ValueError, TypeError, KeyError, OverflowError):  # (an int past float's range)
        return None
    known = {p.name: p for p in peers}
    if name not in known or not (math.isfinite(rtt) and rtt >= 0):
        return None
    return [Link(known[name], rtt, True)]


def digest(ids: Iterable[str]) -> str:
    """Order-independent digest of a set of ids: the XOR of their 128-bit hashes, and
    their count (two sets differing by a pair of ids would otherwise cancel less often
    than chance, but the count catches a missing one at once)."""
    acc, n = 0, 0
    for i in set(ids):
        acc ^= int.from_bytes(hashlib.blake2b(i.encode(), digest_size=16).digest(), "big")
        n += 1
    return f"{n}:{acc:032x}"


def parse_peers(text: str) -> tuple[Peer, ...]:
    """``site_peers``: whitespace-separated ``name=redis://...`` entries; ``hops``, a
    pinned ``rtt_ms`` and the peer's key ``prefix`` (its ``global_keyprefix``, where it
    is not this site's) may ride in the URL's query (``?hops=3&rtt_ms=12&prefix=eu:``)
    and are taken out of it. Raises :class:`ConfigError` naming the bad entry."""
    from sits_queue.config import check_redis_url, redacted

    peers: list[Peer] = []
    for entry in text.split():
        name, sep, url = entry.partition("=")
        if not sep or not name or not url:
            raise ConfigError(f"site_peers entry {redacted(entry)!r} is not "
                              "name=redis://...")
        check_site_name(name, "site_peers")
        if "," in url:  # entries are separated by spaces; a comma would hide a peer
            raise ConfigError(f"site_peers entry {name!r}: {redacted(url)!r} holds a comma; "
                              "separate entries with spaces")
        parts = urlsplit(url)
        # (blanks kept: "?prefix=" names the empty prefix, and was dropped unsaid, the
        # site's own prefix used instead; "?hops=" is refused, not read as 1)
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if twice := sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1):
            raise ConfigError(f"site_peers entry {name!r}: {', '.join(twice)} given twice")
        query = dict(pairs)
        hops_text, rtt_text = query.pop("hops", "1"), query.pop("rtt_ms", None)
        key_prefix = query.pop("prefix", None)
        if key_prefix is not None:
            from sits_queue.redisurl import check_key_prefix

            check_key_prefix(key_prefix, f"site_peers entry {name!r}: prefix")
        if not hops_text.isdigit():
            raise ConfigError(f"site_peers entry {name!r}: hops must be a whole number >= 0, "
                              f"got {hops_text!r}")
        try:
            rtt = None if rtt_text is None else float(rtt_text)
        except ValueError:
            rtt = math.nan
        if rtt is not None and not (math.isfinite(rtt) and rtt >= 0):
            raise ConfigError(f"site_peers entry {name!r}: rtt_ms must be a number >= 0, "
                              f"got {rtt_text!r}")
        if parts.scheme in ("redis", "rediss") and not parts.hostname:
            raise ConfigError(f"site_peers entry {name!r}: {redacted(url)!r} names no host")
        if parts.scheme == "unix" and not parts.path.strip("/"):
            raise ConfigError(f"site_peers entry {name!r}: {redacted(url)!r} names no "
                              "socket path")
        clean = urlunsplit(parts._replace(query=urlencode(query)))
        if parts.scheme == "unix" and not parts.netloc:  # (urlunsplit drops the "//" of
            clean = "unix://" + clean.removeprefix("unix:")  # a URL with no host)
        # The rest as for redis_url (scheme, port, database, query options, timeouts):
        # what redis-py would make of it fails here, not in every later enqueue
        check_redis_url(clean, f"site_peers entry {name!r}", celery=False)
        hops = int(hops_text)
        peers.append(Peer(name, clean, hops, rtt, key_prefix))
    names = [p.name for p in peers]
    if len(set(names)) != len(names):
        raise ConfigError(f"site_peers names a site twice: {names}")
    return tuple(peers)


def check_site_name(name: str, setting: str = "site") -> str:
    if not name or len(name) > 64 or not set(name) <= _NAME_CHARS:
        raise ConfigError(f"{setting}: site name {name!r} must be 1-64 letters, digits, "
                          "'-', '_' or '.'")
    return name
