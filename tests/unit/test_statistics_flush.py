"""When a process's buffered task statistics are written (``workers/signals.py``, on
``workers/deferred.py``'s writer): within FLUSH_EVERY_S of the first by a thread, at
once every FLUSH_EVERY_RECORDS, and on an explicit flush; a process forked meanwhile
does not write its parent's. (``_write`` is the unit conftest's stand-in.)"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

from sits_queue.config import SitsConfig
from sits_queue.workers import signals
from tests.waiting import wait_for

CONFIG = SitsConfig(redis_url="redis://127.0.0.1:1/0")


def record(n: int = 1) -> None:
    request = SimpleNamespace(task="t.any", sits={"sla_class": "low", "model": "m"})
    for _ in range(n):
        signals.record_completion(CONFIG, request, False, time.time())


def test_a_record_is_written_by_the_thread_within_the_flush_period(
        no_statistics_sent: list[Any]) -> None:
    started = time.monotonic()
    record()
    assert no_statistics_sent == []  # (buffered: one round trip for what follows)
    wait_for(lambda: len(no_statistics_sent) == 1, 5 * signals.FLUSH_EVERY_S,
             "the flusher thread to write the record")
    assert time.monotonic() - started >= signals.FLUSH_EVERY_S * 0.9
    assert no_statistics_sent[0].sla_class == "low"


def test_a_full_buffer_is_written_at_once_and_a_flush_writes_the_rest(
        no_statistics_sent: list[Any]) -> None:
    record(signals.FLUSH_EVERY_RECORDS)
    assert len(no_statistics_sent) == signals.FLUSH_EVERY_RECORDS  # no wait
    record(2)
    signals.flush()
    assert len(no_statistics_sent) == signals.FLUSH_EVERY_RECORDS + 2
    signals.flush()  # (nothing left: nothing written twice)
    assert len(no_statistics_sent) == signals.FLUSH_EVERY_RECORDS + 2


def test_a_forked_child_starts_with_none_of_its_parents_records(
        no_statistics_sent: list[Any]) -> None:
    record(3)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what would it write?
        try:
            signals.flush()
            os.write(write, str(len(no_statistics_sent)).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"0"
    os.close(read)
    signals.flush()  # the parent's are its own to write
    assert len(no_statistics_sent) == 3
