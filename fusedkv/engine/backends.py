"""Every attention implementation the engine installs, behind the model's one interface.

An attention layer describes what it attends over as one `KVSources` value and calls the implementation
it was given (`Attention.use`; the interface is documented on the model's own, `ReferenceAttention`):

    implementation(q, sources, mask, causal, kv_start) -> [B, H_q, T, D]
    implementation.storage_kv(q, k, v) -> what a storage layer attends over and hands on

Which implementation a layer gets is decided once, by `fusedkv.engine.selection.select_runtime`, from
facts fixed before decoding (the plan's sources and weights, the model's device and dtype). Here nothing
is checked again: the only branch per call is the query length, inherent to attention (one decode token,
a short block, a long block). The implementations:

  * `Materialized`: build the fused K/V, then SDPA. The compute-efficient one for long blocks (training,
    prefill) and the one for unweighted layers.
  * `Factored` (paper Sec. 2.5; `fusedkv.kernels.reference.factored`): key weights move onto the query and
    value weights onto the output, so no fused tensor is written. For short blocks of weighted layers,
    where it is much faster than materializing (`benchmarks/attention_paths_cpu.py`; figures in
    `docs/results.md`); longer blocks go to `Materialized`.
  * `NativeOneToken` / `TritonOneToken`: the factored idea in one pass that reads each source once, for one
    query token: the native CPU kernel (`fusedkv.kernels.cpu_attention`, which also reads a 16-bit cache in
    place) and Triton flash-decoding (`fusedkv.kernels`, CUDA or its interpreter). Blocks go to the
    implementation they wrap.
  * `AbsorbedMLA` (DeepSeek-V2 Sec. 2.1.2): MLA's up-projection absorbed into the query and the output, so
    decode reads the latent cache as it is; long blocks keep the model's expanded form.

The dtype rule, in one place (`Materialized.widens`): on CPU a short block over a 16-bit cache attends in
f32, because PyTorch's CPU SDPA at one query row is 3-4x slower over bf16 K/V than converting them and
running its f32 kernel (`benchmarks/cpu_decode.py --overhead`), and f32 is the more exact. A block of any
length over an f16 cache does too on a processor without f16 arithmetic (no AVX-512 FP16 / AMX-FP16), where
PyTorch's CPU SDPA emulates f16 (a prefill's attention several times slower than in f32: docs/real-model.md,
"Prefill"). The native kernel widens the cache as it reads it; the
PyTorch implementations read K/V upcast once by their storage layer (`storage_kv`). Triton reads the cache's
dtype itself. Elsewhere attention runs in the cache's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import cpu_attention, triton_decode_fits, triton_decode_step
from ..kernels.reference import factored
from ..model.attention import SHORT_QUERY, Attention, ReferenceAttention
from ..model.fusion import KVSources
from ..model.mla import ExpandedAttention
from .precision import native_f16

# Query blocks up to this length take the factored / absorbed form (measured by
# `benchmarks/attention_paths_cpu.py`; figures in docs/results.md).
FACTORED_MAX_QUERY = SHORT_QUERY


@dataclass(frozen=True)
class LayerFacts:
    """What decides an attention layer's implementation, fixed by the plan and the shapes (read by
    `fusedkv.engine.selection` and by the native step's coverage check, `native_step.unsupported`)."""

    weighted: bool  # carries fusion weights: the factored form pays off only then
    triton_fits: bool  # the Triton decode kernel takes its sources
    native_fits: bool  # the native CPU kernel takes its sources

    @classmethod
    def of(cls, attn: Attention, plan) -> LayerFacts:
        kv = attn.layer
        if kv.stores:
            k_count = v_count = 1
            mixed = False
        else:
            k_count, v_count = len(kv.k_sources), len(kv.v_sources)
            # The kernels read every source of a side with one stride: sources from one kind of cache.
            mixed = len({plan.layers[i].attention_type for i in kv.sources}) > 1
        return cls(kv.weighted,
                   not kv.scalar_weighted and triton_decode_fits(attn.head_dim, k_count, v_count),
                   not kv.scalar_weighted and not mixed and cpu_attention.fits(
                       attn.head_dim, attn.num_heads, attn.num_kv_heads, k_count, v_count))


