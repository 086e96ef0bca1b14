"""SITS queue: a Celery-compatible task queue for offline AI inference on GPU fleets.

``celery -A sits_queue worker`` finds :data:`app` here.
"""

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

app = make_app()
celery = app  # `celery -A sits_queue` also looks for this name

__all__ = ["ConfigError", "ContextTooLong", "InferenceError", "InvalidInput",
           "InvalidTaskOptions", "ModelLoadError", "SitsCelery", "SitsError", "SitsTask",
           "UnknownModel", "VramLimitExceeded", "app", "celery", "make_app"]
