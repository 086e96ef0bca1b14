"""Which holder process has certainly ended, and what its records say (``holders.py``).
Against real Redis and a real killed process: ``tests/integration/test_holders.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from sits_queue.broker import holders
from sits_queue.broker.holders import Holder, Process

HERE = Process("vm", 4242, 1000, "boot-1", "4026531836")
#: fields 5..21 (pgrp .. itrealvalue), starttime (22), then vsize and rss
STAT_TAIL = " ".join(["0"] * 17) + " {start} 0 0"


def write_stat(proc: Path, pid: int, comm: str, state: str, start: object) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(
        f"{pid} ({comm}) {state} 1 " + STAT_TAIL.format(start=start))


def alive(pid: int) -> bool:
    return True


def test_a_process_is_read_past_a_command_name_with_parentheses(tmp_path: Path) -> None:
    write_stat(tmp_path, 7, "celery) (worker x", "S", 12345)
    assert not holders.ended(7, 12345, str(tmp_path), alive)
    assert holders.ended(7, 12344, str(tmp_path), alive)  # its pid, a later process


@pytest.mark.parametrize("state", ["Z", "X"])
def test_a_zombie_or_dead_process_has_ended(tmp_path: Path, state: str) -> None:
    write_stat(tmp_path, 7, "celery", state, 12345)
    assert holders.ended(7, 12345, str(tmp_path), alive)


def test_a_pid_no_process_has_has_ended(tmp_path: Path) -> None:
    write_stat(tmp_path, 7, "celery", "S", 12345)  # (a stale view: the pid is free)
    assert holders.ended(7, 12345, str(tmp_path), lambda pid: False)


def test_a_process_proc_hides_or_cannot_read_has_not_ended(tmp_path: Path) -> None:
    """(an unreadable stat was taken for an ended process: under hidepid, or systemd's
    ProtectProc, each worker saw the other's pid missing and put back its running
    tasks, to run twice)"""
    assert not holders.ended(7, 12345, str(tmp_path), alive)  # hidden: no /proc/7
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "stat").write_text("8 (x) S 1 2")  # cut short
    assert not holders.ended(8, 12345, str(tmp_path), alive)
    write_stat(tmp_path, 9, "x", "S", "zz")
    assert not holders.ended(9, 12345, str(tmp_path), alive)
    write_stat(tmp_path, 10, "x", "S", 12345)
    (tmp_path / "10" / "stat").chmod(0)
    if os.geteuid() != 0:  # (root reads it all the same)
        assert not holders.ended(10, 1, str(tmp_path), alive)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc (Linux)")
def test_this_process_is_checkable_and_alive_on_linux() -> None:
    me = holders.this_process()
    assert me.pid == os.getpid() and me.checkable
    assert not holders.gone(Holder("c", me, ("celery",), 0.0, 60.0), me)
    # a process that ended is gone, its pid free or reused by another start
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    ended = Process(me.host, int(done.stdout), me.started, me.boot, me.pidns)
    assert holders.gone(Holder("c", ended, ("celery",), 0.0, 60.0), me)


def test_a_proc_of_another_pid_namespace_checks_nothing(tmp_path: Path) -> None:
    """(``unshare --pid`` without a /proc of its own: /proc/<our pid> is another
    process of the host, whose end would have made this live one look dead)"""
    (tmp_path / "sys" / "kernel" / "random").mkdir(parents=True)
    (tmp_path / "sys" / "kernel" / "random" / "boot_id").write_text("boot-1\n")
    (tmp_path / "self").symlink_to("40")  # (as /proc/self reads: the pid alone)
    write_stat(tmp_path, 40, "other", "S", 5)
    assert holders.read_process(40, str(tmp_path)).started == 5  # (/proc/self is pid 40)
    assert holders.read_process(12, str(tmp_path)).started is None
    assert not holders.read_process(12, str(tmp_path)).checkable


def test_a_record_of_another_host_name_is_not_checked() -> None:
    """(VMs cloned from one snapshot share a boot id and the first pid namespace)"""
    clone = Holder("c", Process("vm2", 11, 1000, "boot-1", "4026531836"), ("a",), 0.0, 60.0)
    assert not holders.gone(clone, HERE, lambda pid, started: True)


def test_a_reused_pid_is_another_process() -> None:
    holder = Holder("c", HERE, ("celery",), 0.0, 60.0)
    assert holders.gone(holder, HERE, lambda pid, started: True)
    assert not holders.gone(holder, HERE, lambda pid, started: False)


def test_no_host_hash_where_processes_cannot_be_checked() -> None:
    assert holders.host_key("p:", HERE) == "p:sits:holders:boot-1:4026531836"
    for blind in (Process("mac", 1, None, None, None), Process("vm", 1, 5, "", "1"),
                  Process("vm", 1, 5, "b", None)):
        assert holders.host_key("", blind) is None


def test_a_record_reads_back_with_the_readers_boot_and_namespace() -> None:
    holder = Holder("c1", HERE, ("celery", "gpu"), 1.5, 90.0)
    back = Holder.decode("c1", holder.encode().encode(), HERE)
    assert back == holder


@pytest.mark.parametrize("raw", [
    b"not json", b"[]", b'{"pid": 1}',
    b'{"pid": "1", "started": 1, "queues": [], "seen": 1, "timeout": 60}',
    b'{"pid": 1, "started": 1.5, "queues": [], "seen": 1, "timeout": 60}',
    b'{"pid": 0, "started": 1, "queues": [], "seen": 1, "timeout": 60}',
    b'{"pid": true, "started": 1, "queues": [], "seen": 1, "timeout": 60}',
    b'{"pid": 1, "started": 1, "queues": [1], "seen": 1, "timeout": 60}',
    b'{"pid": 1, "started": 1, "queues": "celery", "seen": "x", "timeout": 60}',
    b'{"pid": 1, "started": 1, "queues": [], "seen": NaN, "timeout": 60}',
    b'{"pid": 1, "started": 1, "queues": [], "seen": 1}',  # (no timeout)
    b'{"pid": 1, "started": 1, "queues": [], "seen": 1, "timeout": 0}',
    b'{"pid": 1, "started": 1, "queues": [], "seen": 1' + b"0" * 400 + b', "timeout": 60}',
    b'{"pid": 99999999999999999999, "started": 1, "queues": [], "seen": 1, "timeout": 60}',
    b"[" * 100_000, b"\xff"])
def test_a_record_this_version_cannot_read_is_none(raw: bytes) -> None:
    assert Holder.decode("c", raw, HERE) is None


class Hashes:
    """The two hash commands reclaim uses, on a dict (the edge; real Redis: integration)."""

    def __init__(self, records: dict[str, str]) -> None:
        self.records = {k.encode(): v.encode() for k, v in records.items()}

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        return dict(self.records)

    def hdel(self, key: str, field: str) -> int:
        return int(self.records.pop(field.encode(), None) is not None)


def reclaim(client: Hashes, restore: Any, dead: Any, now: float = 10_000.0) -> int:
    return holders.reclaim(client, "", "own", now, restore, lambda pid, started: dead(pid))


@pytest.fixture
def here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holders, "this_process", lambda: HERE)


def record(pid: int, queues: tuple[str, ...], seen: float, started: int = 1000,
           timeout: float = 60.0) -> str:
    return Holder("x", Process("vm", pid, started, "boot-1", "4026531836"), queues,
                  seen, timeout).encode()


@pytest.mark.usefixtures("here")
def test_reclaim_puts_back_each_queue_of_an_ended_holder_once_scanned_whole() -> None:
    calls: list[tuple[str, list[Any]]] = []
    client = Hashes({"dead": record(11, ("a", "b"), 9_990.0), "alive": record(12, ("a",), 9_990.0),
                     "own": record(13, ("a",), 9_990.0)})

    def restore(queue: str, args: list[Any]) -> list[Any]:
        calls.append((queue, args))
        # queue a: two steps of the scan (its cursor comes back as bytes)
        return [2, b"17"] if (queue, args[4]) == ("a", "0") else [1, b"0"]

    assert reclaim(client, restore, lambda pid: pid == 11) == 4
    # its bound: its last record plus half the timeout (a pick of its own comes at most
    # a tick, a sixth, after a record; another holder's, restored by a sweep, a timeout
    # after its last beat, which came at most a third before its record: 2/3 after)
    bound, period = 9_990.0 + 30.0, 20.0
    step = holders.SCAN_STEP
    assert calls == [("a", ["=", "dead", bound, period, "0", step]),
                     ("a", ["=", "dead", bound, period, b"17", step]),
                     ("b", ["=", "dead", bound, period, "0", step])]
    assert set(client.records) == {b"alive", b"own"}


@pytest.mark.usefixtures("here")
def test_only_the_consumer_that_drops_the_record_puts_back() -> None:
    """(every consumer of the host that read the record in the same tick scanned the
    dead one's queues again)"""
    client = Hashes({"dead": record(11, ("a",), 9_990.0)})
    client.hdel = lambda key, field: 0  # type: ignore[method-assign]  # another took it
    calls: list[str] = []
    assert reclaim(client, lambda q, args: calls.append(q) or [1, "0"], lambda pid: True) == 0
    assert calls == []


@pytest.mark.usefixtures("here")
def test_a_queue_that_fails_is_left_to_the_timeout_and_the_rest_put_back() -> None:
    def restore(queue: str, args: list[Any]) -> list[Any]:
        if queue == "down":
            raise redis.ConnectionError("gone")
        if queue == "typed":
            raise redis.ResponseError("SITS_WRONGTYPE key ...")
        if queue == "bad{name":
            raise ValueError("no hash tag")
        return [1, "0"]

    client = Hashes({"dead": record(11, ("typed", "bad{name", "down", "ok"), 9_990.0)})
    assert reclaim(client, restore, lambda pid: True) == 1
    assert not client.records


@pytest.mark.usefixtures("here")
def test_reclaim_drops_a_live_record_unwritten_for_three_timeouts_and_leaves_odd_ones() -> None:
    client = Hashes({"closed": record(11, ("a",), 10_000.0 - 3 * 60.0 - 1),
                     "fresh": record(12, ("a",), 10_000.0 - 3 * 60.0 + 1), "odd": "not json"})
    assert reclaim(client, lambda q, args: [0, "0"], lambda pid: False) == 0
    assert set(client.records) == {b"fresh", b"odd"}


def test_reclaim_does_nothing_where_nothing_can_be_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holders, "this_process", lambda: Process("mac", 1, None, None, None))
    client = Hashes({"dead": record(11, ("a",), 9_990.0)})
    assert reclaim(client, lambda q, args: [1, "0"], lambda pid: True) == 0


@pytest.mark.usefixtures("here")
def test_nothing_is_put_back_while_a_worker_of_an_earlier_release_is_live() -> None:
    """(its sweep restores a message and its pick takes it again with the dead holder's
    entry left: a dead holder that had come back from a stall, its record fresh, had
    that message put back while the older worker ran it)"""
    client = Hashes({"dead": record(11, ("a",), 9_990.0), "dead2": record(12, ("a",), 9_990.0)})
    asked: list[int] = []

    def older() -> str | None:
        asked.append(1)
        return "old@host"

    calls: list[str] = []
    n = holders.reclaim(client, "", "own", 10_000.0,
                        lambda q, args: calls.append(q) or [1, "0"],
                        lambda pid, started: True, older)
    assert (n, calls, len(asked)) == (0, [], 1)  # (the fleet read once a call)
    assert set(client.records) == {b"dead", b"dead2"}  # kept: put back once it is gone
    assert holders.reclaim(client, "", "own", 10_000.0, lambda q, args: [1, "0"],
                           lambda pid, started: True, lambda: None) == 2
    assert not client.records
