"""Smoke run of the coalesce benchmark at a tiny size (real workers, a real encoder):
it checks the JSON and what must hold whatever the speed; never a timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sits_queue.bench import coalesce
from sits_queue.bench.coalesce import STREAMS, Shape
from sits_queue.bench.coalesce_apps import GEN_ONLY, SYSTEMS

#: (one timed run of each in-process batch: what the JSON holds, not how steady it is)
TINY = Shape(burst=40, paced=10, generations=12, batch_repeats=1)


def test_every_system_every_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "coalesce.json"
    monkeypatch.setattr(coalesce, "QUICK", TINY)
    assert coalesce.main(["--quick", "--json", str(out), "--zoo", str(tmp_path / "zoo")]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {*STREAMS, "ratios", "meta"}
    for stream in STREAMS:
        expected = set(SYSTEMS) - (set() if stream.startswith("gen_") else set(GEN_ONLY))
        if stream == "gen_paced":
            expected = set(coalesce.PACED_GEN_SYSTEMS)
        assert set(result[stream]) == expected
        for system, s in result[stream].items():
            want = {"burst": TINY.burst, "gen_burst": TINY.generations,
                    "gen_template": TINY.generations,
                    "gen_ragged": TINY.generations,
                    "gen_paced": TINY.generations}.get(stream, TINY.paced)
            assert s["n"] == want and s["failed"] == 0, (stream, system, s)
            assert s["throughput_tps"] > 0 and s["p99_ms"] >= s["p50_ms"] > 0
    # One at a time means one task per run; 40 texts waiting at once run in batches
    assert all(result[k]["sits_one_by_one"]["mean_batch"] == 1.0 for k in STREAMS
               if k != "gen_paced")
    assert all(result[k]["celery_per_task"]["mean_batch"] == 1.0 for k in STREAMS
               if k != "gen_paced")
    assert result["burst"]["sits_batched"]["mean_batch"] > 4
    assert result["gen_burst"]["sits_batched"]["mean_batch"] > 2
    assert result["gen_template"]["sits_batched"]["mean_batch"] > 2
    assert result["gen_ragged"]["sits_batched"]["mean_batch"] > 2
    assert result["gen_ragged"]["sits_joins"]["mean_batch"] > 2
    assert result["meta"]["gen_paced_per_s"] > 0
    assert set(result["meta"]["rates_per_s"]) == {"light", "heavy"}
    assert all(v is not None for v in result["ratios"].values())
    # The in-process batches: one template is what the first shares; the mixed one
    # shares each of its four templates within that template's rows
    batches = result["meta"]["template_batch"]
    assert batches["one"]["groups"] == 1 and batches["mixed"]["groups"] == 4
    for batch in batches.values():
        assert batch["rows"] == coalesce.BATCH_ROWS and batch["shared_tokens"] >= 16
        assert batch["shared_ms"] > 0 and batch["unshared_ms"] > 0
    # The ragged batch: every row got what it asked for, no more
    ragged = result["meta"]["ragged_batch"]
    lengths = coalesce.ragged_lengths(coalesce.BATCH_ROWS, TINY.seed + 11)
    assert ragged["tokens"] == sum(lengths) and ragged["longest"] == max(lengths)
    assert ragged["rows"] == coalesce.BATCH_ROWS and ragged["ragged_ms"] > 0
