"""What a pool child had imported when it started (forked from the worker's parent),
before any task ran: ``x.forked_with`` returns it. A worker of an app that serves models
imports the inference stack before its pool forks (``planstep.preimport``); one of plain
tasks does not, and neither does the child's own start-up. ``x.collector`` says what a
full collection in the child would walk (``workers/childgc.py`` freezes the start-up)."""

from __future__ import annotations

import gc
import sys
from typing import Any

from celery import Celery, signals

#: The modules looked for: torch, and the bulk of a Hugging Face model load's imports.
HEAVY = ("torch", "transformers.modeling_utils")
_at_start: list[str] = []


def _note(**_: Any) -> None:
    _at_start[:] = [name for name in HEAVY if name in sys.modules]


def register(app: Celery) -> None:
    # (after the runtime's own worker_process_init receiver: what the child's start-up
    # imports is in the snapshot too)
    signals.worker_process_init.connect(_note, weak=False, dispatch_uid="sits-forkcheck")

    @app.task(name="x.forked_with", shared=False)
    def forked_with() -> list[str]:
        return list(_at_start)

    @app.task(name="x.collector", shared=False)
    def collector() -> dict[str, Any]:
        """Objects frozen (no collection walks them), and tracked (a full one walks)."""
        return {"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects()),
                "torch": "torch" in sys.modules}
