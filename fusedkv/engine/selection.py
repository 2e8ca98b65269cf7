"""How a model runs, decided once: the one place that selects attention implementations and the native step.

`select_runtime(model, ...)` reads the facts that are fixed before decoding (each layer's sources and
fusion weights from the plan, the model's device and dtype, which kernels are built or importable, the
cache the loop decodes into) and installs one implementation per attention layer (`fusedkv.engine.backends`,
through the model's `use` seam). It is called by `fusedkv.generation.generate`, `fusedkv bench` (through
`generate`) and whoever wants a plain `model(...)` to run the engine's paths; afterwards nothing is checked
per call. A model nobody selected for runs its own reference implementations (transformers' `generate()`,
training, scoring). Moving or casting the model resets the selection (`FusedKVModel._apply`).

Paths (`ATTENTION_PATHS`): "auto" picks per layer (below); "materialized" (the reference), "factored",
"triton" or "native" force one everywhere (the one-token kernels for one-token steps; blocks then use
SDPA), refusing layers a kernel cannot take.

Served by vLLM (`fusedkv.serving`), a reconstruction layer reads its sources' paged caches in place; how
(`PAGED_PATHS`) is `select_paged_attention`'s choice, made once per layer when serving loads the weights.

"auto", per layer: a one-token kernel for decode steps where one runs and takes the layer's sources
(Triton where it runs: CUDA, or its interpreter; else the native CPU kernel where built), the factored
form for short blocks of weighted layers, SDPA for the rest; MLA layers absorb for short blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache import StaticKVCache
from ..kernels import cpu_attention, native, triton_decode_fits, triton_runs_on
from ..model.attention import Attention
from ..model.mla import MLA
from .backends import FACTORED_MAX_QUERY, AbsorbedMLA, Factored, Materialized, NativeOneToken, TritonOneToken
from .native_step import NativeDecodeStep, Unsupported

ATTENTION_PATHS = ("auto", "materialized", "factored", "triton", "native")
# How a vLLM reconstruction layer attends over paged caches: vLLM's own CPU attention op (one K source), the
# native block-table kernel (CPU), the paged Triton kernel for decode rows (GPU), or each sequence's blocks
# gathered into the factored form (`fusedkv.kernels.reference.factored_attention`).
PAGED_PATHS = ("vllm_op", "native", "triton", "gathered")


@dataclass(frozen=True)
class LayerFacts:
    """What decides an attention layer's implementation, fixed by the plan and the shapes."""

    weighted: bool  # carries fusion weights: the factored form pays off only then
    triton_fits: bool  # the Triton decode kernel takes its sources
    native_fits: bool  # the native CPU kernel takes its sources

    @classmethod
    def of(cls, attn: Attention, plan) -> LayerFacts:
        kv = attn.layer
        if kv.stores:
            k_count = v_count = 1
            weighted = scalar = mixed = False
        else:
            k_count, v_count = len(kv.k_sources), len(kv.v_sources)
            weighted = kv.k_fusion != "reuse" or kv.v_fusion != "reuse"
            scalar = "scalar" in (kv.k_fusion, kv.v_fusion)
            # The kernels read every source of a side with one stride: sources from one kind of cache.
            mixed = len({plan.layers[i].attention_type for i in (*kv.k_sources, *kv.v_sources)}) > 1
        return cls(weighted,
                   not scalar and triton_decode_fits(attn.head_dim, k_count, v_count),
                   not scalar and not mixed and cpu_attention.supports(attn.head_dim, attn.num_heads,
                                                                       attn.num_kv_heads, k_count, v_count))


@dataclass(frozen=True)
class Runtime:
    """What `select_runtime` chose: each attention layer's implementation (by class name, for reports and
    tests) and the native decode step, when one covers the model and the cache. As a context manager it
    gives the layers back the implementations they had before (`restore`) on exit, so a selection made for
    one generation does not outlive it (training then sees the model's own implementations)."""

    attention: dict[int, str]
    native_step: NativeDecodeStep | None
    previous: tuple = ()  # (layer, implementation) pairs as they were before

    def restore(self) -> None:
        for attn, implementation in self.previous:
            attn.use(implementation)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def select_runtime(model, path: str = "auto", cache=None, batch: int | None = None,
                   native_step: bool = False) -> Runtime:
    """Install, once, the attention implementation of every layer of `model` (a FusedKV model or its
    decoder), for its current device and dtype; with `native_step`, also build the one-call native decode
    step over `cache` (a `StaticKVCache`, or an empty `fusedkv.quant.KIVICache` that knows its max_len, which the
    step then reserves) for `batch` rows, where it covers them."""
    if path not in ATTENTION_PATHS:
        raise ValueError(f"attention path {path!r}: choose one of {ATTENTION_PATHS}")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    cpu = device.type == "cpu"
    triton = triton_runs_on(device, dtype)
    native_ok = cpu and dtype == torch.float32 and native.available()
    if path == "native" and not native_ok:
        raise ValueError("the native attention path needs an f32 model on CPU with the native kernels built "
                         "(a C compiler; FUSEDKV_NATIVE_KERNELS not 0)")
    decoder = getattr(model, "model", model)
    attention = [layer.self_attn for layer in decoder.layers]
    previous = tuple((attn, attn.attend) for attn in attention)
    # Every layer's implementation first, then install them: a layer a forced path cannot take leaves the
    # model as it was.
    implementations = [_mla_backend(attn, path) if isinstance(attn, MLA) else
                       _attention_backend(attn, LayerFacts.of(attn, model.config.plan), path, cpu, triton, native_ok)
                       for attn in attention]
    chosen = {}
    for attn, implementation in zip(attention, implementations):
        attn.use(implementation)
        chosen[attn.layer.index] = type(attn.attend).__name__
    step = None
    if native_step and path in ("auto", "native"):
        try:  # the step checks, once, that it covers the model and the cache (`native_step.unsupported`)
            if type(cache) is StaticKVCache:
                step = NativeDecodeStep(model, cache.keys, cache.values, batch, cache.window_start, cache.max_len)
            elif getattr(cache, "quantization", None) == "kivi" and cache.get_seq_length() == 0:
                # KIVI read in place (`fusedkv.kernels.cpu_kivi`); the step reserves the cache's buffers
                step = NativeDecodeStep(model, {}, {}, batch, kivi=cache)
        except Unsupported:
            step = None
    return Runtime(chosen, step, previous)


