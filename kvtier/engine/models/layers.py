"""The building blocks both models share: linear, RMSNorm, RoPE, SwiGLU.

Every block takes ``acc``, the dtype to accumulate in (``None``: the input's
own dtype, as a GPU engine runs). With ``acc=torch.float64`` on fp32 inputs a
row's result is rounded from a float64 sum and so does not depend on how many
other rows share the matmul: prefilling a prompt, or decoding it a token at a
time, writes the same KV bits. That is what lets the engine promise identical
greedy outputs with and without a prefix cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x W^T`` with no bias (the weight is ``(out_features, in_features)``, as in HF)."""

    def __init__(self, in_features: int, out_features: int, acc: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.acc = acc
        self._acc_weight: tuple[int, int, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.acc is None:
            return F.linear(x, self.weight)
        return F.linear(x.to(self.acc), self._weight_in_acc()).to(x.dtype)

    def _weight_in_acc(self) -> torch.Tensor:
        # Converted once and kept until the weight changes (loading bumps its version).
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._acc_weight is None or self._acc_weight[:2] != key:
            self._acc_weight = (*key, w.detach().to(self.acc))
        return self._acc_weight[2]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the mean of squares taken in float32 (or ``acc``)."""

    def __init__(self, dim: int, eps: float, acc: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.acc = acc or torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.acc)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.to(self.acc)).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding, rotate-half convention, on the last ``dim`` values."""

    def __init__(self, dim: int, theta: float):
        super().__init__()
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        # inv_freq on each device it was asked for, copied once: a blocking .to(device) per layer
        # and step would make the host wait for the stream each time (torch synchronizes the stream
        # after a blocking host-to-device copy), so it could not queue layers ahead of the device.
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, dim)`` cosines and sines for integer ``positions``."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[positions.device] = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``(tokens, heads, dim)``."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]


class SwiGLU(nn.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, acc: torch.dtype | None = None):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, acc)
        self.up_proj = Linear(hidden, intermediate, acc)
        self.down_proj = Linear(intermediate, hidden, acc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
