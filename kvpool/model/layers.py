"""Stateless building blocks: RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpool.model.config import YarnScaling
from kvpool.model.invariant import linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@dataclass(slots=True)
class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions), both rope layouts.

    Layouts (``apply(..., interleave=)``): rotate-half pairs dim i with
    i + dim/2; interleaved (DeepSeek's checkpoints, HF's default) pairs
    (0, 1), (2, 3), ... and returns the rotated pairs de-interleaved — evens'
    rotations then odds' — exactly as HF's ``apply_rotary_pos_emb_interleave``.

    Invariant: `cos` and `sin` are [max_positions, dim // 2] float32. The
    tables are built in float64 so every machine rounds them the same way.
    With YaRN `scaling` the frequencies are YaRN's and both tables carry its
    cos/sin factor, as in HF's DeepSeek-V3.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(
        cls, dim: int, theta: float, max_positions: int, device: torch.device | str = "cpu",
        scaling: YarnScaling | None = None,
    ) -> RotaryEmbedding:
        if scaling is None:
            inv_freq, factor = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim), 1.0
        else:
            inv_freq = torch.tensor(scaling.inv_freq(dim, theta), dtype=torch.float64)
            factor = scaling.cos_sin_factor
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        return cls(
            cos=(angles.cos() * factor).to(torch.float32).to(device),
            sin=(angles.sin() * factor).to(torch.float32).to(device),
        )

    def apply(self, x: torch.Tensor, positions: torch.Tensor, interleave: bool = False) -> torch.Tensor:
        """Rotate x [n, ..., dim] by the angle of each token's position [n]."""
        cos = self.cos[positions]
        sin = self.sin[positions]
        # broadcast the per-token tables over any head dims between n and dim
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass(slots=True)
class SwiGLUMLP:
    """down(silu(gate(x)) * up(x)); weights are [out, in] as in nn.Linear."""

    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(F.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj), self.down_proj)
