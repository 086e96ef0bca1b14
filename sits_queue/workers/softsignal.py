"""The pool's soft-time-limit signal, once a task has stopped itself at that limit.

A task stops itself at its soft limit between steps (``ActiveTask.check_time``): the
signal alone may come late. Billiard's timeout thread wakes once a second, so its
``SIGUSR1`` arrives up to a second after the limit, and then interrupts whatever the
child runs next: the task's accounting, or Celery's failure handling, which replaced the
task's reason ("stopped after 35 of 200 new tokens") with a bare
``SoftTimeLimitExceeded()``. Stock Celery has no second path to race with. So once a task
stopped itself, the signal is ignored in that child until the next task starts (a
signal between tasks would raise in the pool's own loop).

And it is held off while torch imports and while an engine loads (:func:`held`): a
first task's soft limit that hit ``import torch`` midway (a cold child on a busy host)
left torch's operator registrations half done, and every later import in that child
failed ("duplicate registrations for aten....") or crashed; one that hit transformers'
lazy import of a model class left it unimportable in that child. One signal made the
child fail all its inference tasks. Held, the signal raises once the load is whole, and
the engine stays warm for the next task; the hard limit still ends a load that hangs.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from billiard import pool as billiard_pool
from celery.exceptions import SoftTimeLimitExceeded

_muted: Any = None
#: In a batch's pool job (``batched.py``): the job owns the signal, its members' own
#: task_prerun/postrun leave it as it is.
_in_batch = False


def _pool_child_signal() -> int | None:
    """The soft-limit signal, where billiard's handler for it is in place and this is the
    thread that may swap handlers; None elsewhere (a solo worker, a thread, no signal)."""
    sig = billiard_pool.SIG_SOFT_TIMEOUT
    if sig is None or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(sig) is not billiard_pool.soft_timeout_sighandler:
        return None
    return int(sig)


def mute() -> None:
    """Ignore the soft-limit signal until :func:`restore`: in a pool child only (where
    billiard's handler is installed; a solo worker's SIGUSR1 is Celery's traceback dump)."""
    global _muted
    sig = _pool_child_signal()
    if sig is not None:
        signal.signal(sig, signal.SIG_IGN)
        _muted = billiard_pool.soft_timeout_sighandler


def restore() -> None:
    """Billiard's handler back, if :func:`mute` took it (at each task's start)."""
    global _muted
    if _muted is not None and billiard_pool.SIG_SOFT_TIMEOUT is not None \
            and threading.current_thread() is threading.main_thread():
        signal.signal(billiard_pool.SIG_SOFT_TIMEOUT, _muted)
        _muted = None


def task_started() -> None:
    """A task's start (task_prerun): billiard's handler back, unless the task is a
    member of a batch being traced, whose pool job owns the signal (:func:`batch_job`)."""
    if not _in_batch:
        restore()


def task_ended() -> None:
    """A task's end (task_postrun): the signal ignored until the next task, unless the
    task is a member of a batch, whose pool job mutes it as it ends."""
    if not _in_batch:
        mute()


@contextmanager
def batch_job() -> Iterator[None]:
    """A batch's pool job: the signal armed for its run (muted since the child's last
    task ended), and ignored again as it ends. Its members' traces, during the run or
    after it, leave it: a member's start armed it again after the run had stopped itself
    at its soft limit, and the pool's signal, up to a second late, then cut a member's
    trace (a call that had finished stored as a bare ``SoftTimeLimitExceeded()``); a
    member traced while the run went on muted it, and the run's own soft limit never
    came."""
    global _in_batch
    restore()
    _in_batch = True
    try:
        yield
    finally:
        _in_batch = False
        mute()


@contextmanager
def held(what: str | None = None) -> Iterator[None]:
    """Run the block whole: a soft-limit signal that comes meanwhile raises once it ends
    (saying it came while ``what``), unless the block raised its own error.
    (A handler swap, not a signal mask: the signal may land on another thread, and
    Python runs its handler in the main thread wherever that is.)"""
    sig = _pool_child_signal()
    if sig is None:
        yield
        return
    came: list[int] = []
    signal.signal(sig, lambda signum, _frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(sig, billiard_pool.soft_timeout_sighandler)
    if came:
        raise SoftTimeLimitExceeded(*([f"soft time limit hit while {what}"] if what else []))
