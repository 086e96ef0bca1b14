"""Both ends of a running batch's joins (``workers/joins.py``) against a real Redis: the
main process's poll, attach and finish with the child's :class:`~joins.Feed` between
them, including the failure paths a worker rarely shows (a push after the batch ended,
a child that died with joins pushed, declined rows). The whole thing in a real worker:
``test_joins.py``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from sits_queue.workers import joins
from sits_queue.workers.batched import Call

QUEUE, KEY = "gen", "sits.generate_batched|gpt|medium"


@dataclass
class FakeRequest:
    """What attach and finish use of a Celery request (its pool job's fields, and the
    accept it gets), recorded."""

    id: str
    type: str = "sits.generate_batched"
    request_dict: dict[str, Any] = field(default_factory=dict)
    body: bytes = b'[["a prompt"], {"max_new_tokens": 3}, {}]'
    content_type: str = "application/json"
    content_encoding: str = "utf-8"
    accepted: list[tuple[Any, float]] = field(default_factory=list)
    revoked_: bool = False

    def on_accepted(self, pid: Any, at: float) -> None:
        self.accepted.append((pid, at))


@pytest.fixture
def batch(redis_client: redis.Redis) -> Iterator[list[Any]]:
    """A running batch of one own request, registered as the main process does."""
    own = [FakeRequest("own")]
    joins.start("own", QUEUE, KEY, joins.join_keys(QUEUE, "own"), own, lambda: 4242)
    yield own
    joins.finish("own", redis_client)


def feed(client: redis.Redis, capacity: int = 4, for_s: float = 60.0,
         deadline: float | None = None) -> tuple[joins.Feed, list[tuple[Any, ...]]]:
    added: list[tuple[Any, ...]] = []

    def add(job: tuple[Any, ...]) -> tuple[int, Call]:
        added.append(job)
        return len(added), Call(job[1])

    return joins.Feed(client, joins.join_keys(QUEUE, "own"), capacity,
                      time.monotonic() + for_s, add, lambda: deadline), added


def poll_and_attach(client: redis.Redis, members: list[FakeRequest],
                    apart: list[list[Any]]) -> list[tuple[str, str, int]]:
    """One poll; its pick brings ``members`` (as the consumer would) and attaches them."""
    asked: list[tuple[str, str, int]] = []

    def pick(queue: str, key: str, n: int, group: str) -> None:
        asked.append((queue, key, n))
        assert joins.joining(group)
        joins.attach(group, members[:n], lambda _: True, apart.append, client)

    joins.poll(client, pick, apart.append)
    return asked


def test_room_offered_is_picked_pushed_taken_and_served(redis_client: redis.Redis,
                                                        batch: list[Any]) -> None:
    child, added = feed(redis_client)
    apart: list[list[Any]] = []
    # nothing offered yet: the poll asks for nothing
    assert poll_and_attach(redis_client, [FakeRequest("j1")], apart) == []
    assert child.take(live=1) == []  # offers 3 rows; nothing pushed yet
    members = [FakeRequest("j1"), FakeRequest("j2"), FakeRequest("j3"), FakeRequest("j4")]
    assert poll_and_attach(redis_client, members, apart) == [(QUEUE, KEY, 3)]
    # attached: started in the batch's child, part of its requests, not units of their own
    assert batch == [batch[0], *members[:3]] and apart == []
    assert all(m.accepted and m.accepted[0][0] == 4242 for m in members[:3])
    assert all(joins.attached(m) for m in members[:3]) and not joins.attached(members[3])
    # pushed jobs the child has not taken count against its room: no double pick
    assert poll_and_attach(redis_client, members[3:], apart) == []
    got = child.take(live=2)  # room 2 now: the two oldest
    assert [c.id for _, c in got] == ["j1", "j2"] and added[0][1] == "j1"
    # the rows they took are not free: nothing more is picked for them
    assert poll_and_attach(redis_client, members[3:], apart) == []
    assert added[0][3] == members[0].body and child.joined == 2
    # the batch ends having taken two joins: own + 2 served, j3 runs again
    child.close()
    served, rest = joins.finish("own", redis_client, taken=2)
    assert [r.id for r in served] == ["own", "j1", "j2"] and rest == [members[2]]
    assert not any(joins.attached(m) for m in members)
    assert list(redis_client.scan_iter(match="*join*")) == []


def test_a_join_delivered_after_the_batch_ended_runs_apart(redis_client: redis.Redis,
                                                           batch: list[Any]) -> None:
    child, _ = feed(redis_client)
    child.take(live=1)
    apart: list[list[Any]] = []

    def pick(queue: str, key: str, n: int, group: str) -> None:
        child.close()  # the batch ends while the consumer takes the delivery
        joins.attach(group, [FakeRequest("late")], lambda _: True, apart.append,
                     redis_client)

    joins.poll(redis_client, pick, apart.append)
    assert [[m.id for m in members] for members in apart] == [["late"]]
    assert len(batch) == 1  # not attached


def test_a_child_that_died_leaves_its_untaken_joins_to_run_again(
        redis_client: redis.Redis, batch: list[Any]) -> None:
    child, _ = feed(redis_client)
    child.take(live=1)
    members = [FakeRequest("j1"), FakeRequest("j2")]
    poll_and_attach(redis_client, members, [])
    assert len(child.take(live=3)) == 1  # room 1: took j1, then died
    served, rest = joins.finish("own", redis_client)  # no results: the list's count
    assert [r.id for r in served] == ["own", "j1"] and rest == [members[1]]
    assert joins.finish("own", redis_client) == ([], [])  # once


def test_a_child_that_died_after_declining_a_join_leaves_it_to_run_again(
        redis_client: redis.Redis, batch: list[Any]) -> None:
    """The list's count of what the child took includes what it declined: those were
    failed with the dead child's error (a hard time limit) though they never ran."""
    child, _ = feed(redis_client)
    child.take(live=1)
    members = [FakeRequest("j1"), FakeRequest("j2"), FakeRequest("j3")]
    poll_and_attach(redis_client, members, [])
    taken = child.take(live=1)
    assert [(i, c.id) for i, c in taken] == [(1, "j1"), (2, "j2"), (3, "j3")]
    child.decline(2)  # j2 would not finish in time; then the child died
    served, rest = joins.finish("own", redis_client)
    assert [r.id for r in served] == ["own", "j1", "j3"] and rest == [members[1]]


