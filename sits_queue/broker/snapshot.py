"""The priority snapshot (per-class latency stats, model hotness) as stored in Redis.

The rescoring beat task writes it; producers read it (cached) so that a fresh
message is scored with the same inputs the next rescoring pass will use.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from sits_queue.broker.keys import stats_key
from sits_queue.config import SitsConfig
from sits_queue.priority.model import ClassStats, PrioritySnapshot, Scorer

logger = logging.getLogger(__name__)

#: The stored fields of one class's stats (others, e.g. from a newer beat, are ignored).
_STATS = ("p95_ms", "jitter_ms", "bandwidth_compliance")

#: Producers re-read the snapshot at most this often, seconds (beat writes every 5 s).
SNAPSHOT_TTL_S = 2.0


def snapshot_to_json(snapshot: PrioritySnapshot) -> str:
    return json.dumps({
        "now_s": snapshot.now_s,
        "classes": {name: {"p95_ms": s.p95_ms, "jitter_ms": s.jitter_ms,
                           "bandwidth_compliance": s.bandwidth_compliance}
                    for name, s in snapshot.classes.items()},
        "hotness": dict(snapshot.hotness),
    })


def snapshot_from_json(raw: str | bytes | None, now_s: float) -> PrioritySnapshot:
    """The stored snapshot, as far as it reads: an entry that does not (a field a newer
    beat added, a NaN, not JSON at all) is left out with a warning, scoring as no data.
    Every enqueue reads this: one bad value must not stop all submissions."""
    if not raw:
        return PrioritySnapshot.empty(now_s)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        logger.warning("priority snapshot %r is not JSON (%s); scoring without it",
                       bytes(raw[:80]) if isinstance(raw, bytes) else raw[:80], exc)
        return PrioritySnapshot.empty(now_s)
    if not isinstance(data, dict):
        logger.warning("priority snapshot is not an object; scoring without it")
        return PrioritySnapshot.empty(now_s)
    classes: dict[str, ClassStats] = {}
    stored = data.get("classes")
    for name, fields in (stored.items() if isinstance(stored, dict) else ()):
        try:
            classes[name] = ClassStats(**{k: fields[k] for k in _STATS if k in fields})
        except (TypeError, ValueError, ArithmeticError) as exc:  # a huge integer too
            logger.warning("priority snapshot: class %r stats unreadable (%s); left out",
                           name, exc)
    hotness: dict[str, float] = {}
    stored = data.get("hotness")
    for model, value in (stored.items() if isinstance(stored, dict) else ()):
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and 0.0 <= value <= 1.0:  # (NaN fails both)
            hotness[model] = float(value)
        else:
            logger.warning("priority snapshot: hotness of %r is %r; left out", model, value)
    return PrioritySnapshot(now_s=now_s, classes=classes, hotness=hotness)


class SnapshotCache:
    """Per-process :class:`Scorer` over the stored snapshot, re-read every SNAPSHOT_TTL_S."""

    def __init__(self, config: SitsConfig) -> None:
        self._key = stats_key(config.global_keyprefix)
        self._config = config
        self._scorer: Scorer | None = None
        self._read_at = -SNAPSHOT_TTL_S

    def scorer(self, client: Any, now_s: float) -> Scorer:
        """A :class:`Scorer` for the cached snapshot, valid at ``now_s``."""
        mono = time.monotonic()
        if self._scorer is None or mono - self._read_at >= SNAPSHOT_TTL_S:
            try:
                raw = client.get(self._key)
            except redis.ResponseError as exc:
                # A key of another type (another program's): scored without statistics
                # until the next rescoring pass overwrites it. Raised, it failed every
                # put, the pass's own message too, so the key was never put right.
                logger.warning("priority snapshot %s unreadable (%s); scoring without it",
                               self._key, exc)
                raw = None
            snapshot = snapshot_from_json(raw, now_s)
            self._scorer = Scorer(snapshot, self._config)
            self._read_at = mono
        self._scorer.now_s = now_s
        return self._scorer
