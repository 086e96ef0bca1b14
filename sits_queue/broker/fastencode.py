"""Encoding shortcuts for ``enqueue_many`` (``bulk.py``): Celery's ``saferepr`` and
kombu's JSON for arguments of flat scalars, where each is much faster than the general
path and writes the same text; anything else declines, for the general path."""

from __future__ import annotations

import math
from typing import Any

import orjson
from kombu.serialization import dumps

#: Scalar types whose saferepr is ``str(value)`` (exact types: subclasses such as IntEnum
#: may print differently).
_NUMBERS = (int, float, bool)
#: Longest argument list the fast repr handles; longer ones go through saferepr.
_FAST_REPR_ITEMS = 32


def _scalar_repr(value: Any) -> str | None:
    kind = type(value)
    if kind is str:
        text: str = value
        return "'" + text.replace("'", "\\'") + "'"
    if kind in _NUMBERS:
        # Non-finite floats go the slow way: the JSON fast path (orjson) would write null.
        return str(value) if kind is not float or math.isfinite(value) else None
    if value is None:
        return "None"
    return None


def fast_saferepr(value: Any, maxlen: int) -> str | None:
    """Celery's ``saferepr(value, maxlen)`` for flat args/kwargs of plain scalars, else None.

    ``create_task_message`` spends most of its time in ``saferepr`` for ``argsrepr`` and
    ``kwargsrepr``; for a tuple, list or str-keyed dict of str/int/float/bool/None that
    fits in ``maxlen`` its output is simple: numbers print with ``str``, strings in single
    quotes with only ``'`` escaped, no truncation. Anything else returns None (use
    saferepr). ``tests/unit/test_bulk.py`` checks the two agree.
    """
    kind = type(value)
    if kind is dict:
        if len(value) > _FAST_REPR_ITEMS:
            return None
        parts = []
        for k, v in value.items():
            kr, vr = (_scalar_repr(k), _scalar_repr(v)) if type(k) is str else (None, None)
            if kr is None or vr is None:
                return None
            parts.append(f"{kr}: {vr}")
        text = "{" + ", ".join(parts) + "}"
    elif kind is tuple or kind is list:
        if len(value) > _FAST_REPR_ITEMS:
            return None
        reprs = [_scalar_repr(v) for v in value]
        if None in reprs:
            return None
        inner = ", ".join(reprs)  # type: ignore[arg-type]
        if kind is list:
            text = "[" + inner + "]"
        else:
            text = "(" + inner + (",)" if len(value) == 1 else ")")
    else:
        return None
    # Shorter than maxlen: no token reaches saferepr's truncation point.
    return text if len(text) < maxlen else None


def plain_json(body: Any) -> tuple[str, str, str]:
    """kombu's ``dumps(body, "json")`` for a body of flat scalars, through orjson (20x
    faster): for these values the two write the same JSON up to whitespace. Anything
    orjson refuses (a lone surrogate, an int over 64 bits) goes through kombu."""
    try:
        return "application/json", "utf-8", orjson.dumps(body).decode()
    except TypeError:
        return dumps(body, serializer="json")  # type: ignore[no-any-return,no-untyped-call]
