"""Self-attention for both kinds of layer, and the per-forward record of K/V that layers share.

A storage layer projects its own K/V, applies QK-norm and RoPE, appends to the cache and attends.
A reconstruction layer has only a query projection: it reads its source layers' post-RoPE K/V from
`KVState` (filled by the storage layers earlier in the same forward) and attends over their fusion.
Which sources and which fusion is the plan's business (`LayerKV`); this module just follows it.

Either kind of layer describes what it attends over as one value, `KVSources` (sources and fusion
weights, `fusedkv.model.fusion`), and hands it to the attention implementation it was given
(`Attention.use`). This module defines the model, not how it runs: its own implementation,
`ReferenceAttention` (fuse, then SDPA), is what a plain `model(...)` / transformers `generate()` uses,
and the runtime (`fusedkv.engine`) installs faster equivalent ones once, before decoding
(`fusedkv.engine.select_runtime`). The projections are plain `nn.Linear`s; the engine may lay them out
for decoding through the one documented seam, `packed_qkv` (a storage layer's Q|K|V as one product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.reference import fuse_sources
from ..plan import SLIDING, LayerKV
from .fusion import KVFusion, KVSources
from .layers import RMSNorm, apply_rope

# Query blocks up to this length are "short" (decode steps, the last positions of a skipping prefill): where
# the runtime turns `fused_qk_rope` on they normalise and rotate Q|K in one pass, and the engine's
# implementations treat them apart.
SHORT_QUERY = 16


def first_real_key(padding_mask: torch.Tensor) -> torch.Tensor:
    """[B] int64 index of each row's first real key in a left-padded [B, S] mask (1 = real)."""
    return padding_mask.long().argmax(-1)


class KVState:
    """K/V of the storage layers for the current forward (past + new tokens), keyed by layer index. Lives
    for one forward only; the persistent part is the transformers `Cache`, which holds storage layers alone.

    Deliberately a plain class, not a dataclass or a container pytree understands: wrappers such as
    FSDP2 rebuild the dataclasses among a module's arguments, and layers must all see this one object.
    """

    __slots__ = ("cache", "causal", "padding_mask", "layers", "window_mask")

    def __init__(self, cache=None, causal: bool = False, padding_mask: torch.Tensor | None = None,
                 window_mask: torch.Tensor | None = None):
        self.cache = cache
        self.causal = causal  # no padding and no past: SDPA's causal flag replaces the mask
        self.padding_mask = padding_mask  # the 2-D [B, past + new] mask the caller gave, if any
        # Sliding-window layers: the mask restricted to the window, [B or 1, 1, T, past + new]; None when
        # no key needs masking. Window caches return only the last keys, so layers take its last columns.
        self.window_mask = window_mask
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def kv_start(self) -> torch.Tensor | None:
        """[B] index of each row's first real key (left padding), as the one-token kernels take it.
        Derived only when such a kernel runs, so other decode paths pay nothing for it."""
        return None if self.padding_mask is None else first_real_key(self.padding_mask)


