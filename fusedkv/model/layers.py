"""The ordinary building blocks of a Qwen3-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP.

Nothing here knows about KV sharing. RoPE uses the rotate-half layout of transformers' Qwen3 (channel
j is paired with channel j + D/2), which is what the key-weight tying in `fusion.py` must respect and
what makes converted Qwen3 checkpoints give identical logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like Qwen3, so bf16 training matches the reference numerics.
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [B, T, D] for integer positions [B, T].

    Computed on the fly from the positions (D/2 frequencies): cheap next to the projections, and it
    keeps the model free of non-persistent buffers that checkpoint loading would have to rebuild.
    """
    channels = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float64)
    inv_freq = 1.0 / (theta ** (channels / head_dim))
    freqs = position_ids.to(torch.float64)[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
