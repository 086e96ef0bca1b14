"""Hugging Face progress bars off while a worker loads or builds a model.

transformers draws a tqdm bar for every checkpoint it reads or writes ("Loading
weights", "Writing model shards"). In a pool child Celery redirects stderr to its
logger, so each redraw became a WARNING line in the worker's log (two per tiny model,
one per refresh on a large one), carrying ``\\r`` and block characters; in a
benchmark's output, noise between its lines. The worker's own record of a load is its
cold-start accounting (how long, which tier), so the bars say nothing it does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def bars_on() -> bool:
    """Whether transformers draws its progress bars now."""
    return bool(_switch().is_progress_bar_enabled())


def set_bars(on: bool) -> None:
    """Turn transformers' (and the Hub's) progress bars on or off, process-wide."""
    switch = _switch()
    (switch.enable_progress_bar if on else switch.disable_progress_bar)()


def _switch() -> Any:
    from transformers.utils import logging as hf_logging  # (untyped: used through Any)

    return hf_logging


@contextmanager
def quiet() -> Iterator[None]:
    """Progress bars off for the block, as they were after.

    Process-wide, as transformers keeps the switch: a bar another thread draws meanwhile
    is silenced too, which is what a worker wants. When bars were off already (the
    user's ``HF_HUB_DISABLE_PROGRESS_BARS``, or another load's block), nothing changes.
    """
    if not bars_on():
        yield
        return
    set_bars(False)
    try:
        yield
    finally:
        set_bars(True)
