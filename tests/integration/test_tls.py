"""A Redis that speaks TLS only (``rediss://``): a worker, the beat and ``sitsq`` all work
through it, and a URL that cannot verify it fails naming why.

The server is the system's ``redis-server`` with its TLS port alone open, a certificate
signed by a CA the test makes with ``openssl``; skipped where either lacks TLS.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from sits_queue import embedded
from sits_queue.app import make_app
from sits_queue.broker.keys import stats_key
from sits_queue.config import SitsConfig
from sits_queue.errors import ConfigError
from sits_queue.procs import start_beat, start_worker, wait_ready
from tests.integration.conftest import APP_MODULE, ROOT, worker_env
from tests.integration.worker_app import register
from tests.waiting import wait_for

PASSWORD = "tls-pw"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certs(d: Path) -> None:
    """A CA, and a server certificate it signs for 127.0.0.1; another CA that signs
    nothing of this server's."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
             "-out", "ca.pem", "-days", "2", "-subj", "/CN=sits-test-ca", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
             "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf",
             cwd=d)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key",
             "-out", "other.pem", "-days", "2", "-subj", "/CN=another-ca", cwd=d)


def _url(port: int, ca: Path) -> str:
    return (f"rediss://:{PASSWORD}@127.0.0.1:{port}/0"
            f"?ssl_cert_reqs=required&ssl_ca_certs={quote(str(ca))}")


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """(the TLS port, the directory with ``ca.pem`` and ``other.pem``)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make the test's certificates")
    d = tmp_path_factory.mktemp("tls")
    _make_certs(d)
    port = embedded._free_port()
    (d / "redis.conf").write_text("\n".join([
        "port 0", f"tls-port {port}", "bind 127.0.0.1",
        f"tls-cert-file {d / 'server.pem'}", f"tls-key-file {d / 'server.key'}",
        f"tls-ca-cert-file {d / 'ca.pem'}", "tls-auth-clients no",
        f'requirepass "{PASSWORD}"', 'save ""', "appendonly no", ""]))
    proc = subprocess.Popen([embedded.find_redis_server(), str(d / "redis.conf")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    client = redis.Redis.from_url(_url(port, d / "ca.pem"))
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:  # (a build without TLS refuses tls-port)
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                pytest.skip(f"this redis-server cannot serve TLS: {out[-300:]}")
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield port, d
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def test_a_worker_and_the_beat_work_through_tls(tls: tuple[int, Path],
                                                 tmp_path: Path) -> None:
    port, d = tls
    url = _url(port, d / "ca.pem")
    app = make_app(SitsConfig(redis_url=url), main="tls-client")
    register(app)
    env = worker_env(url, rescore_interval_s="1", trigger_check_interval_s="1",
                     prewarm_interval_s="0")
    worker = start_worker(APP_MODULE, env, tmp_path / "logs", concurrency=1, cwd=ROOT)
    beat = start_beat(APP_MODULE, env, tmp_path / "logs", cwd=ROOT)
    client = redis.Redis.from_url(url)
    try:
        wait_ready(app, [worker])
        # A task there and back (the sorted-set queue, the result backend), and one that
        # steps with yield points (their pub/sub subscription is a connection of its own)
        assert app.tasks["w.add"].delay(2, 3).get(timeout=30) == 5
        assert app.tasks["w.steps"].delay("tls", 3, 0.01).get(timeout=30) is not None
        # The beat's rescoring pass ran, through the worker, and left its snapshot
        wait_for(lambda: client.exists(stats_key()) == 1, 60, "a rescoring pass over TLS")
        out = subprocess.run([str(Path(ROOT) / ".venv" / "bin" / "sitsq"), "status"],
                             env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert f"{worker.hostname}: pid {worker.pid}" in out.stdout
        assert beat.alive(), beat.log()[-3000:]
        for proc in (worker, beat):
            assert "Traceback" not in proc.log(), proc.log()[-3000:]
    finally:
        beat.stop(timeout_s=10)
        worker.stop(timeout_s=10)
        client.close()
        app.close()


def test_a_url_that_cannot_verify_the_server_names_why(tls: tuple[int, Path]) -> None:
    port, d = tls
    # A CA that did not sign the server's certificate: the TLS verdict, not a hang
    app = make_app(SitsConfig(redis_url=_url(port, d / "other.pem")), main="tls-wrong")
    try:
        with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            redis.Redis.from_url(app.sits.redis_url).ping()
    finally:
        app.close()


@pytest.mark.parametrize("option", ["ssl_ca_certs", "ssl_certfile", "ssl_keyfile"])
def test_a_tls_file_that_is_not_there_is_refused_naming_it(tmp_path: Path,
                                                           option: str) -> None:
    # (redis-py said "Error 2 connecting to 127.0.0.1:6380. No such file or directory"
    # at the first connection, naming no file)
    missing = tmp_path / "gone.pem"
    url = f"rediss://127.0.0.1:6380/0?ssl_cert_reqs=required&{option}={quote(str(missing))}"
    with pytest.raises(ConfigError, match=re.escape(f"{option} {missing} does not exist")):
        SitsConfig(redis_url=url)
