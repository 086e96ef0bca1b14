"""Whether this process's consumer may take new work now (the runtime profile's feedback,
``workers/profile.py``, pauses it while a resource runs short). Process-wide: one worker
per process; producers never pause."""

from __future__ import annotations

_reason: list[str] = []


def pause(reason: str | None) -> None:
    """Stop picking new messages (``reason``), or pick again (None)."""
    _reason[:] = [reason] if reason else []


def paused() -> str | None:
    """Why picking is paused, or None."""
    return _reason[0] if _reason else None
