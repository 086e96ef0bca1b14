"""Where §1.3 cuts a high-entropy input into shards (pure)."""

from __future__ import annotations

import pytest

from sits_queue.app import make_app
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidTaskOptions
from sits_queue.priority.entropy import SHARD_ENTROPY
from sits_queue.shards import _items_of, apply_sharded, plan


@pytest.mark.parametrize(("n", "entropy", "size", "bounds"), [
    (130, SHARD_ENTROPY, 64, ((0, 44), (44, 87), (87, 130))),  # even, not 64/64/2
    (10, SHARD_ENTROPY, 3, ((0, 3), (3, 6), (6, 8), (8, 10))),  # not 3/3/3/1
    (128, 0.9, 64, ((0, 64), (64, 128))),
    (64, 0.9, 64, ((0, 64),)),  # one shard's worth: no split
    (500, SHARD_ENTROPY - 0.01, 64, ((0, 500),)),  # prose: never split
    (500, None, 64, ((0, 500),)),  # no text to measure
    (0, 0.9, 64, ((0, 0),)),
    (5, 0.9, 1, ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5))),
])
def test_plan(n: int, entropy: float | None, size: int,
              bounds: tuple[tuple[int, int], ...]) -> None:
    got = plan(n, entropy, size)
    assert got.bounds == bounds and got.sharded is (len(bounds) > 1)
    # the shards cover the input exactly, in order
    assert [i for a, b in got.bounds for i in range(a, b)] == list(range(n))


def test_plan_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError, match="shard_items must be >= 1"):
        plan(10, 0.9, 0)
    with pytest.raises(ValueError, match="n_items must be >= 0"):
        plan(-1, 0.9, 4)
    for wrong in ("64", 2.5, True, None):  # (compared as given: a bare TypeError, or taken)
        with pytest.raises(TypeError, match="shard_items must be an integer >= 1, got"):
            plan(10, 0.9, wrong)  # type: ignore[arg-type]


@pytest.mark.parametrize("entropy", ["x", -0.1, 1.5, float("nan"), True])
def test_apply_sharded_names_a_bad_entropy_before_sending(entropy: object) -> None:
    """(a string reached the plan's comparison: a TypeError naming no option)"""
    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="shards_unit")

    @app.task(name="s.lens", shared=False)
    def lens(items: list[str]) -> list[int]:
        return [len(x) for x in items]

    with pytest.raises(InvalidTaskOptions, match="input_entropy must be"):
        apply_sharded(lens, ["a"] * 130, input_entropy=entropy)
    with pytest.raises(TypeError, match="shard_items must be an integer"):
        apply_sharded(lens, ["a"] * 130, shard_items="64")  # type: ignore[arg-type]


@pytest.mark.parametrize("entropy", [0.9, 0.1])
def test_apply_sharded_refuses_a_task_id_sharded_or_not(entropy: float) -> None:
    """(every shard was sent with the one id: one result key, and the job's get()
    returned 132 outputs for 130 items, mixed up, without an error)"""
    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/0"), main="shards_unit")

    @app.task(name="s.lens", shared=False)
    def lens(items: list[str]) -> list[int]:
        return [len(x) for x in items]

    # (the Redis at port 1 is no server: a refusal is raised before anything is sent)
    with pytest.raises(InvalidTaskOptions, match="apply_sharded takes no task_id"):
        apply_sharded(lens, ["a"] * 130, input_entropy=entropy, task_id="job-1")


def test_shard_outputs_are_lists_plain_or_wrapped() -> None:
    assert _items_of([1, 2]) == [1, 2]
    assert _items_of({"output": [3], "sits": {}}) == [3]
    with pytest.raises(TypeError, match="must return a list per shard"):
        _items_of({"output": 5})


def test_a_failed_shard_is_named_by_its_place_and_items() -> None:
    """(its error named only a task id, to be looked up in job.results)"""
    from sits_queue.shards import Sharded, ShardPlan

    class Result:
        def __init__(self, task_id: str, outcome: object) -> None:
            self.id, self.outcome = task_id, outcome

        def get(self, timeout: float | None = None) -> object:
            if isinstance(self.outcome, Exception):
                raise self.outcome
            return self.outcome

    failure = RuntimeError("dead-lettered")
    job = Sharded(None, [Result("a", [1, 2]), Result("b", failure), Result("c", [5])],
                  ShardPlan(((0, 2), (2, 4), (4, 5)), 0.9))
    with pytest.raises(RuntimeError, match="dead-lettered") as info:
        job.get()
    assert info.value is failure  # the same error, its type kept for the caller's except
    assert info.value.__notes__ == ["shard 1 of 3 (items 2 to 3), task b; an item it names "
                                    "by number is that many past item 2"]
