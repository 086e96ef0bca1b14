"""High-entropy inputs split into early-stoppable shards (MISSION §1.3).

A task over a long list of dense inputs (encoded data, non-Latin or mixed scripts: input
entropy >= ``SHARD_ENTROPY``) is submitted as several shard tasks of at most
``shard_items`` items each, one Celery ``group``: each shard is a short task that waits
and runs on its own merits, so one big dense job does not hold a slot for long while
short tasks queue behind it, and the caller can **stop early**: take shard results in
order and, once it has what it needs, revoke the shards not yet started::

    from sits_queue.shards import apply_sharded

    job = apply_sharded(app.tasks["sits.embed"], texts, model="encoder", shard_items=64)
    vectors = job.get(timeout=600)                      # all of it, in input order
    hits = job.take(lambda found: len(found) >= 100)    # or stop once 100 are in

Low-entropy inputs (prose) and short lists go as one task, as ``apply_async`` would.
The task's first argument must be the list; its result a list (or a ``{"output": list}``
inference result) with one entry per item, which :meth:`Sharded.get` concatenates.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from celery import group
from kombu.serialization import dumps

from sits_queue.checks import shown
from sits_queue.errors import InvalidTaskOptions
from sits_queue.options import checked_entropy
from sits_queue.priority.entropy import input_entropy, is_shardable

#: Items per shard by default: a short task on the ladder the batch controller climbs.
DEFAULT_SHARD_ITEMS = 64
#: The least wait passed to a shard's ``get`` once the deadline has passed: a result
#: already in is still taken, and some backends read a timeout of 0 as "no timeout".
LAST_LOOK_S = 0.001


@dataclass(frozen=True)
class ShardPlan:
    """Where the input is cut: (start, end) per shard, and the entropy that decided."""

    bounds: tuple[tuple[int, int], ...]
    entropy: float | None

    @property
    def sharded(self) -> bool:
        return len(self.bounds) > 1


def plan(n_items: int, entropy: float | None, shard_items: int = DEFAULT_SHARD_ITEMS
         ) -> ShardPlan:
    """Shards of at most ``shard_items`` when the input is shardable (§1.3) and longer
    than one shard; otherwise one piece (pure)."""
    if isinstance(shard_items, bool) or not isinstance(shard_items, int):
        raise TypeError(f"shard_items must be an integer >= 1, got {shown(shard_items)}")
    if shard_items < 1:
        raise ValueError(f"shard_items must be >= 1, got {shard_items}")
    if n_items < 0:
        raise ValueError(f"n_items must be >= 0, got {n_items}")
    if not is_shardable(entropy) or n_items <= shard_items:
        return ShardPlan(((0, n_items),), entropy)
    # Even shards, sizes one apart at most: 130 items in 3 of 44/43/43 (not 64/64/2, nor
    # the 44/44/42 of a rounded-up size; 10 by 3 as 3/3/2/2, not 3/3/3/1)
    count = math.ceil(n_items / shard_items)
    size, longer = divmod(n_items, count)
    ends = list(itertools.accumulate(size + (i < longer) for i in range(count)))
    return ShardPlan(tuple(zip([0, *ends[:-1]], ends, strict=True)), entropy)


def _items_of(result: Any) -> list[Any]:
    value = result.get("output") if isinstance(result, dict) and "output" in result \
        else result
    if not isinstance(value, list):
        raise TypeError(f"a sharded task must return a list per shard, got "
                        f"{type(value).__name__}")
    return value


class Sharded:
    """The shards of one submission, in input order."""

    def __init__(self, app: Any, results: Sequence[Any], shard_plan: ShardPlan) -> None:
        self.app = app
        self.results = list(results)
        self.plan = shard_plan

    def __len__(self) -> int:
        return len(self.results)

    def iter_outputs(self, timeout: float | None = None) -> Iterator[list[Any]]:
        """Each shard's items, in input order, as each is done. ``timeout`` (s) bounds the
        whole wait, as it does for one result: past it, Celery's ``TimeoutError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for index, result in enumerate(self.results):
            left = None if deadline is None \
                else max(deadline - time.monotonic(), LAST_LOOK_S)
            try:
                outcome = result.get(timeout=left)
            except Exception as exc:
                # which shard, of which items: the error named only a task id, to be
                # looked up in job.results, and an item by its place in the shard
                start, end = self.plan.bounds[index]
                exc.add_note(f"shard {index} of {len(self.results)} (items {start} to "
                             f"{end - 1}), task {result.id}"
                             + (f"; an item it names by number is that many past item "
                                f"{start}" if start else ""))
                raise
            yield _items_of(outcome)

    def get(self, timeout: float | None = None) -> list[Any]:
        """Every item's output, in input order (``timeout``: for all of it)."""
        return [item for shard in self.iter_outputs(timeout) for item in shard]

    def take(self, until: Callable[[list[Any]], bool], timeout: float | None = None
             ) -> list[Any]:
        """Items in input order, shard by shard, until ``until(items so far)`` holds;
        then the shards not yet started are revoked (:meth:`stop`). ``timeout`` as
        :meth:`iter_outputs`."""
        found: list[Any] = []
        for shard in self.iter_outputs(timeout):
            found += shard
            if until(found):
                self.stop()
                break
        return found

    def stop(self) -> int:
        """Revoke the shards that have not finished (a running one completes; Celery's
        revoke reaches the live workers, which discard a revoked task when they get it).
        Returns how many were revoked."""
        pending = [r.id for r in self.results if not r.ready()]
        if pending:
            self.app.control.revoke(pending)
        return len(pending)


