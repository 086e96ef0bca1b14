"""The priority snapshot (per-class latency stats, model hotness) as stored in Redis.

The rescoring beat task writes it; producers read it (cached) so that a fresh
message is scored with the same inputs the next rescoring pass will use.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sits_queue.broker.keys import stats_key
from sits_queue.config import SitsConfig
from sits_queue.priority.model import ClassStats, PrioritySnapshot, Scorer

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
    if not raw:
        return PrioritySnapshot.empty(now_s)
    data = json.loads(raw)
    classes = {name: ClassStats(**fields) for name, fields in data.get("classes", {}).items()}
    return PrioritySnapshot(now_s=now_s, classes=classes, hotness=data.get("hotness", {}))


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
            snapshot = snapshot_from_json(client.get(self._key), now_s)
            self._scorer = Scorer(snapshot, self._config)
            self._read_at = mono
        self._scorer.now_s = now_s
        return self._scorer
