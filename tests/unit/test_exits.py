"""A task's attempt to end its process, as its failure (``exits.fail_exits``)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from celery.exceptions import WorkerShutdown, WorkerTerminate

from sits_queue.errors import TaskExited
from sits_queue.exits import fail_exits


def task(eager: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name="t.x", request=SimpleNamespace(id="abc", is_eager=eager))


@pytest.mark.parametrize(("raised", "said"), [
    (SystemExit(3), "SystemExit(3)"), (SystemExit(), "SystemExit(None)"),
    (SystemExit("bye"), "SystemExit('bye')"), (KeyboardInterrupt(), "KeyboardInterrupt;")])
def test_an_exit_in_a_worker_is_the_tasks_failure(raised: BaseException, said: str) -> None:
    with pytest.raises(TaskExited) as caught, fail_exits(task()):
        raise raised
    assert f"task t.x[abc] tried to end its process: {said}" in str(caught.value)
    assert caught.value.__cause__ is raised


@pytest.mark.parametrize("shutdown", [WorkerShutdown(0), WorkerTerminate(1)])
def test_the_workers_own_shutdown_goes_through(shutdown: SystemExit) -> None:
    with pytest.raises(type(shutdown)), fail_exits(task()):
        raise shutdown


def test_an_eager_call_leaves_the_exit_to_its_caller() -> None:
    with pytest.raises(SystemExit), fail_exits(task(eager=True)):
        sys.exit(2)


def test_a_body_that_returns_or_fails_otherwise_is_left_alone() -> None:
    with fail_exits(task()):
        pass
    with pytest.raises(ValueError), fail_exits(task()):
        raise ValueError("its own error")


def test_the_pools_terminate_signal_goes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """(billiard's SIGTERM handler raises SystemExit in a pool child: converted, a child
    told to end by revoke(terminate=True) lived on, and the revoked task failed as if it
    had called sys.exit())"""
    from billiard import common

    # what billiard's handler (common._shutdown_cleanup) does on the signal: the flag
    # first, then sys.exit (not called here: it resets this process's SIGTERM)
    monkeypatch.setattr(common, "_should_have_exited", [True])
    assert common.terminate_handler_fired()
    with pytest.raises(SystemExit), fail_exits(task()):
        sys.exit(-(256 - 15))


def test_a_loader_interrupted_by_the_pools_terminate_signal_is_no_load_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(a revoke(terminate=True) that came mid-load was turned into ModelLoadError: the
    child lived on, and the load was called failed)"""
    from billiard import common

    from sits_queue.errors import ModelLoadError
    from sits_queue.registry import ModelSpec, load_engine

    def exits() -> None:
        sys.exit(-(256 - 15))

    spec = ModelSpec(name="m", loader=exits)
    with pytest.raises(ModelLoadError, match="tried to end its process"):
        load_engine(spec, "cpu")  # the loader's own
    monkeypatch.setattr(common, "_should_have_exited", [True])
    with pytest.raises(SystemExit):
        load_engine(spec, "cpu")
    with pytest.raises(WorkerShutdown):
        load_engine(ModelSpec(name="m", loader=lambda: (_ for _ in ()).throw(
            WorkerShutdown(0))), "cpu")
