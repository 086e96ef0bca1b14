"""Configuration: every setting holds its declared type, from a file or the environment;
a bad value is refused naming the setting, never taken silently."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from sits_queue.broker.keys import priority_level
from sits_queue.config import SitsConfig, configured_redis_url
from sits_queue.errors import ConfigError, InvalidTaskOptions
from sits_queue.options import resolve
from sits_queue.priority.model import PRIORITY_SCALE

CLASS = {"name": "a", "cpu_cores": 1, "vram_gib": 1, "max_run_s": 1, "weight": 1,
         "latency_sla_ms": 1, "loss_sensitivity": 0.5}


@pytest.mark.parametrize(("variable", "raw", "named"), [
    ("SITS_VISIBILITY_TIMEOUT_S", "nan", "visibility_timeout_s"),
    ("SITS_VISIBILITY_TIMEOUT_S", "inf", "visibility_timeout_s"),
    ("SITS_SOFT_LIMIT_FRACTION", "nan", "soft_limit_fraction"),
    ("SITS_AFFINITY_HOST_WEIGHT", "nan", "affinity_host_weight"),
    ("SITS_SEND_SENT_EVENTS", "ture", "SITS_SEND_SENT_EVENTS"),  # a typo is not "off"
    ("SITS_PLAIN_TASKS_ONLY", "enabled", "SITS_PLAIN_TASKS_ONLY"),
    ("SITS_RESCORE_CHUNK", "2.5", "SITS_RESCORE_CHUNK"),
    ("SITS_REDIS_URL", "redis://127.0.0.1:99999/0", "Port out of range"),
    ("SITS_REDIS_URL", "redis://127.0.0.1:6379/abc", "database 'abc' is not a number"),
    # an option redis-py cannot read (raised at the first connection, a traceback)
    ("SITS_REDIS_URL", "redis://127.0.0.1:6379/0?socket_timeout=5s", "'socket_timeout'"),
    ("SITS_REDIS_URL", "redis://127.0.0.1:6379/0?db=abc", "Invalid value for 'db'"),
    # (redis-py read "off" as true, Celery's backend settings as false)
    ("SITS_REDIS_URL", "redis://127.0.0.1:6379/0?socket_keepalive=off",
     "socket_keepalive must be true or false"),
    ("SITS_REDIS_URL", "redis://127.0.0.1:6379/0?retry_on_timeout=maybe",
     "retry_on_timeout must be true or false"),
    ("SITS_HOST_POOL_TTL_S", "-1", "host_pool_ttl_s must be >= 0"),
    # past a year: a typo, and past ~1e9 s a timedelta or a wait's timeout overflowed
    ("SITS_PREWARM_INTERVAL_S", "1e14", r"prewarm_interval_s must be at most 3.1536e\+07 s"),
    ("SITS_PREWARM_TIME_LIMIT_S", "0", r"prewarm_time_limit_s must be a positive number"),
    ("SITS_VISIBILITY_TIMEOUT_S", "1e300", "visibility_timeout_s must be at most"),
    ("SITS_VISIBILITY_TIMEOUT_S", "2.5", r"must be > 3 s \(heartbeat every third\), got 2.5"),
    ("SITS_HOST_POOL_TTL_S", "inf", "host_pool_ttl_s"),
    ("SITS_DEAD_LETTER_TTL_S", "-5", r"dead_letter_ttl_s must be >= 0 s \(0: kept\)"),
    ("SITS_IDLE_QUEUE_FORGET_S", "-1", r"idle_queue_forget_s must be >= 0 s \(0: kept\)"),
    ("SITS_DEAD_LETTER_TTL_S", "two weeks", "SITS_DEAD_LETTER_TTL_S"),
    ("SITS_HOST_POOL_PRESSURE_SHARE", "1", r"host_pool_pressure_share must be in \[0, 1\)"),
    ("SITS_HOST_POOL_PRESSURE_SHARE", "nan", "host_pool_pressure_share"),
    # an integer past a float's range: float() of it raises OverflowError, and its repr
    # past 4,300 digits raises ValueError; each is a setting refused by name instead
    ("SITS_RESCORE_CHUNK", "9" * 400, r"rescore_chunk must be an integer in \[1, 1000000\], "
                                      "got an integer of 1329 bits"),
    # (past 2^63 Redis refused the ZSCAN count, or the LTRIM bound, at every pass)
    ("SITS_RESCORE_CHUNK", "9" * 20, r"rescore_chunk must be an integer in \[1, 1000000\]"),
    ("SITS_STATS_WINDOW", "9" * 20, "stats_window must be an integer in"),
    ("SITS_MAX_REDELIVERIES", "0", "max_redeliveries must be an integer in"),
    # bytes that are no UTF-8 reach os.environ as surrogates (a key prefix of them failed
    # at the first Redis call)
    ("SITS_GLOBAL_KEYPREFIX", "\udcff", "SITS_GLOBAL_KEYPREFIX='\\\\udcff' is not valid UTF-8"),
    # URLs that passed the check and failed at the first connection, as tracebacks
    ("SITS_REDIS_URL", "redis://[::1:6421/0", "Invalid IPv6 URL"),
    ("SITS_REDIS_URL", "unix://", r"no socket path \(unix:///path/to/redis.sock\)"),
    ("SITS_REDIS_URL", "redis://h:1/0?foo=bar", "no query option 'foo' for a redis://"),
    ("SITS_REDIS_URL", "redis://h:1/0?ssl_cert_reqs=none", "no query option 'ssl_cert_reqs'"),
    ("SITS_REDIS_URL", "redis://h/0?socket_timeout=-1", "socket_timeout must be > 0 s"),
    # kombu reads it from the URL itself: every producer failed with a raw TypeError
    # ("multiple values for keyword argument 'password'"); the password shown masked
    ("SITS_REDIS_URL", "redis://h/0?password=s3cret", r"'redis://h/0\?password=\*\*\*': "
                                                      "password cannot be a query option"),
    ("SITS_REDIS_URL", "redis://h/0?socket_connect_timeout=nan", "socket_connect_timeout"),
    ("SITS_REDIS_URL", "redis://h/0?health_check_interval=-2", "health_check_interval must"),
    ("SITS_REDIS_URL", "redis://\udcff:1/0", "is not valid UTF-8"),
    ("SITS_REDIS_URL", "redis://:secret@h/0?protocol=9", r"'redis://\*\*\*@h/0\?protocol=9': "
                                                        "protocol must be either 2 or 3"),
    ("SITS_RESCORE_INTERVAL_S", "9" * 400, "rescore_interval_s must be a finite number"),
    ("SITS_BATCH_TIME_SHARE", "9" * 400, "batch_time_share must be a finite number"),
    ("SITS_METRICS_PORT", "9" * 5000, r"SITS_METRICS_PORT='9{40}'\.\.\. \(5000 characters\) "
                                      "is not a valid int"),
    ("SITS_METRICS_PORT", "9" * 30, r"metrics_port must be an integer in \[0, 65535\]"),
    ("SITS_SLICE_MS", "-1", r"slice_ms must be in \[0, 3600000\) ms, got -1"),
    ("SITS_BATCH_JOIN_S", "0", r"batch_join_s must be in \(0, 86400\) s, got 0"),
])
def test_bad_environment_values_are_refused_by_name(variable: str, raw: str,
                                                    named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        SitsConfig.from_env({variable: raw})


@pytest.mark.parametrize("word", ["1", "true", "Yes", "on", "0", "false", "no", "OFF", ""])
def test_boolean_words(word: str) -> None:
    value = SitsConfig.from_env({"SITS_SEND_SENT_EVENTS": word}).send_sent_events
    assert value is (word.lower() in ("1", "true", "yes", "on"))


@pytest.mark.parametrize(("settings", "named"), [
    ({"rescore_chunk": 2.5}, "rescore_chunk must be an integer"),  # Redis refuses it later
    ({"stats_window": 100.5}, "stats_window must be an integer"),
    ({"max_redeliveries": 1.5}, "max_redeliveries"),
    ({"rescore_chunk": True}, "rescore_chunk"),
    ({"send_sent_events": "no"}, "send_sent_events must be true or false"),  # truthy str
    ({"visibility_timeout_s": "90"}, "visibility_timeout_s must be a finite number"),
    ({"redis_url": 5}, "redis_url must be a string"),
    ({"classes": [{**CLASS, "cpu_cores": 2.5}], "default_class": "a"}, "class 'a': cpu_cores"),
    ({"classes": [{**CLASS, "cpu_cores": True}], "default_class": "a"}, "cpu_cores"),
    ({"weights": {"risk_cap": True}}, "risk_cap"),
    ({"classes": 5}, "classes must be a list of"),
    ({"classes": [{"name": "low", "slice_ms": -1.0}], "default_class": "low"},
     r"class low: slice_ms must be in \[0, 3600000\) ms"),
    ({"classes": [{"name": "low", "slice_ms": 1e12}], "default_class": "low"},
     r"class low: slice_ms must be in \[0, 3600000\) ms \(0: the global slice_ms\)"),
    ({"classes": [{"name": "low", "slice_ms": "5"}], "default_class": "low"},
     "class 'low': slice_ms must be a finite number"),
    ({"weights": {"qos_gain": "x"}}, "qos_gain"),
    ({"classes": [{"name": "low", "bogus": 1}], "default_class": "low"},
     r"class 'low': unknown settings \['bogus'\]; known: \[.*'slice_ms'"),
    ({"weights": {"bogus": 1}}, r"weights: unknown settings \['bogus'\]"),
    ({"weights": 3}, "weights must be a \\[weights\\] table"),
])
def test_bad_file_values_are_refused_by_name(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        SitsConfig.from_mapping(settings)


def test_a_file_integer_does_not_narrow_what_the_environment_may_set(tmp_path: Path) -> None:
    site = tmp_path / "site.toml"
    site.write_text("visibility_timeout_s = 60\nrescore_interval_s = 5\n")
    config = SitsConfig.from_env({"SITS_CONFIG": str(site), "SITS_VISIBILITY_TIMEOUT_S": "90.5",
                                  "SITS_RESCORE_INTERVAL_S": "2.5"})
    assert (config.visibility_timeout_s, config.rescore_interval_s) == (90.5, 2.5)
    assert SitsConfig.from_file(site).visibility_timeout_s == 60  # an int is a number


def test_the_environment_can_make_whole_a_file_invalid_on_its_own(tmp_path: Path) -> None:
    """(the file was built and checked alone, before the variables on top of it)"""
    two = tmp_path / "two.toml"
    two.write_text('[[classes]]\nname = "high"\n[[classes]]\nname = "low"\n')
    with pytest.raises(ConfigError, match="default_class"):
        SitsConfig.from_env({"SITS_CONFIG": str(two)})
    assert SitsConfig.from_env({"SITS_CONFIG": str(two),
                                "SITS_DEFAULT_CLASS": "low"}).default_class == "low"
    sync = tmp_path / "sync.toml"
    sync.write_text("site_sync_interval_s = 20\n")
    config = SitsConfig.from_env({"SITS_CONFIG": str(sync), "SITS_SITE_DEAD_AFTER_S": "60"})
    assert (config.site_sync_interval_s, config.site_dead_after_s) == (20, 60)
    # what stays wrong together names the file and the variable
    with pytest.raises(ConfigError, match=r"sync\.toml.*SITS_SITE_DEAD_AFTER_S"):
        SitsConfig.from_env({"SITS_CONFIG": str(sync), "SITS_SITE_DEAD_AFTER_S": "35"})


def test_the_configured_redis_is_the_environments_then_the_files(tmp_path: Path) -> None:
    site = tmp_path / "site.toml"
    site.write_text('redis_url = "redis://db:6380/1"\n')
    assert configured_redis_url({}) is None
    assert configured_redis_url({"SITS_CONFIG": str(site)}) == "redis://db:6380/1"
    assert configured_redis_url({"SITS_CONFIG": str(site),
                                 "SITS_REDIS_URL": "redis://other:1/0"}) == "redis://other:1/0"
    plain = tmp_path / "plain.toml"
    plain.write_text("rescore_chunk = 64\n")
    assert configured_redis_url({"SITS_CONFIG": str(plain)}) is None
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        configured_redis_url({"SITS_CONFIG": str(tmp_path / "missing.toml")})


def test_a_task_may_not_declare_more_vram_than_its_class_allows() -> None:
    config = SitsConfig()
    low = config.quota("low").vram_gib
    assert resolve(config, {}, {"sla_class": "low", "vram_gib": low}).vram_gib == low
    with pytest.raises(InvalidTaskOptions, match="exceeds the 'low' class's limit"):
        resolve(config, {}, {"sla_class": "low", "vram_gib": low + 1})


README_TOML = '''
default_class = "medium"
[weights]
aging_start_s = 20
[[classes]]          # a default class: only what changes
name = "high"
vram_gib = 40
[[classes]]
name = "medium"
[[classes]]          # a new class: every field
name = "batch"
cpu_cores = 2
vram_gib = 4
max_run_s = 600
weight = 0.5
latency_sla_ms = 60000
loss_sensitivity = 0.1
'''


def test_a_class_named_like_a_default_gives_only_what_it_changes(tmp_path: Path) -> None:
    site = tmp_path / "site.toml"
    site.write_text(README_TOML)
    config = SitsConfig.from_file(site)
    assert config.class_names == ("high", "medium", "batch")  # the list is the set
    high, default_high = config.quota("high"), SitsConfig().quota("high")
    assert high.vram_gib == 40 and high.max_run_s == default_high.max_run_s
    assert config.quota("medium") == SitsConfig().quota("medium")
    assert config.quota("batch").max_run_s == 600


def test_a_new_class_must_give_every_field_and_errors_name_the_file(tmp_path: Path) -> None:
    site = tmp_path / "site.toml"
    site.write_text('default_class = "a"\n[[classes]]\nname = "a"\nweight = 1\n')
    with pytest.raises(ConfigError, match=r"site\.toml: class 'a' is not a default class.*"
                                          r"missing \['cpu_cores'"):
        SitsConfig.from_file(site)
    site.write_text('slice_ms = "ten"\n')
    with pytest.raises(ConfigError, match=r"site\.toml: slice_ms"):
        SitsConfig.from_file(site)
    site.write_text('[[classes]]\nname = "high"\n')
    with pytest.raises(ConfigError, match=r"default_class 'medium' is not one of \['high'\] "
                                          r"\(a \[\[classes\]\] list is the whole set"):
        SitsConfig.from_file(site)
    site.write_text('default_class = "high"\nclasses = ["high"]\n')
    with pytest.raises(ConfigError, match="must be a table"):
        SitsConfig.from_file(site)


def test_a_host_no_resolver_takes_is_refused_as_sitsq_reads_the_url() -> None:
    with pytest.raises(ConfigError, match="idna"):
        configured_redis_url({"SITS_REDIS_URL": "redis://\udcff:1/0"})


def test_an_empty_redis_url_is_unset_as_sitsq_reads_it() -> None:
    """(and a blank one, and spaces around one: ``sitsq redis-url`` trimmed them, while
    workers and ``sitsq status`` refused " redis://...", and " " started the embedded
    server for one and was refused by the other)"""
    for blank in ("", " ", "\t\n"):
        assert SitsConfig.from_env({"SITS_REDIS_URL": blank}).redis_url \
            == SitsConfig().redis_url
        assert configured_redis_url({"SITS_REDIS_URL": blank}) is None
    spaced = {"SITS_REDIS_URL": " redis://db:6380/1\n"}
    assert SitsConfig.from_env(spaced).redis_url == configured_redis_url(spaced) \
        == "redis://db:6380/1"


def test_a_config_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file .* cannot be read"):
        SitsConfig.from_file(tmp_path)  # a directory
    latin = tmp_path / "latin.toml"
    latin.write_bytes('site = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin\.toml cannot be read"):
        SitsConfig.from_file(latin)


def test_a_class_sla_a_task_could_not_declare_is_refused_at_start(tmp_path: Path) -> None:
    """(a two-day SLA loaded fine, then every task of the class was refused at submit)"""
    site = tmp_path / "site.toml"
    site.write_text('[[classes]]\nname = "high"\nlatency_sla_ms = 172800000\n')
    with pytest.raises(ConfigError, match=r"class high: latency_sla_ms must be in "
                                          r"\[0.001, 86400000\], got 172800000"):
        SitsConfig.from_file(site)
    day = SitsConfig.from_mapping({"classes": [{**CLASS, "latency_sla_ms": 86_400_000}],
                                   "default_class": "a"})
    assert resolve(day, {}, {}).latency_sla_ms == 86_400_000


def test_class_weights_past_what_a_queue_score_orders_are_refused() -> None:
    """(priorities past the score's ceiling are one level, first come first served: with
    weights of 200000 and 100000 a critical task queued after a high one ran after it)"""
    big = ({**CLASS, "name": "critical", "weight": 200_000},
           {**CLASS, "name": "high", "weight": 100_000})
    with pytest.raises(ConfigError, match=r"class weights up to 200000 make priorities up "
                                          r"to 3\.6e\+08, past what a queue score orders"):
        SitsConfig.from_mapping({"classes": list(big), "default_class": "high"})
    # the same ratio, scaled down, is the same order
    scaled = SitsConfig.from_mapping({"classes": [{**c, "weight": c["weight"] / 1000}
                                                  for c in big], "default_class": "high"})
    assert [c.weight for c in scaled.classes] == [200, 100]


def test_class_weights_under_what_a_queue_score_tells_apart_are_refused() -> None:
    """(weights of 1e-12 .. 1e-14 were taken, and every priority was level 0: a high task
    queued after a low one ran after it)"""
    tiny = [{**CLASS, "name": name, "weight": weight}
            for name, weight in (("high", 1e-12), ("medium", 1e-13), ("low", 1e-14))]
    with pytest.raises(ConfigError, match=r"class weights down to 1e-14 make priorities "
                                          r"from 1e-12, under what a queue score tells "
                                          r"apart \(0\.01\): scale the weights up"):
        SitsConfig.from_mapping({"classes": tiny, "default_class": "high"})
    # the same ratios at the floor hold their order: each class its own levels
    floor = SitsConfig.from_mapping({"classes": [{**c, "weight": c["weight"] * 1e10}
                                                 for c in tiny], "default_class": "high"})
    levels = [priority_level(c.weight * PRIORITY_SCALE) for c in floor.classes]
    assert levels[0] > levels[1] > levels[2] > 0


def test_a_variable_that_nearly_names_a_setting_is_warned_about(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """(``SITS_VISIBILITY_TIMEOUT=90`` was silently not the 90 s timeout meant)"""
    import sits_queue.envnames

    monkeypatch.setattr(sits_queue.envnames, "_warned", set())  # (once per process)
    with caplog.at_level("WARNING", logger="sits_queue.config"):
        config = SitsConfig.from_env({"SITS_VISIBILITY_TIMEOUT": "90",
                                      "SITS_BENCH_SYSTEM": "sits", "SITS_CONFIG": "",
                                      "SITS_DEVICE_CACHE_BYTE": "1GiB",
                                      "SITS_HOST_CACHE_BYTES": "2GiB",
                                      # (settings no variable sets: ignored unsaid)
                                      "SITS_CLASSES": "high,low", "SITS_WEIGHTS": "1"})
    assert config.visibility_timeout_s == SitsConfig().visibility_timeout_s
    # (the cache sizes, read by the worker's children, are settings too)
    assert [r.getMessage() for r in caplog.records] == [
        "SITS_CLASSES is ignored: the [[classes]] table is set in the SITS_CONFIG file "
        "(TOML)",
        "SITS_DEVICE_CACHE_BYTE is no SITS setting and is ignored; did you mean "
        "SITS_DEVICE_CACHE_BYTES?",
        "SITS_VISIBILITY_TIMEOUT is no SITS setting and is ignored; did you mean "
        "SITS_VISIBILITY_TIMEOUT_S?",
        "SITS_WEIGHTS is ignored: the [weights] table is set in the SITS_CONFIG file "
        "(TOML)"]


@pytest.mark.parametrize(("name", "meant"), [
    # (difflib named the seconds setting, which refuses "on"; and a unit word missing
    # or another was not warned about at all)
    ("SITS_BATCH_JOINS", "SITS_BATCH_JOIN or SITS_BATCH_JOIN_S"),
    ("SITS_HOST_CACHE", "SITS_HOST_CACHE_BYTES"),
    ("SITS_HOST_CACHE_SIZE", "SITS_HOST_CACHE_BYTES"),
    ("SITS_DEVICE_CACHE_SIZE", "SITS_DEVICE_CACHE_BYTES"),
    ("SITS_REDIS_ULR", "SITS_REDIS_URL"),  # two letters swapped: one edit
    ("SITS_METRIC_PORT", "SITS_METRICS_PORT"),
    ("SITS_SLICE", "SITS_SLICE_MS"),  # (it was "did you mean SITS_SITE?")
    ("SITS_SLICE_SECONDS", "SITS_SLICE_MS"),
])
def test_a_near_miss_names_every_setting_as_near(
        name: str, meant: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sits_queue.envnames

    monkeypatch.setattr(sits_queue.envnames, "_warned", set())
    with caplog.at_level("WARNING", logger="sits_queue.config"):
        SitsConfig.from_env({name: "on"})
    assert [r.getMessage() for r in caplog.records] == [
        f"{name} is no SITS setting and is ignored; did you mean {meant}?"]


def test_variables_far_from_every_setting_are_not_warned_about(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import sits_queue.envnames

    monkeypatch.setattr(sits_queue.envnames, "_warned", set())
    ours = ["SITS_BENCH_SYSTEM", "SITS_CLASS", "SITS_TASK", "SITS_SYSTEMS", "SITS_EXIT_WITH",
            "SITS_COLDSTART_BUDGET_BYTES", "SITS_TEST_SLOW_FORWARD_S", "SITS_GEN_TASK"]
    with caplog.at_level("WARNING", logger="sits_queue.config"):
        SitsConfig.from_env(dict.fromkeys(ours, "x"))
    assert caplog.records == []


def test_the_transport_options_carry_the_config_without_its_credentials() -> None:
    """(Celery sends the transport options whole in ``inspect stats``: Flower's worker page
    showed the Redis password and the peers')"""
    import json

    from sits_queue.settings import config_from_options, sits_transport_options

    config = SitsConfig(redis_url="redis://:hunter2@10.0.0.1:6380/1", site="a",
                        site_peers="b=redis://ops:s3cret@10.0.0.2:6379/0?hops=2")
    shared = sits_transport_options(config)["sits_config"]
    text = json.dumps(shared)
    assert "hunter2" not in text and "s3cret" not in text and "ops:" not in text
    assert shared["redis_url"] == "redis://***@10.0.0.1:6380/1"
    assert shared["site_peers"] == "b=redis://***@10.0.0.2:6379/0?hops=2"
    # This process puts them back; a reference it does not hold leaves them masked
    assert config_from_options(shared, "options") == config
    foreign = config_from_options({**shared, "credentials": "elsewhere"}, "options")
    assert foreign.redis_url == "redis://***@10.0.0.1:6380/1"


@pytest.mark.parametrize("value, shown", [
    ("redis://:p@ss@h:1/0", "redis://***@h:1/0"),
    # (a raw space in a password, which redis-py takes, kept it in clear)
    ("redis://spacey:Pw0rd LEAK@h:1/0", "redis://***@h:1/0"),
    ("cannot reach redis://u:a b@h:1/0: refused", "cannot reach redis://***@h:1/0: refused"),
    ({"u": ["a=rediss://u:pw@h/0 b=unix://:x@/tmp/s.sock"]},
     {"u": ["a=rediss://***@h/0 b=unix://***@/tmp/s.sock"]}),
    ("redis://h:1/0 and no credentials", "redis://h:1/0 and no credentials"),
    (("amqp://guest:guest@rabbit//", 5), ["amqp://***@rabbit//", 5]),
    # An "@" in a path (a socket's name) is no credential
    ("unix:///run/redis@main.sock?db=1", "unix:///run/redis@main.sock?db=1"),
    ("redis://h:1/0?db=1&password=pw&x=1", "redis://h:1/0?db=1&password=***&x=1"),
])
def test_credentials_are_masked_in_every_url(value: object, shown: object) -> None:
    from sits_queue.config import redacted, without_credentials

    assert without_credentials(value) == shown
    if isinstance(value, str):  # messages and logs mask the same way
        assert redacted(value) == shown


@pytest.mark.parametrize("env, said", [
    ({"SITS_SOFT_LIMIT_FRACTION": "2"},
     r"soft_limit_fraction must be in \(0, 1\), got 2.0 \(set by SITS_SOFT_LIMIT_FRACTION\)$"),
    ({"SITS_SITE": "a", "SITS_SITE_PEERS": "b=redis://h/0", "SITS_SITE_SYNC_INTERVAL_S": "20"},
     r"site_dead_after_s \(30 s\) must exceed two site_sync_interval_s \(20 s\).*"
     r"\(set by SITS_SITE_SYNC_INTERVAL_S\)$"),
])
def test_a_value_out_of_range_names_the_variable_that_set_it(env: dict[str, str],
                                                             said: str) -> None:
    """(it named the field alone, or only the other setting of the two it compares)"""
    with pytest.raises(ConfigError, match=said):
        SitsConfig.from_env(env)


@pytest.mark.parametrize("prefix", ["dep?:", "a*:", "a[b]:", "back\\slash:", "x{y}:", "a b:",
                                    "tab\t:", "nul\x00:"])
def test_a_key_prefix_channels_or_hash_tags_would_misread_is_refused(prefix: str) -> None:
    """(kombu subscribes to the remote control's channel by pattern, the prefix unescaped:
    "dep?:" heard the broadcasts of "depB:", its shutdown included)"""
    with pytest.raises(ConfigError, match=r"global_keyprefix .* must not contain"):
        SitsConfig(global_keyprefix=prefix)
    with pytest.raises(ConfigError, match=r"site_peers entry 'b': prefix .* must not contain"):
        SitsConfig(site="a", site_peers=f"b=redis://h:1/0?prefix={quote(prefix)}")


@pytest.mark.parametrize("prefix", ["", "a:", "tenant-a:", "sits-demo:", "team.one/x:"])
def test_an_ordinary_key_prefix_is_taken(prefix: str) -> None:
    assert SitsConfig(global_keyprefix=prefix).global_keyprefix == prefix


@pytest.mark.parametrize(("raw", "said"), [
    ("inf", "must be a finite number of bytes"), ("-1GiB", "must be a finite number"),
    ("99999999999999999999999999GiB", r"is too large: at most 8 EiB"),
    ("lots", "is not a number of bytes"),
    # (1.5 and 0.5 were budgets of 1 byte and none: a unit forgotten)
    ("1.5", "is a fraction of a byte: give a unit"), ("0.5b", "is a fraction of a byte")])
def test_a_cache_size_out_of_range_says_which_way(raw: str, said: str) -> None:
    """(a size past 8 EiB was called not finite)"""
    from sits_queue.cache.budgets import parse_bytes

    with pytest.raises(ConfigError, match=rf"SITS_DEVICE_CACHE_BYTES=.*{said}"):
        parse_bytes("SITS_DEVICE_CACHE_BYTES", raw)


def test_a_missing_inference_module_is_named_with_its_install_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(a worker without the inference extra failed its inference tasks with "No module
    named 'torch'", and the tiny-model builder alike)"""
    import sys

    from sits_queue.errors import ModelLoadError, missing_extra
    from sits_queue.models.tiny import build_tiny_causal_lm
    from sits_queue.registry import ModelRegistry, load_engine

    hint = "pip install 'sits-queue[inference]'"
    assert missing_extra(ModuleNotFoundError("x", name="torch.cuda")) == hint
    assert missing_extra(ModuleNotFoundError("x", name="yaml")) is None
    assert missing_extra(ImportError("x", name="torch")) is None
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModuleNotFoundError, match=r"building a tiny model needs the "
                                                  r"inference extra: pip install"):
        build_tiny_causal_lm(tmp_path / "lm")
    registry = ModelRegistry()
    spec = registry.register("lm", lambda: __import__("transformers"))
    with pytest.raises(ModelLoadError, match=r"loader for model 'lm' failed: "
                                             r"ModuleNotFoundError: .*\(the inference extra: "
                                             r"pip install 'sits-queue\[inference\]'\)"):
        load_engine(spec, "cpu")
