"""Input entropy (MISSION §1.3): how information-dense a task's text arguments are.

High-entropy inputs rank a little lower (``model.py``) and are split into early-stoppable
shards on submission (``sits_queue/shards.py``); here they are measured and flagged.
Entropy is order-0 Shannon entropy of the UTF-8 bytes, in bits per byte, divided by 8 so
it lies in [0, 1]. It is cheap (one pass, no model) because it runs on the submission
path.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

#: Bits in a byte: the most entropy a byte stream can carry, bits/byte.
BITS_PER_BYTE = 8
#: Default cap on text measured per task, bytes: entropy is stable long before this.
DEFAULT_LIMIT_BYTES = 65536
#: Deepest container nesting walked, levels: task payloads are shallow; this bounds cycles.
MAX_DEPTH = 4
#: Most values visited per task, items: bounds the cost of huge non-text lists.
MAX_ITEMS = 10_000
#: Normalised entropy at or above which an input is sharded (4.8 bits/byte). Measured:
#: base64 0.75, Chinese 0.66, mixed scripts ~0.62 land above; English prose 0.55-0.65,
#: Python source 0.55-0.6, hex 0.5 mostly below (README: what this measure picks out).
SHARD_ENTROPY = 0.6


#: ``c * log2(c)`` for small counts, looked up rather than computed: entropy runs once per
#: submitted task, and for typical prompts nearly every byte count is below this.
_CLOG_TABLE_SIZE = 4096
_CLOG = tuple(c * math.log2(c) if c else 0.0 for c in range(_CLOG_TABLE_SIZE))


def _clog(c: int) -> float:
    return _CLOG[c] if c < _CLOG_TABLE_SIZE else c * math.log2(c)


def _byte_entropy(data: bytes) -> float:
    if not data:
        return 0.0
    n = len(data)
    # H = -sum(p log2 p) with p = c/n, rearranged to log2(n) - sum(c log2 c)/n so each
    # distinct byte costs one table lookup instead of a division and a log.
    bits = math.log2(n) - math.fsum(map(_clog, Counter(data).values())) / n
    # Rounding can leave -0.0 or a hair over 1 for uniform bytes; keep the promised range.
    return min(1.0, max(0.0, bits / BITS_PER_BYTE))


def text_entropy(text: str) -> float:
    """Shannon entropy of ``text``'s UTF-8 bytes / 8, in [0, 1]; 0.0 for ``""``."""
    return _byte_entropy(text.encode("utf-8", errors="surrogatepass"))


def _strings(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Iterator[str]:
    """Every ``str`` in args then kwargs values, depth-first, within the depth/item caps."""
    stack: list[tuple[Any, int]] = [(v, 0) for v in reversed(list(kwargs.values()))]
    stack += [(v, 0) for v in reversed(args)]
    visited = 0
    while stack and visited < MAX_ITEMS:
        value, depth = stack.pop()
        visited += 1
        if isinstance(value, str):
            yield value
        elif depth < MAX_DEPTH and isinstance(value, (list, tuple, dict)):
            children = value.values() if isinstance(value, dict) else value
            # islice: a million-element list must not be copied to visit MAX_ITEMS of it.
            stack += [(v, depth + 1) for v in reversed(list(islice(children, MAX_ITEMS)))]


def input_entropy(
    args: Sequence[Any], kwargs: Mapping[str, Any], limit_bytes: int = DEFAULT_LIMIT_BYTES
) -> float | None:
    """Entropy of the text in a task's arguments, or None when they hold no ``str``.

    Strings inside lists, tuples and dict values are found up to :data:`MAX_DEPTH`
    levels down; ``bytes`` are skipped (they are usually tensors or images, not text).
    At most ``limit_bytes`` of UTF-8 are measured.
    """
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
    chunks: list[bytes] = []
    size = 0
    found = False
    for text in _strings(args, kwargs):
        found = True
        chunk = text.encode("utf-8", errors="surrogatepass")[: limit_bytes - size]
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit_bytes:
            break
    return _byte_entropy(b"".join(chunks)) if found else None


def is_shardable(entropy: float | None) -> bool:
    """True when §1.3 wants this input split into early-stoppable shards."""
    return entropy is not None and entropy >= SHARD_ENTROPY
