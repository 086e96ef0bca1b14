"""Queue names the key layout accepts (``broker/keys.py``): each queue's keys must share
one Redis Cluster hash tag. No Redis."""

from __future__ import annotations

from typing import Any

import pytest

from sits_queue.broker.keys import (
    QueueKeys,
    check_queue_name,
    is_reply_queue,
    is_result_queue_name,
    registered_queues,
)
from sits_queue.errors import InvalidQueueName


@pytest.mark.parametrize("name", ["", "a{b", "a}b", "{x}", None, 5, "bad\udcff", "\ud800"])
def test_a_queue_name_that_would_not_make_one_hash_tag_is_refused(name: Any) -> None:
    with pytest.raises(InvalidQueueName) as info:
        QueueKeys.for_queue(name)
    assert isinstance(info.value, ValueError)


def test_usable_queue_names_pass() -> None:
    assert check_queue_name("ünï-çødé.q") == "ünï-çødé.q"
    assert QueueKeys.for_queue("celery").waiting == "sits:{celery}:z"


def test_the_registry_walk_skips_names_it_cannot_use() -> None:
    assert registered_queues([b"b", b"", "a", b"x{y}"]) == ["a", "b"]


def test_the_workers_add_consumer_command_refuses_such_a_name_in_its_reply() -> None:
    from celery.worker.control import Panel

    from sits_queue.broker import control

    control.register()
    command = Panel.data["add_consumer"]
    assert command is control.add_consumer
    assert Panel.meta["add_consumer"].signature.startswith("<queue>")

    class NoConsumer:  # the command must answer before it touches the worker
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"touched the worker's {name}")

    assert "error" in command(NoConsumer(), "")
    assert "error" in command(NoConsumer(), "a{b}")
    # (a name JSON carries but no Redis key can be: it replied ok, then the worker died)
    assert "not UTF-8 text" in command(NoConsumer(), "bad\udcff")["error"]


@pytest.mark.parametrize(("queue", "reply", "result_name"), [
    ("6b1ac3f4-19d2-3a8e-8f0c-3f2f0d2b1a77.reply.celery.pidbox", True, False),
    ("6b1ac3f4-19d2-3a8e-8f0c-3f2f0d2b1a77", False, True),  # rpc:// results (or work)
    ("celery", False, False), ("w1@host.dq2", False, False),
    ("6b1ac3f4-19d2-3a8e-8f0c-3f2f0d2b1a77-batch", False, False),
    ("6B1AC3F4-19D2-3A8E-8F0C-3F2F0D2B1A77", False, False),  # Python writes lower case
])
def test_reply_and_result_queues_are_known_by_name(queue: str, reply: bool,
                                                   result_name: bool) -> None:
    assert is_reply_queue(queue) is reply
    assert is_result_queue_name(queue) is result_name
