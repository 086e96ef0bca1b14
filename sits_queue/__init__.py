"""SITS queue: a Celery-compatible task queue for offline AI inference on GPU fleets.

``celery -A sits_queue worker`` finds :data:`app` here.
"""

import sys
from pathlib import Path

from sits_queue.app import SitsCelery, SitsTask, make_app
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


try:
    app = make_app()
except ConfigError as exc:
    # ``sitsq`` imports this package before its own error handling can run, and
    # ``celery -A`` while it loads the app (it would print its 80-line import traceback):
    # a bad setting is the user's to fix, so one line naming it, as for sitsq's other
    # errors (a program importing the package gets the exception).
    if _on_a_command_line():
        raise SystemExit(f"Error: {exc}") from None
    raise
celery = app  # `celery -A sits_queue` also looks for this name

__all__ = ["ConfigError", "ContextTooLong", "InferenceError", "InvalidInput",
           "InvalidTaskOptions", "ModelLoadError", "SitsCelery", "SitsError", "SitsTask",
           "UnknownModel", "VramLimitExceeded", "app", "celery", "make_app"]