def _attention_backend(attn: Attention, facts: LayerFacts, path: str, cpu: bool, triton: bool, native_ok: bool):
    scale, gqa = attn.scale, attn.num_heads != attn.num_kv_heads
    if attn.softcap:  # soft-capped scores (Gemma 2): only the model's own implementation applies the cap
        if path not in ("auto", "materialized"):
            raise ValueError(f"layer {attn.layer.index + 1} soft-caps its attention scores "
                             f"(attn_logit_softcapping); only the 'materialized' path applies the cap")
        return None
    if path == "materialized":
        return Materialized(scale, gqa, cpu)
    if path == "factored":
        return Factored(scale, gqa, cpu, max_query=float("inf"))
    if path == "triton":
        if not facts.triton_fits:
            raise ValueError(
                f"layer {attn.layer.index + 1}: the Triton decode kernel takes at most 2 K and 2 V sources with "
                f"per-channel (not scalar) weights and a head_dim that is a power of two in [16, 256] "
                f"(head_dim={attn.head_dim}); use the 'factored' or 'materialized' path")
        return TritonOneToken(Materialized(scale, gqa, cpu))
    if path == "native":
        if not facts.native_fits:
            raise ValueError(f"layer {attn.layer.index + 1}: the native CPU decode kernel takes 1-2 K and 1-2 V "
                             "sources with per-channel (not scalar) weights; use the 'factored' or 'materialized' "
                             "path")
        return NativeOneToken(Materialized(scale, gqa, cpu))
    blocks = Factored(scale, gqa, cpu) if facts.weighted else Materialized(scale, gqa, cpu)
    if triton and facts.triton_fits:
        return TritonOneToken(blocks)
    if native_ok and facts.native_fits:
        return NativeOneToken(blocks)
    return blocks


def _mla_backend(attn: MLA, path: str):
    if path in ("triton", "native"):
        raise ValueError(f"attention path {path!r}: MLA layers take 'auto', 'materialized' (expanded) or "
                         "'factored' (absorbed); there is no one-token kernel for MLA")
    if path == "materialized":
        return None  # the model's own expanded form
    return AbsorbedMLA(float("inf") if path == "factored" else FACTORED_MAX_QUERY)


def select_paged_attention(k_sources: Sequence, v_sources: Sequence, *, gpu: bool, head_dim: int,
                           device: torch.device, dtype: torch.dtype, query_dtype: torch.dtype,
                           native_layout: int | None) -> str:
    """How a FusedKV reconstruction layer served by vLLM attends over its sources' paged caches (one of
    `PAGED_PATHS`), chosen once per layer when serving loads the weights (`fusedkv.serving.paged.select_paths`);
    nothing re-checks per call.

    `k_sources` / `v_sources`: the layer's sources as listed (a layer listed twice counts twice); `gpu`: a
    GPU backend (FlashAttention, Triton) rather than the CPU one; `dtype`: the cache's element type;
    `native_layout`: the CPU backend's block layout as the native kernel names it (`native.PAGED_LAYOUTS`: rows,
    key blocks transposed, or AMX-packed bf16), None where the kernel does not read it. GPU: decode rows in the
    paged Triton kernel where it takes the distinct sources and runs on this device and dtype, else gathered
    (prefill chunks are gathered either way). CPU: one K source is vLLM's op; more run in the native kernel where
    it is built and reads the cache, else gathered. Every path takes a sliding window and Gemma 2's soft cap
    (vLLM's op, both kernels and the gathered factored form), so neither decides the path."""
    if gpu:
        kernel = (query_dtype == dtype and triton_runs_on(device, dtype)
                  and triton_decode_fits(head_dim, len(set(k_sources)), len(set(v_sources))))
        return "triton" if kernel else "gathered"
    if len(k_sources) == 1:
        return "vllm_op"
    if native.available() and native.paged_supports(dtype, len(k_sources), len(v_sources), native_layout):
        return "native"
    return "gathered"
