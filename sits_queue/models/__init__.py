"""Tiny, locally built models for tests, the demo and benchmarks (:mod:`.tiny`)."""

from sits_queue.models.tiny import (
    build_tiny_causal_lm,
    build_tiny_encoder,
    build_tiny_zoo,
    build_tokenizer,
)

__all__ = ["build_tiny_causal_lm", "build_tiny_encoder", "build_tiny_zoo", "build_tokenizer"]