class ReferenceAttention:
    """The model's own attention implementation: build the fused K/V (`fuse_sources`), then SDPA (causal
    flag or boolean mask; GQA without copies), in the K/V's dtype. Exact for every plan, the reference the
    engine's implementations are checked against, and the efficient one for long blocks (training).

    The interface every implementation has (`fusedkv.engine.backends`):
      * `__call__(q, sources, mask, causal, kv_start)` -> [B, H_q, T, D]: `q` [B, H_q, T, D] after RoPE;
        `mask` bool [B or 1, 1, T, S] or None; `causal`: SDPA's causal flag stands for the mask;
        `kv_start()`: [B] first real key per row (left padding, window), computed only if called.
      * `storage_kv(q, k, v)` -> (k, v): what a storage layer attends over and hands to the layers
        reading it, from its cache's K/V (an implementation may widen a 16-bit cache once, here)."""

    def __init__(self, scale: float, gqa: bool, softcap: float | None = None):
        self.scale, self.gqa = scale, gqa
        self.softcap = softcap  # Gemma 2's attention logit soft-capping, applied only here

    def widens(self, t: int, kv_dtype: torch.dtype) -> bool:
        """Whether a block of `t` queries over a 16-bit cache of `kv_dtype` attends in f32: never here (the
        engine's may)."""
        return False

    def storage_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return k, v

    def __call__(self, q, sources: KVSources, mask, causal: bool, kv_start) -> torch.Tensor:
        if q.dtype != sources.keys[0].dtype and not self.widens(q.shape[2], sources.keys[0].dtype):
            q = q.to(sources.keys[0].dtype)  # a 16-bit KV cache under f32 activations: attend in its dtype
        return self.attend(q, sources, mask, causal)

    def attend(self, q, sources: KVSources, mask, causal: bool) -> torch.Tensor:
        k = fuse_sources(sources.keys, sources.key_weights, q.dtype)
        v = fuse_sources(sources.values, sources.value_weights, q.dtype)
        if self.softcap:
            return self._softcapped(q, k, v, mask, causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=self.scale, enable_gqa=self.gqa)

    def _softcapped(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """Gemma 2's attention, as transformers' eager path: scores * scale, cap * tanh(scores / cap), the
        mask, softmax in f32. SDPA and the engine's kernels have no soft-capping, so only this applies it."""
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.tanh(q @ k.transpose(-1, -2) * self.scale / self.softcap) * self.softcap
        if causal and mask is None:
            t, s = scores.shape[-2:]
            mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class Attention(nn.Module):
    def __init__(self, config, layer: LayerKV):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        # Gemma scales scores by query_pre_attn_scalar^-1/2 instead of head_dim^-1/2.
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        # Gemma 2's attention logit soft-capping: SDPA and the engine's kernels cannot apply it, so a capped
        # layer always attends with the model's own implementation (`ReferenceAttention`, explicit softmax).
        self.softcap = config.attn_logit_softcapping
        # Sliding-window layers (Qwen3 / Mistral semantics): a query at position p sees keys p - W < k <= p.
        self.window = config.sliding_window if layer.attention_type == SLIDING else None
        # The engine's seam (`fusedkv.engine.packing` / `precision`): Q|K|V as one product, or None.
        self.packed_qkv = None
        bias = config.attention_bias
        o_bias = bias if config.attention_output_bias is None else config.attention_output_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        # QK-norm (Qwen3, Gemma 3) or none (Llama, Mistral, Qwen2, Gemma 2): Identity keeps one forward.
        self.qk_norm = config.use_qk_norm
        norm = (lambda: RMSNorm(self.head_dim, config.rms_norm_eps, config.rms_norm_unit_offset)) if self.qk_norm \
            else nn.Identity
        self.q_norm = norm()
        if layer.stores:
            self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
            self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
            self.k_norm = norm()
        else:
            self.fusion = KVFusion(layer, self.num_kv_heads, self.head_dim, config.tie_rope_pairs)
        # Storage layers: does a later reconstruction layer read this layer's K/V (paper Sec. 2.2)?
        self.read_later = layer.stores and any(
            layer.index in (*other.k_sources, *other.v_sources) for other in config.plan.layers if not other.stores)
        # The runtime's seam (`fusedkv.engine.select_runtime` sets it, once): short blocks of a storage layer
        # normalise and rotate Q|K in one pass (`_qk_norm_rope`). Off, the model's own two-step form.
        self.fused_qk_rope = False
        self.use(None)

    def use(self, implementation=None) -> None:
        """Attend with `implementation` from now on (`fusedkv.engine.select_runtime` calls this once per
        layer); None restores the model's own `ReferenceAttention`."""
        self.implementation = implementation or ReferenceAttention(
            self.scale, self.num_heads != self.num_kv_heads, self.softcap)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def forward(self, x, cos, sin, mask, kv: KVState) -> torch.Tensor:
        t = x.shape[1]
        if self.layer.stores:
            if self.packed_qkv is not None:
                q, k, v = self.packed_qkv(x)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if self.fused_qk_rope and t <= SHORT_QUERY and not torch.is_grad_enabled():
                q, k = self._qk_norm_rope(q, k, cos, sin)
            else:
                q = apply_rope(self.q_norm(self._heads(q, self.num_heads)), cos, sin)
                k = apply_rope(self.k_norm(self._heads(k, self.num_kv_heads)), cos, sin)
            v = self._heads(v, self.num_kv_heads)
            if kv.cache is not None:
                k, v = kv.cache.update(k, v, self.layer.index)
            cached = (k, v)
            k, v = self.implementation.storage_kv(q, k, v)
            # Hand on what this layer attends over (e.g. a widened copy of a 16-bit cache) only when a later
            # layer reads it: it may be as large as the cache in f32.
            kv.layers[self.layer.index] = (k, v) if self.read_later else cached
            sources = KVSources.own(k, v)
        else:
            q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
            sources = self.fusion.sources(kv.layers)

        causal = kv.causal
        if self.window:
            mask, causal = self._window_mask(kv, t, sources.keys[0].shape[2]), False
        out = self.implementation(q, sources, mask, causal, lambda: self._kv_start(kv, sources.keys[0]))
        return self._output(out, x)

    def _output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] attention output -> the output projection, in the residual stream's dtype."""
        b, t = x.shape[:2]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim).to(x.dtype))

    def _qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """QK-norm and RoPE of a short f32 block's query and key heads in one pass (where the runtime set
        `fused_qk_rope`: a QK-norm layer of an f32 model), over [B, T, H_q + H_kv, D]:
        the same arithmetic as `RMSNorm` (F.rms_norm's formula: x * rsqrt(mean(x^2) + eps) * w) and
        `apply_rope` applied to each, with half the op calls, which is what a one-token step pays for."""
        b, t, _ = q.shape
        n_q, n_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk = torch.cat((q, k), dim=-1).view(b, t, n_q + n_kv, d)
        weight = torch.cat((self.q_norm.gain().expand(n_q, d), self.k_norm.gain().expand(n_kv, d)))
        qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True).add_(self.q_norm.eps))
        qk = qk.mul_(weight)
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)  # [B, T, 1, D]: broadcast over the heads
        qk = apply_rope(qk, cos, sin).transpose(1, 2)  # [B, H_q + H_kv, T, D]
        return qk[:, :n_q], qk[:, n_q:]

    def _window_mask(self, kv: KVState, t: int, num_keys: int) -> torch.Tensor | None:
        """The window mask for the keys this layer attends over: a window cache returns only the last
        `num_keys` positions, so the last columns. None when every key is visible (a one-token step
        without padding over at most W keys, which a window cache guarantees)."""
        if kv.window_mask is None or (t == 1 and kv.padding_mask is None and num_keys <= self.window):
            return None
        return kv.window_mask[..., -num_keys:]

    def _kv_start(self, kv: KVState, keys: torch.Tensor) -> torch.Tensor | None:
        """[B] first key the Triton kernel reads: after left padding and, in a window layer, inside the
        window, counted in this layer's key index space (a window cache drops the oldest columns)."""
        start = kv.kv_start()
        if not self.window:
            return start
        num_keys = keys.shape[2]
        total = kv.padding_mask.shape[1] if kv.padding_mask is not None else num_keys
        band = max(num_keys - self.window, 0)
        if start is None:
            return None if band == 0 else torch.full((keys.shape[0],), band, dtype=torch.long, device=keys.device)
        return (start - (total - num_keys)).clamp(min=band)
