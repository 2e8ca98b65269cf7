"""Self-attention for both kinds of layer, and the per-forward record of K/V that layers share.

A storage layer projects its own K/V, applies QK-norm and RoPE, appends to the cache and attends.
A reconstruction layer has only a query projection: it reads its source layers' post-RoPE K/V from
`KVState` (filled by the storage layers earlier in the same forward) and attends over their fusion.
Which sources and which fusion is the plan's business (`LayerKV`); this module just follows it.

Interchangeable attention paths, all checked against each other by the tests:
  * materialized: build fused K/V, then SDPA (causal flag or boolean mask; GQA without copies).
    Compute-efficient for long query blocks (training, full-sequence scoring) and the plain reference.
  * factored (`fusedkv.kernels.reference`): key weights move onto the query and value weights onto
    the output, so no fused tensor is ever written. Used for short query blocks at inference (decode,
    the last prompt position of a skipping prefill), where it is much faster than materializing
    (`benchmarks/attention_paths_cpu.py`; figures in `docs/results.md`).
  * one-token kernels, the factored idea in one pass that reads each source once: Triton
    flash-decoding (`fusedkv.kernels`) on CUDA, and the native CPU kernel (`fusedkv.kernels.cpu_attention`),
    which also reads a 16-bit cache in place.

The path is decided in one place, `Attention._path_for`, from facts fixed when the layer is built (does
it carry fusion weights? which one-token kernel can take its sources?) plus the call's query length and
device, and the one-token kernel for a (device, dtype) once per layer (`_one_token_kernel`); `_route`
derives from the path, once per call, whether a 16-bit cache is read in f32. The kernel is then launched
with the layer's sources and weights as they are, with no second round of checks or normalisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_attention, native, triton_decode_fits, triton_decode_step, triton_runs_on
from ..kernels.reference import factored_attention, fuse_sources
from ..plan import SLIDING, LayerKV
from .fusion import KVFusion
from .layers import RMSNorm, apply_rope
from .packing import DecodePackable, Linear, PackedLinears, project, to_column_major

ATTENTION_PATHS = ("auto", "materialized", "factored", "triton", "native")
# Query blocks up to this length take the factored path under "auto" (measured by
# `benchmarks/attention_paths_cpu.py`; figures in docs/results.md).
FACTORED_MAX_QUERY = 16


def first_real_key(padding_mask: torch.Tensor) -> torch.Tensor:
    """[B] int64 index of each row's first real key in a left-padded [B, S] mask (1 = real)."""
    return padding_mask.long().argmax(-1)


class KVState:
    """K/V of the storage layers for the current forward (past + new tokens), keyed by layer index,
    plus the carried K/V of the iterative-fusion variant. Lives for one forward only; the persistent
    part is the transformers `Cache`, which holds storage layers alone.

    Deliberately a plain class, not a dataclass or a container pytree understands: wrappers such as
    FSDP2 rebuild the dataclasses among a module's arguments, and layers must all see this one object.
    """

    __slots__ = ("cache", "causal", "padding_mask", "layers", "carry", "window_mask")

    def __init__(self, cache=None, causal: bool = False, padding_mask: torch.Tensor | None = None,
                 window_mask: torch.Tensor | None = None):
        self.cache = cache
        self.causal = causal  # no padding and no past: SDPA's causal flag replaces the mask
        self.padding_mask = padding_mask  # the 2-D [B, past + new] mask the caller gave, if any
        # Sliding-window layers: the mask restricted to the window, [B or 1, 1, T, past + new]; None when
        # no key needs masking. Window caches return only the last keys, so layers take its last columns.
        self.window_mask = window_mask
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.carry: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def kv_start(self) -> torch.Tensor | None:
        """[B] index of each row's first real key (left padding), as the one-token kernels take it.
        Derived only when such a kernel runs, so other decode paths pay nothing for it."""
        return None if self.padding_mask is None else first_real_key(self.padding_mask)


