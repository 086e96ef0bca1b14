"""The torch side of the KV-prefix cache (``cache/prefix.py`` keeps and finds them):
which caches can be reused, and independent copies cut to a prefix.

Only transformers' ``DynamicCache`` made of plain ``DynamicLayer`` s (full attention, a
``[batch, heads, positions, head_dim]`` key and value tensor per layer) is reused: a
sliding-window or recurrent layer cannot be cut back to a prefix, so models with those
simply prefill in full.
"""

from __future__ import annotations

import copy
from typing import Any

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
