"""The CPU cores a process may run on, and pinning threads to some of them.

Linux has ``os.sched_getaffinity``/``os.sched_setaffinity``; macOS (a developer's
laptop) has neither, and a worker that called them died at start with an
AttributeError. There every core counts as usable and nothing is pinned: class
confinement is then torch's thread count alone, which :meth:`ChildRuntime.confine`
still sets, and :data:`UNPINNED_NOTICE` says so once in the worker's log.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

#: The worker's one line where :func:`can_pin` is False.
UNPINNED_NOTICE = ("CPU confinement is unavailable on this platform (no sched_setaffinity): "
                   "tasks run on every core; each class's cpu_cores only sets torch's "
                   "thread count")


def can_pin() -> bool:
    """Whether this platform can pin a thread to cores (False on macOS)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def usable(pid: int = 0) -> tuple[int, ...]:
    """The sorted cores ``pid`` (0: this process) may run on; every core where the
    platform keeps no affinity."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(pid)))
    return tuple(range(os.cpu_count() or 1))


def pinned_to(cpus: Sequence[int]) -> bool:
    """Whether this thread runs on exactly ``cpus``; True where nothing can be pinned
    (there is nothing to re-apply)."""
    return not can_pin() or os.sched_getaffinity(0) == set(cpus)


def pin(thread_ids: Iterable[int], cpus: Sequence[int]) -> None:
    """Pin each thread to ``cpus`` (a no-op where the platform cannot)."""
    if not can_pin():
        return
    for tid in thread_ids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended
            os.sched_setaffinity(tid, cpus)


# -- the CPU time a container may use (cgroup quota) -----------------------------------------
#: Where cgroup file systems are mounted (v2's unified tree, or v1's per controller).
CGROUP_ROOT = Path("/sys/fs/cgroup")


def quota_from_cpu_max(text: str) -> float | None:
    """CPUs' worth of time cgroup v2's ``cpu.max`` (``"<quota> <period>"``, or ``"max
    <period>"``: none) allows; None where unlimited or unreadable."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return _ratio(parts[0], parts[1])


def quota_from_cfs(quota_us: str, period_us: str) -> float | None:
    """The same from cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (a quota
    of -1: none)."""
    return _ratio(quota_us.strip(), period_us.strip())


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _cgroup_paths(self_cgroup: str) -> dict[str, str]:
    """``/proc/self/cgroup``'s lines as controller -> path (``""`` for v2's unified)."""
    paths: dict[str, str] = {}
    for line in self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(","):
            paths[controller] = path
    return paths


def _up_to(base: Path, path: str) -> list[Path]:
    """``base/path`` and each directory above it up to ``base`` (inside a container its
    own cgroup is the root of the mount, whatever the path says)."""
    here = base / path.strip("/")
    return [here, *(p for p in here.parents if p.is_relative_to(base))]


def cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = Path("/proc/self/cgroup")
              ) -> float | None:
    """CPUs' worth of time this process's cgroup may use (a container's ``--cpus``),
    the tightest along its path up to the root; None without a quota, or where
    cgroups cannot be read (not Linux)."""
    try:
        paths = _cgroup_paths(self_cgroup.read_text())
    except OSError:
        return None

    def v2(d: Path) -> float | None:
        return quota_from_cpu_max((d / "cpu.max").read_text())

    def v1(d: Path) -> float | None:
        return quota_from_cfs((d / "cpu.cfs_quota_us").read_text(),
                              (d / "cpu.cfs_period_us").read_text())

    found: list[float] = []
    for base, path, read in ((root, paths.get(""), v2), (root / "cpu", paths.get("cpu"), v1)):
        for directory in _up_to(base, path) if path is not None else ():
            with contextlib.suppress(OSError):
                if (quota := read(directory)) is not None:
                    found.append(quota)
    return min(found) if found else None


def threads_within_quota(threads: int, quota: float | None, slots: int) -> int:
    """``threads`` for one of ``slots`` children, no more than its share of ``quota``
    CPUs (at least one): more threads than the quota's CPUs are throttled in turns,
    each a whole period, which stalls an inference step on its slowest thread."""
    if quota is None:
        return threads
    return max(1, min(threads, math.floor(quota / max(1, slots))))


def capacity() -> float:
    """CPUs' worth of time this process may use: its usable cores, or its cgroup's
    quota where that is less."""
    usable_now = len(usable())
    quota = cpu_quota()
    return min(float(usable_now), quota) if quota is not None else float(usable_now)


# -- NUMA nodes ---------------------------------------------------------------------------------
#: Where Linux lists each NUMA node's cores (``node<N>/cpulist``).
NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> tuple[int, ...]:
    """A kernel cpulist (``"0-3,8-11"``, ``"5"``, ``""``) as sorted core ids; a part that
    is no list raises ValueError."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return tuple(sorted(out))


def numa_nodes(usable_cores: Iterable[int], root: Path = NODE_ROOT
               ) -> dict[int, tuple[int, ...]]:
    """Each NUMA node's cores among ``usable_cores``, by node number; nodes left with
    none are left out, and so is everything where the nodes cannot be read (not Linux)."""
    allowed = set(usable_cores)
    found: dict[int, tuple[int, ...]] = {}
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            number = entry.name[len("node"):]
            if not entry.name.startswith("node") or not number.isdigit():
                continue
            try:
                cpus = parse_cpulist((entry / "cpulist").read_text())
            except (OSError, ValueError):
                continue
            if mine := tuple(c for c in cpus if c in allowed):
                found[int(number)] = mine
    return found
