"""Topology-aware priority sync between sites (MISSION §2.3): the pure policy."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sits_queue.config import ConfigError, SitsConfig
from sits_queue.priority.sites import (
    Link,
    Peer,
    SyncMode,
    Tier,
    decide,
    decode_choice,
    digest,
    encode_choice,
    link_weight,
    other_live_peers,
    parse_peers,
    plan,
    replica_link,
    tiers,
    without_strong,
)

WEIGHTS = {"high": 100.0, "medium": 10.0, "low": 1.0}


def test_link_weight_is_the_sources_formula() -> None:
    assert link_weight(2.0, 3) == pytest.approx(1 / (0.7 * 2 + 0.3 * 3))
    assert link_weight(0.0, 0) == math.inf
    assert link_weight(1.0, 1) > link_weight(10.0, 1) > link_weight(10.0, 5)


def test_tiers_follow_class_weights() -> None:
    assert tiers(WEIGHTS) == {"high": Tier.P0, "medium": Tier.P1, "low": Tier.P2}
    assert tiers({"only": 5.0}) == {"only": Tier.P0}


@pytest.mark.parametrize(("tier", "rtt", "mode"), [
    (Tier.P0, 1.0, SyncMode.STRONG), (Tier.P0, 5.0, SyncMode.STRONG),
    (Tier.P0, 5.1, SyncMode.ASYNC_DIGEST),
    (Tier.P1, 1.0, SyncMode.ASYNC_DIGEST), (Tier.P1, 50.0, SyncMode.ASYNC_DIGEST),
    (Tier.P2, 1.0, SyncMode.EVENTUAL), (Tier.P2, 5.1, SyncMode.SKIP),
])
def test_the_decision_table(tier: Tier, rtt: float, mode: SyncMode) -> None:
    assert decide(tier, rtt) is mode


def test_the_replica_goes_to_the_nearest_live_peer() -> None:
    near, far, dead = (Link(Peer("b", "redis://b"), 2.0), Link(Peer("c", "redis://c"), 30.0),
                       Link(Peer("a", "redis://a"), 0.1, alive=False))
    assert replica_link([far, dead, near]) is near
    assert replica_link([dead]) is None
    # hops count too: 3 ms over 1 hop beats 1 ms over 20
    assert replica_link([Link(Peer("x", "u", hops=20), 1.0),
                         Link(Peer("y", "u", hops=1), 3.0)]).peer.name == "y"


def test_a_plan_gives_each_class_its_mode_toward_the_replica() -> None:
    near = plan(WEIGHTS, [Link(Peer("b", "redis://b"), 1.0)])
    assert dict(near.modes) == {"high": SyncMode.STRONG, "medium": SyncMode.ASYNC_DIGEST,
                                "low": SyncMode.EVENTUAL}
    far = plan(WEIGHTS, [Link(Peer("b", "redis://b"), 40.0)])
    assert far.mode("high") is SyncMode.ASYNC_DIGEST and far.mode("low") is SyncMode.SKIP
    assert far.classes(SyncMode.ASYNC_DIGEST) == ("high", "medium")
    alone = plan(WEIGHTS, [])
    assert alone.link is None and alone.mode("high") is SyncMode.SKIP


def test_a_peer_whose_strong_write_failed_gets_the_top_class_asynchronously() -> None:
    near = plan(WEIGHTS, [Link(Peer("b", "redis://b"), 1.0)])
    backed_off = without_strong(near)
    assert backed_off.link == near.link
    assert dict(backed_off.modes) == {"high": SyncMode.ASYNC_DIGEST,
                                      "medium": SyncMode.ASYNC_DIGEST,
                                      "low": SyncMode.EVENTUAL}
    # still digest-checked: the pass repairs what the outbox would miss
    assert "high" in backed_off.classes(SyncMode.ASYNC_DIGEST)


def test_live_peers_other_than_the_replica_peer_are_the_ones_to_clean_up() -> None:
    b, c, d = (Link(Peer(n, f"redis://{n}"), rtt, alive) for n, rtt, alive in
               (("b", 1.0, True), ("c", 2.0, True), ("d", 0.5, False)))
    # b keeps the replica; c may still hold some (an earlier choice); d is down
    assert other_live_peers([c, d, b], plan(WEIGHTS, [b, c, d])) == ("c",)
    assert other_live_peers([d], plan(WEIGHTS, [d])) == ()


@pytest.mark.parametrize(("raw", "expected"), [
    (encode_choice(Link(Peer("b", "redis://b", 2), 1.5)), [("b", 1.5)]),
    (encode_choice(None), []),  # the pass found no live peer
    ('{"peer": "zz", "rtt_ms": 1}', None),  # unknown here: measure instead
    ('{"peer": "b", "rtt_ms": "nan"}', None), ("not json", None), ('{"peer": "b"}', None),
    # (an int past float's range raised OverflowError on every enqueue that read it)
    ('{"peer": "b", "rtt_ms": 1' + "0" * 400 + "}", None),
    ('{"peer": "b", "rtt_ms": Infinity}', None), ('{"peer": "b", "rtt_ms": -1}', None),
    ('["b", 1]', None), ('"b"', None),
])
def test_a_published_choice_is_read_back_or_refused(
        raw: str, expected: list[tuple[str, float]] | None) -> None:
    peers = (Peer("b", "redis://b", 2), Peer("c", "redis://c"))
    links = decode_choice(raw, peers)
    if expected is None:
        assert links is None
    else:
        assert links is not None
        assert [(x.peer.name, x.rtt_ms) for x in links] == expected
        assert all(x.alive and x.peer is peers[0] for x in links)


def test_digest_is_order_independent_and_sees_any_change() -> None:
    assert digest(["a", "b", "c"]) == digest(["c", "a", "b", "a"])
    assert digest(["a", "b"]) != digest(["a", "b", "c"]) != digest(["a", "c", "b", "d"])
    assert digest(["a", "b"]) != digest(["a", "x"])
    assert digest([]) == "0:" + "0" * 32


def test_peers_parse_with_hops_and_a_pinned_rtt() -> None:
    peers = parse_peers("b=redis://h:6379/0?hops=3&rtt_ms=1.5  c=redis://:pw@x:1/2?db=2")
    assert peers[0] == Peer("b", "redis://h:6379/0", 3, 1.5)
    assert peers[1] == Peer("c", "redis://:pw@x:1/2?db=2", 1, None)
    assert parse_peers("") == ()
    # a socket peer keeps its "//" (rebuilt without it, "unix:/run/r.sock" was refused
    # as no unix:// URL: no socket peer could be named)
    (sock,) = parse_peers("d=unix:///run/r.sock?hops=2&db=1")
    assert sock == Peer("d", "unix:///run/r.sock?db=1", 2, None)
    # an empty prefix is the peer's prefix (dropped, the site's own was used: a prefixed
    # site could not name a peer of the default prefix, and took nothing over from it)
    (plain,) = parse_peers("e=redis://h:1/0?prefix=")
    assert plain == Peer("e", "redis://h:1/0", 1, None, "")


@pytest.mark.parametrize(("text", "message"), [
    ("b", "is not name=redis"), ("b=http://x", "must be redis://"),
    ("b=redis://x?hops=-1", "hops must be a whole number >= 0, got '-1'"),
    ("b=redis://x?rtt_ms=abc", "rtt_ms must be a number >= 0, got 'abc'"),
    ("b=redis://x?hops=", "hops must be a whole number >= 0, got ''"),  # (read as 1)
    ("b=redis://x?prefix=a:&prefix=b:", "'b': prefix given twice"),  # (the last taken)
    ("b=redis://x b=redis://y", "names a site twice"), ("b c=redis://x", "is not name"),
    ("b/x=redis://x", "site name"),
    ("b=redis://127.0.0.1:99999/0", "'b' .*: Port out of range"),
    ("b=redis://h:abc/0", "'b' .*: Port could not be cast"),
    ("b=redis://h:1/0,c=redis://h:2/0", "holds a comma"),
    ("b=redis://", "names no host"), ("b=unix://", "names no socket path"),
    ("b=redis://h:1/zero", "database 'zero' is not a number"),
    ("b=redis://h:1/0?socket_timeout=abc", "'b' .*: Invalid value for 'socket_timeout'"),
    # an option redis-py does not know (rtt_ms misspelt) passed, and every enqueue then
    # raised TypeError after its task was queued (a retrying caller queued it twice)
    ("b=redis://h:1/0?rtt=1", "'b' .*: no query option 'rtt' for a redis:// connection"),
])
def test_bad_peers_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_peers(text)


@pytest.mark.parametrize("text", [
    "redis://:hunter2@peer:6379/0", "b=redis://:hunter2@h:6379/0,c=redis://h2",
    "b=redis://:hunter2@/0", "b=unix://:hunter2@"])
def test_a_refused_peer_entry_does_not_show_its_password(text: str) -> None:
    """(the entry or its URL was quoted whole: the peer's password in every log)"""
    with pytest.raises(ConfigError) as refused:
        parse_peers(text)
    assert "hunter2" not in str(refused.value) and "***" in str(refused.value)


@pytest.mark.parametrize(("settings", "message"), [
    ({"site_peers": "b=redis://x"}, "site_peers needs site"),
    ({"site": "a", "site_peers": "a=redis://x"}, "lists this site"),
    ({"site": "a b"}, "site name"),
    ({"site": "a", "site_dead_after_s": 1.5}, "must exceed two site_sync_interval_s"),
    ({"site": "a", "site_strong_rtt_ms": 0}, "site_strong_rtt_ms must be a positive"),
])
def test_bad_site_settings_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replace(SitsConfig(), **settings)


def test_the_sync_pass_is_scheduled_only_for_a_site() -> None:
    from sits_queue.app import CONTROL_QUEUE, beat_schedule, celery_settings, make_app
    from sits_queue.options import route_maintenance

    assert "sits-site-sync" not in beat_schedule(SitsConfig())
    config = SitsConfig(site="a", site_peers="b=redis://h:1/0", site_sync_interval_s=2.0)
    entry = beat_schedule(config)["sits-site-sync"]
    assert entry["task"] == "sits.site_sync" and entry["schedule"] == 2.0
    options: dict[str, object] = {}
    route_maintenance("sits.site_sync", options)  # as send_task and enqueue_many do
    assert options == {"queue": CONTROL_QUEUE}
    route_maintenance("sits.site_sync", named := {"queue": "mine"})
    route_maintenance("sits.generate", work := {})
    assert named == {"queue": "mine"} and work == {}
    assert "task_routes" not in celery_settings(config)  # (an empty table: no lookup)
    assert "sits.site_sync" in make_app(config, main="sites-unit").tasks


def test_a_records_class_is_read_or_none() -> None:
    from sits_queue.broker.meta import sla_class_of

    assert sla_class_of(b'{"c": "high", "m": null}') == "high"
    for bad in (None, b"not json", b"[1]", b'{"c": 3}', b"{}"):
        assert sla_class_of(bad) is None



def test_the_tasks_a_result_says_its_task_sent_on_are_read_from_its_children() -> None:
    """(``takeover._children_ids``: a chain's next step and callbacks, run at the peer
    that took the first over, have their results copied home by these ids)"""
    import json

    from sits_queue.broker.takeover import _children_ids

    step = [["step2", ["first", None]], None]  # AsyncResult.as_tuple()
    group = [["g", None], [[["m1", None], None], [["m2", None], None]]]  # GroupResult's
    meta = {"status": "SUCCESS", "result": 3, "children": [step, group, "junk", [1]]}
    assert sorted(_children_ids(json.dumps(meta))) == ["m1", "m2", "step2"]
    assert _children_ids(json.dumps({"status": "SUCCESS", "children": None})) == []
    assert _children_ids(b"\x80 not json") == []


def test_a_chains_step_that_ends_a_chord_header_member_is_kept_with_its_chord() -> None:
    """(a chain in a chord's header: its last step alone knows the chord, and it is
    sent on at the peer: its result, copied home, was counted in no chord)"""
    import base64
    import json

    from sits_queue.broker.takeover import _chord_records, _chord_request

    chord_sig = {"task": "w.total", "options": {"task_id": "body"}}
    chain = [{"task": "w.add", "options": {"task_id": "b", "group_id": "g", "group_index": 0,
                                          "chord": chord_sig}},
             {"task": "w.add", "options": {"task_id": "plain-step"}}]
    body = json.dumps([[1, 1], {}, {"chain": chain, "chord": None}]).encode()
    message = {"body": base64.b64encode(body).decode(), "content-type": "application/json",
               "content-encoding": "utf-8", "headers": {"id": "a", "task": "w.add"},
               "properties": {"body_encoding": "base64"}}
    found = _chord_records("a", json.dumps(message))  # (a itself is no group's member)
    assert list(found) == ["b"]
    request = _chord_request(found["b"], ["application/json"])
    assert request is not None
    assert (request.id, request.group, request.group_index, request.chord) == (
        "b", "g", 0, chord_sig)