def apply_sharded(task: Any, items: Sequence[Any], *args: Any,
                  shard_items: int = DEFAULT_SHARD_ITEMS, kwargs: dict[str, Any] | None = None,
                  **options: Any) -> Sharded:
    """Submit ``task(items, *args, **kwargs)``, split into shards when the items' text is
    high-entropy (§1.3) and there are more than ``shard_items``; ``options`` are
    ``apply_async``'s (SITS options included), the same for every shard."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError("items must be a list (or another sequence) of inputs, "
                        f"got {type(items).__name__}")
    options = dict(options)
    if "task_id" in options:  # (every shard would share it: one result key, mixed up)
        raise InvalidTaskOptions(
            "apply_sharded takes no task_id: the items may go as several tasks, each with "
            "an id of its own (the job's .results hold them); submit with apply_async to "
            "name one task's id")
    # The caller's, else the task's declared one (which applies to each shard as it is),
    # else measured and sent once: a measured value sent as the call's would outrank
    # the task's declaration in every shard's score
    entropy = options.pop("input_entropy", None)
    if entropy is not None:  # (checked before the plan compares it: a bare TypeError)
        entropy = checked_entropy(entropy)
    declared = getattr(task, "input_entropy", None)
    if entropy is None and declared is None:
        entropy = input_entropy((list(items),), {})
    shard_plan = plan(len(items), entropy if entropy is not None else declared, shard_items)
    extra = {} if entropy is None else {"input_entropy": entropy}
    if not shard_plan.sharded:
        one = task.apply_async((list(items), *args), kwargs or {}, **extra, **options)
        return Sharded(task.app, [one], shard_plan)
    most = getattr(task, "max_batch", None)
    if isinstance(most, int) and most > 1 and "max_batch" not in options:
        # A batch task's shards would go back into one batch (the same key): one run under
        # one shard's time limit, nothing to stop early. Each shard is a batch already.
        extra["max_batch"] = 1
    signatures = [task.signature((list(items[a:b]), *args), kwargs or {}, **extra, **options)
                  for a, b in shard_plan.bounds]
    # Every shard encoded before any is sent: Celery sends a group's members one at a
    # time, and an item the serializer refuses left the shards before it queued, with
    # no handle on them for the caller.
    serializer = options.get("serializer") or task.serializer or task.app.conf.task_serializer
    for sig in signatures:
        dumps((sig.args, sig.kwargs), serializer=serializer)  # type: ignore[no-untyped-call]
    outcome = group(signatures).apply_async()
    return Sharded(task.app, list(outcome.results), shard_plan)
