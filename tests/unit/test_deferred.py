"""The deferred advert writer: one write per burst of armings, flushed or dropped."""

from __future__ import annotations

import threading

import pytest

from sits_queue.workers.deferred import Deferred, routing

#: Longest a test waits for the writer's thread (its delay here is 0.05 s).
WAIT_S = 10.0


class Writes:
    """A ``write`` that counts its calls and can be waited on; raises when told to."""

    def __init__(self, fail_first: bool = False) -> None:
        self.count = 0
        self.fail_first = fail_first
        self.done = threading.Event()

    def __call__(self) -> None:
        self.count += 1
        self.done.set()
        if self.fail_first and self.count == 1:
            raise OSError("Redis went away mid-write")


def test_armings_before_the_delay_ends_make_one_write() -> None:
    writes = Writes()
    writer = Deferred(writes, defer_s=0.05)
    for _ in range(3):
        writer.arm()
    assert writes.done.wait(WAIT_S)
    writer.flush()  # nothing left: the thread wrote what the three armings asked
    assert writes.count == 1 and not writer.armed


def test_flush_writes_at_once_only_what_is_pending() -> None:
    writes = Writes()
    writer = Deferred(writes, defer_s=3600)
    writer.flush()
    assert writes.count == 0
    writer.arm()
    writer.flush()
    assert writes.count == 1 and not writer.armed


def test_a_write_made_another_way_or_dropped_is_not_made_again() -> None:
    writes = Writes()
    writer = Deferred(writes, defer_s=3600)
    writer.arm()
    writer.disarm()  # written at once by its caller
    writer.flush()
    writer.arm()
    writer.drop()  # a unit test's end
    writer.flush()
    assert writes.count == 0


def test_the_thread_outlives_a_write_that_raises(caplog: pytest.LogCaptureFixture) -> None:
    writes = Writes(fail_first=True)
    writer = Deferred(writes, defer_s=0.05, name="advert",  # (as runtime.py makes it)
                      what="publish the child's advert")
    writer.arm()
    assert writes.done.wait(WAIT_S)
    writes.done.clear()
    writer.arm()
    assert writes.done.wait(WAIT_S)
    assert writes.count == 2
    assert "could not publish the child's advert" in caplog.text


def test_the_routing_part_leaves_counts_and_memory_out() -> None:
    record = {"device": "cpu", "warm": {"m": "device"}, "warm_bytes": {"m": 1},
              "device_room": 5, "serves": {"m": ["m"]}, "kv_prefixes": {}, "kv_keys": [],
              "tasks": 7, "cold": 1, "memory": {"rss": 1}, "cpus": [0], "pid": 9}
    assert routing(record) == routing({**record, "tasks": 8, "memory": {}, "cpus": [1],
                                       "kv_prefixes": {"m": 3}})
    assert routing(record) != routing({**record, "warm": {"m": "host"}})
    assert routing(record) != routing({**record, "kv_keys": ["template-1"]})


def test_arming_while_the_thread_writes_does_not_wait_for_the_write() -> None:
    """(the write takes the runtime's lock, under which the runtime arms: an arming that
    waited for the write's own lock deadlocked the two)"""
    inside, release = threading.Event(), threading.Event()

    def write() -> None:
        inside.set()
        release.wait(WAIT_S)

    writer = Deferred(write, defer_s=0.01)
    writer.arm()
    assert inside.wait(WAIT_S)  # the thread is in the write
    armed = threading.Event()
    threading.Thread(target=lambda: (writer.arm(), armed.set()), daemon=True).start()
    try:
        assert armed.wait(WAIT_S)
    finally:
        release.set()


def test_a_forked_child_leaves_the_pending_write_to_its_parent_and_writes_its_own() -> None:
    """(armed before a fork, the child's copy thought its thread was running: its own
    armings never wrote; and a lock the parent's thread held at the fork was the child's
    for ever)"""
    import os

    writes = Writes()
    writer = Deferred(writes, defer_s=0.05)
    writer.arm()  # the parent's thread starts and waits out its delay
    with writer._writing:  # held by another thread as the fork happens
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if all holds
            code = 1
            try:
                if not writer.armed and writes.count == 0:
                    writer.arm()
                    if writes.done.wait(WAIT_S) and writes.count == 1:
                        code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert writes.done.wait(WAIT_S)  # the parent wrote its own, once
    writer.flush()
    assert writes.count == 1
