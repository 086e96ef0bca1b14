"""``broker_transport_options`` set the usual Celery way keeps what the SITS config
decides: its classes and key prefix reach every channel, and an option that would
contradict it is refused naming the setting to change."""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis

from sits_queue.app import make_app
from sits_queue.config import ClassQuota, ConfigError, SitsConfig

URGENT = ClassQuota("urgent", cpu_cores=1, vram_gib=1, max_run_s=5, weight=500,
                    latency_sla_ms=50, loss_sensitivity=0.9)


def config(redis_url: str) -> SitsConfig:
    base = SitsConfig(redis_url=redis_url)
    return replace(base, classes=(*base.classes, URGENT), global_keyprefix="pfx:",
                   visibility_timeout_s=90.0)


def test_replaced_transport_options_keep_the_sits_config(
        redis_url: str, redis_client: redis.Redis) -> None:
    app = make_app(config(redis_url), main="options-replaced")
    app.conf.broker_transport_options = {"socket_timeout": 7, "visibility_timeout": 90}
    try:
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            assert "urgent" in channel.config.class_names
            assert channel.global_keyprefix == "pfx:"
            assert conn.transport_options["socket_timeout"] == 7
        # and a task of that class is put under the prefix, where the worker looks
        app.send_task("t.any", sla_class="urgent")
        assert redis_client.zcard("pfx:sits:{celery}:z") == 1
        assert not redis_client.exists("sits:{celery}:z")
    finally:
        app.close()


@pytest.mark.parametrize(("option", "value", "setting"), [
    ("global_keyprefix", "other:", "SITS_GLOBAL_KEYPREFIX"),
    ("visibility_timeout", 3600, "SITS_VISIBILITY_TIMEOUT_S"),
])
def test_an_option_the_sits_config_decides_is_refused_naming_its_setting(
        redis_url: str, option: str, value: object, setting: str) -> None:
    app = make_app(config(redis_url), main="options-conflict")
    app.conf.broker_transport_options = {option: value}
    try:
        with pytest.raises(ConfigError, match=f"{option}=.*set {setting} instead"):
            app.connection_for_write()
    finally:
        app.close()
