"""``tests/stuck.py``: a stuck process's native stacks, as the GPU kill test records them
for a replacement child that stops answering."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.stuck import debugger, native_stacks

STUCK = ("import threading, sys; lock = threading.Lock(); lock.acquire(); "
         "print('waiting', flush=True); lock.acquire()")


@pytest.mark.skipif(debugger() is None, reason="no gdb or cuda-gdb on PATH")
def test_a_process_stuck_on_a_lock_shows_its_threads_native_frames() -> None:
    # Given a process that waits for ever on a lock it holds
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "waiting"
        # When its native stacks are taken
        stacks = native_stacks([proc.pid])
        # Then they name the process and its thread's innermost frames
        assert f"native stacks of pid {proc.pid}" in stacks
        assert "Thread 1" in stacks and "#0 " in stacks, stacks[-3000:]
        # And it goes on waiting after the debugger has let go
        time.sleep(0.2)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)


def test_a_process_that_is_gone_is_said_so_not_raised() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    stacks = native_stacks([proc.pid], timeout_s=20)
    assert f"native stacks of pid {proc.pid}" in stacks
