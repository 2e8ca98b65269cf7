"""Multi-head latent attention (DeepSeek-V2/V3) for both kinds of layer, with FusedKV over the latents.

MLA compresses each token's keys and values jointly into one latent (DeepSeek-V2, Sec. 2.1.2):

    c = RMSNorm(W_DKV x)  [r = kv_lora_rank]         k_R = RoPE(W_KR x)  [d_R = qk_rope_head_dim, shared by heads]
    k_h = [W_UK,h c ; k_R]    v_h = W_UV,h c        (W_UK | W_UV = kv_b_proj, per head)
    q_h = [q_C,h ; RoPE(q_R,h)]  from x (q_proj) or a low-rank path (q_a_proj, q_a_layernorm, q_b_proj)

so the cache holds only c and k_R per token: `kv_lora_rank + qk_rope_head_dim` values instead of
`num_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)`. Module and parameter names are
transformers' `DeepseekV3Attention`, so its weights copy over unchanged, in either RoPE layout: rotate-half,
or DeepSeek's interleaved pairs with `rope_interleave` (regrouped into rotate-half order before RoPE).

FusedKV on MLA (paper App. A.6): a storage layer writes (c, k_R) to the cache, keys = latent,
values = RoPE key, in transformers' `DynamicCache` (as transformers' DeepSeek-V3 does); a
reconstruction layer has no W_DKV / W_KR of its own and fuses its sources' latents and RoPE keys,

    c^i = sum_s a_s (.) c^s       k_R^i = sum_s w_s (.) k_R^s

with `a_s` per latent channel and `w_s` tied over each RoPE rotation pair (j, j + d_R/2), so the fused
key still depends only on relative position (the argument of paper Sec. 3.2 for ordinary keys). Each
layer keeps its own query path, up-projection kv_b_proj and output projection. Because the latent
yields both K and V, "K from one layer, V from another" (fusedkv-lite) has no MLA counterpart; the
config refuses it.

Like `Attention`, a layer describes what it attends over as one `KVSources` (keys: the RoPE keys,
values: the latents, each with its fusion weights) and calls the implementation it was given (`use`).
The model's own, `ExpandedAttention`, is the reference: c -> per-head K/V through kv_b_proj, then SDPA,
also the compute-efficient one for long blocks (training, prefill). The engine adds the absorbed form
for short blocks (DeepSeek-V2 Sec. 2.1.2; `fusedkv.engine.backends.AbsorbedMLA`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.reference import fuse_sources
from ..plan import LayerKV
from .fusion import KVFusion, KVSources
from .layers import RMSNorm, apply_rope


def softmax_scale(config, qk_dim: int) -> float:
    """1/sqrt(qk_dim), times mscale^2 under scaled RoPE with `mscale_all_dim` (DeepSeek's YaRN, as
    transformers' DeepseekV3Attention applies it: mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for
    factor > 1). It tempers every query-key product, the non-rotated channels included; the cos/sin
    tables carry YaRN's own factor (`rope_inv_freq`)."""
    scale = qk_dim**-0.5
    rope = config.rope_parameters
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale = scale * mscale * mscale
    return scale


