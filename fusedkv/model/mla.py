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

Two exact attention paths:
  * expanded ("materialized"): c -> per-head K/V through kv_b_proj, then SDPA. The reference, and the
    compute-efficient path for long query blocks (training, prefill).
  * absorbed ("factored"; DeepSeek-V2 Sec. 2.1.2): W_UK moves into the query (q_h W_UK,h attends
    directly over c) and W_UV into the output (attention-weighted c, then W_UV,h), so decode reads the
    latent cache as it is and never expands it per head; fusion weights likewise move onto the query
    and the output, so nothing fused is written either.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.reference import fuse_sources
from ..plan import LayerKV
from .fusion import KVFusion
from .layers import RMSNorm, apply_rope

# Query blocks up to this length take the absorbed path under "auto" at inference (as the factored
# path of ordinary attention).
ABSORBED_MAX_QUERY = 16


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
    exclusion and the plan's fusion modes are KVFusion's."""

    def __init__(self, layer: LayerKV, kv_lora_rank: int, rope_dim: int, tie_rope_pairs: bool = True):
        nn.Module.__init__(self)
        self.layer, self.num_kv_heads, self.head_dim = layer, 1, rope_dim
        self.kv_lora_rank, self.tie_rope_pairs = kv_lora_rank, tie_rope_pairs
        self.k_weight = self._make(layer.k_fusion, len(layer.k_sources), rope_dim // 2 if tie_rope_pairs else rope_dim)
        self.v_weight = self._make(layer.v_fusion, len(layer.v_sources), kv_lora_rank)

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
        self.path = "auto"
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
            lat_src, lat_w, rope_src, rope_w = [latent], [None], [k_rope], [None]
        else:
            lat_src = [kv.layers[s][0] for s in self.layer.v_sources]
            rope_src = [kv.layers[s][1] for s in self.layer.k_sources]
            lat_w, rope_w = self.fusion.value_weights(), self.fusion.key_weights()

        absorbed = self._absorbed(t, q)
        if absorbed and kv.causal and mask is None:
            s = lat_src[0].shape[2]  # the causal flag is SDPA's; spell it out for the absorbed path
            mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(s - t)[None, None]
        if absorbed:
            out = self._absorbed_attention(q_nope, q_rope, lat_src, lat_w, rope_src, rope_w, mask)
        else:
            out = self._expanded_attention(q_nope, q_rope, fuse_sources(lat_src, lat_w),
                                           fuse_sources(rope_src, rope_w), mask, kv.causal and mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.v_dim))

    def _rope_layout(self, x: torch.Tensor) -> torch.Tensor:
        """With `rope_interleave` (DeepSeek's layout: pairs (x0, x1), (x2, x3), ...) the RoPE channels are
        regrouped into rotate-half order (x0, x2, ..., x1, x3, ...), as transformers'
        `apply_rotary_pos_emb_interleave` does; everything after RoPE (cache, fusion weights tied over
        pairs (j, j + d_R/2), attention) then sees the rotate-half layout either way."""
        if not self.rope_interleave:
            return x
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)

    def set_path(self, path: str) -> None:
        """"auto", or force "materialized" (expanded) or "factored" (absorbed)."""
        if path not in ("auto", "materialized", "factored"):
            raise ValueError(f"attention path {path!r}: MLA layers take 'auto', 'materialized' (expanded) or "
                             "'factored' (absorbed); there is no Triton kernel for MLA")
        self.path = path

    def _absorbed(self, t: int, q: torch.Tensor) -> bool:
        """Forced by the path, or under "auto": absorbed for short query blocks at inference (decode,
        the last position of a skipping prefill), expanded otherwise."""
        if self.path != "auto":
            return self.path == "factored"
        return t <= ABSORBED_MAX_QUERY and not (torch.is_grad_enabled() and q.requires_grad)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as W_UK [H, d_nope, r] and W_UV [H, d_v, r] (views, no copy)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _expanded_attention(self, q_nope, q_rope, latent, k_rope, mask, causal) -> torch.Tensor:
        b, _, s, _ = latent.shape
        kv_up = self.kv_b_proj(latent[:, 0]).view(b, s, self.num_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv_up.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)

    def _absorbed_attention(self, q_nope, q_rope, lat_src, lat_w, rope_src, rope_w, mask) -> torch.Tensor:
        """scores_h = (q_C,h W_UK,h) . c + q_R,h . k_R ;  out_h = W_UV,h (softmax(scores_h) c), summed over
        fusion sources with their weights on the query (scores) and on the output (values). Heads are
        rows of one matmul per source over the shared [S, r] latent: nothing is expanded per head."""
        b, nh, t, _ = q_nope.shape
        w_uk, w_uv = self._up_weights()
        # Per-head products as one batched matmul over heads ([H, B*T, .] @ [H, ., .]): broadcasting the
        # [H, d, r] weights over the batch instead would copy them B times.
        q_lat = torch.matmul(q_nope.transpose(0, 1).reshape(nh, b * t, self.nope_dim), w_uk)
        q_lat = q_lat.view(nh, b, t, self.kv_lora_rank).transpose(0, 1).reshape(b, nh * t, self.kv_lora_rank)
        q_lat = q_lat * self.scale
        q_rope = (q_rope * self.scale).reshape(b, nh * t, self.rope_dim)
        scores = None
        for queries, sources, weights in ((q_lat, lat_src, lat_w), (q_rope, rope_src, rope_w)):
            for src, w in zip(sources, weights):
                part = torch.matmul(queries if w is None else queries * w, src[:, 0].transpose(-1, -2))
                scores = part if scores is None else scores.add_(part)
        if mask is not None:
            scores = scores.view(b, nh, t, -1).masked_fill(~mask, float("-inf")).view(b, nh * t, -1)
        p = torch.softmax(scores, dim=-1)
        o_lat = None
        for src, w in zip(lat_src, lat_w):
            part = torch.matmul(p, src[:, 0])
            part = part if w is None else part * w
            o_lat = part if o_lat is None else o_lat + part
        o_lat = o_lat.view(b, nh, t, self.kv_lora_rank).transpose(0, 1).reshape(nh, b * t, self.kv_lora_rank)
        return torch.matmul(o_lat, w_uv.transpose(-1, -2)).view(nh, b, t, self.v_dim).transpose(0, 1)


__all__ = ["MLA", "LatentFusion"]
