"""Input entropy and the §1.3 shard flag (sits_queue.priority.entropy)."""

from __future__ import annotations

import base64
import random
from typing import Any

import pytest

from sits_queue.priority.entropy import (
    MAX_DEPTH,
    SHARD_ENTROPY,
    input_entropy,
    is_shardable,
    text_entropy,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", 0.0),
        ("a", 0.0),
        ("aaaaaaaa", 0.0),
        ("ab", 1 / 8),            # 1 bit/byte
        ("abcd" * 10, 2 / 8),     # 2 bits/byte
        ("é", 1 / 8),             # two distinct UTF-8 bytes
    ],
)
def test_text_entropy_table(text: str, expected: float) -> None:
    assert text_entropy(text) == pytest.approx(expected)


def test_dense_encoded_text_is_near_the_maximum() -> None:
    # Base85 uses 85 symbols: log2(85) / 8 ~= 0.80 is its ceiling, never above 1.
    rng = random.Random(7)
    noise = base64.b85encode(rng.randbytes(50_000)).decode()
    assert 0.75 < text_entropy(noise) <= 1.0


@pytest.mark.parametrize(
    "text",
    ["hello", "The quick brown fox jumps over the lazy dog. " * 20, "金融风险控制", "\ud800"],
)
def test_text_entropy_is_normalised(text: str) -> None:
    assert 0.0 <= text_entropy(text) <= 1.0


def test_prose_is_below_the_shard_threshold_and_encoded_data_above() -> None:
    prose = ("Financial risk control outranks news summaries, and long inputs yield to "
             "short ones so that interactive work is not blocked by bulk jobs. ") * 10
    encoded = base64.b64encode(random.Random(1).randbytes(3000)).decode()
    assert not is_shardable(text_entropy(prose))
    assert is_shardable(text_entropy(encoded))


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((), {}, None),
        ((1, 2.5, None, b"abcd"), {"x": b"zz"}, None),   # bytes are not text
        (("ab",), {}, 1 / 8),
        (("a",), {"k": "b"}, 1 / 8),                      # args and kwargs concatenate
        ((["a", ("b",)],), {}, 1 / 8),                    # lists and tuples are walked
        (({"key": "a", "other": {"x": "b"}},), {}, 1 / 8),  # dict values, not keys
        (({"aaaa": 1, "bbbb": 2},), {}, None),
        (("",), {}, 0.0),                                 # text, but empty
    ],
)
def test_input_entropy_walks_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], expected: float | None
) -> None:
    result = input_entropy(args, kwargs)
    if expected is None:
        assert result is None
    else:
        assert result == pytest.approx(expected)


def _nest(value: Any, levels: int) -> Any:
    for _ in range(levels):
        value = [value]
    return value


def test_input_entropy_depth_is_bounded() -> None:
    assert input_entropy((_nest("ab", MAX_DEPTH),), {}) == pytest.approx(1 / 8)
    assert input_entropy((_nest("ab", MAX_DEPTH + 1),), {}) is None


def test_self_referencing_payload_terminates() -> None:
    loop: list[Any] = ["ab"]
    loop.append(loop)
    assert input_entropy((loop,), {}) == pytest.approx(1 / 8)


def test_input_entropy_measures_at_most_limit_bytes() -> None:
    # Given uniform text first and varied text after the limit
    args = ("a" * 100, "abcdefgh" * 100)
    # Then only the first limit_bytes count
    assert input_entropy(args, {}, limit_bytes=100) == 0.0
    assert input_entropy(args, {}, limit_bytes=10_000) > 0.0  # type: ignore[operator]


def test_input_entropy_rejects_a_non_positive_limit() -> None:
    with pytest.raises(ValueError):
        input_entropy(("x",), {}, limit_bytes=0)


def test_huge_non_text_list_is_cheap_and_has_no_text() -> None:
    assert input_entropy((list(range(1_000_000)),), {}) is None


@pytest.mark.parametrize(
    ("entropy", "expected"),
    [(None, False), (0.0, False), (SHARD_ENTROPY - 1e-9, False), (SHARD_ENTROPY, True),
     (1.0, True), (float("nan"), False)],
)
def test_is_shardable(entropy: float | None, expected: bool) -> None:
    assert is_shardable(entropy) is expected
