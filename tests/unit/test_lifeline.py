"""Which pid a worker or beat started by sitsq ends with (``lifeline``)."""

from __future__ import annotations

import pytest

from sits_queue import lifeline


@pytest.mark.parametrize(("raw", "pid"), [
    ("4242", 4242), (" 17 ", 17),
    # unset, not a pid, or init (what every orphan's parent becomes): nothing watched
    ("", None), ("abc", None), ("-5", None), ("1", None), ("0", None), ("1.5", None)])
def test_the_pid_to_end_with_is_read_off_the_environment(raw: str, pid: int | None) -> None:
    assert lifeline.parent_of({lifeline.ENV: raw}) == pid


def test_a_process_started_otherwise_is_left_alone() -> None:
    assert lifeline.parent_of({}) is None
    assert lifeline.watch({}) is False
