"""SITS queue: a Celery-compatible task queue for offline AI inference on GPU fleets.

``celery -A sits_queue worker`` finds :data:`app` here.
"""

import sys
from pathlib import Path
from types import TracebackType

from sits_queue.app import SitsCelery, SitsTask, make_app
from sits_queue.config import SitsConfig
from sits_queue.errors import (
    ConfigError,
    ContextTooLong,
    InferenceError,
    InvalidInput,
    InvalidTaskOptions,
    ModelLoadError,
    SitsError,
    UnknownModel,
    VramLimitExceeded,
)


def _on_a_command_line() -> bool:
    """Whether this process is ``sitsq`` or Celery's command line (``celery -A
    sits_queue ...``, ``python -m celery``), not a program that imports the package."""
    program = Path(sys.argv[0])
    return program.name in ("sitsq", "celery", "cli.py", "-m") or (
        program.name == "__main__.py" and program.parent.name == "celery")


def _run_as_module(name: str) -> bool:
    """Whether this process is ``python -m name`` (while the package is imported for
    ``-m``, ``sys.argv[0]`` is "-m" whichever module runs: the interpreter's own
    arguments say which)."""
    given = list(getattr(sys, "orig_argv", ()))
    return "-m" in given[:-1] and given[given.index("-m") + 1] == name


def _is_sitsq() -> bool:
    """Whether this process is ``sitsq`` (or ``python -m sits_queue.cli``)."""
    return Path(sys.argv[0]).name in ("sitsq", "cli.py") or _run_as_module("sits_queue.cli")


def _say_ours_in_one_line() -> None:
    """On Celery's command line, our errors that reach the top (``celery -A sits_queue
    call TASK --countdown nan``: the call's options are checked as it is sent) are a
    line naming the problem, as click says its own, not a 30-line traceback; anything
    else is shown as it was."""
    shown = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if isinstance(exc, SitsError):
            print(f"Error: {exc or kind.__name__}", file=sys.stderr)
        else:
            shown(kind, exc, tb)

    sys.excepthook = hook


def _is_celerys() -> bool:
    """Whether this process is Celery's command line (``celery``, ``python -m celery``),
    not another program run with ``-m`` while its package imports this one."""
    program = Path(sys.argv[0])
    return program.name == "celery" or _run_as_module("celery") or (
        program.name == "__main__.py" and program.parent.name == "celery")


if _is_celerys():
    _say_ours_in_one_line()

try:
    app = make_app()
except ConfigError as exc:
    if _is_sitsq():
        # sitsq reads the settings again in each command that uses them and says what
        # is wrong there, in its own one line; meanwhile its --help and the commands
        # that need none work (the import stopped them all: even `sitsq --help` only
        # printed the setting's error). Its own app is never this one.
        app = make_app(SitsConfig())
    # ``celery -A`` loads the app (it would print its 80-line import traceback): a bad
    # setting is the user's to fix, so one line naming it, as for sitsq's errors (a
    # program importing the package gets the exception).
    elif _on_a_command_line():
        raise SystemExit(f"Error: {exc}") from None
    else:
        raise
celery = app  # `celery -A sits_queue` also looks for this name

__all__ = ["ConfigError", "ContextTooLong", "InferenceError", "InvalidInput",
           "InvalidTaskOptions", "ModelLoadError", "SitsCelery", "SitsError", "SitsTask",
           "UnknownModel", "VramLimitExceeded", "app", "celery", "make_app"]
