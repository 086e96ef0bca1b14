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

try:
    app = make_app()
except ConfigError as exc:
    # ``sitsq`` imports this package before its own error handling can run: a bad setting
    # is the user's to fix, so one line naming it, as for sitsq's other errors (anyone
    # else importing the package gets the exception).
    if Path(sys.argv[0]).name in ("sitsq", "cli.py", "-m"):
        raise SystemExit(f"Error: {exc}") from None
    raise
celery = app  # `celery -A sits_queue` also looks for this name

__all__ = ["ConfigError", "ContextTooLong", "InferenceError", "InvalidInput",
           "InvalidTaskOptions", "ModelLoadError", "SitsCelery", "SitsError", "SitsTask",
           "UnknownModel", "VramLimitExceeded", "app", "celery", "make_app"]