@pytest.mark.parametrize("child_died", [False, True])
def test_a_declined_join_runs_again_at_the_next_poll_not_at_the_batch_end(
        redis_client: redis.Redis, batch: list[Any], child_died: bool) -> None:
    """Held to the batch's end, a declined row waited for the longest row it was meant
    to overtake, while another child could have run it; run again once, not twice."""
    child, _ = feed(redis_client)
    child.take(live=1)
    members = [FakeRequest("j1"), FakeRequest("j2"), FakeRequest("j3")]
    apart: list[list[Any]] = []
    poll_and_attach(redis_client, members, apart)
    assert len(child.take(live=1)) == 3
    child.decline(2)  # j2
    assert apart == [] and joins.given_back("own") == set()
    poll_and_attach(redis_client, [], apart)
    assert apart == [[members[1]]] and joins.given_back("own") == {"j2"}
    assert not joins.attached(members[1]) and joins.attached(members[0])
    poll_and_attach(redis_client, [], apart)  # seen once
    assert apart == [[members[1]]]
    served, rest = (joins.finish("own", redis_client) if child_died
                    else joins.finish("own", redis_client, taken=3))
    assert rest == []  # not run a second time by the batch's end
    assert [r.id for r in served] == (["own", "j1", "j3"] if child_died
                                      else ["own", "j1", "j2", "j3"])
    assert joins.given_back("own") == set()  # the batch is gone


def test_revoked_or_refused_members_are_not_attached(redis_client: redis.Redis,
                                                     batch: list[Any]) -> None:
    child, _ = feed(redis_client)
    child.take(live=1)
    apart: list[list[Any]] = []

    def pick(queue: str, key: str, n: int, group: str) -> None:
        joins.attach(group, [FakeRequest("gone"), FakeRequest("ok")],
                     lambda m: m.id != "gone", apart.append, redis_client)

    joins.poll(redis_client, pick, apart.append)
    assert [m.id for m in batch] == ["own", "ok"] and apart == []


def test_the_feed_stops_joining_after_its_time_and_declines_late_rows(
        redis_client: redis.Redis, batch: list[Any]) -> None:
    late, _ = feed(redis_client, for_s=-1.0)
    assert late.take(live=1) == [] and not late.open  # closed: the main process stops
    assert [r.id for r in joins.finish("own", redis_client)[0]] == ["own"]
    near, _ = feed(redis_client, deadline=time.monotonic() + 1.0)
    assert near.fits(10, 0.01) and not near.fits(100, 0.01)
    near.decline(3)
    assert near.declined == {3}


def test_a_redis_error_in_the_child_ends_joining_not_the_batch(batch: list[Any]) -> None:
    dead = redis.Redis(port=1, socket_connect_timeout=0.2)
    child = joins.Feed(dead, joins.join_keys(QUEUE, "own"), 4, time.monotonic() + 60,
                       lambda job: (0, Call(job[1])))
    assert child.take(live=1) == [] and not child.open
    child.close()  # closed already: no second error


def test_a_batch_takes_joins_once_a_quarter_of_it_is_free(redis_client: redis.Redis,
                                                          batch: list[Any]) -> None:
    child, _ = feed(redis_client, capacity=32)
    assert child.least == 8
    members = [FakeRequest("j1"), FakeRequest("j2")]
    # 2 rows free: none offered, so the main process picks nothing the batch would hold
    # unrun (it took joins only from 8 free rows; one picked earlier sat unacked)
    assert child.take(live=30) == []
    assert poll_and_attach(redis_client, members, []) == []
    # 8 free: offered, picked, pushed and taken
    assert child.take(live=24) == []
    assert poll_and_attach(redis_client, members, []) == [(QUEUE, KEY, 8)]
    assert [c.id for _, c in child.take(live=24)] == ["j1", "j2"]
