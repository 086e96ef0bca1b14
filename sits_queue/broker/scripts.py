"""Load the broker's Lua scripts once per Redis client (redis-py handles NOSCRIPT)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.commands.core import Script

from sits_queue.broker.keys import QueueKeys

SCRIPT_NAMES = ("put", "pick", "ack", "dead", "restore", "release", "rescore", "purge")


def _source(name: str) -> str:
    return resources.files("sits_queue.broker").joinpath(f"lua/{name}.lua").read_text()


@dataclass(frozen=True)
class Scripts:
    """The registered scripts; call ``run(name, keys, args, client)``."""

    by_name: dict[str, Script]

    @classmethod
    def register(cls, client: Any) -> Scripts:
        return cls({name: client.register_script(_source(name)) for name in SCRIPT_NAMES})

    def run(self, name: str, keys: QueueKeys, args: list[Any], client: Any) -> Any:
        return self.by_name[name](keys=keys.all(), args=args, client=client)
