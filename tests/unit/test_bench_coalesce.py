"""The coalesce benchmark's statistics (pure)."""

from __future__ import annotations

import pytest

from sits_queue.bench.coalesce import (
    RAGGED_MOST,
    Shape,
    make_texts,
    ragged_lengths,
    ratios,
    summarise,
    targets,
)


def test_summary_counts_latency_from_submission_and_batch_sizes() -> None:
    submitted = {"a": 10.0, "b": 10.0, "c": 10.5, "d": 10.5}
    records = [{"id": "a", "fin": 10.1, "size": 2}, {"id": "b", "fin": 10.1, "size": 2},
               {"id": "c", "fin": 11.0, "size": 1},
               {"id": "d", "fin": 11.0, "size": 1, "error": "InvalidInput('x')"}]
    s = summarise(records, submitted)
    assert s["n"] == 3 and s["failed"] == 1
    assert s["throughput_tps"] == pytest.approx(3 / 1.0)
    assert s["p50_ms"] == pytest.approx(100.0) and s["p99_ms"] == pytest.approx(500.0)
    assert s["mean_batch"] == pytest.approx(5 / 3, abs=0.01)
    assert s["errors"] == ["InvalidInput('x')"]


def test_an_empty_run_summarises_to_zeros() -> None:
    s = summarise([], {})
    assert s["n"] == 0 and s["throughput_tps"] == 0.0 and s["mean_batch"] == 0.0


def row(tput: float, p50: float, p99: float) -> dict[str, float]:
    return {"throughput_tps": tput, "p50_ms": p50, "p99_ms": p99}


def test_ratios_and_targets() -> None:
    result = {
        "burst": {"celery_per_task": row(200, 1, 2), "sits_one_by_one": row(100, 1, 2),
                  "sits_batched": row(300, 1, 2)},
        "light": {"celery_per_task": row(50, 5, 9), "sits_one_by_one": row(50, 4, 8),
                  "sits_batched": row(50, 6, 9)},
        "heavy": {"celery_per_task": row(90, 900, 1000), "sits_one_by_one": row(80, 50, 400),
                  "sits_batched": row(150, 10, 100)},
        "gen_burst": {"celery_per_task": row(20, 1, 2), "sits_one_by_one": row(25, 1, 2),
                      "sits_batched": row(100, 1, 2), "sits_joins": row(120, 1, 2)},
        "gen_template": {"celery_per_task": row(10, 1, 2), "sits_one_by_one": row(20, 1, 2),
                         "sits_batched": row(120, 1, 2), "sits_joins": row(110, 1, 2)},
        "gen_ragged": {"celery_per_task": row(8, 400, 800), "sits_one_by_one": row(7, 500, 900),
                       "sits_batched": row(56, 100, 200), "sits_joins": row(70, 90, 220)},
        "gen_paced": {"sits_batched": row(28, 300, 500), "sits_joins": row(28, 240, 600)},
    }
    r = ratios(result)
    assert r["burst_throughput_vs_one_by_one"] == 3.0
    assert r["burst_throughput_vs_celery"] == 1.5
    assert r["heavy_p99_vs_one_by_one"] == 0.25 and r["heavy_p99_vs_celery"] == 0.1
    assert r["light_p50_vs_one_by_one"] == 1.5
    assert r["gen_throughput_vs_one_by_one"] == 4.0 and r["gen_throughput_vs_celery"] == 5.0
    assert r["template_throughput_vs_one_by_one"] == 6.0
    assert r["template_throughput_vs_celery"] == 12.0
    assert r["ragged_throughput_vs_one_by_one"] == 8.0
    assert r["ragged_throughput_vs_celery"] == 7.0 and r["ragged_p50_vs_celery"] == 0.25
    assert r["joins_gen_throughput"] == 1.2 and r["joins_ragged_throughput"] == 1.25
    assert r["joins_paced_p50"] == 0.8 and r["joins_paced_p99"] == 1.2
    met = targets(r)
    assert list(met.values()) == [True, True, False]  # light p50 1.5 > 1.25


def test_ragged_lengths_are_seeded_and_within_bounds() -> None:
    lengths = ragged_lengths(500, 3)
    assert lengths == ragged_lengths(500, 3) != ragged_lengths(500, 4)
    assert min(lengths) == 1 and max(lengths) == RAGGED_MOST


def test_texts_are_seeded() -> None:
    assert make_texts(5, 1) == make_texts(5, 1) != make_texts(5, 2)
    assert all(t for t in make_texts(20, 3))


@pytest.mark.parametrize("field", ["burst", "paced", "generations", "batch_repeats"])
def test_a_shape_needs_at_least_one_of_each(field: str) -> None:
    with pytest.raises(ValueError, match="batch_repeats must be >= 1"):
        Shape(**{"burst": 1, "paced": 1, "generations": 1, field: 0})
