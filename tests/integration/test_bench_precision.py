"""Smoke run of the precision benchmark at a tiny size (real models, the real conversion
path): it checks the JSON and what must hold whatever the speed; never a timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sits_queue.bench import precision
from sits_queue.options import PRECISIONS

TINY = precision.SMOKE


def test_both_models_at_every_precision(tmp_path: Path) -> None:
    out = tmp_path / "precision.json"
    assert precision.main(["--smoke", "--json", str(out), "--zoo", str(tmp_path / "zoo")]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"encoder", "lm", "ratios", "meta"}
    for model, unit in (("encoder", "texts_per_s"), ("lm", "tokens_per_s")):
        rows = result[model]
        assert list(rows) == list(PRECISIONS)
        assert all(rows[p]["requested"] == p and rows[p][unit] > 0 for p in PRECISIONS)
        # fp32 is the reference: nothing moved; the others moved a little, weights shrank
        assert rows["fp32"]["gate_kl"] == pytest.approx(0.0, abs=1e-9)
        assert all(0 <= rows[p]["gate_kl"] < 0.05 for p in PRECISIONS)
        assert all(rows[p]["bytes"] < rows["fp32"]["bytes"] for p in PRECISIONS[1:])
    assert result["encoder"]["int8"]["served"] == "int8"  # on a CPU, behind the gate
    assert all(result["encoder"][p]["cosine_vs_fp32"] > 0.99 for p in PRECISIONS[1:])
    assert result["meta"]["device"] == "cpu" and set(result["meta"]["targets"])
