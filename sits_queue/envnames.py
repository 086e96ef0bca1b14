"""A ``SITS_*`` variable that names no setting but nearly one: warned about once, naming
every setting as near (its stem with another unit word, or up to two typing slips).

TOML refuses an unknown key; a variable cannot be refused, since other programs share
the prefix: ``SITS_VISIBILITY_TIMEOUT`` was silently not ``SITS_VISIBILITY_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

#: The settings' warnings, under the settings' logger name (``config.py`` said them).
logger = logging.getLogger("sits_queue.config")


def warn_near_misses(env: Mapping[str, str], known: set[str]) -> None:
    """A warning, once a process, for each ``SITS_*`` variable of ``env`` that is none of
    the ``known`` settings but nearly one, or names a table only the TOML file sets."""
    for name in sorted(env):
        if not name.startswith("SITS_") or name in known:
            continue
        if name in _TABLES and (name, "") not in _warned:  # (a setting's name, not read)
            _warned.add((name, ""))
            logger.warning(
                "%s is ignored: the %s table is set in the SITS_CONFIG file (TOML)", name,
                _TABLES[name])
            continue
        near = near_names(name, known)
        if near and (name, near[0]) not in _warned:
            _warned.add((name, near[0]))
            logger.warning(
                "%s is no SITS setting and is ignored; did you mean %s?", name,
                " or ".join(near))


#: Unit suffixes a variable's name may have, lack or get wrong (``SITS_HOST_CACHE_SIZE``
#: for ``SITS_HOST_CACHE_BYTES``, ``SITS_VISIBILITY_TIMEOUT`` for ``..._TIMEOUT_S``,
#: ``SITS_SLICE`` for ``SITS_SLICE_MS``: without ``_MS`` it was "did you mean SITS_SITE?").
_UNITS = ("_BYTES", "_SIZE", "_SECONDS", "_SECS", "_MS", "_S")


def _stem(name: str) -> str:
    return next((name[:-len(u)] for u in _UNITS if name.endswith(u)), name)


def near_names(name: str, known: Iterable[str]) -> list[str]:
    """The settings ``name`` most likely meant, sorted, or none: those of its stem (a
    unit suffix missing or another), else those fewest edits away (at most 2, a swap of
    two neighbours one), else difflib's closest (``SITS_BATCH_JOINS`` is one edit from
    both ``SITS_BATCH_JOIN`` and ``SITS_BATCH_JOIN_S``: both are named; difflib alone
    named the seconds)."""
    import difflib

    known = sorted(known)
    if same := [k for k in known if _stem(k) == _stem(name)]:
        return same
    distances = {k: _edits(name, k) for k in known}
    least = min(distances.values(), default=3)
    if least <= 2:
        return [k for k, d in distances.items() if d == least]
    return difflib.get_close_matches(name, known, n=1, cutoff=0.85)


def _edits(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions and
    swaps of neighbours, one each."""
    previous, row = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        before, previous, row = previous, row, [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(previous[j] + 1, row[j - 1] + 1,
                         previous[j - 1] + (a[i - 1] != b[j - 1]))
            if (before is not None and j > 1 and a[i - 1] == b[j - 2]
                    and a[i - 2] == b[j - 1]):
                row[j] = min(row[j], before[j - 2] + 1)
    return row[-1]


#: The settings no variable sets, by the variable their name would make.
_TABLES = {"SITS_CLASSES": "[[classes]]", "SITS_WEIGHTS": "[weights]"}
#: (variable, setting) pairs already warned about in this process.
_warned: set[tuple[str, str]] = set()
