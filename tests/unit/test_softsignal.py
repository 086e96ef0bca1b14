"""The pool's soft-limit signal is ignored once a task stopped itself at its soft limit,
until the next task starts: a real signal, delivered to this process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from billiard import pool as billiard_pool
from celery.exceptions import SoftTimeLimitExceeded

from sits_queue.config import SitsConfig
from sits_queue.workers import runtime as rt
from sits_queue.workers import softsignal

SIG = signal.SIGUSR1


@pytest.fixture
def pool_child_handler() -> Iterator[None]:
    """This process with billiard's soft-limit handler, as a pool child has it."""
    before = signal.signal(SIG, billiard_pool.soft_timeout_sighandler)
    yield
    softsignal.restore()
    signal.signal(SIG, before)


def _stopped_at_its_soft_limit() -> None:
    late = rt.ActiveTask("m", SitsConfig().quota("high"), 0, "cpu",
                         soft_deadline=time.monotonic() - 1.0)
    with pytest.raises(SoftTimeLimitExceeded, match="after 3 of 9 steps"):
        late.check_time(3, 9)


def test_a_late_signal_after_the_task_stopped_itself_is_ignored(
        pool_child_handler: None) -> None:
    # Billiard's signal raises wherever it lands
    with pytest.raises(SoftTimeLimitExceeded):
        os.kill(os.getpid(), SIG)
        time.sleep(0.1)
    # Once the task stopped itself, the signal sent for the same limit cuts nothing
    _stopped_at_its_soft_limit()
    os.kill(os.getpid(), SIG)
    time.sleep(0.1)
    # and the next task has the handler again
    softsignal.restore()
    assert signal.getsignal(SIG) is billiard_pool.soft_timeout_sighandler
    with pytest.raises(SoftTimeLimitExceeded):
        os.kill(os.getpid(), SIG)
        time.sleep(0.1)


def test_outside_a_pool_child_the_signal_is_left_alone() -> None:
    # A solo worker's SIGUSR1 is Celery's traceback dump: not ours to ignore
    def dump(signum: int, frame: object) -> None: ...

    before = signal.signal(SIG, dump)
    try:
        _stopped_at_its_soft_limit()
        assert signal.getsignal(SIG) is dump
        softsignal.restore()
        assert signal.getsignal(SIG) is dump
    finally:
        signal.signal(SIG, before)


def test_a_signal_during_a_held_block_raises_once_it_ends(pool_child_handler: None) -> None:
    done = []
    with pytest.raises(SoftTimeLimitExceeded), softsignal.held():
        os.kill(os.getpid(), SIG)
        time.sleep(0.1)  # the handler has run by now: the block goes on
        done.append("whole")
    assert done == ["whole"]
    assert signal.getsignal(SIG) is billiard_pool.soft_timeout_sighandler
    with softsignal.held():  # no signal: nothing raised
        done.append("again")
    assert done == ["whole", "again"]


def test_torchs_first_import_in_a_pool_child_is_not_cut_by_a_soft_limit(
        tmp_path: Path) -> None:
    """A soft limit that hit ``import torch`` midway left torch unimportable in that
    child for good ("duplicate registrations"). In a fresh interpreter with billiard's
    handler, a signal sent while torch imports raises only after the import is whole."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, threading
        from billiard import pool
        from celery.exceptions import SoftTimeLimitExceeded
        from sits_queue.workers import gpu
        signal.signal(signal.SIGUSR1, pool.soft_timeout_sighandler)
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        try:
            gpu._torch()
            print("no signal came")
        except SoftTimeLimitExceeded:
            print("raised after the import")
        import torch
        print("torch", torch.ones(2).sum().item())
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["raised after the import", "torch 2.0"]


def _raises_on_signal() -> bool:
    try:
        os.kill(os.getpid(), SIG)
        time.sleep(0.1)
    except SoftTimeLimitExceeded:
        return True
    return False


def test_a_batchs_members_leave_the_signal_to_the_batch_job(pool_child_handler: None) -> None:
    """The batch's members are traced by Celery's tracer, whose task_prerun armed the
    signal again after the run had stopped itself at its soft limit (the pool's signal,
    a second late, then cut a member that had finished: a probe saw it land in a
    member's prerun), and whose task_postrun, for a member traced while the run went on,
    muted the run's own limit."""
    from celery import signals

    from sits_queue.app import make_app

    make_app(SitsConfig(), main="softsignal-unit")  # (its worker's signal handlers)
    softsignal.mute()  # (between tasks: as the child's last task left it)
    with softsignal.batch_job():
        assert _raises_on_signal()  # armed for the run
        signals.task_postrun.send(sender=None, task=None)  # a member traced early
        assert _raises_on_signal()  # still armed: the run's limit stands
        _stopped_at_its_soft_limit()  # the run stops itself at its soft limit
        signals.task_prerun.send(sender=None, task=None)  # the members' traces
        assert not _raises_on_signal()  # the late signal cuts no member
    assert not _raises_on_signal()  # nor the pool's loop, between tasks
    signals.task_prerun.send(sender=None, task=None)  # the next task alone
    assert _raises_on_signal()
