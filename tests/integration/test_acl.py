"""A Redis ACL user confined to its deployment's key prefix: the channel patterns Celery's
remote control and events subscribe to must be granted as written; a worker lacking
them stops at start in one line naming the grants, and runs once they are given."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from sits_queue.app import make_app
from sits_queue.broker import grants
from sits_queue.config import SitsConfig
from sits_queue.embedded import EmbeddedRedis
from sits_queue.procs import celery_command, start_worker, wait_ready
from tests.integration.conftest import APP_MODULE, ROOT, refusal, worker_env
from tests.integration.worker_app import register

PREFIX = "tenant-a:"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A Redis of the test's own: its ACL users are changed."""
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


def user_url(server: EmbeddedRedis, *channel_grants: str) -> str:
    """A user with the keys and channels under PREFIX (the usual confinement), and
    ``channel_grants`` more; its URL."""
    admin = redis.Redis.from_url(server.url)
    admin.acl_setuser("tenant", enabled=True, passwords=["+tenant-pw"], reset=True,
                      keys=[f"{PREFIX}*"],
                      channels=[f"{PREFIX}*", *channel_grants], commands=["+@all"])
    admin.close()
    return f"redis://tenant:tenant-pw@127.0.0.1:{server.port}/0"


def test_the_patterns_are_as_kombu_subscribes_them() -> None:
    app = make_app(SitsConfig(redis_url="redis://127.0.0.1:1/3", global_keyprefix="p:"),
                   main="acl-unit")
    # (gossip binds "worker.#": kombu subscribes .../celeryev/worker.*, which a grant
    # of .../celeryev/*, Flower's, does not allow: the pattern is matched as written)
    assert grants.fanout_patterns(app) == ["p:/3.celery.pidbox", "p:/3.celeryev/worker.*"]
    assert grants.fanout_patterns(app, gossip=False) == ["p:/3.celery.pidbox"]
    app.close()


def test_a_worker_lacking_the_pattern_grants_says_which_in_one_line(
        server: EmbeddedRedis, tmp_path: Path) -> None:
    # (it died on its first connection: "Unrecoverable error: auth:NoPermissionError",
    # ~50 lines of traceback naming no channel)
    url = user_url(server)
    env = worker_env(url, global_keyprefix=PREFIX)
    # A worker that gossips subscribes to the events' pattern too...
    gossiping = celery_command(APP_MODULE, ["worker", "--loglevel=INFO", "--concurrency=1",
                                            "--without-mingle"],
                               env, tmp_path / "gossiping.log", ROOT)
    log = refusal(gossiping, "a user without the grants")
    assert "may not subscribe to the channel pattern(s) 'tenant-a:/0.celery.pidbox', " \
           "'tenant-a:/0.celeryev/worker.*'" in log
    assert ("ACL SETUSER <user> '&tenant-a:/0.celery.pidbox' "
            "'&tenant-a:/0.celeryev/worker.*'") in log
    # ...one that does not, to the remote control's alone
    log = refusal(start_worker(APP_MODULE, env, tmp_path / "logs", concurrency=1, cwd=ROOT),
                  "a user without the pidbox grant")
    assert "ACL SETUSER <user> '&tenant-a:/0.celery.pidbox'\n" in log


def test_a_worker_given_the_pattern_grants_serves(server: EmbeddedRedis,
                                                  tmp_path: Path) -> None:
    """(the grants the check named, `.../celeryev/*`, were Flower's: a worker given them
    died at its first gossip, "Unrecoverable error: auth:NoPermissionError")"""
    url = user_url(server, f"{PREFIX}/0.celery.pidbox", f"{PREFIX}/0.celeryev/worker.*")
    app = make_app(SitsConfig(redis_url=url, global_keyprefix=PREFIX), main="acl-client")
    register(app)
    env = worker_env(url, global_keyprefix=PREFIX)
    # a worker as `celery worker` starts one: it gossips
    worker = celery_command(APP_MODULE, ["worker", "--loglevel=INFO", "--concurrency=1",
                                         "--hostname=acl-gossip@%h"],
                            env, tmp_path / "gossiping.log", ROOT)
    worker.hostname = f"acl-gossip@{os.uname().nodename}"
    try:
        wait_ready(app, [worker])  # (a remote-control ping: the pidbox pattern works)
        assert app.tasks["w.add"].delay(2, 3).get(timeout=30) == 5
        assert app.tasks["w.add"].delay(3, 4).get(timeout=30) == 7
        assert worker.alive(), worker.log()[-3000:]
        assert "Traceback" not in worker.log() and "Unrecoverable" not in worker.log()
    finally:
        worker.stop(timeout_s=10)
        app.close()
