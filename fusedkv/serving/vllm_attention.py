"""The multi-head attention layer of the FusedKV decoder served by vLLM (`vllm_model`), with its RoPE and norms.

Every layer follows the plan (`config.plan`, paper Sec. 3.2):

  * a storage layer projects Q/K/V and is a plain vLLM `Attention`: it writes its cache blocks;
  * a reconstruction layer projects only Q. Its `Attention` names its first K source as
    `kv_sharing_target_layer_name`, so vLLM gives it no cache blocks of its own (the cache holds only
    storage layers: 2x the sequences or the context in the same memory for half plans). When it
    reuses one layer's K and V as they are (CLA, YOCO) that is all vLLM needs. When it reads other
    layers or fuses (Lite, FusedKV, dense, custom source maps) its backend impl is replaced by
    `paged.CrossLayerAttention`, which reads the source caches without writing any fused K/V.

A reconstruction layer holds the model's own fusion module (`fusedkv.model.fusion.KVFusion`: the same parameters
as the transformers model's, so checkpoints load by name); once the weights have loaded, its frozen `KVSources`
(the iterative chain unrolled by the model's code, paper Sec. 3.4; this rank's KV heads under tensor parallel) is
what the attention reads (`freeze_fusion`). RoPE tables come from the model's own `rope_inv_freq` / `rope_tables`
and are applied with its `apply_rope`, so a scaled RoPE rotates exactly as in transformers.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

from ..config_fields import rope_parameters_by_type
from ..model.fusion import KVFusion
from ..model.layers import apply_rope, rope_inv_freq, rope_tables
from ..plan import SLIDING, LayerKV
from .paged import CrossLayerAttention
from .parallel import rank_heads


def attention_layer_name(prefix: str, index: int) -> str:
    return f"{prefix}.layers.{index}.self_attn.attn"


def make_norm(config, dim: int) -> nn.Module:
    """RMSNorm, or Gemma's x / rms(x) * (1 + w) (`rms_norm_unit_offset`): vLLM's layers, residual add fused."""
    return (GemmaRMSNorm if config.rms_norm_unit_offset else RMSNorm)(dim, eps=config.rms_norm_eps)


@functools.lru_cache(maxsize=16)
def _rope_cache(inv_freq: tuple[float, ...], scaling: float, max_positions: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [max_positions, D] of the model's `rope_tables`, shared by every layer with this RoPE
    (like vLLM's own rotary cache)."""
    positions = torch.arange(max_positions, device=device)[None]
    cos, sin = rope_tables(positions, torch.tensor(inv_freq, dtype=torch.float64), dtype, scaling)
    return cos[0, 0], sin[0, 0]


class Rotary(nn.Module):
    """The model's RoPE for one attention type (`fusedkv.model.layers`: `rope_inv_freq` with transformers'
    scaling functions, `rope_tables`, `apply_rope`), tables precomputed up to max_position_embeddings.
    Dynamic NTK equals the unscaled RoPE up to there, which is as far as the server goes
    (`FusedKVModel` refuses a longer max_model_len)."""

    def __init__(self, config, layer_type: str):
        super().__init__()
        by_type = rope_parameters_by_type(config)
        inv_freq, scaling = rope_inv_freq(config, layer_type if layer_type in by_type else None)
        self.cos, self.sin = _rope_cache(tuple(inv_freq.tolist()), scaling, config.max_position_embeddings,
                                         torch.get_default_dtype(), torch.empty(0).device)
        self.head_dim = config.head_dim

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each x: [T, H * D] -> rotated, the same shape (the tables are looked up once for all)."""
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [T, 1, D]
        return tuple(apply_rope(x.view(x.shape[0], -1, self.head_dim), cos.to(x.dtype), sin.to(x.dtype)).view(x.shape)
                     for x in xs)


class FusedKVAttention(nn.Module):
    def __init__(self, config, layer: LayerKV, cache_config, quant_config, model_prefix: str, prefix: str):
        super().__init__()
        self.layer = layer
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        # Tensor parallel: this rank's heads; a reconstruction layer fuses only its KV heads (`parallel`).
        self.num_heads, self.num_kv_heads, self.kv_heads = rank_heads(
            total_heads, total_kv_heads, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        o_bias = bias if config.attention_output_bias is None else config.attention_output_bias
        # QK-norm (Qwen3, Gemma 3) or none (Llama, Mistral, Qwen2, Gemma 2).
        self.qk_norm = config.use_qk_norm
        if layer.stores:
            self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads,
                                              bias=bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
            if self.qk_norm:
                self.k_norm = make_norm(config, self.head_dim)
        else:
            self.q_proj = ColumnParallelLinear(config.hidden_size, total_heads * self.head_dim, bias=bias,
                                               quant_config=quant_config, prefix=f"{prefix}.q_proj")
            # The model's own fusion module, whole on every rank (its parameter names are the checkpoint's); what
            # the attention reads is frozen from it once after loading, this rank's KV heads (`freeze_fusion`).
            self.fusion = KVFusion(layer, total_kv_heads, self.head_dim, config.tie_rope_pairs)
        if self.qk_norm:
            self.q_norm = make_norm(config, self.head_dim)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=o_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary = Rotary(config, layer.attention_type)
        target = None if layer.stores else attention_layer_name(model_prefix, layer.k_sources[0])
        # Gemma scales scores by query_pre_attn_scalar^-1/2; Gemma 2 soft-caps them; window layers see the
        # last `sliding_window` positions (p - W < k <= p, vLLM's convention as the model's).
        scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        window = config.sliding_window if layer.attention_type == SLIDING else None
        self.attn = Attention(self.num_heads, self.head_dim, scale, num_kv_heads=self.num_kv_heads,
                              cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn",
                              logits_soft_cap=config.attn_logit_softcapping, per_layer_sliding_window=window,
                              kv_sharing_target_layer_name=target)
        # Plain reuse of one layer's K and V is vLLM's own KV sharing; anything else reads the sources.
        plain_reuse = layer.k_sources == layer.v_sources and len(layer.k_sources) == 1 and not layer.weighted
        if not layer.stores and not plain_reuse:
            self.attn.impl = CrossLayerAttention(
                self.attn.impl, [attention_layer_name(model_prefix, s) for s in layer.k_sources],
                [attention_layer_name(model_prefix, s) for s in layer.v_sources])

    def freeze_fusion(self) -> None:
        """Give the attention the layer's fusion as loaded (`KVFusion.frozen`), this rank's KV heads (`rank_heads`):
        once, after the checkpoint's weights are in."""
        if isinstance(self.attn.impl, CrossLayerAttention):
            self.attn.impl.take(self.fusion.frozen().kv_heads(self.kv_heads))

    def _heads_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        by_head = x.view(*x.shape[:-1], x.shape[-1] // self.head_dim, self.head_dim)
        return norm(by_head).view(x.shape)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.layer.stores:
            qkv, _ = self.qkv_proj(hidden_states)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.qk_norm:
                q, k = self._heads_norm(q, self.q_norm), self._heads_norm(k, self.k_norm)
            q, k = self.rotary(positions, q, k)
            out = self.attn(q, k, v)
        else:
            q, _ = self.q_proj(hidden_states)
            if self.qk_norm:
                q = self._heads_norm(q, self.q_norm)
            (q,) = self.rotary(positions, q)
            out = self.attn(q, None, None)
        out, _ = self.o_proj(out)
        return out