class Attention(nn.Module, DecodePackable):
    def __init__(self, config, layer: LayerKV):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        # Gemma scales scores by query_pre_attn_scalar^-1/2 instead of head_dim^-1/2.
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        # Gemma 2's attention logit soft-capping: SDPA and the kernels cannot apply it, so a capped layer
        # always takes the materialized path with an explicit softmax (`_softcapped_attention`).
        self.softcap = config.attn_logit_softcapping
        self.iterative = config.fusion_init == "iterative" and not layer.stores
        # Sliding-window layers (Qwen3 / Mistral semantics): a query at position p sees keys p - W < k <= p.
        self.window = config.sliding_window if layer.attention_type == SLIDING else None
        self.path = "auto"
        self.packed_qkv: PackedLinears | None = None  # set by `pack_for_decode` (storage layers)
        bias = config.attention_bias
        o_bias = bias if config.attention_output_bias is None else config.attention_output_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        # QK-norm (Qwen3, Gemma 3) or none (Llama, Mistral, Qwen2, Gemma 2): Identity keeps one forward.
        self.qk_norm = config.use_qk_norm
        norm = (lambda: RMSNorm(self.head_dim, config.rms_norm_eps, config.rms_norm_unit_offset)) if self.qk_norm \
            else nn.Identity
        self.q_norm = norm()
        if layer.stores:
            self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
            self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
            self.k_norm = norm()
        else:
            self.fusion = KVFusion(layer, self.num_kv_heads, self.head_dim, config.tie_rope_pairs)
        # Decided once, from the plan and the shapes: whether the layer's K/V carry fusion weights (the
        # factored path pays off only then), and whether the one-token kernels take its sources (the
        # iterative variant hands them one fused K and V).
        fused = not layer.stores and not self.iterative
        self.weighted = fused and (layer.k_fusion != "reuse" or layer.v_fusion != "reuse")
        k_count, v_count = (len(layer.k_sources), len(layer.v_sources)) if fused else (1, 1)
        scalar = fused and "scalar" in (layer.k_fusion, layer.v_fusion)
        self.triton_fits = not scalar and not self.softcap and triton_decode_fits(self.head_dim, k_count, v_count)
        self.native_fits = not scalar and not self.softcap and cpu_attention.supports(
            self.head_dim, self.num_heads, self.num_kv_heads, k_count, v_count)
        self._one_token: dict[tuple, str | None] = {}  # (device, dtype) -> "triton", "native" or None
        # Storage layers: does a later reconstruction layer read this layer's K/V (paper Sec. 2.2)?
        self.read_later = layer.stores and any(
            layer.index in (*other.k_sources, *other.v_sources) for other in config.plan.layers if not other.stores)

    def set_path(self, path: str) -> None:
        """"auto", or force "materialized", "factored", or a one-token kernel, "triton" or "native" (one-token
        steps only; longer blocks use SDPA)."""
        if path not in ATTENTION_PATHS:
            raise ValueError(f"attention path {path!r}: choose one of {ATTENTION_PATHS}")
        if path == "triton" and not self.triton_fits:
            raise ValueError(
                f"layer {self.layer.index + 1}: the Triton decode kernel takes at most 2 K and 2 V sources with "
                f"per-channel (not scalar) weights and a head_dim that is a power of two in [16, 256] "
                f"(head_dim={self.head_dim}); use the 'factored' or 'materialized' path"
            )
        if path == "native" and not self.native_fits:
            raise ValueError(f"layer {self.layer.index + 1}: the native CPU decode kernel takes 1-2 K and 1-2 V "
                             "sources with per-channel (not scalar) weights; use the 'factored' or 'materialized' path")
        self.path = path

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def forward(self, x, cos, sin, mask, kv: KVState) -> torch.Tensor:
        b, t, _ = x.shape
        if self.layer.stores:
            q, k, v = project(x, [self.q_proj, self.k_proj, self.v_proj], self.packed_qkv)
            if self.qk_norm and t <= FACTORED_MAX_QUERY and q.dtype == torch.float32 and not torch.is_grad_enabled():
                q, k = self._qk_norm_rope(q, k, cos, sin)
            else:
                q = apply_rope(self.q_norm(self._heads(q, self.num_heads)), cos, sin)
                k = apply_rope(self.k_norm(self._heads(k, self.num_kv_heads)), cos, sin)
            v = self._heads(v, self.num_kv_heads)
            path, widen = self._route(t, q)
            if kv.cache is not None:
                k, v = kv.cache.update(k, v, self.layer.index)
            cached = (k, v)
            if k.dtype != q.dtype and widen and path != "native":
                # A 16-bit cache read in f32 by a path that cannot widen it as it reads (see `_route`):
                # upcast once, here, and hand the f32 copy to the reconstruction layers that read this layer
                # (kept only when one does: it is as large as the cache in f32), instead of each of them
                # converting the same K/V again.
                k, v = k.to(q.dtype), v.to(q.dtype)
            kv.layers[self.layer.index] = (k, v) if self.read_later else cached
            k_src, k_w, v_src, v_w = [k], [None], [v], [None]
        else:
            q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
            path, widen = self._route(t, q)
            if self.iterative:
                k_src, k_w, v_src, v_w = self._iterative_sources(kv)
            else:
                k_src = [kv.layers[s][0] for s in self.layer.k_sources]
                v_src = [kv.layers[s][1] for s in self.layer.v_sources]
                k_w, v_w = self.fusion.key_weights(), self.fusion.value_weights()

        causal = kv.causal
        if self.window:
            mask, causal = self._window_mask(kv, t, k_src[0].shape[2]), False
        if q.dtype != k_src[0].dtype and not widen:  # a 16-bit KV cache under f32 activations: attend in
            q = q.to(k_src[0].dtype)  # the cache's dtype, except where `_route` says f32
        if path == "native":
            out = cpu_attention.decode_attention(q, k_src, k_w, v_src, v_w, self._kv_start(kv, k_src[0]), self.scale)
            if out is not None:
                return self._output(out, x)
            path = "factored" if self.weighted else "materialized"  # sources it cannot read in place
        if path == "triton":
            out = triton_decode_step(q[:, :, 0], k_src, k_w, v_src, v_w, kv_start=self._kv_start(kv, k_src[0]),
                                     scale=self.scale).unsqueeze(2)
        elif path == "factored":
            if causal and mask is None:  # the causal flag is SDPA's; spell it out here
                mask = torch.ones(t, k_src[0].shape[2], dtype=torch.bool, device=q.device).tril(k_src[0].shape[2] - t)
            out = factored_attention(q, k_src, k_w, v_src, v_w, mask=mask, scale=self.scale)
        elif self.softcap:
            k, v = fuse_sources(k_src, k_w, q.dtype), fuse_sources(v_src, v_w, q.dtype)
            out = self._softcapped_attention(q, k, v, mask, causal)
        else:
            k, v = fuse_sources(k_src, k_w, q.dtype), fuse_sources(v_src, v_w, q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                 scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return self._output(out, x)

    def _softcapped_attention(self, q, k, v, mask, causal) -> torch.Tensor:
        """Gemma 2's attention, as transformers' eager path: scores * scale, cap * tanh(scores / cap), the
        mask, softmax in f32. Materialized only: SDPA and the kernels have no soft-capping."""
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.tanh(q @ k.transpose(-1, -2) * self.scale / self.softcap) * self.softcap
        if causal and mask is None:
            t, s = scores.shape[-2:]
            mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    def _output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] attention output -> the output projection, in the residual stream's dtype."""
        b, t = x.shape[:2]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim).to(x.dtype))

    def _route(self, t: int, q: torch.Tensor) -> tuple[str, bool]:
        """The attention path (`_path_for`) and whether a 16-bit cache is read in f32, the one rule for both:
        a short block (decode) on CPU attends in f32, because PyTorch's CPU SDPA at one query row is 3-4x
        slower over bf16 K/V than converting them and running its f32 kernel (`benchmarks/cpu_decode.py
        --overhead`), and f32 is the more exact. The native kernel widens the cache as it reads it; the
        other CPU paths read K/V upcast once by their storage layer. Triton (its interpreter on CPU) reads
        the cache's dtype itself."""
        path = self._path_for(t, q)
        return path, path != "triton" and t <= FACTORED_MAX_QUERY and q.device.type == "cpu"

    def _one_token_kernel(self, q: torch.Tensor) -> str | None:
        """The one-token kernel for this layer on q's device and dtype: "triton" where Triton runs (CUDA, or
        its interpreter) and takes the layer's sources, "native" on CPU where the native kernels are built
        and take them, else None. Decided once per (device, dtype)."""
        key = (q.device, q.dtype)
        kernel = self._one_token.get(key, False)
        if kernel is False:
            if self.triton_fits and triton_runs_on(q.device, q.dtype):
                kernel = "triton"
            elif self.native_fits and q.device.type == "cpu" and native.available():
                kernel = "native"
            else:
                kernel = None
            self._one_token[key] = kernel
        return kernel

    def _qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """QK-norm and RoPE of a short f32 block's query and key heads in one pass, over [B, T, H_q + H_kv, D]:
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

    def _path_for(self, t: int, q: torch.Tensor) -> str:
        """The forced path, or under "auto": the one-token kernel (Triton or native) for one-token decode
        where one runs and takes this layer's sources, factored for short weighted query blocks at
        inference, SDPA otherwise (training keeps SDPA's fused kernels). The one-token kernels only take
        one query token; longer blocks use SDPA."""
        if self.softcap:
            return "materialized"  # soft-capping: only `_softcapped_attention` applies it
        if self.path != "auto":
            return "materialized" if self.path in ("triton", "native") and t > 1 else self.path
        if torch.is_grad_enabled() and q.requires_grad:
            return "materialized"
        if t == 1:
            kernel = self._one_token_kernel(q)
            if kernel is not None:
                return kernel
        return "factored" if self.weighted and t <= FACTORED_MAX_QUERY else "materialized"

    # ---- decode layout (`fusedkv.model.packing`): Q|K|V in one buffer, O and lone Q column-major -------
    def pack_for_decode(self) -> None:
        if self.layer.stores and not self.is_packed():
            self.packed_qkv = PackedLinears([self.q_proj, self.k_proj, self.v_proj])
        elif not self.layer.stores:
            to_column_major(self.q_proj)
        to_column_major(self.o_proj)

    def drop_packing(self) -> None:
        self.packed_qkv = None

    def is_packed(self) -> bool:
        return self.packed_qkv is not None and self.packed_qkv.active()

    def _iterative_sources(self, kv: KVState):
        """The iterative variant: fuse the fixed first source with the K/V carried up from the
        previous reconstruction layer (initially the second source), and carry the result on."""
        first, second = self.layer.k_sources
        chain = self.layer.k_sources
        carry_k, carry_v = kv.carry.get(chain, kv.layers[second])
        k1, v1 = kv.layers[first]
        (a_fixed, a_carry), (b_fixed, b_carry) = self.fusion.key_weights(), self.fusion.value_weights()
        k = a_fixed[None, :, None, :] * k1 + a_carry[None, :, None, :] * carry_k
        v = b_fixed[None, :, None, :] * v1 + b_carry[None, :, None, :] * carry_v
        kv.carry[chain] = (k, v)
        return [k], [None], [v], [None]

