"""docker-compose.yml and ops/Dockerfile describe a deployable, locked-down stack."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sits_queue.config import SitsConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
APP_SERVICES = ("worker", "beat", "flower")


def _command(service: dict[str, Any]) -> str:
    command = service["command"]
    return command if isinstance(command, str) else " ".join(command)


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load(COMPOSE.read_text())
    result: dict[str, dict[str, Any]] = compose["services"]
    return result


def test_all_services_exist(services: dict[str, dict[str, Any]]) -> None:
    assert {"redis", *APP_SERVICES} <= set(services)


def test_redis_is_durable_password_protected_and_health_checked(
        services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    command = _command(redis)
    assert redis["image"].startswith("redis:7")
    assert "--appendonly yes" in command
    assert "--requirepass ${REDIS_PASSWORD:?" in command
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    assert "ports" not in redis, "Redis must not be published outside the compose network"
    health = " ".join(redis["healthcheck"]["test"])
    assert "redis-cli -a" in health and "ping" in health


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_services_load_the_package_and_wait_for_redis(
        services: dict[str, dict[str, Any]], name: str) -> None:
    service = services[name]
    # the user's task module when SITS_APP names it, sits_queue's own by default
    assert "celery -A ${SITS_APP:-sits_queue} " in _command(service)
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert service["environment"]["SITS_REDIS_URL"] == "redis://:${REDIS_PASSWORD}@redis:6379/0"


def test_worker_beat_flower_run_their_roles(services: dict[str, dict[str, Any]]) -> None:
    assert " worker " in _command(services["worker"]) + " "
    assert " beat " in _command(services["beat"]) + " "
    assert " flower " in _command(services["flower"]) + " "


def test_flower_requires_basic_auth(services: dict[str, dict[str, Any]]) -> None:
    flower = services["flower"]
    assert "--basic-auth=${FLOWER_USER:-admin}:${FLOWER_PASSWORD:?" in _command(flower)
    assert "--port=5555" in _command(flower)
    assert "5555:5555" in flower["ports"]


def test_worker_reserves_all_nvidia_gpus(services: dict[str, dict[str, Any]]) -> None:
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]} in devices


@pytest.mark.parametrize("name", APP_SERVICES)
def test_referenced_dockerfile_exists(services: dict[str, dict[str, Any]], name: str) -> None:
    build = services[name]["build"]
    context = ROOT / build["context"]
    assert (context / build["dockerfile"]).is_file()


def test_dockerfile_is_slim_non_root_and_inference_is_opt_in() -> None:
    text = (ROOT / "ops" / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert "ARG INSTALL_INFERENCE=0" in text
    assert '".[monitor]"' in text and "inference]" in text
    assert "WORKDIR /app" in text
    # built elsewhere and removed: a source copy in /app shadowed the installed package
    assert text.index("rm -rf /src") < text.index("WORKDIR /app")
    copied = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    for names in copied:  # (what pip's build reads: LICENSE is the metadata's licence file)
        for name in names:
            assert list(ROOT.glob(name)), name
    assert "LICENSE" in {n for names in copied for n in names}
    user_lines = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert user_lines and user_lines[-1] not in ("root", "0")


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv"} <= ignored


def test_worker_serves_metrics_on_the_network_only(services: dict[str, dict[str, Any]]) -> None:
    worker = services["worker"]
    port = worker["environment"]["SITS_METRICS_PORT"]
    assert SitsConfig.from_env({"SITS_METRICS_PORT": port}).metrics_port == 9808
    assert worker["expose"] == [port] and "ports" not in worker
