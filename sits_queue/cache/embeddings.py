"""Embedding cache (MISSION §4.4: "prompt-embedding cache LRU+TTL, 10,000 entries, 30 min
TTL"): a text embedded by a model within the TTL is not run through the model again.

Offline embedding jobs repeat themselves (the same documents re-indexed, the same queries
re-scored); each pool child keeps its recent vectors, least recently used evicted past
the entry bound, every entry dropped after the TTL. ``cachetools.TTLCache`` is exactly
LRU with a TTL; this wraps it with the key and the accounting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from cachetools import TTLCache

#: The source's figures.
DEFAULT_ENTRIES = 10_000
DEFAULT_TTL_S = 1800.0


class EmbeddingCache:
    """Vectors by (model, normalised or not, text); ``clock`` in seconds."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1 or not ttl_s > 0:
            raise ValueError(f"need max_entries >= 1 and ttl_s > 0, got {max_entries}, "
                             f"{ttl_s}")
        self._cache: TTLCache[tuple[str, bool, str], list[float]] = TTLCache(
            maxsize=max_entries, ttl=ttl_s, timer=clock)
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._cache)

    def embed(self, model: str, normalize: bool, texts: Sequence[str],
              compute: Callable[[list[str]], list[list[float]]]) -> tuple[list[list[float]], int]:
        """Vectors for ``texts`` in order, running ``compute`` once on the distinct texts
        not cached (or none); returns them and how many texts were served from cache."""
        vectors: list[list[float] | None] = []
        missing: dict[str, None] = {}
        for text in texts:
            vector = self._cache.get((model, normalize, text))
            vectors.append(vector)
            if vector is None:
                missing.setdefault(text)
        hits = sum(v is not None for v in vectors)
        if missing:
            computed = dict(zip(missing, compute(list(missing)), strict=True))
            for text, vector in computed.items():
                self._cache[(model, normalize, text)] = vector
            vectors = [v if v is not None else computed[t] for v, t in zip(vectors, texts,
                                                                            strict=True)]
        self.hits += hits
        self.misses += len(texts) - hits
        return [v for v in vectors if v is not None], hits
