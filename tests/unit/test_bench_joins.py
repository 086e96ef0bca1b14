"""``sitsq bench joins`` at a tiny size (a real tiny LM, in-process): the JSON, and what
must hold whatever the speed: every prompt decoded both ways to the same text, and the
joined way needing fewer decode steps for the same tokens. Never a timing."""

from __future__ import annotations

import json
from pathlib import Path

from sits_queue.bench import joins as bench

TINY = bench.SMOKE


def test_both_ways_decode_every_prompt_alike(tmp_path: Path) -> None:
    out = tmp_path / "joins.json"
    assert bench.main(["--smoke", "--json", str(out), "--zoo", str(tmp_path / "zoo")]) == 0
    result = json.loads(out.read_text())
    assert result["static"]["done"] == result["joined"]["done"] == TINY.prompts
    assert result["same_texts"] is True
    # 44 prompts: static runs a batch of 32 then one of 12; joined refills the first
    assert result["joined"]["steps"] < result["static"]["steps"]
    assert result["joined"]["rows_per_step"] > result["static"]["rows_per_step"]
    assert result["ratios"]["joined_throughput_vs_static"] > 0
    assert result["meta"]["device"] == "cpu" and result["meta"]["batch"] == bench.BATCH


def test_the_local_feed_joins_once_a_quarter_is_free() -> None:
    from sits_queue.workers.batched import Call

    feed = bench.LocalFeed([Call(str(i)) for i in range(10)], first=32)
    assert feed.take(30) == []  # 2 free of 32: fewer than 8
    got = feed.take(24)
    assert [i for i, _ in got] == list(range(32, 40)) and len(feed.waiting) == 2
    assert [c.id for c in feed.joined] == [str(i) for i in range(8)]
