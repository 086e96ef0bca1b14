"""The Redis commands a block of a test sends, as redis-py packs them: how many round
trips a path costs, read from what actually went on the wire."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis


@contextmanager
def sent_commands(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The packed commands every redis-py connection sends inside the block."""
    sent: list[Any] = []
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        sent.append(command)
        send(self, command, check_health)

    with monkeypatch.context() as patch:
        patch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
        yield sent
