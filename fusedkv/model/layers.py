"""The ordinary building blocks of a decoder: RMSNorm, rotary embeddings, the gated MLP (SwiGLU / GeGLU).

Nothing here knows about KV sharing. RoPE uses the rotate-half layout of transformers' Llama / Qwen3 /
Gemma (channel j is paired with channel j + D/2), which is what the key-weight tying in `fusion.py` must
respect and what makes converted checkpoints give identical logits. Every RoPE scaling type goes through
`rope_inv_freq`, which uses transformers' own `ROPE_INIT_FUNCTIONS`, so a scaled checkpoint rotates its
queries and keys exactly as transformers does.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..config_fields import rope_parameters_by_type


class RMSNorm(nn.Module):
    """RMSNorm; with `unit_offset` Gemma's form, x / rms(x) * (1 + w), whose weights are stored around 0."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def gain(self) -> torch.Tensor:
        """The multiplier applied after normalising (in fp32 for Gemma's form, as transformers computes it)."""
        return 1.0 + self.weight.float() if self.unit_offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.gain(), self.eps)  # no casts on the fp32 decode path
        # Normalise in fp32 like Qwen3 and Gemma, so bf16 training matches the reference numerics.
        return F.rms_norm(x.float(), (x.shape[-1],), self.gain().float(), self.eps).to(x.dtype)


def rope_inv_freq(config, layer_type: str | None = None, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2] in float64, attention scaling of cos/sin) of `config`'s RoPE for layers of
    `layer_type` (None: the one RoPE all layers share). Scaled types (linear, dynamic, llama3, yarn) come
    from transformers' own `ROPE_INIT_FUNCTIONS`; dynamic NTK takes the current `seq_len` (max position + 1),
    as transformers' rotary embedding recomputes it in each forward past max_position_embeddings.
    The default RoPE is computed here in float64 (transformers: float32), as fusedkv always has."""
    by_type = rope_parameters_by_type(config)
    params = by_type[layer_type if layer_type in by_type else next(iter(by_type))]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return default_inv_freq(config.head_dim, params["rope_theta"]), 1.0
    # transformers' functions read these attributes of a config, with rope_parameters for one layer type.
    view = types.SimpleNamespace(
        rope_parameters=params, head_dim=config.head_dim, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, max_position_embeddings=config.max_position_embeddings,
        standardize_rope_params=lambda: None)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](view, torch.device("cpu"), seq_len=seq_len)
    return inv_freq.to(torch.float64), float(scaling)


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The unscaled RoPE frequencies theta^(-2j/D), in float64."""
    channels = torch.arange(0, head_dim, 2, dtype=torch.float64)
    return 1.0 / (float(theta) ** (channels / head_dim))


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """The unscaled RoPE's tables (`rope_tables` of `default_inv_freq`)."""
    return rope_tables(position_ids, default_inv_freq(head_dim, theta), dtype)


def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, attention_scaling: float = 1.0):
    """RoPE tables for integer positions [B, T] and `rope_inv_freq`'s frequencies: (cos, signed sin), each
    [B, 1, T, D] (broadcast over heads), times the attention scaling (YaRN) where it is not 1.

    The sin table carries rotate-half's sign (negative on the first D/2 channels), so `apply_rope` is a
    roll and two products: two fewer ops per call, which matters in a one-token decode step.
    Computed on the fly from the positions (D/2 frequencies): cheap next to the projections, and it
    keeps the model free of non-persistent buffers that checkpoint loading would have to rebuild.
    """
    freqs = position_ids.to(torch.float64)[:, None, :, None] * inv_freq.to(position_ids.device)  # [B, 1, T, D/2]
    sin = freqs.sin()
    cos, sin = torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; tables from `rope_cos_sin`. Equals x * cos + rotate_half(x) * sin, where
    rotate_half(x) = cat(-x2, x1): the roll gives cat(x2, x1) and the table supplies the sign."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class SwiGLU(nn.Module):
    """The gated MLP down(act(gate(x)) * up(x)): SwiGLU with SiLU (Llama, Qwen), GeGLU with `hidden_act`
    gelu_pytorch_tanh (Gemma); biases with Llama's `mlp_bias`."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = F.silu if hidden_act == "silu" else ACT2FN[hidden_act]  # transformers' own functions
        # The engine's seam (`fusedkv.engine.packing` / `precision`): gate|up as one product, or None.
        self.packed_gate_up = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_gate_up is not None:
            gate, up = self.packed_gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)
