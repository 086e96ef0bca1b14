"""Row-invariant int8 linear layers: the int8 precision of ``cache/precision.py``.

``y = x @ W.T + b`` with W in int8 (one scale per output channel) and x quantised to int8
as it comes (one scale per row, that is per token), the products summed exactly in int32
(``torch._int_mm``). Per token rather than per tensor (``torch.ao``'s dynamic
quantisation): a per-tensor scale is set by the largest activation anywhere in the batch,
padding included, so the same prompt decoded differently alone, in a batch, or after a
reused KV prefix. Here a row's output depends on that row alone. Imported only where
torch is wanted (the worker's parent process never imports it).
"""

from __future__ import annotations

from typing import Any

import torch

#: Activations and weights are scaled so that their largest magnitude maps to this.
INT8_MAX = 127.0
#: Smallest scale: an all-zero row (padding) quantises to zeros, not to NaN.
TINY = 1e-12


class Int8Linear(torch.nn.Module):
    """An ``nn.Linear`` in int8: per-channel weights, per-token activations, int32 sums."""

    weight_int8: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()  # weight: (out, in), as nn.Linear keeps it
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=TINY) / INT8_MAX
        self.in_features, self.out_features = int(w.shape[1]), int(w.shape[0])
        # stored (out, in), as nn.Linear's; torch._int_mm takes its transpose, the faster
        # operand layout on the CPU
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(
            -INT8_MAX, INT8_MAX).to(torch.int8).contiguous())
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        peak = flat.abs().amax(dim=1, keepdim=True).clamp_(min=TINY)
        scale = peak / INT8_MAX
        # each row's largest magnitude maps to 127, so no clamp is needed
        q = flat.mul(INT8_MAX / peak).round_().to(torch.int8)
        # In place over the (tokens x out) sums, the layer's largest tensors: the row
        # scales, then the channel scales and the bias in one pass.
        y = int8_matmul(q, self.weight_int8.t()).to(torch.float32).mul_(scale)
        y = y.mul_(self.weight_scale) if self.bias is None \
            else torch.addcmul(self.bias, y, self.weight_scale)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weights (out, in), unscaled: for model code that reads its layers'
        ``weight`` to choose a dtype (T5's feed-forward casts its input to it unless it
        is int8, as in Hugging Face's own quantised layers)."""
        return self.weight_int8

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                "int8 weights per channel, activations per token")


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 (m, k) @ int8 (k, n) -> int32, exact: ``torch._int_mm`` where it takes the
    shapes (any on the CPU), else in float64 (exact: the sums stay far below 2**53)."""
    try:
        return torch._int_mm(a, b)
    except RuntimeError:
        return (a.double() @ b.double()).to(torch.int32)


def int8_layers(module: torch.nn.Module) -> torch.nn.Module:
    """Every ``nn.Linear`` and GPT-2 style ``Conv1D`` (x @ W + b, W stored in x out) of
    ``module`` replaced by an :class:`Int8Linear`, in place; ``module`` returned, or its
    replacement when it is such a layer itself (a model that is one ``nn.Linear``)."""
    if (own := _int8_of(module)) is not None:
        return own
    for name, child in list(module.named_children()):
        setattr(module, name, int8_layers(child))
    return module


def _int8_of(layer: torch.nn.Module) -> Int8Linear | None:
    if type(layer) is torch.nn.Linear:
        return Int8Linear(layer.weight, layer.bias)
    if type(layer).__name__ == "Conv1D" and hasattr(layer, "nf"):
        conv: Any = layer
        return Int8Linear(conv.weight.detach().t(), conv.bias)
    return None
