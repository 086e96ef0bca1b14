"""Fixtures shared by every test: a real Redis for the session, and the GPU gate."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from kombu import pools

from sits_queue.embedded import EmbeddedRedis
from sits_queue.errors import SitsError

GPU_SKIP_REASON = "no NVIDIA GPU visible (nvidia-smi/NVML)"


def _nvml_device_count() -> int:
    """GPUs NVML sees. NVML, not torch: importing torch here would start CUDA in pytest."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # missing library, no driver, no device: all mean "no usable GPU"
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or _nvml_device_count() > 0:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A private redis-server on a free port (never 6379), system binary preferred.

    Fails rather than skips when none can start: a silently skipped integration suite
    would pass CI while testing nothing.
    """
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
    except SitsError as exc:
        pytest.fail(f"cannot start a Redis server for the tests: {exc}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client on the session server, emptied first so tests do not see each other's keys."""
    client = redis.Redis.from_url(redis_url)
    # kombu pools connections (and their channels' state) process-wide; a test that
    # starts from an empty Redis must not inherit a channel that "knows" old keys.
    pools.reset()
    client.flushall()
    yield client
    client.close()