def _causal_mask(t: int, s: int, device) -> torch.Tensor:
    """SDPA's causal flag spelled out, for the implementations that take a mask only: [T, S] bool."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)


def f32_block_dtypes(cpu: bool) -> frozenset:
    """The 16-bit cache dtypes that blocks of every length attend over in f32 (the module docstring's rule):
    on CPU, f16 where the processor has no f16 arithmetic."""
    return frozenset({torch.float16}) if cpu and not native_f16() else frozenset()


class Materialized(ReferenceAttention):
    """Fused K/V, then SDPA (causal flag or boolean mask; GQA without copies): the model's own computation,
    with the engine's dtype rule for CPU blocks over a 16-bit cache (`widens`)."""

    def __init__(self, scale: float, gqa: bool, f32_short: bool, f32_blocks: frozenset = frozenset()):
        super().__init__(scale, gqa)
        self.f32_short = f32_short  # CPU: a short block over a 16-bit cache attends in f32
        self.f32_blocks = f32_blocks  # and a block of any length over a cache of these dtypes

    def widens(self, t: int, kv_dtype: torch.dtype) -> bool:
        return self.f32_short and (t <= SHORT_QUERY or kv_dtype in self.f32_blocks)

    def storage_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if k.dtype != q.dtype and self.widens(q.shape[2], k.dtype):  # upcast once, here, not in every reader
            return k.to(q.dtype), v.to(q.dtype)
        return k, v


class Factored(Materialized):
    """The factored form for query blocks up to `max_query` rows, `Materialized` above."""

    def __init__(self, scale: float, gqa: bool, f32_short: bool, f32_blocks: frozenset = frozenset(),
                 max_query: float = FACTORED_MAX_QUERY):
        super().__init__(scale, gqa, f32_short, f32_blocks)
        self.max_query = max_query

    def attend(self, q, sources: KVSources, mask, causal: bool) -> torch.Tensor:
        t = q.shape[2]
        if t > self.max_query:
            return super().attend(q, sources, mask, causal)
        if causal and mask is None:
            mask = _causal_mask(t, sources.keys[0].shape[2], q.device)
        return factored(q, sources.keys, sources.key_weights, sources.values, sources.value_weights, mask,
                        self.scale)


class NativeOneToken:
    """One query token: the native CPU kernel over the sources as they are (a 16-bit cache widened as read).
    Blocks: the wrapped implementation."""

    def __init__(self, blocks: Materialized):
        self.blocks, self.scale = blocks, blocks.scale

    def storage_kv(self, q, k, v):
        return (k, v) if q.shape[2] == 1 else self.blocks.storage_kv(q, k, v)

    def __call__(self, q, sources: KVSources, mask, causal: bool, kv_start) -> torch.Tensor:
        if q.shape[2] != 1:
            return self.blocks(q, sources, mask, causal, kv_start)
        return cpu_attention.one_token_attention(q, sources.keys, sources.key_weights, sources.values,
                                              sources.value_weights, kv_start(), self.scale)


class TritonOneToken(NativeOneToken):
    """One query token: the Triton flash-decoding kernel, in the cache's dtype. Blocks: the wrapped one."""

    def __call__(self, q, sources: KVSources, mask, causal: bool, kv_start) -> torch.Tensor:
        if q.shape[2] != 1:
            return self.blocks(q, sources, mask, causal, kv_start)
        return triton_decode_step(q[:, :, 0].to(sources.keys[0].dtype), list(sources.keys),
                                  list(sources.key_weights), list(sources.values), list(sources.value_weights),
                                  kv_start=kv_start(), scale=self.scale).unsqueeze(2)


class AbsorbedMLA:
    """MLA with W_UK absorbed into the query and W_UV into the output for query blocks up to `max_query`
    rows; longer blocks use the model's expanded form (`ExpandedAttention`)."""

    def __init__(self, max_query: float = FACTORED_MAX_QUERY):
        self.max_query = max_query
        self.expanded = ExpandedAttention()

    def __call__(self, layer, q_nope, q_rope, sources: KVSources, mask, causal: bool) -> torch.Tensor:
        t = q_nope.shape[2]
        if t > self.max_query:
            return self.expanded(layer, q_nope, q_rope, sources, mask, causal)
        if causal and mask is None:
            mask = _causal_mask(t, sources.values[0].shape[2], q_nope.device)[None, None]
        return absorbed_attention(layer, q_nope, q_rope, sources, mask)


def absorbed_attention(layer, q_nope, q_rope, sources: KVSources, mask) -> torch.Tensor:
    """scores_h = (q_C,h W_UK,h) . c + q_R,h . k_R ;  out_h = W_UV,h (softmax(scores_h) c), summed over
    fusion sources with their weights on the query (scores) and on the output (values). Heads are
    rows of one matmul per source over the shared [S, r] latent: nothing is expanded per head."""
    b, nh, t, _ = q_nope.shape
    rank = layer.kv_lora_rank
    w_uk, w_uv = layer.up_weights()
    # Per-head products as one batched matmul over heads ([H, B*T, .] @ [H, ., .]): broadcasting the
    # [H, d, r] weights over the batch instead would copy them B times.
    q_lat = torch.matmul(q_nope.transpose(0, 1).reshape(nh, b * t, layer.nope_dim), w_uk)
    q_lat = q_lat.view(nh, b, t, rank).transpose(0, 1).reshape(b, nh * t, rank) * layer.scale
    q_rope = (q_rope * layer.scale).reshape(b, nh * t, layer.rope_dim)
    scores = None
    for queries, srcs, weights in ((q_lat, sources.values, sources.value_weights),
                                   (q_rope, sources.keys, sources.key_weights)):
        for src, w in zip(srcs, weights):
            part = torch.matmul(queries if w is None else queries * w, src[:, 0].transpose(-1, -2))
            scores = part if scores is None else scores.add_(part)
    if mask is not None:
        scores = scores.view(b, nh, t, -1).masked_fill(~mask, float("-inf")).view(b, nh * t, -1)
    p = torch.softmax(scores, dim=-1)
    o_lat = None
    for src, w in zip(sources.values, sources.value_weights):
        part = torch.matmul(p, src[:, 0])
        part = part if w is None else part * w
        o_lat = part if o_lat is None else o_lat + part
    o_lat = o_lat.view(b, nh, t, rank).transpose(0, 1).reshape(nh, b * t, rank)
    return torch.matmul(o_lat, w_uv.transpose(-1, -2)).view(nh, b, t, layer.v_dim).transpose(0, 1)
