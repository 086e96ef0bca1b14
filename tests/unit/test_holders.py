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


def test_start_ticks_reads_field_22_past_a_command_name_with_parentheses(
        tmp_path: Path) -> None:
    write_stat(tmp_path, 7, "celery) (worker x", "S", 12345)
    assert holders.start_ticks(7, str(tmp_path)) == 12345


@pytest.mark.parametrize("state", ["Z", "X"])
def test_a_zombie_or_dead_process_has_no_start(tmp_path: Path, state: str) -> None:
    write_stat(tmp_path, 7, "celery", state, 12345)
    assert holders.start_ticks(7, str(tmp_path)) is None


def test_no_such_process_or_an_unreadable_stat_has_no_start(tmp_path: Path) -> None:
    assert holders.start_ticks(7, str(tmp_path)) is None
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "stat").write_text("8 (x) S 1 2")  # cut short
    assert holders.start_ticks(8, str(tmp_path)) is None
    write_stat(tmp_path, 9, "x", "S", "zz")
    assert holders.start_ticks(9, str(tmp_path)) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc (Linux)")
def test_this_process_is_checkable_and_alive_on_linux() -> None:
    me = holders.this_process()
    assert me.pid == os.getpid() and me.checkable
    assert holders.start_ticks(os.getpid()) == me.started
    assert not holders.gone(Holder("c", me, ("celery",), 0.0))
    # a process that ended is gone, its pid free or reused by another start
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    ended = Process(me.host, int(done.stdout), me.started, me.boot, me.pidns)
    assert holders.gone(Holder("c", ended, ("celery",), 0.0))


def test_a_reused_pid_is_another_process() -> None:
    holder = Holder("c", HERE, ("celery",), 0.0)
    assert holders.gone(holder, lambda pid: 999)
    assert holders.gone(holder, lambda pid: None)
    assert not holders.gone(holder, lambda pid: 1000)


def test_no_host_hash_where_processes_cannot_be_checked() -> None:
    assert holders.host_key("p:", HERE) == "p:sits:holders:boot-1:4026531836"
    for blind in (Process("mac", 1, None, None, None), Process("vm", 1, 5, "", "1"),
                  Process("vm", 1, 5, "b", None)):
        assert holders.host_key("", blind) is None


def test_a_record_reads_back_with_the_readers_boot_and_namespace() -> None:
    holder = Holder("c1", HERE, ("celery", "gpu"), 1.5)
    back = Holder.decode("c1", holder.encode().encode(), HERE)
    assert back == holder


@pytest.mark.parametrize("raw", [
    b"not json", b"[]", b'{"pid": 1}', b'{"pid": "1", "started": 1, "queues": [], "seen": 1}',
    b'{"pid": 1, "started": 1.5, "queues": [], "seen": 1}',
    b'{"pid": 0, "started": 1, "queues": [], "seen": 1}',
    b'{"pid": true, "started": 1, "queues": [], "seen": 1}',
    b'{"pid": 1, "started": 1, "queues": [1], "seen": 1}',
    b'{"pid": 1, "started": 1, "queues": "celery", "seen": "x"}',
    b'{"pid": 1, "started": 1, "queues": [], "seen": NaN}', b"\xff"])
def test_a_record_this_version_cannot_read_is_none(raw: bytes) -> None:
    assert Holder.decode("c", raw, HERE) is None


class Hashes:
    """The two hash commands reclaim uses, on a dict (the edge; real Redis: integration)."""

    def __init__(self, records: dict[str, str]) -> None:
        self.records = {k.encode(): v.encode() for k, v in records.items()}

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        return dict(self.records)

    def hdel(self, key: str, field: str) -> None:
        self.records.pop(field.encode(), None)


def reclaim(client: Hashes, restore: Any, started: Any, now: float = 10_000.0) -> int:
    return holders.reclaim(client, "", "own", now, 60.0, restore, started)


@pytest.fixture
def here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holders, "this_process", lambda: HERE)


def record(pid: int, queues: tuple[str, ...], seen: float, started: int = 1000) -> str:
    return Holder("x", Process("vm", pid, started, "boot-1", "4026531836"), queues,
                  seen).encode()


@pytest.mark.usefixtures("here")
def test_reclaim_restores_each_queue_of_an_ended_holder_under_its_bound() -> None:
    calls: list[tuple[str, list[Any]]] = []
    client = Hashes({"dead": record(11, ("a", "b"), 9_990.0), "alive": record(12, ("a",), 9_990.0),
                     "own": record(13, ("a",), 9_990.0)})
    def restore(queue: str, args: list[Any]) -> int:
        calls.append((queue, args))
        return 2

    n = reclaim(client, restore, lambda pid: None if pid == 11 else 1000)
    assert n == 4
    assert calls == [("a", ["=", "dead", 10_050.0, 20.0]), ("b", ["=", "dead", 10_050.0, 20.0])]
    assert set(client.records) == {b"alive", b"own"}


@pytest.mark.usefixtures("here")
def test_reclaim_keeps_the_record_of_a_holder_a_queue_of_which_did_not_answer() -> None:
    def restore(queue: str, args: list[Any]) -> int:
        if queue == "down":
            raise redis.ConnectionError("gone")
        if queue == "typed":
            raise redis.ResponseError("SITS_WRONGTYPE key ...")
        if queue == "bad{name":
            raise ValueError("no hash tag")
        return 1

    client = Hashes({"dead": record(11, ("typed", "bad{name", "ok", "down"), 9_990.0)})
    assert reclaim(client, restore, lambda pid: None) == 1
    assert b"dead" in client.records  # (tried again next tick)
    client = Hashes({"dead": record(11, ("typed", "bad{name", "ok"), 9_990.0)})
    assert reclaim(client, restore, lambda pid: None) == 1
    assert not client.records


@pytest.mark.usefixtures("here")
def test_reclaim_drops_a_live_record_unwritten_for_long_and_leaves_unreadable_ones() -> None:
    client = Hashes({"stale": record(11, ("a",), 10_000.0 - holders.STALE_S - 1),
                     "fresh": record(12, ("a",), 9_000.0), "odd": "not json"})
    assert reclaim(client, lambda q, args: 0, lambda pid: 1000) == 0
    assert set(client.records) == {b"fresh", b"odd"}


def test_reclaim_does_nothing_where_nothing_can_be_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holders, "this_process", lambda: Process("mac", 1, None, None, None))
    client = Hashes({"dead": record(11, ("a",), 9_990.0)})
    assert reclaim(client, lambda q, args: 1, lambda pid: None) == 0
