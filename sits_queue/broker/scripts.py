"""The broker's Lua scripts, called by SHA.

redis-py's ``Script`` objects send ``SCRIPT EXISTS`` before every pipeline that uses
them: a whole extra round trip per ``delay()``. Here a script is called with ``EVALSHA``
directly; after a ``NOSCRIPT`` (a restarted or flushed server) every script is loaded
again and the call is retried once. A script that hit NOSCRIPT did not run, so the retry
cannot apply it twice.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

from sits_queue.broker.keys import QueueKeys

SCRIPT_NAMES = ("put", "pick", "ack", "dead", "restore", "release", "purge")


def _source(name: str) -> str:
    return resources.files("sits_queue.broker").joinpath(f"lua/{name}.lua").read_text()


@dataclass(frozen=True)
class Scripts:
    """Script sources and their SHA1s (computed locally, as Redis does)."""

    sources: dict[str, str]
    shas: dict[str, str]

    @classmethod
    def register(cls) -> Scripts:
        sources = {name: _source(name) for name in SCRIPT_NAMES}
        return cls(sources, {n: hashlib.sha1(s.encode()).hexdigest() for n, s in sources.items()})

    def load_all(self, client: Any) -> None:
        for source in self.sources.values():
            client.script_load(source)

    def run(self, name: str, keys: QueueKeys, args: list[Any], client: Any) -> Any:
        """One script call (EVALSHA, reloading every script once after NOSCRIPT)."""
        names = keys.all()
        try:
            return client.evalsha(self.shas[name], len(names), *names, *args)
        except NoScriptError:
            self.load_all(client)
            return client.evalsha(self.shas[name], len(names), *names, *args)