class LatentFusion(KVFusion):
    """Fusion weights of an MLA reconstruction layer. `k_weight` fuses the decoupled RoPE keys
    ([sources, 1, d_R/2] when tied over rotation pairs), `v_weight` the latents ([sources, 1, r]); one
    "head" each, since MLA's latent and RoPE key are shared by all heads. Initialisation, weight decay
    exclusion and the plan's fusion modes are KVFusion's. A source layer's record is (latent, RoPE key), so
    the keys (RoPE) sit in its second slot and the values (latents) in its first."""

    KEY_SLOT, VALUE_SLOT = 1, 0

    def __init__(self, layer: LayerKV, kv_lora_rank: int, rope_dim: int, tie_rope_pairs: bool = True):
        nn.Module.__init__(self)
        self.layer, self.num_kv_heads, self.head_dim = layer, 1, rope_dim
        self.kv_lora_rank, self.tie_rope_pairs = kv_lora_rank, tie_rope_pairs
        self.k_weight = self._make(layer.weight_shape("k", 1, rope_dim // 2 if tie_rope_pairs else rope_dim))
        self.v_weight = self._make(layer.weight_shape("v", 1, kv_lora_rank))
        self.chain = None  # no iterative variant for MLA (the config refuses it)

    def value_weights(self) -> list[torch.Tensor | None]:
        w = self.v_weight
        if w is not None and w.dim() == 1:  # scalar mode: one number per source, over the latent width
            return [x.expand(1, self.kv_lora_rank) for x in w]
        return super().value_weights()


class MLA(nn.Module):
    def __init__(self, config, layer: LayerKV):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.kv_lora_rank, self.q_lora_rank = config.kv_lora_rank, config.q_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.scale = softmax_scale(config, self.qk_dim)
        self.rope_interleave = config.rope_interleave
        h, bias = config.hidden_size, config.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        if layer.stores:
            self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias=bias)
            self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        else:
            self.fusion = LatentFusion(layer, self.kv_lora_rank, self.rope_dim, config.tie_rope_pairs)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.use(None)

    def forward(self, x, cos, sin, mask, kv) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(b, t, self.num_heads, self.qk_dim).transpose(1, 2).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_rope(self._rope_layout(q_rope), cos, sin)
        if self.layer.stores:
            latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
            latent = self.kv_a_layernorm(latent).unsqueeze(1)  # [B, 1, T, r]: one "head", shared by all
            k_rope = apply_rope(self._rope_layout(k_rope.unsqueeze(1)), cos, sin)  # [B, 1, T, d_R]
            if kv.cache is not None:
                latent, k_rope = kv.cache.update(latent, k_rope, self.layer.index)
            kv.layers[self.layer.index] = (latent, k_rope)
            sources = KVSources.own(k_rope, latent)  # keys: the RoPE key; values: the latent
        else:
            sources = self.fusion.sources(kv.layers)
        out = self.implementation(self, q_nope, q_rope, sources, mask, kv.causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.v_dim))

    def use(self, implementation=None) -> None:
        """Attend with `implementation` (`fusedkv.engine.select_runtime`); None: the model's own
        `ExpandedAttention`. Called as `implementation(layer, q_nope, q_rope, sources, mask, causal)`."""
        self.implementation = implementation or ExpandedAttention()

    def _rope_layout(self, x: torch.Tensor) -> torch.Tensor:
        """With `rope_interleave` (DeepSeek's layout: pairs (x0, x1), (x2, x3), ...) the RoPE channels are
        regrouped into rotate-half order (x0, x2, ..., x1, x3, ...), as transformers'
        `apply_rotary_pos_emb_interleave` does; everything after RoPE (cache, fusion weights tied over
        pairs (j, j + d_R/2), attention) then sees the rotate-half layout either way."""
        if not self.rope_interleave:
            return x
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as W_UK [H, d_nope, r] and W_UV [H, d_v, r] (views, no copy)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def expanded_attention(self, q_nope, q_rope, latent, k_rope, mask, causal) -> torch.Tensor:
        b, _, s, _ = latent.shape
        kv_up = self.kv_b_proj(latent[:, 0]).view(b, s, self.num_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv_up.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)


class ExpandedAttention:
    """MLA's reference implementation: fuse the latents and RoPE keys, expand per head, SDPA."""

    def __call__(self, layer: MLA, q_nope, q_rope, sources: KVSources, mask, causal: bool) -> torch.Tensor:
        latent = fuse_sources(sources.values, sources.value_weights)
        k_rope = fuse_sources(sources.keys, sources.key_weights)
        return layer.expanded_attention(q_nope, q_rope, latent, k_rope, mask, causal and mask is None)


__all__ = ["MLA", "LatentFusion", "ExpandedAttention"]
