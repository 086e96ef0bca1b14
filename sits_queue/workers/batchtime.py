"""A batch's time budget: how many of the calls a worker gathered fit its time limit.

A batch runs as one pool job under its calls' time limits (its key includes them), not
under a limit per call, so calls that each fit their soft limit alone can miss it
together, and then every call still going fails with ``SoftTimeLimitExceeded``. The
worker's main process learns, per batch key, how long its batches of that key took per
unit of work (a call; a text of ``sits.embed``; a token asked of
``sits.generate_batched``; what a batch task's ``work=`` says), and before it sends a
gathered batch to the pool it runs only the longest prefix of its calls whose expected
time is within ``batch_time_share`` of the limit (at least one call). The rest go back
to their queue at their scores, uncounted (as a batch-mate of a terminated task does),
to run in the next batch, here or on another worker.

* A run's time is its own: the child reports it with the cold start (context, load,
  promotion, warm-up) taken out, since the next batch finds the engine warm.
* A batch stopped at its soft limit is recorded as having needed twice that limit (at
  least the limit; how much more is unknown): after a failure the next batch of the key
  is at most ``share / 2`` of it, so a fitting size is found in a few batches.
* The estimate is the median seconds per unit over the key's last :data:`WINDOW` runs,
  times the batch's units: proportional, so it over-estimates a large batch where the
  device has spare parallelism (a GPU decodes 32 rows in about the time of one). It
  only matters near the limit, where erring towards smaller batches is the safe side,
  and runs at the larger sizes it allows bring the median down again.
* The first batch of a key is not cut (nothing is known yet): if it misses its limit it
  fails as before, and the batches after it are cut.

Pure functions over frozen dataclasses; ``batched.py`` measures (in the pool child) and
``batchmain.py`` applies (in the main process).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: Runs of a key remembered.
WINDOW = 8
#: A run stopped at its limit counts as having needed this many times the limit.
CUT_SHORT_FACTOR = 2.0


@dataclass(frozen=True)
class Run:
    #: Units of work the batch ran (the sum over its calls).
    work: float
    #: How long it ran, s, its cold start excluded.
    seconds: float
    #: Stopped at its time limit: ``seconds`` is the limit, a lower bound.
    cut_short: bool = False


@dataclass(frozen=True)
class Times:
    """A batch key's recent runs, oldest first."""

    runs: tuple[Run, ...] = ()

    def record(self, run: Run) -> Times:
        if not run.work > 0 or run.seconds < 0:
            return self  # nothing to learn from an empty or unmeasured run
        return Times((*self.runs, run)[-WINDOW:])

    def per_unit_s(self) -> float | None:
        """Seconds per unit of work: the median over the runs (None: no run yet)."""
        if not self.runs:
            return None
        return statistics.median(
            r.seconds * (CUT_SHORT_FACTOR if r.cut_short else 1.0) / r.work for r in self.runs)


def fitting(times: Times | None, works: Sequence[float], limit_s: float | None,
            share: float) -> int:
    """How many of ``works`` (a batch's calls' units, in order) to run: all of them
    without a limit, a share (0: no cut) or a run to learn from; else the longest prefix
    expected within ``share`` of ``limit_s``, and at least one."""
    per_unit = times.per_unit_s() if times is not None else None
    if not works or not limit_s or limit_s <= 0 or not share > 0 or per_unit is None:
        return len(works)
    budget, spent = share * limit_s, 0.0
    for taken, work in enumerate(works):
        spent += max(0.0, work) * per_unit
        if spent > budget:
            return max(1, taken)
    return len(works)
