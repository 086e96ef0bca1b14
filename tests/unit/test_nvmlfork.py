"""NVML and fork(): a fork waits for the NVML session in flight and closes the ones kept
open (sits_queue/workers/nvmlfork.py). Real forks, in a fresh interpreter (forking the
pytest process, with its threads, would test pytest); a fake NVML module."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from sits_queue.workers import devices, nvmlfork
from sits_queue.workers.freemem import NvmlProbe
from tests.unit.test_devices import two_h100s

#: A fake NVML for the scripts: counts inits and shutdowns, answers memory by UUID.
FAKE = """
import json, os, sys, threading, time
from types import SimpleNamespace
from sits_queue.workers import nvmlfork
from sits_queue.workers.freemem import NvmlProbe

class Nvml:
    def __init__(self):
        self.inits = self.shutdowns = 0
    def nvmlInit(self):
        self.inits += 1
    def nvmlShutdown(self):
        self.shutdowns += 1
    def nvmlDeviceGetHandleByUUID(self, uuid):
        return uuid
    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(free=7 * 2**30)
"""


def run_script(body: str) -> dict[str, Any]:
    code = FAKE + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_fork_waits_for_the_nvml_session_in_flight() -> None:
    got = run_script("""
        inside, ended = threading.Event(), []
        def advertiser():
            with nvmlfork.session():
                inside.set()
                time.sleep(0.3)  # an NVML call in flight
                ended.append(time.monotonic())
        thread = threading.Thread(target=advertiser)
        thread.start()
        inside.wait()
        pid = os.fork()
        if pid == 0:  # the child's lock is its own, free
            os._exit(0 if nvmlfork._lock.acquire(blocking=False) else 3)
        forked = time.monotonic()
        _, status = os.waitpid(pid, 0)
        thread.join()
        free = nvmlfork._lock.acquire(blocking=False)  # the parent's is released
        print(json.dumps({"forked_after_the_call": forked >= ended[0],
                          "child_status": os.waitstatus_to_exitcode(status),
                          "parent_lock_free": free}))
    """)
    assert got == {"forked_after_the_call": True, "child_status": 0,
                   "parent_lock_free": True}


def test_an_open_probe_is_closed_before_a_fork_and_reopens_at_its_next_read() -> None:
    got = run_script("""
        nvml = Nvml()
        probe = NvmlProbe(["GPU-a", "GPU-b"], nvml)
        probe.max_free_bytes(); probe.max_free_bytes()
        before = (nvml.inits, nvml.shutdowns)
        pid = os.fork()
        if pid == 0:  # the child inherits NVML closed
            os._exit(0 if probe._handles is None and nvml.shutdowns == 1 else 3)
        _, status = os.waitpid(pid, 0)
        after_fork = (nvml.inits, nvml.shutdowns)
        free = probe.max_free_bytes()
        print(json.dumps({"before": before, "after_fork": after_fork,
                          "child_status": os.waitstatus_to_exitcode(status),
                          "reopened": (nvml.inits, nvml.shutdowns), "free": free}))
    """)
    assert got == {"before": [1, 0], "after_fork": [1, 1], "child_status": 0,
                   "reopened": [2, 1], "free": 7 * 2**30}


def test_a_fork_with_no_probe_open_shuts_nothing_down() -> None:
    got = run_script("""
        nvml = Nvml()
        probe = NvmlProbe(["GPU-a"], nvml)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print(json.dumps({"inits": nvml.inits, "shutdowns": nvml.shutdowns}))
    """)
    assert got == {"inits": 0, "shutdowns": 0}


class _Failing:
    """A probe's NVML whose handle lookup fails after init."""

    def __init__(self) -> None:
        self.inits = self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        raise RuntimeError(f"no GPU {uuid}")


def test_a_probe_that_fails_to_open_leaves_nvml_shut_down() -> None:
    nvml = _Failing()
    probe = NvmlProbe(["GPU-gone"], nvml)
    with pytest.raises(RuntimeError, match="no GPU GPU-gone"):
        probe.max_free_bytes()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)
    probe.close()  # nothing open: nothing shut down twice
    assert nvml.shutdowns == 1


def test_discovery_holds_off_forks_while_nvml_is_open() -> None:
    fake = two_h100s()
    seen: list[bool] = []
    count = fake.nvmlDeviceGetCount

    def counted() -> int:
        # another thread (a fork's hook) cannot take the lock while discovery runs
        probe = threading.Thread(target=lambda: seen.append(
            nvmlfork._lock.acquire(blocking=False)))
        probe.start()
        probe.join()
        return count()

    fake.nvmlDeviceGetCount = counted  # type: ignore[method-assign]
    found = devices.discover(nvml=fake)
    assert len(found.devices) == 2 and fake.shutdowns == 1
    assert seen == [False]


def test_collected_probes_leave_no_closer_behind() -> None:
    nvml = _Failing()
    NvmlProbe(["GPU-x"], nvml)
    gc.collect()
    nvmlfork._before_fork()
    nvmlfork._after_fork_in_parent()
    assert all(ref() is not None for ref in nvmlfork._closers)
    assert nvmlfork._lock.acquire(blocking=False)
    nvmlfork._lock.release()


def test_only_a_bound_method_can_be_a_closer() -> None:
    with pytest.raises(TypeError, match="bound method"):
        nvmlfork.close_before_fork(lambda: None)
