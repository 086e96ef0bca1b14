"""The broker's Lua scripts, called by SHA.

redis-py's ``Script`` objects send ``SCRIPT EXISTS`` before every pipeline that uses
them: a whole extra round trip per ``delay()``. Here a script is called with ``EVALSHA``
directly; after a ``NOSCRIPT`` (a restarted or flushed server) every script is loaded
again and the call is retried once. A script that hit NOSCRIPT did not run, so the retry
cannot apply it twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.exceptions import ConnectionError, NoScriptError

from sits_queue.broker.keys import QueueKeys

SCRIPT_NAMES = ("put", "pick", "ack", "dead", "restore", "release", "purge", "preempt", "join",
                "prune_hot", "arm", "take_outbox", "done_outbox", "forget", "requeue", "beat")


#: What is prepended to a script, in order. ``queue_types.lua``: to those that check their
#: keys' types before any write (their writes, stopped half-way, would lose or duplicate a
#: message). ``put_lib.lua``: the put, to both scripts that put messages. ``sweeps.lua``:
#: the gap that holds the sweeps, to both scripts that tell a queue is being served.
LIBRARIES = {"put": ("queue_types", "put_lib"), "requeue": ("queue_types", "put_lib"),
             "pick": ("queue_types",), "restore": ("queue_types", "sweeps"),
             "beat": ("queue_types", "sweeps")}


def _source(name: str) -> str:
    text = resources.files("sits_queue.broker").joinpath(f"lua/{name}.lua").read_text()
    return "".join(_source(lib) for lib in LIBRARIES.get(name, ())) + text


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
        return self.run_on(name, keys.all(), args, client)

    def run_on(self, name: str, keys: list[str], args: list[Any], client: Any) -> Any:
        """:meth:`run` for a script with keys of its own (``join.lua``: a running batch's)."""
        try:
            return client.evalsha(self.shas[name], len(keys), *keys, *args)
        except NoScriptError:
            self.load_all(client)
            return client.evalsha(self.shas[name], len(keys), *keys, *args)

    def start(self, name: str, keys: QueueKeys, args: list[Any], client: Any
              ) -> Callable[[], Any]:
        """Send one script call now; the returned function waits for its reply.

        Lets a producer build its next batch while Redis runs this one (bulk
        submission). The call holds one pooled connection until the reply is read; the
        reply function must be called exactly once. NOSCRIPT is handled as in :meth:`run`.
        """
        names = keys.all()
        pool = client.connection_pool
        conn = pool.get_connection()
        command = ("EVALSHA", self.shas[name], len(names), *names, *args)
        try:
            try:
                conn.send_command(*command)
            except ConnectionError:
                # A pooled connection the server closed (restart, idle timeout): nothing
                # ran, since Redis drops a partial command with its connection. Once more.
                conn.disconnect()
                conn.send_command(*command)
        except BaseException:
            pool.release(conn)
            raise

        def reply() -> Any:
            try:
                # On a transport error read_response disconnects the connection itself,
                # so it goes back to the pool clean either way.
                return conn.read_response()
            except NoScriptError:
                pass  # that error was the whole reply: the script did not run
            finally:
                pool.release(conn)
            self.load_all(client)
            return client.evalsha(self.shas[name], len(names), *names, *args)

        return reply
