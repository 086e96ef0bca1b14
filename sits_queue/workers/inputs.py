"""What the built-in inference tasks accept: each argument checked before any work, so a
bad one fails its task (its call alone, in a batch) with an ``InvalidInput`` naming it."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from sits_queue.checks import shown
from sits_queue.errors import ContextTooLong, InvalidInput

#: Upper bound on ``max_new_tokens``: a typo guard, not a model limit (that is checked too).
MAX_NEW_TOKENS = 8192
#: Texts per ``sits.embed`` call: bounds one task's activation memory.
MAX_EMBED_BATCH = 1024


def check_flag(name: str, value: Any) -> None:
    """A yes/no argument must be a bool: the string "false" is truthy, so bool() of it
    would silently do the opposite of what the caller asked."""
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be true or false, got {shown(value)}")


def check_text(name: str, text: str) -> None:
    """A str Python holds but no tokenizer takes: a lone surrogate (JSON carries one as
    ``"\\ud800"``; the tokenizer's TypeError would not name it)."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{name} is not valid Unicode text: {exc.reason} at character "
                           f"{exc.start}") from None


def check_prompt(prompt: Any, max_new_tokens: Any, temperature: Any, seed: Any = 0,
                 stop_at_eos: Any = True) -> None:
    if not isinstance(prompt, str) or not prompt:
        raise InvalidInput("prompt must be a non-empty string, got "
                           + ("an empty string" if prompt == "" else type(prompt).__name__))
    check_text("prompt", prompt)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise InvalidInput(f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS}], "
                           f"got {shown(max_new_tokens)}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 <= temperature <= 100:
        raise InvalidInput(f"temperature must be a number in [0, 100], got {shown(temperature)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63:
        # (a seed past 64 bits drew what another one does: 2**80 and -2**80 alike)
        raise InvalidInput(f"seed must be an integer in [-2**63, 2**63), got {shown(seed)}")
    check_flag("stop_at_eos", stop_at_eos)


def check_texts(texts: Any) -> list[str]:
    batch = [texts] if isinstance(texts, str) else texts
    if not isinstance(batch, (list, tuple)) or not batch:
        raise InvalidInput("texts must be a non-empty string or a non-empty list of strings")
    if len(batch) > MAX_EMBED_BATCH:
        raise InvalidInput(f"at most {MAX_EMBED_BATCH} texts per call, got {len(batch)}")
    bad = [i for i, t in enumerate(batch) if not isinstance(t, str) or not t]
    if bad:
        item = batch[bad[0]]
        raise InvalidInput(f"texts must be non-empty strings; item {bad[0]} is "
                           + ("an empty string" if item == "" else type(item).__name__))
    for i, text in enumerate(batch):
        check_text(f"texts item {i}", text)
    return list(batch)


def check_context(model: str, prompt_tokens: int, max_new_tokens: int,
                  limit: int | None) -> None:
    """:class:`ContextTooLong` when the prompt and the new tokens pass the model's
    positions (``limit``, None: no limit known). The last new token is never fed back
    through the model, so it takes no position (a 256-token prompt on 256 positions
    still gets its one new token, as from transformers' ``generate``)."""
    if limit is not None and prompt_tokens + max_new_tokens - 1 > limit:
        raise ContextTooLong(f"prompt of {prompt_tokens} tokens + max_new_tokens "
                             f"{max_new_tokens} exceeds model {model!r}'s {limit} positions")


def check_length(name: str, text: str, limit: int | None, tokenizer: Any,
                 model: str) -> None:
    """:class:`ContextTooLong` for a text longer than ``limit`` tokens of the tokenizer's
    longest could cover, before it is tokenized: tokenizing is not interruptible (the
    tokenizer runs outside Python), and 8M characters took the soft limit's whole time,
    then the hard one killed the child and every call batched with it."""
    if limit is None:
        return
    most = limit * longest_token_chars(tokenizer)
    if len(text) > most:
        raise ContextTooLong(f"{name} of {len(text)} characters is longer than model "
                             f"{model!r}'s {limit} positions can hold (its tokens cover at "
                             f"most {longest_token_chars(tokenizer)} characters each)")


def check_tokens(name: str, tokens: int, model: str) -> None:
    """:class:`InvalidInput` for a text its tokenizer keeps nothing of (whitespace a
    normaliser strips): decoded from no position, it raised a raw torch error, or came
    back as output made of padding."""
    if tokens <= 0:
        raise InvalidInput(f"{name} gives no tokens with model {model!r}'s tokenizer "
                           "(it keeps none of its characters)")


def prompt_ids(prompt: str, max_new_tokens: int, limit: int | None, tokenizer: Any,
               model: str) -> list[int]:
    """``prompt``'s token ids, once it is known to fit: not too long to tokenize, some
    tokens, room for ``max_new_tokens`` within ``limit`` positions. One rule for a
    generation alone and a row of a batch, which must decode it alike."""
    check_length("prompt", prompt, limit, tokenizer, model)
    ids = list(tokenizer(prompt)["input_ids"])
    check_tokens("prompt", len(ids), model)
    check_context(model, len(ids), max_new_tokens, limit)
    return ids


#: Characters one token is taken to cover at most when a tokenizer cannot list its
#: vocabulary (a byte-level BPE's longest is some dozens).
FALLBACK_TOKEN_CHARS = 256


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters (a byte-level BPE: bytes) one token of ``tokenizer`` covers;
    read from its vocabulary once."""
    known = getattr(tokenizer, "_sits_longest_token", None)
    if isinstance(known, int):
        return known
    try:
        longest = max(len(str(token)) for token in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):  # no vocabulary to read
        longest = FALLBACK_TOKEN_CHARS
    longest = max(1, longest)
    with contextlib.suppress(AttributeError):  # (slots: read again next time)
        tokenizer._sits_longest_token = longest
    return longest


def check_arguments(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The call's arguments against the task function's (the engine first), before the
    engine is got: a producer that sends by name (Celery checks no types then) gets
    InvalidInput naming the argument, not a TypeError from inside the function, counted
    as a crash and with the engine in its count."""
    try:
        signature = inspect.signature(task.run)
    except (TypeError, ValueError):  # a builtin or C function: it says for itself
        return
    try:
        signature.bind(None, *args, **kwargs)
    except TypeError as exc:
        raise InvalidInput(f"{getattr(task, 'name', 'the task')} arguments: {exc}") from None
