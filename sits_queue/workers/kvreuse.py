"""The torch side of the KV-prefix cache (``cache/prefix.py`` keeps and finds them):
which caches can be reused, and independent copies cut to a prefix; and the rows of a
left-padded batch cache joined and trimmed (continuous batching, ``batchdecode.py``); and
:class:`PromptPrefix`, one generation's lookup and store, tagged with its task's (or its
batch row's) ``prefix_key`` for affinity.

Only transformers' ``DynamicCache`` made of plain ``DynamicLayer`` s (full attention, a
``[batch, heads, positions, head_dim]`` key and value tensor per layer) is reused: a
sliding-window or recurrent layer cannot be cut back to a prefix, so models with those
simply prefill in full.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from sits_queue.workers import metrics

if TYPE_CHECKING:
    from sits_queue.workers import runtime

#: Positions are the second-to-last dimension of a layer's key and value tensors.
_POSITIONS_DIM = -2


def reusable(cache: Any) -> bool:
    """True for a cache this module can copy and cut to a prefix."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:  # a transformers without layered caches: prefill in full
        return False
    layers: Any = getattr(cache, "layers", None)
    if type(cache) is not DynamicCache or not layers:
        return False
    for layer in layers:
        keys: Any = getattr(layer, "keys", None)
        if type(layer) is not DynamicLayer or keys is None or keys.dim() != 4:
            return False
    return True


def nbytes(cache: Any) -> int:
    """Bytes of the key and value tensors."""
    return sum(int(t.numel()) * int(t.element_size())
               for layer in cache.layers for t in (layer.keys, layer.values))


def prefix_copy(cache: Any, tokens: int) -> Any:
    """An independent cache of the first ``tokens`` positions of ``cache``.

    Each layer's tensors are cut and cloned (compact: a view would pin the longer
    storage); everything else is deep-copied. Cloning is memory traffic, far cheaper
    than the prefill it saves, and keeps a stored prefix safe from a cache that a later
    forward pass might extend in place.
    """
    memo: dict[int, Any] = {}
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor.shape[_POSITIONS_DIM] < tokens:
                raise ValueError(f"cache holds {tensor.shape[_POSITIONS_DIM]} positions, "
                                 f"not {tokens}")
            # deepcopy consults the memo first: the cut clone stands in for the tensor
            memo[id(tensor)] = tensor[..., :tokens, :].clone()
    return copy.deepcopy(cache, memo)


def merge_rows(past: Any, mask: Any, cache: Any, rows_mask: Any) -> tuple[Any, Any]:
    """A batch's KV cache ``past`` (as wide as its attention ``mask``) with the rows of
    another ``cache`` (its own ``rows_mask``) appended, both right-aligned: the narrower
    side gets masked-out zeros on the left. Positions count real tokens, so padding
    changes nothing any row attends to. Returns the cache and the grown mask."""
    import torch

    width, other = mask.shape[1], rows_mask.shape[1]
    if other > width:  # the new rows are wider: every row of the batch gets more padding
        _pad_left(past, other - width)
        mask = torch.cat([mask.new_zeros((mask.shape[0], other - width)), mask], dim=1)
    elif width > other:
        _pad_left(cache, width - other)
        rows_mask = torch.cat([rows_mask.new_zeros((rows_mask.shape[0], width - other)),
                               rows_mask], dim=1)
    for layer, part in zip(past.layers, cache.layers, strict=True):
        layer.keys = torch.cat([layer.keys, part.keys], dim=0)
        layer.values = torch.cat([layer.values, part.values], dim=0)
    return past, torch.cat([mask, rows_mask], dim=0)


def trim_padding(past: Any, mask: Any) -> Any:
    """Drop the leading positions no row attends to (padding left behind by rows that
    left the batch): a batch that rows keep joining would otherwise grow wider with
    every step. Returns the mask; ``past`` is cut in place."""
    # the first column some row attends to (0 when none does: nothing is cut)
    lead = int((mask.sum(dim=0) > 0).long().argmax())
    if lead == 0:
        return mask
    for layer in past.layers:
        layer.keys = layer.keys[:, :, lead:, :]
        layer.values = layer.values[:, :, lead:, :]
    return mask[:, lead:]


def _pad_left(cache: Any, n: int) -> None:
    import torch

    for layer in cache.layers:
        for name in ("keys", "values"):
            old = getattr(layer, name)
            setattr(layer, name, torch.cat(
                [old.new_zeros((old.shape[0], old.shape[1], n, old.shape[3])), old], dim=2))


# -- one generation's use of the KV-prefix store ---------------------------------------------

class _Own:
    """The running task's own ``prefix_key`` (:meth:`PromptPrefix.looked_up`)."""


OWN = _Own()


class PromptPrefix:
    """The KV-prefix cache as one generation uses it: the start it found (a private
    copy, cut to the shared prefix) and, after the prefill, its own prompt stored."""

    def __init__(self, store: Any, model: str, tokens: list[int], tag: str | None) -> None:
        self.store, self.model, self.tokens_in, self.tag = store, model, tokens, tag
        hit = store.lookup(model, tokens, tag) if store is not None else None
        self.start = prefix_copy(hit.value, hit.tokens) if hit is not None else None
        self.tokens = hit.tokens if hit is not None else 0

    @classmethod
    def looked_up(cls, active: runtime.ActiveTask | None, model: str, tokens: list[int],
                  tag: str | _Own | None = OWN) -> PromptPrefix:
        """The running task's lookup of ``tokens`` in its child's store (none outside a
        worker), counted in the worker's KV-prefix metrics; tagged with the task's
        ``prefix_key``, or a batch row's own ``tag`` (a batch runs as its first task)."""
        if isinstance(tag, _Own):
            tag = active.prefix_key if active is not None else None
        prefix = cls(active.prefixes if active is not None else None, model, tokens, tag)
        if active is not None and active.count is not None and prefix.store is not None:
            active.count(metrics.prefix_fields(prefix.tokens))
        return prefix

    def after_prefill(self, cache: Any) -> None:
        """Keep this prompt's whole blocks unless the store holds them already."""
        if self.store is None or not reusable(cache):
            return
        block = self.store.block
        aligned = (len(self.tokens_in) // block) * block
        if aligned and self.store.covered(self.model, self.tokens_in[:aligned]) < aligned:
            kept = prefix_copy(cache, aligned)
            self.store.store(self.model, self.tokens_in[:aligned], kept, nbytes(kept),
                             self.tag)
