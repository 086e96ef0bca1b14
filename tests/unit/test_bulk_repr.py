"""``fast_saferepr`` must print exactly what Celery's ``saferepr`` prints, or decline."""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import pytest
from celery.utils.saferepr import saferepr

from sits_queue.broker.fastencode import fast_saferepr

MAXLEN = 1024  # Celery's argsrepr_maxsize / kwargsrepr_maxsize default


class Colour(IntEnum):
    RED = 1


@pytest.mark.parametrize("value", [
    (), ("x",), ("a", "b"), (1, 2.5, True, None), [], ["x"], [1, "two"],
    {}, {"n": 3}, {"a": "it's", "b": None, "c": -0.0},
    ("quote ' inside", 'double " inside', "new\nline", "tab\t", "üñíçødé", "back\\slash"),
    (10**30, -7, 1e300, 5e-324),
    ("x" * 500, "y" * 500),
])
def test_agrees_with_saferepr(value: Any) -> None:
    fast = fast_saferepr(value, MAXLEN)
    assert fast is not None
    assert fast == saferepr(value, MAXLEN, maxlevels=3)


@pytest.mark.parametrize("value", [
    ("x" * 1100,),  # saferepr truncates: too long for the fast path
    ((1, 2),), ([1],), ({"a": 1},),  # nested containers
    (b"bytes",), (Colour.RED,), ({1: "int key"}),
    tuple(range(100)),  # more items than the fast path takes
    "a string", 42, None,
    # saferepr prints these fine, but the orjson body fast path that a fast repr
    # unlocks would write NaN and infinities as null.
    (float("nan"),), (float("inf"),), {"x": float("-inf")},
])
def test_declines_what_it_does_not_reproduce(value: Any) -> None:
    assert fast_saferepr(value, MAXLEN) is None


def test_the_length_bound_is_strict() -> None:
    text = "x" * (MAXLEN - 5)  # repr is "('xxx…',)": MAXLEN - 5 + 5 characters
    assert fast_saferepr((text,), MAXLEN) is None
    shorter = (text[:-1],)
    assert fast_saferepr(shorter, MAXLEN) == saferepr(shorter, MAXLEN, maxlevels=3)
