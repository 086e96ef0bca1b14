"""The precision benchmark's targets: what each device is held to (pure)."""

from __future__ import annotations

from typing import Any

from sits_queue.bench import precision
from sits_queue.options import PRECISIONS


def result(device: str, int8_served: str) -> dict[str, Any]:
    rows = {p: {"served": p, "cosine_vs_fp32": None if p == "fp32" else 0.999,
                "batch_vs_alone_max_diff": 1e-8} for p in PRECISIONS}
    rows["int8"]["served"] = int8_served
    return {"encoder": rows, "lm": {p: dict(r) for p, r in rows.items()},
            "meta": {"device": device}}


RATIOS = {"encoder_int8_vs_fp32": 1.5}


def test_on_a_cpu_int8_must_pass_its_gate_and_be_faster() -> None:
    met = precision.targets(result("cpu", "int8"), RATIOS)
    assert met["int8_passed_the_gate"] is True
    assert met[f"encoder_int8_speedup>={precision.TARGET_INT8_SPEEDUP_CPU}"] is True
    assert precision.targets(result("cpu", "fp32"), RATIOS)["int8_passed_the_gate"] is False


def test_on_a_gpu_int8_is_held_to_being_served_at_fp16_as_designed() -> None:
    met = precision.targets(result("cuda", "fp16"), RATIOS)
    assert "int8_passed_the_gate" not in met
    assert not any(name.startswith("encoder_int8_speedup") for name in met)
    assert met["int8_served_at_fp16_on_the_gpu"] is True
    refused = precision.targets(result("cuda", "fp32"), RATIOS)
    assert refused["int8_served_at_fp16_on_the_gpu"] is False
