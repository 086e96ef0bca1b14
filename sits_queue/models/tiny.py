"""Tiny randomly initialised models, built and saved locally (nothing is downloaded).

Tests, the demo and the cold-start benchmark need real Hugging Face models that load
through the normal ``from_pretrained(path)`` route, yet cost nothing to fetch. Each
builder trains a small byte-level BPE tokenizer on a generated corpus, initialises a
model from a seed, and saves both with ``save_pretrained``.

Builds are idempotent and safe to race: a directory is written under a temporary name,
stamped with :data:`MARKER` (its build spec) last, then renamed into place; a directory
whose marker matches the requested spec is reused as is, one of another spec (an older
release's) is moved aside in one rename before it is deleted, and a path that holds
anything else (a model of the user's own) is refused, never replaced. transformers, tokenizers and
torch are imported inside the builders only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sits_queue.cache import hfprogress
from sits_queue.errors import missing_extra

#: Written last into every built directory: the spec it was built from.
MARKER = "sits_tiny.json"
#: Bump when a builder's output changes, so directories built by older code are rebuilt.
BUILD_VERSION = 1
#: Target vocabulary: big enough for subword merges on the corpus, small for tiny embeddings.
VOCAB_SIZE = 512
#: Sentences in the tokenizer's training corpus (a few hundred, per the design).
CORPUS_SENTENCES = 400
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>",
                  "unk_token": "<unk>", "cls_token": "<cls>", "sep_token": "<sep>",
                  "mask_token": "<mask>"}
#: (n_layer, n_embd, n_head) of the zoo's GPT-2 models, smallest first: about 1.2, 2.0,
#: 2.8, 3.6, 4.2, 5.9 and 7.7 MB of fp32 weights with the tiny vocabulary.
ZOO_LADDER = ((2, 96, 2), (2, 128, 2), (3, 128, 2), (4, 128, 4), (3, 160, 4), (3, 192, 4),
              (4, 192, 4))

_SUBJECTS = ("the worker", "a scheduler", "the queue", "every task", "the gpu", "a model",
             "the cache", "our fleet", "the broker", "a client", "the beat", "this engine")
_VERBS = ("loads", "runs", "keeps", "evicts", "promotes", "schedules", "warms", "scores",
          "batches", "drops", "predicts", "serves", "streams", "measures")
_OBJECTS = ("the prompt", "a batch of tokens", "warm engines", "the kv cache", "cold starts",
            "priority scores", "latency samples", "host memory", "device memory",
            "an embedding", "the next token", "a summary", "risk reports", "log lines")
_TAILS = ("quickly", "before noon", "under load", "within the budget", "on every host",
          "at 120 ms", "twice", "for 2048 tokens", "without a restart", "in order")


def corpus(n_sentences: int = CORPUS_SENTENCES, seed: int = 0) -> list[str]:
    """Deterministic English-like sentences about the product's own domain."""
    rng = random.Random(seed)
    out = []
    for i in range(n_sentences):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.6:
            words.append(rng.choice(_TAILS))
        sentence = " ".join(words)
        out.append(f"{sentence[0].upper()}{sentence[1:]}{'?' if i % 7 == 0 else '.'}")
    return out


def _build(path: Path, spec: Mapping[str, Any], write: Callable[[Path], None]) -> Path:
    """Build ``path`` with ``write`` unless it already holds ``spec``; see the module doc."""
    spec = {**spec, "version": BUILD_VERSION}
    if _built_with(path) == spec:
        return path
    if _foreign(path):  # (replaced, a model directory of the user's own was deleted)
        raise FileExistsError(f"{path} exists and is no tiny model built here: not "
                              "replaced; give another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    tmp.mkdir()
    aside = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.old"
    try:
        try:
            with hfprogress.quiet():
                write(tmp)
        except ModuleNotFoundError as exc:
            if (hint := missing_extra(exc)) is None:
                raise
            raise ModuleNotFoundError(f"{exc}: building a tiny model needs the inference "
                                      f"extra: {hint}", name=exc.name) from exc
        (tmp / MARKER).write_text(json.dumps(spec, sort_keys=True))
        if _built_with(path) == spec:  # (a builder racing this one put it there first)
            return path
        # One built here from another spec is moved aside in one step, and deleted once
        # the new one is in place: no reader or builder ever sees it half deleted (a
        # builder racing this one read a directory without its marker as the user's
        # own, and refused it), and the path is empty only between the two renames.
        if path.exists():
            with contextlib.suppress(FileNotFoundError):  # (another builder moved it)
                path.rename(aside)
        try:
            tmp.rename(path)
        except OSError:
            if _built_with(path) != spec:  # a concurrent builder won with another spec
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)
    return path


