"""``prefix_key``: given on a task or a call, or derived from the prompt's start."""

from __future__ import annotations

from typing import Any

import pytest

from sits_queue.config import SitsConfig
from sits_queue.errors import ConfigError, InvalidTaskOptions
from sits_queue.options import derive_prefix_key, from_header, resolve

CONFIG = SitsConfig()
TEMPLATE = "You summarise operations logs. Keep every number. " * 6  # 306 characters


def key(args: Any = (), kwargs: Any = None, model: str | None = "lm", **per_call: Any
        ) -> str | None:
    return resolve(CONFIG, {"model": model}, per_call, args, kwargs).prefix_key


def test_prompts_equal_in_their_first_characters_share_a_key() -> None:
    a = key((TEMPLATE + "disk 3 is full",))
    b = key((TEMPLATE + "node 7 rebooted",))
    assert a is not None and a == b and len(a) == 16
    assert key(("x" + TEMPLATE,)) != a  # a different start, a different key
    assert key((), {"prompt": TEMPLATE + "as a keyword"}) == a


@pytest.mark.parametrize(("args", "kwargs", "model"), [
    (("short prompt",), None, "lm"),  # shorter than prefix_key_chars
    ((TEMPLATE,), None, None),  # no model: nothing a worker could hold
    ((42, TEMPLATE), None, "lm"),  # the first argument is not a prompt
    ((), {"text": TEMPLATE}, "lm"),  # only prompt= counts among keywords
])
def test_no_key_is_derived(args: Any, kwargs: Any, model: str | None) -> None:
    assert key(args, kwargs, model) is None


def test_a_given_key_wins_and_is_validated() -> None:
    assert key((TEMPLATE,), prefix_key="template-v3") == "template-v3"
    assert key(("short",), model=None, prefix_key="template-v3") == "template-v3"
    for bad in ("", 7, "k" * 201):
        with pytest.raises(InvalidTaskOptions, match="prefix_key"):
            key((TEMPLATE,), prefix_key=bad)


def test_the_key_travels_in_the_header() -> None:
    opts = resolve(CONFIG, {"model": "lm"}, {}, (TEMPLATE,))
    assert from_header(CONFIG, opts.to_header()) == opts


def test_derivation_length_is_configuration() -> None:
    assert derive_prefix_key(("abc",), {}, 3) == derive_prefix_key(("abcdef",), {}, 3)
    assert derive_prefix_key((TEMPLATE,), {}, 0) is None
    config = SitsConfig.from_env({"SITS_PREFIX_KEY_CHARS": "0"})
    assert resolve(config, {"model": "lm"}, {}, (TEMPLATE,)).prefix_key is None
    with pytest.raises(ConfigError, match="prefix_key_chars"):
        SitsConfig(prefix_key_chars=-1)


def test_a_prompt_with_a_lone_surrogate_still_gets_a_key() -> None:
    # (a raw UnicodeEncodeError from apply_async; the worker refuses the prompt, naming it)
    key = derive_prefix_key(("\ud800" + "x" * 300,), {}, 256)
    assert key is not None and key != derive_prefix_key(("y" * 301,), {}, 256)
