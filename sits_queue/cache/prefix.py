"""KV-prefix cache: a prompt that starts like an earlier one reuses that prompt's KV cache
instead of recomputing it (MISSION §1.1: "whether its prompt prefix can reuse a KV cache
already held by some worker"; the design card's "KV caches warm across tasks").

Offline inference jobs mostly share long prefixes (one system prompt or instruction
template over thousands of inputs), and prefill of the shared part is the same work every
time. Each pool child keeps the KV caches of recent prompts, per model, under a byte
budget; a new prompt's prefill starts after the longest cached prefix it shares, in whole
blocks of :data:`BLOCK_TOKENS` (vLLM's automatic prefix caching keys blocks the same way:
a block's key hashes its tokens and the key of the block before it, so equal keys mean
equal prefixes).

This module is the pure part (block keys, the LRU plan) and the store that applies it;
it never touches torch: the cached objects are opaque, sized by the caller. The decode
loop (``workers/decoding.py``) copies and crops them.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Tokens per block: a prefix is reused in whole blocks (as in vLLM's default of 16).
BLOCK_TOKENS = 16


def block_keys(tokens: Sequence[int], block: int = BLOCK_TOKENS) -> list[bytes]:
    """One key per whole block of ``tokens``: key i covers tokens ``[0, (i + 1) * block)``."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    keys: list[bytes] = []
    previous = b""
    for start in range(0, len(tokens) - block + 1, block):
        chunk = ",".join(map(str, tokens[start:start + block])).encode()
        previous = hashlib.blake2b(previous + b"|" + chunk, digest_size=16).digest()
        keys.append(previous)
    return keys


@dataclass(frozen=True)
class Slot:
    """One cached prefix, as the policy sees it."""

    id: int
    size_bytes: int
    last_used: float


def plan_evictions(slots: Iterable[Slot], budget_bytes: int, incoming_bytes: int
                   ) -> tuple[int, ...] | None:
    """Ids to evict, least recently used first, so ``incoming_bytes`` fits the budget;
    None when it cannot fit even in an empty store."""
    if incoming_bytes > budget_bytes:
        return None
    ordered = sorted(slots, key=lambda s: (s.last_used, s.id))
    used = sum(s.size_bytes for s in ordered)
    evict: list[int] = []
    for slot in ordered:
        if used + incoming_bytes <= budget_bytes:
            break
        evict.append(slot.id)
        used -= slot.size_bytes
    return tuple(evict)


#: Prefix keys (``TaskOptions.prefix_key``) a child advertises at most: the newest.
MAX_TAGS = 256


@dataclass
class _Entry:
    model: str
    keys: tuple[bytes, ...]
    value: Any
    size_bytes: int
    last_used: float
    #: ``prefix_key`` s of the tasks that stored or reused it (for affinity), newest last.
    tags: list[str] = field(default_factory=list)

    def tag(self, key: str | None) -> None:
        if key is not None:
            if key in self.tags:
                self.tags.remove(key)
            self.tags.append(key)
            # a shared template reused by task after task: only the newest can be
            # advertised (MAX_TAGS), so only they are kept (the list grew without bound)
            del self.tags[:-MAX_TAGS]


@dataclass(frozen=True)
class Hit:
    """A cached prefix a prompt can start from: ``value`` holds the KV of a stored
    prompt whose first ``tokens`` positions are this prompt's too (copy it, cut to
    ``tokens``, before extending it)."""

    value: Any
    tokens: int


class PrefixStore:
    """The KV caches of recent prompts of one pool child, per model, LRU under a budget.

    ``clock`` orders recency only (seconds). Not thread-safe: one pool child runs one
    task at a time.
    """

    def __init__(self, budget_bytes: int, block: int = BLOCK_TOKENS,
                 clock: Any = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.block = block
        self._clock = clock or time.monotonic
        self._entries: dict[int, _Entry] = {}
        self._index: dict[tuple[str, bytes], int] = {}
        self._ids = itertools.count(1)
        self.hits = self.misses = self.stored = self.evicted = 0

    @property
    def used_bytes(self) -> int:
        return sum(e.size_bytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def models(self) -> dict[str, int]:
        """Cached prefixes per model (what the child advertises)."""
        out: dict[str, int] = {}
        for e in self._entries.values():
            out[e.model] = out.get(e.model, 0) + 1
        return dict(sorted(out.items()))

    def tags(self) -> list[str]:
        """The ``prefix_key`` s of the tasks whose prefixes are held, most recent first,
        at most :data:`MAX_TAGS` (what the child advertises for affinity)."""
        seen: dict[str, None] = {}
        for entry in sorted(self._entries.values(), key=lambda e: -e.last_used):
            for key in reversed(entry.tags):
                seen.setdefault(key)
        return list(seen)[:MAX_TAGS]

    def lookup(self, model: str, tokens: Sequence[int], tag: str | None = None
               ) -> Hit | None:
        """The longest cached prefix of ``tokens`` for ``model``, in whole blocks, but
        never all of ``tokens`` (the model must see at least one token to give logits).
        A hit's entry is tagged with the task's ``prefix_key``."""
        keys = block_keys(tokens[:len(tokens) - 1], self.block)
        for i in range(len(keys) - 1, -1, -1):
            entry_id = self._index.get((model, keys[i]))
            if entry_id is not None:
                entry = self._entries[entry_id]
                entry.last_used = self._clock()
                entry.tag(tag)
                self.hits += 1
                return Hit(entry.value, (i + 1) * self.block)
        self.misses += 1
        return None

    def covered(self, model: str, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens``' whole-block prefix already cached (nothing is counted)."""
        keys = block_keys(tokens, self.block)
        for i in range(len(keys) - 1, -1, -1):
            if (model, keys[i]) in self._index:
                return (i + 1) * self.block
        return 0

    def store(self, model: str, tokens: Sequence[int], value: Any, size_bytes: int,
              tag: str | None = None) -> bool:
        """Keep ``value``, the KV cache of exactly ``tokens`` (a whole number of blocks),
        evicting the least recently used; False when it does not fit at all."""
        if len(tokens) == 0 or len(tokens) % self.block:
            raise ValueError(f"a stored prefix is whole blocks of {self.block} tokens, "
                             f"got {len(tokens)}")
        plan = plan_evictions((Slot(i, e.size_bytes, e.last_used)
                               for i, e in self._entries.items()),
                              self.budget_bytes, size_bytes)
        if plan is None:
            return False
        for entry_id in plan:
            self._remove(entry_id)
            self.evicted += 1
        keys = tuple(block_keys(tokens, self.block))
        entry_id = next(self._ids)
        self._entries[entry_id] = _Entry(model, keys, value, size_bytes, self._clock())
        self._entries[entry_id].tag(tag)
        for key in keys:  # the newest entry serves every prefix it holds
            self._index[(model, key)] = entry_id
        self.stored += 1
        return True

    def drop(self, models: Iterable[Hashable]) -> int:
        """Forget every prefix of these models (their engine left the device); how many."""
        gone = {str(m) for m in models}
        ids = [i for i, e in self._entries.items() if e.model in gone]
        for entry_id in ids:
            self._remove(entry_id)
        return len(ids)

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        for key in entry.keys:
            if self._index.get((entry.model, key)) == entry_id:
                # Another live entry of this model may hold the same prefix: repoint.
                other = next((i for i, e in self._entries.items()
                              if e.model == entry.model and key in e.keys), None)
                if other is None:
                    del self._index[(entry.model, key)]
                else:
                    self._index[(entry.model, key)] = other
