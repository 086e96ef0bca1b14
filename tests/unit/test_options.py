"""Submission options (``options.py``): numbers at the edges of what a float holds. No Redis."""

from __future__ import annotations

import pytest

from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidTaskOptions
from sits_queue.options import resolve


@pytest.mark.parametrize("option", ["context_tokens", "vram_gib", "latency_sla_ms",
                                    "loss_sensitivity", "input_entropy", "batch_max"])
@pytest.mark.parametrize("value", [10**400, -10**400, 10**5000], ids=["1e400", "-1e400", "1e5000"])
def test_a_huge_integer_option_is_an_invalid_option_naming_it(option: str, value: int) -> None:
    with pytest.raises(InvalidTaskOptions) as info:
        resolve(SitsConfig(), {}, {option: value})
    assert option in str(info.value) and "bits" in str(info.value)
