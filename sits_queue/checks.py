"""Checks of one setting's value, shared by the config dataclasses: each raises
:class:`ConfigError` naming the setting and what it must hold. And the two helpers every
reader of outside values shares: :func:`shown` (a value for an error message),
:func:`stored_number` (a number read back from Redis or a record, which another program
may have written) and :func:`is_utf8` (a str Redis can take); and :func:`make_file_in`,
whether a directory takes a new file."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import fields
from typing import Any, TypeGuard

from sits_queue.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
#: A scalar setting's declared type (annotations are strings here) -> what it must hold.
KINDS: dict[str, tuple[type, str]] = {
    "bool": (bool, "true or false"), "int": (int, "an integer"),
    "float": (float, "a finite number"), "str": (str, "a string")}


def coerce(name: str, raw: str, kind: type) -> Any:
    try:  # (bytes no UTF-8 reach os.environ as surrogates: a key prefix of them failed
        raw.encode()  # at the first Redis call, far from the setting)
    except UnicodeEncodeError:
        raise ConfigError(f"SITS_{name.upper()}={shown(raw)} is not valid UTF-8") from None
    if kind is bool:
        word = raw.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        # a typo must not silently mean "off"
        raise ConfigError(f"SITS_{name.upper()}={shown(raw)} is not a boolean (one of "
                          f"{', '.join(_TRUE)} / {', '.join(w for w in _FALSE if w)})")
    try:
        return kind(raw)
    except ValueError as exc:
        raise ConfigError(f"SITS_{name.upper()}={shown(raw)} is not a valid "
                          f"{kind.__name__}") from exc


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
            ok = is_number(value) and finite(value)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise ConfigError(f"{where}{f.name} must be {what}, got {shown(value)}")
        if f.name.endswith("_s") and is_number(value) and value > MAX_DURATION_S:
            # a duration past a year is a typo (ms for s), and past ~1e9 s it fails later,
            # elsewhere: a beat schedule's timedelta, a wait's timeout, a Redis EXPIRE
            raise ConfigError(f"{where}{f.name} must be at most {MAX_DURATION_S:g} s (a "
                              f"year), got {shown(value)}")


#: Longest duration setting (``*_s``), s: a year.
MAX_DURATION_S = 365 * 86_400


#: Longest raw value an error message quotes whole, characters.
_QUOTED_CHARS = 80


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: not so a str with a lone surrogate (JSON
    carries one as ``"\\udcff"``), which no Redis command can take."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def make_file_in(directory: str | os.PathLike[str], prefix: str = ".sits-") -> None:
    """Make a file in ``directory`` and remove it, or raise the OSError that stopped it:
    tried, not asked (``os.access`` says yes to root everywhere, /proc included)."""
    fd, probe = tempfile.mkstemp(prefix=prefix, dir=directory)
    os.close(fd)
    os.unlink(probe)


def shown(value: Any) -> str:
    """``value`` for an error message: a log line, not a dump. A huge int's repr runs to
    thousands of digits (and past 4300 Python refuses to write it): its size says enough;
    a long string or any long repr is shown by its start and its length."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str) and len(value) > _QUOTED_CHARS:
        return f"{value[:_QUOTED_CHARS // 2]!r}... ({len(value)} characters)"
    text = repr(value)
    if len(text) > _QUOTED_CHARS:
        return f"{text[:_QUOTED_CHARS // 2]}... ({len(text)} characters of repr)"
    return text


def text(value: object, errors: str = "strict") -> str:
    """A Redis reply as text: bytes decoded (``errors`` as for ``bytes.decode``), a
    number or str as its ``str``."""
    return value.decode(errors=errors) if isinstance(value, bytes) else str(value)


def stored_number(raw: Any) -> float | None:
    """A number as Redis or a record holds it (bytes, text, a number); None for one that
    does not parse or is not finite: a reader leaves it out instead of failing on it."""
    try:
        value = float(raw)
    except (TypeError, ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_positive(value: object) -> TypeGuard[int | float]:
    """A number (no bool), finite as a float, above 0: a figure read from a record."""
    return is_number(value) and finite(value) and value > 0


def finite(value: float) -> bool:
    """Whether a number is finite as a float: an int past ~1.8e308 is not (``float()``
    of it raises OverflowError, which a setting's check must not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def integer(name: str, value: object, most: int, note: str = "", least: int = 0) -> None:
    """An integer (not a bool) in [least, most]; ``note`` says what 0 means."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ConfigError(f"{name} must be an integer in [{least}, {most}]{note}, "
                          f"got {shown(value)}")


def positive(name: str, value: float) -> None:
    if not is_number(value) or not finite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number, got {shown(value)}")


def non_negative(name: str, value: float, note: str = "") -> None:
    """A finite number >= 0; ``note`` says its unit and what 0 means."""
    if not is_number(value) or not finite(value) or value < 0:
        raise ConfigError(f"{name} must be >= 0{note}, got {shown(value)}")


def interval(name: str, value: object, lo: float, hi: float, *, open_lo: bool = False,
             open_hi: bool = False, note: str = "") -> None:
    """A number (not a bool) between ``lo`` and ``hi``, each end included unless it is
    open; ``note`` says its unit or what an end means."""
    ok = is_number(value) and finite(value) \
        and (lo < value if open_lo else lo <= value) \
        and (value < hi if open_hi else value <= hi)
    if not ok:
        raise ConfigError(f"{name} must be in {'(' if open_lo else '['}{_end(lo)}, "
                          f"{_end(hi)}{')' if open_hi else ']'}{note}, got {shown(value)}")


def _end(bound: float) -> str:
    """A bound as written in a message: 3600000, not 3.6e+06; 0.5 as 0.5."""
    return str(int(bound)) if float(bound).is_integer() else repr(bound)
