"""Where a stuck process waits, for a test to say when a child stops answering: each
thread's native stack, from a debugger attached for a moment (the GPU host's image has
cuda-gdb and no gdb). Python's own dump (``kill -USR2``, ``workers/stacks.py``) shows the
Python frames; these show what a thread waits on below them: a lock, NVML, the driver."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

#: Frames kept per thread: the innermost ones say where it waits.
FRAMES = 16
#: Longest a debugger may take per process, s: attaching to a process stuck in a driver
#: call may itself hang; killed, the debugger detaches and the process goes on.
ATTACH_S = 30.0
#: Most of a debugger's output kept per process, characters (the innermost frames first).
KEEP_CHARS = 30_000


#: Where a CUDA image keeps cuda-gdb when its bin folder is not on PATH.
CUDA_GDB = Path("/usr/local/cuda/bin/cuda-gdb")


def debugger() -> str | None:
    found = shutil.which("gdb") or shutil.which("cuda-gdb")
    return found or (str(CUDA_GDB) if CUDA_GDB.is_file() else None)


def native_stacks(pids: list[int], timeout_s: float = ATTACH_S) -> str:
    """Every thread's innermost native frames, per process; a line saying why not where
    no debugger is on PATH or one could not attach."""
    tool = debugger()
    if tool is None:
        return "no gdb or cuda-gdb on PATH: no native stacks"
    parts = []
    for pid in pids:
        try:
            run = subprocess.run(
                [tool, "-p", str(pid), "-batch", "-nx", "-ex", f"thread apply all bt {FRAMES}"],
                capture_output=True, text=True, timeout=timeout_s, check=False)
            text = (run.stdout + run.stderr)[:KEEP_CHARS]
        except subprocess.TimeoutExpired:
            text = f"{tool} did not finish within {timeout_s:g} s"
        except OSError as exc:
            text = f"{tool} could not run: {exc}"
        parts.append(f"--- native stacks of pid {pid} ({tool}) ---\n{text}")
    return "\n".join(parts)
