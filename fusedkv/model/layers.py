"""The ordinary building blocks of a Qwen3-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP.

Nothing here knows about KV sharing. RoPE uses the rotate-half layout of transformers' Qwen3 (channel
j is paired with channel j + D/2), which is what the key-weight tying in `fusion.py` must respect and
what makes converted Qwen3 checkpoints give identical logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # no casts on the fp32 decode path
        # Normalise in fp32 like Qwen3, so bf16 training matches the reference numerics.
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies [head_dim/2] (float64) and the attention scaling of its cos/sin tables, for
    `config.rope_parameters`: the default RoPE here (exactly as before scaling existed), any other
    `rope_type` by transformers' own `ROPE_INIT_FUNCTIONS` (YaRN: the interpolated frequencies and the
    temperature sqrt(1/t) that transformers multiplies into cos and sin), so scaled checkpoints match."""
    rope = config.rope_parameters
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return _default_inv_freq(config.head_dim, float(rope["rope_theta"])), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_parameters.rope_type={rope_type!r}: choose default or one of "
                         f"{sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq.to(torch.float64), float(attention_scaling)


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    channels = torch.arange(0, head_dim, 2, dtype=torch.float64)
    return 1.0 / (theta ** (channels / head_dim))


def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype):
    """RoPE tables for integer positions [B, T]: (cos, signed sin), each [B, 1, T, D] (broadcast over heads),
    both times `attention_scaling` (1 for the default RoPE; see `rope_inv_freq`).

    The sin table carries rotate-half's sign (negative on the first D/2 channels), so `apply_rope` is a
    roll and two products: two fewer ops per call, which matters in a one-token decode step.
    Computed on the fly from the positions (D/2 frequencies): cheap next to the projections, and it
    keeps the model free of non-persistent buffers that checkpoint loading would have to rebuild.
    """
    freqs = position_ids.to(torch.float64)[:, None, :, None] * inv_freq.to(position_ids.device)  # [B, 1, T, D/2]
    cos, sin = torch.cat((freqs, freqs), dim=-1).cos(), freqs.sin()
    sin = torch.cat((-sin, sin), dim=-1)
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """`rope_tables` of the default (unscaled) RoPE of base `theta`."""
    return rope_tables(position_ids, _default_inv_freq(head_dim, theta), 1.0, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; tables from `rope_cos_sin`. Equals x * cos + rotate_half(x) * sin, where
    rotate_half(x) = cat(-x2, x1): the roll gives cat(x2, x1) and the table supplies the sign."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # The engine's seam (`fusedkv.engine.packing` / `precision`): gate|up as one product, or None.
        self.packed_gate_up = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_gate_up is not None:
            gate, up = self.packed_gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)
