"""Checks of one setting's value, shared by the config dataclasses: each raises
:class:`ConfigError` naming the setting and what it must hold."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from sits_queue.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
#: A scalar setting's declared type (annotations are strings here) -> what it must hold.
KINDS: dict[str, tuple[type, str]] = {
    "bool": (bool, "true or false"), "int": (int, "an integer"),
    "float": (float, "a finite number"), "str": (str, "a string")}


def coerce(name: str, raw: str, kind: type) -> Any:
    if kind is bool:
        word = raw.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        # a typo must not silently mean "off"
        raise ConfigError(f"SITS_{name.upper()}={raw!r} is not a boolean (one of "
                          f"{', '.join(_TRUE)} / {', '.join(w for w in _FALSE if w)})")
    try:
        return kind(raw)
    except ValueError as exc:
        raise ConfigError(f"SITS_{name.upper()}={raw!r} is not a valid {kind.__name__}") from exc


def check_types(obj: Any, where: str = "") -> None:
    """Each scalar field holds its declared type: a TOML ``send_sent_events = "no"``
    (a truthy string), ``rescore_chunk = 2.5`` (Redis refuses it at every pass) or a NaN
    timeout is refused here, naming the setting, not later and elsewhere."""
    for f in fields(obj):
        kind, what = KINDS.get(str(f.type), (None, ""))
        value = getattr(obj, f.name)
        if kind is None:
            continue
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = is_number(value) and math.isfinite(value)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise ConfigError(f"{where}{f.name} must be {what}, got {value!r}")
        if f.name.endswith("_s") and is_number(value) and value > MAX_DURATION_S:
            # a duration past a year is a typo (ms for s), and past ~1e9 s it fails later,
            # elsewhere: a beat schedule's timedelta, a wait's timeout, a Redis EXPIRE
            raise ConfigError(f"{where}{f.name} must be at most {MAX_DURATION_S:g} s (a "
                              f"year), got {value!r}")


#: Longest duration setting (``*_s``), s: a year.
MAX_DURATION_S = 365 * 86_400


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(name: str, value: object, most: int, note: str = "", least: int = 0) -> None:
    """An integer (not a bool) in [least, most]; ``note`` says what 0 means."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ConfigError(f"{name} must be an integer in [{least}, {most}]{note}, "
                          f"got {value!r}")


def positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


def non_negative(name: str, value: float, note: str = "") -> None:
    """A finite number >= 0; ``note`` says its unit and what 0 means."""
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be >= 0{note}, got {value!r}")


def in_range(name: str, value: float, lo: float, hi: float) -> None:
    if not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ConfigError(f"{name} must be in [{lo}, {hi}], got {value!r}")