def _foreign(path: Path) -> bool:
    """Whether ``path`` holds something this module did not build: a file, or a
    directory with no :data:`MARKER` that is not empty (one being moved aside by another
    builder is gone, not foreign)."""
    try:
        if (path / MARKER).exists():
            return False
        if path.is_dir():
            return any(path.iterdir())
        return path.exists()
    except (FileNotFoundError, NotADirectoryError):
        return False


def _built_with(path: Path) -> dict[str, Any] | None:
    try:
        loaded: dict[str, Any] = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return loaded


def _write_tokenizer(path: Path, model_max_length: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    # Byte-level: any input text encodes (no unknowns), as with GPT-2's tokenizer.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    # transformers 5's tokenizer classes are untyped: build through Any.
    wrapper: Any = PreTrainedTokenizerFast
    fast = wrapper(tokenizer_object=tok, model_max_length=model_max_length,
                   model_input_names=["input_ids", "attention_mask"], **SPECIAL_TOKENS)
    fast.save_pretrained(path)
    return fast


def build_tokenizer(path: str | Path, model_max_length: int = 256) -> Path:
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) saved at ``path``."""
    spec = {"kind": "tokenizer", "model_max_length": model_max_length}
    return _build(Path(path), spec, lambda p: _write_tokenizer(p, model_max_length))


def build_tiny_causal_lm(path: str | Path, seed: int = 0, n_layer: int = 2, n_embd: int = 64,
                         n_head: int = 2, n_positions: int = 256) -> Path:
    """A GPT-2 causal LM with random weights (from ``seed``) and its tokenizer at ``path``."""
    spec = {"kind": "gpt2", "seed": seed, "n_layer": n_layer, "n_embd": n_embd,
            "n_head": n_head, "n_positions": n_positions}

    def write(tmp: Path) -> None:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        tokenizer = _write_tokenizer(tmp, n_positions)
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=n_positions, n_embd=n_embd,
                            n_layer=n_layer, n_head=n_head,
                            bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(seed)
        GPT2LMHeadModel(config).save_pretrained(tmp)

    return _build(Path(path), spec, write)


def build_tiny_encoder(path: str | Path, seed: int = 0, n_layer: int = 2, hidden: int = 64,
                       n_head: int = 2, n_positions: int = 256) -> Path:
    """A BERT-style encoder (for text embeddings) with random weights at ``path``."""
    spec = {"kind": "bert", "seed": seed, "n_layer": n_layer, "hidden": hidden,
            "n_head": n_head, "n_positions": n_positions}

    def write(tmp: Path) -> None:
        import torch
        from transformers import BertConfig, BertModel

        tokenizer = _write_tokenizer(tmp, n_positions)
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                            num_hidden_layers=n_layer, num_attention_heads=n_head,
                            intermediate_size=4 * hidden, max_position_embeddings=n_positions,
                            pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(seed)
        BertModel(config).save_pretrained(tmp)

    return _build(Path(path), spec, write)


def zoo_configs(n_models: int) -> list[tuple[int, int, int]]:
    """``n_models`` (n_layer, n_embd, n_head) spread evenly over :data:`ZOO_LADDER`;
    beyond its length the ladder repeats (the models still differ by seed)."""
    if n_models < 1:
        raise ValueError(f"n_models must be >= 1, got {n_models}")
    last = len(ZOO_LADDER) - 1
    if n_models > last:
        return [ZOO_LADDER[i % len(ZOO_LADDER)] for i in range(n_models)]
    return [ZOO_LADDER[round(i * last / max(1, n_models - 1))] for i in range(n_models)]


def build_tiny_zoo(root: str | Path, n_models: int = 4, seed: int = 0) -> list[Path]:
    """``n_models`` GPT-2 models of different sizes (about 1 to 8 MB) under ``root``,
    named ``tiny-lm-<i>``, model ``i`` seeded with ``seed + i``."""
    root = Path(root)
    return [build_tiny_causal_lm(root / f"tiny-lm-{i}", seed=seed + i, n_layer=layers,
                                 n_embd=embd, n_head=heads)
            for i, (layers, embd, heads) in enumerate(zoo_configs(n_models))]
